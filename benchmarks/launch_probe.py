"""How jax_cute.matmul is launched and configured, timed as the suite times: graph or stream, PDL, config.

  CUTE_DSL_ARCH=sm_90a python benchmarks/launch_probe.py build --out DIR [--variants V;V..]  # any machine
  python benchmarks/launch_probe.py run --bins DIR [--variants V;V..] [--out F.json]      # GPU machine
  python benchmarks/launch_probe.py report F.json

A variant is ``graph``, ``stream`` or ``stream+pdl``, optionally followed by ``:field=value,..``
overriding fields of the heuristic's sm90_gemm.Config (e.g. ``graph:tile_n=128``).

XLA records an FFI custom call into a command buffer by stream capture (a child graph, where
PDL cannot act) and captures it again when a buffer address changed since the last recording;
on an H200 that happened on ~5% of the suite's calls (session 8), so host dispatch is not what
limits it. The stream target (``jax_cute.config`` switch ``command_buffer`` off) is
launched on XLA's stream instead, and its dense Hopper kernels take programmatic dependent
launch (PDL): the next kernel's CTAs start under the previous one's tail. This probe times, as
the suite does (CHAIN products per jit, rotated interleaved rounds, random bf16), XLA against
jax_cute.matmul recorded (``graph``), launched on the stream without PDL (``stream``) and with
it (``stream+pdl``); per implementation it also records the host's dispatch time per call and
how many times our handler launched per call (8 per call of 8 products: captured or launched
every run; 0: a recorded graph was replayed). Then the README's MLP training step, large and
small, the same ways. `build` lowers every case for sm_90a into DIR/cache (no GPU needed), so
the GPU machine only loads kernels.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_cute  # noqa: E402
from common import Impl, case_table, case_tables, measure, parse_shapes, probe_cli, write_result  # noqa: E402
from jax_cute.primitives import gemm_route  # noqa: E402

SHAPES = [(2048, 2048, 2048), (16384, 1536, 1024), (16384, 2048, 2048), (4096, 4096, 4096),
          (512, 8192, 8192), (4096, 14336, 4096), (4096, 4096, 14336), (8192, 8192, 8192)]
CHAIN = 8
MLP_SIZES = ("small", "large")
VARIANTS = ("graph", "stream", "stream+pdl")
# launch -> (command_buffer, pdl on the stream)
_LAUNCHES = {"graph": (True, False), "stream": (False, False), "stream+pdl": (False, True)}


def parse_variant(text: str) -> tuple[bool, bool, dict]:
    """(command_buffer, pdl, Config field overrides) of a variant (see the module notes)."""
    launch, _, fields = text.partition(":")
    if launch not in _LAUNCHES:
        raise ValueError(f"variant {text!r}: launch must be one of {sorted(_LAUNCHES)}")
    over = {}
    for item in filter(None, fields.split(",")):
        key, _, value = item.partition("=")
        over[key] = value == "true" if value in ("true", "false") else int(value) if value.isdigit() else value
    return (*_LAUNCHES[launch], over)


@contextlib.contextmanager
def mode(variant: str):
    """Lower jax_cute calls as ``variant`` says: launch target, PDL and config overrides."""
    graph, pdl, over = parse_variant(variant)
    saved = gemm_route.launch_mode
    gemm_route.launch_mode = lambda cfg: dataclasses.replace(saved(cfg) if pdl else cfg, **over)
    try:
        with jax_cute.config.override(command_buffer=graph):
            yield
    finally:
        gemm_route.launch_mode = saved


def mlp_case(size: str, variants):
    """(impls, make_args, flops, label) of the README's MLP training step at ``size``."""
    import mlp_training as mlp

    batch, d_model, d_ff, _, lr = mlp.SIZES[size]
    params = mlp.init(jax.random.key(0), d_model, d_ff)
    x, y = mlp.data(jax.random.key(1), batch, d_model, n_batches=1)
    impls = [Impl("xla", mlp.make_step(jnp.matmul, jnp.bfloat16, lr))]
    impls += [Impl(f"jax_cute {m}", mlp.make_step(jax_cute.matmul, jnp.bfloat16, lr),
                   context=lambda m=m: mode(m)) for m in variants]
    mk = lambda s: (params, jax.random.normal(jax.random.key(s), x[0].shape, jnp.float32), y[0])  # noqa: E731
    return impls, mk, 6 * 2.0 * batch * d_model * d_ff, f"MLP train step {batch}x{d_model}x{d_ff}"


def gemm_impls(variants) -> list[Impl]:
    # a function of its own per mode: jit must not hand one mode's trace to another
    return [Impl("xla", jnp.matmul)] + [Impl(f"jax_cute {m}", lambda a, b: jax_cute.matmul(a, b),
                                             context=lambda m=m: mode(m)) for m in variants]


def cmd_build(out: str, shapes, variants, mlp_sizes) -> None:
    """Lower every case for sm_90a here, filling DIR/cache with the kernels they take."""
    jax_cute.config.set(target_arch="sm_90a", strict=True, cache_dir=os.path.join(out, "cache"))
    bf = jnp.bfloat16
    for (m, n, k) in shapes:
        for name in variants:
            with mode(name):   # a new function per mode, or jit reuses the first lowering
                jax.jit(lambda a, b: jax_cute.matmul(a, b)).trace(jax.ShapeDtypeStruct((m, k), bf),
                                               jax.ShapeDtypeStruct((k, n), bf)).lower(lowering_platforms=("cuda",))
        print(f"built {m}x{n}x{k}", flush=True)
    for size in mlp_sizes:
        impls, mk, _, label = mlp_case(size, variants)
        args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), mk(0))
        for im in impls[1:]:
            with im.context():
                jax.jit(im.fn).trace(*args).lower(lowering_platforms=("cuda",))
        print(f"built {label}", flush=True)


def launches_per_call(im: Impl, args: tuple, calls: int = 20) -> float:
    """How often our handler launched per call, after warm-up (see the module notes)."""
    from jax_cute import runtime

    f = jax.jit(im.fn)
    with im.context():
        jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    before = runtime.stats()["launches"]
    out = None
    for _ in range(calls):
        out = f(*args)
    jax.block_until_ready(out)
    return (runtime.stats()["launches"] - before) / calls


def cmd_run(bins: str, out: str, shapes, rounds: int, variants, mlp_sizes) -> None:
    # strict: a fallback to XLA raises instead of timing XLA twice
    jax_cute.config.set(strict=True, cache_dir=os.path.join(bins, "cache"))
    dev = jax.devices()[0]
    rec = {"probe": "launch", "variants": list(variants), "device": dev.device_kind, "jax": jax.__version__, "chain": CHAIN,
           "commit": os.environ.get("JAX_CUTE_COMMIT", "unknown"), "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "records": []}
    dt = jnp.bfloat16
    cases = []
    for (m, n, k) in shapes:
        mk = lambda s, m=m, n=n, k=k: tuple(jax.random.normal(key, sh, dt) for key, sh in  # noqa: E731
                                            zip(jax.random.split(jax.random.key(s)), [(m, k), (k, n)]))
        cases.append((gemm_impls(variants), mk, 2.0 * m * n * k, f"{m}x{n}x{k}", CHAIN))
    for size in mlp_sizes:
        cases.append((*mlp_case(size, variants), 1))
    for impls, mk, flops, label, chain in cases:
        recs = measure("launch", "launch", label, impls, mk, flops, rounds=rounds, chain=chain,
                       check=chain > 1)
        args = tuple(mk(1 + j) for j in range(chain)) if chain > 1 else mk(1)
        for im, r in zip(impls, recs):
            if im.context is not None and not r["error"]:
                call = (lambda *sets, fn=im.fn: [fn(*a) for a in sets]) if chain > 1 else im.fn
                r["launches_per_call"] = launches_per_call(Impl(im.name, call, context=im.context), args)
        rec["records"] += recs
        print(report_case(recs), flush=True)
    write_result(out, rec)


def report_case(recs: list[dict]) -> str:
    return case_table(recs, extra_header="  dispatch µs/call  wall µs/call  launches/call", extra=lambda r: (
        f" {r['dispatch_ms_per_call'] * 1e3:17.1f} {r['ms'] * 1e3 * r['chain']:13.1f}"
        f" {r.get('launches_per_call', float('nan')):14.1f}"))


def report(rec: dict) -> list[str]:
    """One table per case of a ``run`` output (also read by benchmarks/run.py)."""
    return case_tables(rec["records"], report_case)


def cmd_report(path: str) -> None:
    rec = json.load(open(path))
    print(f"{rec['device']}, {rec['date']}, jax {rec['jax']}, commit {rec['commit']}, XLA_FLAGS {rec['xla_flags'] or '(none)'}")
    print("\n".join(report(rec)))


def main() -> None:
    p, r = probe_cli(__doc__.splitlines()[0], rounds=7, build=True)
    build = p.subcommands["build"]
    for sp in (build, r):
        sp.add_argument("--variants", default=";".join(VARIANTS), help="';'-separated, see the module notes")
        sp.add_argument("--mlp", default=",".join(MLP_SIZES), help="MLP step sizes to time ('' for none)")
        if sp is build:
            sp.add_argument("--shapes", default="")
    args = p.parse_args()
    variants = args.variants.split(";") if args.cmd != "report" else ()
    mlp_sizes = [s for s in args.mlp.split(",") if s] if args.cmd != "report" else ()
    if args.cmd == "build":
        cmd_build(args.out, parse_shapes(args.shapes, SHAPES), variants, mlp_sizes)
    elif args.cmd == "run":
        cmd_run(args.bins, args.out, parse_shapes(args.shapes, SHAPES), args.rounds, variants, mlp_sizes)
    else:
        cmd_report(args.path)


if __name__ == "__main__":
    main()
