"""Property tests of the layout algebra against plain numpy indexing."""

from __future__ import annotations

import itertools
import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_cute import layout as L
from jax_cute.layout import Layout, insert_axis, make_layout, read, row_major, write
from jax_cute.problem.gemm_layouts import refine

small_shapes = st.lists(st.integers(1, 4), min_size=1, max_size=4).map(tuple)


def numpy_offsets(buffer_shape, perm):
    """Offsets of a row-major buffer viewed with its axes permuted, in numpy's own words."""
    idx = np.arange(math.prod(buffer_shape)).reshape(buffer_shape)
    return np.transpose(idx, perm)


@st.composite
def permuted_views(draw):
    shape = draw(small_shapes)
    perm = draw(st.permutations(range(len(shape))))
    rm = row_major(shape)
    return shape, tuple(perm), rm.select(*perm)


@given(permuted_views())
def test_offsets_match_numpy(view):
    shape, perm, lay = view
    np.testing.assert_array_equal(lay.offsets(), numpy_offsets(shape, perm))


@given(permuted_views())
def test_call_matches_offsets(view):
    shape, perm, lay = view
    offs = lay.offsets()
    for coord in itertools.islice(np.ndindex(offs.shape), 50):
        assert lay(*coord) == offs[coord]


@given(permuted_views())
def test_coalesce_keeps_the_function(view):
    _, _, lay = view
    flat = Layout(tuple(s for s, _ in lay.flat_modes()), tuple(d for _, d in lay.flat_modes()))
    co = lay.coalesce()
    assert co.size() == flat.size()
    for i in range(flat.size()):
        assert co(i) == flat(i)
    assert len(co.flat_modes()) <= len(flat.flat_modes())


@given(small_shapes, st.data())
def test_read_write_roundtrip(shape, data):
    perm = tuple(data.draw(st.permutations(range(len(shape)))))
    lay = row_major(shape).select(*perm)
    buf = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    got = np.asarray(read(jnp.asarray(buf), lay))
    np.testing.assert_array_equal(got, np.transpose(buf, perm))
    back = np.asarray(write(jnp.asarray(got), lay, shape))
    np.testing.assert_array_equal(back, buf)


@given(small_shapes, st.integers(0, 4), st.integers(1, 3), st.data())
def test_insert_axis_relocates_offsets(shape, axis, extent, data):
    axis = min(axis, len(shape))
    relocate, inner = insert_axis(shape, axis, extent)
    new_shape = shape[:axis] + (extent,) + shape[axis:]
    old = np.arange(math.prod(shape)).reshape(shape)
    new = np.arange(math.prod(new_shape)).reshape(new_shape)
    at0 = np.take(new, 0, axis=axis)
    for idx in np.ndindex(shape):
        assert relocate(int(old[idx])) == int(at0[idx])
    if extent > 1:
        assert int(np.take(new, 1, axis=axis).flat[0] - at0.flat[0]) == inner


@given(small_shapes, st.data())
def test_compose_is_function_composition(shape, data):
    perm = tuple(data.draw(st.permutations(range(len(shape)))))
    inner = row_major(shape).select(*perm)
    axis = data.draw(st.integers(0, len(shape)))
    extent = data.draw(st.integers(1, 3))
    outer, _ = insert_axis(shape, axis, extent)
    comp = outer.compose(inner)
    offs = inner.offsets()
    for coord in np.ndindex(offs.shape):
        assert comp(*coord) == outer(int(offs[coord]))


@given(st.lists(st.integers(1, 3), min_size=1, max_size=3), st.data())
@settings(max_examples=50)
def test_broadcast_mode_reads_like_numpy_broadcast(shape, data):
    shape = tuple(shape)
    b = data.draw(st.integers(2, 3))
    lay = row_major(shape).append_to_mode(len(shape) - 1, b, 0)  # batch sub-mode, stride 0
    buf = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    got = np.asarray(read(jnp.asarray(buf), lay))
    want = np.concatenate([buf] * b, axis=-1)  # colexicographic: the new sub-mode is slowest
    np.testing.assert_array_equal(got, want)


def test_refine_splits_to_a_common_structure():
    a = Layout((6,), (1,))
    b = Layout((2, 3), (3, 0))
    ra, rb = refine([a, b])
    assert ra.shape == rb.shape == (2, 3)
    for i in range(6):
        assert ra(i) == a(i) and rb(i) == b(i)


def test_bad_layouts_are_rejected():
    with pytest.raises(ValueError):
        Layout((2, 3), (1,))
    with pytest.raises(ValueError):
        Layout((2, 3), (1, 4)).compose(Layout(3, 1))  # 3 elements straddle the 2-wide first mode


def test_hierarchical_mode_is_colexicographic():
    lay = make_layout(Layout((3, 2), (4, 12)), Layout((4,), (1,)))  # M folded with a batch
    buf = np.arange(24).reshape(2, 3, 4)
    np.testing.assert_array_equal(np.asarray(read(jnp.asarray(buf), lay)), buf.reshape(6, 4))


@pytest.mark.parametrize("shape,lay", [
    ((5, 7), L.Layout(((5,), (7,), (1,)), ((7,), (1,), (0,)))),                 # rows and columns
    ((3, 5, 7), L.Layout(((5,), (7,), (3,)), ((7,), (1,), (35,)))),              # a batch axis
    ((5, 7), L.Layout(((7,), (5,), (1,)), ((1,), (7,), (0,)))),                 # transposed
    ((4, 6), L.Layout(((2, 2), (6,)), ((12, 6), (1,)))),                        # an axis split in two
])
def test_restride_reads_the_same_elements_from_the_padded_buffer(shape, lay):
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    padded_shape = shape[:-1] + (shape[-1] + 3,)
    moved = L.restride(lay, shape, padded_shape)
    xp = np.pad(x, [(0, 0)] * (len(shape) - 1) + [(0, 3)])
    np.testing.assert_array_equal(L.read(jnp.asarray(xp), moved), L.read(jnp.asarray(x), lay))


def test_restride_refuses_a_sub_mode_spanning_axes():
    # one sub-mode of 35 elements covers both axes of a (5, 7) buffer: padding breaks it
    assert L.restride(L.Layout((35,), (1,)), (5, 7), (5, 8)) is None


@pytest.mark.parametrize("bias_shape", [(7,), (5, 1), (1, 7), (), (3, 1, 7)])
def test_reindex_reads_a_broadcast_buffer_through_stride_zero(bias_shape):
    # C of a (3, 5, 7) product read at its (M, N, L) coordinates; a bias broadcast against it
    shape = (3, 5, 7)
    lay = L.Layout(((5,), (7,), (3,)), ((7,), (1,), (35,)))
    bias = np.arange(max(1, int(np.prod(bias_shape))), dtype=np.float32).reshape(bias_shape)
    own = L.row_major(bias_shape).stride
    per_axis = [0] * (3 - len(bias_shape)) + [s if n > 1 else 0 for n, s in zip(bias_shape, own)]
    moved = L.reindex(lay, shape, per_axis)
    want = L.read(jnp.asarray(np.broadcast_to(bias, shape).copy()), lay)
    np.testing.assert_array_equal(L.read(jnp.asarray(bias.reshape(-1)), moved), want)
