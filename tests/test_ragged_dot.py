"""CPU: jax_cute.ragged_dot (reference lowering) against jax.lax.ragged_dot and a float64 numpy
model of the documented bad-size rules, under jit, vmap and grad."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jax_cute.primitives.ragged_dot import ragged_dot


def np_ragged_dot(x, w, gs) -> np.ndarray:
    """Documented semantics: negative sizes count as 0, group ends clipped at M, rest zero."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    ends = np.minimum(np.cumsum(np.maximum(np.asarray(gs, np.int64), 0)), x.shape[0])
    out = np.zeros((x.shape[0], w.shape[2]))
    for g, (s, e) in enumerate(zip(np.concatenate([[0], ends[:-1]]), ends)):
        out[s:e] = x[s:e] @ w[g]
    return out


def _data(m, k, g, n, dtype=jnp.float32, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return jax.random.normal(k1, (m, k), dtype), jax.random.normal(k2, (g, k, n), dtype)


SHAPES = [  # (M, K, N, group sizes)
    (8, 4, 5, [3, 0, 5]),        # an empty group
    (10, 6, 3, [2, 3, 1]),       # sum < M: trailing rows are zero
    (16, 8, 8, [16]),            # one group
    (7, 3, 2, [0, 0, 0, 0]),     # all empty
    (33, 17, 9, [5, 11, 0, 9, 8]),
]


@pytest.mark.parametrize("m,k,n,sizes", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_matches_lax(m, k, n, sizes, dtype):
    x, w = _data(m, k, len(sizes), n, dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    got = jax.jit(ragged_dot)(x, w, gs)
    want = jax.lax.ragged_dot(x, w, gs)
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.float32(got), np.float32(want), rtol=tol, atol=tol * 4)
    np.testing.assert_allclose(np.float32(got), np_ragged_dot(x, w, gs), rtol=tol, atol=tol * 4)


def test_preferred_element_type_and_precision():
    x, w = _data(12, 8, 3, 4, jnp.bfloat16)
    gs = jnp.array([4, 4, 4], jnp.int32)
    got = ragged_dot(x, w, gs, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, np_ragged_dot(x, w, gs), rtol=1e-5, atol=1e-5)
    # mixed precision: gradients come back in the operand dtype
    gx, gw = jax.grad(lambda x, w: ragged_dot(x, w, gs, preferred_element_type=jnp.float32).sum(), (0, 1))(x, w)
    assert gx.dtype == gw.dtype == jnp.bfloat16


@pytest.mark.parametrize("sizes", [[-3, 5, 4], [6, 9, 2], [2**31 - 1, 2**31 - 1, 5], [-1, -1, -1], [0, 20, -5]])
def test_bad_sizes_documented(sizes):
    x, w = _data(10, 4, 3, 5)
    gs = jnp.asarray(sizes, jnp.int32)
    np.testing.assert_allclose(jax.jit(ragged_dot)(x, w, gs), np_ragged_dot(x, w, sizes), rtol=1e-5, atol=1e-5)
    # the gradients see the same clipped groups
    gx = jax.grad(lambda x: ragged_dot(x, w, gs).sum())(x)
    np.testing.assert_allclose(gx, jax.grad(lambda x: jnp.sum(np_model_jnp(x, w, sizes)))(x), rtol=1e-5, atol=1e-5)


def np_model_jnp(x, w, sizes):
    """The documented semantics with static sizes, in jnp (for gradients)."""
    ends = np.minimum(np.cumsum(np.maximum(np.asarray(sizes, np.int64), 0)), x.shape[0])
    rows = [x[s:e] @ w[g] for g, (s, e) in enumerate(zip(np.concatenate([[0], ends[:-1]]), ends))]
    return jnp.concatenate(rows + [jnp.zeros((x.shape[0] - int(ends[-1]), w.shape[2]), x.dtype)])


def test_grads_match_lax_and_float0():
    x, w = _data(12, 6, 4, 5)
    gs = jnp.array([3, 0, 6, 2], jnp.int32)
    ct = jax.random.normal(jax.random.key(3), (12, 5))
    out, vjp = jax.vjp(ragged_dot, x, w, gs)
    out_l, vjp_l = jax.vjp(jax.lax.ragged_dot, x, w, gs)
    dx, dw, dgs = vjp(ct)
    dx_l, dw_l, _ = vjp_l(ct)
    np.testing.assert_allclose(dx, dx_l, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, dw_l, rtol=1e-5, atol=1e-5)
    assert dgs.dtype == jax.dtypes.float0 and dgs.shape == gs.shape
    assert np.all(dw[1] == 0)  # empty group


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_check_grads_order2(dtype):
    with jax.enable_x64(dtype == jnp.float64):
        x, w = _data(7, 3, 3, 4, jnp.float32)
        x, w = x.astype(dtype), w.astype(dtype)
        for sizes in ([2, 0, 4], [5, 4, -1]):
            gs = jnp.asarray(sizes, jnp.int32)
            tol = 2e-2 if dtype == jnp.float32 else 1e-6
            check_grads(lambda x, w: ragged_dot(x, w, gs), (x, w), order=2, modes=("fwd", "rev"), atol=tol, rtol=tol)


def _loop(f, axes, args, b):
    take = lambda a, ax, i: a if ax is None else jnp.take(a, i, axis=ax)  # noqa: E731
    return jnp.stack([f(*(take(a, ax, i) for a, ax in zip(args, axes))) for i in range(b)])


def _batched_args(axes, b=3, m=9, k=4, g=3, n=5):
    x, w = _data(m, k, g, n)
    xb, wb = _data(b * m, k, b * g, n, seed=1)
    xb, wb = xb.reshape(b, m, k), wb.reshape(b, g, k, n)
    gsb = jnp.array([[3, 0, 5], [1, 6, 2], [4, 0, 4]], jnp.int32)
    gs = gsb[1]
    args = [xb if axes[0] is not None else x, wb if axes[1] is not None else w, gsb if axes[2] is not None else gs]
    return [a if ax in (None, 0) else jnp.moveaxis(a, 0, ax) for a, ax in zip(args, axes)]


AXES = [ax for ax in itertools.product((None, 0), repeat=3) if ax != (None, None, None)] + [(1, 2, 1), (2, None, 1)]


@pytest.mark.parametrize("axes", AXES)
def test_vmap_and_grads(axes):
    args = _batched_args(axes)
    f = jax.jit(jax.vmap(ragged_dot, axes))
    want = _loop(jax.lax.ragged_dot, axes, args, 3)
    np.testing.assert_allclose(f(*args), want, rtol=1e-5, atol=1e-5)
    # grad of vmap
    loss = lambda fn: lambda x, w: jnp.sum(fn(x, w, args[2]) ** 2)  # noqa: E731
    got = jax.grad(loss(jax.vmap(ragged_dot, axes)), (0, 1))(*args[:2])
    ref = jax.grad(loss(lambda x, w, g: _loop(jax.lax.ragged_dot, axes, (x, w, g), 3)), (0, 1))(*args[:2])
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_vmap_of_grad_and_nested():
    args = _batched_args((0, 0, 0))
    per = lambda x, w, g: jax.grad(lambda x, w: jnp.sum(jnp.sin(ragged_dot(x, w, g))), (0, 1))(x, w)  # noqa: E731
    per_l = lambda x, w, g: jax.grad(lambda x, w: jnp.sum(jnp.sin(jax.lax.ragged_dot(x, w, g))), (0, 1))(x, w)  # noqa: E731
    got = jax.jit(jax.vmap(per))(*args)
    for i in range(3):
        want = per_l(args[0][i], args[1][i], args[2][i])
        for a, b in zip(got, want):
            np.testing.assert_allclose(a[i], b, rtol=1e-5, atol=1e-5)
    # nested vmap: two batch sub-modes
    x, w = _data(2 * 3 * 6, 4, 3, 5)
    gs = jnp.array([2, 1, 3], jnp.int32)
    got = jax.vmap(jax.vmap(ragged_dot, (0, None, None)), (0, None, None))(x.reshape(2, 3, 6, 4), w, gs)
    np.testing.assert_allclose(got.reshape(-1, 6, 5), _loop(jax.lax.ragged_dot, (0, None, None), (x.reshape(6, 6, 4), w, gs), 6),
                               rtol=1e-5, atol=1e-5)


def test_bad_inputs():
    x, w = _data(8, 4, 2, 3)
    gs = jnp.array([4, 4], jnp.int32)
    with pytest.raises(ValueError, match=r"2 entries for 3 groups"):
        ragged_dot(x, jnp.ones((3, 4, 3)), gs)
    with pytest.raises(TypeError, match="group_sizes must be integers"):
        ragged_dot(x, w, gs.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"lhs K=4, rhs K=5"):
        ragged_dot(x, jnp.ones((2, 5, 3)), gs)
    with pytest.raises(ValueError, match=r"expected lhs \[M,K\]"):
        ragged_dot(x[None], w, gs)
    with pytest.raises(ValueError, match=r"expected lhs \[M,K\]"):
        ragged_dot(x, w, gs[None])
    with pytest.raises(TypeError, match="unsupported operand dtype bool"):
        ragged_dot(x > 0, w, gs)
    with pytest.raises(NotImplementedError, match="group_offset"):
        ragged_dot(x, w, gs, group_offset=jnp.array([0]))
    # other integer dtypes are used as int32
    np.testing.assert_allclose(ragged_dot(x, w, gs.astype(jnp.int16)), ragged_dot(x, w, gs))
