"""Partitioning rules of the GEMM primitives for jit's SPMD partitioner (Shardy or GSPMD).

An XLA custom call without rules is replicated: XLA gathers its operands onto every device.
Every lowering of ``jax_cute_matmul``, ``jax_cute_ragged_m`` and ``jax_cute_ragged_k`` (the CPU
reference and the CUDA kernel alike) therefore goes through one ``custom_partitioning``
function whose rules say which buffer axes may stay sharded, and whose per-shard body is the
same computation over the local buffers.

The model is Shardy's: *factors*. Each logical mode (M, N, K, L, G) is refined into the same
sub-modes in every operand that has it (``gemm_layouts.refine``); each sub-mode of extent > 1
is a factor. In an operand's buffer a factor is one stride, so it lies in one buffer axis; an
axis is described by its factors from slowest to fastest (a Shardy compound factor). A
sharded buffer axis shards its slowest factor, so the local buffer's layout keeps its
sub-modes with that factor's extent divided and the strides of slower axes recomputed
(``localize``).

What each kind of factor does when sharded:
- M, N, L (free and batch modes): the local GEMM on the local blocks, no communication.
- K (the reduction): the local GEMM, then ``psum`` over K's mesh axes, or ``psum_scatter``
  along an output axis when the requested output sharding uses K's mesh axes there. With
  ``config.float32_partial_sums`` a 16-bit result is summed as float32 partial products and
  rounded once, as the unsharded GEMM rounds its accumulator; by default in its own dtype.
- the ragged mode of a grouped GEMM (M rows of ``ragged_dot``, K of its weight gradient):
  groups are consecutive ranges of the *global* index, so each shard derives its own group
  sizes from the global ones (group sizes are kept replicated; they are G integers): the
  groups clipped to its block of rows. Exact for any group sizes, no communication (plus the
  ``psum`` when the ragged mode is K). Only the slowest factor of the ragged mode is sharded.
- G (groups, the experts of a mixture of experts): replicated. Sharding experts under jit
  would leave each shard rows of other shards' experts; expert parallelism is written with
  ``shard_map`` and an all-to-all token dispatch, where each shard's ``ragged_dot`` sees its
  own tokens and groups (``examples/sharded_layers.py``).
- a factor that is not the slowest of its axis in every operand holding it, or an axis whose
  sub-modes do not tile it (a layout that cannot be localized): replicated.

Sharding in types (mesh axes of type Explicit): the result's type takes each factor's sharding
from the operands' types, as lax's sharding rules do (``result_aval``). Where two operands
shard a contracting factor alike, the type is the reduced (summed) result; a public function
called without ``out_sharding`` then raises lax's error (``constrain``), while the transposes,
which take no ``out_sharding``, get the reduced cotangent. Inside ``shard_map`` the result
varies over the union of the operands' manual axes (their vma), and binding first makes the
operands vary alike (``Primitive``), as lax's binary ops do, so gradients check.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import logging
import math
import weakref
from typing import Callable, Mapping, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import ArrayMapping, CompoundFactor, SdyShardingRule, custom_partitioning
from jax.extend import core as extend_core
# No public API for these: marking a primitive as needing devices, lax's typed-result lowering,
# its operand vma matching and its sharding type error.
from jax._src import core as jax_core
from jax._src import dispatch as jax_dispatch
from jax._src import sharding_impls
from jax._src.interpreters import mlir as jax_mlir
from jax.interpreters import mlir
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

from jax_cute import config
from jax_cute import layout as L
from jax_cute.layout import Layout, make_layout
from jax_cute.problem.gemm_layouts import GemmLayouts, refine
from jax_cute.problem.ragged_layouts import RAGGED_K, RAGGED_M, RaggedLayouts
from jax_cute.primitives.ragged_reference import clipped_sizes, group_ends

logger = logging.getLogger(__name__)

# Logical modes of each operand's layout, in mode order; the last name is the result.
MODES = {
    "gemm": {"a": "mkl", "b": "nkl", "c": "mnl"},
    RAGGED_M: {"a": "mkl", "b": "nkgl", "gs": "gl", "c": "mnl"},
    RAGGED_K: {"a": "mkl", "b": "nkl", "gs": "gl", "c": "mngl"},
}
REDUCTION = "k"
REPLICATED = ("g", "h")  # groups (h: a lead's G + 1 sizes): see the module docstring


# An epilogue's operand past the GEMM's (a bias, Z): name -> (its logical modes, its layout)
Extra = Mapping[str, tuple[str, Layout]]


def _modes(layouts: GemmLayouts | RaggedLayouts, extra: Extra | None = None) -> dict[str, str]:
    """MODES of a call; the sizes' group mode of a call with a lead is a mode of its own (h).
    ``extra``: an epilogue's operands, after the others."""
    modes = MODES[_kind(layouts)]
    modes = {**modes, "gs": "hl"} if getattr(layouts, "lead", False) else dict(modes)
    c = modes.pop("c")
    return {**modes, **{n: m for n, (m, _) in (extra or {}).items()}, "c": c}


# -- layouts of local buffers -----------------------------------------------------------------

def axis_steps(layout: Layout, shape: Sequence[int]) -> tuple[tuple[int, int] | None, ...]:
    """For each flat sub-mode of ``layout`` over a row-major buffer of ``shape``: the buffer axis
    it steps along and its step in that axis's units, (axis, stride // axis stride); None for a
    sub-mode that reads no axis (extent 1 or stride 0); (-1, stride) when no one axis holds it."""
    strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    out: list[tuple[int, int] | None] = []
    for e, d in layout.flat_modes():
        if e == 1 or d == 0:
            out.append(None)
            continue
        # the slowest axis whose stride divides d and which holds all e steps
        axis = next((i for i in range(len(shape)) if shape[i] > 1 and d % strides[i] == 0
                     and d // strides[i] * (e - 1) < shape[i]), None)
        out.append((-1, d) if axis is None else (axis, d // strides[axis]))
    return tuple(out)


def localize(layout: Layout, shape: Sequence[int], local_shape: Sequence[int],
             divisors: Sequence[int] | None = None) -> Layout | None:
    """``layout`` over a row-major buffer of ``shape``, moved to one block of a sharding whose
    local buffer has ``local_shape``: the layout of the same logical block in the local buffer.

    A sharded axis (local extent smaller) must be stepped along by exactly one sub-mode that
    covers its slowest part; that sub-mode's extent is divided by the axis's shard count.
    Strides are recomputed from the local buffer's row-major strides. ``divisors`` gives each
    flat sub-mode's shard count where the buffer cannot tell (a broadcast sub-mode, stride 0,
    of a mode sharded in another operand); it must agree with the buffer elsewhere. Returns
    None when the sharding cannot be expressed on this layout.
    """
    steps = axis_steps(layout, shape)
    flat = layout.flat_modes()
    local_strides = tuple(math.prod(local_shape[i + 1:]) for i in range(len(local_shape)))
    counts = []
    for n, ln in zip(shape, local_shape):
        if ln == 0 or n % ln:
            return None
        counts.append(n // ln)
    absorbed = [c == 1 for c in counts]
    new: list[tuple[int, int]] = []
    for i, ((e, d), step) in enumerate(zip(flat, steps)):
        div = divisors[i] if divisors is not None else None
        if step is None:  # no buffer axis: only the caller knows its shard count
            div = div or 1
            if e % div:
                return None
            new.append((e // div, 0 if d == 0 or e // div == 1 else d))
            continue
        axis, t = step
        if axis < 0:
            if div not in (None, 1):
                return None
            new.append((e, d))
            continue
        want = counts[axis] if t * e == shape[axis] else 1  # the slowest sub-mode takes the split
        if div not in (None, want) or e % want:
            return None
        if want > 1:
            absorbed[axis] = True
        e2 = e // want
        new.append((e2, L.stride_of(e2, t * local_strides[axis])))
    if not all(absorbed):
        return None
    it = iter(new)

    def rebuild(s):
        if isinstance(s, int):
            return next(it)
        parts = [rebuild(x) for x in s]
        return tuple(p[0] for p in parts), tuple(p[1] for p in parts)

    shape_, stride_ = rebuild(layout.shape)
    return Layout(shape_, stride_)


# -- factors ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Operand:
    name: str
    shape: tuple[int, ...]
    layout: Layout  # refined: every logical mode split as in every other operand
    factors: tuple[str | None, ...]  # per flat sub-mode of ``layout``
    axes: tuple[tuple[str, ...] | None, ...]  # per buffer axis: factors slowest first; None: opaque


@dataclasses.dataclass(frozen=True)
class Problem:
    """The factors of one primitive call (global buffers) and which of them may be sharded."""

    kind: str
    operands: tuple[Operand, ...]  # inputs in call order, then the result
    sizes: Mapping[str, int]
    shardable: frozenset[str]
    ragged: str | None  # the ragged mode's slowest factor, when shardable

    def operand(self, name: str) -> Operand:
        return next(o for o in self.operands if o.name == name)


def _kind(layouts) -> str:
    return "gemm" if isinstance(layouts, GemmLayouts) else layouts.mode


def _clean_axis(entries: list[tuple[str, int, int]], extent: int) -> tuple[str, ...] | None:
    """Factors of one axis, slowest first, when their sub-modes tile the axis exactly."""
    entries = sorted(entries, key=lambda t: t[2])
    step = 1
    for _, e, t in entries:
        if t != step:
            return None
        step *= e
    if step != extent:
        return None
    return tuple(f for f, _, _ in reversed(entries))


def _refined(layouts: GemmLayouts | RaggedLayouts, extra: Extra):
    """Each operand's layout with every logical mode split as in every other operand, the
    factors' extents, and each mode's factors (fastest first); None when no split is common."""
    modes = _modes(layouts, extra)
    lays = {n: extra[n][1] if n in extra else getattr(layouts, n) for n in modes}
    refined: dict[str, list[Layout]] = {n: list(lays[n].modes()) for n in modes}
    sizes: dict[str, int] = {}
    mode_factors: dict[str, list[str]] = {}
    for x in "mnklgh":
        holders = [(n, modes[n].index(x)) for n in modes if x in modes[n]]
        if not holders:
            continue
        try:
            parts = refine([lays[n].mode(i) for n, i in holders])
        except ValueError:
            return None
        for (n, i), part in zip(holders, parts):
            refined[n][i] = part
        flat = parts[0].flat_modes()
        mode_factors[x] = [f"{x}{j}" for j, (e, _) in enumerate(flat) if e > 1]
        sizes.update({f"{x}{j}": e for j, (e, _) in enumerate(flat) if e > 1})
    return {n: make_layout(*refined[n]) for n in modes}, sizes, mode_factors


def _operand(name: str, modes: str, shape: tuple[int, ...], lay: Layout | None, fallback: Layout
             ) -> tuple[Operand, set[str]]:
    """One operand's factors per buffer axis, and the factors its layout keeps replicated."""
    if lay is None:  # no common refinement: every axis opaque
        return Operand(name, shape, fallback, (None,) * len(fallback.flat_modes()), (None,) * len(shape)), set()
    facs: list[str | None] = []
    for i, x in enumerate(modes):
        facs += [f"{x}{j}" if e > 1 else None for j, (e, _) in enumerate(lay.mode(i).flat_modes())]
    per_axis: list[list[tuple[str, int, int]]] = [[] for _ in shape]
    blocked: set[str] = set()
    unplaced = False
    for f, st, (e, _) in zip(facs, axis_steps(lay, shape), lay.flat_modes()):
        if f is None or st is None:
            continue
        if st[0] < 0:
            unplaced = True
            blocked.add(f)
        else:
            per_axis[st[0]].append((f, e, st[1]))
    axes: list[tuple[str, ...] | None] = []
    for i, entries in enumerate(per_axis):
        clean = None if unplaced else _clean_axis(entries, shape[i])
        # only an axis's slowest factor follows the axis's sharding
        blocked.update(clean[1:] if clean is not None else (f for f, _, _ in entries))
        axes.append(clean)
    return Operand(name, shape, lay, tuple(facs), tuple(axes)), blocked


def problem(layouts: GemmLayouts | RaggedLayouts, shapes: Sequence[Sequence[int]],
            extra: Extra | None = None, whole: str = "") -> Problem:
    """The factors of a call with ``layouts`` on input buffers of ``shapes`` (call order).
    ``extra``: an epilogue's operands (a bias or Z, with their logical modes: "mnl" where read at
    C's coordinates), whose buffers follow the others in ``shapes``; ``whole``: logical modes
    kept unsharded."""
    extra = dict(extra or {})
    kind = _kind(layouts)
    modes = _modes(layouts, extra)
    shapes = [tuple(s) for s in shapes] + [tuple(layouts.c_shape)]
    ref = _refined(layouts, extra)
    refined, sizes, mode_factors = ref if ref is not None else ({}, {}, {})
    operands, blocked = [], {f for x in whole for f in mode_factors.get(x, ())}
    for n, shape in zip(modes, shapes):
        o, b = _operand(n, modes[n], shape, refined.get(n), extra[n][1] if n in extra else getattr(layouts, n))
        operands.append(o)
        blocked |= b
    ragged_mode = {RAGGED_M: "m", RAGGED_K: "k"}.get(kind)
    ragged = mode_factors.get(ragged_mode, [None])[-1] if ragged_mode and mode_factors.get(ragged_mode) else None
    if ragged:
        blocked.update(mode_factors[ragged_mode][:-1])  # a shard's part of the ragged mode is one range
    shardable = frozenset(f for f in sizes if f not in blocked and not f.startswith(REPLICATED))
    return Problem(kind, tuple(operands), sizes, shardable, ragged if ragged in shardable else None)


def result_operand(layouts: GemmLayouts | RaggedLayouts) -> Operand:
    ref = _refined(layouts, {})
    return _operand("c", MODES[_kind(layouts)]["c"], tuple(layouts.c_shape), ref and ref[0]["c"], layouts.c)[0]


def sharding_rule(p: Problem, results: Sequence[Sequence[int]] | None = None) -> SdyShardingRule:
    """Shardy's rule for the call: each buffer axis as its factors, slowest first. ``results``:
    the shapes of several results, each mapped as C where its axis has C's extent and as a
    factor of its own, replicated, where not (a gated activation's halved N); default: C."""
    mappings, whole, used = [], set(), set()
    private: list[str] = []
    for o in p.operands:
        dims = []
        for i, fs in enumerate(o.axes):
            if not fs:  # an opaque axis, or an extent-1 one: a factor of its own
                name = f"{'opaque' if fs is None else 'unit'}_{o.name}_{i}"
                if fs is None:
                    private.append(name)
                dims.append(name)
                whole.add(name)
            elif len(fs) == 1:
                dims.append(fs[0])
                whole.add(fs[0])
            else:
                dims.append(CompoundFactor(*fs))
            used.update(fs or ())
        mappings.append(ArrayMapping(*dims))
    c = p.operands[-1]
    outs = [mappings.pop()]
    if results is not None:
        c_dims = tuple(outs[0])
        outs = []
        for r, shape in enumerate(results):
            own = [f"own_{r}_{i}" for i, n in enumerate(shape) if n != c.shape[i]]
            private += own
            whole.update(own)
            it = iter(own)
            outs.append(ArrayMapping(*(d if n == c.shape[i] else next(it)
                                       for i, (d, n) in enumerate(zip(c_dims, shape)))))
    mappings += outs
    # Shardy numbers factors in order of first appearance and wants the special ones in that order.
    order = [f for dims in mappings for d in dims for f in ((d,) if isinstance(d, str) else tuple(d))]
    rank = {f: i for i, f in reversed(list(enumerate(order)))}
    real = sorted(used, key=rank.__getitem__)
    reduction = tuple(f for f in real if f in p.shardable and f.startswith(REDUCTION))
    replicated = tuple(sorted([f for f in real if f not in p.shardable] + private, key=rank.__getitem__))
    factor_sizes = {f: p.sizes[f] for f in real if f not in whole}
    ins = len(mappings) - len(outs)
    return SdyShardingRule(tuple(mappings[:ins]), tuple(mappings[ins:]), reduction_factors=reduction,
                           need_replication_factors=replicated, **factor_sizes)


# -- resolving shardings ------------------------------------------------------------------------

Spec = tuple[tuple[str, ...], ...]


def spec_of(sharding, ndim: int, mesh=None) -> Spec | None:
    """Per buffer axis, the mesh axes it is sharded over; None for a sharding we cannot read.
    ``mesh``: a partition rule's, to read XLA's shardings it is handed undecoded."""
    if not isinstance(sharding, NamedSharding):
        # (custom_partitioning finds no mesh where the jit has none: nothing to decode against)
        sharding = decoded(sharding, mesh) if mesh is not None and not mesh.empty else None
        if sharding is None:
            return None
    parts = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return tuple(() if x is None else (x,) if isinstance(x, str) else tuple(x) for x in parts[:ndim])


def decoded(sharding, mesh) -> NamedSharding | None:
    """XLA's ``sharding`` of an operand as a NamedSharding of ``mesh``; None (with a log line)
    where none expresses it. Shardy shards an axis over part of a mesh axis (a sub-axis) where
    a reshape splits a sharded axis unevenly, as (N,) -> (2, N/2) does to an N over 4 shards;
    custom_partitioning's own decoding raises on those, so the partition rules are handed
    shardings undecoded (``decode_shardings=False``) and decode them here."""
    hlo = sharding._hlo_sharding  # (GSPMDSharding's; outside the try: a rename must fail loudly)
    try:
        parts = sharding_impls.parse_flatten_op_sharding(hlo, mesh)[0]
    except (KeyError, ValueError):  # a sub-axis (JAX raises KeyError, or IndivisibleError: a ValueError)
        logger.warning("jax_cute: an operand sharded as %s splits a mesh axis of %s, which no partition "
                       "spec expresses: read as replicated", sharding, dict(mesh.shape))
        return None
    return NamedSharding(mesh, PartitionSpec(*parts))


def partition_spec(parts: Sequence[Sequence[str]]) -> PartitionSpec:
    """Per buffer axis its mesh axes (empty: not sharded) as a PartitionSpec."""
    return PartitionSpec(*(None if not a else a[0] if len(a) == 1 else tuple(a) for a in parts))


def can_take(axes: Sequence[str], extent: int, mesh_shape: Mapping[str, int], taken: set[str]) -> bool:
    """Whether a factor of ``extent`` may be sharded over mesh ``axes``: none of them serves
    another factor already (``taken``), and their shards split it evenly."""
    return not taken & set(axes) and extent % math.prod(mesh_shape[a] for a in axes) == 0


@dataclasses.dataclass(frozen=True)
class Plan:
    assignment: Mapping[str, tuple[str, ...]]  # factor -> mesh axes
    scatter: tuple[int, tuple[str, ...]] | None  # (result axis, mesh axes) of a reduce-scatter
    reduce: tuple[str, ...]  # mesh axes summed over after the local GEMM

    def spec(self, o: Operand, result: bool = False) -> PartitionSpec:
        parts = []
        for i, fs in enumerate(o.axes):
            axes = self.assignment.get(fs[0], ()) if fs else ()
            if result and self.scatter and self.scatter[0] == i:
                axes = self.scatter[1]
            parts.append(axes)
        return partition_spec(parts)


def plan(p: Problem, mesh_shape: Mapping[str, int], inputs: Sequence[Spec | None], result: Spec | None = None) -> Plan:
    """Which factors are sharded over which mesh axes, from the inputs' shardings (first
    operand first; None, a sharding we cannot read, proposes nothing), then the requested
    result sharding; and the reduction that follows."""
    assignment: dict[str, tuple[str, ...]] = {}
    taken: set[str] = set()

    def propose(o: Operand, spec: Spec | None, allow=lambda f: True):
        for fs, axes in zip(o.axes, spec or ()):
            if not axes or not fs or fs[0] in assignment or fs[0] not in p.shardable or not allow(fs[0]):
                continue
            if not can_take(axes, p.sizes[fs[0]], mesh_shape, taken):
                continue
            assignment[fs[0]] = axes
            taken.update(axes)

    for o, spec in zip(p.operands, inputs):
        propose(o, spec)
    out = p.operands[-1]
    propose(out, result)
    reduce = tuple(a for f, axes in assignment.items() if f.startswith(REDUCTION) for a in axes)
    scatter = None
    for i, (fs, axes) in enumerate(zip(out.axes, result or ())):
        if axes and fs and fs[0] not in assignment and set(axes) <= set(reduce) \
                and out.shape[i] % math.prod(mesh_shape[a] for a in axes) == 0:
            scatter = (i, axes)
            break
    return Plan(assignment, scatter, reduce)


def local_shapes(p: Problem, pl: Plan, mesh_shape: Mapping[str, int]) -> list[tuple[int, ...]]:
    out = []
    for o in p.operands:
        out.append(tuple(n // math.prod(mesh_shape[a] for a in pl.assignment.get(fs[0], ())) if fs else n
                         for n, fs in zip(o.shape, o.axes)))
    return out


def localized(p: Problem, pl: Plan, mesh_shape: Mapping[str, int]) -> tuple[dict[str, Layout], list[tuple[int, ...]]]:
    """Each operand's layout over its local buffer of ``pl`` (each mode coalesced), by name, and
    the local buffers' shapes (call order, then the result)."""
    shapes = local_shapes(p, pl, mesh_shape)
    new = {}
    for o, shape in zip(p.operands, shapes):
        div = [math.prod(mesh_shape[a] for a in pl.assignment.get(f, ())) if f else 1 for f in o.factors]
        lay = localize(o.layout, o.shape, shape, div)
        if lay is None:
            raise AssertionError(f"jax_cute: cannot localize {o.name}={o.layout} of {o.shape} to {shape}")
        new[o.name] = make_layout(*(m.coalesce() for m in lay.modes()))
    return new, shapes


def local_layouts(p: Problem, pl: Plan, mesh_shape: Mapping[str, int], layouts):
    """The call's layouts over the local buffers of ``pl`` (each mode coalesced)."""
    new, shapes = localized(p, pl, mesh_shape)
    return rebuilt(layouts, new, shapes[-1]), shapes


def rebuilt(layouts: GemmLayouts | RaggedLayouts, new: Mapping[str, Layout], c_shape) -> GemmLayouts | RaggedLayouts:
    """``layouts`` with the operands' layouts ``new`` (by name) and the result's shape ``c_shape``."""
    if isinstance(layouts, GemmLayouts):
        return GemmLayouts(new["a"], new["b"], new["c"], c_shape)
    return RaggedLayouts(layouts.mode, new["a"], new["b"], new["c"], new["gs"], c_shape, layouts.lead)


# -- sharding in types ---------------------------------------------------------------------------

def explicit_axes(mesh) -> bool:
    """Whether ``mesh`` has Explicit axes: sharding in types."""
    return not mesh.empty and AxisType.Explicit in tuple(mesh.axis_types)


def auto_axes(mesh) -> bool:
    """Whether ``mesh`` has Auto axes over several devices: shardings only the partitioner knows."""
    return not mesh.empty and mesh.size > 1 and AxisType.Auto in tuple(mesh.axis_types)


def _typed_factors(name: str, p: Problem, avals) -> tuple[dict[str, tuple[str, ...]], bool]:
    """Each factor's mesh axes as the operands' sharding types give them (a buffer axis's
    sharding is its slowest factor's), and whether two operands shard a contracting factor."""
    assignment: dict[str, tuple[str, ...]] = {}
    holders: dict[str, int] = {}
    for o, a in zip(p.operands, avals):
        for fs, axes in zip(o.axes, spec_of(a.sharding, a.ndim) or ()):
            if not fs or not axes:
                continue
            f = fs[0]
            holders[f] = holders.get(f, 0) + 1
            if assignment.setdefault(f, axes) != axes:
                raise jax_core.ShardingTypeError(
                    f"{name}: operands shard one dimension differently ({assignment[f]} and {axes}, "
                    f"mode {f[0].upper()}); reshard one of them. Got "
                    + ", ".join(x.str_short(short_dtypes=True) for x in avals))
    reduced = any(f.startswith(REDUCTION) and n > 1 for f, n in holders.items())
    return assignment, reduced


def result_aval(name: str, layouts: GemmLayouts | RaggedLayouts, avals, out_dtype,
                extra: Extra | None = None, whole: str = "",
                shape: Sequence[int] | None = None) -> jax.core.ShapedArray:
    """The type of the call's result: its buffer's shape and ``out_dtype``, weak where every
    operand is (lax's rule for its products, so gradients are weak as lax's are); where mesh
    axes are Explicit, the sharding of the factors it holds (as lax's sharding rules give
    theirs); and the union of the operands' varying manual axes (inside shard_map).
    ``extra`` and ``whole`` as ``problem``'s (an epilogue's operands follow the GEMM's in
    ``avals``); ``shape``: a result shaped otherwise than C, unsharded along
    each axis whose extent differs (a gated activation's halved N)."""
    meshes = {a.sharding.mesh for a in avals if not a.sharding.mesh.empty}
    if len(meshes) > 1:
        raise jax_core.ShardingTypeError(f"{name}: operands on different meshes: {meshes}")
    mesh = meshes.pop() if meshes else jax.sharding.get_abstract_mesh()
    shape = tuple(layouts.c_shape if shape is None else shape)
    spec = PartitionSpec()
    if explicit_axes(mesh):
        p = problem(layouts, [a.shape for a in avals], extra, whole)
        assignment, _ = _typed_factors(name, p, avals)
        assignment = {f: axes for f, axes in assignment.items() if f[0] not in whole}
        parts = tuple(Plan(assignment, None, ()).spec(p.operands[-1], result=True))
        parts += (None,) * (len(shape) - len(parts))
        spec = PartitionSpec(*(x if n == c else None for x, n, c in zip(parts, shape, layouts.c_shape)))
    varying = frozenset().union(*(a.mat.varying for a in avals))
    return jax.core.ShapedArray(shape, out_dtype, weak_type=all(a.weak_type for a in avals),
                                sharding=NamedSharding(mesh, spec),
                                manual_axis_type=jax_core.ManualAxisType(varying=varying))


def varying_as(outs: Sequence[jax.core.ShapedArray], avals) -> list[jax.core.ShapedArray]:
    """``outs`` varying over the manual mesh axes any of the operands ``avals`` varies over
    (inside shard_map), as an elementwise op's result does; unchanged elsewhere."""
    if not any(a.mat.varying for a in avals):
        return list(outs)
    return [varying_aval(o.shape, o.dtype, avals) for o in outs]


def varying_aval(shape, dtype, avals) -> jax.core.ShapedArray:
    """A result type unsharded on the operands' mesh that varies over their manual axes (inside
    shard_map): for primitives whose partitioning is not followed in types (the block-scaled
    products)."""
    meshes = {a.sharding.mesh for a in avals if not a.sharding.mesh.empty}
    mesh = meshes.pop() if len(meshes) == 1 else jax.sharding.get_abstract_mesh()
    varying = frozenset().union(*(a.mat.varying for a in avals))
    return jax.core.ShapedArray(tuple(shape), np.dtype(dtype), sharding=NamedSharding(mesh, PartitionSpec()),
                                manual_axis_type=jax_core.ManualAxisType(varying=varying))


# The last result whose contraction ran over operands both sharded along it (see ``constrain``).
_reduced_result: contextvars.ContextVar[weakref.ref | None] = contextvars.ContextVar("jax_cute_reduced", default=None)


class VaryingPrimitive(extend_core.Primitive):
    """Binding first makes the operands vary over the same manual mesh axes (inside shard_map),
    as lax's binary ops do: a transpose then sums a cotangent over the axes its operand did not
    vary over."""

    def bind(self, *args, **params):
        return super().bind(*jax_core.auto_insert_reshard(*args), **params)


class Primitive(VaryingPrimitive):
    """A GEMM primitive (its params hold ``layouts``), binding as ``VaryingPrimitive`` (as lax's
    dot_general does). A result contracted over operands both sharded along the contraction
    (Explicit axes) is remembered for ``constrain``."""

    def bind(self, *args, **params):
        args = jax_core.auto_insert_reshard(*args)
        out = extend_core.Primitive.bind(self, *args, **params)
        avals = [jax.typeof(x) for x in args]
        if any(explicit_axes(a.sharding.mesh) for a in avals):
            p = problem(params["layouts"], [a.shape for a in avals])
            if _typed_factors(self.name, p, avals)[1]:
                _reduced_result.set(weakref.ref(out))
        return out


# -- the partitioned call -----------------------------------------------------------------------

class Local(Protocol):
    """(input avals, params) -> the computation on the arrays. ``free_sms``: SMs its kernel
    leaves free for work running beside it (a collective ring's transfers; see
    ``dispatch.GemmRequest.free_sms``). ``whole``: (avals, params) of the unsharded call, whose
    order of float32 additions a shard's kernel keeps (its split-K), or None."""

    def __call__(self, avals: tuple, params: dict, free_sms: int = 0, whole: tuple | None = None) -> Callable: ...


@dataclasses.dataclass(frozen=True)
class _Call:
    """Static part of one call: the primitive's params and its per-shard computation."""

    params: tuple[tuple[str, object], ...]
    local: Local
    # (problem, mesh shape, input specs, result spec) -> a ring that hides the call's all-gather or
    # reduce-scatter in its GEMMs, or None (primitives/collective.py; None: that switch is off)
    rings: Callable | None = None
    # config.float32_partial_sums: a sharded contraction with a 16-bit result sums float32 partial
    # products, and a shard of a call whose contraction is whole adds as the unsharded call does
    float32_sums: bool = False

    @property
    def kwargs(self) -> dict:
        return dict(self.params)


def plain_avals(xs) -> tuple:
    return tuple(jax.core.ShapedArray(x.shape, x.dtype) for x in xs)


def _mesh_shape(mesh) -> dict[str, int]:
    return dict(mesh.shape)


def _input_specs(mesh, arg_shapes) -> list[Spec | None]:
    return [spec_of(s.sharding, len(s.shape), mesh) for s in arg_shapes]


def shard_index(axes: Sequence[str], mesh_shape: Mapping[str, int]):
    idx = jnp.int32(0)
    for a in axes:  # the first mesh axis is the slowest, as in a PartitionSpec
        idx = idx * mesh_shape[a] + jax.lax.axis_index(a)
    return idx


def shard_group_sizes(args: list, p: Problem, pl: Plan, mesh_shape: Mapping[str, int], layouts, local,
                      shapes) -> list:
    """A shard's operands ``args``: where the ragged mode is sharded, the group sizes replaced by
    those of the shard's block (``layouts`` the call's, ``local`` and ``shapes`` the shard's)."""
    if p.ragged in pl.assignment:
        gs_i = [o.name for o in p.operands].index("gs")
        lext = local.ragged_extent()
        offset = shard_index(pl.assignment[p.ragged], mesh_shape) * lext
        args[gs_i] = _local_group_sizes(args[gs_i], local.gs, shapes[gs_i], layouts.ragged_extent(), lext, offset)
    return args


def _local_group_sizes(gs, gs_layout: Layout, gs_shape, extent: int, local_extent: int, offset):
    """Group sizes of one shard's block [offset, offset + local_extent) of the ragged mode."""
    ends = group_ends(L.read(gs, gs_layout), extent)  # (G, L)
    starts = ends - clipped_sizes(ends)
    clip = lambda x: jnp.clip(x - offset, 0, local_extent)  # noqa: E731
    return L.write((clip(ends) - clip(starts)).astype(gs.dtype), gs_layout, gs_shape)


def traced_unmeshed(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapped(*args):
        with unmeshed():
            return fn(*args)
    return wrapped


def _widened_sum(call: _Call, out_dtype: np.dtype) -> bool:
    """Whether partial products of a sharded contraction are summed in float32: for 16-bit
    float results, when ``config.float32_partial_sums`` was on when the call was lowered."""
    return call.float32_sums and jnp.issubdtype(out_dtype, jnp.floating) and out_dtype.itemsize == 2


def _partition(call: _Call, mesh, arg_shapes, result_shape):
    params = call.kwargs
    layouts = params["layouts"]
    p = problem(layouts, [s.shape for s in arg_shapes])
    ms = _mesh_shape(mesh)
    specs = _input_specs(mesh, arg_shapes)  # (one we cannot read proposes nothing: plan)
    result_spec = spec_of(result_shape.sharding, len(result_shape.shape), mesh)
    ring = call.rings(p, ms, specs, result_spec) if call.rings and all(s is not None for s in specs) else None
    if ring is not None:
        return ring.partition(call, mesh)
    pl = plan(p, ms, specs, result_spec)
    local, shapes = local_layouts(p, pl, ms, layouts)
    out_dtype = np.dtype(params["out_dtype"])
    wide = bool(pl.reduce) and _widened_sum(call, out_dtype)
    local_params = {**params, "layouts": local, "out_dtype": "float32" if wide else params["out_dtype"]}
    # each shard's GEMM is a block of the whole one, over all of K: with float32_partial_sums
    # its kernel splits K as the whole problem's would (its own M, N and L may pick another
    # split), so every element is the same float32 sum in the same order as on one device
    whole = (plain_avals(arg_shapes), params) if call.float32_sums and not pl.reduce else None

    @traced_unmeshed
    def lower_fn(*args):
        args = shard_group_sizes(list(args), p, pl, ms, layouts, local, shapes)
        out = call.local(plain_avals(args), local_params, whole=whole)(*args)
        if pl.scatter:
            rest = tuple(a for a in pl.reduce if a not in pl.scatter[1])
            if rest:
                out = jax.lax.psum(out, rest)
            out = jax.lax.psum_scatter(out, pl.scatter[1], scatter_dimension=pl.scatter[0], tiled=True)
        elif pl.reduce:
            out = jax.lax.psum(out, pl.reduce)
        return out.astype(out_dtype)  # one rounding of the float32 sum (a no-op otherwise)

    arg_shardings = tuple(NamedSharding(mesh, pl.spec(o)) for o in p.operands[:-1])
    return mesh, lower_fn, NamedSharding(mesh, pl.spec(p.operands[-1], result=True)), arg_shardings


def _infer(call: _Call, mesh, arg_shapes, result_shape):
    p = problem(call.kwargs["layouts"], [s.shape for s in arg_shapes])
    specs = _input_specs(mesh, arg_shapes)
    ring = call.rings(p, _mesh_shape(mesh), specs, None) if call.rings and all(s is not None for s in specs) else None
    if ring is not None:
        return NamedSharding(mesh, ring.result_spec)
    pl = plan(p, _mesh_shape(mesh), specs)
    return NamedSharding(mesh, pl.spec(p.operands[-1]))


def _propagate_user(call: _Call, mesh, user_shape):
    # Keep the user's sharding of each result axis that can follow one (its slowest factor).
    c = result_operand(call.kwargs["layouts"])
    spec = spec_of(user_shape.sharding, len(user_shape.shape), mesh)
    if spec is None:
        return user_shape.sharding
    parts = [axes if fs and axes else () for fs, axes in zip(c.axes, spec)]
    return NamedSharding(mesh, partition_spec(parts))


def _rule(call: _Call, mesh, operand_types, result_types) -> SdyShardingRule:
    shapes = [tuple(t.shape) for t in operand_types]
    return sharding_rule(problem(call.kwargs["layouts"], shapes))


def _body(call: _Call, *args):
    # Inside a jit of its own, array constants (gather offsets, empty outputs) stay in the inner
    # computation: custom_partitioning refuses a body that closes over constants.
    with unmeshed():
        return jax.jit(call.local(plain_avals(args), call.kwargs))(*args)


_partitioned = custom_partitioning(_body, static_argnums=(0,))
_partitioned.def_partition(partition=_partition, infer_sharding_from_operands=_infer,
                           propagate_user_sharding=_propagate_user, sharding_rule=_rule, decode_shardings=False)


def lowering(primitive, local: Local, rings: Callable[[], Callable | None] | None = None) -> Callable:
    """An MLIR lowering rule for ``primitive`` whose per-shard computation is ``local``.

    ``local(avals, params)`` returns the function of the (local) operand arrays that computes
    the primitive with ``params`` (``params["layouts"]`` describe those local buffers).
    ``rings()``, asked when a call is lowered, gives the planner of ``_Call.rings`` (or None).
    """
    # custom_partitioning needs the device assignment while lowering, which jit passes only to
    # computations holding a primitive that asks for it (as custom_partitioning_p itself does).
    jax_dispatch.prim_requires_devices_during_lowering.add(primitive)

    @typed_results  # the rules, not the types, partition the call
    def rule(ctx, *args, **params):
        if one_shard(ctx.module_context.axis_context):  # nothing to partition: the computation itself
            fn = local(ctx.avals_in, params)
        else:
            fn = functools.partial(_partitioned, _Call(tuple(sorted(params.items())), local,
                                                       rings() if rings else None, config.float32_partial_sums()))
        return mlir.lower_fun(fn, multiple_results=False)(ctx, *args)

    return rule


def typed_results(rule: Callable) -> Callable:
    """The lowering ``rule`` traced without the caller's
    mesh on untyped avals, so that its ops are placed by the partitioner, not typed (a bias
    sharded along N, concatenated with an unsharded row, would be a type error), then each
    result typed with Explicit mesh axes constrained to its type, as lax's lowerings do."""
    def lowered(ctx, *args, **params):
        with unmeshed():
            plain = ctx.replace(avals_in=plain_avals(ctx.avals_in), avals_out=plain_avals(ctx.avals_out))
            outs = rule(plain, *args, **params)
        return [jax_mlir.lower_with_sharding_in_types(ctx, out, aval) for out, aval in zip(outs, ctx.avals_out)]
    return lowered


def unmeshed():
    """Trace a local computation without the caller's mesh: traced under Explicit mesh axes,
    its ops would be typed (and lowered) with shardings of that mesh, whose constraints inside a
    partitioned body no partitioner removes (XLA then finds no `Sharding` custom call)."""
    return jax.sharding.use_abstract_mesh(AbstractMesh((), ()))


def one_shard(axis_context) -> bool:
    """Whether the computation being lowered runs as one shard: on one device, or inside a
    shard_map body whose mesh axes are all manual."""
    devices = getattr(axis_context, "num_devices", None)
    if devices is not None:
        return devices == 1
    mesh = getattr(axis_context, "mesh", None)
    return mesh is not None and set(mesh.axis_names) <= set(getattr(axis_context, "manual_axes", ()))


def reference_local(reference: Callable) -> Local:
    """The per-shard computation of a primitive that always runs its ``reference``."""
    return lambda avals, params, free_sms=0, whole=None: functools.partial(reference, **params)


def constrain(x, out_sharding):
    """The result ``x`` of a public call with ``out_sharding`` (as ``jnp.matmul``,
    ``lax.dot_general`` and ``lax.ragged_dot`` take it: a NamedSharding, or a PartitionSpec of
    the context mesh), resharded to it on Explicit mesh axes and constrained to it on Auto ones
    (where JAX's own ops refuse it; there the constraint guides the partitioner). Without one,
    a result contracted over operands both sharded along the contraction raises lax's error."""
    if out_sharding is None:
        ref = _reduced_result.get()
        if ref is not None and ref() is x:
            raise jax_core.ShardingTypeError(
                "Contracting dimensions are sharded and it is ambiguous how the output should be sharded. "
                "Please specify the output sharding via the `out_sharding` parameter.")
        return x
    mesh = out_sharding.mesh if isinstance(out_sharding, NamedSharding) else jax.sharding.get_abstract_mesh()
    if explicit_axes(mesh):
        return jax.sharding.reshard(x, out_sharding)
    return jax.lax.with_sharding_constraint(x, out_sharding)
