"""fp8 operands XLA lays out in several passes, by small SIMT kernels: the weight gradient's
(called through ``cute_call`` from ``jax_cute/fp8/wgrad_operands.py``) and the weights' two
layouts (from ``jax_cute/fp8/weight_operands.py``); those modules hold their references.

A weight gradient contracts the tokens, so its fp8 operands are read contiguous along them
(fp8 WGMMA reads both operands K-major) and its scale blocks run along them: each block of up to
128 consecutive tokens sits at columns [128 j, 128 j + its length) of an (R, 128 nb) operand,
zeros after. The blocks are given by their first token and length (uniform for a dense layer,
restarting at each group for a grouped one, the layout the ragged-K kernel reads).

- ``aligned_transpose``: (T, R) token-major fp8 values -> that layout.
- ``quantize_tokens``: (T, R) token-major 16- or 32-bit values -> that layout's e4m3/e5m2
  values and their float32 scales (R, nb), in one pass. Numerics are the quantizer's: amax /
  fmax as the scale (1 for an all-zero block), ``x / scale`` rounded to nearest and saturated.
- ``quantize_rows_and_tokens``: the same, and in the same pass x's 1 x 128 blocks along R (its
  own layout, for the product that contracts R): a linear layer's input or output gradient is
  read once for both of its products. Each CTA stages a 128-token x 128-column tile.
  ``quantize_rows_and_group_tokens``: the same over a grouped layer's blocks (the rows past the
  last group zeros).
- ``quantize_weight``: a weight's (or a stack of them) 128 x 128 blocks, in one pass, its fp8
  values written in its own layout (dgrad reads them K-major) and transposed (the forward
  product's K-major operand), with one scale a block.

``aligned_transpose`` and ``quantize_tokens``: each CTA takes one block and 64 columns, stages
the block's 128 rows x 64 columns in shared memory (whole row pieces read) and writes 64 rows of
128 bytes; the other two stage a 128 x 128 tile a CTA. Imports the DSL: only kernel
builds import it.
"""

from __future__ import annotations

from jax_cute.kernels.dsl import Constexpr, Float32, cute, cutlass, memory

ROWS = 128     # tokens per scale block: one block per CTA
COLS = 64      # columns of R per CTA
THREADS = 128
TINY = 1.1754943508222875e-38   # float32's smallest normal: the least scale (quantize._TINY)
FMAX = {cutlass.Float8E4M3FN: 448.0, cutlass.Float8E5M2: 57344.0}
_PITCH = COLS + 4   # staged float32 row pitch: 16-byte rows, fewer bank conflicts on the store
# scales whose quotients take _quotients' fast path: a quotient an fp8 value can hold (at least
# e5m2's half-smallest 2^-17) then has a dividend of 2^-97 or more, whose residual is exact
FAST_MIN, FAST_MAX = 2.0 ** -80, 2.0 ** 100


@cute.jit
def _absmax(m: Float32, v: Float32) -> Float32:
    """max(m, |v|), NaN propagating as in XLA's max."""
    return cute.arch.fmax(m, cute.arch.fmax(v, -v), nan=True)


@cute.jit
def _quotients(src: cute.Tensor, dst: cute.Tensor, scale: Float32):
    """dst[i] = src[i] / scale, rounded to nearest as div.rn.f32 rounds it, for a block's values
    (each at most its amax, so no quotient overflows). div.rn is a dozen instructions a value;
    with ``inv`` = RN(1 / scale) (one rcp.rn), the quotient RN(src * inv) is within an ulp, and one correction
    by the exact residual (an FMA) makes it the correctly rounded one (Markstein's theorem),
    provided nothing underflows: scales in [FAST_MIN, FAST_MAX] (any realistic block) take that
    path, others divide (smaller quotients round to fp8 zero either way). The residual is formed
    as scale * q - src so that a negative zero keeps its sign. The quantizers ran 4-18% faster
    for it on an H200 (2026-11-29), bit for bit the same."""
    inv = Float32(1.0) / scale
    if scale >= Float32(FAST_MIN) and scale <= Float32(FAST_MAX):
        for i in cutlass.range(cute.size(src), unroll_full=True):
            q = src[i] * inv
            err = cute.math.fma(scale, q, -src[i])
            dst[i] = cute.math.fma(-err, inv, q)
    else:
        for i in cutlass.range(cute.size(src), unroll_full=True):
            dst[i] = src[i] / scale    # div.rn.f32, as XLA divides


@cute.jit
def _store_quantized(xs: cute.Tensor, scale: Float32, dst: cute.Tensor, row, block, h):
    """The 64 values ``xs`` divided by ``scale`` into fp8 row ``row`` of ``dst``, half ``h`` of its
    128-value block ``block``: four 16-value pieces at 16-byte columns ``8 block + 2 i + h``
    (i < 4). The thread with the other ``h`` writes the pieces between, so each store instruction
    of the pair fills whole 32-byte sectors (a thread writing 64 contiguous bytes half-fills them,
    and L2 throughput, not DRAM, bounds the quantizers).
    One batch of 64: in batches of 16 (38 registers, not 90, so three times the CTAs an SM) the
    quantizers ran 12-19% slower on an H200."""
    q = cute.make_rmem_tensor(cute.make_layout((16, 4)), Float32)
    _quotients(xs, q, scale)
    out = cute.make_rmem_tensor(cute.make_layout((16, 4)), dst.element_type)
    out.store(q.load().to(dst.element_type))   # cvt.rn.satfinite: the quantizer's clip and rounding
    for i in cutlass.range_constexpr(4):
        cute.local_tile(dst, (1, 16), (row, 8 * block + 2 * i + h))[0, None].store(out[None, i].load())


@cute.jit
def _block_scale(amax: Float32, fmax: Constexpr) -> Float32:
    """The quantizer's scale of a block whose largest magnitude is ``amax``: amax / fmax, at least
    float32's smallest normal; 1 for an all-zero block (and a NaN one: as the quantizer's where)."""
    scale = Float32(1.0)
    if amax > 0.0:
        scale = cute.arch.fmax(amax * Float32(1.0 / fmax), Float32(TINY))
    return scale


@cute.kernel
def _aligned_transpose_kernel(mX: cute.Tensor, mStart: cute.Tensor, mLen: cute.Tensor, mOut: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    blk, cb, _ = cute.arch.block_idx()
    smem = memory.SmemAllocator()
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
    for i in cutlass.range(COLS, unroll_full=True):
        out[i] = sT[half * COLS + i, c]
    dst = cute.local_tile(mOut, (1, COLS), (c0 + c, blk * 2 + half))
    dst[0, None].store(out.load())


@cute.jit
def aligned_transpose(stream, x: cute.Tensor, start: cute.Tensor, length: cute.Tensor, out: cute.Tensor):
    """cute_call launcher: x (T, R) uint8, start/length (nb,) int32, out (R, 128 nb) uint8."""
    nb = start.shape[0]
    _aligned_transpose_kernel(x, start, length, out).launch(
        grid=[nb, x.shape[1] // COLS, 1], block=[THREADS, 1, 1], stream=stream)


@cute.kernel
def _quantize_tokens_kernel(mX: cute.Tensor, mStart: cute.Tensor, mLen: cute.Tensor, mVal: cute.Tensor,
                            mScale: cute.Tensor, fmax: Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    blk, cb, _ = cute.arch.block_idx()
    smem = memory.SmemAllocator()
    sX = smem.allocate_tensor(element_type=Float32, layout=cute.make_layout((ROWS, COLS), stride=(_PITCH, 1)),
                              byte_alignment=16)
    sMax = smem.allocate_tensor(element_type=Float32, layout=cute.make_layout((2, COLS), stride=(COLS, 1)),
                                byte_alignment=16)
    start = mStart[blk]
    length = mLen[blk]
    # staged in float32, 16 rows x 64 columns a pass
    _stage_tile(mX, sX, start, length, cb, tidx, COLS // 8)
    cute.arch.sync_threads()
    # thread t holds half t % 2 of column t // 2 (64 tokens, as _column_chunks reads them); the
    # column's amax over both halves, NaN propagating as in XLA's max
    c, half = tidx // 2, tidx % 2
    vals = cute.make_rmem_tensor((64,), Float32)
    _column_chunks(sX, c, half, vals)
    sMax[half, c] = _amax(vals)
    cute.arch.sync_threads()
    scale = _block_scale(cute.arch.fmax(sMax[0, c], sMax[1, c], nan=True), fmax)
    if half == 0:
        mScale[cb * COLS + c, blk] = scale
    _store_quantized(vals, scale, mVal, cb * COLS + c, blk, half)


@cute.jit
def quantize_tokens(stream, x: cute.Tensor, start: cute.Tensor, length: cute.Tensor, values: cute.Tensor,
                    scales: cute.Tensor):
    """cute_call launcher: x (T, R) float, start/length (nb,) int32 -> values (R, 128 nb) fp8,
    scales (R, nb) float32."""
    nb = start.shape[0]
    _quantize_tokens_kernel(x, start, length, values, scales, FMAX[values.element_type]).launch(
        grid=[nb, x.shape[1] // COLS, 1], block=[THREADS, 1, 1], stream=stream)


ROW_THREADS = 256   # quantize_rows_and_tokens: a 128-token x 128-column tile per CTA
BLOCK_COLS = 128    # columns of R per CTA: one 1 x 128 block of every row


@cute.jit
def _chunk_xor(row):
    """The staged tiles' swizzle: rows 16-31 of every 32 keep their 8-value chunks pairwise swapped
    two apart (chunk ^ 2), so the two halves of a column a warp reads, 16 rows apart (the same
    banks in a 16-byte-aligned pitch), fall in different banks."""
    return ((row >> 4) & 1) * 2


@cute.jit
def _stage_tile(mX: cute.Tensor, sX: cute.Tensor, start, length, cb, tidx, chunks: Constexpr):
    """Rows [start, start + 128) x the ``chunks`` 8-column chunks from chunk ``chunks * cb`` of ``mX``
    into ``sX`` (in its element type: exact in float32), 16 rows a pass (``16 * chunks`` threads,
    8 columns a thread); rows past ``length`` are zeros. Every pass's load is issued before the
    first store (a row past the block reads the tensor's last row, then is zeroed): a load behind
    a branch waited for its predecessor's store, one 16-byte load in flight a thread."""
    frags = cute.make_rmem_tensor(cute.make_layout((8, ROWS // 16)), mX.element_type)
    last = mX.shape[0] - 1
    for p in cutlass.range_constexpr(ROWS // 16):
        row = cutlass.min(start + p * 16 + tidx // chunks, last)
        frags[None, p].store(cute.local_tile(mX, (1, 8), (row, cb * chunks + tidx % chunks))[0, None].load())
    for p in cutlass.range_constexpr(ROWS // 16):
        row = p * 16 + tidx // chunks
        if row >= length:
            frags[None, p].fill(0.0)
        chunk = cute.local_tile(sX, (1, 8), (row, (tidx % chunks) ^ _chunk_xor(row)))[0, None]
        chunk.store(frags[None, p].load().to(sX.element_type))


@cute.jit
def _row_chunks(sX: cute.Tensor, r, h, xs: cute.Tensor):
    """Half ``h`` of staged row ``r`` into ``xs`` (64 float32s): its 16-value pieces 2 i + h (i < 4),
    as _store_quantized writes them."""
    for i in cutlass.range_constexpr(4):
        for e in cutlass.range_constexpr(2):
            chunk = cute.local_tile(sX, (1, 8), (r, (4 * i + 2 * h + e) ^ _chunk_xor(r)))[0, None].load().to(Float32)
            for k in cutlass.range_constexpr(8):
                xs[16 * i + 8 * e + k] = chunk[k]


@cute.jit
def _column_chunks(sX: cute.Tensor, c, hc, xs: cute.Tensor):
    """Half ``hc`` of staged column ``c`` into ``xs`` (64 float32s): rows 32 i + 16 hc + j (i < 4,
    j < 16), the pieces _store_quantized writes. All of them share row 16 hc's swizzle."""
    col = c ^ (8 * _chunk_xor(16 * hc))
    for i in cutlass.range_constexpr(4):
        for j in cutlass.range(16, unroll_full=True):
            xs[16 * i + j] = sX[32 * i + 16 * hc + j, col].to(Float32)


@cute.jit
def _amax(xs: cute.Tensor) -> Float32:
    """The largest magnitude in ``xs`` (64 values), NaN propagating as in XLA's max: four
    independent chains, then their max (a shorter dependency chain; max is associative)."""
    m = cute.make_rmem_tensor((4,), Float32)
    m.fill(0.0)
    for i in cutlass.range(16, unroll_full=True):
        for k in cutlass.range_constexpr(4):
            m[k] = _absmax(m[k], xs[4 * i + k])
    return cute.arch.fmax(cute.arch.fmax(m[0], m[1], nan=True), cute.arch.fmax(m[2], m[3], nan=True), nan=True)


def _staging(smem, element_type):
    """The staged 128 x 128 tile, rows 16 bytes apart beyond their width (fewer bank conflicts),
    swizzled (_chunk_xor)."""
    pitch = BLOCK_COLS + 128 // element_type.width
    return smem.allocate_tensor(element_type=element_type, layout=cute.make_layout((ROWS, BLOCK_COLS), stride=(pitch, 1)),
                                byte_alignment=16)


@cute.kernel
def _quantize_rows_and_tokens_kernel(mX: cute.Tensor, mStart: cute.Tensor, mLen: cute.Tensor, mRowVal: cute.Tensor,
                                     mRowScale: cute.Tensor, mVal: cute.Tensor, mScale: cute.Tensor, fmax: Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    blk, cb, _ = cute.arch.block_idx()
    smem = memory.SmemAllocator()
    sX = _staging(smem, mX.element_type)
    sRow = smem.allocate_tensor(element_type=Float32, layout=cute.make_layout((ROWS, 2), stride=(2, 1)),
                                byte_alignment=16)
    sCol = smem.allocate_tensor(element_type=Float32, layout=cute.make_layout((2, BLOCK_COLS), stride=(BLOCK_COLS, 1)),
                                byte_alignment=16)
    start = mStart[blk]
    length = mLen[blk]
    _stage_tile(mX, sX, start, length, cb, tidx, BLOCK_COLS // 8)
    cute.arch.sync_threads()
    # thread t takes half t % 2 of row t // 2 (a 1 x 128 block along the columns) and half t % 2
    # of column t // 2 (a block of 128 tokens): first each block's amax over both halves (NaN
    # propagating as in XLA's max), then its values, read again from shared memory (holding
    # both blocks' values in registers would leave one CTA an SM: 1.7x slower)
    r, h = tidx // 2, tidx % 2
    xs = cute.make_rmem_tensor((64,), Float32)
    _row_chunks(sX, r, h, xs)
    sRow[r, h] = _amax(xs)
    _column_chunks(sX, r, h, xs)
    sCol[h, r] = _amax(xs)
    cute.arch.sync_threads()
    # the row block: its scale and fp8 values
    scale = _block_scale(cute.arch.fmax(sRow[r, 0], sRow[r, 1], nan=True), fmax)
    if r < length:
        if h == 0:
            mRowScale[start + r, cb] = scale
        _row_chunks(sX, r, h, xs)
        _store_quantized(xs, scale, mRowVal, start + r, cb, h)
    # the token block: as quantize_tokens' (zeros past the block's length)
    scale = _block_scale(cute.arch.fmax(sCol[0, r], sCol[1, r], nan=True), fmax)
    if h == 0:
        mScale[cb * BLOCK_COLS + r, blk] = scale
    _column_chunks(sX, r, h, xs)
    _store_quantized(xs, scale, mVal, cb * BLOCK_COLS + r, blk, h)


@cute.jit
def quantize_rows_and_tokens(stream, x: cute.Tensor, start: cute.Tensor, length: cute.Tensor, row_values: cute.Tensor,
                             row_scales: cute.Tensor, values: cute.Tensor, scales: cute.Tensor):
    """cute_call launcher: x (T, R) float (16 or 32 bits), start/length (nb,) int32 (blocks covering
    every token) -> row_values (T, R) fp8 and row_scales (T, R / 128) float32 (1 x 128 blocks
    along R), values (R, 128 nb) fp8 and scales (R, nb) float32 (as quantize_tokens')."""
    _launch_rows_and_tokens(stream, x, start, length, row_values, row_scales, values, scales)


@cute.jit
def quantize_rows_and_group_tokens(stream, x: cute.Tensor, start: cute.Tensor, length: cute.Tensor, end: cute.Tensor,
                                   row_values: cute.Tensor, row_scales: cute.Tensor, values: cute.Tensor,
                                   scales: cute.Tensor):
    """quantize_rows_and_tokens over a grouped layer's blocks, which cover tokens [0, end[0])
    (end (1,) int32): the rows past them (past the last group) are written as zeros with scale 1
    by a second kernel, a CTA per 128 rows (one that holds none returns at once)."""
    _launch_rows_and_tokens(stream, x, start, length, row_values, row_scales, values, scales)
    _zero_rows_kernel(end, row_values, row_scales).launch(
        grid=[(x.shape[0] + ROWS - 1) // ROWS, 1, 1], block=[ROW_THREADS, 1, 1], stream=stream)


@cute.kernel
def _zero_rows_kernel(mEnd: cute.Tensor, mRowVal: cute.Tensor, mRowScale: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    rb, _, _ = cute.arch.block_idx()
    # thread t: half t % 2 of row t // 2 of this CTA's 128, in every 1 x 128 block of the row
    row, h = rb * ROWS + tidx // 2, tidx % 2
    if row >= mEnd[0] and row < mRowVal.shape[0]:
        zeros = cute.make_rmem_tensor((64,), Float32)
        zeros.fill(0.0)
        out = cute.make_rmem_tensor((64,), mRowVal.element_type)
        out.store(zeros.load().to(mRowVal.element_type))
        for cb in cutlass.range(mRowVal.shape[1] // BLOCK_COLS, unroll=1):
            cute.local_tile(mRowVal, (1, 64), (row, cb * 2 + h))[0, None].store(out.load())
            if h == 0:
                mRowScale[row, cb] = Float32(1.0)


@cute.jit
def _launch_rows_and_tokens(stream, x: cute.Tensor, start: cute.Tensor, length: cute.Tensor, row_values: cute.Tensor,
                            row_scales: cute.Tensor, values: cute.Tensor, scales: cute.Tensor):
    nb = start.shape[0]
    _quantize_rows_and_tokens_kernel(x, start, length, row_values, row_scales, values, scales,
                                     FMAX[values.element_type]).launch(
        grid=[nb, x.shape[1] // BLOCK_COLS, 1], block=[ROW_THREADS, 1, 1], stream=stream)


@cute.kernel
def _quantize_weight_kernel(mX: cute.Tensor, mVal: cute.Tensor, mValT: cute.Tensor, mScale: cute.Tensor,
                            fmax: Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    kb, nb, l = cute.arch.block_idx()
    x, val, val_t, sc = mX[(l, None, None)], mVal[(l, None, None)], mValT[(l, None, None)], mScale[(l, None, None)]
    smem = memory.SmemAllocator()
    sX = _staging(smem, mX.element_type)
    sWarp = smem.allocate_tensor(element_type=Float32, layout=cute.make_layout((ROW_THREADS // 32,)), byte_alignment=16)
    _stage_tile(x, sX, kb * ROWS, ROWS, nb, tidx, BLOCK_COLS // 8)
    cute.arch.sync_threads()
    # the block's amax: each thread's half row, then across the warp, then across the 8 warps
    # (NaN propagating as in XLA's max)
    r, h = tidx // 2, tidx % 2
    xs = cute.make_rmem_tensor((64,), Float32)
    _row_chunks(sX, r, h, xs)
    m = _amax(xs)
    for k in cutlass.range_constexpr(5):
        m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, 1 << k), nan=True)
    if tidx % 32 == 0:
        sWarp[tidx // 32] = m
    cute.arch.sync_threads()
    amax = sWarp[0]
    for w in cutlass.range_constexpr(1, ROW_THREADS // 32):
        amax = cute.arch.fmax(amax, sWarp[w], nan=True)
    scale = _block_scale(amax, fmax)
    if tidx == 0:
        sc[kb, nb] = scale
    # the values in the weight's layout (thread t: half t % 2 of row t // 2) and transposed
    # (half t % 2 of column t // 2)
    _store_quantized(xs, scale, val, kb * ROWS + r, nb, h)
    _column_chunks(sX, r, h, xs)
    _store_quantized(xs, scale, val_t, nb * BLOCK_COLS + r, kb, h)


@cute.jit
def quantize_weight(stream, x: cute.Tensor, values: cute.Tensor, values_t: cute.Tensor, scales: cute.Tensor):
    """cute_call launcher: x (L, K, N) float (16 or 32 bits; K and N multiples of 128) -> its
    128 x 128 blocks' fp8 values (L, K, N), the same values transposed (L, N, K) and the float32
    scales (L, K / 128, N / 128), in one pass (the quantizer's numerics)."""
    _quantize_weight_kernel(x, values, values_t, scales, FMAX[values.element_type]).launch(
        grid=[x.shape[1] // ROWS, x.shape[2] // BLOCK_COLS, x.shape[0]], block=[ROW_THREADS, 1, 1], stream=stream)
