"""``ragged_dot``'s fused epilogue as one primitive, ``jax_cute_ragged_fused``:
``act(lhs[m] @ rhs[g] + bias[g])`` for the rows m of group g, rows past the last group zero.

The product is the one ``jax_cute_ragged_m`` computes (same ``RaggedLayouts``); the epilogue adds
the bias row (G, N) of each row's group and applies the activation (``fused.py``'s, swiglu
included) in float32, rounding once. Rows past the last group take no bias, and every
activation maps their zeros to zero. One place for each rule, as in ``fused.py``:
- abstract evaluation: ``y`` (N/2 columns with swiglu) and, with ``preact``, the
  pre-activation ``z`` (M, N);
- lowering (CPU, and wherever no fused kernel runs): the grouped GEMM primitive with a float32
  output, then the epilogue in XLA (``composed``);
- CUDA: ``dispatch.gemm``'s kernel (bias row per tile's group, activation, ``z`` stored
  clipped at group ends like y); otherwise ``composed``;
- partitioning (both lowerings, ``epilogue_sharding.py``): each shard of the rows runs the call
  on its rows with group sizes derived from the global ones, the bias sharded along N with the
  weight; a sharded K sums float32 partial products before the epilogue (``finish``);
- batching: ``rules.batch_rule``, a vmapped axis an L sub-mode of the operands and a leading
  axis of the bias (..., G, N), extent 1 where the bias is shared; the fused kernel runs the
  whole batch (a gated activation: one batch only);
- autodiff: the JVP binds the primitive with ``preact=True``, so the forward kernel also writes
  ``z`` as the residual; the tangent is ``act'(z) * (dA·B + A·dB + dbias[g])`` (the grouped GEMM
  primitive's transposes give the gradient GEMMs, the bias rows' transpose a per-group sum).

The grouped GEMM primitive is ``grouped.ragged_m_p``; ``ragged_dot`` binds this one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad, mlir
from jax.sharding import PartitionSpec

from jax_cute.dispatch import GemmRequest
from jax_cute import layout as L
from jax_cute.activations import check_gated_columns, epilogue_dtype, is_gated, output_columns
from jax_cute.primitives.fused import activated, checked_options, epilogue_tangents
from jax_cute.primitives.grouped import ragged_m_p
from jax_cute.layout import Layout, make_layout
from jax_cute.primitives import epilogue_sharding
from jax_cute.primitives.rules import batch_rule, composed_local, epilogue_local, gemm_primitive
from jax_cute.primitives.sharding import result_aval
from jax_cute.problem.ragged_layouts import RaggedLayouts
from jax_cute.primitives.ragged_reference import row_groups
from jax_cute.primitives.ragged_reference import reference as gemm_reference

def _abstract_eval(a, b, gs, *bias, layouts: RaggedLayouts, activation, preact, out_dtype, acc_dtype,
                   precision=None):
    del acc_dtype, precision
    c_shape = tuple(layouts.c_shape)   # (M, N), with vmapped batch axes in front
    n = c_shape[-1]
    if bias and (bias[0].ndim != len(c_shape) or tuple(bias[0].shape[-2:]) != (layouts.extents()["g"], n)
                 or any(x not in (1, y) for x, y in zip(bias[0].shape[:-2], c_shape[:-2]))):
        raise ValueError(f"jax_cute_ragged_fused: bias {bias[0].shape} is not (..., G, N) for an output {c_shape}")
    # typed as the grouped GEMM's result (the bias, (..., G, N), shards no axis of its own)
    typed = functools.partial(result_aval, "jax_cute_ragged_fused", layouts, (a, b, gs), np.dtype(out_dtype),
                              whole="n" if is_gated(activation) else "")
    out = [typed(shape=c_shape[:-1] + (output_columns(activation, n),))]
    if preact:
        out.append(typed())
    return out


ragged_fused_p = gemm_primitive("jax_cute_ragged_fused", _abstract_eval, multiple_results=True)


def bias_rows(bias, group_sizes, m: int, dtype, lead: bool = False):
    """(M, N): row m holds ``bias[g]`` of its group g, zero in a lead (``lead``: the first size
    is one) and past the last group (group ends as ragged_dot's: negative sizes count as 0,
    ends clip at M)."""
    if lead:
        bias = jnp.concatenate([jnp.zeros((1, bias.shape[1]), bias.dtype), bias])
    _, row_group = row_groups(group_sizes, m)   # G: no group
    rows = jnp.concatenate([bias.astype(dtype), jnp.zeros((1, bias.shape[1]), dtype)])
    return jnp.take(rows, jnp.minimum(row_group, bias.shape[0]), axis=0)


def bias_in_c(bias, group_sizes, layouts: RaggedLayouts, dtype):
    """``bias_rows`` of every batch, shaped like C: ``bias`` (..., G, N) with a leading axis per
    batch axis of C (extent 1: shared), ``group_sizes`` read through its layout."""
    c_shape = tuple(layouts.c_shape)
    sizes = L.read(group_sizes, layouts.gs)   # (G or G + 1, L), L in C's batch order
    per_batch = jnp.broadcast_to(bias, c_shape[:-2] + bias.shape[-2:]).reshape((-1,) + bias.shape[-2:])
    one = lambda b, s: bias_rows(b, s, c_shape[-2], dtype, layouts.lead)  # noqa: E731
    rows = jax.vmap(one, in_axes=(0, 1))(per_batch, sizes)
    return rows.reshape(c_shape)


def _bias_term(bias, group_sizes, layouts: RaggedLayouts, dtype, like):
    """``bias_in_c`` of an unbatched call, its rows taken at row indices sharded as C's rows are
    (``like``: a result typed as C), so that under Explicit mesh axes the bias gradient (the
    transpose) sums each shard's rows before summing across shards rather than gathering C's
    whole cotangent onto every device."""
    spec = tuple(jax.typeof(like).sharding.spec)
    if bias.ndim != 2 or len(layouts.c_shape) != 2 or not spec or spec[0] is None:
        return bias_in_c(bias, group_sizes, layouts, dtype)
    sizes = L.read(group_sizes, layouts.gs)[:, 0]
    zero = jnp.zeros_like(bias[:1], dtype)  # (typed as the bias: concatenated with it)
    bias = bias.astype(dtype)
    if layouts.lead:
        bias = jnp.concatenate([zero, bias])
    _, row_group = row_groups(sizes, layouts.c_shape[0])
    row_group = jax.sharding.reshard(jnp.minimum(row_group, bias.shape[0]), PartitionSpec(spec[0]))
    rows = jnp.concatenate([bias, zero])
    return rows.at[row_group].get(out_sharding=PartitionSpec(*spec))


def epilogue(acc, group_sizes, bias, *, layouts: RaggedLayouts, activation, preact, out_dtype) -> list:
    """``[act(acc + bias rows)]`` (and ``z`` with ``preact``), each rounded once to ``out_dtype``;
    ``acc`` (C's buffer) is the grouped product in the epilogue dtype."""
    z = acc if bias is None else acc + bias_in_c(bias, group_sizes, layouts, acc.dtype)
    return activated(z, activation=activation, preact=preact, out_dtype=out_dtype)


def finish(acc, gs, *bias, layouts: RaggedLayouts, activation, preact, out_dtype, acc_dtype,
           precision=None) -> list:
    """The epilogue in XLA on the grouped GEMM's float32 (epilogue dtype) result ``acc``."""
    del acc_dtype, precision
    return epilogue(acc, gs, bias[0] if bias else None, layouts=layouts, activation=activation, preact=preact,
                    out_dtype=out_dtype)


def composed(a, b, gs, *bias, layouts: RaggedLayouts, acc_dtype, precision=None, **params) -> list:
    """The grouped GEMM primitive with a float32 (epilogue dtype) output, then the epilogue in XLA."""
    acc = ragged_m_p.bind(a, b, gs, layouts=layouts, out_dtype=epilogue_dtype(acc_dtype).name, acc_dtype=acc_dtype,
                          precision=precision)
    return finish(acc, gs, *bias, layouts=layouts, acc_dtype=acc_dtype, **params)


def reference(a, b, gs, *bias, layouts: RaggedLayouts, activation, preact, out_dtype, acc_dtype,
              precision=None) -> list:
    """The fused grouped GEMM in plain lax ops (the first-use check of unverified kernels)."""
    acc = gemm_reference(a, b, gs, layouts=layouts, out_dtype=epilogue_dtype(acc_dtype), acc_dtype=acc_dtype,
                         precision=precision)
    return epilogue(acc, gs, bias[0] if bias else None, layouts=layouts, activation=activation, preact=preact,
                    out_dtype=out_dtype)


def _read_bias(params: dict, shape: tuple) -> tuple[str, Layout] | None:
    """The bias (..., G, N) as modes (N, G, L) for the partitioning rules: its leading axes are
    C's batch axes (extent 1: shared, stride 0); None where C's layout does not take its strides."""
    layouts = params["layouts"]
    own = L.row_major(shape).stride
    at_c = L.reindex(layouts.c, tuple(layouts.c_shape), [s if x > 1 else 0 for x, s in zip(shape[:-2], own[:-2])]
                     + [0, 1])   # C's (M, N, L) re-targeted at the bias: rows broadcast, columns its own
    if at_c is None:
        return None
    return "ngl", make_layout(at_c.mode(1), Layout((shape[-2],), (shape[-1],)), at_c.mode(2))


# Both lowerings go through the partitioning rules (primitives/epilogue_sharding.py)
_BIAS = epilogue_sharding.Operand("bias", _read_bias, lambda params, lay: params)
mlir.register_lowering(ragged_fused_p, epilogue_sharding.lowering(composed_local(composed), finish, composed, _BIAS,
                                                                  ragged_m_p))


def _request(avals: tuple, params: dict) -> GemmRequest:
    return GemmRequest(avals, params["layouts"], params["out_dtype"], params["acc_dtype"], epilogue=True,
                       bias=len(avals) > 3, activation=params["activation"], preact=params["preact"],
                       precision=params.get("precision"))


mlir.register_lowering(ragged_fused_p, epilogue_sharding.lowering(epilogue_local(_request, reference, composed), finish,
                                                                  composed, _BIAS, ragged_m_p), platform="cuda")


def _batch_bias(args: list, dims: list, size: int, params: dict) -> tuple[list, list, dict]:
    """The bias's batch axis in front, as the output's (extent 1: shared)."""
    if len(args) > 3:
        args[3], dims[3] = jnp.expand_dims(args[3], 0) if dims[3] is None else jnp.moveaxis(args[3], dims[3], 0), 0
    return args, dims, params


batch_rule(ragged_fused_p, _batch_bias)


def _jvp(primals, tangents, *, layouts: RaggedLayouts, activation, preact, out_dtype, acc_dtype,
         precision=None):
    a, b, gs, *bias = primals
    da, db, _, *dbias = tangents   # group sizes are integers: no tangent
    params = dict(layouts=layouts, activation=activation, out_dtype=out_dtype, acc_dtype=acc_dtype,
                  precision=precision)
    outs = ragged_fused_p.bind(*primals, preact=activation is not None or preact, **params)
    epi = epilogue_dtype(acc_dtype)
    gemm_params = dict(layouts=layouts, out_dtype=epi.name, acc_dtype=acc_dtype, precision=precision)
    terms = []
    if type(da) is not ad.Zero:
        terms.append(ragged_m_p.bind(da, b, gs, **gemm_params))
    if type(db) is not ad.Zero:
        terms.append(ragged_m_p.bind(a, db, gs, **gemm_params))
    if bias and type(dbias[0]) is not ad.Zero:
        terms.append(_bias_term(dbias[0], gs, layouts, epi, outs[-1]))
    return epilogue_tangents(outs, terms, activation=activation, preact=preact, out_dtype=out_dtype, epi=epi)


ad.primitive_jvps[ragged_fused_p] = _jvp


def check_epilogue(rhs_shape: tuple[int, ...], out_dtype, bias, activation):
    """``ragged_dot``'s bias (G, N) as an array (or None), after the trace-time checks of it and
    the activation."""
    bias = checked_options("ragged_dot", out_dtype, bias, activation)
    g, _, n = rhs_shape
    check_gated_columns("ragged_dot", activation, n)
    if bias is not None and tuple(bias.shape) != (g, n):
        raise ValueError(f"jax_cute.ragged_dot: bias must have shape (G, N) = ({g}, {n}), got {tuple(bias.shape)}")
    return bias


def ragged_epilogue(lhs, rhs, group_sizes, layouts: RaggedLayouts, *, bias, activation, out_dtype, acc_dtype,
                    precision=None):
    """``act(lhs[m] @ rhs[g] + bias[g])`` for ``jax_cute.ragged_dot``: operands of one dtype,
    int32 ``group_sizes``, ``layouts`` from ``ragged_dot_layouts``."""
    bias = check_epilogue(rhs.shape, out_dtype, bias, activation)
    args = (lhs, rhs, group_sizes) + (() if bias is None else (bias,))
    y, = ragged_fused_p.bind(*args, layouts=layouts, activation=activation, preact=False,
                             out_dtype=np.dtype(out_dtype).name, acc_dtype=np.dtype(acc_dtype).name,
                             precision=precision)
    return y
