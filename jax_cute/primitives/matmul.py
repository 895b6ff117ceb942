"""The ``jax_cute_matmul`` primitive: a GEMM whose operands are read through layouts.

One place for each rule, as in ``jax/_src/lax``:
- abstract evaluation: the output buffer's shape and dtype;
- reference lowering (CPU, and the fallback everywhere): reads the buffers *through the
  layouts* with reshape/transpose/broadcast and contracts with ``dot_general``;
- CUDA lowering: the kernel ``jax_cute.dispatch.gemm`` picks (else the reference);
- batching: a vmapped axis becomes an L sub-mode (stride 0 on an unbatched operand), the
  layouts re-targeted at the batched buffers by composition, no data moved;
- autodiff: bilinear; each cotangent is another ``jax_cute_matmul`` over the same buffers with
  permuted modes (``gemm_layouts.cotangent_a``/``cotangent_b``).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad, batching, mlir

from jax_cute import dispatch
from jax_cute import layout as L
from jax_cute.fp8 import ops as fp8_ops
from jax_cute.kernels.gemm_spec import dtype_refusal
from jax_cute.primitives import collective, fused, sharding
from jax_cute.primitives.dot_dtypes import acc_dtype, hashable_precision, inputs_name, operand_dtypes
from jax_cute.primitives.gemm_layouts import (GemmLayouts, batched_gemm, cotangent_a, cotangent_a_partials,
                                               cotangent_b, cotangent_b_partials, matmul_layouts)
from jax_cute.primitives.gemm_plan import flatten_gemm

logger = logging.getLogger("jax_cute")

matmul_p = sharding.Primitive("jax_cute_matmul")


def _abstract_eval(a, b, *, layouts: GemmLayouts, out_dtype, acc_dtype, precision=None):
    if int(np.prod(a.shape)) < layouts.a.cosize() or int(np.prod(b.shape)) < layouts.b.cosize():
        raise ValueError(f"jax_cute_matmul: layouts {layouts.a} / {layouts.b} reach past buffers "
                         f"{a.shape} / {b.shape}")
    return sharding.result_aval(matmul_p.name, layouts, (a, b), np.dtype(out_dtype))


matmul_p.def_abstract_eval(_abstract_eval)


def _eager(*args, **params):
    # Outside jit, run the primitive as a one-op jitted computation (like jax's own primitives).
    return jax.jit(functools.partial(matmul_p.bind, **params))(*args)


matmul_p.def_impl(_eager)


def reference(a, b, *, layouts: GemmLayouts, out_dtype, acc_dtype, precision=None):
    """The GEMM in plain lax ops, reading and writing through the layouts."""
    av = L.read(a, layouts.a)  # (M, K, L)
    bv = L.read(b, layouts.b)  # (N, K, L)
    acc = np.dtype(acc_dtype)
    # Widening first is exact (products of 16-bit floats are exact in f32) and every backend's
    # dot supports it; XLA:CPU has no bf16 x bf16 -> f32 batched dot.
    av, bv = av.astype(acc), bv.astype(acc)
    cv = jax.lax.dot_general(av, bv, (((1,), (1,)), ((2,), (2,))), precision=precision,
                             preferred_element_type=acc)  # (L, M, N)
    cv = jnp.transpose(cv, (1, 2, 0)).astype(out_dtype)
    return L.write(cv, layouts.c, layouts.c_shape)


# Both lowerings go through the partitioning rules (primitives/sharding.py); ``avals`` and
# ``params`` are then those of one shard.
mlir.register_lowering(matmul_p, sharding.lowering(matmul_p, sharding.reference_local(reference), collective.planner))


def _cuda_lowering(avals, params):
    ref = functools.partial(reference, **params)
    return dispatch.gemm(*avals, reference=ref, **params) or ref


mlir.register_lowering(matmul_p, sharding.lowering(matmul_p, _cuda_lowering, collective.planner), platform="cuda")


# -- batching ---------------------------------------------------------------------------------

def _batch_rule(args, dims, *, layouts: GemmLayouts, out_dtype, acc_dtype, precision=None):
    a, b = args
    da, db = dims
    size = a.shape[da] if da is not None else b.shape[db]
    new = batched_gemm(layouts, a.shape, b.shape, da, db, size)
    return matmul_p.bind(a, b, layouts=new, out_dtype=out_dtype, acc_dtype=acc_dtype, precision=precision), 0


batching.primitive_batchers[matmul_p] = _batch_rule


# -- autodiff ---------------------------------------------------------------------------------

def _cotangent_dtype(ct, operand_dtype):
    # Mixed precision: an f32 cotangent of a 16-bit GEMM is rounded once to the operand dtype,
    # so the gradient GEMMs run on the 16-bit kernels as training frameworks do.
    return ct.astype(operand_dtype) if ct.dtype != operand_dtype else ct


def _gradient_dtype(operand_dtype: np.dtype) -> np.dtype:
    """Dtype the gradient GEMMs of an operand run in: the operand's own for 16-bit floats;
    bfloat16 for 8-bit floats, whose 2-3 mantissa bits would ruin a cotangent (fp8 -> bf16 is
    exact, so only the cotangent is rounded, as for 16-bit inputs)."""
    if operand_dtype.itemsize == 1 and jnp.issubdtype(operand_dtype, jnp.floating):
        return np.dtype(jnp.bfloat16)
    return operand_dtype


def _kernel_needs_copies(g: GemmLayouts, dtypes) -> bool:
    flat = flatten_gemm(g, dtypes)
    return isinstance(flat, str) or bool(flat.copies)


def _cotangent_rule(which: str):
    """Transpose rule for operand ``which``: another matmul over the cotangent and the other
    operand, its layouts from ``gemm_layouts.cotangent_a``/``cotangent_b``.

    A batch the operand was broadcast over is summed by joining the reduction K. Where that
    batch does not continue K in memory, a kernel would need copies; for 16-bit operands the
    sum is then taken over per-batch f32 partial products instead (one more reduction, no
    copy), rounded once to the operand dtype.
    """
    layouts_for = cotangent_a if which == "a" else cotangent_b
    partials_for = cotangent_a_partials if which == "a" else cotangent_b_partials

    def rule(ct, a, b, *, layouts: GemmLayouts, out_dtype, acc_dtype, precision=None):
        undefined, other = (a, b) if which == "a" else (b, a)
        if type(ct) is ad.Zero:
            return ad.Zero(undefined.aval)
        shape, dtype = undefined.aval.shape, np.dtype(undefined.aval.dtype)
        gdt = _gradient_dtype(dtype)
        ct = _cotangent_dtype(ct, gdt)
        if gdt != dtype:
            other = other.astype(gdt)  # both operands share the fp8 dtype; bf16 holds it exactly
        folded = layouts_for(layouts, shape)
        dts = [gdt.name, np.dtype(other.dtype).name, gdt.name]
        if gdt.itemsize == 2 and _kernel_needs_copies(folded, dts):
            partial = partials_for(layouts, shape)
            if partial is not None and not _kernel_needs_copies(partial[0], dts[:2] + ["float32"]):
                g, lead = partial
                out = matmul_p.bind(ct, other, layouts=g, out_dtype="float32", acc_dtype=acc_dtype,
                                    precision=precision)
                return jnp.sum(out, axis=tuple(range(lead))).astype(dtype)
        out = matmul_p.bind(ct, other, layouts=folded, out_dtype=gdt.name, acc_dtype=acc_dtype, precision=precision)
        return out.astype(dtype)  # a no-op unless the gradient GEMM ran in bf16 for fp8

    return rule


_transpose_a, _transpose_b = _cotangent_rule("a"), _cotangent_rule("b")
ad.defbilinear(matmul_p, _transpose_a, _transpose_b)


# -- public API -------------------------------------------------------------------------------

def operand_dtype_error(dtype) -> str | None:
    """Why ``dtype`` cannot be a GEMM operand at all (as for ``jnp.matmul``), or None."""
    if jnp.issubdtype(dtype, jnp.number) or dtype == np.dtype(bool):
        return None
    return f"unsupported dtype {dtype}"


def _acc_dtype(dtype: np.dtype) -> np.dtype:
    """Accumulation dtype of a product of two ``dtype`` operands with a ``dtype`` result."""
    return acc_dtype(dtype, dtype, dtype)


def check_operand_dtypes(op: str, a, b) -> None:
    for what, x in (("first", a), ("second", b)):
        if operand_dtype_error(x.dtype):
            raise TypeError(f"jax_cute.{op}: the {what} operand has unsupported dtype {x.dtype} "
                            f"(shapes {a.shape}:{a.dtype}, {b.shape}:{b.dtype})")


def bind_gemm(op: str, a, b, layouts: GemmLayouts, out_dtype, precision, *,
              out_shape: tuple[int, ...] | None = None, bias=None, activation: str | None = None,
              preact: bool = False, act_operand=None):
    """The product as ``jax_cute_matmul`` (or, with ``bias``/``activation``, the fused epilogue
    primitive) with the result dtype ``out_dtype`` (the JAX function's own), the operands
    converted as lax converts them (``dot_dtypes``); the result has ``out_shape`` (default: C's
    buffer shape). ``preact`` and ``act_operand``: kernelize's chained products
    (``fused.epilogue_call``)."""
    check_operand_dtypes(op, a, b)
    precision = hashable_precision(precision)
    out = np.dtype(out_dtype)
    da, db = operand_dtypes(a.dtype, b.dtype, out)
    a, b = a.astype(da), b.astype(db)
    acc = acc_dtype(da, db, out)
    shape = tuple(layouts.c_shape) if out_shape is None else tuple(out_shape)
    dispatch.at_trace(op, dtype_refusal(False, inputs_name(da, db), out.name))
    if bias is not None or activation is not None or preact or act_operand is not None:
        return fused.epilogue_call(op, matmul_p, a, b, layouts, shape, bias=bias, activation=activation,
                                   out_dtype=out, acc_dtype=acc, precision=precision, preact=preact,
                                   act_operand=act_operand)
    c = matmul_p.bind(a, b, layouts=layouts, out_dtype=out.name, acc_dtype=acc.name, precision=precision)
    return jnp.reshape(c, shape) if c.shape != shape else c


def check_flag(op: str, name: str, value) -> bool:
    """A boolean option as a bool; anything else (a string, an array) is a TypeError."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"jax_cute.{op}: {name} must be a bool, got {value!r} of type {type(value).__name__}")
    return bool(value)


def matmul(a, b, *, transpose_a: bool = False, transpose_b: bool = False, precision=None,
           preferred_element_type=None, out_sharding=None, bias=None, activation: str | None = None):
    """``jnp.matmul(a', b')`` with ``a' = swapaxes(a, -1, -2)`` when ``transpose_a`` (likewise b).

    Batch dimensions broadcast as in ``jnp.matmul``; 1-D operands are promoted and the added
    mode dropped, as there. Transposes are layout changes, not copies. ``precision`` is passed
    to XLA where no kernel runs (the kernels multiply 16- and 8-bit inputs exactly and
    accumulate in float32). With ``preferred_element_type=float32`` on 16-bit inputs the result
    is float32, and in the backward pass its cotangent is rounded once to the input dtype
    before the gradient GEMMs. With 8-bit float inputs (``float8_e4m3fn``/``float8_e5m2``; the
    Hopper kernel needs both contiguous along K, e.g. ``matmul(x, w, transpose_b=True)`` for a
    (N, K) weight) pass ``preferred_element_type`` (bfloat16, float16 or float32): the gradient
    GEMMs then run in bfloat16 and the gradients are rounded to the fp8 dtype at the end.
    ``out_sharding`` (a NamedSharding, or a PartitionSpec of the context mesh) constrains the
    result's sharding, as ``jnp.matmul``'s does.

    ``bias`` and ``activation`` fuse an epilogue: the result is ``act(a' @ b' + bias)``, computed
    in float32 on the accumulator and rounded once to the output dtype (``primitives/fused.py``).
    ``bias`` broadcasts against the product by numpy's rules: (N,) (one per column, what the
    kernels read), the product's full shape, or anything between. ``activation`` is None,
    "relu", "gelu" (``jax.nn.gelu``, tanh form), "gelu_exact", "silu" or "swiglu" (b's N columns
    are ``[gate | up]``; the result has N/2 columns, ``silu(gate) * up``).
    """
    transpose_a = check_flag("matmul", "transpose_a", transpose_a)
    transpose_b = check_flag("matmul", "transpose_b", transpose_b)
    if fp8_ops.is_scaled(a, b):  # jax_cute.fp8.BlockScaled operands: the block-scaled product
        return sharding.constrain(fp8_ops.scaled_matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b,
                                                        preferred_element_type=preferred_element_type, bias=bias,
                                                        activation=activation), out_sharding)
    a, b = jnp.asarray(a), jnp.asarray(b)
    if (transpose_a and a.ndim < 2) or (transpose_b and b.ndim < 2):
        raise ValueError(f"jax_cute.matmul: transpose_a/transpose_b need a 2-D or higher operand, got shapes "
                         f"{a.shape} and {b.shape}")
    check_operand_dtypes("matmul", a, b)
    # jnp.matmul's own shape and dtype rules: its errors, its precision checks, its result type
    swap = lambda x, t: jnp.swapaxes(x, -1, -2) if t else x  # noqa: E731
    out = jax.eval_shape(lambda x, y: jnp.matmul(swap(x, transpose_a), swap(y, transpose_b), precision=precision,
                                                 preferred_element_type=preferred_element_type),
                         jax.ShapeDtypeStruct(a.shape, a.dtype), jax.ShapeDtypeStruct(b.shape, b.dtype))
    layouts, out_shape = matmul_layouts(a.shape, b.shape, transpose_a, transpose_b)
    assert tuple(out_shape) == tuple(out.shape), (out_shape, out.shape)
    return sharding.constrain(bind_gemm("matmul", a, b, layouts, out.dtype, precision, out_shape=out_shape,
                                        bias=bias, activation=activation), out_sharding)
