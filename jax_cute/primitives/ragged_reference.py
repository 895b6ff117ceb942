"""The grouped GEMMs in plain lax ops: what the grouped primitives lower to where no kernel runs,
and what a kernel's first-use check compares against."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_cute import layout as L
from jax_cute.problem.ragged_layouts import RAGGED_M, RaggedLayouts


def group_ends(sizes, extent: int):
    """Documented bad-size rules: negative sizes count as 0 and group ends are clipped at
    ``extent``. A saturating scan (``x + min(y, R - x)``) cannot overflow int32."""
    s = jnp.clip(sizes.astype(jnp.int32), 0, extent)
    return jax.lax.associative_scan(lambda x, y: x + jnp.minimum(y, extent - x), s, axis=0)


def row_groups(sizes, extent: int):
    """(the group ends, ``group_ends``; the group of each of ``extent`` rows, G past the last)
    for one (G,) set of sizes."""
    ends = group_ends(sizes, extent)
    return ends, jnp.searchsorted(ends, jnp.arange(extent, dtype=jnp.int32), side="right").astype(jnp.int32)


def clipped_sizes(ends):
    return jnp.diff(ends, axis=0, prepend=jnp.zeros_like(ends[:1]))


def reference(a, b, gs, *, layouts: RaggedLayouts, out_dtype, acc_dtype, precision=None):
    """The grouped GEMM in plain lax ops (masks, as lax.ragged_dot's own decomposition),
    reading and writing through the layouts; a lead (``layouts.lead``) is masked out."""
    av, bv, sv = L.read(a, layouts.a), L.read(b, layouts.b), L.read(gs, layouts.gs)
    acc = np.dtype(acc_dtype)
    ends = group_ends(sv, layouts.ragged_extent())  # (G, L)
    starts = ends - clipped_sizes(ends)
    # mask[g, r, l]: ragged index r (row m, or reduction index k) lies in group g of batch l
    r = jnp.arange(av.shape[0 if layouts.mode == RAGGED_M else 1], dtype=jnp.int32)[None, :, None]
    mask = (starts[:, None, :] <= r) & (r < ends[:, None, :])
    mask = mask[1:] if layouts.lead else mask
    if layouts.mode == RAGGED_M:
        am = jnp.where(mask[:, :, None, :], av[None], 0)  # (G, M, K, L)
        cv = jax.lax.dot_general(am, bv, (((0, 2), (2, 1)), ((3,), (3,))), precision=precision,
                                 preferred_element_type=acc)  # (L, M, N)
        cv = jnp.transpose(cv, (1, 2, 0))
    else:
        am = jnp.where(mask[:, None, :, :], av[None], 0)  # (G, M, K, L)
        cv = jax.lax.dot_general(am, bv, (((2,), (1,)), ((3,), (2,))), precision=precision,
                                 preferred_element_type=acc)  # (L, G, M, N)
        cv = jnp.transpose(cv, (2, 3, 1, 0))
    return L.write(cv.astype(out_dtype), layouts.c, layouts.c_shape)
