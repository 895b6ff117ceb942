"""Partitioning rules of the epilogue GEMM primitives: ``jax_cute_matmul_fused`` (``act(A·B +
bias)``), ``jax_cute_matmul_dact`` (``act'(Z) ⊙ A·B``) and ``jax_cute_ragged_fused`` (``ragged_dot``'s
bias row per group and activation).

Their operand past the GEMM's (the bias, Z) joins the GEMM's factor model through a layout
(``sharding.problem``'s ``extra``): the dense calls' is read at C's (M, N, L) coordinates, the
grouped call's bias (..., G, N) at (N, G, L). Each of its buffer axes shards with the factors
it steps along, a broadcast mode (stride 0) holds none, and G stays whole as for the grouped
GEMM. What each kind of sharded factor does:
- M, N, L: each shard runs the fused computation (on CUDA its kernel) on its blocks, the
  epilogue operand's block included; no communication. The grouped call's rows: each shard
  derives its group sizes from the global ones, as the grouped GEMM's rules do.
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
from jax_cute.layout import Layout
from jax_cute.primitives import sharding
from jax_cute.primitives.rules import as_list
from jax_cute.problem.ragged_layouts import RaggedLayouts

# (avals, params, whole) -> the one-shard computation, returning its results as a list; ``whole``
# is (avals, params) of the unsharded call whose split-K the shard's kernel keeps, or None
Local = Callable[..., Callable]
# (float32 accumulator in C's buffer, the operands after A and B, **params) -> the results, as a list
Finish = Callable[..., list]


@dataclasses.dataclass(frozen=True)
class Operand:
    """How the rules read an epilogue primitive's operand past its GEMM's (the bias, Z)."""

    name: str
    # (params, its buffer's shape) -> (its logical modes, its layout), or None: not expressible
    read: Callable[[dict, tuple], tuple[str, Layout] | None]
    # (params, its layout over the shard's buffer) -> the shard's params
    localized: Callable[[dict, Layout], dict]


def layout_param(name: str, param: str) -> Operand:
    """An operand read at C's (M, N, L) coordinates through the layout in ``params[param]``."""
    return Operand(name, lambda params, shape: ("mnl", params[param]),
                   lambda params, lay: {**params, param: lay})


@dataclasses.dataclass(frozen=True)
class _Call:
    """Static part of one partitioned call."""

    params: tuple[tuple[str, object], ...]
    local: Local
    finish: Finish
    operand: Operand
    gemm: object  # the GEMM primitive (jax_cute_matmul, jax_cute_ragged_m) a sharded K sums
    float32_sums: bool

    @property
    def kwargs(self) -> dict:
        return dict(self.params)


def _arity(layouts) -> int:
    """How many of a call's operands are its GEMM's (A, B, and a grouped GEMM's sizes)."""
    return 3 if isinstance(layouts, RaggedLayouts) else 2


def _extra(operand: Operand, params: dict, shapes) -> dict | None:
    n = _arity(params["layouts"])
    if len(shapes) <= n:
        return {}
    read = operand.read(params, tuple(shapes[n]))
    return None if read is None else {operand.name: read}


def _problem(call: _Call, shapes) -> sharding.Problem:
    kw = call.kwargs
    shapes = [tuple(s) for s in shapes]
    return sharding.problem(kw["layouts"], shapes, _extra(call.operand, kw, shapes),
                            whole="n" if is_gated(kw.get("activation")) else "")


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
    layouts = params["layouts"]
    ms = dict(mesh.shape)
    p, pl = _plan(call, mesh, arg_shapes, result_shape)
    lays, shapes = sharding.localized(p, pl, ms)
    local = sharding.rebuilt(layouts, lays, shapes[-1])
    local_params = {**params, "layouts": local}
    n = _arity(layouts)
    if len(arg_shapes) > n:
        local_params = call.operand.localized(local_params, lays[call.operand.name])
    whole = (sharding.plain_avals(arg_shapes), params) if call.float32_sums and not pl.reduce else None
    epi = epilogue_dtype(params["acc_dtype"]).name

    @sharding.traced_unmeshed
    def lower_fn(*args):
        args = sharding.shard_group_sizes(list(args), p, pl, ms, layouts, local, shapes)
        if not pl.reduce:
            return call.local(sharding.plain_avals(args), local_params, whole)(*args)
        # K sharded: float32 partial products, summed, then the epilogue once on the sum
        acc = call.gemm.bind(*args[:n], layouts=local, out_dtype=epi, acc_dtype=params["acc_dtype"],
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


def lowering(local: Local, finish: Finish, composed: Callable, operand: Operand, gemm) -> Callable:
    """The MLIR lowering rule of an epilogue primitive over the GEMM primitive ``gemm``, whose
    one-shard computation is ``local`` (its results as a list), whose epilogue on a float32
    accumulator is ``finish``, and whose operand past the GEMM's is read as ``operand`` says.
    With ``collective_matmul`` on, or an operand the rules cannot read, a partitioned call runs
    ``composed`` (the GEMM primitive, which partitions itself and can take a ring, then the
    epilogue in XLA) instead of these rules."""
    @sharding.typed_results
    def rule(ctx, *args, **params):
        if sharding.one_shard(ctx.module_context.axis_context):
            fn = local(ctx.avals_in, params, None)
        elif config.collective_matmul() or _extra(operand, params, [a.shape for a in ctx.avals_in]) is None:
            fn = as_list(functools.partial(composed, **params))
        else:
            call = _Call(tuple(sorted(params.items())), local, finish, operand, gemm, config.float32_partial_sums())
            fn = functools.partial(_partitioned, call)
        return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)
    return rule
