"""Block-scaled float8: the container and the quantizer (DeepSeek-V3 / DeepGEMM's recipe).

A :class:`BlockScaled` holds e4m3 ``values`` and one float32 scale per block of ``block``
elements: the number it stands for is ``values * scale`` of the block the element lies in.
Activations take blocks of 1 x 128 along the contracting axis, weights 128 x 128. A block's
scale is ``amax / 448`` (448: e4m3's largest finite value), so the block's largest magnitude
maps to 448; with ``pow2_scales`` it is that rounded up to a power of two (DeepGEMM's ``ue8m0``
scales: dequantisation is then exact and the scale fits 8 exponent bits).

Sizes need not be multiples of the block: the last block of an axis is partial (its amax is
taken over the elements that exist). A group-aligned container (``group_sizes`` set; from
:func:`quantize_grouped`) has its last axis split into consecutive groups and blocks that
restart at each group's first element, as the weight gradient of a grouped GEMM needs.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jax_cute.fp8 import quantize_sharding
from jax_cute.primitives.ragged_reference import clipped_sizes, group_ends, row_groups  # noqa: F401 - re-exported
from jax_cute.primitives.sharding import explicit_axes, shard_index

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
FP8_DTYPES = (E4M3, E5M2)
BLOCK = 128  # the K block every scaled product promotes at (and the weights' square block)
ACTIVATION = "1x128"
WEIGHT = "128x128"
_FMAX = {E4M3: 448.0, E5M2: 57344.0}
_TINY = float(np.finfo(np.float32).tiny)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class BlockScaled:
    """fp8 ``values`` with float32 ``scales``, one per ``block`` of values.

    ``scales.shape[i] == ceil(values.shape[i] / block[i])`` on every axis, except the last
    axis of a group-aligned container (``group_sizes`` not None), whose blocks restart at each
    group's start and which has room for ``(T + 127 G) // 128`` of them (T the axis length, G
    the group count); elements outside every group are zero there. ``block`` is static (part
    of the pytree's structure); ``values``, ``scales`` and ``group_sizes`` are its leaves.
    """

    values: jax.Array
    scales: jax.Array
    block: tuple[int, ...]
    group_sizes: jax.Array | None = None

    def tree_flatten(self):
        return (self.values, self.scales, self.group_sizes), self.block

    @classmethod
    def tree_unflatten(cls, block, children):
        values, scales, group_sizes = children
        return cls(values, scales, block, group_sizes)

    @property
    def blocks(self) -> tuple[int, ...]:
        """``block`` as one extent per axis of ``values``: leading axes not named have blocks of 1
        (so the container keeps its meaning under vmap, which adds or removes leading axes)."""
        blk = tuple(int(b) for b in self.block)
        while len(blk) > self.ndim and blk[0] == 1:
            blk = blk[1:]
        return (1,) * (self.ndim - len(blk)) + blk

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def ndim(self) -> int:
        return len(self.values.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.values.dtype)

    @property
    def T(self) -> "BlockScaled":  # noqa: N802 - as jax.Array.T
        """The last two axes swapped, blocks with them (the weight's transposed blocks for
        dgrad: 128 x 128 blocks transpose into themselves)."""
        if self.group_sizes is not None:
            raise ValueError("jax_cute.fp8: a group-aligned BlockScaled cannot be transposed")
        perm = tuple(range(self.ndim - 2)) + (self.ndim - 1, self.ndim - 2)
        blk = self.blocks
        return BlockScaled(jnp.transpose(self.values, perm), jnp.transpose(self.scales, perm),
                           _strip(tuple(blk[i] for i in perm)))

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return dequantize(self, dtype)


def _block_tuple(block, ndim: int) -> tuple[int, ...]:
    """``block`` ("1x128", "128x128", an int tuple for the last axes, or one per axis) as one
    int per axis (1 on the leading axes not named)."""
    if isinstance(block, str):
        try:
            block = tuple(int(b) for b in block.lower().split("x"))
        except ValueError:
            raise ValueError(f"jax_cute.quantize: block {block!r} is not like '1x128' or '128x128'") from None
    if isinstance(block, (int, np.integer)):
        block = (int(block),)
    block = tuple(int(b) for b in block)
    if not block or len(block) > ndim:
        raise ValueError(f"jax_cute.quantize: block {block} does not fit an array of rank {ndim}")
    if any(b < 1 for b in block):
        raise ValueError(f"jax_cute.quantize: block sizes must be positive, got {block}")
    return (1,) * (ndim - len(block)) + block


def _strip(block: tuple[int, ...]) -> tuple[int, ...]:
    """Leading blocks of 1 dropped (they are implied), at least one entry kept."""
    i = 0
    while i < len(block) - 1 and block[i] == 1:
        i += 1
    return tuple(block[i:])


def check_block_scaled(x: BlockScaled, op: str = "fp8") -> None:
    """Trace-time checks of a container's consistency (ValueError / TypeError)."""
    if not isinstance(x, BlockScaled):
        raise TypeError(f"jax_cute.{op}: expected a BlockScaled, got {type(x).__name__}")
    if np.dtype(x.values.dtype) not in FP8_DTYPES:
        raise TypeError(f"jax_cute.{op}: BlockScaled values must be float8_e4m3fn or float8_e5m2, got "
                        f"{x.values.dtype}")
    if np.dtype(x.scales.dtype) != np.float32:
        raise TypeError(f"jax_cute.{op}: BlockScaled scales must be float32, got {x.scales.dtype}")
    if len(x.blocks) != x.ndim or x.scales.ndim != x.ndim:
        raise ValueError(f"jax_cute.{op}: values {x.shape}, scales {x.scales.shape} and block {x.block} "
                         "must have the same rank")
    want = scales_shape(x.shape, x.blocks, None if x.group_sizes is None else x.group_sizes.shape[0])
    if tuple(x.scales.shape) != want:
        raise ValueError(f"jax_cute.{op}: values {x.shape} in blocks {x.blocks} need scales of shape {want}, "
                         f"got {tuple(x.scales.shape)}")


def scales_shape(shape: Sequence[int], block: Sequence[int], groups: int | None = None) -> tuple[int, ...]:
    out = [-(-n // b) for n, b in zip(shape, block)]
    if groups is not None:
        out[-1] = grouped_blocks(shape[-1], groups, block[-1])
    return tuple(out)


def grouped_blocks(extent: int, groups: int, block: int = BLOCK) -> int:
    """Room for the blocks of ``groups`` consecutive groups of ``extent`` elements, each group
    starting a new block: sum(ceil(s_g / b)) <= (extent + (b - 1) G) // b."""
    return (extent + (block - 1) * groups) // block


def scale_of(amax, dtype: np.dtype, pow2: bool):
    """The block scale for a block whose largest magnitude is ``amax`` (float32)."""
    fmax = _FMAX[dtype]
    if pow2:
        # the smallest power of two s with amax / s <= fmax (division by 2^p is exact)
        _, e = jnp.frexp(amax / fmax)
        s = jnp.ldexp(jnp.float32(1), e)
        s = jnp.where(amax / (s * 0.5) <= fmax, s * 0.5, s)
        s = jnp.where(amax / s > fmax, s * 2, s)
        s = jnp.maximum(s, _TINY)
    else:
        # times the float32 reciprocal (XLA would turn a division by the constant into it anyway):
        # one definition on every backend
        s = jnp.maximum(amax * np.float32(1 / fmax), _TINY)
    # an all-zero (or empty) block: any scale holds it; 1 keeps dequantisation trivial
    return jnp.where(amax > 0, s, jnp.float32(1)).astype(jnp.float32)


def fp8_dtype(dtype, op: str) -> np.dtype:
    """``dtype`` as e4m3 or e5m2; a TypeError naming ``op`` for anything else."""
    dt = np.dtype(dtype)
    if dt not in FP8_DTYPES:
        raise TypeError(f"{op}: dtype must be float8_e4m3fn or float8_e5m2, got {dt}")
    return dt


def checkpoint_named(tree, name: str):
    """``jax.ad_checkpoint.checkpoint_name(tree, name)``, fp8 arrays named through their bits: a
    checkpoint policy that saves a residual rounds it with ``reduce_precision`` to its dtype's
    exponent and mantissa widths (jax 0.11, 0.12), which takes e4m3fn (no infinities) for IEEE-like
    e4m3 and turns its values of 256 and more into NaN."""
    def named(x):
        if np.dtype(x.dtype) not in FP8_DTYPES:
            return checkpoint_name(x, name)
        return jax.lax.bitcast_convert_type(checkpoint_name(jax.lax.bitcast_convert_type(x, jnp.uint8), name), x.dtype)
    return jax.tree_util.tree_map(named, tree)


def weight_pair(values, values_t, scales) -> tuple[BlockScaled, BlockScaled]:
    """A weight's two fp8 operands from the weight kernel's outputs for it (K, N) or (G, K, N):
    ``values`` in its layout with ``scales`` (dgrad's operand), and the same operand with its
    values stored transposed, ``values_t`` (..., N, K), seen through ``.T`` (the forward product's,
    which reads it K-major, so the transpose it would take cancels)."""
    blocks = (BLOCK, BLOCK)
    return BlockScaled(values, scales, blocks), BlockScaled(values_t, jnp.swapaxes(scales, -1, -2), blocks).T


def quantize_cast(x32, scale, dtype: np.dtype):
    fmax = _FMAX[dtype]
    # amax / (amax / 448) may round a hair above 448; clip so no value becomes NaN (e4m3fn has no inf)
    return jnp.clip(x32 / scale, -fmax, fmax).astype(dtype)


def quantize(x, block="1x128", *, pow2_scales: bool = False, dtype=jnp.float8_e4m3fn) -> BlockScaled:
    """``x`` as fp8 ``values`` with one float32 scale per ``block``.

    ``block``: ``"1x128"`` (activations: 128 consecutive elements of the last axis, which should
    be the axis a product contracts), ``"128x128"`` (weights: the last two axes), or the block
    extents as ints for the last axes (``(128, 1)``: 128 rows of one column, an activation
    quantized along its tokens for a weight gradient). Axes before those take blocks of 1.
    A block's scale is ``amax / fmax`` (fmax 448 for e4m3), or with ``pow2_scales`` the power of
    two at or above it; an all-zero block gets scale 1. Sizes need not divide the block (the
    last block of an axis is partial). One reduction and one elementwise pass, which XLA fuses
    with what produced ``x``; jit-able and vmap-able.
    """
    x = jnp.asarray(x)
    dt = fp8_dtype(dtype, "jax_cute.quantize")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"jax_cute.quantize: x must be floating point, got {x.dtype}")
    if x.ndim == 0:
        raise ValueError("jax_cute.quantize: x must have at least one axis")
    blk = _block_tuple(block, x.ndim)
    x, split_spec = _whole_blocks_a_shard(x, blk)
    x32 = x.astype(jnp.float32)
    nb = scales_shape(x.shape, blk)
    padded = jnp.pad(jnp.abs(x32), [(0, n * b - s) for n, b, s in zip(nb, blk, x.shape)])
    split = padded.reshape(tuple(d for n, b in zip(nb, blk) for d in (n, b)), out_sharding=split_spec)
    amax = jnp.max(split, axis=tuple(range(1, 2 * x.ndim, 2))) if x.size else jnp.zeros(nb, jnp.float32)
    scales = scale_of(amax, dt, pow2_scales)
    values = quantize_cast(x32, expand_scales(scales, blk, x.shape), dt)
    return BlockScaled(values, scales, _strip(blk))


def _typed_spec(x) -> jax.sharding.PartitionSpec | None:
    """``x``'s sharding on Explicit mesh axes (its type's), else None."""
    sharding = jax.typeof(x).sharding
    return sharding.spec if explicit_axes(sharding.mesh) else None


def _whole_blocks_a_shard(x, block: tuple[int, ...]):
    """On Explicit mesh axes (sharding in types): ``x`` with each axis whose shards would cut a
    block resharded whole (as the scaled products' rules replicate such a dimension), and the
    sharding of its (blocks, block) split, the axes on the blocks. Elsewhere (x, None)."""
    typed = _typed_spec(x)
    if typed is None:
        return x, None
    mesh = jax.typeof(x).sharding.mesh
    spec = tuple(typed) + (None,) * (x.ndim - len(typed))
    count = lambda axes: int(np.prod([mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes)]))  # noqa: E731
    kept = tuple(axes if axes is None or b == 1 or s % (count(axes) * b) == 0 else None
                 for axes, b, s in zip(spec, block, x.shape))
    if kept != spec:
        x = jax.sharding.reshard(x, jax.sharding.PartitionSpec(*kept))
    return x, jax.sharding.PartitionSpec(*(d for axes in kept for d in (axes, None)))


def expand_scales(scales, block: Sequence[int], shape: Sequence[int]):
    """Each element's scale: ``scales`` repeated over its blocks and cut to ``shape``."""
    out = scales
    for axis, (b, n) in enumerate(zip(block, shape)):
        if b > 1:   # (on Explicit mesh axes, sharded along the blocks as the scales are)
            out = jax.lax.slice_in_dim(jnp.repeat(out, b, axis=axis, out_sharding=_typed_spec(out)), 0, n, axis=axis)
    return out


def group_blocks(sizes, extent: int, block: int = BLOCK):
    """The block structure of group-aligned quantization of ``extent`` elements.

    Returns (block index of each element (``extent``,), -1 outside every group; per block: its
    first element, its length and its group, each (nb,), a block past the last one with length 0
    and group -1)."""
    g = sizes.shape[0]
    nb = grouped_blocks(extent, g, block)
    ends, grp = row_groups(sizes, extent)                        # grp: group of element t, G past the end
    starts = ends - clipped_sizes(ends)
    counts = (ends - starts + block - 1) // block
    first_block = jnp.cumsum(counts) - counts                    # (G,)
    t = jnp.arange(extent, dtype=jnp.int32)
    inside = grp < g
    gi = jnp.minimum(grp, g - 1)
    elem_block = jnp.where(inside, first_block[gi] + (t - starts[gi]) // block, -1)
    j = jnp.arange(nb, dtype=jnp.int32)
    bgroup = jnp.searchsorted(first_block + counts, j, side="right").astype(jnp.int32)
    valid = bgroup < g
    bg = jnp.minimum(bgroup, g - 1)
    bstart = starts[bg] + (j - first_block[bg]) * block
    blen = jnp.where(valid, jnp.clip(ends[bg] - bstart, 0, block), 0)
    return elem_block, jnp.where(valid, bstart, extent), blen, jnp.where(valid, bgroup, -1)


def aligned_columns(bstart, blen, extent: int, blocks: int, block: int = BLOCK) -> tuple[jax.Array, jax.Array]:
    """For the group-aligned layout (each scale block j at columns [block j, block j + its
    length)): where each of its ``block * blocks`` columns reads along the ``extent`` axis, and
    whether it holds an element (else a zero); ``bstart``/``blen`` as ``group_blocks`` gives them."""
    j = jnp.arange(blocks * block, dtype=jnp.int32)
    blk, lane = j // block, j % block
    return jnp.minimum(bstart[blk] + lane, extent - 1), lane < blen[blk]


def quantize_grouped(x, group_sizes, *, pow2_scales: bool = False, dtype=jnp.float8_e4m3fn) -> BlockScaled:
    """``x`` (..., T) quantized in blocks of 1 x 128 along its last axis, where the last axis is
    split into consecutive groups of ``group_sizes`` (G,) and every group starts a new block
    (a block never mixes two groups). The grouped weight gradient contracts T group by group
    (``ragged_dot``'s ragged-K form), so its scales must not straddle groups. Elements past the
    last group are zero. Scales have shape (..., (T + 127 G) // 128) (room for every block);
    unused trailing ones are 1."""
    x = jnp.asarray(x)
    group_sizes = jnp.asarray(group_sizes)
    dt = fp8_dtype(dtype, "jax_cute.quantize_grouped")
    if x.ndim < 1 or group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"jax_cute.quantize_grouped: expected x (..., T) and integer group_sizes (G,), got "
                         f"{x.shape} and {group_sizes.shape}:{group_sizes.dtype}")
    spec = _typed_spec(x)
    if spec is not None and len(spec) == x.ndim and spec[-1] is not None:
        values, scales = _grouped_over_shards(x, group_sizes, dt, pow2_scales, spec)
    elif spec is None:   # (under an Auto jit, the partitioner's rule keeps the tokens where they lie)
        values, scales = quantize_sharding.quantize_grouped(x, group_sizes, _GroupedLocal(dt, pow2_scales))
    else:
        values, scales = _grouped_blocks(x, group_sizes, dt, pow2_scales, x.shape[-1])
    return BlockScaled(values, scales, (BLOCK,), group_sizes.astype(jnp.int32))


@dataclasses.dataclass(frozen=True)
class _GroupedLocal:
    """quantize_grouped on one shard (quantize_sharding.Local)."""

    dtype: np.dtype
    pow2_scales: bool

    def __call__(self, x, sizes, total: int, lo, reduce):
        return _grouped_blocks(x, sizes, self.dtype, self.pow2_scales, total, lo, reduce)


def _grouped_blocks(x, group_sizes, dt, pow2_scales: bool, t: int, lo=0, reduce=None):
    """quantize_grouped's (values, scales) of ``x`` (..., T'), the tokens [lo, lo + T') of ``t``;
    ``reduce``: how the blocks' amax over these tokens combines with the other shards' (a block
    may straddle two)."""
    # computed token-major (for x = y.T that is y's own layout), the fp8 values transposed at the
    # end: each block's amax reduces 128 gathered rows, where a segment max over a transposed
    # operand ran as a scatter, several times slower (H100, the GPT example's fp8 MoE step)
    local = x.shape[-1]
    xt = jnp.moveaxis(x, -1, 0).astype(jnp.float32)                      # (T', ...)
    elem_block, bstart, blen, _ = group_blocks(group_sizes, t)
    if local != t:
        elem_block = jax.lax.dynamic_slice_in_dim(elem_block, lo, local)
    r = jnp.arange(BLOCK, dtype=jnp.int32)
    rows = bstart[:, None] + r - lo
    rows = jnp.where((r < blen[:, None]) & (rows >= 0) & (rows < local), rows, local)   # (nb, 128); past the end
    amax = jnp.max(jnp.take(jnp.abs(xt), rows, axis=0, mode="fill", fill_value=0), axis=1)   # (nb, ...)
    if reduce is not None:
        amax = reduce(amax)
    scales = scale_of(amax, dt, pow2_scales)
    inside = (elem_block >= 0).reshape((local,) + (1,) * (x.ndim - 1))
    per_row = jnp.take(scales, jnp.maximum(elem_block, 0), axis=0)          # (T', ...)
    values = jnp.where(inside, quantize_cast(xt, per_row, dt), jnp.zeros((), dt))
    return jnp.moveaxis(values, 0, -1), jnp.moveaxis(scales, 0, -1)


def _grouped_over_shards(x, group_sizes, dt, pow2_scales: bool, spec):
    """quantize_grouped where x's type shards its tokens (Explicit mesh axes): each shard
    quantizes its own tokens, its blocks' amax the max over the shards (one all-reduce of the
    scales); the values stay sharded as x is, the scales whole along the blocks."""
    axes = spec[-1] if isinstance(spec[-1], tuple) else (spec[-1],)
    mesh = jax.typeof(x).sharding.mesh

    def shard(xl, sizes):
        return _grouped_blocks(xl, sizes, dt, pow2_scales, x.shape[-1], shard_index(axes, mesh.shape) * xl.shape[-1],
                               lambda amax: jax.lax.pmax(amax, axes))

    P = jax.sharding.PartitionSpec
    return jax.shard_map(shard, mesh=mesh, in_specs=(P(*spec), P()), out_specs=(P(*spec), P(*spec[:-1], None)))(
        x, group_sizes)


def dequantize(x: BlockScaled, dtype=jnp.float32) -> jax.Array:
    """``values * scale`` in float32 (each product exact with power-of-two scales), cast to ``dtype``."""
    check_block_scaled(x, "dequantize")
    v = x.values.astype(jnp.float32)
    if x.group_sizes is not None:
        eb, _, _, _ = group_blocks(x.group_sizes, x.shape[-1], x.blocks[-1])
        s = jnp.where(eb >= 0, jnp.take(x.scales, jnp.maximum(eb, 0), axis=-1), 0.0)
    else:
        s = expand_scales(x.scales, x.blocks, x.shape)
    return (v * s).astype(dtype)

