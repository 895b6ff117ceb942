"""``jax_cute.matmul``: ``jnp.matmul``'s shapes, dtypes and errors, as one ``jax_cute_matmul``.

``bind_gemm`` is where every dense product enters (``matmul``, ``dot_general``, ``einsum``,
``kernelize``'s products): operands converted as lax converts them, the trace-time check, and
the GEMM primitive (``gemm.py``) or, with an epilogue, the fused one (``fused.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_cute import dispatch
from jax_cute.fp8 import ops as fp8_ops
from jax_cute.kernels.gemm_spec import dtype_refusal
from jax_cute.primitives import fused, sharding
from jax_cute.primitives.dot_dtypes import (acc_dtype, hashable_precision, inputs_name, operand_dtypes,
                                            converted, struct, weak_as)
from jax_cute.primitives.gemm import matmul_p
from jax_cute.problem.gemm_layouts import GemmLayouts, matmul_layouts


def operand_dtype_error(dtype) -> str | None:
    """Why ``dtype`` cannot be a GEMM operand at all (as for ``jnp.matmul``), or None."""
    if jnp.issubdtype(dtype, jnp.number) or dtype == np.dtype(bool):
        return None
    return f"unsupported dtype {dtype}"


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
    a, b = converted(a, da), converted(b, db)
    acc = acc_dtype(da, db, out)
    shape = tuple(layouts.c_shape) if out_shape is None else tuple(out_shape)
    dispatch.at_trace(op, dtype_refusal(False, inputs_name(da, db), out.name))
    if bias is not None or activation is not None or preact or act_operand is not None:
        return fused.epilogue_call(op, a, b, layouts, shape, bias=bias, activation=activation,
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
                                                 preferred_element_type=preferred_element_type), struct(a), struct(b))
    layouts, out_shape = matmul_layouts(a.shape, b.shape, transpose_a, transpose_b)
    assert tuple(out_shape) == tuple(out.shape), (out_shape, out.shape)
    res = bind_gemm("matmul", a, b, layouts, out.dtype, precision, out_shape=out_shape, bias=bias,
                    activation=activation)
    return sharding.constrain(weak_as(res, out, bias), out_sharding)
