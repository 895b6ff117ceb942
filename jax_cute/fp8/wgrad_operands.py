"""The fp8 weight gradient's operands by kernels (``kernels/fp8_operands.py``, whose docstring
gives the layout), each with its jax.numpy reference, which runs where no kernel does.

Imports the DSL (the kernels' launchers): imported only where a weight gradient is traced.
The layout: each scale block of up to 128 consecutive tokens at columns [128 j, 128 j + its
length) of an (R, 128 nb) operand, zeros after; the blocks given by their first token and
length (``uniform_blocks``, or ``quantize.group_blocks`` for a grouped layer).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_cute.fp8.quantize import (BLOCK, FP8_DTYPES, BlockScaled, aligned_columns, fp8_dtype, group_blocks, quantize,
                                   quantize_cast, scale_of)
from jax_cute.kernels import fp8_operands
from jax_cute.primitives.cute_call import cute_call


def supported(rows: int) -> bool:
    """Whether the kernels take operands of ``rows`` (R): whole 64-column tiles."""
    return rows > 0 and rows % fp8_operands.COLS == 0


def uniform_blocks(tokens: int) -> tuple[jax.Array, jax.Array]:
    """(first token, length) of each block of 128 consecutive tokens, the last one partial."""
    start = jnp.arange(-(-tokens // BLOCK), dtype=jnp.int32) * BLOCK
    return start, jnp.minimum(tokens - start, BLOCK).astype(jnp.int32)


def _aligned_rows(x: jax.Array, start: jax.Array, length: jax.Array) -> jax.Array:
    """x (T, R)'s rows in the layout's order (128 nb, R), zeros where no token is."""
    src, keep = aligned_columns(start, length, x.shape[0], start.shape[0], BLOCK)
    return jnp.where(keep[:, None], jnp.take(x, src, axis=0), jnp.zeros((), x.dtype))


def transpose_reference(xt: jax.Array, start: jax.Array, length: jax.Array) -> jax.Array:
    """What ``aligned_transpose`` computes, in jax.numpy (any dtype)."""
    return _aligned_rows(xt, start, length).T


def quantize_reference(x: jax.Array, start: jax.Array, length: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """What ``quantize_tokens`` computes, in jax.numpy: the quantizer's numerics on these blocks."""
    dt, nb = np.dtype(dtype), start.shape[0]
    xa = _aligned_rows(x.astype(jnp.float32), start, length)                # (128 nb, R)
    scales = scale_of(jnp.max(jnp.abs(xa).reshape(nb, BLOCK, -1), axis=1), dt, False)   # (nb, R)
    values = quantize_cast(xa, jnp.repeat(scales, BLOCK, axis=0), dt)
    return values.T, scales.T


def aligned_transpose(xt: jax.Array, start: jax.Array, length: jax.Array) -> jax.Array:
    """``xt`` (T, R) fp8 token-major values -> (R, 128 nb) in the layout; ``start``/``length``
    (nb,) each block's first token and length (zero-length blocks are all zeros). R must be a
    multiple of 64 (``supported``)."""
    t, r = xt.shape
    nb = start.shape[0]
    call = cute_call(fp8_operands.aligned_transpose, out_shape=jax.ShapeDtypeStruct((r, BLOCK * nb), jnp.uint8),
                     reference=lambda x, s, n: (transpose_reference(x, s, n),), name="fp8_aligned_transpose", partitioned_reference=True)
    out = call(jax.lax.bitcast_convert_type(xt, jnp.uint8), start.astype(jnp.int32), length.astype(jnp.int32))
    return jax.lax.bitcast_convert_type(out, xt.dtype)


def quantize_tokens(x: jax.Array, start: jax.Array, length: jax.Array, dtype=jnp.float8_e4m3fn
                    ) -> tuple[jax.Array, jax.Array]:
    """``x`` (T, R) (bfloat16, float16 or float32) -> (values (R, 128 nb) ``dtype``, scales
    (R, nb) float32) in the layout, in one pass: each block's scale is amax / fmax, as
    ``quantize``'s (power-of-two scales are not computed here). ``start``/``length`` (nb,) as
    for ``aligned_transpose``; a zero-length block is zeros with scale 1. R must be a multiple
    of 64 (``supported``)."""
    dt = fp8_dtype(dtype, "jax_cute.fp8.quantize_tokens")
    if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating) or np.dtype(x.dtype) in FP8_DTYPES:
        raise TypeError(f"jax_cute.fp8.quantize_tokens: x must be a 2-D 16- or 32-bit float array, got "
                        f"{x.shape}:{x.dtype}")
    t, r = x.shape
    nb = start.shape[0]
    call = cute_call(fp8_operands.quantize_tokens,
                     out_shape=(jax.ShapeDtypeStruct((r, BLOCK * nb), dt), jax.ShapeDtypeStruct((r, nb), jnp.float32)),
                     reference=lambda x, s, n: quantize_reference(x, s, n, dt), name="fp8_quantize_tokens", partitioned_reference=True)
    return call(x, start.astype(jnp.int32), length.astype(jnp.int32))


def rows_and_tokens_supported(x_shape: tuple[int, ...], dtype) -> bool:
    """Whether ``quantize_rows_and_tokens`` takes x (T, R) of ``dtype``: a 16- or 32-bit float
    with whole 1 x 128 blocks along R (R a multiple of 128)."""
    return (len(x_shape) == 2 and x_shape[0] > 0 and x_shape[1] > 0 and x_shape[1] % fp8_operands.BLOCK_COLS == 0
            and np.dtype(dtype) in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)))


def rows_and_tokens_reference(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """What ``quantize_rows_and_tokens`` computes, in jax.numpy: ``quantize(x, "1x128")``'s values and
    scales, then ``quantize_reference``'s over uniform blocks of 128 tokens: as ``quantize``'s
    (128, 1) blocks of x zero-padded to whole blocks (zeros leave a block's amax as it is),
    transposed. XLA partitions it (cute_call's partitioned_reference) as fast as its own
    quantization, where the general reference's gathers would not be."""
    q = quantize(x, "1x128", dtype=dtype)
    t = x.shape[0]
    tq = quantize(jnp.pad(x, ((0, -t % BLOCK), (0, 0))), (BLOCK, 1), dtype=dtype)
    return q.values, q.scales, tq.values.T, tq.scales.T


def quantize_rows_and_tokens(x: jax.Array, dtype=jnp.float8_e4m3fn) -> tuple[BlockScaled, tuple[jax.Array, jax.Array]]:
    """``x`` (T, R) (bfloat16, float16 or float32, R a multiple of 128: ``rows_and_tokens_supported``)
    quantized both ways in one pass over it, as a linear layer's forward (its input) and backward
    (the output gradient) need: ``quantize(x, "1x128")`` for the product that contracts R, and
    ``quantize_tokens(x, *uniform_blocks(T))``'s (values, scales) for the weight gradient, which
    contracts T. Numerics are the quantizer's (amax / fmax scales)."""
    dt = fp8_dtype(dtype, "jax_cute.fp8.quantize_rows_and_tokens")
    if not rows_and_tokens_supported(x.shape, x.dtype):
        raise TypeError(f"jax_cute.fp8.quantize_rows_and_tokens: x must be (T, R) bfloat16, float16 or float32 with R a "
                        f"multiple of {fp8_operands.BLOCK_COLS}, got {x.shape}:{x.dtype}")
    t, r = x.shape
    start, length = uniform_blocks(t)
    nb = start.shape[0]
    call = cute_call(fp8_operands.quantize_rows_and_tokens,
                     out_shape=(jax.ShapeDtypeStruct((t, r), dt), jax.ShapeDtypeStruct((t, r // BLOCK), jnp.float32),
                                jax.ShapeDtypeStruct((r, BLOCK * nb), dt), jax.ShapeDtypeStruct((r, nb), jnp.float32)),
                     reference=lambda x, s, n: rows_and_tokens_reference(x, dt), name="fp8_quantize_rows_and_tokens", partitioned_reference=True)
    row_values, row_scales, values, scales = call(x, start, length)
    return BlockScaled(row_values, row_scales, (1, BLOCK)), (values, scales)


def rows_and_group_tokens_reference(x: jax.Array, start: jax.Array, length: jax.Array, end: jax.Array, dtype
                                    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """What ``quantize_rows_and_group_tokens`` computes, in jax.numpy: ``quantize(x, "1x128")`` of x
    with its rows from ``end[0]`` on zeroed (values 0, scales 1), then ``quantize_reference``'s."""
    rows = jnp.where(jnp.arange(x.shape[0])[:, None] < end[0], x, jnp.zeros((), x.dtype))
    q = quantize(rows, "1x128", dtype=dtype)
    return (q.values, q.scales, *quantize_reference(x, start, length, dtype))


def quantize_rows_and_group_tokens(x: jax.Array, sizes: jax.Array, dtype=jnp.float8_e4m3fn
                                   ) -> tuple[BlockScaled, tuple[jax.Array, jax.Array]]:
    """``x`` (T, R) (as ``quantize_rows_and_tokens`` takes it) for a grouped layer whose groups
    have ``sizes`` (G,), in one pass: ``quantize(x, "1x128")`` for the grouped product that
    contracts R, with the rows past the last group (which no grouped product reads) quantized as
    zeros, and ``quantize_tokens(x, *group_blocks(sizes, T)[1:3])``'s (values, scales), the
    group-aligned layout of the ragged-K weight gradient."""
    dt = fp8_dtype(dtype, "jax_cute.fp8.quantize_rows_and_group_tokens")
    if not rows_and_tokens_supported(x.shape, x.dtype):
        raise TypeError(f"jax_cute.fp8.quantize_rows_and_group_tokens: x must be (T, R) bfloat16, float16 or float32 "
                        f"with R a multiple of {fp8_operands.BLOCK_COLS}, got {x.shape}:{x.dtype}")
    t, r = x.shape
    _, start, length, _ = group_blocks(sizes, t)
    nb = start.shape[0]
    end = jnp.max(jnp.where(length > 0, start + length, 0), initial=0, keepdims=True).astype(jnp.int32)
    call = cute_call(fp8_operands.quantize_rows_and_group_tokens,
                     out_shape=(jax.ShapeDtypeStruct((t, r), dt), jax.ShapeDtypeStruct((t, r // BLOCK), jnp.float32),
                                jax.ShapeDtypeStruct((r, BLOCK * nb), dt), jax.ShapeDtypeStruct((r, nb), jnp.float32)),
                     reference=lambda x, s, n, e: rows_and_group_tokens_reference(x, s, n, e, dt),
                     name="fp8_quantize_rows_and_group_tokens", partitioned_reference=True)
    row_values, row_scales, values, scales = call(x, start, length, end)
    return BlockScaled(row_values, row_scales, (1, BLOCK)), (values, scales)
