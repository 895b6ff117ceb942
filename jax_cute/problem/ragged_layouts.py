"""Layout metadata of a grouped GEMM (the ``ragged_dot`` primitives), and its flat kernel problem.

Two modes, as in ``kernels/gemm_spec.GroupedSpec`` (whose docstring defines the arithmetic):

* ``ragged_m``: ``a`` maps (M, K, L), ``b`` (N, K, G, L), ``c`` (M, N, L); rows of M are split
  into consecutive groups, row m of batch l multiplies group g(m, l) of B.
* ``ragged_k``: ``a`` (M, K, L), ``b`` (N, K, L), ``c`` (M, N, G, L); the reduction mode K is
  split into groups, one output slice per group.

``gs`` maps (G, L) into the group-sizes buffer. Group offsets are
``clip(cumsum(max(sizes, 0)), 0, M or K)`` per batch, so bad sizes never reach out of bounds.
With ``lead``, ``gs`` maps (G + 1, L): its first size is a lead of the ragged mode that no group
takes (``ragged_dot``'s ``group_offset``: the rows of the groups before the offset), zero rows of
C (ragged_m) or tokens no group sums (ragged_k); size g + 1 is group g's.
Batching adds L sub-modes (stride 0 where an operand is unbatched); autodiff re-targets modes
(``cotangent``): every gradient is again one of the two modes over the same buffers.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from jax_cute.layout import Layout, make_layout, product, stride_of
from jax_cute.problem.gemm_layouts import batched_layout, cat_modes, refine, sub_modes
from jax_cute.problem.gemm_plan import FlatOperand, flat_operand, itemsize, single_mode

RAGGED_M, RAGGED_K = "ragged_m", "ragged_k"
# Index of the L mode in (a, b, c, gs) for each mode.
L_INDEX = {RAGGED_M: (2, 3, 2, 1), RAGGED_K: (2, 2, 3, 1)}
NAMES = ("a", "b", "c", "gs")


@dataclasses.dataclass(frozen=True)
class RaggedLayouts:
    mode: str
    a: Layout
    b: Layout
    c: Layout
    gs: Layout
    c_shape: tuple[int, ...]
    lead: bool = False

    def __post_init__(self):
        if self.mode not in L_INDEX:
            raise ValueError(f"unknown grouped mode {self.mode!r}")
        ranks = (3, 4, 3, 2) if self.mode == RAGGED_M else (3, 3, 4, 2)
        for name, r in zip(NAMES, ranks):
            if self.layout(name).rank != r:
                raise ValueError(f"{self.mode} layout {name} must have {r} modes, got {self.layout(name)}")
        e = self.extents()
        ext = lambda name, i: product(self.layout(name).mode(i).shape)  # noqa: E731
        g_b, g_c = (2, None) if self.mode == RAGGED_M else (None, 2)
        # G is gs's extent less a lead: b's or c's groups must agree with it
        want = [("a", 0, "m"), ("a", 1, "k"), ("b", 0, "n"), ("b", 1, "k"), ("c", 0, "m"), ("c", 1, "n")] \
            + [(n, self.l_index(n), "l") for n in NAMES]
        want += [("b", g_b, "g")] if g_b is not None else [("c", g_c, "g")]
        if any(ext(n, i) != e[x] for n, i, x in want):
            raise ValueError(f"{self.mode} layouts disagree on extents: a={self.a} b={self.b} c={self.c} gs={self.gs}")

    def layout(self, name: str) -> Layout:
        return getattr(self, name)

    def l_index(self, name: str) -> int:
        return L_INDEX[self.mode][NAMES.index(name)]

    def extents(self) -> dict[str, int]:
        return {"m": product(self.a.mode(0).shape), "n": product(self.b.mode(0).shape),
                "k": product(self.a.mode(1).shape), "g": product(self.gs.mode(0).shape) - self.lead,
                "l": product(self.a.mode(2).shape)}

    def ragged_extent(self) -> int:
        """The extent the group offsets are clipped at: M (ragged_m) or K (ragged_k)."""
        return self.extents()["m" if self.mode == RAGGED_M else "k"]


def ragged_dot_layouts(m: int, k: int, g: int, n: int, lead: bool = False) -> RaggedLayouts:
    """``lax.ragged_dot`` on row-major buffers lhs (M,K), rhs (G,K,N), group_sizes (G,) (with
    ``lead``: (G + 1,), the lead first): ragged_m."""
    one = Layout((1,), (0,))
    mode = lambda e, d: Layout((e,), (stride_of(e, d),))  # noqa: E731
    return RaggedLayouts(RAGGED_M, make_layout(mode(m, k), mode(k, 1), one),
                         make_layout(mode(n, 1), mode(k, n), mode(g, k * n), one),
                         make_layout(mode(m, n), mode(n, 1), one), make_layout(mode(g + lead, 1), one), (m, n), lead)


def batched(r: RaggedLayouts, shapes: Sequence[Sequence[int]], axes: Sequence[int | None], size: int) -> RaggedLayouts:
    """Layouts of the primitive vmapped over (a, b, gs) at ``axes``; the output's batch axis is 0."""
    new = {n: batched_layout(r.layout(n), s, ax, size, r.l_index(n)) for n, s, ax in zip(("a", "b", "gs"), shapes, axes)}
    new["c"] = r.c.append_to_mode(r.l_index("c"), size, product(r.c_shape))
    return RaggedLayouts(r.mode, new["a"], new["b"], new["c"], new["gs"], (size,) + tuple(r.c_shape), r.lead)


# -- autodiff ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Cotangent:
    """A gradient as a primitive call: ``bind(*operands)`` with ``layouts``, then a sum over the
    leading ``extra`` axes of its output (L sub-modes the differentiated operand was broadcast
    over with group sizes varying along them, so they cannot join the reduction)."""

    layouts: RaggedLayouts
    operands: tuple[str, str]  # which of the old (a, b, ct) buffers feed the new a and b
    extra: int


def cotangent(r: RaggedLayouts, wrt: str, shape: Sequence[int]) -> Cotangent:
    """The layouts of d(out)/d(``wrt``) ("a" or "b"), written into a buffer of ``shape``.

    ragged_m: dA = ragged_m(dC (M,N,L), B (K,N,G,L)) and dB = ragged_k(dC (N,M,L), A (K,M,L)).
    ragged_k: dA = ragged_m(B (K,N,L), dC (M,N,G,L)) and dB = ragged_m(A (K,M,L), dC (N,M,G,L)).
    """
    ls = dict(zip(NAMES, refine([r.layout(n).mode(r.l_index(n)) for n in NAMES])))
    m_in = r.mode == RAGGED_M
    # (new mode, (old operand, its non-L modes) for new a and b, output's non-L modes)
    if m_in and wrt == "a":
        spec = RAGGED_M, ("c", (0, 1)), ("b", (1, 0, 2)), (0, 1)
    elif m_in:
        spec = RAGGED_K, ("c", (1, 0)), ("a", (1, 0)), (0, 1, 2)
    elif wrt == "a":
        spec = RAGGED_M, ("b", (1, 0)), ("c", (0, 1, 2)), (1, 0)
    else:
        spec = RAGGED_M, ("a", (1, 0)), ("c", (1, 0, 2)), (1, 0)
    new_mode, (sa, ma), (sb, mb), mo = spec
    lo, lg = ls[wrt].flat_modes(), ls["gs"].flat_modes()
    bcast = [i for i, (s, d) in enumerate(lo) if d == 0 and s > 1]
    keep = [i for i, (s, d) in enumerate(lo) if not (d == 0 and s > 1)]
    # A broadcast sub-mode joins the reduction when that is not the ragged mode (new ragged_m)
    # and the group sizes do not vary along it; otherwise it stays a batch of the output.
    join = [i for i in bcast if new_mode == RAGGED_M and lg[i][1] == 0]
    extra = [i for i in bcast if i not in join]
    size = product(tuple(shape))
    ext_strides, acc = [], size
    for i in extra:
        ext_strides.append(stride_of(lo[i][0], acc))
        acc *= lo[i][0]
    out_l = cat_modes(sub_modes(ls[wrt], keep), Layout(tuple(lo[i][0] for i in extra), tuple(ext_strides))) if extra \
        else sub_modes(ls[wrt], keep)
    new_l = lambda n: cat_modes(sub_modes(ls[n], keep), sub_modes(ls[n], extra)) if extra else sub_modes(ls[n], keep)  # noqa: E731

    def operand(src: str, modes: tuple[int, ...]) -> Layout:
        lay = r.layout(src)
        ms = [lay.mode(i) for i in modes]
        if join:
            ms[1] = cat_modes(ms[1], sub_modes(ls[src], join))  # K' of a new ragged_m is mode 1 of both
        return make_layout(*ms, new_l(src))

    out = r.layout(wrt)
    new_c = make_layout(*(out.mode(i) for i in mo), out_l)
    gs = make_layout(r.gs.mode(0), new_l("gs"))
    c_shape = tuple(lo[i][0] for i in reversed(extra)) + tuple(shape)
    new = RaggedLayouts(new_mode, operand(sa, ma), operand(sb, mb), new_c, gs, c_shape, r.lead)
    return Cotangent(new, (sa, sb), len(extra))


# -- the flat kernel problem ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class FlatGrouped:
    m: int
    n: int
    k: int
    g: int
    l: int
    a: FlatOperand
    b: FlatOperand  # ragged_m: shape/stride (N, K, G, L) in ``b4``
    c: FlatOperand
    gs: tuple[tuple[int, int], tuple[int, int]]  # (shape, stride) of (G, L), or (G + 1, L) with a lead
    b4: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    c4: tuple[tuple[int, ...], tuple[int, ...]] | None = None


def _coalesce_modes(modes: Sequence[Layout]) -> list[list[int]]:
    """Joint coalescing of congruent (refined) modes: [extent, stride_0, stride_1, ...] each."""
    out: list[list[int]] = []
    for subs in zip(*(m.flat_modes() for m in modes)):
        s = subs[0][0]
        if s == 1:
            continue
        if out and all((p == 0 and d == 0) or (p != 0 and d == p * out[-1][0])
                       for p, (_, d) in zip(out[-1][1:], subs)):
            out[-1][0] *= s
            continue
        out.append([s] + [d for _, d in subs])
    return out


def _batch_stride(name: str, l: int, stride: int, matrix: int, dtype: str) -> tuple[int, int] | str:
    """(extent, stride) of an operand's G or L mode: extent 1 when broadcast (the kernel reads
    index 0 for every batch), a 16-byte aligned stride otherwise."""
    div = max(1, 16 // itemsize(dtype))
    if l == 1 or stride == 0:
        return 1, -(-matrix // div) * div
    if stride % div:
        return f"operand {name}: stride {stride} is not a multiple of 16 bytes"
    return l, stride


def flatten_grouped(r: RaggedLayouts, dtypes: Sequence[str]) -> FlatGrouped | str:
    """The kernel problem for ``r`` (one extent and stride per mode), or why there is none."""
    a_dt, b_dt, c_dt = dtypes
    e = r.extents()
    ls = refine([r.layout(n).mode(r.l_index(n)) for n in NAMES])
    lmodes = _coalesce_modes(ls)
    if len(lmodes) > 1:
        return f"{len(lmodes)} batch modes do not coalesce into one"
    l_ext, (la, lb, lc, lgs) = (lmodes[0][0], lmodes[0][1:]) if lmodes else (1, (0, 0, 0, 0))
    if l_ext > 1 and lc == 0:
        return "output broadcast over a batch mode"
    g_mode = single_mode(r.gs.mode(0))
    if g_mode is None or (g_mode[0] > 1 and g_mode[1] != 1):
        return f"group sizes are not contiguous along G ({r.gs})"
    sizes = e["g"] + r.lead
    gs = ((sizes, l_ext if lgs else 1), (1, lgs if lgs else sizes))
    ragged_m = r.mode == RAGGED_M
    a = flat_operand("a", r.a.mode(0), r.a.mode(1), l_ext, la, a_dt, ("m", "k"))
    if isinstance(a, str):
        return a
    b = flat_operand("b", r.b.mode(0), r.b.mode(1), l_ext, lb, b_dt, ("n", "k"))
    if isinstance(b, str):
        return b
    c = flat_operand("c", r.c.mode(0), r.c.mode(1), l_ext, lc, c_dt, ("m", "n"))
    if isinstance(c, str):
        return c
    # The group mode of b (ragged_m) or c (ragged_k) sits between the matrix modes and L.
    grouped, dt = (b, b_dt) if ragged_m else (c, c_dt)
    lay = r.b if ragged_m else r.c
    gm = single_mode(lay.mode(2))
    if gm is None:
        return f"the group mode of {'b' if ragged_m else 'c'} does not coalesce ({lay.mode(2)})"
    if gm[0] > 1 and gm[1] == 0:
        return "an operand broadcast over groups"
    gx = _batch_stride("b" if ragged_m else "c", gm[0], gm[1], grouped.shape[0] * grouped.shape[1], dt)
    if isinstance(gx, str):
        return gx
    four = (grouped.shape[:2] + (gx[0], grouped.shape[2]), grouped.stride[:2] + (gx[1], grouped.stride[2]))
    return FlatGrouped(e["m"], e["n"], e["k"], e["g"], l_ext, a, b, c, gs,
                       four if ragged_m else None, None if ragged_m else four)
