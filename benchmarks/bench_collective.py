"""Collective suite: tensor-parallel products with their all-gather / reduce-scatter, on all visible devices.

Rows, interleaved in one process on fresh random data (common.measure):
- jax_cute: the ring of ``JAX_CUTE_COLLECTIVE_MATMUL=bidirectional`` (primitives/collective.py),
  its chunk GEMMs leaving ``JAX_CUTE_RING_SMS`` SMs free (the switch's value in this process);
  jax_cute_sms<R>: the same ring leaving R SMs free, for each R in ``BENCH_COLLECTIVE_RING_SMS``
  (default 0: GEMMs on every SM); jax_cute_stream: the ring with ``JAX_CUTE_COMMAND_BUFFER=0``
  (our launches on XLA's stream, outside its CUDA graphs); jax_cute_unidirectional: the one-way ring;
- jax_cute_no_ring: the switch off: XLA's all-gather then our GEMM, or our GEMM then XLA's
  reduce-scatter;
- xla: ``jnp.dot`` with the same shardings (XLA's default: NCCL collective, then cuBLAS);
- pallas: Pallas' Mosaic GPU ``all_gather_lhs_matmul`` (all-gather cases, Hopper only);
- local_gemm: the same per-device GEMMs on inputs already where they are needed (no
  communication): the floor the rings aim at (issue 45: within 1.10x at 2 GPUs).

XLA's flags hold for a whole process, so each flag set of ``BENCH_COLLECTIVE_FLAG_SETS`` (default
``windowed``; names in FLAG_SETS) runs in a subprocess of its own, started before this process
takes the GPUs, its flags added to this process's XLA_FLAGS, its rows in the table
``collective_<name>`` (compare rows within a table, not across tables):
- windowed: XLA's windowed einsum (xla_windowed) against the ring and the floor;
- lhs: XLA's latency-hiding scheduler on, its only scheduler that places async collectives to
  overlap compute (every row but Pallas');
- memcpy_p2p: collective-permutes between local GPUs as peer copies on copy engines, no NCCL
  kernels (``--xla_gpu_use_memcpy_local_p2p=true``); lhs_memcpy_p2p: both;
- lhs_overlap2: the scheduler allowed two collectives in flight (both directions of a ring; XLA
  may still keep two permutes over the same devices apart);
- lhs_windowed: the windowed einsum with the scheduler on.
Every record holds the process's XLA_FLAGS (``xla_flags``), ring_sms, and NCCL_* and
CUDA_DEVICE_MAX_CONNECTIONS settings (``env``);
the jax_cute row also how its compiled program schedules the permutes against our GEMMs
(``schedule``: see schedule()).

    python benchmarks/bench_collective.py --records out.json     (or: run.py --suite collective)
    BENCH_COLLECTIVE_CASES=doc python benchmarks/bench_collective.py ...   (cases whose name has a word)
    BENCH_COLLECTIVE_RING_SMS=0,8,32 BENCH_COLLECTIVE_FLAG_SETS=windowed,memcpy_p2p python ...
    BENCH_COLLECTIVE_FLAG_SETS= python ...                       (this process only, its own XLA_FLAGS)
    XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true python ... --flag-set lhs   (that set only)
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax_cute  # noqa: E402
from common import Impl, best_of, measure, suite_main  # noqa: E402

AXIS = "x"


@dataclasses.dataclass(frozen=True)
class FlagSet:
    """XLA flags for a subprocess, and the rows it times (``rename``: a row's name there)."""

    flags: str
    rows: tuple[str, ...]
    rename: tuple[tuple[str, str], ...] = ()


WINDOWED = "--xla_gpu_multi_streamed_windowed_einsum=true --xla_gpu_threshold_for_windowed_einsum_mib=0"
# XLA's GPU scheduler overlaps async collectives with compute only when the latency-hiding
# scheduler runs (off by default; gpu_hlo_schedule.cc's IsLHSEnabled)
LHS = "--xla_gpu_enable_latency_hiding_scheduler=true"
MEMCPY = "--xla_gpu_use_memcpy_local_p2p=true"   # local collective-permutes as peer copies
OVERLAP2 = "--xla_gpu_experimental_parallel_collective_overlap_limit=2"   # both ring directions in flight
RING_ROWS = ("jax_cute", "jax_cute_sms*", "jax_cute_stream", "jax_cute_unidirectional")
ALL_BUT_PALLAS = (*RING_ROWS, "jax_cute_no_ring", "xla", "local_gemm")
_WINDOWED_ROWS = ("jax_cute", "local_gemm", "xla")
FLAG_SETS = {
    "windowed": FlagSet(WINDOWED, _WINDOWED_ROWS, (("xla", "xla_windowed"),)),
    "lhs": FlagSet(LHS, ALL_BUT_PALLAS),
    "memcpy_p2p": FlagSet(MEMCPY, ALL_BUT_PALLAS),
    "lhs_memcpy_p2p": FlagSet(f"{LHS} {MEMCPY}", ALL_BUT_PALLAS),
    "lhs_overlap2": FlagSet(f"{LHS} {OVERLAP2}", ALL_BUT_PALLAS),
    "lhs_windowed": FlagSet(f"{LHS} {WINDOWED}", _WINDOWED_ROWS, (("xla", "xla_windowed"),)),
}


def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((jax.device_count(),), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


def _ring(mode, free_sms: int | None = None, command_buffer: bool | None = None) -> Callable:
    """The context a row lowers in: the ring switch, the SMs its GEMMs leave free and whether our
    launches go into XLA's CUDA graphs (None: the switch as this process has it)."""
    return lambda: jax_cute.config.override(collective_matmul=mode, ring_sms=free_sms,
                                            command_buffer=command_buffer)


def _budgets() -> list[int]:
    """``BENCH_COLLECTIVE_RING_SMS``: the SM budgets timed as rows of their own (jax_cute_sms<R>)."""
    raw = os.environ.get("BENCH_COLLECTIVE_RING_SMS", "0")
    return [int(w) for w in raw.split(",") if w.strip()]


def _ring_rows(fn: Callable) -> list[Impl]:
    """The ring's rows for a case computed by ``fn``: the switch's budget, each timed budget, our
    GEMMs launched on the stream (outside XLA's CUDA graphs, with programmatic dependent launch),
    one-way."""
    return [Impl("jax_cute", fn, context=_ring("bidirectional")),
            *(Impl(f"jax_cute_sms{r}", fn, context=_ring("bidirectional", r)) for r in _budgets()),
            Impl("jax_cute_stream", fn, context=_ring("bidirectional", command_buffer=False)),
            Impl("jax_cute_unidirectional", fn, context=_ring("unidirectional"))]


def _normal(mesh, shapes_specs, dtype, replicated_copy: bool) -> Callable[[int], tuple]:
    """``make_args``: fresh standard-normal arrays made on the devices with their shardings,
    weights (all but the first) scaled by 1/sqrt(fan-in) so 16-bit products stay O(1); with
    ``replicated_copy`` the first array once more, replicated (the floor's input)."""
    makers = [jax.jit(lambda key, shape=shape, scale=(1.0 if i == 0 else shape[0] ** -0.5):
                      (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype),
                      out_shardings=NamedSharding(mesh, P(*spec))) for i, (shape, spec) in enumerate(shapes_specs)]
    replicate = jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, P()))

    def make(seed: int) -> tuple:
        keys = jax.random.split(jax.random.key(seed), len(makers))
        arrays = tuple(mk(k) for mk, k in zip(makers, keys))
        return arrays + (replicate(arrays[0]),) if replicated_copy else arrays
    return make


def _on(mesh, *spec):
    return NamedSharding(mesh, P(*spec))


def _constrain(mesh, x, *spec):
    return jax.lax.with_sharding_constraint(x, _on(mesh, *spec))


def _pallas_impls(mesh) -> list[Impl]:
    """Pallas' all-gather matmul (lhs rows gathered, rhs columns sharded), a few of its tuning configs."""
    try:
        from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu as cm
    except Exception as e:  # noqa: BLE001 - a missing rival is recorded, not fatal
        msg = f"{type(e).__name__}: {e}"

        def missing(*args):
            raise RuntimeError(f"Pallas collective_matmul_mgpu unavailable: {msg}")
        return [Impl("pallas", missing, "import")]
    D = cm.MatmulDimension
    out = []
    for tm, tn, minor, width in [(128, 128, D.N, 8), (128, 128, D.M, 8), (128, 256, D.N, 4), (256, 128, D.M, 4)]:
        cfg = cm.TuningConfig(tile_m=tm, tile_n=tn, tile_k=64, max_concurrent_steps=4, grid_minor_dim=minor,
                              grid_tile_width=width, wg_dimension=D.N)

        def fn(a, b, a_rep, cfg=cfg):
            body = functools.partial(cm.all_gather_lhs_matmul, axis_name=AXIS, config=cfg, dtype=a.dtype)
            return jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS, None), P(None, AXIS)), out_specs=P(None, AXIS),
                                 check_vma=False)(a, b)
        out.append(Impl("pallas", fn, f"tm{tm} tn{tn} tk64 s4 minor={minor.name} w{width}"))
    return out


# -- cases ------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Case:
    args: list  # (global shape, PartitionSpec parts) of each argument
    out: NamedSharding  # the result's sharding (forward cases)
    impls: list[Impl]
    flops: float  # per device
    dtype: object
    replicated_copy: bool = False  # the first argument once more, replicated: the floor's input
    floor_exact: bool = False  # the floor's output is the product (else unreduced partial sums)
    grad: bool = False  # the result is the gradients (no out sharding, no value check)


def all_gather_case(mesh, m_shard: int, k: int, n_shard: int, dtype, pallas: bool):
    """A (M, K) rows sharded times B (K, N) columns sharded -> (M, N) columns sharded."""
    n = mesh.size
    m = n * m_shard
    args = [((m, k), (AXIS, None)), ((k, n * n_shard), (None, AXIS))]
    out = _on(mesh, None, AXIS)
    ring = lambda a, b, a_rep: jax_cute.matmul(a, b)  # noqa: E731
    impls = [
        *_ring_rows(ring),
        Impl("jax_cute_no_ring", lambda a, b, a_rep: jax_cute.matmul(_constrain(mesh, a, None, None), b),
             context=_ring(False)),
        Impl("xla", lambda a, b, a_rep: jnp.dot(a, b)),
        Impl("local_gemm", lambda a, b, a_rep: jax_cute.matmul(a_rep, b), context=_ring(False)),
        *(_pallas_impls(mesh) if pallas else []),
    ]
    return Case(args, out, impls, 2.0 * m * k * n_shard, dtype, replicated_copy=True, floor_exact=True)


def reduce_scatter_case(mesh, m: int, k_shard: int, n_out: int, dtype):
    """A (M, K) and B (K, N) both sharded along K -> (M, N) rows sharded."""
    n = mesh.size
    k = n * k_shard
    args = [((m, k), (None, AXIS)), ((k, n_out), (AXIS, None))]
    out = _on(mesh, AXIS, None)
    # each device's partial sums, unreduced (out_specs P() claims them replicated: no collective)
    local = jax.shard_map(jax_cute.matmul, mesh=mesh, in_specs=(P(None, AXIS), P(AXIS, None)), out_specs=P(),
                          check_vma=False)
    impls = [
        *_ring_rows(lambda a, b: jax_cute.matmul(a, b)),
        Impl("jax_cute_no_ring", lambda a, b: jax_cute.matmul(a, b), context=_ring(False)),
        Impl("xla", lambda a, b: jnp.dot(a, b)),
        Impl("local_gemm", local, context=_ring(False)),
    ]
    return Case(args, out, impls, 2.0 * m * k_shard * n_out, dtype)


def _swiglu_mlp(mesh, mm, x, wg, wu, wd, gather_first: bool = False):
    """Llama's MLP, tensor parallel: gate and up column-parallel, down row-parallel; tokens
    sequence-parallel in and out, the hidden activation (tokens, hidden over the axis)."""
    if gather_first:  # XLA's all-gather of the tokens, then the local products
        x = _constrain(mesh, x, None, None)
    h = jax.nn.silu(mm(x, wg)) * mm(x, wu)
    return mm(_constrain(mesh, h, None, AXIS), wd)


def mlp_case(mesh, tokens: int, d: int, hidden: int, dtype, grad: bool):
    n = mesh.size
    args = [((tokens, d), (AXIS, None)), ((d, hidden), (None, AXIS)), ((d, hidden), (None, AXIS)),
            ((hidden, d), (AXIS, None))]
    out = _on(mesh, AXIS, None)

    def step(mm, gather_first=False):
        f = lambda x, wg, wu, wd, *x_rep: _swiglu_mlp(mesh, mm, x, wg, wu, wd, gather_first)  # noqa: E731
        if not grad:
            return f
        loss = lambda *a: jnp.sum(_constrain(mesh, f(*a), AXIS, None).astype(jnp.float32) ** 2)  # noqa: E731
        return lambda *a: jax.grad(loss, argnums=(0, 1, 2, 3))(*a)

    impls = [
        *_ring_rows(step(jax_cute.matmul)),
        Impl("jax_cute_no_ring", step(jax_cute.matmul, gather_first=True), context=_ring(False)),
        Impl("xla", step(jnp.dot)),
    ]
    if not grad:
        def local(x, wg, wu, wd, x_rep):  # every device's three GEMMs on tokens already gathered
            mm = jax_cute.matmul
            body = lambda x, wg, wu, wd: mm(jax.nn.silu(mm(x, wg)) * mm(x, wu), wd)  # noqa: E731
            return jax.shard_map(body, mesh=mesh, in_specs=(P(), P(None, AXIS), P(None, AXIS), P(AXIS, None)),
                                 out_specs=P(), check_vma=False)(x_rep, wg, wu, wd)
        impls.append(Impl("local_gemm", local, context=_ring(False)))
    return Case(args, out, impls, (3 if grad else 1) * 3 * 2.0 * tokens * d * hidden / n, dtype, grad=grad,
                replicated_copy=not grad)


def cases(args: argparse.Namespace, mesh, on_gpu: bool) -> list[tuple[str, Case]]:
    """The suite's cases; ``BENCH_COLLECTIVE_CASES=up,down`` keeps those whose name contains one of
    the words (to split a run)."""
    keep = [w.strip().lower() for w in os.environ.get("BENCH_COLLECTIVE_CASES", "").split(",") if w.strip()]
    return [(name, case) for name, case in _cases(args, mesh, on_gpu)
            if not keep or any(w in name.lower() for w in keep)]


def _cases(args: argparse.Namespace, mesh, on_gpu: bool) -> list[tuple[str, Case]]:
    n = mesh.size
    if args.smoke:
        f16, bf16 = jnp.float16, jnp.bfloat16
        return [(f"all-gather GEMM f16 {n}x64x128 @ 128x128/dev", all_gather_case(mesh, 64, 128, 128, f16, on_gpu)),
                (f"GEMM reduce-scatter f16 {n * 64}x128/dev x 128", reduce_scatter_case(mesh, n * 64, 128, 128, f16)),
                ("Llama MLP fwd bf16 64 tokens 64->96", mlp_case(mesh, 64, 64, 96, bf16, grad=False)),
                ("Llama MLP fwd+bwd bf16 64 tokens 64->96", mlp_case(mesh, 64, 64, 96, bf16, grad=True))]
    f16, bf16 = jnp.float16, jnp.bfloat16
    return [
        # Pallas' collective_matmul doc shape: M = 1024 per shard, K = 4096, N = 4096 per shard
        (f"doc shape: all-gather GEMM f16 ({n}x1024)x4096 @ 4096x4096/dev",
         all_gather_case(mesh, 1024, 4096, 4096, f16, on_gpu)),
        (f"doc shape: GEMM reduce-scatter f16 {n * 1024}x(4096/dev) @ 4096",
         reduce_scatter_case(mesh, n * 1024, 4096, 4096, f16)),
        # Llama-3-8B MLP: 8192 tokens, 4096 -> 14336 -> 4096
        ("Llama up: all-gather GEMM bf16 8192x4096 @ 4096x14336",
         all_gather_case(mesh, 8192 // n, 4096, 14336 // n, bf16, on_gpu)),
        ("Llama down: GEMM reduce-scatter bf16 8192x14336 @ 14336x4096",
         reduce_scatter_case(mesh, 8192, 14336 // n, 4096, bf16)),
        ("Llama MLP fwd bf16 8192 tokens 4096->14336->4096", mlp_case(mesh, 8192, 4096, 14336, bf16, grad=False)),
        ("Llama MLP fwd+bwd bf16 8192 tokens 4096->14336->4096", mlp_case(mesh, 8192, 4096, 14336, bf16, grad=True)),
    ]


def _rows(impls: list[Impl], flag_set: str | None) -> list[Impl]:
    """The rows a process times: all of them, or a flag set's (renamed as it says)."""
    if flag_set is None:
        return impls
    fs = FLAG_SETS[flag_set]
    rename = dict(fs.rename)
    return [dataclasses.replace(im, name=rename.get(im.name, im.name)) for im in impls
            if any(fnmatch.fnmatchcase(im.name, row) for row in fs.rows)]


def _transfer_env() -> dict[str, str]:
    """The environment that shapes the transfers: NCCL's settings, and CUDA's hardware queue
    count (1 puts every stream's kernels in one queue, in launch order)."""
    return {k: v for k, v in os.environ.items() if k.startswith("NCCL_") or k == "CUDA_DEVICE_MAX_CONNECTIONS"}


def _run_cases(args: argparse.Namespace, flag_set: str | None) -> list[dict]:
    mesh = _mesh()
    on_gpu = jax.default_backend() == "gpu"
    rounds = 2 if args.smoke else args.rounds
    table = "collective" if flag_set is None else f"collective_{flag_set}"
    meta = {"devices": mesh.size, "xla_flags": os.environ.get("XLA_FLAGS", ""), "ring_sms": jax_cute.config.ring_sms(),
            "env": _transfer_env()}
    recs: list[dict] = []
    if mesh.size < 2:
        print("collective suite: one device visible; the products have nothing to communicate", file=sys.stderr)
    for name, case in cases(args, mesh, on_gpu and flag_set is None):
        impls = _rows(case.impls, flag_set)
        if not case.grad:  # (the floor's unreduced sums stay where they are)
            impls = [im if im.name == "local_gemm" and not case.floor_exact else
                     dataclasses.replace(im, fn=jax.jit(im.fn, out_shardings=case.out)) for im in impls]
        make = _normal(mesh, case.args, case.dtype, case.replicated_copy)
        chain = 1 if args.smoke or "Llama" in name else 4
        # --smoke: one call per timed window, so one program is in flight at a time (XLA:CPU's
        # in-process collectives can deadlock on a 2-core machine with several queued)
        got = measure("collective", table, name, impls, make, case.flops, rounds=rounds, chain=chain,
                      check=not case.grad, target_s=1e-6 if args.smoke else 0.05,
                      meta={**meta, "dtype": jnp.dtype(case.dtype).name})
        for r in got:
            if r["impl"] == "local_gemm" and not case.floor_exact:
                r.pop("max_rel_err", None)  # unreduced partial sums: the floor's time, not a result
            if r["impl"] == "jax_cute" and not r["error"]:
                # the kernel is lowered when the partitioner runs the rules: look in the compiled program
                ring = next(im for im in impls if im.name == "jax_cute")
                r.update(_compiled(ring.fn, make(0), ring.context))
        recs += got
    return best_of(recs, "pallas")


def _compiled(fn: Callable, args: tuple, context) -> dict:
    """What the compiled program of a ring row holds: our kernel (None: unknown) and how its
    collective-permutes are scheduled against our GEMMs (``schedule``)."""
    try:
        with context():
            text = jax.jit(fn).lower(*args).compile().as_text()
    except Exception:  # noqa: BLE001 - reported as unknown
        return {"kernel": None}
    return {"kernel": KERNEL in text, "schedule": schedule(text)}


KERNEL = "jax_cute_launch"   # our custom call's target (runtime.TARGET_NAME, STREAM_TARGET_NAME)
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)")   # a header: unindented, ends with "{"
_DEFINED = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_CALLED = re.compile(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_NAME = re.compile(r"%?([\w.\-]+)")


def _computations(text: str) -> dict[str, list[str]]:
    """The instruction lines of each computation of an HLO module's text, in schedule order."""
    comps: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line[:1].strip() and line.rstrip().endswith("{") and not line.startswith("HloModule"):
            current = comps.setdefault(_COMPUTATION.match(line).group(1), [])
        elif line.strip() == "}":
            current = None
        elif current is not None:
            current.append(line)
    return comps


def schedule(text: str) -> dict[str, int]:
    """How a compiled (scheduled) program orders its collective-permutes against our GEMMs:
    ``permutes`` in all, ``async`` (XLA marks a permute is_sync when it will not overlap
    anything), and ``over_gemm``: those with one of our kernel launches (directly or inside a
    called computation, such as a command buffer) scheduled between start and done."""
    comps = _computations(text)
    gemm = {name for name, lines in comps.items() if any(KERNEL in line for line in lines)}
    grew = True
    while grew:  # computations that call one holding our kernel hold it too
        more = {name for name, lines in comps.items()
                if any(c in gemm for line in lines for c in _CALLED.findall(line))} - gemm
        gemm |= more
        grew = bool(more)
    counts = {"permutes": 0, "async": 0, "over_gemm": 0}
    for lines in comps.values():
        open_: dict[str, bool] = {}   # start name -> a GEMM was scheduled since
        for line in lines:
            name = _DEFINED.match(line)
            if "collective-permute-start(" in line and name:
                open_[name.group(1)] = False
                counts["permutes"] += 1
                counts["async"] += '"is_sync":true' not in line.replace(" ", "")
            elif "collective-permute-done(" in line:
                operands = set(_NAME.findall(line.split("collective-permute-done(", 1)[1]))
                for start in operands & set(open_):
                    counts["over_gemm"] += open_.pop(start)
            elif KERNEL in line or any(c in gemm for c in _CALLED.findall(line)):
                open_ = dict.fromkeys(open_, True)
    return counts


def _flag_sets() -> list[str]:
    """``BENCH_COLLECTIVE_FLAG_SETS``: the flag sets to run in subprocesses (default: windowed)."""
    names = [w.strip() for w in os.environ.get("BENCH_COLLECTIVE_FLAG_SETS", "windowed").split(",") if w.strip()]
    unknown = sorted(set(names) - set(FLAG_SETS))
    if unknown:
        raise SystemExit(f"BENCH_COLLECTIVE_FLAG_SETS: unknown {', '.join(unknown)} (known: {', '.join(FLAG_SETS)})")
    return names


def _flagged(args: argparse.Namespace, flag_set: str) -> list[dict]:
    """A flag set's rows, from a subprocess started with its XLA flags added to this process's."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        path = tmp.name
    flags = (os.environ.get("XLA_FLAGS", "") + " " + FLAG_SETS[flag_set].flags).strip()
    cmd = [sys.executable, os.path.abspath(__file__), "--flag-set", flag_set, "--records", path,
           "--rounds", str(args.rounds)]
    proc = subprocess.run(cmd + (["--smoke"] if args.smoke else []), env={**os.environ, "XLA_FLAGS": flags})
    try:
        with open(path) as f:
            return json.load(f)["records"]
    except (OSError, ValueError, KeyError) as e:
        return [{"suite": "collective", "table": f"collective_{flag_set}", "case": "all", "impl": "all",
                 "ms": None, "tflops": None, "xla_flags": flags,
                 "error": f"{flag_set} subprocess exit {proc.returncode}: {e}"}]
    finally:
        os.unlink(path)


def _check_flags(flag_set: str) -> None:
    """A flag set's process runs with its flags in XLA_FLAGS (jax read them at import)."""
    have = os.environ.get("XLA_FLAGS", "").split()
    missing = [f for f in FLAG_SETS[flag_set].flags.split() if f not in have]
    if missing:
        raise SystemExit(f"--flag-set {flag_set}: XLA_FLAGS lacks {' '.join(missing)}")


def run(args: argparse.Namespace) -> list[dict]:
    if args.flag_set:
        _check_flags(args.flag_set)
        return _run_cases(args, args.flag_set)
    # The flag sets' processes run first, before this one takes the GPUs' memory (XLA
    # preallocates most of it on first use).
    flagged = [r for fs in _flag_sets() for r in _flagged(args, fs)]
    return _run_cases(args, None) + flagged


def _flag_set_argument() -> str | None:
    """``--flag-set NAME`` (this process is that flag set's subprocess), taken off ``sys.argv``:
    suite_main's parser knows only the shared options."""
    if "--flag-set" not in sys.argv:
        return None
    i = sys.argv.index("--flag-set")
    name = sys.argv[i + 1]
    del sys.argv[i:i + 2]
    return name


if __name__ == "__main__":
    flag_set = _flag_set_argument()
    suite_main(lambda a: run(argparse.Namespace(**vars(a), flag_set=flag_set)), __doc__.splitlines()[0])
