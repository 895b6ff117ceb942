"""From hierarchical GEMM layouts to the flat (M,K,L)/(N,K,L)/(M,N,L) problem a kernel takes.

Kernels take one extent and one stride per mode (see ``kernels/gemm_spec.py``). This module
coalesces the hierarchical modes the batching and autodiff rules built, folds batch sub-modes
into M (or N) where an operand is broadcast and the strides continue, and checks what TMA
needs (a unit-stride mode per operand, other strides multiples of 16 bytes). An operand that
cannot be expressed gets exactly one copy into a canonical layout; an output that cannot, or a
misaligned canonical operand, sends the whole call to the XLA fallback.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

import jax.numpy as jnp

from jax_cute import layout as L
from jax_cute.layout import Layout, make_layout, product, restride
from jax_cute.problem.gemm_layouts import GemmLayouts, refined


def itemsize(dtype: str) -> int:
    return jnp.dtype(dtype).itemsize


# Batch modes a kernel takes: one, or three (a 5-D TMA tensor: two matrix modes and three batch).
MAX_BATCH_MODES = 3


@dataclasses.dataclass(frozen=True)
class FlatOperand:
    """(rows, cols, *batch) extents and strides: one batch mode, or MAX_BATCH_MODES of them."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    major: str  # which matrix mode has unit stride: "k", "m", "n"
    aligned: bool = True  # every stride a multiple of 16 bytes (else an output the kernel stores without TMA)

    @property
    def batch_modes(self) -> int:
        return len(self.shape) - 2


@dataclasses.dataclass(frozen=True)
class FlatGemm:
    m: int
    n: int
    k: int
    l: int
    a: FlatOperand
    b: FlatOperand
    c: FlatOperand
    copies: tuple[tuple[str, str], ...] = ()  # (operand, why) materialised before the launch
    a_src: Layout | None = None  # for a copied operand: its (rows, cols, L) layout to read from
    b_src: Layout | None = None

    @property
    def batch_modes(self) -> int:
        return self.c.batch_modes


def _coalesce_l(g: GemmLayouts) -> list[tuple[int, int, int, int]]:
    """Joint coalescing of the L sub-modes: (extent, stride_a, stride_b, stride_c) each."""
    fa, fb, fc = (x.mode(2).flat_modes() for x in (g.a, g.b, g.c))
    out: list[list[int]] = []
    for (s, da), (_, db), (_, dc) in zip(fa, fb, fc):
        if s == 1:
            continue
        if out:
            ps, pa, pb, pc = out[-1]
            if all((p == 0 and d == 0) or (p != 0 and d == p * ps) for p, d in ((pa, da), (pb, db), (pc, dc))):
                out[-1][0] *= s
                continue
        out.append([s, da, db, dc])
    return [tuple(x) for x in out]  # type: ignore[misc]


def single_mode(mode: Layout) -> tuple[int, int] | None:
    c = mode.coalesce()
    fm = c.flat_modes()
    return fm[0] if len(fm) == 1 else None


def _joint_order(x: Layout, y: Layout) -> tuple[Layout, Layout]:
    """The same logical mode of two operands with its sub-modes permuted alike, so that both
    coalesce where an order exists. Relabelling a mode's index the same way in every operand
    leaves the product unchanged; the order autodiff leaves sub-modes in need not be the one
    that makes them contiguous (a gradient's K' made of (h, d) listed slowest first)."""
    fx, fy = x.flat_modes(), y.flat_modes()
    for key in (None, lambda i: fy[i][1], lambda i: fx[i][1]):
        order = list(range(len(fx))) if key is None else sorted(range(len(fx)), key=key)
        nx = Layout(tuple(fx[i][0] for i in order), tuple(fx[i][1] for i in order))
        ny = Layout(tuple(fy[i][0] for i in order), tuple(fy[i][1] for i in order))
        if single_mode(nx) is not None and single_mode(ny) is not None:
            return nx, ny
    return x, y


def flat_operand(name: str, rows: Layout, cols: Layout, l_ext: int, l_stride: int, dtype: str,
             names: tuple[str, str]) -> FlatOperand | str:
    """An operand with one batch mode (the grouped kernels take one)."""
    return _operand_modes(name, rows, cols, [(l_ext, l_stride)], dtype, names)


def _operand_modes(name: str, rows: Layout, cols: Layout, batch: Sequence[tuple[int, int]], dtype: str,
                   names: tuple[str, str], unaligned: bool = False) -> FlatOperand | str:
    """The flat operand over matrix modes ``rows``, ``cols`` and batch modes (extent, stride),
    or why TMA cannot address it. A broadcast batch mode (stride 0) becomes extent 1: the
    kernels read index 0 of it for every batch. ``unaligned``: strides need not be multiples
    of 16 bytes with one batch mode (an output a kernel stores without TMA; ``aligned`` says
    whether they are)."""
    op = _operand_modes_tma(name, rows, cols, batch, max(1, 16 // itemsize(dtype)), names)
    if isinstance(op, str) and unaligned:
        loose = _operand_modes_tma(name, rows, cols, batch, 1, names)
        if not isinstance(loose, str) and loose.batch_modes == 1:
            return dataclasses.replace(loose, aligned=False)
    return op


def _operand_modes_tma(name: str, rows: Layout, cols: Layout, batch: Sequence[tuple[int, int]], div: int,
                       names: tuple[str, str]) -> FlatOperand | str:
    r, c = single_mode(rows), single_mode(cols)
    if r is None or c is None:
        return f"operand {name}: a matrix mode does not coalesce ({rows}, {cols})"
    (rs, rd), (cs, cd) = r, c
    # An extent-1 mode's stride is free: give it a legal, 16-byte aligned value.
    if rs == 1:
        rd = 0
    if cs == 1:
        cd = 0
    if cd in (0, 1) and (cd == 1 or rd != 1):
        major, cd = names[1], 1
        rd = rd or -(-cs // div) * div
        other = rd
    elif rd in (0, 1):
        major, rd = names[0], 1
        cd = cd or -(-rs // div) * div
        other = cd
    else:
        return f"operand {name}: neither mode has unit stride (strides {rd}, {cd})"
    if other % div:
        return f"operand {name}: stride {other} is not a multiple of 16 bytes"
    unit = -(-(rs * cs) // div) * div  # a legal stride for an extent-1 batch mode
    modes = []
    for ext, st in batch or [(1, 0)]:
        if ext == 1 or st == 0:
            modes.append((1, unit))
        elif st % div:
            return f"operand {name}: batch stride {st} is not a multiple of 16 bytes"
        else:
            modes.append((ext, st))
    if len(modes) > 1:
        modes += [(1, unit)] * (MAX_BATCH_MODES - len(modes))
    return FlatOperand((rs, cs, *(e for e, _ in modes)), (rd, cd, *(d for _, d in modes)), major)


def flatten_gemm(g: GemmLayouts, dtypes: Sequence[str], unaligned_c: bool = False) -> FlatGemm | str:
    """The kernel problem for ``g``, or why no kernel can take it (then the call falls back).
    ``unaligned_c``: C's strides need not be multiples of 16 bytes (``_operand_modes``)."""
    g = refined(g)
    a_dt, b_dt, c_dt = dtypes
    ext = g.extents()
    lmodes = _coalesce_l(g)
    am, ak, bn, bk, cm, cn = g.a.mode(0), g.a.mode(1), g.b.mode(0), g.b.mode(1), g.c.mode(0), g.c.mode(1)
    am, cm = _joint_order(am, cm)
    bn, cn = _joint_order(bn, cn)
    ak, bk = _joint_order(ak, bk)

    # Fold batch sub-modes into M (B broadcast) or N (A broadcast) while the strides continue.
    def fold(x: Layout, y: Layout, s: int, dx: int, dy: int) -> tuple[Layout, Layout] | None:
        sx, sy = single_mode(x), single_mode(y)
        if sx is None or sy is None:
            return None
        if sx[0] == 1 and sy[0] == 1:  # an extent-1 matrix mode takes the batch mode as it is
            return Layout((s,), (dx,)), Layout((s,), (dy,))
        if dx == sx[0] * sx[1] and dy == sy[0] * sy[1]:
            return Layout((sx[0] * s,), (sx[1],)), Layout((sy[0] * s,), (sy[1],))
        return None

    while lmodes:
        s, da, db, dc = lmodes[0]
        if db == 0 and (f := fold(am, cm, s, da, dc)):
            am, cm = f
        elif da == 0 and (f := fold(bn, cn, s, db, dc)):
            bn, cn = f
        else:
            break
        lmodes.pop(0)
    copies: list[tuple[str, str]] = []
    if len(lmodes) > MAX_BATCH_MODES:
        return f"{len(lmodes)} batch modes that do not coalesce (kernels take up to {MAX_BATCH_MODES})"
    exts = [s for s, *_ in lmodes]
    m, n = product(cm.shape), product(cn.shape)  # M and N after any fold

    if any(dc == 0 for *_, dc in lmodes):
        return "output broadcast over a batch mode"
    c = _operand_modes("c", cm, cn, [(s, dc) for s, _, _, dc in lmodes], c_dt, ("m", "n"), unaligned_c)
    if isinstance(c, str):
        return c
    srcs = {}
    ops = {}
    for name, rows, cols, i, dt, names, r in (("a", am, ak, 1, a_dt, ("m", "k"), m),
                                               ("b", bn, bk, 2, b_dt, ("n", "k"), n)):
        op = _operand_modes(name, rows, cols, [(mode[0], mode[i]) for mode in lmodes], dt, names)
        if isinstance(op, str):
            # One copy into (batch..., rows, K) row-major, rows padded to 16 bytes, keeping
            # broadcast batch modes at extent 1.
            copies.append((name, op))
            own = [s if mode[i] else 1 for s, mode in zip(exts, lmodes)]
            srcs[name] = make_layout(rows, cols, Layout(tuple(own) or (1,), tuple(mode[i] for mode in lmodes) or (0,)))
            div = max(1, 16 // itemsize(dt))
            row = -(-ext["k"] // div) * div
            strides, step = [], r * row
            for e in own:
                strides.append(step)
                step *= e
            op = _operand_modes(name, Layout((r,), (row,)), Layout((ext["k"],), (1,)),
                                list(zip(own, strides)), dt, names)
            if isinstance(op, str):
                return op
        ops[name] = op
    a, b = ops["a"], ops["b"]
    return FlatGemm(m, n, ext["k"], product(tuple(exts) or (1,)), a, b, c, tuple(copies), srcs.get("a"),
                    srcs.get("b"))


def _padded_shape(shape: tuple[int, ...], dtype: str) -> tuple[int, ...]:
    """``shape`` with its innermost non-trivial axis padded to a multiple of 16 bytes, so every
    stride outside that axis is aligned."""
    div = max(1, 16 // itemsize(dtype))
    axes = [i for i, n in enumerate(shape) if n > 1]
    if not axes or shape[axes[-1]] % div == 0:
        return shape
    i = axes[-1]
    return shape[:i] + (-(-shape[i] // div) * div,) + shape[i + 1:]


def plan_gemm(g: GemmLayouts, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[str], unaligned_c: bool = False
              ) -> tuple[FlatGemm | str, list[tuple[int, ...]]]:
    """The kernel problem for ``g`` over buffers of ``shapes`` (a, b, c), and the buffer shapes it
    needs. Where strides are not 16-byte aligned (a 50257-word vocabulary, K = 7), buffers may be
    padded along their innermost axis (the padding is never read: logical extents stay); of the
    ways to pad, the one with the fewest copies, then the fewest padded buffers, wins. With
    ``unaligned_c`` (a kernel that stores C without TMA) C is never padded: it is written where
    it is, with no slice copy after."""
    shapes = [tuple(s) for s in shapes]
    best = (flatten_gemm(g, dtypes, unaligned_c), shapes)
    padded = [_padded_shape(s, dt) for s, dt in zip(shapes, dtypes)]
    options = [i for i in range(3 if not unaligned_c else 2) if padded[i] != shapes[i]]
    for pick in itertools.chain.from_iterable(itertools.combinations(options, r) for r in range(1, len(options) + 1)):
        new = [padded[i] if i in pick else shapes[i] for i in range(3)]
        moved = [restride(lay, old, nw) for lay, old, nw in zip((g.a, g.b, g.c), shapes, new)]
        if any(m is None for m in moved):
            continue
        flat = flatten_gemm(GemmLayouts(*moved, new[2]), dtypes, unaligned_c)
        if isinstance(flat, str):
            continue
        if isinstance(best[0], str) or len(flat.copies) < len(best[0].copies):
            best = (flat, new)
    return best


def canonical_output(g: GemmLayouts) -> GemmLayouts:
    """The same product written into a fresh row-major (L, M, N) buffer, where M, N and L are each
    one mode: for an output layout no kernel can write (its M and N sub-modes interleave, or
    neither is contiguous)."""
    ext = g.extents()

    def compact(mode: Layout, start: int) -> Layout:
        fm, strides, step = mode.flat_modes(), [], start
        for s, _ in fm:
            strides.append(step if s > 1 else 0)
            step *= s
        return Layout(tuple(s for s, _ in fm), tuple(strides))

    c = make_layout(compact(g.c.mode(0), ext["n"]), compact(g.c.mode(1), 1), compact(g.c.mode(2), ext["m"] * ext["n"]))
    return GemmLayouts(g.a, g.b, c, (ext["l"], ext["m"], ext["n"]))


def canonical_problem(g: GemmLayouts) -> GemmLayouts:
    """The same product over fresh row-major (L, M, K), (L, N, K) and (L, M, N) buffers: for batch
    sub-modes that coalesce into more modes than the kernels take (four or more batch indices
    in different orders)."""
    e = g.extents()
    m, n, k, l = e["m"], e["n"], e["k"], e["l"]

    def operand(rows: int) -> Layout:
        return make_layout(Layout((rows,), (k,)), Layout((k,), (1,)), Layout((l,), (rows * k,)))

    c = make_layout(Layout((m,), (n,)), Layout((n,), (1,)), Layout((l,), (m * n,)))
    return GemmLayouts(operand(m), operand(n), c, (l, m, n))


@dataclasses.dataclass(frozen=True)
class Rewrite:
    """A problem the kernel runs in place of ``g``: one copy of the output (written row-major,
    then moved into place), and with ``copy_operands`` one of each operand too."""

    g: GemmLayouts
    canonical: GemmLayouts
    copy_operands: bool
    why: str  # what no kernel takes in ``g``

    def run(self, kernel, a, b):
        """``kernel(a, b)`` (the canonical output buffer) on the original operands, the result in
        ``g``'s output buffer."""
        if self.copy_operands:   # read through their layouts into row-major (L, rows, K)
            a = jnp.transpose(L.read(a, self.g.a), (2, 0, 1))
            b = jnp.transpose(L.read(b, self.g.b), (2, 0, 1))
        return L.write(L.read(kernel(a, b), self.canonical.c), self.g.c, self.g.c_shape)


def plan_with_copies(g: GemmLayouts, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[str],
                     unaligned_c: bool = False
                     ) -> tuple[FlatGemm | str, list[tuple[int, ...]], list[tuple[int, ...]], Rewrite | None]:
    """``plan_gemm``, and where it finds no kernel layout for the output, or more batch modes
    than the kernels take, the plan of the rewritten problem (``Rewrite``). Returns (plan, buffer
    shapes it needs, the shapes it was given, rewrite or None)."""
    flat, padded = plan_gemm(g, shapes, dtypes, unaligned_c)
    if not isinstance(flat, str) or not (flat.startswith("operand c") or "batch modes that do not coalesce" in flat):
        return flat, padded, list(shapes), None
    e = g.extents()
    # the output alone first (one copy), then everything (three)
    for copy_operands in ([False] if flat.startswith("operand c") else []) + [True]:
        canonical = canonical_problem(g) if copy_operands else canonical_output(g)
        given = [(e["l"], e["m"], e["k"]), (e["l"], e["n"], e["k"])] if copy_operands else list(shapes[:2])
        given.append(tuple(canonical.c_shape))
        new, new_padded = plan_gemm(canonical, given, dtypes, unaligned_c)
        if not isinstance(new, str):
            return new, new_padded, given, Rewrite(g, canonical, copy_operands, flat)
    return flat, padded, list(shapes), None


def materialise(x, lay: Layout, op: FlatOperand):
    """Copy an operand into a (L, rows, cols) row-major buffer (L the product of its batch modes,
    the first fastest; rows padded to ``op``'s row stride), as ``op`` describes it: the one
    logged copy a plan may need for an operand no kernel layout can express."""
    rows, cols, l = op.shape[0], op.shape[1], product(op.shape[2:])
    logical = L.read(x, lay)  # (rows, cols, l) as three flat axes
    logical = jnp.transpose(jnp.reshape(logical, (rows, cols, l)), (2, 0, 1))
    return jnp.pad(logical, ((0, 0), (0, 0), (0, op.stride[0] - cols))) if op.stride[0] > cols else logical
