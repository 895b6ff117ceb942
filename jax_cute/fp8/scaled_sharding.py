"""Partitioning rules of the block-scaled fp8 primitives (``fp8/scaled.py``): how a call whose
operands are sharded over a mesh runs as one call per shard.

Scales shard with their blocks: an axis stays sharded only where every shard holds whole
blocks, else it is replicated with a log line saying why; a sharded contraction is summed
(``psum``) in float32 before the epilogue and the output's rounding. Each rule is a
``custom_partitioning`` (GSPMD's partition and inference, Shardy's sharding rule) whose body is
the primitive's per-shard computation, ``Call.local``: the kernel, or the reference.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import ArrayMapping, CompoundFactor, SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jax_cute.activations import apply_activation, is_gated
from jax_cute.fp8.quantize import BLOCK, clipped_sizes, group_blocks, group_ends, grouped_blocks, row_groups
from jax_cute.primitives import sharding

logger = logging.getLogger("jax_cute")

# (primitive name, input avals, params, cuda) -> the shard's computation on its arrays
Local = Callable[[str, tuple, dict, bool], Callable]


@dataclasses.dataclass(frozen=True)
class Call:
    """Static part of one call: the primitive's params (``cuda``: lowered for the GPU) and its
    per-shard computation."""

    params: tuple[tuple[str, object], ...]
    local: Local

    @property
    def kwargs(self) -> dict:
        return dict(self.params)


def epilogue(acc, bias, activation, out_dtype):
    """A float32 accumulator's epilogue: the bias, the activation, one rounding to ``out_dtype``."""
    if bias is not None:
        acc = acc + bias.astype(jnp.float32)
    return apply_activation(activation, acc).astype(out_dtype)


# -- partitioning rules of the dense call --------------------------------------------------------------
#
# Scales shard with their blocks: a sharded axis of a (M or K) shards sa's block axis over the
# same mesh axes, likewise b's N and K with sb, and the bias with N. An axis is kept sharded only
# when every shard holds whole blocks (its extent divides into shards of a multiple of the block);
# otherwise it is replicated, with a log line saying why. A sharded K is summed (psum) in f32
# before the epilogue.

def _count(axes: Sequence[str], mesh_shape) -> int:
    return int(np.prod([mesh_shape[x] for x in axes])) if axes else 1


def _fits(extent: int, block: int, axes, mesh_shape) -> bool:
    n = _count(axes, mesh_shape)
    return extent % n == 0 and (extent // n) % block == 0 if n > 1 else True


def _kept(dims, mesh_shape, warn: bool, what: str) -> dict[str, tuple[str, ...]]:
    """Mesh axes of each of ``dims`` ((name, wanted axes, extent, block, why not or None), in
    order), each kept only where shards hold whole blocks and no mesh axis is used twice; a
    dimension not kept is replicated, logged (``warn``) with the reason."""
    used: set[str] = set()
    out: dict[str, tuple[str, ...]] = {}
    for f, axes, e, blk, refused in dims:
        why = None
        if axes and used & set(axes):
            why = f"its mesh axes {axes} already shard another dimension"
        elif axes and refused:
            why = refused
        elif axes and not _fits(e, blk, axes, mesh_shape):
            why = (f"{f.upper()}={e} does not split into {_count(axes, mesh_shape)} shards of whole "
                   f"{blk}-element scale blocks")
        if why:
            if warn:
                logger.warning("jax_cute.fp8: %s dimension %s is replicated, not sharded over %s: %s",
                               what, f.upper(), axes, why)
            axes = ()
        used |= set(axes)
        out[f] = tuple(axes)
    return out


def gemm_plan(shapes: Sequence[tuple[int, ...]], specs, mesh_shape, a_block: int, b_block: int,
              warn: bool = True, gated: bool = False) -> dict[str, tuple[str, ...]]:
    """Mesh axes of the dense call's L, M, N and K from its operands' specs (a's for L, M, K;
    b's for N; K where both shard it alike), each kept only where shards hold whole blocks and
    no mesh axis is used twice. A gated activation (swiglu pairs column j with j + N/2) keeps
    N whole."""
    (l, m, k), n = shapes[0], shapes[2][1]
    sa, sb = specs[0] or ((),) * 3, specs[2] or ((),) * 3
    return _kept([("l", sa[0] or sb[0], l, 1, None), ("m", sa[1], m, a_block, None),
                  ("n", sb[1], n, b_block, "a gated activation pairs columns of both halves of N" if gated else None),
                  ("k", sa[2] if sa[2] == sb[2] else (), k, BLOCK, None)], mesh_shape, warn, "scaled GEMM")


def _pspec(*parts) -> PartitionSpec:
    return sharding.partition_spec(parts)


def _gemm_shardings(mesh, plan, has_bias: bool):
    l, m, n, k = plan["l"], plan["m"], plan["n"], plan["k"]
    args = [_pspec(l, m, k), _pspec(l, m, k), _pspec(l, n, k), _pspec(l, n, k)] + ([_pspec(n)] if has_bias else [])
    return tuple(NamedSharding(mesh, s) for s in args), NamedSharding(mesh, _pspec(l, m, n))


def _plan_for(call: Call, mesh, arg_shapes, warn: bool):
    kw = call.kwargs
    a, b = (sharding.spec_of(arg_shapes[i].sharding, 3, mesh) for i in (0, 2))  # (the scales shard with them)
    return gemm_plan([tuple(s.shape) for s in arg_shapes], [a, None, b, None], dict(mesh.shape), kw["a_block"],
                     kw["b_block"], warn, is_gated(kw["activation"]))


def _partition(call: Call, mesh, arg_shapes, result_shape):
    kw = call.kwargs
    cuda = kw.pop("cuda")
    plan = _plan_for(call, mesh, arg_shapes, warn=True)
    arg_sh, out_sh = _gemm_shardings(mesh, plan, len(arg_shapes) == 5)
    reduce = plan["k"]

    def lower_fn(*args):
        with sharding.unmeshed():
            avals = tuple(jax.core.ShapedArray(x.shape, x.dtype) for x in args)
            if not reduce:
                return call.local("jax_cute_scaled_gemm", avals, kw, cuda)(*args)
            # K sharded: each shard's f32 partial sum, summed, then the epilogue once
            part = call.local("jax_cute_scaled_gemm", avals[:4], {**kw, "out_dtype": "float32", "activation": None},
                          cuda)(*args[:4])
            acc = jax.lax.psum(part, reduce)
            return epilogue(acc, args[4] if len(args) == 5 else None, kw["activation"], kw["out_dtype"])

    return mesh, lower_fn, out_sh, arg_sh


def _infer(call: Call, mesh, arg_shapes, result_shape):
    return _gemm_shardings(mesh, _plan_for(call, mesh, arg_shapes, warn=False), len(arg_shapes) == 5)[1]


def _blocked(name: str, extent: int, block: int, *, sizes: dict, separate: list):
    """(values' axis, scales' axis) of a Shardy rule: one factor where blocks divide the extent
    (a compound of the block count and the in-block factor, recorded in ``sizes``), else two
    unrelated factors, replicated (added to ``separate``)."""
    if block == 1:
        return name, name
    if extent % block == 0 and extent > block:  # (Shardy: no size-1 factor in a compound)
        sizes[f"{name}i"] = block
        return CompoundFactor(f"{name}b", f"{name}i"), f"{name}b"
    separate.extend([name, f"{name}s"])
    return name, f"{name}s"


def _sdy_rule_with_output(maps: list, out_lead: tuple, nv, activation, separate: list, k: int,
                          sizes: dict) -> SdyShardingRule:
    """The Shardy rule of operand mappings ``maps`` and an output of leading factors ``out_lead``
    then N (its own factor for a gated activation, which keeps N whole)."""
    gated = is_gated(activation)
    out = ArrayMapping(*out_lead, "ng" if gated else nv)
    if gated:
        separate.append("ng")
    return _factor_rule(maps, out, ("kb",) if k % BLOCK == 0 and k > BLOCK else (), separate, sizes)


def _factor_rule(maps: list, out: ArrayMapping, reduction: tuple, separate: list, sizes: dict) -> SdyShardingRule:
    """The Shardy rule of operand mappings ``maps``, the output's ``out``, ``reduction`` factors and
    the factors in ``separate`` replicated."""
    # Shardy numbers factors in order of first appearance and wants the special ones in that order
    order = [f for mp in (*maps, out) for d in mp for f in ((d,) if isinstance(d, str) else tuple(d))]
    rank = {f: i for i, f in reversed(list(enumerate(order)))}
    return SdyShardingRule(tuple(maps), (out,), reduction_factors=reduction,
                           need_replication_factors=tuple(sorted(set(separate), key=rank.__getitem__)), **sizes)


def _body(name: str) -> Callable:
    """The body custom_partitioning runs per shard for the primitive ``name``: its local kernel or
    reference, traced without the caller's mesh."""
    def body(call: Call, *args):
        kw = call.kwargs
        cuda = kw.pop("cuda")
        with sharding.unmeshed():
            avals = tuple(jax.core.ShapedArray(x.shape, x.dtype) for x in args)
            return jax.jit(call.local(name, avals, kw, cuda))(*args)
    return body


def _sdy_rule(call: Call, mesh, operand_types, result_types) -> SdyShardingRule:
    kw = call.kwargs
    (_, m, k), n = operand_types[0].shape, operand_types[2].shape[1]
    sizes: dict[str, int] = {}
    separate: list[str] = []

    blocked = functools.partial(_blocked, sizes=sizes, separate=separate)

    mv, ms = blocked("m", m, kw["a_block"])
    nv, ns = blocked("n", n, kw["b_block"])
    kv, ks = blocked("k", k, BLOCK)
    maps = [ArrayMapping("l", mv, kv), ArrayMapping("l", ms, ks), ArrayMapping("l", nv, kv), ArrayMapping("l", ns, ks)]
    if len(operand_types) == 5:
        maps.append(ArrayMapping(nv))
    return _sdy_rule_with_output(maps, ("l", mv), nv, kw["activation"], separate, k, sizes)


_gemm_body = _body("jax_cute_scaled_gemm")


_partitioned_gemm = custom_partitioning(_gemm_body, static_argnums=(0,))
_partitioned_gemm.def_partition(partition=_partition, infer_sharding_from_operands=_infer, sharding_rule=_sdy_rule,
                                decode_shardings=False)


# -- partitioning rules of the call grouped over M ----------------------------------------------------
#
# M (tokens) splits into row blocks: each shard derives its group sizes from the global ones
# (the groups clipped to its rows; sizes stay replicated). N and K as in the dense call; G
# (experts) is replicated: expert parallelism is a shard_map with a token all-to-all.

def _ragged_plan(call: Call, mesh, arg_shapes, warn: bool) -> dict[str, tuple[str, ...]]:
    kw = call.kwargs
    shapes = [tuple(s.shape) for s in arg_shapes]
    a, b = (sharding.spec_of(arg_shapes[i].sharding, len(shapes[i]), mesh) or ((),) * len(shapes[i])
            for i in (0, 2))
    (m, k), n = shapes[0], shapes[2][1]
    # as the dense plan over (L=1, M, K) x (L=1, N, K): a's M and K, b's N and K
    fake = [(1, m, k), None, (1, n, k)]
    dense = gemm_plan(fake, [((),) + tuple(a), None, ((),) + tuple(b[1:]), None], dict(mesh.shape),
                      1, kw["b_block"], warn, is_gated(kw["activation"]))
    return {"m": dense["m"], "n": dense["n"], "k": dense["k"]}


def _ragged_shardings(mesh, plan, has_bias: bool):
    m, n, k = plan["m"], plan["n"], plan["k"]
    args = [_pspec(m, k), _pspec(m, k), _pspec((), n, k), _pspec((), n, k), _pspec(())]
    args += [_pspec((), n)] if has_bias else []
    return tuple(NamedSharding(mesh, s) for s in args), NamedSharding(mesh, _pspec(m, n))


def _shard_offset(axes: Sequence[str], mesh_shape, local: int):
    return sharding.shard_index(axes, mesh_shape) * local


def _ragged_partition(call: Call, mesh, arg_shapes, result_shape):
    kw = call.kwargs
    cuda = kw.pop("cuda")
    plan = _ragged_plan(call, mesh, arg_shapes, warn=True)
    has_bias = len(arg_shapes) == 6
    arg_sh, out_sh = _ragged_shardings(mesh, plan, has_bias)
    m = arg_shapes[0].shape[0]
    ms = dict(mesh.shape)

    def lower_fn(*args):
        with sharding.unmeshed():
            args = list(args)
            lm = args[0].shape[0]
            if plan["m"]:  # this shard's rows [offset, offset + lm): the groups clipped to them
                ends = group_ends(args[4], m)
                starts = ends - clipped_sizes(ends)
                off = _shard_offset(plan["m"], ms, lm)
                clip = lambda x: jnp.clip(x - off, 0, lm)  # noqa: E731
                args[4] = (clip(ends) - clip(starts)).astype(jnp.int32)
            avals = tuple(jax.core.ShapedArray(x.shape, x.dtype) for x in args)
            if not plan["k"]:
                return call.local("jax_cute_scaled_ragged_m", avals, kw, cuda)(*args)
            part = call.local("jax_cute_scaled_ragged_m", avals[:5], {**kw, "out_dtype": "float32", "activation": None},
                          cuda)(*args[:5])
            acc = jax.lax.psum(part, plan["k"])
            if has_bias or kw["activation"]:
                # rows past the last group stay zero: the epilogue only on rows inside a group
                ends, grp = row_groups(args[4], lm)
                inside = (grp < ends.shape[0])[:, None]
                bias = jnp.where(inside, args[5][jnp.minimum(grp, ends.shape[0] - 1)].astype(jnp.float32), 0) \
                    if has_bias else None
                return jnp.where(inside, epilogue(acc, bias, kw["activation"], jnp.float32), 0).astype(kw["out_dtype"])
            return acc.astype(kw["out_dtype"])

    return mesh, lower_fn, out_sh, arg_sh


def _ragged_infer(call: Call, mesh, arg_shapes, result_shape):
    return _ragged_shardings(mesh, _ragged_plan(call, mesh, arg_shapes, warn=False), len(arg_shapes) == 6)[1]


def _ragged_sdy_rule(call: Call, mesh, operand_types, result_types) -> SdyShardingRule:
    kw = call.kwargs
    (_, k), n = operand_types[0].shape, operand_types[2].shape[1]
    sizes: dict[str, int] = {}
    separate: list[str] = ["g"]

    blocked = functools.partial(_blocked, sizes=sizes, separate=separate)

    nv, ns = blocked("n", n, kw["b_block"])
    kv, ks = blocked("k", k, BLOCK)
    maps = [ArrayMapping("m", kv), ArrayMapping("m", ks), ArrayMapping("g", nv, kv), ArrayMapping("g", ns, ks),
            ArrayMapping("g")]
    if len(operand_types) == 6:
        maps.append(ArrayMapping("g", nv))
    return _sdy_rule_with_output(maps, ("m",), nv, kw["activation"], separate, k, sizes)


_ragged_body = _body("jax_cute_scaled_ragged_m")


_partitioned_ragged_m = custom_partitioning(_ragged_body, static_argnums=(0,))
_partitioned_ragged_m.def_partition(partition=_ragged_partition, infer_sharding_from_operands=_ragged_infer,
                                    sharding_rule=_ragged_sdy_rule, decode_shardings=False)


# -- partitioning rules of the call grouped over K ----------------------------------------------------
#
# P and Q (the weight gradient's rows and columns, one scale per row) keep their sharding, and so
# does T (the tokens, contracted) where a and b shard it alike; each shard's float32 partial sums
# are summed. G is replicated and so are the group sizes. Laid out group-aligned (``aligned``:
# every group from a multiple of 128, every block whole and in place), T stays sharded where each
# shard holds whole blocks, and a shard takes the groups' blocks in its range. In the natural
# layout (blocks from each group's first token, as ``quantize_grouped`` writes them) a block may
# straddle two shards: each shard lays out the blocks that meet its tokens group-aligned, its part
# of a straddling block in place and zeros for the rest, with the blocks' scales (T of the scales
# whole: 1/32 of the fp8 values' bytes), and the partial sums of a block add up across shards.

def _ragged_k_plan(call: Call, mesh, arg_shapes, warn: bool) -> dict[str, tuple[str, ...]]:
    a, b = (sharding.spec_of(arg_shapes[i].sharding, 2, mesh) or ((), ()) for i in (0, 2))
    (p, t), q = arg_shapes[0].shape, arg_shapes[2].shape[0]
    block = BLOCK if call.kwargs.get("aligned") else 1
    return _kept([("p", a[0], p, 1, None), ("q", b[0], q, 1, None),
                  ("t", a[1] if a[1] == b[1] else (), t, block, None)], dict(mesh.shape), warn, "ragged-K scaled GEMM")


def _ragged_k_shardings(mesh, plan, aligned: bool):
    p, q, t = plan["p"], plan["q"], plan["t"]
    ts = t if aligned else ()
    args = [_pspec(p, t), _pspec(p, ts), _pspec(q, t), _pspec(q, ts), _pspec(())]
    return tuple(NamedSharding(mesh, s) for s in args), NamedSharding(mesh, _pspec((), p, q))


def _aligned_shard(sizes, total: int, lo, local: int):
    """The group-aligned layout's groups (``sizes`` tokens each, of ``total``) on the shard that
    holds blocks [lo, lo + local): each group's blocks there, as token counts (128 a block; the
    kernel and the reference round a group up to whole blocks, whose tail is zeros)."""
    nb = -(-jnp.clip(sizes, 0, total) // BLOCK)
    first = jnp.cumsum(nb) - nb
    clip = lambda x: jnp.clip(x - lo, 0, local)  # noqa: E731
    return ((clip(first + nb) - clip(first)) * BLOCK).astype(jnp.int32)


def _natural_shard_blocks(local: int, total: int, groups: int) -> int:
    """Room for the natural layout's blocks that meet a shard of ``local`` of ``total`` tokens:
    a group's part of L tokens there meets at most (L + 126) / 128 + 1 blocks."""
    return min(grouped_blocks(total, groups), (local + 126 * groups) // BLOCK + groups + 1)


def _natural_shard(a, sa, b, sb, sizes, total: int, lo, blocks: int):
    """The natural layout's call on the shard holding tokens [lo, lo + a.shape[1]) of ``total``,
    as a group-aligned call over ``blocks`` blocks (_natural_shard_blocks): the blocks that meet
    the shard, in order, each with its tokens there at their offsets in the block (zeros for the
    rest) and its scales (sa, sb: every block's); the sizes: each group's blocks there times 128."""
    local, g = a.shape[1], sizes.shape[0]
    _, bstart, blen, bgroup = group_blocks(sizes, total)
    meets = (blen > 0) & (bstart < lo + local) & (bstart + blen > lo)
    first, count = jnp.argmax(meets), jnp.sum(meets)   # the blocks that meet the shard are consecutive
    i = jnp.arange(blocks, dtype=jnp.int32)
    j = jnp.minimum(first + i, bstart.shape[0] - 1)
    held = i < count
    lane = jnp.arange(BLOCK, dtype=jnp.int32)
    src = bstart[j][:, None] + lane[None, :] - lo
    keep = (held[:, None] & (lane[None, :] < blen[j][:, None]) & (src >= 0) & (src < local)).reshape(-1)
    src = jnp.clip(src, 0, local - 1).reshape(-1)
    take = lambda x: jnp.where(keep, jnp.take(x, src, axis=1), jnp.zeros((), x.dtype))  # noqa: E731
    per_group = jax.ops.segment_sum(held.astype(jnp.int32), jnp.where(held, bgroup[j], g), num_segments=g + 1)[:g]
    return take(a), jnp.take(sa, j, axis=1), take(b), jnp.take(sb, j, axis=1), per_group * BLOCK


def _ragged_k_partition(call: Call, mesh, arg_shapes, result_shape):
    kw = call.kwargs
    cuda = kw.pop("cuda")
    aligned = kw.get("aligned", False)
    plan = _ragged_k_plan(call, mesh, arg_shapes, warn=True)
    arg_sh, out_sh = _ragged_k_shardings(mesh, plan, aligned)
    t, ms = arg_shapes[0].shape[1], dict(mesh.shape)
    name = "jax_cute_scaled_ragged_k"

    def lower_fn(*args):
        with sharding.unmeshed():
            params = kw
            if plan["t"]:
                local_t = args[0].shape[1]
                if aligned:
                    local = args[1].shape[1]
                    args = (*args[:4], _aligned_shard(args[4], t, _shard_offset(plan["t"], ms, local), local))
                else:
                    blocks = _natural_shard_blocks(local_t, t, args[4].shape[0])
                    args = _natural_shard(*args, t, _shard_offset(plan["t"], ms, local_t), blocks)
                params = {**kw, "out_dtype": "float32", "aligned": True}
            avals = tuple(jax.core.ShapedArray(x.shape, x.dtype) for x in args)
            out = call.local(name, avals, params, cuda)(*args)
            return jax.lax.psum(out, plan["t"]).astype(kw["out_dtype"]) if plan["t"] else out

    return mesh, lower_fn, out_sh, arg_sh


def _ragged_k_infer(call: Call, mesh, arg_shapes, result_shape):
    plan = _ragged_k_plan(call, mesh, arg_shapes, warn=False)
    return _ragged_k_shardings(mesh, plan, call.kwargs.get("aligned", False))[1]


def _ragged_k_sdy_rule(call: Call, mesh, operand_types, result_types) -> SdyShardingRule:
    t = operand_types[0].shape[1]
    sizes: dict[str, int] = {}
    separate: list[str] = ["g"]
    if call.kwargs.get("aligned", False):
        tv, ts = _blocked("k", t, BLOCK, sizes=sizes, separate=separate)
        reduction = ("kb",) if isinstance(tv, CompoundFactor) else ()
    else:   # the values' T shards freely, the scales' stays whole
        tv, ts, reduction = "k", "ks", ("k",)
        separate.append(ts)
    maps = [ArrayMapping("p", tv), ArrayMapping("p", ts), ArrayMapping("q", tv), ArrayMapping("q", ts),
            ArrayMapping("g")]
    return _factor_rule(maps, ArrayMapping("g", "p", "q"), reduction, separate, sizes)


_ragged_k_body = _body("jax_cute_scaled_ragged_k")


_partitioned_ragged_k = custom_partitioning(_ragged_k_body, static_argnums=(0,))
_partitioned_ragged_k.def_partition(partition=_ragged_k_partition, infer_sharding_from_operands=_ragged_k_infer,
                                    sharding_rule=_ragged_k_sdy_rule, decode_shardings=False)
PARTITIONED = {"jax_cute_scaled_gemm": _partitioned_gemm, "jax_cute_scaled_ragged_m": _partitioned_ragged_m,
                "jax_cute_scaled_ragged_k": _partitioned_ragged_k}

_INFER = {"jax_cute_scaled_gemm": _infer, "jax_cute_scaled_ragged_m": _ragged_infer,
          "jax_cute_scaled_ragged_k": _ragged_k_infer}


def typed_result(name: str, avals, params: dict) -> PartitionSpec | None:
    """On Explicit mesh axes (sharding in types), the sharding of the call's result as its rules
    partition it, the operands' types read as their shardings (a dimension the rules cannot keep
    sharded replicated, a sharded contraction summed); elsewhere None."""
    meshes = {a.sharding.mesh for a in avals if not a.sharding.mesh.empty}
    if len(meshes) != 1:
        return None
    mesh = meshes.pop()
    if not sharding.explicit_axes(mesh):
        return None
    return _INFER[name](Call(tuple(sorted(params.items())), None), mesh, avals, None).spec

