"""The dtypes of a product by lax's rules: what each operand is converted to, and where the
reference path accumulates.

The result type itself is always the JAX function's own (``jax.eval_shape`` of
``lax.dot_general``, ``jnp.matmul``, ``lax.ragged_dot`` on the operands' ``struct``), dtype and
weak type, so it is never re-derived here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import dtypes
from jax._src.lax.lax import _convert_element_type  # no public API makes an array weakly typed

_FP8 = {np.dtype(getattr(jnp, n)) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                               "float8_e4m3b11fnuz", "float8_e3m4", "float8_e4m3", "float8_e8m0fnu")
        if hasattr(jnp, n)}


def struct(x) -> jax.ShapeDtypeStruct:
    """``x``'s type as the JAX function sees it, weak type included: a weak operand changes the
    result dtype (jnp's ``bf16 @ weak f32`` is bf16) and whether the result is weak."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=jax.typeof(x).weak_type)


def weak_as(x, product, bias=None):
    """``x`` weakly typed exactly where the JAX function's result ``product`` is (its steps may
    differ from ours: jnp.matmul's ``preferred_element_type`` makes a strong result of weak
    operands) and, with an epilogue, its ``bias`` is too, as ``act(product + bias)`` would be in
    jnp. The conversion changes no dtype and lowers to nothing."""
    weak = product.weak_type and (bias is None or jax.typeof(jnp.asarray(bias)).weak_type)
    return x if jax.typeof(x).weak_type == weak else _convert_element_type(x, x.dtype, weak_type=weak)


def converted(x, dtype):
    """``x`` as a ``dtype`` operand, its weak type kept: a primitive's result is weak where all
    its operands are, as lax's products are, and so are the gradients. A complex operand of a
    real product loses its imaginary part silently, as in lax's lowering."""
    dtype = np.dtype(dtype)
    if x.dtype == dtype:
        return x
    return _convert_element_type(x, dtype, weak_type=jax.typeof(x).weak_type, warn_on_complex_to_real_cast=False)


def operand_dtypes(lhs, rhs, out) -> tuple[np.dtype, np.dtype]:
    """lax's CPU and GPU lowering convert operands of different dtypes to the result dtype
    before the product, except two 8-bit floats, which are multiplied as they are."""
    lhs, rhs, out = np.dtype(lhs), np.dtype(rhs), np.dtype(out)
    if lhs == rhs or (lhs in _FP8 and rhs in _FP8):
        return lhs, rhs
    return out, out


def _wide(d: np.dtype) -> bool:
    return d.itemsize >= (16 if d.kind == "c" else 8)


def acc_dtype(a, b, out) -> np.dtype:
    """Where the reference path accumulates: float32 (complex64, int32) for operands and results
    of 32 bits or fewer, as the kernels do (products of 16- and 8-bit floats are exact there);
    the 64-bit type where any of them is 64-bit, as lax accumulates in the requested type
    (``preferred_element_type=float64`` on float32 operands sums in float64, int64 in int64,
    uint64 in uint64)."""
    ds = [np.dtype(a), np.dtype(b), np.dtype(out)]
    wide = any(_wide(d) for d in ds)
    if any(d.kind == "c" for d in ds):
        return np.dtype("complex128" if wide else "complex64")
    if any(dtypes.issubdtype(d, np.floating) for d in ds):
        return np.dtype("float64" if wide else "float32")
    out = ds[2]
    if out.itemsize == 8:
        return out
    if wide:  # 64-bit integer operands, narrower integer result: the operands' type, cast once
        return np.dtype("uint64" if all(d.kind in "ub" for d in ds[:2]) else "int64")
    return np.dtype("uint32" if out == np.dtype("uint32") else "int32")


def hashable_precision(precision):
    """``precision`` as a primitive parameter: lax takes a list of two where a tuple is meant,
    and parameters must hash (it is validated by lax's own rule before this)."""
    return tuple(precision) if isinstance(precision, list) else precision


def inputs_name(da, db) -> str:
    """The operands' dtype as the kernels' dtype tables name it ("a x b" when they differ)."""
    da, db = np.dtype(da).name, np.dtype(db).name
    return da if da == db else f"{da} x {db}"


def cotangent_dtype(ct, operand_dtype):
    """``ct`` in ``operand_dtype``. Mixed precision: an f32 cotangent of a 16-bit GEMM is rounded
    once to the operand dtype, so the gradient GEMMs run on the 16-bit kernels as training
    frameworks do."""
    return converted(ct, operand_dtype)


def cotangent_result(x, operand, ct_dtype):
    """A gradient GEMM's result ``x`` in the dtype of ``operand`` (its aval). Where the
    cotangent had another dtype (``ct_dtype``), lax's transposes convert to the operand's dtype
    and weak type, so the gradient of a weak operand is weak there."""
    x = converted(x, operand.dtype)
    if np.dtype(ct_dtype) == np.dtype(operand.dtype) or jax.typeof(x).weak_type == operand.weak_type:
        return x
    return _convert_element_type(x, x.dtype, weak_type=operand.weak_type)
