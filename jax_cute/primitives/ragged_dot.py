"""``jax_cute.ragged_dot``: ``lax.ragged_dot``'s shapes, dtypes and errors, as one grouped GEMM
(``grouped.py``'s ``jax_cute_ragged_m``), or with an epilogue ``ragged_fused.py``'s primitive.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_cute import dispatch
from jax_cute.fp8 import ops as fp8_ops
from jax_cute.kernels.gemm_spec import dtype_refusal
from jax_cute.primitives import ragged_fused, sharding
from jax_cute.primitives.dot_dtypes import (acc_dtype, hashable_precision, inputs_name, operand_dtypes,
                                            converted, struct, weak_as)
from jax_cute.primitives.grouped import ragged_m_p
from jax_cute.primitives.matmul import operand_dtype_error
from jax_cute.primitives.ragged_reference import clipped_sizes, group_ends
from jax_cute.problem.ragged_layouts import ragged_dot_layouts

_INT32_MAX = 2**31 - 1


def ragged_dot(lhs, rhs, group_sizes, *, precision=None, preferred_element_type=None, group_offset=None,
               out_sharding=None, bias=None, activation: str | None = None):
    """A drop-in for ``jax.lax.ragged_dot``: ``out[m] = lhs[m] @ rhs[g]`` for the rows m of group g.

    ``lhs`` is [M, K], ``rhs`` [G, K, N], ``group_sizes`` [G] integer (used as int32); the result is
    [M, N], its dtype and the operands' conversions as ``lax.ragged_dot``'s (bf16 x f16 gives
    bf16), and so are the errors. Groups are consecutive row ranges; rows past
    ``sum(group_sizes)`` are zero, and group ends past M are clipped, as in ``lax.ragged_dot``.
    Negative sizes are refused: with concrete ``group_sizes`` (a numpy array, even one closed
    over under ``jit``) this raises ValueError. Under ``jit`` the sizes are only known on the
    device, where the kernels count a negative size as zero (``lax.ragged_dot`` would instead let
    the next groups start earlier and overlap; no kernel reads or writes out of bounds either
    way). ``precision`` is lax's: validated when traced, and passed to XLA wherever XLA computes
    (the kernels multiply 16- and 8-bit inputs exactly and accumulate in float32). With
    ``preferred_element_type=float32`` on 16-bit inputs the result is float32 and its cotangent is
    rounded once to the input dtype for the gradient GEMMs. The cotangent of ``group_sizes`` is
    float0.

    ``group_offset`` (an integer scalar, or shape (1,)) is for experts split across devices:
    ``group_sizes`` then has one entry per expert of all devices (G_total >= G), ``rhs`` holds G
    experts, ``offset`` to ``offset + G - 1``, and only their rows are computed: row m of group
    ``offset + j`` is ``lhs[m] @ rhs[j]``, every other row is zero. A concrete offset must lie in
    [0, G_total - G] (ValueError); a traced one is clamped there, as ``lax.dynamic_slice`` clamps.
    The grouped kernel sees the rows before the offset's first as a lead it stores zeros to, with
    no product: only the local groups' tiles multiply.

    ``out_sharding`` constrains the result's sharding, as ``lax.ragged_dot``'s does. Under jit,
    sharded rows (tokens) stay local; sharded groups (experts) are gathered: expert
    parallelism is a ``shard_map`` with a token all-to-all (``jax_cute.primitives.sharding``).

    ``bias`` (G, N) and ``activation`` (as ``jax_cute.matmul``'s) give ``act(lhs[m] @ rhs[g] +
    bias[g])``, in float32 and rounded once; rows past the last group stay zero. The grouped
    kernel runs the epilogue (``ragged_fused.py``), and under ``grad`` also writes the
    pre-activation its backward needs.

    With ``jax_cute.fp8.BlockScaled`` operands this is the block-scaled grouped product
    (``jax_cute.fp8.scaled_ragged_dot``; no ``group_offset``).
    """
    if fp8_ops.is_scaled(lhs, rhs):
        if group_offset is not None:
            raise ValueError("jax_cute.ragged_dot: group_offset is not supported with block-scaled operands")
        return sharding.constrain(fp8_ops.scaled_ragged_dot(lhs, rhs, group_sizes, bias=bias, activation=activation,
                                                            preferred_element_type=preferred_element_type),
                                  out_sharding)
    if not isinstance(group_sizes, jax.core.Tracer):  # before jnp.asarray, which may wrap int64 to int32
        sizes = np.asarray(group_sizes)
        if sizes.dtype.kind in "iu" and (sizes > _INT32_MAX).any():
            raise ValueError(f"jax_cute.ragged_dot: group sizes {sizes[sizes > _INT32_MAX].tolist()} do not fit "
                             f"int32, in which group sizes are counted (at most {_INT32_MAX})")
    _refuse_concrete_negative(group_sizes)
    lhs, rhs, group_sizes = jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes)
    desc = f"lhs {lhs.shape}:{lhs.dtype}, rhs {rhs.shape}:{rhs.dtype}, group_sizes {group_sizes.shape}:{group_sizes.dtype}"
    for x in (lhs, rhs):
        if operand_dtype_error(x.dtype):
            raise TypeError(f"jax_cute.ragged_dot: unsupported operand dtype {x.dtype} ({desc})")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"jax_cute.ragged_dot: group_sizes must be integers (int32 is used); got {desc}")
    # with group_offset, lax's rules see the local groups' sizes
    local_gs = struct(group_sizes) if group_offset is None or rhs.ndim < 1 else \
        jax.ShapeDtypeStruct(rhs.shape[:1], group_sizes.dtype, weak_type=jax.typeof(group_sizes).weak_type)
    # lax.ragged_dot's own shape and dtype rules first: its errors, precision checks and result
    # type. Off any mesh: it infers no sharding on Explicit axes (ours is sharding.py's rule).
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        out = jax.eval_shape(lambda x, y, s: jax.lax.ragged_dot(x, y, s, precision=precision,
                                                                preferred_element_type=preferred_element_type),
                             struct(lhs), struct(rhs), local_gs)
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.ndim != 1:   # shapes lax takes and we do not
        raise ValueError(f"jax_cute.ragged_dot: expected lhs [M,K], rhs [G,K,N], group_sizes [G]; got {desc}")
    (m, k), (g, _, n) = lhs.shape, rhs.shape
    out_dtype = np.dtype(jax.dtypes.canonicalize_dtype(out.dtype))  # lax.ragged_dot keeps float64 under x32
    da, db = operand_dtypes(lhs.dtype, rhs.dtype, out_dtype)
    lhs, rhs = converted(lhs, da), converted(rhs, db)
    acc = acc_dtype(da, db, out_dtype)
    precision = hashable_precision(precision)
    # A wider size (traced, so unchecked) is capped at M first: it means the same rows, and never
    # wraps to a small or negative int32.
    wide = np.iinfo(group_sizes.dtype).max > _INT32_MAX
    gs32 = (jnp.minimum(group_sizes, m) if wide else group_sizes).astype(jnp.int32)
    dispatch.at_trace("ragged_dot", dtype_refusal(True, inputs_name(da, db), out_dtype.name))
    lead = group_offset is not None
    if lead:
        gs32 = _offset_sizes(gs32, group_offset, g, m)
    layouts = ragged_dot_layouts(m, k, g, n, lead)
    if bias is not None or activation is not None:
        res = ragged_fused.ragged_epilogue(lhs, rhs, gs32, layouts, bias=bias, activation=activation,
                                           out_dtype=out_dtype, acc_dtype=acc, precision=precision)
    else:
        res = ragged_m_p.bind(lhs, rhs, gs32, layouts=layouts, out_dtype=out_dtype.name, acc_dtype=acc.name,
                              precision=precision)
    return sharding.constrain(weak_as(res, out, bias), out_sharding)


def _refuse_concrete_negative(group_sizes) -> None:
    """ValueError for negative sizes known at trace time: a numpy array or list (closed over
    under jit too), or a concrete jax array."""
    if isinstance(group_sizes, jax.core.Tracer):
        return
    try:
        sizes = np.asarray(group_sizes)
    except Exception:  # noqa: BLE001 - not concrete after all: the device rules apply
        return
    if sizes.dtype.kind in "iu" and (sizes < 0).any():
        raise ValueError(f"jax_cute.ragged_dot: negative group sizes {sizes.tolist()} are not supported")


def _offset_sizes(sizes, group_offset, g: int, m: int):
    """The G + 1 sizes the grouped GEMM sees for ``group_offset``: a lead, the rows of the groups
    before ``offset`` (zero rows, no work), then the sizes of groups offset..offset+G-1 (ends
    clipped at M, negatives as 0, as everywhere)."""
    total = sizes.shape[0]
    if total < g:
        raise ValueError(f"jax_cute.ragged_dot: with group_offset, group_sizes needs at least G = {g} entries "
                         f"(one per expert of all devices), got {total}")
    offset = jnp.asarray(group_offset)
    if not jnp.issubdtype(offset.dtype, jnp.integer):
        raise TypeError(f"jax_cute.ragged_dot: group_offset must be an integer, got {offset.dtype}")
    if offset.shape not in ((), (1,)):
        raise ValueError(f"jax_cute.ragged_dot: group_offset must be a scalar (or shape (1,)), got shape "
                         f"{offset.shape}")
    if not isinstance(group_offset, jax.core.Tracer) and not isinstance(offset, jax.core.Tracer):
        o = int(np.asarray(offset).reshape(()))
        if not 0 <= o <= total - g:
            raise ValueError(f"jax_cute.ragged_dot: group_offset {o} is outside [0, {total - g}] for {g} local "
                             f"groups of {total}")
    offset = jnp.clip(jnp.reshape(offset, ()).astype(jnp.int32), 0, total - g)
    ends = group_ends(sizes, m)
    first_row = jnp.where(offset > 0, ends[jnp.maximum(offset - 1, 0)], 0)
    local = jax.lax.dynamic_slice(clipped_sizes(ends), (offset,), (g,))
    return jnp.concatenate([first_row[None], local])
