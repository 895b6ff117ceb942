"""First-call latency of jax_cute.matmul in a fresh process, cold (empty cache) or warm (disk).

Each measurement runs in a new Python process so nothing is cached in memory. Reported per
phase: lowering (where jax_cute compiles a kernel, or loads it from disk), XLA compilation, and
the first execution (where our FFI handler loads the module onto the device); the same phases
for jnp.matmul give XLA's own baseline. The jax_cute overhead per kernel is the difference.

    python benchmarks/bench_first_call.py --cache DIR [--cold] [--shape 4096x4096x4096]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import textwrap

_PROBE = textwrap.dedent("""
    import json, sys, time
    import jax, jax.numpy as jnp, numpy as np
    import jax_cute
    from jax_cute.cache import CACHE
    m, n, k = (int(x) for x in sys.argv[1].split("x"))
    jax_cute.config.set(strict=True)
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16)
    jax.block_until_ready((a, b))
    def phases(f):
        t = time.perf_counter(); low = jax.jit(f).lower(a, b); t1 = time.perf_counter()
        exe = low.compile(); t2 = time.perf_counter()
        exe(a, b).block_until_ready(); t3 = time.perf_counter()
        return {"lower_s": t1 - t, "compile_s": t2 - t1, "first_run_s": t3 - t2}
    xla = phases(lambda x, y: jnp.matmul(x, y))
    ours = phases(lambda x, y: jax_cute.matmul(x, y))
    print(json.dumps({"shape": sys.argv[1], "device": jax.devices()[0].device_kind, "xla": xla, "jax_cute": ours,
                      "compiles": CACHE.stats.compiles, "disk_hits": CACHE.stats.disk_hits,
                      "cutlass_imported": "cutlass" in sys.modules}))
""")


def measure(shape: str, cache: str) -> dict:
    env = dict(os.environ, JAX_CUTE_CACHE_DIR=cache)
    out = subprocess.run([sys.executable, "-c", _PROBE, shape], env=env, capture_output=True, text=True,
                         timeout=600)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cache", required=True)
    p.add_argument("--cold", action="store_true", help="empty the cache first")
    p.add_argument("--shape", default="4096x4096x4096")
    p.add_argument("--out")
    args = p.parse_args()
    if args.cold:
        import shutil

        shutil.rmtree(args.cache, ignore_errors=True)
    rec = measure(args.shape, args.cache)
    rec["mode"] = "cold" if args.cold else "warm"
    rec["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    ours, xla = rec["jax_cute"], rec["xla"]
    extra = sum(ours.values()) - sum(xla.values())
    rec["overhead_s"] = extra
    print(f"{rec['mode']:5s} {args.shape}: jax_cute lower {ours['lower_s']*1e3:.0f} ms, compile "
          f"{ours['compile_s']*1e3:.0f} ms, first run {ours['first_run_s']*1e3:.0f} ms | XLA lower "
          f"{xla['lower_s']*1e3:.0f} ms, compile {xla['compile_s']*1e3:.0f} ms, first run "
          f"{xla['first_run_s']*1e3:.0f} ms | overhead {extra*1e3:.0f} ms for 1 kernel | compiles "
          f"{rec['compiles']} disk hits {rec['disk_hits']} DSL compiler imported {rec['cutlass_imported']}")
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
