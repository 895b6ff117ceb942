"""Per-tile timeline of the Hopper dense GEMM, from SM clock stamps written by the kernel itself.

  CUTE_DSL_ARCH=sm_90a python benchmarks/tile_trace.py build --out .device/bins/trace   # CPU
  python benchmarks/tile_trace.py run --bins .device/bins/trace --out trace.json        # GPU
  python benchmarks/tile_trace.py report trace.json                                     # anywhere

`build` compiles timing builds (sm90_gemm Config.trace) of the configs below for jnp.matmul's
layouts (bf16, A k-major, B n-major). In them the first thread of each consumer warpgroup
writes the SM clock at fixed points of every tile (see sm90_gemm's `stamp` calls):

- plain epilogue: 0 tile start, 1 first k-tile's WGMMAs issued (its data had arrived),
  3 mainloop done (all WGMMAs retired), 2 tile stored;
- deferred epilogue: 0 tile start, 1 first `defer` k-tiles issued, 2 previous tile stored,
  3 mainloop done.

`run` checks each build's product against jnp.matmul on random data, then takes the stamps of
one call after warm-up; `report` prints per shape and config the median cycles per tile of
each phase, the mainloop's cycles per k-tile (the tensor cores need 1024 for a 128 x 256 x 64
step on both warpgroups), the gap between tiles, and the span from the first stamp to the last.
The kernel time of a timing build is within a few stamps of the plain build's: only one
thread per warpgroup writes, once per phase.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import parse_shapes, probe_cli  # noqa: E402  (benchmarks/common.py, beside this script)
from jax_cute.kernels import build, sm90_gemm  # noqa: E402
from jax_cute.kernels.gemm_spec import GemmSpec  # noqa: E402

BF = "bfloat16"
SPEC = GemmSpec(BF, BF, BF, "k", "n", "n")
C = sm90_gemm.Config
CONFIGS = {"e32": C(trace=True), "e64": C(epi_n=64, trace=True), "df2": C(defer=2, trace=True), "df3": C(defer=3, trace=True),
           "w32": C(whole_c=True, trace=True), "w64": C(epi_n=64, whole_c=True, trace=True),
           "w64df1": C(epi_n=64, whole_c=True, defer=1, trace=True), "w64df2": C(epi_n=64, whole_c=True, defer=2, trace=True),
           "e64st3": C(epi_n=64, stages=3, trace=True), "w32p": C(whole_c=True, trace=True)}
SHAPES = [(16384, 1536, 1024), (2048, 2048, 2048), (16384, 2048, 2048), (8192, 8192, 8192)]


def cmd_build(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    index = []
    for name, cfg in CONFIGS.items():
        t = time.time()
        binary = build.compile_launcher(sm90_gemm.launcher(SPEC, cfg), sm90_gemm.signature(SPEC, cfg),
                                        arch=sm90_gemm.ARCH, name="trace_" + name)
        build.save_binary(binary, os.path.join(out, name))
        index.append({"name": name, "config": cfg.__dict__})
        print(f"built {name} {cfg.key()} {time.time() - t:.1f}s", flush=True)
    json.dump(index, open(os.path.join(out, "index.json"), "w"), indent=1)


def _call(binary, cfg, m: int, n: int, k: int):
    import jax
    import jax.numpy as jnp
    from jax_cute.launch import kernel_call

    words = sm90_gemm.trace_words(cfg)

    def f(a, b):
        res = kernel_call(binary, inputs={"a": (a, (m, k, 1), (k, 1, m * k)), "b": (b, (n, k, 1), (1, n, n * k))},
                          outputs={"c": (jax.ShapeDtypeStruct((m, n), jnp.bfloat16), (m, n, 1), (n, 1, m * n)),
                                   "trace": (jax.ShapeDtypeStruct((words,), jnp.int32), (words,), (1,))},
                          zeroed=["trace"])
        return res["c"], res["trace"]
    return jax.jit(f)


def cmd_run(bins: str, out: str, shapes: list[tuple[int, int, int]], warmup: int = 2) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    index = json.load(open(os.path.join(bins, "index.json")))
    records = []
    for (m, n, k) in shapes:
        ka, kb = jax.random.split(jax.random.PRNGKey(m + 7 * n + 13 * k))
        a = jax.random.normal(ka, (m, k), jnp.bfloat16)
        b = jax.random.normal(kb, (k, n), jnp.bfloat16)
        want = jnp.matmul(a, b, preferred_element_type=jnp.float32)
        for e in index:
            cfg = C(**e["config"])
            f = _call(build.load_binary(os.path.join(bins, e["name"])), cfg, m, n, k)
            for _ in range(warmup + 1):     # the stamps of the last call are kept
                c, trace = jax.block_until_ready(f(a, b))
            err = float(jnp.max(jnp.abs(c.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))
            t = np.asarray(trace).reshape(-1, 2, sm90_gemm.TRACE_TILES, sm90_gemm.TRACE_WORDS)
            records.append({"shape": [m, n, k], "config": e["name"], "key": cfg.key(), "rel_err": err,
                            "k_tiles": -(-k // sm90_gemm.tile_k(BF)),
                            "stamps": t.astype(np.uint32).tolist()})
            print(f"{m}x{n}x{k} {e['name']}: rel err {err:.2e}", flush=True)
    json.dump({"device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "commit": os.environ.get("JAX_CUTE_COMMIT", "unknown"), "records": records}, open(out, "w"))


def _d(a: int, b: int) -> int:
    return (b - a) & 0xFFFFFFFF       # 32-bit SM clock, may wrap


def phases(rec: dict) -> dict[str, float]:
    """Median cycles per tile of each phase over every warpgroup that ran tiles."""
    deferred = ".df" in rec["key"]
    got: dict[str, list[int]] = {"first_wait": [], "mainloop": [], "epilogue": [], "gap": [], "span": [],
                                 "tiles": []}
    for slot in rec["stamps"]:
        for wg in slot:
            start = wg[0][0]
            tiles = [r for r in wg[1:] if r[0] or r[1] or r[2] or r[3]]
            if not tiles:
                continue
            body = tiles[:-1] if deferred else tiles     # deferred: the last record is the final store
            got["tiles"].append(len(body))
            for i, r in enumerate(body):
                got["first_wait"].append(_d(r[0], r[1]))
                if deferred:
                    got["mainloop"].append(_d(r[2], r[3]) + _d(r[0], r[1]))    # WGMMA issue phases
                    if i:
                        got["epilogue"].append(_d(r[1], r[2]))
                else:
                    got["mainloop"].append(_d(r[0], r[3]))
                    got["epilogue"].append(_d(r[3], r[2]))
                if i:
                    prev = body[i - 1]
                    got["gap"].append(_d(prev[3] if deferred else prev[2], r[0]))
            last = tiles[-1][2]      # both layouts: word 2 of the last record is its final store
            got["span"].append(_d(start, last))
    return {k: (statistics.median(v) if v else 0.0) for k, v in got.items()}


def cmd_report(path: str) -> None:
    data = json.load(open(path))
    print(f"# tile_trace {data['device']} {data['date']} commit {data['commit']}; median cycles per tile")
    print(f"{'shape':18s} {'config':28s} {'err':>8s} {'tiles':>5s} {'1st wait':>8s} {'mainloop':>8s} "
          f"{'/k-tile':>7s} {'epilogue':>8s} {'gap':>6s} {'span':>8s}")
    for rec in data["records"]:
        p = phases(rec)
        m, n, k = rec["shape"]
        print(f"{m}x{n}x{k:<8d} {rec['key']:28s} {rec['rel_err']:8.1e} {p['tiles']:5.0f} {p['first_wait']:8.0f} "
              f"{p['mainloop']:8.0f} {p['mainloop'] / rec['k_tiles']:7.0f} {p['epilogue']:8.0f} {p['gap']:6.0f} "
              f"{p['span']:8.0f}")


def main() -> None:
    p, _ = probe_cli(__doc__.splitlines()[0], rounds=2, build=True)   # rounds: warm-up calls
    a = p.parse_args()
    if a.cmd == "build":
        cmd_build(a.out)
    elif a.cmd == "run":
        cmd_run(a.bins, a.out or "tile_trace.json", parse_shapes(a.shapes, SHAPES), a.rounds)
    else:
        cmd_report(a.path)


if __name__ == "__main__":
    main()
