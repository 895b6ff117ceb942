"""Layout metadata of a GEMM: how its logical modes M, N, K, L sit in the physical buffers.

``a`` maps (M, K, L) coordinates into A's buffer, ``b`` maps (N, K, L) into B's, ``c`` maps
(M, N, L) into the output buffer of shape ``c_shape``. Each mode may be hierarchical (a vmapped
axis adds a sub-mode to L, a broadcast operand has stride 0 there, a gradient folds L
sub-modes into K). The arithmetic is always ``C[m,n,l] = sum_k A[m,k,l] B[n,k,l]``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from jax_cute.layout import Layout, flatten, insert_axis, make_layout, product, row_major

M, N, K, L = "m", "n", "k", "l"


@dataclasses.dataclass(frozen=True)
class GemmLayouts:
    a: Layout
    b: Layout
    c: Layout
    c_shape: tuple[int, ...]

    def __post_init__(self):
        for name, lay in (("a", self.a), ("b", self.b), ("c", self.c)):
            if lay.rank != 3:
                raise ValueError(f"GEMM layout {name} must have 3 modes, got {lay}")

        ext = self.extents()
        if product(self.a.mode(0).shape) != ext[M] or product(self.b.mode(1).shape) != ext[K] \
                or product(self.b.mode(2).shape) != ext[L] or product(self.c.mode(1).shape) != ext[N] \
                or product(self.c.mode(2).shape) != ext[L] or product(self.a.mode(2).shape) != ext[L]:
            raise ValueError(f"GEMM layouts disagree on extents: a={self.a} b={self.b} c={self.c}")

    def extents(self) -> dict[str, int]:
        return {M: product(self.c.mode(0).shape), N: product(self.c.mode(1).shape),
                K: product(self.a.mode(1).shape), L: product(self.c.mode(2).shape)}


def batched_layout(lay: Layout, buffer_shape: Sequence[int], axis: int | None, size: int, l_mode: int) -> Layout:
    """``lay`` re-targeted at the buffer with a vmapped axis, which becomes an L sub-mode."""
    if axis is None:
        return lay.append_to_mode(l_mode, size, 0)
    unbatched = tuple(s for i, s in enumerate(buffer_shape) if i != axis)
    relocate, inner = insert_axis(unbatched, axis, size)
    return relocate.compose(lay).append_to_mode(l_mode, size, inner)


def batched_gemm(g: GemmLayouts, a_shape: Sequence[int], b_shape: Sequence[int], da: int | None, db: int | None,
                 size: int) -> GemmLayouts:
    """A dense GEMM's layouts vmapped over A and B at ``da``/``db`` (None: unbatched, read with
    stride 0); the output gets the batch axis in front, so its old offsets are unchanged at index 0."""
    return GemmLayouts(batched_layout(g.a, a_shape, da, size, 2), batched_layout(g.b, b_shape, db, size, 2),
                       g.c.append_to_mode(2, size, product(g.c_shape)), (size,) + tuple(g.c_shape))


def refine(modes: Sequence[Layout]) -> list[Layout]:
    """Split the sub-modes of congruent-in-size modes until they share one flat structure.

    Two operands can describe the same logical mode with different sub-mode splits (one was
    composed with a relocation, the other not); rules that pick sub-modes need them equal.
    """
    cuts: set[int] = set()
    for m in modes:
        acc = 1
        for s in flatten(m.shape):
            acc *= s
            cuts.add(acc)
    bounds = sorted(cuts)
    extents, prev = [], 1
    for b in bounds:
        if b % prev:
            raise ValueError(f"modes {[str(m) for m in modes]} have no common refinement")
        if b != prev:
            extents.append(b // prev)
        prev = b
    out = []
    for m in modes:
        shape, stride = [], []
        it = iter(extents)
        for s, d in m.flat_modes():
            covered, dd = 1, d
            while covered < s:
                e = next(it)
                shape.append(e)
                stride.append(0 if e == 1 else dd)
                dd *= e
                covered *= e
        out.append(Layout(tuple(shape), tuple(stride)) if shape else Layout((1,), (0,)))
    return out


def refined(g: GemmLayouts) -> GemmLayouts:
    """The same GEMM with every logical mode split identically in all operands."""
    am, cm = refine([g.a.mode(0), g.c.mode(0)])
    bn, cn = refine([g.b.mode(0), g.c.mode(1)])
    ak, bk = refine([g.a.mode(1), g.b.mode(1)])
    al, bl, cl = refine([g.a.mode(2), g.b.mode(2), g.c.mode(2)])
    return GemmLayouts(make_layout(am, ak, al), make_layout(bn, bk, bl), make_layout(cm, cn, cl), g.c_shape)


def sub_modes(lay: Layout, idx: Sequence[int]) -> Layout:
    fm = lay.flat_modes()
    if not idx:
        return Layout((1,), (0,))
    return Layout(tuple(fm[i][0] for i in idx), tuple(fm[i][1] for i in idx))


def cat_modes(*modes: Layout) -> Layout:
    shape = tuple(s for m in modes for s in flatten(m.shape))
    stride = tuple(d for m in modes for d in flatten(m.stride))
    return Layout(shape, stride)


def cotangent_a(g: GemmLayouts, a_shape: Sequence[int]) -> GemmLayouts:
    """dA[m,k,l] = sum_n dC[m,n,l] B[n,k,l]: a GEMM (M, N'=K, K'=N) over the same buffers.

    L sub-modes over which A was broadcast (stride 0) are summed: they join the reduction K'.
    """
    g = refined(g)
    al, bl, cl = (x.mode(2) for x in (g.a, g.b, g.c))
    fa = al.flat_modes()
    bcast = [i for i, (s, d) in enumerate(fa) if d == 0 and s > 1]
    keep = [i for i, (s, d) in enumerate(fa) if not (d == 0 and s > 1)]
    new_a = make_layout(g.c.mode(0), cat_modes(g.c.mode(1), sub_modes(cl, bcast)), sub_modes(cl, keep))
    new_b = make_layout(g.b.mode(1), cat_modes(g.b.mode(0), sub_modes(bl, bcast)), sub_modes(bl, keep))
    new_c = make_layout(g.a.mode(0), g.a.mode(1), sub_modes(al, keep))
    return GemmLayouts(new_a, new_b, new_c, tuple(a_shape))


def cotangent_a_partials(g: GemmLayouts, a_shape: Sequence[int]) -> tuple[GemmLayouts, int] | None:
    """dA as per-batch partial products, for when the broadcast batch cannot join K.

    The GEMM keeps every L sub-mode as a batch and writes ``dA_l`` for each broadcast batch
    index into a new buffer of shape ``(*broadcast extents reversed, *a_shape)``: its leading
    axes are summed afterwards (a reduction, not a copy). Returns (layouts, number of leading
    axes), or None when A is broadcast over nothing.
    """
    g = refined(g)
    fa = g.a.mode(2).flat_modes()
    bcast = [i for i, (s, d) in enumerate(fa) if d == 0 and s > 1]
    if not bcast:
        return None
    strides, step = [], math.prod(a_shape)
    for i, (s, d) in enumerate(fa):
        if i in bcast:  # a fresh slab of the output per broadcast index
            strides.append(step)
            step *= s
        else:
            strides.append(d)
    out_l = Layout(tuple(s for s, _ in fa), tuple(strides))
    extents = tuple(fa[i][0] for i in reversed(bcast))  # row-major: the first sub-mode is fastest
    new_a = make_layout(g.c.mode(0), g.c.mode(1), g.c.mode(2))
    new_b = make_layout(g.b.mode(1), g.b.mode(0), g.b.mode(2))
    new_c = make_layout(g.a.mode(0), g.a.mode(1), out_l)
    return GemmLayouts(new_a, new_b, new_c, extents + tuple(a_shape)), len(bcast)


def swapped(g: GemmLayouts) -> GemmLayouts:
    """The same product with the operands' roles exchanged: C^T[n,m,l] = sum_k B[n,k,l] A[m,k,l]."""
    return GemmLayouts(g.b, g.a, g.c.select(1, 0, 2), g.c_shape)


def cotangent_b(g: GemmLayouts, b_shape: Sequence[int]) -> GemmLayouts:
    """dB[n,k,l] = sum_m dC[m,n,l] A[m,k,l]: dA of the swapped product (M'=N, N'=K, K'=M)."""
    return cotangent_a(swapped(g), b_shape)


def cotangent_b_partials(g: GemmLayouts, b_shape: Sequence[int]) -> tuple[GemmLayouts, int] | None:
    return cotangent_a_partials(swapped(g), b_shape)


def matmul_layouts(a_shape: Sequence[int], b_shape: Sequence[int], transpose_a: bool,
                   transpose_b: bool) -> tuple[GemmLayouts, tuple[int, ...]]:
    """Layouts of ``jnp.matmul(a', b')`` (a' = swapaxes(a,-1,-2) when transpose_a; 1-D as jnp).

    Returns the layouts and the shape jnp.matmul's result has (1-D operands drop their mode).
    """
    a1, b1 = len(a_shape) == 1, len(b_shape) == 1
    a_full = (1,) + tuple(a_shape) if a1 else tuple(a_shape)
    b_full = tuple(b_shape) + (1,) if b1 else tuple(b_shape)
    sa, sb = row_major(a_full).stride, row_major(b_full).stride
    ia_m, ia_k = (-1, -2) if transpose_a else (-2, -1)
    ib_k, ib_n = (-1, -2) if transpose_b else (-2, -1)
    m, k, kb, n = a_full[ia_m], a_full[ia_k], b_full[ib_k], b_full[ib_n]
    if k != kb:
        raise ValueError(f"jax_cute.matmul: contracting dimensions differ: a{tuple(a_shape)} "
                         f"(K={k}) vs b{tuple(b_shape)} (K={kb})"
                         + (" with transpose_a" if transpose_a else "") + (" with transpose_b" if transpose_b else ""))
    batch_a, batch_b = a_full[:-2], b_full[:-2]
    try:
        batch = _broadcast_batch(batch_a, batch_b)
    except ValueError:
        raise ValueError(f"jax_cute.matmul: batch dimensions {batch_a} and {batch_b} of a{tuple(a_shape)} "
                         f"and b{tuple(b_shape)} do not broadcast") from None
    c_full = batch + (m, n)
    sc = row_major(c_full).stride

    def batch_mode(shape, strides) -> Layout:
        # L sub-modes fastest-first (last batch axis first) so a row-major output coalesces.
        ext, st = [], []
        off = len(batch) - len(shape)
        for i in reversed(range(len(batch))):
            j = i - off
            own = j >= 0 and shape[j] == batch[i] and batch[i] != 1
            ext.append(batch[i])
            st.append(strides[j] if own else 0)
        return Layout(tuple(ext), tuple(st)) if ext else Layout((1,), (0,))

    lay_a = make_layout(Layout((m,), (sa[ia_m] if m > 1 else 0,)), Layout((k,), (sa[ia_k] if k > 1 else 0,)),
                        batch_mode(a_full[:-2], sa[:-2]))
    lay_b = make_layout(Layout((n,), (sb[ib_n] if n > 1 else 0,)), Layout((k,), (sb[ib_k] if k > 1 else 0,)),
                        batch_mode(b_full[:-2], sb[:-2]))
    lay_c = make_layout(Layout((m,), (sc[-2] if m > 1 else 0,)), Layout((n,), (sc[-1] if n > 1 else 0,)),
                        batch_mode(c_full[:-2], sc[:-2]))
    out_shape = batch + ((m,) if not a1 else ()) + ((n,) if not b1 else ())
    return GemmLayouts(lay_a, lay_b, lay_c, c_full), out_shape


def _broadcast_batch(x: Sequence[int], y: Sequence[int]) -> tuple[int, ...]:
    n = max(len(x), len(y))
    x = (1,) * (n - len(x)) + tuple(x)
    y = (1,) * (n - len(y)) + tuple(y)
    out = []
    for p, q in zip(x, y):
        if p != q and 1 not in (p, q):
            raise ValueError("no broadcast")
        out.append(max(p, q) if 0 not in (p, q) else 0)
    return tuple(out)

