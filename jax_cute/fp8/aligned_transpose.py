"""The ragged-K weight gradient's operand layout, by a kernel: (T, R) token-major fp8 values ->
(R, 128 nb) with scale block j's rows at columns [128 j, 128 j + its length), zeros after.

Each fp8 operand of the grouped weight gradient is quantized token-major (its natural layout,
``quantize_grouped(y.T)``) and must reach the ragged-K GEMM contiguous along the tokens, each
group starting on a 128-column block. As one XLA fusion (a gather along T of a transposed
array) every byte was read strided: 1.7 ms per (4096, 16384) operand on an H100, 9.3 of the GPT
example's 87 ms fp8 MoE step. Here each CTA stages one block's 128 rows x 64 columns in shared
memory, reading whole 64-byte row pieces, and writes 64 rows of 128 bytes.
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
import jax
import jax.numpy as jnp

from jax_cute.fp8.quantize import aligned_columns
from jax_cute.primitives.cute_call import cute_call

ROWS = 128   # tokens per scale block: one block per CTA
COLS = 64    # columns of R per CTA
THREADS = 128


@cute.kernel
def _aligned_transpose_kernel(mX: cute.Tensor, mStart: cute.Tensor, mLen: cute.Tensor, mOut: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    blk, cb, _ = cute.arch.block_idx()
    smem = cutlass.utils.SmemAllocator()
    sT = smem.allocate_tensor(element_type=cutlass.Uint8, layout=cute.make_layout((ROWS, COLS), stride=(COLS, 1)),
                              byte_alignment=16)
    start = mStart[blk]
    length = mLen[blk]
    c0 = cb * COLS
    # load: thread t stages row t of the block (token start + t), 64 bytes, or zeros past its length
    frag = cute.make_rmem_tensor((COLS,), cutlass.Uint8)
    if tidx < length:
        src = cute.local_tile(mX, (1, COLS), (start + tidx, cb))
        frag.store(src[0, None].load())
    else:
        frag.fill(0)
    sT[tidx, None].store(frag.load())
    cute.arch.sync_threads()
    # store: thread t writes half t % 2 of output row c0 + t // 2 (64 tokens, contiguous)
    c, half = tidx // 2, tidx % 2
    out = cute.make_rmem_tensor((COLS,), cutlass.Uint8)
    for i in cutlass.range_constexpr(COLS):
        out[i] = sT[half * COLS + i, c]
    dst = cute.local_tile(mOut, (1, COLS), (c0 + c, blk * 2 + half))
    dst[0, None].store(out.load())


@cute.jit
def _aligned_transpose(stream, x: cute.Tensor, start: cute.Tensor, length: cute.Tensor, out: cute.Tensor):
    """cute_call launcher: x (T, R) uint8, start/length (nb,) int32, out (R, 128 nb) uint8."""
    nb = start.shape[0]
    _aligned_transpose_kernel(x, start, length, out).launch(
        grid=[nb, x.shape[1] // COLS, 1], block=[THREADS, 1, 1], stream=stream)


def supported(rows: int) -> bool:
    """Whether the kernel takes operands of ``rows`` (R): whole 64-column tiles."""
    return rows > 0 and rows % COLS == 0


def reference(xt: jax.Array, start: jax.Array, length: jax.Array) -> jax.Array:
    """What the kernel computes, in jax.numpy (any dtype)."""
    src, keep = aligned_columns(start, length, xt.shape[0], start.shape[0], ROWS)
    return jnp.where(keep, jnp.take(xt.T, src, axis=1), jnp.zeros((), xt.dtype))


def _bytes_reference(x, start, length):
    return (reference(x, start, length),)


def aligned_transpose(xt: jax.Array, start: jax.Array, length: jax.Array) -> jax.Array:
    """``xt`` (T, R) fp8 -> (R, 128 nb) fp8 as the module says, ``start``/``length`` (nb,) each
    block's first token and length (zero-length blocks are all zeros). R must be a multiple of 64
    (``supported``)."""
    t, r = xt.shape
    nb = start.shape[0]
    call = cute_call(_aligned_transpose, out_shape=jax.ShapeDtypeStruct((r, ROWS * nb), jnp.uint8),
                     reference=_bytes_reference, name="fp8_aligned_transpose")
    out = call(jax.lax.bitcast_convert_type(xt, jnp.uint8), start.astype(jnp.int32), length.astype(jnp.int32))
    return jax.lax.bitcast_convert_type(out, xt.dtype)
