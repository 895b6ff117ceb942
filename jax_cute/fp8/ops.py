"""The scaled products users call: ``jax_cute.matmul``/``dot_general``/``ragged_dot`` on
:class:`BlockScaled` operands land here.

Each checks the blocks at trace time (the contracting axis in blocks of 128 on both sides, each
free axis in blocks of 1 or 128), brings the operands into the primitives' layout (K last: a
transpose, which XLA fuses into the quantization that produced the values, or a copy), reports
what no kernel takes (``scaled.kernel_refusal``) and binds the primitive.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jax_cute import dispatch
from jax_cute.fp8.quantize import BLOCK, BlockScaled, check_block_scaled, grouped_blocks
from jax_cute.fp8.scaled import (OUT_DTYPES, kernel_refusal, scaled_gemm_p, scaled_ragged_k_p, scaled_ragged_m_p)
from jax_cute.activations import check_activation, is_gated


def _out_dtype(op: str, preferred_element_type) -> np.dtype:
    out = np.dtype(jnp.bfloat16 if preferred_element_type is None else preferred_element_type)
    if out not in OUT_DTYPES:
        raise TypeError(f"jax_cute.{op}: block-scaled products write bfloat16, float16 or float32, "
                        f"got preferred_element_type={out}")
    return out


def _as_scaled(op: str, x, which: str) -> BlockScaled:
    if not isinstance(x, BlockScaled):
        raise TypeError(f"jax_cute.{op}: with one block-scaled operand the other must be one too (quantize it "
                        f"with jax_cute.quantize); the {which} operand is a {type(x).__name__}")
    check_block_scaled(x, op)
    return x


def _free_block(op: str, x: BlockScaled, free: tuple[int, ...], which: str) -> int:
    """The rows-per-scale of the flattened free axes: 1 when every free axis has blocks of 1,
    else 128 for one free axis in blocks of 128."""
    blocks = [x.blocks[i] for i in free]
    if all(b == 1 for b in blocks):
        return 1
    if len(free) == 1 and blocks[0] == BLOCK:
        return BLOCK
    raise ValueError(f"jax_cute.{op}: the {which} operand's free axes {free} have blocks {tuple(blocks)}; "
                     f"a scaled product takes blocks of 1 on every free axis, or one free axis in blocks of "
                     f"{BLOCK} (got values {x.shape} in blocks {x.blocks})")


def _to_rows(x: BlockScaled, batch: tuple[int, ...], free: tuple[int, ...], k: int):
    """Values (L, R, K) and scales (L, Rb, Kb): batch axes, then free axes flattened, then K."""
    perm = batch + free + (k,)
    v, s = jnp.transpose(x.values, perm), jnp.transpose(x.scales, perm)
    lb = math.prod(x.shape[i] for i in batch)
    return (v.reshape(lb, math.prod(x.shape[i] for i in free), x.shape[k]),
            s.reshape(lb, math.prod(x.scales.shape[i] for i in free), x.scales.shape[k]))


def scaled_dot_general(lhs: BlockScaled, rhs: BlockScaled, dimension_numbers, *, preferred_element_type=None,
                       bias=None, activation: str | None = None, op: str = "dot_general"):
    """``lax.dot_general`` of the dequantised operands with two-level accumulation.

    One contracting dimension per operand, in blocks of 128 on both; batch dimensions in blocks
    of 1 and of equal extent; the free dimensions of each operand flattened into the GEMM's M
    (lhs) or N (rhs), in blocks of 1, or one free dimension in blocks of 128. The result has
    ``lax.dot_general``'s shape (batch, lhs free, rhs free) and dtype ``preferred_element_type``
    (bfloat16 by default; bfloat16, float16 or float32). ``bias`` broadcasts against the result's
    last axis (shape (N,) with N the rhs free extent; one rhs free dimension), ``activation`` as
    ``jax_cute.matmul``'s; both in float32 before the one rounding.
    """
    lhs, rhs = _as_scaled(op, lhs, "first"), _as_scaled(op, rhs, "second")
    out = _out_dtype(op, preferred_element_type)
    check_activation(op, activation)
    if lhs.group_sizes is not None or rhs.group_sizes is not None:
        raise ValueError(f"jax_cute.{op}: group-aligned operands (quantize_grouped) are for ragged_dot's "
                         "weight gradient (jax_cute.fp8.ragged_k_dot)")
    try:
        (lc, rc), (lb, rb) = dimension_numbers
        lc, rc, lb, rb = (tuple(int(d) % n for d in ds) for ds, n in
                          ((lc, lhs.ndim), (rc, rhs.ndim), (lb, lhs.ndim), (rb, rhs.ndim)))
    except (TypeError, ValueError):
        raise TypeError(f"jax_cute.{op}: dimension_numbers must be ((lhs_contract, rhs_contract), "
                        f"(lhs_batch, rhs_batch)), got {dimension_numbers!r}") from None
    if len(lc) != 1 or len(rc) != 1:
        raise ValueError(f"jax_cute.{op}: a scaled product contracts exactly one dimension of each operand "
                         f"(its blocks of {BLOCK} are the promotion interval), got {lc} and {rc}")
    k = lhs.shape[lc[0]]
    if rhs.shape[rc[0]] != k:
        raise ValueError(f"jax_cute.{op}: contracting extents differ: {lhs.shape} dim {lc[0]} vs {rhs.shape} "
                         f"dim {rc[0]}")
    for x, c, name in ((lhs, lc[0], "first"), (rhs, rc[0], "second")):
        if x.blocks[c] != BLOCK:
            raise ValueError(f"jax_cute.{op}: the {name} operand's contracting dimension {c} must be in blocks of "
                             f"{BLOCK}, got blocks {x.blocks} for values {x.shape}")
    if len(lb) != len(rb) or any(lhs.shape[i] != rhs.shape[j] for i, j in zip(lb, rb)):
        raise ValueError(f"jax_cute.{op}: batch dimensions {lb} of {lhs.shape} and {rb} of {rhs.shape} differ")
    if any(lhs.blocks[i] != 1 for i in lb) or any(rhs.blocks[i] != 1 for i in rb):
        raise ValueError(f"jax_cute.{op}: batch dimensions must be in blocks of 1 (got {lhs.blocks} / {rhs.blocks})")
    lf = tuple(i for i in range(lhs.ndim) if i not in lc + lb)
    rf = tuple(i for i in range(rhs.ndim) if i not in rc + rb)
    a_block, b_block = _free_block(op, lhs, lf, "first"), _free_block(op, rhs, rf, "second")
    a, sa = _to_rows(lhs, lb, lf, lc[0])
    b, sb = _to_rows(rhs, rb, rf, rc[0])
    n = b.shape[1]
    args = [a, sa, b, sb]
    if bias is not None:
        bias = jnp.asarray(bias)
        if len(rf) != 1 or bias.shape not in ((n,), (1,)):
            raise ValueError(f"jax_cute.{op}: a scaled product's bias has one entry per output column: shape "
                             f"({n},) with one rhs free dimension; got {bias.shape} (rhs free dims {rf})")
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            raise TypeError(f"jax_cute.{op}: bias must be floating point, got {bias.dtype}")
        args.append(jnp.broadcast_to(bias, (n,)))
    if is_gated(activation) and (len(rf) != 1 or n % 2):
        raise ValueError(f"jax_cute.{op}: {activation} needs one rhs free dimension of even extent, got {rhs.shape}")
    dispatch.at_trace(op, kernel_refusal(op, a=a.dtype, b=b.dtype, out=out, a_block=a_block, b_block=b_block))
    res = scaled_gemm_p.bind(*args, a_block=a_block, b_block=b_block, out_dtype=out.name, activation=activation,
                             compute="float32")
    last = [rhs.shape[i] for i in rf]
    if is_gated(activation):
        last[-1] //= 2
    return res.reshape(*(lhs.shape[i] for i in lb), *(lhs.shape[i] for i in lf), *last)


def scaled_matmul(a: BlockScaled, b: BlockScaled, *, transpose_a: bool = False, transpose_b: bool = False,
                  preferred_element_type=None, bias=None, activation: str | None = None):
    """``a' @ b'`` of block-scaled operands (``a'`` is ``a`` with its last two axes swapped when
    ``transpose_a``, likewise ``b``): K is a's last (or, transposed, second-to-last) axis, in
    blocks of 128 on both. ``a`` may have leading batch axes (blocks of 1) over a 2-D ``b``
    (a weight), which fold into M; otherwise both must have the same batch axes."""
    op = "matmul"
    a, b = _as_scaled(op, a, "first"), _as_scaled(op, b, "second")
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError(f"jax_cute.matmul: block-scaled operands must be at least 2-D, got {a.shape} and {b.shape}")
    ka = a.ndim - 2 if transpose_a else a.ndim - 1
    kb = b.ndim - 1 if transpose_b else b.ndim - 2
    if b.ndim == 2:  # a weight: a's leading axes are rows of M
        return scaled_dot_general(a, b, (((ka,), (kb,)), ((), ())), preferred_element_type=preferred_element_type,
                                  bias=bias, activation=activation, op=op)
    if a.ndim != b.ndim or a.shape[:-2] != b.shape[:-2]:
        raise ValueError(f"jax_cute.matmul: block-scaled operands need equal batch axes (or a 2-D second operand), "
                         f"got {a.shape} and {b.shape}")
    batch = tuple(range(a.ndim - 2))
    return scaled_dot_general(a, b, (((ka,), (kb,)), (batch, batch)), preferred_element_type=preferred_element_type,
                              bias=bias, activation=activation, op=op)


def scaled_ragged_dot(lhs: BlockScaled, rhs: BlockScaled, group_sizes, *, preferred_element_type=None,
                      bias=None, activation: str | None = None):
    """``lax.ragged_dot`` of block-scaled operands: lhs (M, K) in blocks of 1 x 128, rhs (G, K, N)
    in blocks of (1, 128, 128) or (1, 128, 1); rows of consecutive groups of ``group_sizes`` (G,)
    against their group's matrix, rows past the last group zero (group ends clipped at M,
    negative sizes as 0). ``bias`` (G, N) and ``activation`` as ``jax_cute.ragged_dot``'s."""
    op = "ragged_dot"
    lhs, rhs = _as_scaled(op, lhs, "first"), _as_scaled(op, rhs, "second")
    out = _out_dtype(op, preferred_element_type)
    check_activation(op, activation)
    group_sizes = jnp.asarray(group_sizes)
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.ndim != 1 or group_sizes.shape[0] != rhs.shape[0]:
        raise ValueError(f"jax_cute.ragged_dot: expected lhs [M,K], rhs [G,K,N], group_sizes [G]; got {lhs.shape}, "
                         f"{rhs.shape}, {group_sizes.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"jax_cute.ragged_dot: group_sizes must be integers, got {group_sizes.dtype}")
    if lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"jax_cute.ragged_dot: K differs: lhs {lhs.shape}, rhs {rhs.shape}")
    if lhs.blocks != (1, BLOCK) or rhs.blocks[:2] != (1, BLOCK) or rhs.blocks[2] not in (1, BLOCK):
        raise ValueError(f"jax_cute.ragged_dot: block-scaled lhs takes blocks (1, {BLOCK}) and rhs (1, {BLOCK}, "
                         f"{BLOCK}) or (1, {BLOCK}, 1); got {lhs.blocks} and {rhs.blocks}")
    if lhs.group_sizes is not None or rhs.group_sizes is not None:
        raise ValueError("jax_cute.ragged_dot: group-aligned operands are for the weight gradient (ragged_k_dot)")
    g, k, n = rhs.shape
    b, sb = jnp.swapaxes(rhs.values, 1, 2), jnp.swapaxes(rhs.scales, 1, 2)  # (G, N, K): K-major for WGMMA
    args = [lhs.values, lhs.scales, b, sb, group_sizes.astype(jnp.int32)]
    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.shape != (g, n):
            raise ValueError(f"jax_cute.ragged_dot: bias must have shape (G, N) = {(g, n)}, got {bias.shape}")
        args.append(bias)
    if is_gated(activation) and n % 2:
        raise ValueError(f"jax_cute.ragged_dot: {activation} needs an even N, got {n}")
    dispatch.at_trace(op, kernel_refusal(op, grouped="M", a=lhs.dtype, b=rhs.dtype, out=out, a_block=1,
                                         b_block=rhs.blocks[2]))
    return scaled_ragged_m_p.bind(*args, b_block=rhs.blocks[2], out_dtype=out.name, activation=activation,
                                  compute="float32")


def ragged_k_dot(a: BlockScaled, b: BlockScaled, group_sizes, *, preferred_element_type=jnp.float32):
    """The grouped weight gradient: ``out[g] = a[:, T_g] @ b[:, T_g].T`` (G, P, Q) for a (P, T) and
    b (Q, T) group-aligned block-scaled operands (``quantize_grouped`` with these ``group_sizes``),
    T_g the g-th consecutive range of T. For ``ragged_dot(x, w, sizes)``'s weight gradient,
    ``a = quantize_grouped(x.T, sizes)`` and ``b = quantize_grouped(dy.T, sizes)`` give dw (G, K, N).
    Float32 by default."""
    op = "ragged_k_dot"
    a, b = _as_scaled(op, a, "first"), _as_scaled(op, b, "second")
    out = _out_dtype(op, preferred_element_type)
    group_sizes = jnp.asarray(group_sizes)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"jax_cute.{op}: expected a (P, T) and b (Q, T), got {a.shape} and {b.shape}")
    if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"jax_cute.{op}: group_sizes must be integers of shape (G,), got "
                         f"{group_sizes.shape}:{group_sizes.dtype}")
    g, t = group_sizes.shape[0], a.shape[1]
    for x, name in ((a, "first"), (b, "second")):
        if x.group_sizes is None or x.blocks != (1, BLOCK) or x.group_sizes.shape != (g,):
            raise ValueError(f"jax_cute.{op}: the {name} operand must be quantized group-aligned along its last "
                             f"axis with {g} groups (jax_cute.fp8.quantize_grouped); got blocks {x.blocks}, "
                             f"group sizes {None if x.group_sizes is None else x.group_sizes.shape}")
        if x.scales.shape[1] != grouped_blocks(t, g):
            raise ValueError(f"jax_cute.{op}: the {name} operand's scales {x.scales.shape} do not hold "
                             f"{grouped_blocks(t, g)} group-aligned blocks")
    dispatch.at_trace(op, kernel_refusal(op, grouped="K", a=a.dtype, b=b.dtype, out=out))
    return scaled_ragged_k_p.bind(a.values, a.scales, b.values, b.scales, group_sizes.astype(jnp.int32),
                                  out_dtype=out.name, compute="float32", aligned=False)


def ragged_k_dot_aligned(a: tuple, b: tuple, group_sizes, *, preferred_element_type=jnp.float32):
    """:func:`ragged_k_dot` of operands already in the group-aligned layout, as
    ``fp8.wgrad_operands.quantize_tokens`` writes them: a = (values (P, 128 nb), scales (P, nb)),
    b likewise (Q rows), ``group_sizes`` (G,) the groups' token counts, clipped to the tokens
    there were (``quantize.group_ends``)."""
    op = "ragged_k_dot"
    out = _out_dtype(op, preferred_element_type)
    (av, sa), (bv, sb) = a, b
    nb = sa.shape[1]
    if av.shape != (sa.shape[0], BLOCK * nb) or bv.shape != (sb.shape[0], BLOCK * nb) or sb.shape[1] != nb:
        raise ValueError(f"jax_cute.{op}: group-aligned operands must be (rows, 128 nb) with scales (rows, nb), got "
                         f"{av.shape}/{sa.shape} and {bv.shape}/{sb.shape}")
    dispatch.at_trace(op, kernel_refusal(op, grouped="K", a=av.dtype, b=bv.dtype, out=out))
    return scaled_ragged_k_p.bind(av, sa, bv, sb, jnp.asarray(group_sizes, jnp.int32), out_dtype=out.name,
                                  compute="float32", aligned=True)


def is_scaled(*xs) -> bool:
    return any(isinstance(x, BlockScaled) for x in xs)

