"""Block-scaled fp8 GEMM primitives: dense, grouped over M, grouped over K.

Each primitive takes its operands in the layout the Hopper kernel will read (DeepGEMM's "NT"
layout: both fp8 operands contiguous along K, which fp8 WGMMA requires) with their float32
block scales:

- ``jax_cute_scaled_gemm``: a (L, M, K), sa (L, ceil(M/bm), Kb), b (L, N, K), sb (L, ceil(N/bn), Kb)
  [, bias (N,)] -> (L, M, N); bm, bn (``a_block``/``b_block``) are 1 or 128 rows per scale,
  Kb = ceil(K/128).
- ``jax_cute_scaled_ragged_m``: a (M, K), sa (M, Kb), b (G, N, K), sb (G, ceil(N/bn), Kb),
  group_sizes (G,) [, bias (G, N)] -> (M, N): rows of consecutive groups against their group's b.
- ``jax_cute_scaled_ragged_k``: a (P, T), sa (P, Tb), b (Q, T), sb (Q, Tb), group_sizes (G,)
  -> (G, P, Q): T split into consecutive groups, blocks of 128 that restart at each group
  (``quantize_grouped``); out[g] contracts group g's part of T (a grouped weight gradient).

Numerics (the reference lowering, and what the kernel computes): per 128-K block, the product
of the fp8 values accumulated in float32 (exact products), multiplied by ``sa[row] * sb[col]``
of that block and added to a float32 accumulator; then ``act(acc + bias)`` in float32, rounded
once to the output dtype. A partial last K block is zero-padded.

Dispatch: every call runs the Hopper kernel (kernels/sm90_scaled.py, a mainloop of the
sm90_gemm kernel, its dense raster or its ragged_m / ragged_k walk) through ``dispatch.gemm``
like every other GEMM: a ``GemmRequest`` with ``scales``, the block scales passed transposed to
(L or G, Kb, row blocks), contiguous along the row blocks (the kernel loads 1-row-block scales
with TMA), their count zero-padded to a multiple of 4 (16-byte strides). The ragged-K call's
kernel passed its GPU tests and runs by default; a call no kernel takes is reported by
:func:`kernel_refusal` when it is traced (``dispatch.at_trace``: a log line, or
:class:`jax_cute.FallbackError` in strict mode) and lowers to the reference, as does a call the
kernel refuses when it is lowered (logged the same way). Its operands reach the kernel with T
laid out group-aligned (every group from a multiple of 128, zero-filled to the next): by
``fp8/wgrad_operands.py``'s transposing kernel, or :func:`group_aligned` (an XLA gather).

Lowered over several devices, each call is partitioned by its rules (``fp8/scaled_sharding.py``)
and runs this module's kernel or reference on each shard.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import dispatch as jax_dispatch
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding

from jax_cute import dispatch
from jax_cute.fp8.quantize import (BLOCK, FP8_DTYPES, aligned_columns, clipped_sizes, group_blocks, group_ends,
                                   grouped_blocks, row_groups)
from jax_cute.kernels.gemm_spec import PAIRED_BLOCK, SCALE_ROWS
from jax_cute.activations import apply_activation, is_gated
from jax_cute.layout import Layout, make_layout, stride_of
from jax_cute.fp8 import scaled_sharding
from jax_cute.fp8.scaled_sharding import epilogue
from jax_cute.primitives import remat, sharding
from jax_cute.problem.gemm_layouts import matmul_layouts
from jax_cute.problem.ragged_layouts import RAGGED_K, RAGGED_M, RaggedLayouts

logger = logging.getLogger("jax_cute")

OUT_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32))
KERNEL_BLOCKS = (1, BLOCK)   # rows per scale of either operand the Hopper kernel reads


def kernel_refusal(op: str, *, grouped: str | None = None, a=None, b=None, out=None, a_block: int = 1,
                   b_block: int = BLOCK) -> str | None:
    """Why no kernel of any arch takes this scaled call, or None (checked when it is traced;
    what only the target knows, its arch and the operands' layout, is checked when it is lowered).
    ``grouped``: "M" or "K" for the grouped calls ("K": a kernel never run on hardware, opt-in)."""
    del op   # (every activation has a kernel: a gated one reads B's scales per 64 paired columns or per column)
    # the ragged-K kernel's gate is dispatch's (arch.UNVERIFIED_VARIANTS), asked here at trace time
    if grouped == "K" and (why := dispatch.variant_allowed("sm_90a", "scaled_ragged_k")):
        return (f"block-scaled fp8 ragged-K (grouped weight gradient): {why}; the scaled product runs as XLA ops "
                "with the same two-level accumulation")
    if any(np.dtype(x) not in FP8_DTYPES for x in (a, b)) or np.dtype(out) not in OUT_DTYPES:
        return f"the block-scaled kernel takes fp8 operands into {'/'.join(d.name for d in OUT_DTYPES)}"
    if a_block not in KERNEL_BLOCKS or b_block not in KERNEL_BLOCKS:
        return f"the block-scaled kernel reads 1 or {BLOCK} rows per scale, not {a_block} and {b_block}"
    return None


def _padded_rows(rows: int) -> int:
    return -(-rows // SCALE_ROWS) * SCALE_ROWS


def _block_major(s) -> jax.Array:
    """Scales (L, row blocks, Kb) as the kernel reads them: (L, Kb, row blocks), contiguous along
    the row blocks (an (M, Kb) operand's as L = 1), which are zero-padded to a multiple of
    SCALE_ROWS (16-byte TMA strides; XLA fuses the pad with the transpose)."""
    t = jnp.swapaxes(s if s.ndim == 3 else s[None], 1, 2)
    return jnp.pad(t, ((0, 0), (0, 0), (0, _padded_rows(t.shape[2]) - t.shape[2])))


def _block_major_aval(s) -> jax.core.ShapedArray:
    return jax.core.ShapedArray((*(s.shape[:-2] or (1,)), s.shape[-1], _padded_rows(s.shape[-2])), s.dtype)


def _row_major(s, rows: int) -> jax.Array:
    """Block-major scales (L, Kb, padded row blocks) back to (L, ``rows``, Kb)."""
    return jnp.swapaxes(s[:, :, :rows], 1, 2)


def _dense_request(avals, params) -> dispatch.GemmRequest:
    a, sa, b, sb, *bias = avals
    (l, m, k), n = a.shape, b.shape[1]
    layouts, _ = matmul_layouts((l, m, k), (l, n, k), False, True)
    act = params["activation"]
    return dispatch.GemmRequest(
        (a, b, _block_major_aval(sa), _block_major_aval(sb), *bias), layouts, params["out_dtype"], "float32",
        epilogue=bool(bias or act), bias=bool(bias),
        bias_layout=make_layout(Layout((m,), (0,)), Layout((n,), (1,)), Layout((l,), (0,))),
        activation=act, scales=(params["a_block"], params["b_block"]))


def _k16(k: int) -> int:
    """K padded to 16 bytes of fp8 (a grouped kernel's row strides; never past the last K block)."""
    return -(-k // 16) * 16


def _ragged_m_request(avals, params) -> dispatch.GemmRequest:
    """The grouped request, a and b read with K padded to 16 bytes (``run`` pads them)."""
    a, sa, b, sb, gs, *bias = avals
    (m, _), (g, n, _) = a.shape, b.shape
    k = _k16(a.shape[1])
    a, b = a.update(shape=(m, k)), b.update(shape=(g, n, k))
    one = Layout((1,), (0,))
    mode = lambda e, d: Layout((e,), (stride_of(e, d),))  # noqa: E731
    # b (G, N, K): contiguous along K, as fp8 WGMMA reads it
    layouts = RaggedLayouts(RAGGED_M, make_layout(mode(m, k), mode(k, 1), one),
                            make_layout(mode(n, k), mode(k, 1), mode(g, n * k), one),
                            make_layout(mode(m, n), mode(n, 1), one), make_layout(mode(g, 1), one), (m, n))
    act = params["activation"]
    return dispatch.GemmRequest(
        (a, b, gs, _block_major_aval(sa), _block_major_aval(sb), *bias), layouts, params["out_dtype"],
        "float32", epilogue=bool(bias or act), bias=bool(bias), activation=act, scales=(1, params["b_block"]))


def _aligned_gather(group_sizes, t: int, blocks: int) -> tuple[jax.Array, jax.Array]:
    """Where each of the 128 ``blocks`` columns of the group-aligned layout (``group_aligned``)
    reads along T, and whether it holds an element (else a zero)."""
    _, bstart, blen, _ = group_blocks(group_sizes, t)
    return aligned_columns(bstart, blen, t, blocks)


def _take_aligned(x, gather: tuple[jax.Array, jax.Array]):
    src, keep = gather
    return jnp.where(keep, jnp.take(x, src, axis=1), jnp.zeros((), x.dtype))


def wgrad_kernels(rows: int):
    """``fp8.wgrad_operands`` (the weight gradient's operand kernels) where they take an operand
    of ``rows`` columns, else None (XLA ops instead). Imported here, where a weight gradient is
    traced or lowered, not before: the module defines kernels with the DSL."""
    try:
        from jax_cute.fp8 import wgrad_operands
    except ImportError as e:   # (a machine lowering from the disk cache without the DSL)
        logger.info("jax_cute fp8 weight-gradient operands: XLA ops, the DSL is not importable (%s)", e)
        return None
    return wgrad_operands if wgrad_operands.supported(rows) else None


def weight_kernel(shape: tuple[int, ...], dtype):
    """``fp8.weight_operands`` (a weight's two operands by one kernel) where it takes a weight
    of ``shape`` and ``dtype``, else None (XLA ops instead). Imported here, as wgrad_kernels."""
    try:
        from jax_cute.fp8 import weight_operands
    except ImportError as e:   # (a machine lowering from the disk cache without the DSL)
        logger.info("jax_cute fp8 weight operands: XLA ops, the DSL is not importable (%s)", e)
        return None
    return weight_operands if weight_operands.supported(shape, dtype) else None


def _group_aligned_operand(x, group_sizes, t: int, blocks: int):
    """``group_aligned`` for the ragged-K kernel's operand x (R, T): by the transposing kernel
    from x's token-major values (``x.T``, which the quantization wrote) where it takes R."""
    kernels = wgrad_kernels(x.shape[0])
    if kernels is not None:
        _, bstart, blen, _ = group_blocks(group_sizes, t)
        return kernels.aligned_transpose(x.T, bstart, blen)
    return _take_aligned(x, _aligned_gather(group_sizes, t, blocks))


def group_aligned(x, group_sizes, blocks: int):
    """``x`` (R, T), quantized group-aligned (``quantize_grouped``), with T laid out as the ragged-K
    kernel reads it: (R, 128 ``blocks``), scale block j's elements at [128 j, 128 j + its length),
    zeros elsewhere; so every group starts at 128 times its first block and ends zero-filled."""
    return _take_aligned(x, _aligned_gather(group_sizes, x.shape[1], blocks))


def _ragged_k_kernel(avals, params) -> Callable | None:
    """The ragged-K call's kernel (see ``_cuda_kernel``): a (P, T) and b (Q, T) laid out
    group-aligned, (P, Tp) and (Q, Tp) with Tp = 128 Tb, the group sizes clipped to T (the kernel
    rounds each up to 128: a group's first block is the sum of the rounded sizes before it / 128)."""
    a, sa, b, sb, gs = avals
    (p, t), q, g, tb = a.shape, b.shape[0], gs.shape[0], sa.shape[1]
    aligned = params.get("aligned", False)
    if t == 0 or tb != (t // BLOCK if aligned else grouped_blocks(t, g)):
        return None
    tp = tb * BLOCK
    one = Layout((1,), (0,))
    mode = lambda e, d: Layout((e,), (stride_of(e, d),))  # noqa: E731
    layouts = RaggedLayouts(RAGGED_K, make_layout(mode(p, tp), mode(tp, 1), one),
                            make_layout(mode(q, tp), mode(tp, 1), one),
                            make_layout(mode(p, q), mode(q, 1), mode(g, p * q), one), make_layout(mode(g, 1), one),
                            (g, p, q))
    req = dispatch.GemmRequest((a.update(shape=(p, tp)), b.update(shape=(q, tp)), gs, _block_major_aval(sa),
                                _block_major_aval(sb)), layouts, params["out_dtype"], "float32", scales=(1, 1))

    def reference(x, y, sizes, sx, sy):
        """The reference of the kernel's operands (group-aligned, sizes rounded up to 128 as the
        kernel rounds them)."""
        return ragged_k_reference(x, _row_major(sx, p)[0], y, _row_major(sy, q)[0], sizes,
                                  **{**params, "aligned": True})

    impl = dispatch.gemm(req, reference)
    if impl is None:
        return None

    def run(x, sx, y, sy, sizes):
        if aligned:   # laid out by the caller, the sizes clipped
            return impl(x, y, sizes, _block_major(sx), _block_major(sy))
        clipped = clipped_sizes(group_ends(sizes, t)).astype(jnp.int32)
        return impl(_group_aligned_operand(x, sizes, t, tb), _group_aligned_operand(y, sizes, t, tb), clipped,
                    _block_major(sx), _block_major(sy))

    return run


def _paired_scale_rows(activation: str | None, b_block: int | None, n: int) -> np.ndarray | None:
    """For a gated product with 128 x 128 B scales, which of B's scale rows (its 128-column
    blocks) the kernel reads per 64 paired columns (gemm_spec.PAIRED_BLOCK): row 2 t + h holds
    the block of columns h N/2 + 64 t (h: 0 gate, 1 up); None for other products (B's scales as
    given). The kernel's gated tiles need N/2 a multiple of 64 (else it refuses the call), so
    each 64 paired columns lie in one block."""
    if not is_gated(activation) or b_block == 1:
        return None
    t, h = np.divmod(np.arange(n // PAIRED_BLOCK), 2)
    return (h * (n // 2) + PAIRED_BLOCK * t) // BLOCK


def _paired_row_of_column(n: int) -> np.ndarray:
    """Each column's row among the scales per 64 paired columns (_paired_scale_rows)."""
    h, c = np.divmod(np.arange(n), n // 2)
    return 2 * (c // PAIRED_BLOCK) + h


def _cuda_kernel(name: str, avals, params) -> Callable | None:
    """The kernel for one shard's call (a function of its operands emitting the custom call),
    or None for the reference: every call asks ``dispatch.gemm``, which logs a refusal as a
    fallback (strict mode raises)."""
    # A gated tile pairs column j with j + N/2, which lie in different 128-column blocks: the
    # kernel reads B's 128-column scales per 64 paired columns, two a tile (gate and up), which
    # XLA gathers from B's (per-column scales, b_block 1, the kernel pairs itself).
    n, sb = avals[2].shape[-2], avals[3]
    b_rows = _paired_scale_rows(params.get("activation"), params.get("b_block"), n)
    if b_rows is not None:
        avals = (*avals[:3], sb.update(shape=(*sb.shape[:-2], len(b_rows), sb.shape[-1])), *avals[4:])
        params = {**params, "b_block": PAIRED_BLOCK}
    if name == "jax_cute_scaled_gemm":
        req = _dense_request(avals, params)
    elif name == "jax_cute_scaled_ragged_m":
        req = _ragged_m_request(avals, params)
    else:
        return _ragged_k_kernel(avals, params)
    n_gs = 1 if req.grouped else 0   # the group sizes of a grouped call

    def reorder(x, sx, y, sy, *rest):
        """The primitive's (a, sa, b, sb, [gs], [bias]) as the request's (a, b, [gs], sa, sb, [bias])."""
        if req.grouped:
            k = _k16(x.shape[1])
            x, y = _pad_k(x, 1, k), _pad_k(y, 2, k)
        if b_rows is not None:
            sy = jnp.take(sy, b_rows, axis=-2)
        return (x, y, *rest[:n_gs], _block_major(sx), _block_major(sy), *rest[n_gs:])

    rows = (avals[1].shape[-2], avals[3].shape[-2])   # the primitive's sa and sb row blocks

    def reference(x, y, *rest):
        """The reference of the request's operands (dispatch's first-use check)."""
        gs, (sx, sy), bias = rest[:n_gs], rest[n_gs:n_gs + 2], rest[n_gs + 2:]
        sx, sy = _row_major(sx, rows[0]), _row_major(sy, rows[1])
        ref_params = params
        if params.get("b_block") == PAIRED_BLOCK:   # back to per-column scales
            sy, ref_params = jnp.take(sy, _paired_row_of_column(n), axis=-2), {**params, "b_block": 1}
        return _REFERENCES[name](x, sx[0] if req.grouped else sx, y, sy, *gs, *bias, **ref_params)

    impl = dispatch.gemm(req, reference)
    if impl is None:
        return None

    def run(*args):
        out = impl(*reorder(*args))
        return out[0] if req.multiple_results else out

    return run


# Binding first makes the operands vary over the same manual mesh axes (inside shard_map).
scaled_gemm_p = sharding.VaryingPrimitive("jax_cute_scaled_gemm")
scaled_ragged_m_p = sharding.VaryingPrimitive("jax_cute_scaled_ragged_m")
scaled_ragged_k_p = sharding.VaryingPrimitive("jax_cute_scaled_ragged_k")

def _result(name: str, shape, dtype, avals, params: dict) -> jax.core.ShapedArray:
    """The result type: inside shard_map it varies over the operands' manual axes; on Explicit
    mesh axes it is sharded as the call's partitioning rules shard it (scaled_sharding)."""
    aval = sharding.varying_aval(shape, dtype, avals)
    spec = scaled_sharding.typed_result(name, avals, params)
    return aval if spec is None else aval.update(sharding=NamedSharding(aval.sharding.mesh, spec))


def _blocks(n: int, block: int) -> int:
    return -(-n // block)


# -- abstract evaluation ------------------------------------------------------------------------

def _check(name: str, ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {what}")


def _gemm_abstract(a, sa, b, sb, *bias, a_block, b_block, out_dtype, activation, compute):
    n = "jax_cute_scaled_gemm"
    (l, m, k), (lb, nn, kb) = a.shape, b.shape
    _check(n, (l, k) == (lb, kb), f"a {a.shape} and b {b.shape} must share L and K")
    kbl = _blocks(k, BLOCK)
    _check(n, sa.shape == (l, _blocks(m, a_block), kbl), f"sa {sa.shape} for a {a.shape} in blocks of {a_block}")
    _check(n, sb.shape == (l, _blocks(nn, b_block), kbl), f"sb {sb.shape} for b {b.shape} in blocks of {b_block}")
    _check(n, not bias or bias[0].shape == (nn,), f"bias {bias[0].shape if bias else None} for N={nn}")
    out_n = nn // 2 if is_gated(activation) else nn
    return _result(n, (l, m, out_n), out_dtype, (a, sa, b, sb, *bias),
                   dict(a_block=a_block, b_block=b_block, out_dtype=out_dtype, activation=activation, compute=compute))


def _ragged_m_abstract(a, sa, b, sb, gs, *bias, b_block, out_dtype, activation, compute):
    n = "jax_cute_scaled_ragged_m"
    (m, k), (g, nn, kb) = a.shape, b.shape
    kbl = _blocks(k, BLOCK)
    _check(n, k == kb and gs.shape == (g,), f"a {a.shape}, b {b.shape}, group sizes {gs.shape}")
    _check(n, sa.shape == (m, kbl) and sb.shape == (g, _blocks(nn, b_block), kbl),
           f"scales {sa.shape} / {sb.shape} for a {a.shape} / b {b.shape}")
    _check(n, not bias or bias[0].shape == (g, nn), f"bias {bias[0].shape if bias else None} for (G, N)=({g}, {nn})")
    out_n = nn // 2 if is_gated(activation) else nn
    return _result(n, (m, out_n), out_dtype, (a, sa, b, sb, gs, *bias),
                   dict(b_block=b_block, out_dtype=out_dtype, activation=activation, compute=compute))


def _ragged_k_abstract(a, sa, b, sb, gs, *, out_dtype, compute, aligned=False):
    n = "jax_cute_scaled_ragged_k"
    (p, t), (q, tb), g = a.shape, b.shape, gs.shape[0]
    _check(n, t == tb and sa.shape[0] == p and sb.shape[0] == q and sa.shape[1] == sb.shape[1],
           f"a {a.shape}, sa {sa.shape}, b {b.shape}, sb {sb.shape}")
    _check(n, not aligned or t == BLOCK * sa.shape[1], f"group-aligned operands {a.shape} for {sa.shape[1]} blocks")
    return _result(n, (g, p, q), out_dtype, (a, sa, b, sb, gs), dict(out_dtype=out_dtype, compute=compute, aligned=aligned))


scaled_gemm_p.def_abstract_eval(_gemm_abstract)
scaled_ragged_m_p.def_abstract_eval(_ragged_m_abstract)
scaled_ragged_k_p.def_abstract_eval(_ragged_k_abstract)

# What checkpoint policies see: the product of the fp8 values (scales aside), as lax states it.
# Operands: a, sa, b, sb[, group sizes].
def _gemm_view(avals, params) -> remat.LaxView:
    (l, m, k), n = avals[0].shape, avals[2].shape[1]
    return remat.dot_view(avals[0].dtype, avals[2].dtype, l, m, n, k, params["out_dtype"])


def _ragged_m_view(avals, params) -> remat.LaxView:
    (m, k), (g, n, _) = avals[0].shape, avals[2].shape
    return remat.ragged_view(avals[0].dtype, avals[2].dtype, RAGGED_M, m, n, k, g, 1, params["out_dtype"])


def _ragged_k_view(avals, params) -> remat.LaxView:
    (p, t), q, g = avals[0].shape, avals[2].shape[0], avals[4].shape[0]
    return remat.ragged_view(avals[0].dtype, avals[2].dtype, RAGGED_K, p, q, t, g, 1, params["out_dtype"])


remat.register(scaled_gemm_p, _gemm_view)
remat.register(scaled_ragged_m_p, _ragged_m_view)
remat.register(scaled_ragged_k_p, _ragged_k_view)


# -- reference: two-level accumulation in lax ------------------------------------------------------

def _pad_k(x, axis: int, to: int | None = None):
    """``x`` zero-padded along ``axis`` to ``to`` (default: whole K blocks)."""
    k = x.shape[axis]
    pad = (_blocks(k, BLOCK) * BLOCK if to is None else to) - k
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _row_scales(s, block: int, rows: int, axis: int):
    """Per-row scales along ``axis`` from per-block ones."""
    return s if block == 1 else jax.lax.slice_in_dim(jnp.repeat(s, block, axis=axis), 0, rows, axis=axis)


def gemm_reference(a, sa, b, sb, bias=None, *, a_block, b_block, out_dtype, activation=None, compute="float32"):
    """The dense scaled GEMM: per K block an f32 product of the fp8 values, scaled, summed in f32."""
    (l, m, k), n = a.shape, b.shape[1]
    cd = np.dtype(compute)
    nk = _blocks(k, BLOCK)
    a4 = _pad_k(a.astype(cd), 2).reshape(l, m, nk, BLOCK)
    b4 = _pad_k(b.astype(cd), 2).reshape(l, n, nk, BLOCK)
    sa_r, sb_r = _row_scales(sa, a_block, m, 1), _row_scales(sb, b_block, n, 1)  # (L, M, nk), (L, N, nk)

    def step(acc, xs):
        aj, bj, saj, sbj = xs
        part = jax.lax.dot_general(aj, bj, (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32)
        return acc + part * (saj[:, :, None] * sbj[:, None, :]), None

    xs = (jnp.moveaxis(a4, 2, 0), jnp.moveaxis(b4, 2, 0), jnp.moveaxis(sa_r, 2, 0), jnp.moveaxis(sb_r, 2, 0))
    acc, _ = jax.lax.scan(step, jnp.zeros((l, m, n), jnp.float32), xs)
    return epilogue(acc, bias, activation, out_dtype)


def ragged_m_reference(a, sa, b, sb, gs, bias=None, *, b_block, out_dtype, activation=None, compute="float32"):
    """Rows of consecutive groups against their group's b, two-level accumulation per K block."""
    (m, k), (g, n, _) = a.shape, b.shape
    cd = np.dtype(compute)
    nk = _blocks(k, BLOCK)
    ends, grp = row_groups(gs, m)
    sizes = clipped_sizes(ends)
    inside = grp < g
    gi = jnp.minimum(grp, g - 1)
    a3 = _pad_k(a.astype(cd), 1).reshape(m, nk, BLOCK)
    b4 = _pad_k(b.astype(cd), 2).reshape(g, n, nk, BLOCK)
    sb_r = _row_scales(sb, b_block, n, 1)  # (G, N, nk)

    def step(acc, xs):
        aj, bj, saj, sbj = xs  # (M, 128), (G, N, 128), (M,), (G, N)
        part = jax.lax.ragged_dot(aj, jnp.swapaxes(bj, 1, 2), sizes, preferred_element_type=jnp.float32)
        return acc + part * (saj[:, None] * sbj[gi]), None

    xs = (jnp.moveaxis(a3, 1, 0), jnp.moveaxis(b4, 2, 0), jnp.moveaxis(sa, 1, 0), jnp.moveaxis(sb_r, 2, 0))
    acc, _ = jax.lax.scan(step, jnp.zeros((m, n), jnp.float32), xs)
    if bias is not None:
        acc = acc + jnp.where(inside[:, None], bias.astype(jnp.float32)[gi], 0)
    out = apply_activation(activation, acc)
    return jnp.where(inside[:, None], out, 0).astype(out_dtype)  # rows past the last group stay zero


def ragged_k_reference(a, sa, b, sb, gs, *, out_dtype, compute="float32", aligned=False):
    """out[g] = sum over group g's blocks of (a_blk @ b_blk^T) * sa[:, blk] * sb[:, blk] in f32.
    ``aligned``: a and b are already group-aligned (``group_aligned``'s layout, T = 128 Tb) and
    ``gs`` the groups' token counts (clipped to the tokens there were): each group then spans its
    blocks' whole 128 columns."""
    (p, t), q, g = a.shape, b.shape[0], gs.shape[0]
    if aligned:
        gs = -(-jnp.clip(gs, 0, t) // BLOCK) * BLOCK
    cd = np.dtype(compute)
    _, bstart, blen, bgroup = group_blocks(gs, t)
    nb = sa.shape[1]
    # pad so that a 128-wide slice at any block start stays in bounds (dynamic_slice would clamp)
    ap = jnp.pad(a.astype(cd), ((0, 0), (0, BLOCK)))
    bp = jnp.pad(b.astype(cd), ((0, 0), (0, BLOCK)))
    lanes = jnp.arange(BLOCK, dtype=jnp.int32)

    def step(acc, j):
        keep = lanes < blen[j]
        aj = jnp.where(keep, jax.lax.dynamic_slice_in_dim(ap, bstart[j], BLOCK, axis=1), 0)
        bj = jnp.where(keep, jax.lax.dynamic_slice_in_dim(bp, bstart[j], BLOCK, axis=1), 0)
        part = jax.lax.dot_general(aj, bj, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        part = part * (sa[:, j][:, None] * sb[:, j][None, :])
        gj = bgroup[j]
        upd = jnp.where(gj >= 0, part, 0)[None]
        return jax.lax.dynamic_update_index_in_dim(acc, acc[jnp.maximum(gj, 0)] + upd[0], jnp.maximum(gj, 0), 0), None

    acc, _ = jax.lax.scan(step, jnp.zeros((g, p, q), jnp.float32), jnp.arange(nb, dtype=jnp.int32))
    return acc.astype(out_dtype)


# -- lowering: partitioned, then per shard the kernel or the reference ----------------------------------

_REFERENCES = {"jax_cute_scaled_gemm": gemm_reference, "jax_cute_scaled_ragged_m": ragged_m_reference,
               "jax_cute_scaled_ragged_k": ragged_k_reference}


def _local(name: str, avals, params, cuda: bool) -> Callable:
    """One shard's computation: the kernel where one takes it, else the reference (bf16 operands
    on the GPU, whose bf16 x bf16 -> f32 dot is exact for fp8 values; f32 elsewhere)."""
    impl = _cuda_kernel(name, avals, params) if cuda else None
    if impl is not None:
        return impl
    ref = _REFERENCES[name]
    compute = "bfloat16" if cuda else "float32"
    return lambda *args: ref(*args, **{**params, "compute": compute})


def _lowering(prim, cuda: bool):
    jax_dispatch.prim_requires_devices_during_lowering.add(prim)

    @sharding.typed_results  # (traced unmeshed on untyped avals, each result then typed)
    def rule(ctx, *args, **params):
        if sharding.one_shard(ctx.module_context.axis_context):
            fn = _local(prim.name, ctx.avals_in, params, cuda)
        else:
            call = scaled_sharding.Call(tuple(sorted({**params, "cuda": cuda}.items())), _local)
            fn = functools.partial(scaled_sharding.PARTITIONED[prim.name], call)
        return mlir.lower_fun(fn, multiple_results=False)(ctx, *args)

    return rule


for _p in (scaled_gemm_p, scaled_ragged_m_p, scaled_ragged_k_p):
    _p.def_impl(lambda *args, _prim=_p, **params: jax.jit(functools.partial(_prim.bind, **params))(*args))
    mlir.register_lowering(_p, _lowering(_p, cuda=False))
    mlir.register_lowering(_p, _lowering(_p, cuda=True), platform="cuda")


# -- batching ----------------------------------------------------------------------------------------

def _gemm_batch(args, dims, **params):
    """A vmapped axis joins L (an unbatched operand is broadcast along it); a batched bias runs
    the call once per batch element."""
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    if len(args) == 5 and dims[4] is not None:
        return _map_batch(scaled_gemm_p, args, dims, size, params), 0
    moved = []
    for x, d in zip(args[:4], dims[:4]):
        x = jnp.broadcast_to(x[None], (size, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)
        moved.append(x.reshape(size * x.shape[1], *x.shape[2:]))
    out = scaled_gemm_p.bind(*moved, *args[4:], **params)
    return out.reshape(size, -1, *out.shape[1:]), 0


def _map_batch(prim, args, dims, size: int, params):
    moved = [None if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(args, dims)]

    def one(xs):
        it = iter(xs)
        return prim.bind(*[next(it) if m is not None else x for x, m in zip(args, moved)], **params)

    return jax.lax.map(one, [m for m in moved if m is not None])


def _grouped_batch(prim, args, dims, **params):
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    return _map_batch(prim, args, dims, size, params), 0


def _no_jvp(prim, primals, tangents, **params):
    if all(type(t) is ad.Zero for t in tangents):
        out = prim.bind(*primals, **params)
        return out, ad.Zero(jax.typeof(out).to_tangent_aval())
    raise TypeError(f"{prim.name}: block-scaled products are not differentiated through their fp8 operands "
                    "(rounding to fp8 has no useful derivative); train with jax_cute.fp8.linear / grouped_linear "
                    "or jax_cute.kernelize(fn, fp8='blockwise'), whose gradients are fp8 products of their own")


for _prim in (scaled_gemm_p, scaled_ragged_m_p, scaled_ragged_k_p):
    ad.primitive_jvps[_prim] = functools.partial(_no_jvp, _prim)

batching.primitive_batchers[scaled_gemm_p] = _gemm_batch
batching.primitive_batchers[scaled_ragged_m_p] = functools.partial(_grouped_batch, scaled_ragged_m_p)
batching.primitive_batchers[scaled_ragged_k_p] = functools.partial(_grouped_batch, scaled_ragged_k_p)


def check_fp8(op: str, *dtypes) -> None:
    for dt in dtypes:
        if np.dtype(dt) not in FP8_DTYPES:
            raise TypeError(f"jax_cute.{op}: scaled operands must be float8_e4m3fn or float8_e5m2, got {dt}")
