"""The CuTe DSL's own Hopper GEMM example, timed beside jax_cute.matmul and XLA, on two kinds of data.

  CUTE_DSL_ARCH=sm_90a python benchmarks/example_probe.py build --out DIR --example PATH  # any machine
  python benchmarks/example_probe.py run --bins DIR --example PATH [--out F.json]       # GPU machine
  python benchmarks/example_probe.py report F.json

Issue 4 quotes the CUTLASS CuTe DSL example ``dense_gemm_persistent.py`` (hopper) at 822-872
TFLOP/s on an H200. That example fills its operands with integers drawn from [-2, 2), whose
products toggle few bits, and at the H200's power cap the data sets the clock. This probe runs
that kernel (loaded from PATH, a copy of the example from NVIDIA/cutlass that stays outside this
repository) through ``jax_cute.cute_call``, so it is launched exactly as our own kernel is, and
times it as the suite does (CHAIN products per jit, interleaved rounds, each starting with another
implementation; by default the rest of a round runs in a seeded random order, see
common.round_order) against
``jnp.matmul`` and ``jax_cute.matmul``, once on random normal data (the suite's) and once on the
example's integers. Every output is compared with XLA's on the same inputs (``max_rel_err``).
``build`` lowers every case for sm_90a into DIR/cache, so the GPU machine only loads kernels.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import importlib.util
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_cute  # noqa: E402

try:  # the DSL compiles the example: needed by build (and by run, to key the cache), not by report
    import cutlass  # noqa: E402
    import cutlass.cute as cute  # noqa: E402
except ImportError:
    cutlass = cute = None
from common import Impl, case_table, case_tables, measure, parse_shapes, probe_cli, write_result  # noqa: E402
from launch_probe import mode, parse_variant  # noqa: E402

SHAPES = [(8192, 8192, 8192), (4096, 14336, 4096), (2048, 2048, 2048), (16384, 2048, 2048)]
CHAIN = 8
NUM_SMS = 132
# (tile M x N, cluster M x N) of the example to time: its widest tile, B or A multicast
EXAMPLE_CONFIGS = (((128, 256), (2, 1)), ((128, 256), (1, 2)))
DATA = ("normal", "int")


def _load_example(path: str):
    spec = importlib.util.spec_from_file_location("cutlass_example_dense_gemm_persistent", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@functools.lru_cache(maxsize=None)
def example_matmul(path: str, tile: tuple[int, int], cluster: tuple[int, int]):
    """``x @ w`` (x: (M, K), w: (K, N), row-major as jnp.matmul takes them) on the example kernel."""
    mod = _load_example(path)
    gemm = mod.HopperWgmmaGemmPersistentKernel(cutlass.Float32, tile, cluster, swizzle_size=1, raster_along_m=True)
    clusters = NUM_SMS // (cluster[0] * cluster[1])   # every 2-CTA cluster fits on an H100/H200

    @cute.jit
    def launch(stream, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor):
        gemm(a, b, c, clusters, stream)

    digest = hashlib.sha256(open(path, "rb").read()).hexdigest()[:16]
    key = f"{digest}:{tile[0]}x{tile[1]}:c{cluster[0]}x{cluster[1]}:{clusters}"

    def reference(a, b):
        return (jnp.matmul(a[..., 0], b[..., 0], preferred_element_type=jnp.float32).astype(a.dtype)[..., None],)

    def matmul(x, w):
        (m, _), n = x.shape, w.shape[1]
        # The example takes (M, K, L) A, (N, K, L) B and (M, N, L) C: a unit batch mode and B seen
        # through its transpose (N-major), both free views of the row-major buffers.
        call = jax_cute.cute_call(launch, out_shape=jax.ShapeDtypeStruct((m, n, 1), x.dtype),
                                  in_layouts=[None, (1, 0, 2)], key=key, reference=reference,
                                  name="cutlass_example_gemm")
        return call(x[..., None], w[..., None])[..., 0]

    return matmul


def impls(path: str, variants=("graph",)) -> list[Impl]:
    """XLA, jax_cute.matmul per launch variant (benchmarks/launch_probe.py's syntax: ``graph`` is
    the heuristic's pick, ``graph:epi_n=64`` overrides a Config field) and the example's configs."""
    out = [Impl("xla", jnp.matmul)]
    # a function of its own per variant: jit must not hand one variant's trace to another
    out += [Impl("jax_cute", lambda a, b: jax_cute.matmul(a, b), config=None if v == "graph" else v,
                 context=lambda v=v: mode(v)) for v in variants]
    for tile, cluster in EXAMPLE_CONFIGS:
        out.append(Impl("cutlass_example", example_matmul(path, tile, cluster),
                        config=f"{tile[0]}x{tile[1]} c{cluster[0]}x{cluster[1]}"))
    return out


def kernel_config(variant: str, m: int, n: int, k: int) -> str:
    """Config key of the sm90_gemm kernel a jax_cute variant runs on jnp.matmul's layouts."""
    import dataclasses

    from jax_cute.kernels import sm90_gemm
    from jax_cute.kernels.gemm_spec import GemmSpec

    pick = sm90_gemm.heuristic(GemmSpec("bfloat16", "bfloat16", "bfloat16", "k", "n", "n"), m, n, k, 1)
    return dataclasses.replace(pick, **parse_variant(variant)[2]).key()


def make_inputs(data: str, m: int, n: int, k: int, dtype=jnp.bfloat16):
    """Seed -> (a, b): random normal, or the example's own integers in [-2, 2)."""
    def make(seed):
        ka, kb = jax.random.split(jax.random.key(seed))
        if data == "normal":
            return jax.random.normal(ka, (m, k), dtype), jax.random.normal(kb, (k, n), dtype)
        return (jax.random.randint(ka, (m, k), -2, 2).astype(dtype), jax.random.randint(kb, (k, n), -2, 2).astype(dtype))
    return make


def cmd_build(out: str, path: str, shapes, variants) -> None:
    jax_cute.config.set(target_arch="sm_90a", strict=True, cache_dir=os.path.join(out, "cache"))
    bf = jnp.bfloat16
    for (m, n, k) in shapes:
        for im in impls(path, variants)[1:]:
            with (im.context or contextlib.nullcontext)():
                jax.jit(im.fn).trace(jax.ShapeDtypeStruct((m, k), bf),
                                     jax.ShapeDtypeStruct((k, n), bf)).lower(lowering_platforms=("cuda",))
        print(f"built {m}x{n}x{k}", flush=True)


def cmd_run(bins: str, path: str, out: str, shapes, rounds: int, data_kinds, variants, shuffle: bool = True) -> None:
    jax_cute.config.set(strict=True, cache_dir=os.path.join(bins, "cache"))
    dev = jax.devices()[0]
    rec = {"probe": "example", "order": "shuffle" if shuffle else "rotate", "device": dev.device_kind, "jax": jax.__version__, "chain": CHAIN,
           "commit": os.environ.get("JAX_CUTE_COMMIT", "unknown"),
           "example_sha256": hashlib.sha256(open(path, "rb").read()).hexdigest(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "records": []}
    for data in data_kinds:
        for (m, n, k) in shapes:
            recs = measure("example", data, f"{m}x{n}x{k} {data}", impls(path, variants), make_inputs(data, m, n, k),
                           2.0 * m * n * k, rounds=rounds, chain=CHAIN, shuffle=shuffle)
            for r in recs:   # the kernel each jax_cute variant ran, by its config key
                if r["impl"] == "jax_cute":
                    r["kernel_config"] = kernel_config(r["config"] or "graph", m, n, k)
            rec["records"] += recs
            print(report_case(recs), flush=True)
    write_result(out, rec)


def report_case(recs: list[dict]) -> str:
    return case_table(recs, width=32)


def report(rec: dict) -> list[str]:
    """One table per case of a ``run`` output (also read by benchmarks/run.py)."""
    return case_tables(rec["records"], report_case)


def main() -> None:
    p, r = probe_cli(__doc__.splitlines()[0], rounds=7, build=True)
    build = p.subcommands["build"]
    for sp in (build, r):
        sp.add_argument("--example", required=True, help="path of NVIDIA/cutlass's "
                        "examples/python/CuTeDSL/cute/hopper/kernel/dense_gemm/dense_gemm_persistent.py")
        sp.add_argument("--variants", default="graph", help="';'-separated jax_cute launch variants")
    build.add_argument("--shapes", default="")
    r.add_argument("--data", default=",".join(DATA), help="data kinds to time: normal, int")
    r.add_argument("--order", choices=("shuffle", "rotate"), default="shuffle",
                   help="each round after its first implementation: seeded random order, or the suite's rotation")
    args = p.parse_args()
    if args.cmd == "build":
        cmd_build(args.out, args.example, parse_shapes(args.shapes, SHAPES), args.variants.split(";"))
    elif args.cmd == "run":
        cmd_run(args.bins, args.example, args.out, parse_shapes(args.shapes, SHAPES), args.rounds,
                [d for d in args.data.split(",") if d], args.variants.split(";"), args.order == "shuffle")
    else:
        rec = json.load(open(args.path))
        print(f"{rec['device']}, {rec['date']}, jax {rec['jax']}, commit {rec['commit']}")
        print("\n".join(report(rec)))


if __name__ == "__main__":
    main()
