"""CuTe-style layouts: a (shape, stride) pair of static integers mapping coordinates to offsets.

A layout's shape and stride are congruent nested tuples ("hierarchical modes"). A coordinate
is mapped to an offset by ``sum(coord_i * stride_i)`` over the flattened modes; within a
hierarchical mode, an integer index is split colexicographically (first sub-mode fastest), as
in CuTe. The algebra here is what the batching and autodiff rules of our primitives need:
selecting and permuting modes, inserting a batch mode (stride 0 for a broadcast operand),
coalescing, composition, and mapping to and from a JAX array's row-major buffer.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence, Union

import jax.numpy as jnp
import numpy as np

IntTuple = Union[int, tuple["IntTuple", ...]]


def flatten(t: IntTuple) -> tuple[int, ...]:
    if isinstance(t, int):
        return (t,)
    return tuple(x for e in t for x in flatten(e))


def product(t: IntTuple) -> int:
    return math.prod(flatten(t))


def _congruent(a: IntTuple, b: IntTuple) -> bool:
    if isinstance(a, int) or isinstance(b, int):
        return isinstance(a, int) and isinstance(b, int)
    return len(a) == len(b) and all(_congruent(x, y) for x, y in zip(a, b))


@dataclasses.dataclass(frozen=True)
class Layout:
    shape: IntTuple
    stride: IntTuple

    def __post_init__(self):
        if not _congruent(self.shape, self.stride):
            raise ValueError(f"shape {self.shape} and stride {self.stride} are not congruent")
        if any(s < 0 for s in flatten(self.shape)):
            raise ValueError(f"negative extent in {self.shape}")

    # -- basic queries ------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return 1 if isinstance(self.shape, int) else len(self.shape)

    def size(self) -> int:
        return product(self.shape)

    def cosize(self) -> int:
        """One past the largest offset (0 for an empty layout)."""
        if self.size() == 0:
            return 0
        return sum((s - 1) * d for s, d in zip(flatten(self.shape), flatten(self.stride))) + 1

    def mode(self, i: int) -> "Layout":
        if isinstance(self.shape, int):
            if i != 0:
                raise IndexError(i)
            return self
        return Layout(self.shape[i], self.stride[i])  # type: ignore[index]

    def modes(self) -> tuple["Layout", ...]:
        return tuple(self.mode(i) for i in range(self.rank))

    def flat_modes(self) -> tuple[tuple[int, int], ...]:
        return tuple(zip(flatten(self.shape), flatten(self.stride)))

    def __call__(self, *coord: int) -> int:
        """Offset of a coordinate: one integer (colexicographic over all modes) or one per mode."""
        if len(coord) == 1:
            idx, out = coord[0], 0
            for s, d in self.flat_modes():
                out += (idx % s) * d
                idx //= s
            return out
        if len(coord) != self.rank:
            raise ValueError(f"coordinate {coord} does not match rank {self.rank}")
        return sum(self.mode(i)(c) for i, c in enumerate(coord))

    def offsets(self) -> np.ndarray:
        """All offsets, as an array of shape (size(mode 0), size(mode 1), ...)."""
        out = np.zeros((), np.int64)
        for m in self.modes():
            idx = np.zeros((1,), np.int64)
            for s, d in m.flat_modes():  # colexicographic inside a mode
                idx = (idx[None, :] + np.arange(s, dtype=np.int64)[:, None] * d).reshape(-1)
            out = out[..., None] + idx
        return out

    # -- algebra ------------------------------------------------------------------------------
    def select(self, *indices: int) -> "Layout":
        """A layout of the given modes, in the given order (a permutation when all are given)."""
        return make_layout(*(self.mode(i) for i in indices))

    def replace(self, i: int, mode: "Layout") -> "Layout":
        ms = list(self.modes())
        ms[i] = mode
        return make_layout(*ms)

    def append_to_mode(self, i: int, extent: int, stride: int) -> "Layout":
        """Add a sub-mode (extent : stride) as the slowest part of mode ``i``.

        This is how a vmapped axis becomes a batch sub-mode: its stride in the buffer, or 0 for
        an operand broadcast over it.
        """
        m = self.mode(i)
        shapes = (m.shape,) if isinstance(m.shape, int) else m.shape
        strides = (m.stride,) if isinstance(m.stride, int) else m.stride
        return self.replace(i, Layout(shapes + (extent,), strides + (stride_of(extent, stride),)))

    def flatten_mode(self, i: int) -> "Layout":
        m = self.mode(i)
        return self.replace(i, Layout(flatten(m.shape), flatten(m.stride)))

    def coalesce(self) -> "Layout":
        """Merge adjacent flattened sub-modes that are contiguous; drop extent-1 sub-modes."""
        return Layout(*_coalesce_pairs(self.flat_modes()))

    def compose(self, other: "Layout") -> "Layout":
        """``self ∘ other``: the layout ``c -> self(other(c))``, shaped like ``other``."""
        return _compose(self, other)

    def __str__(self) -> str:
        return f"{self.shape}:{self.stride}"


def stride_of(extent: int, stride: int) -> int:
    # An extent-1 sub-mode's stride is never used; normalising it keeps equal layouts equal.
    return 0 if extent == 1 else stride


def make_layout(*modes: Layout) -> Layout:
    return Layout(tuple(m.shape for m in modes), tuple(m.stride for m in modes))


def _coalesce_pairs(pairs: Sequence[tuple[int, int]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    shape: list[int] = []
    stride: list[int] = []
    for s, d in pairs:
        if s == 1:
            continue
        if shape and stride[-1] * shape[-1] == d:
            shape[-1] *= s
        elif shape and stride[-1] == 0 and d == 0:
            shape[-1] *= s
        else:
            shape.append(s)
            stride.append(d)
    if not shape:
        return (1,), (0,)
    return tuple(shape), tuple(stride)


def row_major(shape: Sequence[int]) -> Layout:
    """The layout of a JAX array's default (row-major) buffer: last axis fastest."""
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(stride_of(s, acc))
        acc *= s
    return Layout(tuple(shape), tuple(reversed(stride)))


def reindex(layout: Layout, shape: Sequence[int], axis_strides: Sequence[int]) -> Layout | None:
    """``layout`` over a row-major buffer of ``shape`` re-targeted at a buffer whose axis i has
    stride ``axis_strides[i]`` (a padded buffer, or a broadcast one with stride 0): the element at
    the same index tuple. Each flat sub-mode must lie inside one buffer axis (its stride then
    scales with that axis's); None otherwise."""
    old = [math.prod(shape[i + 1:]) for i in range(len(shape))]

    def moved(extent: int, stride: int) -> int | None:
        if extent == 1 or stride == 0:
            return stride
        # the slowest axis whose stride divides this one: the axis the sub-mode steps along
        axis = max((i for i, s in enumerate(old) if shape[i] > 1 and s <= stride and stride % s == 0),
                   key=lambda i: old[i], default=None)
        if axis is None or (stride // old[axis]) * (extent - 1) >= shape[axis]:
            return None
        return stride // old[axis] * axis_strides[axis]

    def walk(sh: IntTuple, stride: IntTuple) -> IntTuple | None:
        if isinstance(sh, int):
            return moved(sh, stride)  # type: ignore[arg-type]
        out = [walk(s, d) for s, d in zip(sh, stride)]  # type: ignore[arg-type]
        return None if any(x is None for x in out) else tuple(out)

    stride = walk(layout.shape, layout.stride)
    return None if stride is None else Layout(layout.shape, stride)


def restride(layout: Layout, old_shape: Sequence[int], new_shape: Sequence[int]) -> Layout | None:
    """``layout`` over a row-major buffer of ``old_shape`` moved to a padded buffer of
    ``new_shape`` (no axis shorter): the same elements at their new offsets (``reindex``)."""
    return reindex(layout, old_shape, [math.prod(new_shape[i + 1:]) for i in range(len(new_shape))])


def insert_axis(buffer_shape: Sequence[int], axis: int, extent: int) -> tuple[Layout, int]:
    """Relocate offsets when a new axis is inserted into a row-major buffer.

    Returns (E, inner): ``E`` maps an offset of the old buffer to the offset of the same element
    at index 0 of the new axis, and ``inner`` is the new axis's stride. Composing an operand's
    layout with ``E`` is how vmap re-targets a layout at the batched buffer without moving data.
    """
    inner = math.prod(buffer_shape[axis:])
    outer = math.prod(buffer_shape[:axis])
    return Layout((inner, outer), (1, stride_of(outer, inner * extent))), inner


def _compose(a: Layout, b: Layout) -> Layout:
    if not isinstance(b.shape, int):
        return make_layout(*(_compose(a, m) for m in b.modes()))
    s, d = b.shape, b.stride
    if d == 0 or s == 1:
        return Layout(s, stride_of(s, 0))
    shapes, strides = map(list, _coalesce_pairs(a.flat_modes()))
    # Divide out the first d elements of a, then keep the next s of what is left, mode by mode.
    rest = d
    while rest > 1 and len(shapes) > 1:
        if rest % shapes[0] == 0:
            rest //= shapes[0]
            shapes.pop(0)
            strides.pop(0)
        elif shapes[0] % rest == 0:
            shapes[0] //= rest
            strides[0] *= rest
            rest = 1
        else:
            raise ValueError(f"cannot compose {a} with stride {d}: not divisible")
    strides[0] *= rest
    out_s, out_d, need = [], [], s
    for i, (sh, st) in enumerate(zip(shapes, strides)):
        last = i == len(shapes) - 1
        if need <= sh or last:
            if not last and sh % need:
                raise ValueError(f"cannot compose {a} with extent {s}: not divisible")
            out_s.append(need)
            out_d.append(st)
            need = 1
            break
        if need % sh:
            raise ValueError(f"cannot compose {a} with extent {s}: not divisible")
        out_s.append(sh)
        out_d.append(st)
        need //= sh
    if len(out_s) == 1:
        return Layout(out_s[0], stride_of(out_s[0], out_d[0]))
    return Layout(tuple(out_s), tuple(stride_of(x, y) for x, y in zip(out_s, out_d)))


# -- layouts over JAX arrays ---------------------------------------------------------------------

def _compact_plan(layout: Layout, buffer_size: int):
    """For a layout that is a permutation of a whole buffer up to stride-0 (broadcast) sub-modes,
    the order of its non-broadcast flat sub-modes from slowest to fastest; else None."""
    flat = [(i, s, d) for i, (s, d) in enumerate(layout.flat_modes()) if s != 1 and d != 0]
    flat.sort(key=lambda t: -t[2])
    acc = 1
    for _, s, d in reversed(flat):
        if d != acc:
            return None
        acc *= s
    if acc != buffer_size:
        return None
    return [i for i, _, _ in flat]


def read(buffer, layout: Layout):
    """The logical array ``x[c0, c1, ...] = buffer.flat[layout(c0, c1, ...)]``, one axis per mode.

    Built from reshape, transpose and broadcast when the layout is a permutation of the whole
    buffer (all layouts our primitives build are); otherwise from a gather of its offsets.
    """
    flat = jnp.reshape(buffer, (-1,))
    plan = _compact_plan(layout, flat.shape[0])
    out_shape = tuple(product(m.shape) for m in layout.modes())
    if plan is None:
        return jnp.reshape(flat[jnp.asarray(layout.offsets().reshape(-1))], out_shape)
    fm = layout.flat_modes()
    x = jnp.reshape(flat, tuple(fm[i][0] for i in plan))
    # Axis order wanted: flat sub-modes fastest-first within a mode must become numpy order
    # (last axis fastest), so within each mode list sub-modes slowest-first.
    order, pos = [], 0
    for m in layout.modes():
        n = len(flatten(m.shape))
        order.extend(reversed(range(pos, pos + n)))
        pos += n
    present = [i for i in order if i in plan]
    x = jnp.transpose(x, [plan.index(i) for i in present])
    full = tuple(fm[i][0] for i in order)
    x = jnp.reshape(x, tuple(fm[i][0] for i in order if i in plan))
    # Re-insert broadcast (stride 0) and extent-1 sub-modes.
    expand = [k for k, i in enumerate(order) if i not in plan]
    for k in expand:
        x = jnp.expand_dims(x, k)
    x = jnp.broadcast_to(x, full)
    return jnp.reshape(x, out_shape)


def write(values, layout: Layout, buffer_shape: Sequence[int]):
    """The buffer ``b`` with ``b.flat[layout(c)] = values[c]`` (layout a permutation of it)."""
    size = math.prod(buffer_shape)
    plan = _compact_plan(layout, size)
    fm = layout.flat_modes()
    if plan is None or any(d == 0 and s != 1 for s, d in fm):
        if size == 0:
            return jnp.zeros(buffer_shape, values.dtype)
        offs = jnp.asarray(layout.offsets().reshape(-1))
        return jnp.zeros((size,), values.dtype).at[offs].set(jnp.reshape(values, (-1,))).reshape(buffer_shape)
    order, pos = [], 0
    for m in layout.modes():
        n = len(flatten(m.shape))
        order.extend(reversed(range(pos, pos + n)))
        pos += n
    x = jnp.reshape(values, tuple(fm[i][0] for i in order))
    keep = [k for k, i in enumerate(order) if i in plan]
    x = jnp.reshape(x, tuple(fm[order[k]][0] for k in keep))
    kept = [order[k] for k in keep]
    x = jnp.transpose(x, [kept.index(i) for i in plan])
    return jnp.reshape(x, tuple(buffer_shape))
