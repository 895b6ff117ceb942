"""Fused epilogues: ``act(A·B + bias)`` as one primitive, ``jax_cute_matmul_fused``.

The product is the one ``jax_cute_matmul`` computes (the same ``GemmLayouts``; its C buffer is
the pre-activation ``z``); the epilogue adds a bias read through a layout of its own and applies
an activation, in float32 (or the accumulator's wider dtype) on the accumulator, rounding once to
the output dtype. ``swiglu`` reads C's last buffer axis (N) as ``[gate | up]`` and writes
``silu(gate) * up``, N/2 columns.

One place for each rule, as in ``matmul.py``:
- abstract evaluation: ``y`` (and, with ``preact``, the pre-activation ``z``);
- lowering (CPU, and wherever no fused kernel runs): the GEMM primitive with a float32 output,
  then the epilogue in XLA (``composed``), which XLA fuses into one elementwise pass;
- CUDA: ``dispatch.gemm``'s kernel, whose epilogue adds the bias and applies the activation
  (swiglu: each tile holds gate columns and the up columns they pair with) and, with
  ``preact``, also writes ``z``; otherwise ``composed``;
- partitioning (both lowerings, ``epilogue_sharding.py``): the bias shards with the C blocks it
  is read at; each shard runs the call on its blocks, and a sharded K sums float32 partial
  products before the epilogue (``finish``);
- batching: ``rules.batch_rule``, a vmapped axis an L sub-mode of every operand, the bias
  included (stride 0 where it is unbatched);
- autodiff: the JVP binds the primitive with ``preact=True``, so the forward also writes the
  pre-activation ``z`` (rounded to the output dtype, by the same kernel) as the residual; the tangent is
  ``act'(z) * (dA·B + A·dB + dbias)``. Reverse mode transposes that: the cotangent times
  ``act'(z)`` (one XLA elementwise pass feeding both gradient GEMMs and the bias reduction),
  then the two GEMMs of ``jax_cute_matmul``'s transpose rules and a sum for the bias.
  Saving ``z`` costs one extra output write in the forward; recomputing it instead is
  ``jax.checkpoint`` around the call (the backward then reruns the forward GEMM):
  benchmarks/bench_fused.py measures both.

The GEMM primitive is ``gemm.matmul_p``; the public ``matmul`` (``matmul.py``) binds this one.

``ragged_dot``'s options are the same epilogue on the grouped GEMM: ``ragged_fused.py``.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad, mlir
from jax.interpreters import partial_eval as pe

from jax_cute import layout as L
from jax_cute.activations import (apply_activation, check_activation, check_gated_columns, derivative_times, elementwise,
                                  epilogue_dtype, is_gated, output_columns)
from jax_cute.dispatch import GemmRequest
from jax_cute.layout import Layout
from jax_cute.primitives.dact import align_batch, operand_p
from jax_cute.primitives.gemm import matmul_p
from jax_cute.primitives import epilogue_sharding
from jax_cute.primitives.rules import batch_rule, composed_local, epilogue_local, gemm_primitive
from jax_cute.primitives.sharding import result_aval
from jax_cute.problem.gemm_layouts import GemmLayouts, batched_layout


def check_float(op: str, out_dtype, bias) -> None:
    if not jnp.issubdtype(out_dtype, jnp.floating):
        raise TypeError(f"jax_cute.{op}: bias and activation need a real floating output dtype, got {out_dtype}")
    if bias is not None and not jnp.issubdtype(bias.dtype, jnp.floating):
        raise TypeError(f"jax_cute.{op}: bias must be a real floating array, got dtype {bias.dtype}")


def checked_options(op: str, out_dtype, bias, activation):
    """``bias`` as an array (or None), after the checks every fused entry point makes: a known
    activation, and a real floating output dtype and bias."""
    check_activation(op, activation)
    bias = None if bias is None else jnp.asarray(bias)
    check_float(op, np.dtype(out_dtype), bias)
    return bias


# -- the primitive ------------------------------------------------------------------------------

def _y_shape(layouts: GemmLayouts, activation) -> tuple[int, ...]:
    c = tuple(layouts.c_shape)
    return c[:-1] + (output_columns(activation, c[-1]),)


def _split_z(rest: tuple, act_operand) -> tuple[tuple, object]:
    """(bias operands, Z or None) of the operands after A and B."""
    return (rest[:-1], rest[-1]) if act_operand is not None else (rest, None)


def _abstract_eval(a, b, *rest, layouts: GemmLayouts, bias_layout, activation, preact, out_dtype,
                   acc_dtype, precision=None, act_operand=None):
    del acc_dtype, precision
    bias, z = _split_z(rest, act_operand)
    if z is not None and tuple(z.shape) != tuple((a if act_operand[0] == "a" else b).shape):
        raise ValueError(f"jax_cute_matmul_fused: Z {z.shape} is not shaped like operand {act_operand[0]}")
    if int(np.prod(a.shape)) < layouts.a.cosize() or int(np.prod(b.shape)) < layouts.b.cosize():
        raise ValueError(f"jax_cute_matmul_fused: layouts {layouts.a} / {layouts.b} reach past buffers "
                         f"{a.shape} / {b.shape}")
    if bias and int(np.prod(bias[0].shape)) < bias_layout.cosize():
        raise ValueError(f"jax_cute_matmul_fused: bias layout {bias_layout} reaches past its buffer {bias[0].shape}")
    if is_gated(activation):
        n_mode = layouts.c.mode(1).coalesce().flat_modes()
        if n_mode != ((layouts.c_shape[-1], 1),):
            raise ValueError(f"jax_cute_matmul_fused: {activation} needs N as C's last buffer axis ({layouts.c})")
    typed = functools.partial(result_aval, "jax_cute_matmul_fused", layouts, (a, b, *bias), np.dtype(out_dtype),
                              {"bias": ("mnl", bias_layout)} if bias else None, "n" if is_gated(activation) else "")
    out = [typed(shape=_y_shape(layouts, activation))]
    if preact:
        out.append(typed())
    return out


fused_p = gemm_primitive("jax_cute_matmul_fused", _abstract_eval, multiple_results=True)


def _bias_in_c(bias, bias_layout: Layout, layouts: GemmLayouts, dtype):
    """The bias as a buffer shaped like C (broadcast where its layout has stride 0)."""
    return L.write(L.read(bias, bias_layout).astype(dtype), layouts.c, layouts.c_shape)


def _bias_term(bias, bias_layout: Layout, layouts: GemmLayouts, dtype, like):
    """``_bias_in_c``, typed as ``like`` (a result shaped like C): where the bias broadcasts
    along whole axes of C by numpy's rules, one broadcast whose transpose sums each shard's
    block before summing across shards (``L.read``'s reshapes, typed replicated under Explicit
    mesh axes, would gather C's whole cotangent onto every device for the bias gradient)."""
    c_shape, nd = tuple(layouts.c_shape), bias.ndim
    if nd > len(c_shape) or any(x not in (1, y) for x, y in zip(bias.shape, c_shape[len(c_shape) - nd:])):
        return _bias_in_c(bias, bias_layout, layouts, dtype)
    own = L.row_major(tuple(bias.shape)).stride
    strides = [0] * (len(c_shape) - nd) + [s if x > 1 else 0 for x, s in zip(bias.shape, own)]
    if L.reindex(layouts.c, c_shape, strides) != bias_layout:
        return _bias_in_c(bias, bias_layout, layouts, dtype)
    return jax.lax.broadcast_in_dim(bias.astype(dtype), c_shape, tuple(range(len(c_shape) - nd, len(c_shape))),
                                    out_sharding=jax.typeof(like).sharding)


def epilogue(acc, bias, *, layouts: GemmLayouts, bias_layout, activation, preact, out_dtype) -> list:
    """``[act(acc + bias)]`` (and ``z = acc + bias`` with ``preact``), each rounded once to
    ``out_dtype``; ``acc`` is the GEMM's result in C's buffer, in the epilogue dtype."""
    z = acc if bias is None else acc + _bias_in_c(bias, bias_layout, layouts, acc.dtype)
    return activated(z, activation=activation, preact=preact, out_dtype=out_dtype)


def activated(z, *, activation, preact, out_dtype) -> list:
    """``[act(z)]`` (and ``z`` itself with ``preact``), each rounded once to ``out_dtype``."""
    out = [apply_activation(activation, z).astype(out_dtype)]
    if preact:
        out.append(z.astype(out_dtype))
    return out


def finish(acc, *bias, layouts: GemmLayouts, bias_layout, activation, preact, out_dtype, acc_dtype,
           precision=None) -> list:
    """The epilogue in XLA on the GEMM's float32 (epilogue dtype) result ``acc``."""
    del acc_dtype, precision
    return epilogue(acc, bias[0] if bias else None, layouts=layouts, bias_layout=bias_layout,
                    activation=activation, preact=preact, out_dtype=out_dtype)


def composed(a, b, *bias, layouts: GemmLayouts, acc_dtype, precision=None, **params) -> list:
    """The GEMM primitive with a float32 (epilogue dtype) output, then the epilogue in XLA."""
    acc = matmul_p.bind(a, b, layouts=layouts, out_dtype=epilogue_dtype(acc_dtype).name, acc_dtype=acc_dtype,
                        precision=precision)
    return finish(acc, *bias, layouts=layouts, acc_dtype=acc_dtype, **params)


def reference(a, b, *bias, layouts: GemmLayouts, bias_layout, activation, preact, out_dtype, acc_dtype,
              precision=None) -> list:
    """The fused GEMM in plain lax ops (the first-use check of unverified kernels compares to it)."""
    acc = epilogue_dtype(acc_dtype)
    av, bv = L.read(a, layouts.a).astype(acc), L.read(b, layouts.b).astype(acc)
    cv = jax.lax.dot_general(av, bv, (((1,), (1,)), ((2,), (2,))), precision=precision,
                             preferred_element_type=acc)  # (L, M, N)
    c = L.write(jnp.transpose(cv, (1, 2, 0)), layouts.c, layouts.c_shape)
    return epilogue(c, bias[0] if bias else None, layouts=layouts, bias_layout=bias_layout,
                    activation=activation, preact=preact, out_dtype=out_dtype)


def _without_z(rule: Callable) -> Callable:
    """A lowering rule of the call without Z: the product never reads it, only its JVP does."""
    def lowered(ctx, *args, act_operand=None, **params):
        if act_operand is not None:
            args, ctx = args[:-1], ctx.replace(avals_in=ctx.avals_in[:-1])
        return rule(ctx, *args, **params)
    return lowered


# Both lowerings go through the partitioning rules (primitives/epilogue_sharding.py)
_BIAS = epilogue_sharding.layout_param("bias", "bias_layout")
mlir.register_lowering(fused_p, _without_z(epilogue_sharding.lowering(composed_local(composed), finish, composed, _BIAS,
                                                                      matmul_p)))


def _request(avals: tuple, params: dict) -> GemmRequest:
    return GemmRequest(avals, params["layouts"], params["out_dtype"], params["acc_dtype"], epilogue=True,
                       bias=len(avals) > 2, bias_layout=params["bias_layout"], activation=params["activation"],
                       preact=params["preact"], precision=params.get("precision"))


mlir.register_lowering(fused_p, _without_z(epilogue_sharding.lowering(epilogue_local(_request, reference, composed),
                                                                      finish, composed, _BIAS, matmul_p)),
                       platform="cuda")


# -- batching -----------------------------------------------------------------------------------

def _batch_operands(args: list, dims: list, size: int, params: dict) -> tuple[list, list, dict]:
    """The bias's layout batched as the operands', and Z given its operand's batch axis (it is
    read as that operand is; an unbatched operand of a batched Z cannot be act(Z): the chain is
    dropped, the product stays as it is)."""
    act_operand = params.get("act_operand")
    (a, b, *bias), z = _split_z(tuple(args), act_operand)
    if act_operand is not None:
        (_, dz), d_op = _split_z(tuple(dims), act_operand), dims[0 if act_operand[0] == "a" else 1]
        if d_op is None and dz is not None:
            params["act_operand"], z = None, None
            args, dims = args[:-1], dims[:-1]
        elif dz != d_op:
            args[-1], dims[-1] = align_batch(z, dz, size, d_op), d_op
    if bias:
        params["bias_layout"] = batched_layout(params["bias_layout"], bias[0].shape, dims[2], size, 2)
    return args, dims, params


batch_rule(fused_p, _batch_operands)


# -- autodiff -----------------------------------------------------------------------------------

def _jvp(primals, tangents, *, layouts: GemmLayouts, bias_layout, activation, preact, out_dtype,
         acc_dtype, precision=None, act_operand=None):
    (a, b, *bias), z = _split_z(tuple(primals), act_operand)
    (da, db, *dbias), dz_op = _split_z(tuple(tangents), act_operand)
    params = dict(layouts=layouts, bias_layout=bias_layout, activation=activation,
                  out_dtype=out_dtype, acc_dtype=acc_dtype, precision=precision)
    outs = fused_p.bind(a, b, *bias, preact=activation is not None or preact, **params)
    epi = epilogue_dtype(acc_dtype)
    # dz = dA·B + A·dB + dbias, in the epilogue dtype; each GEMM's transpose rounds its
    # cotangent to the operand dtype, as jax_cute_matmul's do. An operand that is act(Z) (a
    # chain: act_operand) takes its term as act'(Z)·dZ through dact.operand_p, whose transpose
    # puts the derivative into the gradient GEMM's epilogue; dA = act'(Z)·dZ itself is not read.
    terms = []
    gemm_params = dict(layouts=layouts, out_dtype=epi.name, acc_dtype=acc_dtype, precision=precision)
    for which, d_op in (("a", da), ("b", db)):
        x, w = (a, b) if which == "a" else (b, a)
        if act_operand is not None and act_operand[0] == which:
            if type(dz_op) is not ad.Zero:
                terms.append(operand_p.bind(dz_op, w, z, which=which, activation=act_operand[1],
                                            **gemm_params))
        elif type(d_op) is not ad.Zero:
            terms.append(matmul_p.bind(*((d_op, w) if which == "a" else (w, d_op)), **gemm_params))
    if bias and type(dbias[0]) is not ad.Zero:
        terms.append(_bias_term(dbias[0], bias_layout, layouts, epi, outs[-1]))
    return epilogue_tangents(outs, terms, activation=activation, preact=preact, out_dtype=out_dtype, epi=epi)


ad.primitive_jvps[fused_p] = _jvp


def _dce(used_outs: list[bool], *rest):
    """Dead-code elimination (JAX calls it as (used_outs, eqn), or (used_outs, live_ins, eqn)):
    Z is dropped, since only the JVP reads it, and an unread pre-activation output is not
    written, so ``kernelize``'s chained calls cost nothing outside autodiff."""
    eqn = rest[-1]
    if not any(used_outs):
        return [False] * len(eqn.invars), None
    params, invars, outvars = dict(eqn.params), list(eqn.invars), list(eqn.outvars)
    used = [True] * len(invars)
    if params.get("act_operand") is not None:
        params["act_operand"], used[-1], invars = None, False, invars[:-1]
    if params["preact"] and len(outvars) == 2 and not used_outs[1]:
        params["preact"], outvars = False, outvars[:1]
    if params == eqn.params:
        return used, eqn
    return used, eqn.replace(params=params, invars=invars, outvars=outvars)


pe.dce_rules[fused_p] = _dce


def epilogue_tangents(outs: list, terms: list, *, activation, preact: bool, out_dtype, epi) -> tuple[list, list]:
    """(primal outputs, their tangents) of a fused GEMM's JVP: ``outs`` the call bound with
    ``preact=True`` where there is an activation ([y, z]), ``terms`` the tangent of z's sum in the
    epilogue dtype ``epi`` (none: zero tangents). The output list is [y] (and z with ``preact``)."""
    if not terms:
        zeros = [ad.Zero(jax.typeof(o).to_tangent_aval()) for o in outs]
        return (outs if preact or activation is None else outs[:1]), (zeros if preact or activation is None
                                                                      else zeros[:1])
    dz = functools.reduce(jnp.add, terms)
    if activation is None:
        return outs, [dz.astype(out_dtype)] * len(outs)
    y, z = outs
    dy = derivative_times(activation, z, dz, epi)
    if preact:
        return [y, z], [dy.astype(out_dtype), dz.astype(out_dtype)]
    return [y], [dy.astype(out_dtype)]


# -- public entry points --------------------------------------------------------------------------

def check_bias_broadcasts(op: str, bias_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> None:
    if len(bias_shape) > len(out_shape) or any(x not in (1, y) for x, y in zip(bias_shape[::-1], out_shape[::-1])):
        raise ValueError(f"jax_cute.{op}: bias of shape {tuple(bias_shape)} does not broadcast to the product's "
                         f"shape {tuple(out_shape)}")


def broadcast_bias_layout(op: str, bias_shape: tuple[int, ...], out_shape: tuple[int, ...],
                          layouts: GemmLayouts) -> Layout:
    """The layout that reads a bias of ``bias_shape``, broadcast against the pre-activation
    product's shape ``out_shape`` by numpy's rules, at C's (M, N, L) coordinates: stride 0 along
    every axis it is broadcast over, so nothing is materialized. C's buffer (``c_shape``) is
    ``out_shape`` with unit axes inserted (``matmul``'s 1-D operands)."""
    check_bias_broadcasts(op, bias_shape, out_shape)
    own = L.row_major(bias_shape).stride
    per_out = [0] * (len(out_shape) - len(bias_shape)) + [s if x > 1 else 0 for x, s in zip(bias_shape, own)]
    wide = iter([(x, s) for x, s in zip(out_shape, per_out) if x > 1])
    c_strides = [next(wide)[1] if x > 1 else 0 for x in layouts.c_shape]
    lay = L.reindex(layouts.c, layouts.c_shape, c_strides)
    assert lay is not None, (layouts.c, layouts.c_shape)  # C's sub-modes each index one output axis
    return lay


def epilogue_call(op: str, a, b, layouts: GemmLayouts, out_shape: tuple[int, ...], *, bias, activation,
                  out_dtype, acc_dtype, precision=None, preact: bool = False, act_operand=None):
    """``act(a' @ b' + bias)`` for ``jax_cute.{op}``: ``a``, ``b`` already of one dtype, ``layouts``
    the product's and ``out_shape`` its result's shape (with swiglu: the pre-activation's, whose
    last axis, N, holds [gate | up]).

    ``bias`` broadcasts against ``out_shape`` by numpy's rules: (N,) (one bias per column, what
    the kernels read), the full shape, or anything between.

    For ``kernelize``'s chains of two products (``dact.py``): ``preact`` returns ``(y, z)``, the
    pre-activation too (an elementwise activation), shaped like ``y``; ``act_operand`` =
    (``"a"`` or ``"b"``, activation, z) says that operand is ``act(z)`` of such a call, so the
    backward GEMM of that operand applies the activation's derivative in its epilogue."""
    out_dtype = np.dtype(out_dtype)
    bias = checked_options(op, out_dtype, bias, activation)
    out_shape = tuple(out_shape)
    if is_gated(activation):
        n_mode = layouts.c.mode(1).coalesce().flat_modes()
        if not out_shape or n_mode not in (((out_shape[-1], 1),), ((1, 0),)) or layouts.c_shape[-1] != out_shape[-1]:
            raise ValueError(f"jax_cute.{op}: {activation} needs the product's last axis to be its only N (rhs free) "
                             f"axis, holding [gate | up]; the product's shape is {out_shape}")
        check_gated_columns(op, activation, out_shape[-1])
    if preact and not elementwise(activation):
        raise ValueError(f"jax_cute.{op}: the pre-activation output takes an elementwise activation, not {activation}")
    bias_layout, args = None, [a, b]
    if bias is not None:
        bias_layout = broadcast_bias_layout(op, tuple(bias.shape), out_shape, layouts)
        args.append(bias)
    if act_operand is not None:
        which, act, z = act_operand
        args.append(jnp.reshape(z, (a if which == "a" else b).shape))
        act_operand = (which, act)
    outs = fused_p.bind(*args, layouts=layouts, bias_layout=bias_layout, activation=activation,
                        preact=preact, out_dtype=out_dtype.name, acc_dtype=np.dtype(acc_dtype).name,
                        precision=precision, act_operand=act_operand)
    shape = out_shape[:-1] + (output_columns(activation, out_shape[-1]),) if out_shape else out_shape
    outs = [jnp.reshape(x, shape) if x.shape != shape else x for x in outs]
    return tuple(outs) if preact else outs[0]
