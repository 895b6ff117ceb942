"""Collective matmul: a tensor-parallel product's all-gather or reduce-scatter run inside its GEMMs.

Where the partitioning rules (``sharding.py``) would wait for a whole collective and then run one
local GEMM, a ring splits the collective into chunks and interleaves them with per-chunk GEMMs:
each step sends one chunk to a neighbour on the ring's mesh axes (``lax.ppermute``) while the GEMM
of the chunk that already arrived runs, so XLA's scheduler can hide the transfers behind the
products. Each chunk GEMM is the primitive's own per-shard computation (``_Call.local``: our
kernel on the GPU, the reference on the CPU) over chunk layouts.

Three rings, each chosen from the shardings the partitioner hands the call (``choose``):
- GATHER (all-gather -> GEMM): one operand's free mode f is sharded over mesh axes X, the other
  operand's free mode g over the same X (sequence-parallel activations times a column-parallel
  weight). Instead of gathering the weight, the activation's chunks travel: at step s a device
  computes the rows of chunk (idx - s) (and (idx + s) on a bidirectional ring) and writes them
  with ``dynamic_update_slice`` into its slice of the preallocated result: f full, g over X.
- GATHER_K: the same, but f is the contraction K (the weight gradient ``x^T @ dh`` of a
  sequence-parallel product): the travelling K chunk meets the matching K slice of the other
  operand and the partial products are summed (in float32 for 16-bit outputs).
- SCATTER (GEMM -> reduce-scatter): both operands shard K over X and the result is requested
  with a free mode sharded over X (a row-parallel weight). At step s a device computes the
  partial product of output chunk (idx + s + 1) (the rows of its operand for that chunk), adds
  the accumulator received from its neighbour and passes it on; after n steps each device
  holds its own chunk, summed over the ring.

SM budget: our Hopper GEMM is persistent, one CTA per SM holding nearly all of its registers and
shared memory, so NCCL's send/receive kernels (which run on SMs too) find none free while a chunk
GEMM runs: they wait for it, or take SMs its grid was sized for and leave its last CTAs to run
late. A GEMM the ring issues while a transfer may be in flight therefore leaves
``config.ring_sms()`` SMs free (``Ring.free_sms``, ``GemmRequest.free_sms``): its persistent grid
fills the rest. The GEMMs with no transfer of the ring in flight (the gather rings' last step,
which needs the last chunk to have arrived; the scatter ring's first partial product, issued
before any transfer) use every SM.

Gradients need nothing more: the transposes of our GEMM are GEMM primitives with layouts, so the
backward of GATHER is SCATTER (and GATHER_K for the weight), and the partitioner brings them
here with their shardings. Mesh axes outside the ring keep the ordinary plan (a data axis stays
local, a contraction also sharded outside the ring ends in a ``psum``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jax_cute import config
from jax_cute.primitives import sharding
from jax_cute.primitives.sharding import Operand, Plan, Problem, Spec

GATHER, GATHER_K, SCATTER = "gather", "gather_k", "scatter"
FREE = {"a": "m", "b": "n"}  # each input's free (uncontracted) mode


@dataclasses.dataclass(frozen=True, eq=False)
class Ring:
    """One call's ring: which factor is chunked over which mesh axes, and the plans whose local
    layouts are one step's GEMM (``chunk``) and the call's result buffer (``out``)."""

    kind: str
    problem: Problem
    axes: tuple[str, ...]  # the ring's mesh axes (X)
    size: int  # devices on the ring
    factor: str  # the factor split into chunks (f)
    operand: str  # GATHER*: the operand that travels; SCATTER: the one sliced per chunk
    chunk: Plan
    out: Plan
    specs: tuple[PartitionSpec, ...]  # the inputs' shardings
    result_spec: PartitionSpec
    reduce: tuple[str, ...]  # mesh axes summed over after the ring (K sharded outside it)
    directions: tuple[int, int]  # hops one way round the ring and the other ((n - 1, 0): one-way)
    free_sms: int = 0  # SMs a chunk GEMM leaves free while a transfer may be in flight

    def partition(self, call, mesh):
        """``custom_partitioning``'s answer for the call: mesh, per-shard body, result and input
        shardings (the partitioner reshards the inputs to those)."""
        return (mesh, _body(self, call, dict(mesh.shape)), NamedSharding(mesh, self.result_spec),
                tuple(NamedSharding(mesh, s) for s in self.specs))


@dataclasses.dataclass(frozen=True)
class Planner:
    """``sharding._Call.rings``: the ring for a call's shardings, or None for the ordinary plan."""

    mode: str  # config.RINGS
    free_sms: int  # config.ring_sms()

    def __call__(self, p: Problem, mesh_shape: Mapping[str, int], specs: Sequence[Spec],
                 result: Spec | None) -> Ring | None:
        ring = choose(p, mesh_shape, specs, result, self.mode)
        return ring and dataclasses.replace(ring, free_sms=self.free_sms)


def planner() -> Planner | None:
    """The planner under the current ``collective_matmul`` and ``ring_sms`` switches (asked when
    a call lowers)."""
    mode = config.collective_matmul()
    return Planner(mode, config.ring_sms()) if mode else None


# -- choosing a ring -------------------------------------------------------------------------------

def _axis_of(o: Operand, factor: str) -> int | None:
    """The buffer axis of ``o`` whose slowest factor is ``factor`` (the one its sharding splits)."""
    return next((i for i, fs in enumerate(o.axes) if fs and fs[0] == factor), None)


def _sharded(o: Operand, spec: Spec) -> Iterator[tuple[str, tuple[str, ...]]]:
    """(slowest factor, mesh axes) of each sharded buffer axis of ``o``."""
    for fs, axes in zip(o.axes, spec):
        if fs and axes:
            yield fs[0], tuple(axes)


def _strip(spec: Spec | None, ring: tuple[str, ...]) -> Spec | None:
    return None if spec is None else tuple(tuple(a for a in axes if a not in ring) for axes in spec)


def _count(mesh_shape: Mapping[str, int], axes: Sequence[str]) -> int:
    return math.prod(mesh_shape[a] for a in axes)


def _directions(mode: str, n: int) -> tuple[int, int]:
    # Bidirectional: chunks travel both ways round the ring, each direction covering half of it,
    # so the last chunk arrives after n // 2 hops instead of n - 1 (both link directions busy).
    return (n // 2, (n - 1) // 2) if mode == "bidirectional" else (n - 1, 0)


def _result_fits(p: Problem, result: Spec | None, factor: str, axes: tuple[str, ...], ring: tuple[str, ...]) -> bool:
    """Whether the requested result shards ``factor``'s axis over exactly ``axes`` and uses the
    ring's axes nowhere else (no request: any result will do)."""
    if result is None:
        return True
    ci = _axis_of(p.operands[-1], factor)
    if ci is None or tuple(result[ci]) != axes:
        return False
    return not any(set(other) & set(ring) for i, other in enumerate(result) if i != ci)


def _common_suffix(x: tuple[str, ...], y: tuple[str, ...]) -> tuple[str, ...]:
    j = 0
    while j < min(len(x), len(y)) and x[len(x) - 1 - j] == y[len(y) - 1 - j]:
        j += 1
    return x[len(x) - j:]


def _base(p: Problem, mesh_shape, specs, result, ring) -> Plan | None:
    """The ordinary plan of everything off the ring (its axes stripped from every sharding)."""
    base = sharding.plan(p, mesh_shape, [_strip(s, ring) for s in specs], _strip(result, ring))
    return None if base.scatter else base


def _gather(p: Problem, ms, specs, result, mode: str, moving: str) -> Ring | None:
    """GATHER or GATHER_K with ``moving``'s chunks travelling (see the module docstring)."""
    names = [o.name for o in p.operands]
    g_op, s_op = p.operand(moving), p.operand("b" if moving == "a" else "a")
    g_spec, s_spec = specs[names.index(g_op.name)], specs[names.index(s_op.name)]
    for f, f_axes in _sharded(g_op, g_spec):
        kind = GATHER if f[0] == FREE[g_op.name] else GATHER_K if f[0] == "k" else None
        if kind is None or f not in p.shardable:
            continue
        for g, ring in _sharded(s_op, s_spec):
            if g[0] != FREE[s_op.name] or g not in p.shardable or f_axes[len(f_axes) - len(ring):] != ring:
                continue
            outer, n = f_axes[:len(f_axes) - len(ring)], _count(ms, ring)
            if n < 2 or p.sizes[f] % (n * _count(ms, outer)) or p.sizes[g] % n \
                    or not _result_fits(p, result, g, ring, ring):
                continue
            base = _base(p, ms, specs, result, ring)
            if base is None or tuple(base.assignment.get(f, ())) != outer or g in base.assignment:
                continue
            chunk = Plan({**base.assignment, f: f_axes, g: ring}, None, ())
            out = Plan({**base.assignment, g: ring}, None, ())
            # The travelling operand is sharded as one chunk; the other as the result needs it.
            in_specs = tuple((chunk if o is g_op else out).spec(o) for o in p.operands[:-1])
            return Ring(kind, p, ring, n, f, moving, chunk, out, in_specs, out.spec(p.operands[-1]),
                        base.reduce, _directions(mode, n))
    return None


def _scatter(p: Problem, ms, specs, result, mode: str) -> Ring | None:
    """SCATTER: K sharded alike in both operands, the result asked for with a free mode over the
    ring's axes (see the module docstring)."""
    if result is None:
        return None
    a, b, c = p.operands
    b_axes = dict(_sharded(b, specs[1]))
    for k, k_axes in _sharded(a, specs[0]):
        if k[0] != "k" or k not in p.shardable or b_axes.get(k) != k_axes:
            continue
        for f, f_axes in _sharded(c, result):
            # the ring: the mesh axes that end both K's sharding and the result's (rows over
            # (data, model) with K over model: a ring over model in each data group)
            ring = _common_suffix(k_axes, f_axes)
            holder = a if f[0] == "m" else b
            hi = _axis_of(holder, f)
            if not ring or f not in p.shardable or hi is None:
                continue
            outer_k, outer_f = k_axes[:len(k_axes) - len(ring)], f_axes[:len(f_axes) - len(ring)]
            n = _count(ms, ring)
            if n < 2 or specs[[a, b].index(holder)][hi] not in ((), outer_f) \
                    or p.sizes[f] % (n * _count(ms, outer_f)) or p.sizes[k] % (n * _count(ms, outer_k)) \
                    or not _result_fits(p, result, f, f_axes, ring):
                continue
            base = _base(p, ms, specs, result, ring)
            if base is None or tuple(base.assignment.get(k, ())) != outer_k \
                    or tuple(base.assignment.get(f, ())) != outer_f:
                continue
            inputs = Plan({**base.assignment, k: k_axes}, None, ())
            chunk = Plan({**base.assignment, k: k_axes, f: f_axes}, None, ())
            return Ring(SCATTER, p, ring, n, f, holder.name, chunk, chunk,
                        (inputs.spec(a), inputs.spec(b)), chunk.spec(c), base.reduce, _directions(mode, n))
    return None


def choose(p: Problem, mesh_shape: Mapping[str, int], specs: Sequence[Spec], result: Spec | None,
           mode: str = "bidirectional") -> Ring | None:
    """The ring for a dense GEMM whose inputs have ``specs`` and whose result is requested with
    ``result`` (None: not known yet, as when GSPMD infers it), or None. Where both operands'
    chunks could travel, the first operand's do (activations, not the weight), unless the
    requested result says otherwise."""
    if p.kind != "gemm" or len(specs) != 2:
        return None
    return _gather(p, mesh_shape, specs, result, mode, "a") or _gather(p, mesh_shape, specs, result, mode, "b") \
        or _scatter(p, mesh_shape, specs, result, mode)


# -- the per-shard body ------------------------------------------------------------------------------

def _shift(x, axes: tuple[str, ...], n: int, step: int):
    """``x`` sent to the device ``step`` places on along the ring (received from ``-step``)."""
    return jax.lax.ppermute(x, axes, perm=[(i, (i + step) % n) for i in range(n)])


def _body(ring: Ring, call, ms: Mapping[str, int]) -> Callable:
    p = ring.problem
    params = call.kwargs
    chunk_layouts, chunk_shapes = sharding.local_layouts(p, ring.chunk, ms, params["layouts"])
    out_shape = sharding.local_shapes(p, ring.out, ms)[-1]
    out_dtype = np.dtype(params["out_dtype"])
    names = [o.name for o in p.operands[:-1]]
    n = ring.size

    def gemm(dtype: np.dtype, busy: bool, **ops):
        """One chunk's GEMM; ``busy``: a transfer of the ring may be in flight while it runs."""
        args = [ops[name] for name in names]
        chunk_params = {**params, "layouts": chunk_layouts, "out_dtype": dtype.name}
        free = ring.free_sms if busy else 0
        return call.local(sharding.plain_avals(args), chunk_params, free_sms=free)(*args)

    def block(x, axis: int, extent: int, j):
        return jax.lax.dynamic_slice_in_dim(x, j * extent, extent, axis)

    @sharding.traced_unmeshed
    def lower_fn(*args):
        ops = dict(zip(names, args))
        idx = sharding.shard_index(ring.axes, ms)
        at = lambda offset: jax.lax.rem(idx + offset % n, n)  # noqa: E731 - ring position idx + offset
        if ring.kind == SCATTER:
            out = _scatter_steps(ring, ops, gemm, block, at, chunk_shapes[names.index(ring.operand)], out_dtype)
        else:
            out = _gather_steps(ring, ops, gemm, block, at, chunk_shapes, out_shape, out_dtype, params["acc_dtype"])
        return jax.lax.psum(out, ring.reduce) if ring.reduce else out

    return lower_fn


def _partial_dtype(out_dtype: np.dtype, acc_dtype: str) -> np.dtype:
    """Dtype GATHER_K sums its partial products in: the accumulator's for narrow floats (float32),
    so the sum over the ring rounds once, as one GEMM over the whole K would."""
    acc = np.dtype(acc_dtype)
    if jnp.issubdtype(out_dtype, jnp.floating) and acc.itemsize > out_dtype.itemsize:
        return acc
    return out_dtype


def _gather_steps(ring: Ring, ops: dict, gemm, block, at, chunk_shapes, out_shape, out_dtype, acc_dtype: str):
    p, n = ring.problem, ring.size
    fwd_steps, bwd_steps = ring.directions
    other = "b" if ring.operand == "a" else "a"
    names = [o.name for o in p.operands[:-1]]
    if ring.kind == GATHER:  # each chunk's rows go to their block of the result
        ci = _axis_of(p.operands[-1], ring.factor)
        extent = chunk_shapes[-1][ci]
        # every row is written by one step: no fill needed (a GPU allocates, the CPU fills zeros)
        out = jax.lax.empty(out_shape, out_dtype)

        def step(out, chunk, j, busy):
            y = gemm(out_dtype, busy, **{ring.operand: chunk, other: ops[other]})
            return jax.lax.dynamic_update_slice_in_dim(out, y, j * extent, ci)
    else:  # GATHER_K: each chunk meets its K block of the other operand; partial products summed
        si = _axis_of(p.operand(other), ring.factor)
        extent = chunk_shapes[names.index(other)][si]
        dtype = _partial_dtype(out_dtype, acc_dtype)
        out = None

        def step(out, chunk, j, busy):
            y = gemm(dtype, busy, **{ring.operand: chunk, other: block(ops[other], si, extent, j)})
            return y if out is None else out + y

    own = fwd = bwd = ops[ring.operand]
    last = max(fwd_steps, bwd_steps)
    for s in range(last + 1):
        # Send the chunks on before computing with them: the transfers overlap this step's GEMMs.
        nxt_fwd = _shift(fwd, ring.axes, n, 1) if s < fwd_steps else None
        nxt_bwd = _shift(bwd, ring.axes, n, -1) if s < bwd_steps else None
        busy = s < last  # the last step's chunks have all arrived: nothing left in flight
        if s == 0:
            out = step(out, own, at(0), busy)
        if 0 < s <= fwd_steps:
            out = step(out, fwd, at(-s), busy)  # s hops forward: the chunk of device idx - s
        if 0 < s <= bwd_steps:
            out = step(out, bwd, at(s), busy)
        fwd, bwd = nxt_fwd, nxt_bwd
    return out.astype(out_dtype)


def _scatter_steps(ring: Ring, ops: dict, gemm, block, at, moving_shape, out_dtype):
    n = ring.size
    fwd_steps, bwd_steps = ring.directions
    mi = _axis_of(ring.problem.operand(ring.operand), ring.factor)
    extent = moving_shape[mi]
    other = "b" if ring.operand == "a" else "a"

    def partial(offset: int, busy: bool):  # this device's part of output chunk idx + offset
        rows = block(ops[ring.operand], mi, extent, at(offset))
        return gemm(out_dtype, busy, **{ring.operand: rows, other: ops[other]})

    # Chunk c's sums: one starts fwd_steps devices after c and travels toward idx - 1, adding one
    # partial product per hop (at step s device idx adds its part of chunk idx - fwd_steps + s;
    # one-way: chunk idx + s + 1); the other starts bwd_steps devices before c and travels toward
    # idx + 1. Both arrive at c, which adds its own part. Each GEMM runs while a sum is in flight.
    down = up = None
    for s in range(max(fwd_steps, bwd_steps)):
        if s < fwd_steps:
            y = partial(s - fwd_steps, busy=s > 0)  # the first: issued before any transfer
            down = _shift(y if down is None else down + y, ring.axes, n, -1)
        if s < bwd_steps:
            y = partial(bwd_steps - s, busy=True)
            up = _shift(y if up is None else up + y, ring.axes, n, 1)
    out = partial(0, busy=True)
    for acc in (down, up):
        if acc is not None:
            out = out + acc
    return out
