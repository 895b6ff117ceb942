"""``quantize_grouped``'s primitive (``fp8/quantize.py``) and its partitioning rule under a
``jit`` whose mesh axes are Auto: the tokens stay where they lie.

``quantize_grouped(x, sizes)`` quantizes x (..., T) in blocks of 128 tokens that restart at each
group, the values in place. A shard holding a contiguous run of the tokens quantizes them there;
a block may straddle two shards, so its amax is the max over the shards (one all-reduce of the
scales, 1/32 of the fp8 values' bytes, which stay sharded as x). The leading axes shard freely.
On Explicit mesh axes ``quantize_grouped`` does the same by ``shard_map`` (its types say where
the tokens lie); under an Auto ``jit`` only the partitioner knows, hence this rule.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax._src import dispatch as jax_dispatch
from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule, custom_partitioning
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding

from jax_cute.primitives import sharding

# (x shard, sizes, total tokens, first token of the shard, how the blocks' amax combines across
# shards or None) -> (values, scales): the quantizer on one shard
Local = Callable


@dataclasses.dataclass(frozen=True)
class Call:
    """Static part of one call: its per-shard quantizer (``local``, closed over the dtype and
    the scales' rounding; hashable, as custom_partitioning's static argument must be)."""

    local: Local


def _plan(mesh, x) -> tuple[tuple[str, ...], ...]:
    """Per axis of x (..., T), the mesh axes it stays sharded over: each axis whose shards split
    it evenly (an uneven shard would be padded, and padding would enter a block's amax)."""
    spec = sharding.spec_of(x.sharding, len(x.shape), mesh) or ((),) * len(x.shape)
    used: set[str] = set()
    out = []
    for axes, extent in zip(spec, x.shape):
        keep = sharding.can_take(axes, extent, dict(mesh.shape), used) if axes else False
        out.append(tuple(axes) if keep else ())
        used |= set(axes) if keep else set()
    return tuple(out)


def _shardings(mesh, plan):
    pspec = sharding.partition_spec
    lead = plan[:-1]
    return ((NamedSharding(mesh, pspec(plan)), NamedSharding(mesh, pspec([()]))),
            (NamedSharding(mesh, pspec(plan)), NamedSharding(mesh, pspec([*lead, ()]))))


def _partition(call: Call, mesh, arg_shapes, result_shape):
    plan = _plan(mesh, arg_shapes[0])
    args, outs = _shardings(mesh, plan)
    total, tokens = arg_shapes[0].shape[-1], plan[-1]

    def lower_fn(x, sizes):
        with sharding.unmeshed():
            if not tokens:
                return call.local(x, sizes, total, 0, None)
            lo = sharding.shard_index(tokens, dict(mesh.shape)) * x.shape[-1]
            return call.local(x, sizes, total, lo, lambda amax: jax.lax.pmax(amax, tokens))

    return mesh, lower_fn, outs, args


def _infer(call: Call, mesh, arg_shapes, result_shape):
    return _shardings(mesh, _plan(mesh, arg_shapes[0]))[1]


def _sdy_rule(call: Call, mesh, operand_types, result_types) -> SdyShardingRule:
    lead = tuple(f"l{i}" for i in range(len(operand_types[0].shape) - 1))
    x = ArrayMapping(*lead, "t")
    # the scales' block axis and the group sizes stay whole
    return SdyShardingRule((x, ArrayMapping("g")), (x, ArrayMapping(*lead, "b")),
                           need_replication_factors=("g", "b"))


def _body(call: Call, x, sizes):
    with sharding.unmeshed():
        return call.local(x, sizes, x.shape[-1], 0, None)


partitioned = custom_partitioning(_body, static_argnums=(0,))
partitioned.def_partition(partition=_partition, infer_sharding_from_operands=_infer, sharding_rule=_sdy_rule,
                          decode_shardings=False)


# -- the primitive: one shard's quantizer where the call runs as one, else the rule above --------

grouped_p = sharding.VaryingPrimitive("jax_cute_quantize_grouped")
grouped_p.multiple_results = True


def quantize_grouped(x, sizes, local: Local):
    """(values, scales) of ``local`` on x (..., T) and the group sizes, partitioned as above."""
    return grouped_p.bind(x, sizes, call=Call(local))


def _whole(call: Call) -> Callable:
    return lambda x, sizes: call.local(x, sizes, x.shape[-1], 0, None)


def _abstract_eval(x, sizes, *, call: Call):
    out = jax.eval_shape(_whole(call), jax.ShapeDtypeStruct(x.shape, x.dtype),
                         jax.ShapeDtypeStruct(sizes.shape, sizes.dtype))
    return [sharding.varying_aval(o.shape, o.dtype, (x, sizes)) for o in out]   # (varying as x inside shard_map)


def _lowering(ctx, x, sizes, *, call: Call):
    fn = _whole(call) if sharding.one_shard(ctx.module_context.axis_context) else functools.partial(partitioned, call)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, x, sizes)


def _batch(args, dims, *, call: Call):
    (x, sizes), (bx, bs) = args, dims
    if bs is None:   # a batch of operands: one more leading axis
        return grouped_p.bind(jnp.moveaxis(x, bx, 0), sizes, call=call), (0, 0)
    return jax.vmap(_whole(call), in_axes=(bx, bs))(x, sizes), (0, 0)   # each its own groups


def _jvp(primals, tangents, *, call: Call):
    x, sizes = primals
    out, tan = jax.jvp(lambda a: _whole(call)(a, sizes), (x,), (ad.instantiate_zeros(tangents[0]),))
    return out, tan


grouped_p.def_impl(lambda x, sizes, *, call: jax.jit(functools.partial(grouped_p.bind, call=call))(x, sizes))
grouped_p.def_abstract_eval(_abstract_eval)
jax_dispatch.prim_requires_devices_during_lowering.add(grouped_p)   # (custom_partitioning's lowering)
mlir.register_lowering(grouped_p, _lowering)
batching.primitive_batchers[grouped_p] = _batch
ad.primitive_jvps[grouped_p] = _jvp
