"""Skewed vs uniform group sizes, timed against each other in one interleaved measurement.

The ragged suite times the uniform and the Dirichlet(0.3) case of a shape in separate
measurements, minutes apart, so their ratio also carries the GPU's drift between them. Here the
two sizes are two "implementations" of one case (jax_cute.ragged_dot forward on the same
operands), so every round times both, in rotated order:

    python benchmarks/skew_ratio.py --rounds 15 --out skew.json
"""

import argparse
import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax_cute  # noqa: E402
from bench_ragged import SHAPES, SMOKE_SHAPES, group_sizes  # noqa: E402
from common import Impl, measure  # noqa: E402


def run(shapes, rounds: int) -> list[dict]:
    rows = []
    for g, m, k, n in shapes:
        sizes = {d: jnp.asarray(group_sizes(g, m, d)) for d in ("uniform", "dirichlet0.3")}
        impls = [Impl("jax_cute", lambda lhs, rhs, gs=gs: jax_cute.ragged_dot(lhs, rhs, gs), d)
                 for d, gs in sizes.items()]

        def mk(seed, g=g, m=m, k=k, n=n):
            k1, k2 = jax.random.split(jax.random.key(seed))
            return jax.random.normal(k1, (m, k), jnp.bfloat16), jax.random.normal(k2, (g, k, n), jnp.bfloat16)

        recs = measure("skew", "skew", f"fwd G={g} M={m} K={k} N={n}", impls, mk, 2.0 * m * k * n,
                       rounds=rounds, check=False)
        by = {r["config"]: r for r in recs}
        u, s = by["uniform"], by["dirichlet0.3"]
        ratio = None if u["error"] or s["error"] else u["ms"] / s["ms"]
        # per round too: both sizes were timed in every round
        per_round = [a / b for a, b in zip(u.get("rounds_ms") or [], s.get("rounds_ms") or [])]
        rows.append({"case": f"G={g} M={m} K={k} N={n}", "uniform_tflops": u["tflops"],
                     "skewed_tflops": s["tflops"], "ratio": ratio,
                     "ratio_rounds": sorted(per_round), "kernel": u.get("kernel")})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out")
    a = p.parse_args()
    rows = run(SMOKE_SHAPES if a.smoke else SHAPES, 2 if a.smoke else a.rounds)
    dev = jax.devices()[0]
    doc = {"device": getattr(dev, "device_kind", str(dev)), "commit": os.environ.get("JAX_CUTE_COMMIT"),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "rounds": 2 if a.smoke else a.rounds, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
