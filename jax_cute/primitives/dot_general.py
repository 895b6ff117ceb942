"""``jax_cute.dot_general`` and ``jax_cute.einsum``: any two-operand contraction as one GEMM.

Dimension numbers map straight onto the GEMM's logical modes, each a hierarchical layout over
the operand buffers as they lie: the lhs free dimensions become sub-modes of M, the rhs free
ones of N, the contracting pairs of K and the batch pairs of L. The output layout can put those
modes in any order, so einsum writes ``bthd,bshd->bhts`` straight into its (b, h, t, s) buffer:
no transpose before or after. The product is the ``jax_cute_matmul`` primitive, so vmap, grad
and the kernels' choice work exactly as for ``matmul``.
"""

from __future__ import annotations

import functools
import logging
import string
from typing import Sequence

import jax
import jax.numpy as jnp

from jax_cute.layout import Layout, make_layout, row_major, stride_of
from jax_cute.primitives.fused import activated, check_bias_broadcasts, check_swiglu, checked_options, epilogue_dtype
from jax_cute.primitives.gemm_layouts import GemmLayouts
from jax_cute.primitives.matmul import bind_gemm, check_operand_dtypes
from jax_cute.primitives.sharding import constrain

logger = logging.getLogger("jax_cute")

DimensionNumbers = tuple[tuple[Sequence[int], Sequence[int]], tuple[Sequence[int], Sequence[int]]]


def _mode(extents: Sequence[int], *strides: Sequence[int]) -> tuple[Layout, ...]:
    """One hierarchical mode per operand over the given dimensions, fastest (last) first."""
    if not extents:
        return tuple(Layout((1,), (0,)) for _ in strides)
    shape = tuple(reversed(extents))
    return tuple(Layout(shape, tuple(stride_of(e, d) for e, d in zip(shape, reversed(s)))) for s in strides)


def contraction_layouts(lhs_shape: Sequence[int], rhs_shape: Sequence[int], contracting: tuple[Sequence[int], Sequence[int]],
                        batch: tuple[Sequence[int], Sequence[int]], out_order: Sequence[int] | None = None
                        ) -> tuple[GemmLayouts, tuple[int, ...]]:
    """Layouts of the contraction, and the output buffer's shape.

    The logical output axes are lax.dot_general's: batch, lhs free, rhs free. ``out_order``
    lists them in the order the output buffer holds them (default: that order).
    """
    (lc, rc), (lb, rb) = contracting, batch
    lf = [i for i in range(len(lhs_shape)) if i not in lc and i not in lb]
    rf = [i for i in range(len(rhs_shape)) if i not in rc and i not in rb]
    logical = [lhs_shape[i] for i in lb] + [lhs_shape[i] for i in lf] + [rhs_shape[i] for i in rf]
    order = list(out_order) if out_order is not None else list(range(len(logical)))
    out_shape = tuple(logical[i] for i in order)
    out_stride = row_major(out_shape).stride
    sc = [0] * len(logical)  # stride of each logical output axis in the output buffer
    for pos, axis in enumerate(order):
        sc[axis] = out_stride[pos]
    sa, sb = row_major(tuple(lhs_shape)).stride, row_major(tuple(rhs_shape)).stride
    nb, nf = len(lb), len(lf)
    am, cm = _mode([lhs_shape[i] for i in lf], [sa[i] for i in lf], sc[nb:nb + nf])
    bn, cn = _mode([rhs_shape[i] for i in rf], [sb[i] for i in rf], sc[nb + nf:])
    ak, bk = _mode([lhs_shape[i] for i in lc], [sa[i] for i in lc], [sb[i] for i in rc])
    al, bl, cl = _mode([lhs_shape[i] for i in lb], [sa[i] for i in lb], [sb[i] for i in rb], sc[:nb])
    return GemmLayouts(make_layout(am, ak, al), make_layout(bn, bk, bl), make_layout(cm, cn, cl), out_shape), out_shape


def dot_general(lhs, rhs, dimension_numbers: DimensionNumbers, precision=None, preferred_element_type=None, *,
                out_sharding=None, bias=None, activation: str | None = None):
    """``jax.lax.dot_general`` with the same semantics and errors, as one jax_cute GEMM.

    Any number of contracting and batch dimensions, in any positions; the output is ordered
    (batch, lhs free, rhs free). No operand is transposed or copied: the kernels read the
    buffers through layouts wherever each of M, N, K coalesces into a mode the kernel can
    address, and otherwise the smallest copy is made (logged; strict mode names it).
    ``out_sharding`` constrains the result's sharding, as ``lax.dot_general``'s does.

    ``bias`` and ``activation`` fuse ``act(product + bias)`` into the GEMM's epilogue, as for
    ``jax_cute.matmul``: the bias broadcasts against the product by numpy's rules (shaped like
    the rhs free dimensions, it is one bias per output column, what the kernels read); swiglu
    needs one rhs free dimension, holding [gate | up], and halves it.
    """
    return constrain(chained_dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type, bias=bias,
                                         activation=activation), out_sharding)


def chained_dot_general(lhs, rhs, dimension_numbers: DimensionNumbers, precision=None, preferred_element_type=None,
                        *, bias=None, activation: str | None = None, preact: bool = False, act_operand=None):
    """``dot_general`` without the sharding constraint, for kernelize's chained products:
    ``preact`` and ``act_operand`` as ``fused.epilogue_call``'s."""
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    # lax's own shape rule: the same trace-time errors for bad dimension numbers and dtypes
    out = jax.eval_shape(lambda x, y: jax.lax.dot_general(x, y, dimension_numbers, precision=precision,
                                                          preferred_element_type=preferred_element_type),
                         jax.ShapeDtypeStruct(lhs.shape, lhs.dtype), jax.ShapeDtypeStruct(rhs.shape, rhs.dtype))
    (lc, rc), (lb, rb) = dimension_numbers
    norm = lambda dims, nd: tuple(int(d) % nd if nd else int(d) for d in dims)  # noqa: E731
    contracting = (norm(lc, lhs.ndim), norm(rc, rhs.ndim))
    batch = (norm(lb, lhs.ndim), norm(rb, rhs.ndim))
    layouts, shape = contraction_layouts(lhs.shape, rhs.shape, contracting, batch)
    assert shape == out.shape, (shape, out.shape)
    return bind_gemm("dot_general", lhs, rhs, layouts, preferred_element_type, precision, out_dtype=out.dtype,
                     bias=bias, activation=activation, preact=preact, act_operand=act_operand)


def einsum(subscripts: str, a, b, *, precision=None, preferred_element_type=None, out_sharding=None, bias=None,
           activation: str | None = None):
    """Two-operand ``jnp.einsum``, written as one GEMM whose output layout is the requested order.

    Indices in both operands and the output are batch modes, in both operands only contracted,
    in one operand and the output free. An index that appears in one operand only and not in the
    output is summed first. Repeated indices within one operand (diagonals) are not GEMMs: they
    run as ``jnp.einsum`` (logged). ``out_sharding`` constrains the result's sharding.

    ``bias`` and ``activation`` fuse ``act(product + bias)`` into the GEMM's epilogue, as for
    ``jax_cute.matmul``: the bias broadcasts against the result by numpy's rules; swiglu halves
    the result's last index, which must be the second operand's only free index.
    """
    a, b = jnp.asarray(a), jnp.asarray(b)
    lhs, rhs, out = _parse(subscripts, a.ndim, b.ndim)
    if len(set(lhs)) != len(lhs) or len(set(rhs)) != len(rhs):
        logger.warning("jax_cute.einsum: %r repeats an index within an operand (a diagonal): "
                       "running jnp.einsum", subscripts)
        plain = functools.partial(jnp.einsum, subscripts, precision=precision,
                                  preferred_element_type=preferred_element_type)
        if bias is None and activation is None:
            return constrain(plain(a, b), out_sharding)
        out_dtype = jax.eval_shape(plain, a, b).dtype
        return constrain(_xla_epilogue("einsum", subscripts, a, b, out_dtype, bias, activation, precision), out_sharding)
    for name, idx, x in (("first", lhs, a), ("second", rhs, b)):
        lone = [i for i, c in enumerate(idx) if c not in out and c not in (rhs if x is a else lhs)]
        if lone:  # summed over before the product: a reduction, as jnp.einsum does
            x = jnp.sum(x, axis=tuple(lone))
            idx = "".join(c for i, c in enumerate(idx) if i not in lone)
            if name == "first":
                a, lhs = x, idx
            else:
                b, rhs = x, idx
    sizes: dict[str, int] = {}
    for idx, x in ((lhs, a), (rhs, b)):
        for c, n in zip(idx, x.shape):
            if sizes.setdefault(c, n) != n:
                raise ValueError(f"jax_cute.einsum: index {c!r} has extents {sizes[c]} and {n} in {subscripts!r}")
    for c in out:
        if c not in sizes:
            raise ValueError(f"jax_cute.einsum: output index {c!r} appears in no operand of {subscripts!r}")
    batch = [c for c in out if c in lhs and c in rhs]
    contract = [c for c in lhs if c in rhs and c not in out]
    lf = [c for c in lhs if c not in rhs]
    rf = [c for c in rhs if c not in lhs]
    logical = batch + lf + rf
    check_operand_dtypes("einsum", a, b)
    layouts, _ = contraction_layouts(
        a.shape, b.shape, ([lhs.index(c) for c in contract], [rhs.index(c) for c in contract]),
        ([lhs.index(c) for c in batch], [rhs.index(c) for c in batch]), [logical.index(c) for c in out])
    return constrain(bind_gemm("einsum", a, b, layouts, preferred_element_type, precision, bias=bias,
                               activation=activation), out_sharding)


def _parse(subscripts: str, lhs_ndim: int, rhs_ndim: int) -> tuple[str, str, str]:
    """(lhs, rhs, output) index strings, with ellipses expanded and an implicit output made explicit."""
    text = subscripts.replace(" ", "")
    inputs, arrow, out = text.partition("->")
    parts = inputs.split(",")
    if len(parts) != 2:
        raise ValueError(f"jax_cute.einsum takes two operands; {subscripts!r} names {len(parts)}")
    spare = [c for c in string.ascii_letters if c not in text]
    widths = [nd - (len(p) - 3) if "..." in p else 0 for p, nd in zip(parts, (lhs_ndim, rhs_ndim))]
    ell = "".join(spare[:max(widths)])
    # An ellipsis stands for an operand's leading dimensions, aligned to the right as in numpy.
    expanded = [p.replace("...", ell[len(ell) - w:] if w else "") for p, w in zip(parts, widths)]
    for idx, p, nd in zip(expanded, parts, (lhs_ndim, rhs_ndim)):
        if len(idx) != nd or not all(c.isalpha() for c in idx):
            raise ValueError(f"jax_cute.einsum: {p!r} does not index an operand of rank {nd} in {subscripts!r}")
    if arrow:
        return expanded[0], expanded[1], out.replace("...", ell)
    both = expanded[0] + expanded[1]
    return expanded[0], expanded[1], ell + "".join(sorted(c for c in set(both) if both.count(c) == 1 and c not in ell))


def _xla_epilogue(op: str, subscripts: str, a, b, out_dtype, bias, activation, precision):
    """``act(einsum + bias)`` in XLA, where no GEMM layout exists (diagonals), with the fused
    path's checks and numerics: the product in float32 (or wider), rounded once."""
    bias = checked_options(op, out_dtype, bias, activation)
    z = jnp.einsum(subscripts, a, b, precision=precision, preferred_element_type=epilogue_dtype(out_dtype))
    if activation == "swiglu":
        check_swiglu(op, activation, z.shape[-1] if z.ndim else 1)
    if bias is not None:
        check_bias_broadcasts(op, bias.shape, z.shape)
        z = z + bias.astype(z.dtype)
    return activated(z, activation=activation, preact=False, out_dtype=out_dtype)[0]
