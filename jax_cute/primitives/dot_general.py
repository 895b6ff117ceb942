"""``jax_cute.dot_general`` and ``jax_cute.einsum``: each product of two operands as one GEMM.

Dimension numbers map straight onto the GEMM's logical modes, each a hierarchical layout over
the operand buffers as they lie: the lhs free dimensions become sub-modes of M, the rhs free
ones of N, the contracting pairs of K and the batch pairs of L. The output layout can put those
modes in any order, so einsum writes ``bthd,bshd->bhts`` straight into its (b, h, t, s) buffer:
no transpose before or after. The product is the ``jax_cute_matmul`` primitive, so vmap, grad
and the kernels' choice work exactly as for ``matmul``.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import opt_einsum

from jax_cute.fp8 import ops as fp8_ops
from jax_cute.layout import Layout, make_layout, row_major, stride_of
from jax_cute.activations import check_gated_columns, epilogue_dtype, is_gated
from jax_cute.primitives.fused import activated, check_bias_broadcasts, checked_options
from jax_cute.problem.gemm_layouts import GemmLayouts
from jax_cute.primitives.dot_dtypes import struct, weak_as
from jax_cute.primitives.matmul import bind_gemm, check_operand_dtypes, operand_dtype_error
from jax_cute.primitives.sharding import constrain

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

    With ``jax_cute.fp8.BlockScaled`` operands this is the block-scaled product
    (``jax_cute.fp8.scaled_dot_general``).
    """
    if fp8_ops.is_scaled(lhs, rhs):
        return constrain(fp8_ops.scaled_dot_general(lhs, rhs, dimension_numbers, bias=bias, activation=activation,
                                                    preferred_element_type=preferred_element_type), out_sharding)
    return constrain(chained_dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type, bias=bias,
                                         activation=activation), out_sharding)


def chained_dot_general(lhs, rhs, dimension_numbers: DimensionNumbers, precision=None, preferred_element_type=None,
                        *, bias=None, activation: str | None = None, preact: bool = False, act_operand=None):
    """``dot_general`` without the sharding constraint, for kernelize's chained products:
    ``preact`` and ``act_operand`` as ``fused.epilogue_call``'s."""
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    check_operand_dtypes("dot_general", lhs, rhs)
    out = _lax_result(lhs, rhs, dimension_numbers, precision, preferred_element_type)
    (lc, rc), (lb, rb) = dimension_numbers
    norm = lambda dims, nd: tuple(int(d) % nd if nd else int(d) for d in dims)  # noqa: E731
    contracting = (norm(lc, lhs.ndim), norm(rc, rhs.ndim))
    batch = (norm(lb, lhs.ndim), norm(rb, rhs.ndim))
    layouts, shape = contraction_layouts(lhs.shape, rhs.shape, contracting, batch)
    assert shape == out.shape, (shape, out.shape)
    res = bind_gemm("dot_general", lhs, rhs, layouts, out.dtype, precision, bias=bias, activation=activation,
                    preact=preact, act_operand=act_operand)
    return res if preact else weak_as(res, out, bias)


def _lax_result(lhs, rhs, dimension_numbers, precision, preferred_element_type):
    """lax.dot_general's result (shape, dtype and weak type), with its own trace-time errors for
    bad dimension numbers, dtypes and precisions."""
    return jax.eval_shape(lambda x, y: jax.lax.dot_general(x, y, dimension_numbers, precision=precision,
                                                           preferred_element_type=preferred_element_type),
                          struct(lhs), struct(rhs))


def einsum(subscripts: str, *operands, precision=None, preferred_element_type=None, optimize="auto",
           out_sharding=None, bias=None, activation: str | None = None):
    """``jnp.einsum``: the same contraction order, result dtype and errors, each product of two
    operands one GEMM whose output layout is the order that step asks for.

    The contraction path is ``opt_einsum``'s, as in ``jnp.einsum`` (``optimize`` as there). In
    each product of two operands, an index of extent 1 facing a larger extent in the other
    operand is dropped (broadcast, as jnp does); an index only one operand has and the result
    does not is summed first (``lax.reduce``, keeping the dtype), repeated indices within one
    operand (diagonals) are masked and summed; the rest is a GEMM: indices in both operands and
    the result are batch modes, in both operands only contracted, in one operand and the
    result free. ``out_sharding`` constrains the result's sharding.

    ``bias`` and ``activation`` fuse ``act(product + bias)`` into the epilogue of the last
    product, as for ``jax_cute.matmul``: the bias broadcasts against the result by numpy's
    rules; swiglu halves the result's last index, which must be the second operand's only free
    index.
    """
    if not isinstance(subscripts, str):
        raise TypeError(f"jax_cute.einsum: subscripts must be a string, got {type(subscripts).__name__}")
    arrays = [jnp.asarray(x) for x in operands]
    for i, x in enumerate(arrays):
        if operand_dtype_error(x.dtype):
            raise TypeError(f"jax_cute.einsum: operand {i} has unsupported dtype {x.dtype} in {subscripts!r}")
    plain = functools.partial(jnp.einsum, subscripts, precision=precision,
                              preferred_element_type=preferred_element_type, optimize=optimize)
    # jnp.einsum's own checks (subscripts, extents, dtypes, precision) and result
    out = jax.eval_shape(plain, *(struct(x) for x in arrays))
    how = "optimal" if optimize is True else _Unoptimized() if optimize is False else optimize
    _, path = opt_einsum.contract_path(subscripts, *arrays, einsum_call=True, use_blas=True, optimize=how)
    pet = np.dtype(out.dtype)
    epilogue = bias is not None or activation is not None
    if epilogue and (not path or len(path[-1][0]) != 2):
        return constrain(_xla_epilogue("einsum", plain, arrays, pet, bias, activation), out_sharding)
    for step, (inds, removed, einstr, *_) in enumerate(path):
        ins, result = einstr.split("->")
        names = dict(zip(inds, ins.split(",")))
        picked = sorted(inds)
        if len(picked) > 2:
            raise NotImplementedError("jax_cute.einsum (as jax.numpy.einsum) does not support simultaneous "
                                      "contraction of 3 or more operands; the optimize path names one")
        xs = [arrays[i] for i in picked]
        for i in reversed(picked):
            arrays.pop(i)
        if len(picked) == 1:
            arrays.append(_one(xs[0], names[picked[0]], removed, result, pet))
        else:
            last = step == len(path) - 1
            arrays.append(_pair(xs[0], names[picked[0]], xs[1], names[picked[1]], removed, result, precision, pet,
                                bias=bias if last else None, activation=activation if last else None))
    res = arrays[0]
    assert is_gated(activation) or res.shape == out.shape, (res.shape, out.shape)   # a gated one halves N
    return constrain(weak_as(res if res.dtype == pet else res.astype(pet), out, bias), out_sharding)


class _Unoptimized(opt_einsum.paths.PathOptimizer):
    """jnp.einsum's ``optimize=False``: contract the operands left to right."""

    def __call__(self, inputs, *args, **kwargs):
        return [(0, 1)] * (len(inputs) - 1)


def _sum(x, axes: Sequence[int], pet: np.dtype):
    """jnp.einsum's sum over ``axes``: in the operand's dtype unless the result type is wider
    (so bool stays bool, summed as a logical or, and int8 wraps as jnp's does)."""
    if not axes:
        return x
    if jnp.result_type(x.dtype, pet) != x.dtype:
        x = x.astype(pet)
    add = jax.lax.bitwise_or if x.dtype == np.dtype(bool) else jax.lax.add
    return jax.lax.reduce(x, np.array(0, x.dtype), add, tuple(axes))


def _drop(names: str, drop: Sequence[str]) -> str:
    return "".join(c for c in names if c not in drop)


def _reduce_unshared(x, names: str, removed, keep: str, pet: np.dtype):
    """Sum the contracted indices only ``x`` has, then its diagonals (repeated indices), as
    jnp.einsum does: an index in ``keep`` keeps one copy of its diagonal."""
    counts = {c: names.count(c) for c in names}
    uniques = [c for c in sorted(removed) if counts.get(c) == 1 and c not in keep]
    x = _sum(x, [names.index(c) for c in uniques], pet)
    names = _drop(names, uniques)
    for c in dict.fromkeys(names):
        axes = [i for i, n in enumerate(names) if n == c]
        if len(axes) < 2:
            continue
        iotas = [jax.lax.broadcasted_iota(jnp.int32, x.shape, a) for a in axes]
        eye = functools.reduce(jnp.logical_and, [iotas[0] == t for t in iotas[1:]])
        x = jax.lax.select(eye, x, jnp.zeros_like(x))
        summed = axes if c not in keep else axes[:-1]
        x = _sum(x, summed, pet)
        names = "".join(n for i, n in enumerate(names) if i not in summed)
    return x, names


def _one(x, names: str, removed, result: str, pet: np.dtype):
    """A step of the path over one operand: sums, diagonals and a transpose, no product."""
    x, names = _reduce_unshared(x, names, removed, result, pet)
    return x if names == result else jnp.transpose(x, [names.index(c) for c in result])


def _squeeze_broadcast(x, names: str, other_shape, other_names: str):
    """Drop the extent-1 indices of ``x`` that the other operand has with a larger extent: they
    broadcast (jnp.einsum's rule)."""
    drop = [i for i, c in enumerate(names) if x.shape[i] == 1 and c in other_names
            and other_shape[other_names.index(c)] != 1]
    if not drop:
        return x, names
    return jnp.squeeze(x, tuple(drop)), "".join(c for i, c in enumerate(names) if i not in drop)


def _pair(a, lhs: str, b, rhs: str, removed, out: str, precision, pet: np.dtype, *, bias, activation):
    """One product of two operands of the path, as one GEMM written in the order ``out``."""
    a, lhs = _squeeze_broadcast(a, lhs, b.shape, rhs)
    b, rhs = _squeeze_broadcast(b, rhs, a.shape, lhs)
    a, lhs = _reduce_unshared(a, lhs, [c for c in removed if c not in rhs], out + rhs, pet)
    b, rhs = _reduce_unshared(b, rhs, [c for c in removed if c not in lhs], out + lhs, pet)
    batch = [c for c in out if c in lhs and c in rhs]
    contract = [c for c in lhs if c in rhs and c not in out]
    lf = [c for c in lhs if c not in rhs]
    rf = [c for c in rhs if c not in lhs]
    logical = batch + lf + rf
    dn = (([lhs.index(c) for c in contract], [rhs.index(c) for c in contract]),
          ([lhs.index(c) for c in batch], [rhs.index(c) for c in batch]))
    check_operand_dtypes("einsum", a, b)
    dtype = _lax_result(a, b, dn, precision, pet).dtype
    layouts, _ = contraction_layouts(a.shape, b.shape, *dn, [logical.index(c) for c in out])
    return bind_gemm("einsum", a, b, layouts, dtype, precision, bias=bias, activation=activation)


def _xla_epilogue(op: str, product, arrays, out_dtype, bias, activation):
    """``act(product + bias)`` in XLA, where no product of two operands ends the path, with the
    fused path's checks and numerics: the product in float32 (or wider), rounded once."""
    bias = checked_options(op, out_dtype, bias, activation)
    z = product(*arrays, preferred_element_type=epilogue_dtype(out_dtype))
    if is_gated(activation):
        check_gated_columns(op, activation, z.shape[-1] if z.ndim else 1)
    if bias is not None:
        check_bias_broadcasts(op, bias.shape, z.shape)
        z = z + bias.astype(z.dtype)
    return activated(z, activation=activation, preact=False, out_dtype=out_dtype)[0]
