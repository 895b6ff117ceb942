"""Does computing C^T = B^T A^T (the operands' roles exchanged) run faster than C = A B?

  CUTE_DSL_ARCH=sm_90a python benchmarks/swap_probe.py build --out DIR    # any machine
  python benchmarks/swap_probe.py run --bins DIR [--out FILE.json]       # GPU machine

jnp.matmul(a[M,K], b[K,N]) is, in the kernel's frame, an M x N tile grid over a K-major A and
an N-major B. The same product read as C^T[N,M] = B^T A^T gives the kernel an N x M tile grid
over an M-major A' (b itself) and a K-major B' (a itself), writing an M-major C' (c itself):
no data moves, only the layouts change. cuBLAS, column-major, always runs in that second
frame; its 128x160 pingpong tile there is 160 rows of a (K-major, 128-byte swizzle atoms)
by 128 columns of b, where our 128x160 tile in the first frame takes b 160 wide N-major
(64-byte atoms). Each shape times XLA and every built config, in both frames, in short
interleaved windows (the suite's regime) and in sustained 1 s windows with the board's energy
counter (energy_probe's regime), CHAIN independent products per call.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jax_cute.kernels import build, sm90_gemm  # noqa: E402
from jax_cute.kernels.gemm_spec import GemmSpec  # noqa: E402

BF = "bfloat16"
C = sm90_gemm.Config
SHAPES = [(4096, 14336, 4096), (16384, 2048, 2048), (8192, 8192, 8192), (16384, 1536, 1024),
          (4096, 4096, 14336), (4096, 4096, 4096)]
CHAIN = 8
SHORT_ROUNDS, LONG_ROUNDS = 7, 3   # interleaved ~60 ms windows; rotated 1 s windows
# (frame, config): "ab" is jnp.matmul's frame, "ba" the swapped one
CONFIGS = [
    ("ab", C(epi_n=64)),
    ("ab", C(128, 160, pingpong=True)),
    ("ba", C(epi_n=64)),
    ("ba", C(128, 256, 1, 2, epi_n=64)),
    ("ba", C(128, 160, pingpong=True)),
    ("ba", C(128, 160, 1, 2, pingpong=True)),
    ("ba", C(128, 160, raster="n", pingpong=True)),
    ("ba", C(128, 128, pingpong=True)),
]


def frame_spec(frame: str) -> GemmSpec:
    return GemmSpec(BF, BF, BF, "k", "n", "n") if frame == "ab" else GemmSpec(BF, BF, BF, "m", "k", "m")


def name_of(frame: str, cfg) -> str:
    return f"{frame}_{cfg.key().replace('.', '_')}"


def cmd_build(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    index = []
    for frame, cfg in CONFIGS:
        spec = frame_spec(frame)
        name = name_of(frame, cfg)
        binary = build.compile_launcher(sm90_gemm.launcher(spec, cfg), sm90_gemm.signature(spec, cfg),
                                        arch=sm90_gemm.ARCH, name=name)
        build.save_binary(binary, os.path.join(out, name))
        index.append({"name": name, "frame": frame, "config": dataclasses.asdict(cfg)})
        print("built", name, flush=True)
    with open(os.path.join(out, "swap_index.json"), "w") as f:
        json.dump(index, f, indent=1)


def frame_call(binary, frame: str, cfg, m: int, n: int, k: int):
    """A jitted (a[m,k], b[k,n]) -> c[m,n] through ``binary`` in the given frame."""
    from devcheck_sm90_gemm import _make_call

    spec = frame_spec(frame)
    if frame == "ab":
        return _make_call(binary, spec, cfg, m, n, k, 1, ((m, k, 1), (k, 1, m * k)), ((n, k, 1), (1, n, n * k)),
                          (m, n), (m, n, 1), (n, 1, m * n))
    # C^T[n, m] = sum_k b[k, n] a[m, k]: A' = b as (n, k) n-fastest, B' = a as (m, k) k-fastest,
    # C' = c as (n, m) n-fastest
    call = _make_call(binary, spec, cfg, n, m, k, 1, ((n, k, 1), (1, n, n * k)), ((m, k, 1), (k, 1, m * k)),
                      (m, n), (n, m, 1), (1, n, m * n))
    return lambda a, b: call(b, a)


def cmd_run(bins: str, out: str, shapes, long_rounds: int) -> None:
    import jax
    import jax.numpy as jnp
    from common import round_order
    from devcheck_sm90_gemm import _time_interleaved, chained_operands
    from energy_probe import Nvml, window

    nvml = Nvml()
    index = json.load(open(os.path.join(bins, "swap_index.json")))
    rec = {"probe": "swap", "device": jax.devices()[0].device_kind, "commit": os.environ.get("JAX_CUTE_COMMIT", "unknown"),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "chain": CHAIN, "cases": []}
    print(rec["device"], rec["date"], flush=True)
    for (m, n, k) in shapes:
        pairs = chained_operands(m, n, k, CHAIN, m + 3 * n + 7 * k)
        want = [jnp.matmul(x, y).astype(jnp.float32) for x, y in pairs[:2]]
        impls = {"xla": jax.jit(lambda *ps: [jnp.matmul(x, y) for x, y in ps])}
        for e in index:
            cfg = C(**e["config"])
            g = frame_call(build.load_binary(os.path.join(bins, e["name"])), e["frame"], cfg, m, n, k)
            for (x, y), w in zip(pairs[:2], want):   # every element, against XLA's product
                rel = float(jnp.max(jnp.abs(g(x, y).astype(jnp.float32) - w)) / jnp.max(jnp.abs(w)))
                if not rel < 1e-2:
                    raise SystemExit(f"FAIL {e['name']} {m}x{n}x{k}: rel {rel:.3g}")
            impls[e["name"]] = jax.jit(lambda *ps, g=g: [g(x, y) for x, y in ps])
        flop = 2.0 * m * n * k * CHAIN
        labels = list(impls)
        short = _time_interleaved([impls[x] for x in labels], tuple(pairs), rounds=SHORT_ROUNDS)
        case = {"shape": [m, n, k], "short_tflops": {x: flop / t / 1e12 for x, t in zip(labels, short)}, "long": {}}
        runs = {x: [] for x in labels}
        for r in range(long_rounds):
            for x in round_order(labels, r):
                w = window(impls[x], tuple(pairs), nvml, 1.0)
                w["tflops"] = flop * w["calls"] / w["s"] / 1e12
                w["watts"] = w["mj"] / 1e3 / w["s"]
                runs[x].append(w)
        case["long"] = runs
        rec["cases"].append(case)
        print(report(case), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(rec, f, indent=1)


def report(case: dict) -> str:
    m, n, k = case["shape"]
    xs, xl = case["short_tflops"]["xla"], statistics.median(w["tflops"] for w in case["long"]["xla"])
    lines = [f"{m}x{n}x{k}  (short: {SHORT_ROUNDS} interleaved ~60 ms windows; long: 1 s windows; TFLOP/s and ratio to XLA)",
             f"  {'impl':40s} {'short':>7s} {'ratio':>6s} {'long':>7s} {'ratio':>6s} {'W':>5s} {'MHz':>5s}"]
    for x, s in case["short_tflops"].items():
        ws = case["long"][x]
        med = lambda key: statistics.median(w[key] for w in ws)  # noqa: E731
        lines.append(f"  {x:40s} {s:7.1f} {s / xs:6.3f} {med('tflops'):7.1f} {med('tflops') / xl:6.3f} "
                     f"{med('watts'):5.0f} {med('mhz'):5.0f}")
    return "\n".join(lines)


def main() -> None:
    from common import parse_shapes, probe_cli

    p, _ = probe_cli(__doc__.splitlines()[0], LONG_ROUNDS, build=True)
    a = p.parse_args()
    if a.cmd == "build":
        cmd_build(a.out)
    elif a.cmd == "run":
        cmd_run(a.bins, a.out, parse_shapes(a.shapes, SHAPES), a.rounds)
    else:
        rec = json.load(open(a.path))
        print(f"device {rec['device']}, date {rec['date']}, commit {rec['commit']}")
        for c in rec["cases"]:
            print(report(c))


if __name__ == "__main__":
    main()
