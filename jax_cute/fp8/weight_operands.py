"""A weight's two fp8 operands by one kernel (``kernels/fp8_operands.quantize_weight``), with
its jax.numpy reference, which runs where no kernel does.

fp8 WGMMA reads both operands K-major, so a weight w (K, N) takes two layouts: the forward
product ``x @ w`` reads it transposed (N, K), dgrad ``dy @ w.T`` in its own. XLA quantized it
in two passes over the float32 weight (the 128 x 128 blocks' amax, then both layouts' values)
and, under ``scan``, first transposed the whole float32 stack; the kernel reads w once.

Imports the DSL (the kernel's launcher): imported only where a weight is quantized for a
kernel (``scaled.weight_kernel``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_cute.fp8.quantize import BLOCK, WEIGHT, BlockScaled, checkpoint_named, fp8_dtype, quantize, weight_pair
from jax_cute.kernels import fp8_operands
from jax_cute.primitives.cute_call import cute_call

_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32))


def supported(shape: tuple[int, ...], dtype) -> bool:
    """Whether the kernel takes a weight of ``shape`` (K, N) or (L, K, N) and ``dtype``: 16- or
    32-bit floats, K and N whole 128 x 128 blocks."""
    return (len(shape) in (2, 3) and all(d > 0 for d in shape) and shape[-1] % BLOCK == 0
            and shape[-2] % BLOCK == 0 and np.dtype(dtype) in _DTYPES)


def reference(w: jax.Array, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """What the kernel computes for w (L, K, N), in jax.numpy: ``quantize(w, "128x128")``'s
    values, the same values transposed, and its scales."""
    q = quantize(w, WEIGHT, dtype=dtype)
    return q.values, jnp.swapaxes(q.values, 1, 2), q.scales


def quantize_weight(w: jax.Array, dtype=jnp.float8_e4m3fn, name: str | None = None
                    ) -> tuple[BlockScaled, BlockScaled]:
    """``quantize(w, "128x128")`` for w (K, N) or a stack (L, K, N) (``supported``), twice: with
    its values in w's layout (dgrad's operand) and as the same operand whose values are stored
    transposed (``quantize.weight_pair``). One kernel reads w once and writes both. ``name``: a
    ``checkpoint_name`` for the kernel's outputs (as stored: a checkpoint policy that saves them
    keeps no transposed copy)."""
    _check(w)
    values, values_t, scales = stored(w if w.ndim == 3 else w[None], dtype)
    if name is not None:
        values, values_t, scales = checkpoint_named((values, values_t, scales), name)
    if w.ndim == 2:
        values, values_t, scales = values[0], values_t[0], scales[0]
    return weight_pair(values, values_t, scales)


def _check(w) -> None:
    if not supported(w.shape, w.dtype):
        raise TypeError(f"jax_cute.fp8.quantize_weight: w must be (K, N) or (L, K, N) bfloat16, float16 "
                        f"or float32 with K and N multiples of {BLOCK}, got {w.shape}:{w.dtype}")


def stored(w: jax.Array, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The kernel's outputs for w (L, K, N): each weight's values (L, K, N), the same values
    transposed (L, N, K) and its scales (L, K / 128, N / 128)."""
    dt = fp8_dtype(dtype, "jax_cute.fp8.quantize_weight")
    if w.ndim != 3:
        raise TypeError(f"jax_cute.fp8.weight_operands.stored: w must be a stack (L, K, N), got {w.shape}")
    _check(w)
    l, k, n = w.shape
    call = cute_call(fp8_operands.quantize_weight,
                     out_shape=(jax.ShapeDtypeStruct((l, k, n), dt), jax.ShapeDtypeStruct((l, n, k), dt),
                                jax.ShapeDtypeStruct((l, k // BLOCK, n // BLOCK), jnp.float32)),
                     reference=lambda x: reference(x, dt), name="fp8_quantize_weight",
                     partitioned_reference=True)
    return call(w)
