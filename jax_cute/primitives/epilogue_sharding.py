"""Partitioning rules of the epilogue GEMM primitives: ``jax_cute_matmul_fused`` (``act(A·B +
bias)``) and ``jax_cute_matmul_dact`` (``act'(Z) ⊙ A·B``).

Their operand past A and B (the bias, Z) is read at C's (M, N, L) coordinates through a layout
of its own, so it joins the GEMM's factor model (``sharding.problem``'s ``extra``): each of its
buffer axes shards with the C factors it steps along, and a broadcast mode (stride 0) holds none.
What each kind of sharded factor does:
- M, N, L: each shard runs the fused computation (on CUDA its kernel) on its blocks, the
  epilogue operand's block included; no communication.
- K: each shard's GEMM with a float32 result, ``psum`` over K's mesh axes, then the epilogue in
  XLA on the summed block, so the bias is added once and the activation sees the whole sum.
- N under a gated activation (swiglu pairs column j with j + N/2): kept whole.
Unlike the plain GEMM there is no reduce-scatter of the result: a K-sharded call sums whole
blocks before its epilogue. With ``collective_matmul`` on, a partitioned call keeps the plain
GEMM's rules instead (its GEMM primitive takes the ring, the epilogue runs in XLA). On one
device, and inside a shard_map body, a call lowers to its one-shard computation directly.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec

from jax_cute import config
from jax_cute.activations import epilogue_dtype, is_gated
from jax_cute.primitives import sharding
from jax_cute.primitives.gemm import matmul_p
from jax_cute.primitives.rules import as_list
from jax_cute.problem.gemm_layouts import GemmLayouts

# (avals, params, whole) -> the one-shard computation, returning its results as a list; ``whole``
# is (avals, params) of the unsharded call whose split-K the shard's kernel keeps, or None
Local = Callable[..., Callable]
# (float32 accumulator in C's buffer, epilogue operands, **params) -> the results, as a list
Finish = Callable[..., list]


@dataclasses.dataclass(frozen=True)
class _Call:
    """Static part of one partitioned call."""

    params: tuple[tuple[str, object], ...]
    local: Local
    finish: Finish
    extra: str  # the param holding the epilogue operand's layout
    float32_sums: bool

    @property
    def kwargs(self) -> dict:
        return dict(self.params)


def _problem(call: _Call, shapes) -> sharding.Problem:
    kw = call.kwargs
    shapes = [tuple(s) for s in shapes]
    extra = {call.extra.removesuffix("_layout"): kw[call.extra]} if len(shapes) > 2 else None
    return sharding.problem(kw["layouts"], shapes, extra, whole="n" if is_gated(kw.get("activation")) else "")


def _shapes(tree) -> list:
    return list(tree) if isinstance(tree, (tuple, list)) else [tree]


def _result_shardings(mesh, p: sharding.Problem, pl: sharding.Plan, results) -> tuple:
    """Each result as C is sharded, but unsharded along an axis of another extent (swiglu's N/2)."""
    c = p.operands[-1]
    spec = tuple(pl.spec(c)) + (None,) * len(c.shape)
    out = []
    for r in results:
        parts = [spec[i] if n == c.shape[i] else None for i, n in enumerate(r.shape)]
        out.append(NamedSharding(mesh, PartitionSpec(*parts)))
    return tuple(out)


def _plan(call: _Call, mesh, arg_shapes, result_shape=None) -> tuple[sharding.Problem, sharding.Plan]:
    p = _problem(call, [s.shape for s in arg_shapes])
    specs = [sharding.spec_of(s.sharding, len(s.shape), mesh) for s in arg_shapes]
    out_spec = None
    if result_shape is not None:
        first = _shapes(result_shape)[0]
        out_spec = sharding.spec_of(first.sharding, len(first.shape), mesh)
    # (no reduce-scatter: the epilogue needs whole sums)
    return p, dataclasses.replace(sharding.plan(p, dict(mesh.shape), specs, out_spec), scatter=None)


def _partition(call: _Call, mesh, arg_shapes, result_shape):
    params = call.kwargs
    p, pl = _plan(call, mesh, arg_shapes, result_shape)
    lays, shapes = sharding.localized(p, pl, dict(mesh.shape))
    local = GemmLayouts(lays["a"], lays["b"], lays["c"], shapes[-1])
    names = [o.name for o in p.operands]
    extra = lays[names[2]] if len(arg_shapes) > 2 else params[call.extra]
    local_params = {**params, "layouts": local, call.extra: extra}
    whole = (sharding.plain_avals(arg_shapes), params) if call.float32_sums and not pl.reduce else None
    epi = epilogue_dtype(params["acc_dtype"]).name

    @sharding.traced_unmeshed
    def lower_fn(*args):
        if not pl.reduce:
            return call.local(sharding.plain_avals(args), local_params, whole)(*args)
        # K sharded: float32 partial products, summed, then the epilogue once on the sum
        acc = matmul_p.bind(args[0], args[1], layouts=local, out_dtype=epi, acc_dtype=params["acc_dtype"],
                            precision=params.get("precision"))
        return call.finish(jax.lax.psum(acc, pl.reduce), *args[2:], **local_params)

    arg_shardings = tuple(NamedSharding(mesh, pl.spec(o)) for o in p.operands[:-1])
    return mesh, lower_fn, list(_result_shardings(mesh, p, pl, _shapes(result_shape))), arg_shardings


def _infer(call: _Call, mesh, arg_shapes, result_shape):
    p, pl = _plan(call, mesh, arg_shapes)
    return list(_result_shardings(mesh, p, pl, _shapes(result_shape)))


def _rule(call: _Call, mesh, operand_types, result_types):
    p = _problem(call, [tuple(t.shape) for t in operand_types])
    return sharding.sharding_rule(p, [tuple(t.shape) for t in result_types])


def _body(call: _Call, *args):
    with sharding.unmeshed():
        return jax.jit(call.local(sharding.plain_avals(args), call.kwargs, None))(*args)


_partitioned = custom_partitioning(_body, static_argnums=(0,))
_partitioned.def_partition(partition=_partition, infer_sharding_from_operands=_infer, sharding_rule=_rule,
                           decode_shardings=False)


def lowering(local: Local, finish: Finish, composed: Callable, extra: str) -> Callable:
    """The MLIR lowering rule of an epilogue primitive whose one-shard computation is ``local``
    (returning its results as a list) and whose epilogue on a float32 accumulator is ``finish``;
    ``extra`` names the param with the layout of its operand past A and B. With
    ``collective_matmul`` on, a partitioned call runs ``composed`` (the GEMM primitive, which
    can take a ring, then the epilogue in XLA) instead of these rules."""
    @sharding.typed_results
    def rule(ctx, *args, **params):
        if sharding.one_shard(ctx.module_context.axis_context):
            fn = local(ctx.avals_in, params, None)
        elif config.collective_matmul():
            fn = as_list(functools.partial(composed, **params))
        else:
            call = _Call(tuple(sorted(params.items())), local, finish, extra, config.float32_partial_sums())
            fn = functools.partial(_partitioned, call)
        return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)
    return rule

