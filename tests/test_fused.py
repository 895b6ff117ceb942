"""Fused epilogues on the CPU: ``matmul``/``ragged_dot`` with ``bias`` and ``activation``.

Values and gradients must equal the unfused ``jax.nn`` expression (float32: to rounding; 16-bit:
the activation of the float32 accumulator rounded once), under jit, vmap and grad; bad input is
refused at trace time; calls without the options keep the plain primitive.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_cute
from jax_cute import config
from jax_cute.activations import ACTIVATIONS, apply_activation

ACTS = (None,) + ACTIVATIONS
BIASES = ("none", "row", "full")


def crossed(xs, ys) -> list:
    """Every (x, y) pair: the README's test line takes each x and each y at least once (x i with
    y i mod len(ys), and y j with x j mod len(xs)); the other pairs are sweeps (CI's second step)."""
    return [pytest.param(x, y, marks=() if j == i % len(ys) or i == j % len(xs) else pytest.mark.sweep)
            for i, x in enumerate(xs) for j, y in enumerate(ys)]


def _data(*shapes, scale=0.3, seed=0, dtype=jnp.float32):
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    return [(scale * jax.random.normal(k, s)).astype(dtype) for k, s in zip(keys, shapes)]


def _bias(kind, out_shape, seed=7, dtype=jnp.float32):
    if kind == "none":
        return None
    shape = out_shape[-1:] if kind == "row" else out_shape
    return _data(shape, seed=seed, dtype=dtype)[0]


def unfused(a, b, bias, activation, **kw):
    """The same computation written with jnp and jax.nn."""
    z = jnp.matmul(a, b, preferred_element_type=jnp.float32, **kw)
    if bias is not None:
        z = z + bias.astype(jnp.float32)
    return apply_activation(activation, z)


def _close(got, want, tol=2e-5):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


# -- values -------------------------------------------------------------------------------------

@pytest.mark.parametrize("activation, bias_kind", crossed(ACTS, BIASES))
def test_matmul_values(activation, bias_kind):
    a, b = _data((5, 2, 9, 7), (7, 12))
    bias = _bias(bias_kind, (5, 2, 9, 12))
    f = jax.jit(functools.partial(jax_cute.matmul, activation=activation))
    got = f(a, b, bias=bias)
    want = unfused(a, b, bias, activation)
    assert got.shape == want.shape
    _close(got, want)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_matmul_transposed_and_batched_weights(activation):
    a, w = _data((3, 9, 7), (3, 10, 7))
    bias = _bias("row", (10,))
    got = jax.jit(lambda a, w, c: jax_cute.matmul(a, w, transpose_b=True, bias=c, activation=activation))(a, w, bias)
    _close(got, unfused(a, jnp.swapaxes(w, -1, -2), bias, activation))


@pytest.mark.parametrize("activation", ("gelu", "swiglu"))
def test_matmul_16bit_rounds_once(activation):
    a, b = _data((33, 64), (64, 48), dtype=jnp.bfloat16)
    bias = _bias("row", (48,), dtype=jnp.bfloat16)
    got = jax.jit(lambda a, b, c: jax_cute.matmul(a, b, bias=c, activation=activation))(a, b, bias)
    assert got.dtype == jnp.bfloat16
    want = unfused(a.astype(jnp.float32), b.astype(jnp.float32), bias, activation).astype(jnp.bfloat16)
    # one rounding of the same float32 value: equal up to the last bit where sums reorder
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=8e-3, atol=1e-6)
    f32 = jax.jit(lambda a, b, c: jax_cute.matmul(a, b, bias=c, activation=activation,
                                                   preferred_element_type=jnp.float32))(a, b, bias)
    assert f32.dtype == jnp.float32
    _close(f32, unfused(a.astype(jnp.float32), b.astype(jnp.float32), bias, activation), 1e-5)


def test_one_dimensional_operands():
    a, b = _data((7,), (7, 6))
    bias = _bias("row", (6,))
    _close(jax_cute.matmul(a, b, bias=bias, activation="silu"), unfused(a, b, bias, "silu"))
    a2, b2 = _data((4, 7), (7,))
    _close(jax_cute.matmul(a2, b2, bias=_bias("full", (4,)), activation="relu"),
           unfused(a2, b2, _bias("full", (4,)), "relu"))


# -- vmap ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("activation, axes", crossed(("relu", "gelu_exact", "swiglu"),
                                                   [(0, None, None), (None, 0, None), (None, None, 0), (0, 0, 0),
                                                    (1, None, 0)]))
def test_matmul_vmap(activation, axes):
    a_shape, b_shape, c_shape = (9, 7), (7, 8), (8,)

    def batched(shape, ax):
        if ax is None:
            return shape
        s = list(shape)
        s.insert(ax, 3)
        return tuple(s)

    a, b, bias = _data(batched(a_shape, axes[0]), batched(b_shape, axes[1]), batched(c_shape, axes[2]))
    f = functools.partial(jax_cute.matmul, activation=activation)
    got = jax.jit(jax.vmap(lambda a, b, c: f(a, b, bias=c), in_axes=axes))(a, b, bias)
    want = jax.vmap(lambda a, b, c: unfused(a, b, c, activation), in_axes=axes)(a, b, bias)
    _close(got, want)


def test_matmul_nested_vmap_full_bias():
    a, b, bias = _data((2, 3, 9, 7), (3, 7, 8), (2, 3, 9, 8))
    f = lambda a, b, c: jax_cute.matmul(a, b, bias=c, activation="gelu")  # noqa: E731
    got = jax.jit(jax.vmap(jax.vmap(f), in_axes=(0, None, 0)))(a, b, bias)
    want = jax.vmap(jax.vmap(lambda a, b, c: unfused(a, b, c, "gelu")), in_axes=(0, None, 0))(a, b, bias)
    _close(got, want)


# -- gradients ----------------------------------------------------------------------------------

# An elementwise activation's derivative is jax.jvp of its function, whichever it is: the test
# line checks one (gelu) and gated swiglu, with the bias (its gradient too); the plain product
# and the other activations are sweeps, run in CI's second step.
_GRAD_ACTS = ("gelu", "swiglu")


@pytest.mark.parametrize("activation, bias_kind", [
    pytest.param(a, b, id=f"{b}-{a}", marks=() if b == "row" and a in _GRAD_ACTS else pytest.mark.sweep)
    for b in ("none", "row") for a in ACTS])
def test_matmul_check_grads(activation, bias_kind):
    a, b = _data((2, 5, 6), (6, 8))
    bias = _bias(bias_kind, (8,))
    if bias is None:
        f = lambda a, b: jax_cute.matmul(a, b, activation=activation)  # noqa: E731
        args = (a, b)
    else:
        f = lambda a, b, c: jax_cute.matmul(a, b, bias=c, activation=activation)  # noqa: E731
        args = (a, b, bias)
    check_grads(jax.jit(f), args, order=1)
    check_grads(jax.jit(f), args, order=2, modes=("fwd", "rev"))


@pytest.mark.parametrize("activation, bias_kind", crossed(ACTS, BIASES))
def test_matmul_grad_equals_unfused(activation, bias_kind):
    a, b = _data((2, 5, 6), (6, 8))
    bias = _bias(bias_kind, (2, 5, 8))
    n = 2 if bias is None else 3
    loss = lambda f: lambda *x: jnp.sum(jnp.sin(f(*x)))  # noqa: E731
    ours = lambda a, b, c=None: jax_cute.matmul(a, b, bias=c, activation=activation)  # noqa: E731
    ref = lambda a, b, c=None: unfused(a, b, c, activation)  # noqa: E731
    args = (a, b, bias)[:n]
    got = jax.jit(jax.grad(loss(ours), argnums=tuple(range(n))))(*args)
    want = jax.grad(loss(ref), argnums=tuple(range(n)))(*args)
    for g, w in zip(got, want):
        _close(g, w)


def test_matmul_grad_under_vmap_and_checkpoint():
    a, b, bias = _data((4, 9, 6), (6, 8), (4, 8))
    f = lambda a, b, c: jnp.sum(jax_cute.matmul(a, b, bias=c, activation="silu") ** 2)  # noqa: E731
    r = lambda a, b, c: jnp.sum(unfused(a, b, c, "silu") ** 2)  # noqa: E731
    got = jax.jit(jax.vmap(jax.grad(f, argnums=(0, 1, 2)), in_axes=(0, None, 0)))(a, b, bias)
    want = jax.vmap(jax.grad(r, argnums=(0, 1, 2)), in_axes=(0, None, 0))(a, b, bias)
    for g, w in zip(got, want):
        _close(g, w)
    # recomputing the pre-activation in the backward (jax.checkpoint) gives the same gradients
    remat = jax.jit(jax.grad(jax.checkpoint(f), argnums=(0, 1, 2)))(a[0], b, bias[0])
    saved = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(a[0], b, bias[0])
    for g, w in zip(remat, saved):
        _close(g, w)


def test_grad_16bit_mixed_precision():
    a, b = _data((16, 32), (32, 24), dtype=jnp.bfloat16)
    bias = _bias("row", (24,), dtype=jnp.bfloat16)
    f = lambda a, b, c: jnp.sum(jax_cute.matmul(a, b, bias=c, activation="gelu").astype(jnp.float32))  # noqa: E731
    ga, gb, gc = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(a, b, bias)
    assert (ga.dtype, gb.dtype, gc.dtype) == (jnp.bfloat16,) * 3
    r = lambda a, b, c: jnp.sum(unfused(a, b, c, "gelu"))  # noqa: E731
    wa, wb, wc = jax.grad(r, argnums=(0, 1, 2))(*(x.astype(jnp.float32) for x in (a, b, bias)))
    for g, w in ((ga, wa), (gb, wb), (gc, wc)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w), rtol=3e-2, atol=3e-2)


# -- ragged_dot ---------------------------------------------------------------------------------

def _ragged_ref(lhs, rhs, gs, bias, activation):
    z = jax.lax.ragged_dot(lhs, rhs, gs, preferred_element_type=jnp.float32)
    if bias is not None:
        ends = jnp.cumsum(gs)
        gid = jnp.searchsorted(ends, jnp.arange(lhs.shape[0]), side="right")
        rows = jnp.concatenate([bias, jnp.zeros_like(bias[:1])])[jnp.minimum(gid, bias.shape[0])]
        z = z + rows
    return apply_activation(activation, z)


GROUPS = jnp.array([3, 0, 5, 2], jnp.int32)  # 10 of 12 rows: the last two are in no group


# (the plain product and gelu with the bias; the rest are sweeps)
@pytest.mark.parametrize("activation, with_bias", [
    pytest.param(a, b, id=f"{b}-{a}", marks=() if (a, b) in ((None, False), ("gelu", True)) else pytest.mark.sweep)
    for b in (False, True) for a in ACTS])
def test_ragged_values_and_grads(activation, with_bias):
    lhs, rhs, bias = _data((12, 6), (4, 6, 8), (4, 8))
    bias = bias if with_bias else None
    f = lambda x, w, c: jax_cute.ragged_dot(x, w, GROUPS, bias=c, activation=activation)  # noqa: E731
    got = jax.jit(f)(lhs, rhs, bias)
    want = _ragged_ref(lhs, rhs, GROUPS, bias, activation)
    _close(got, want)
    assert not np.asarray(got[10:]).any()  # rows past the groups stay zero
    args = (lhs, rhs, bias) if with_bias else (lhs, rhs)
    g = (lambda x, w, c: f(x, w, c)) if with_bias else (lambda x, w: f(x, w, None))
    check_grads(jax.jit(g), args, order=1)
    check_grads(jax.jit(g), args, order=2, modes=("rev",))


def test_ragged_vmap_and_grad():
    lhs, rhs, bias = _data((3, 12, 6), (4, 6, 8), (3, 4, 8))
    f = lambda x, c: jnp.sum(jax_cute.ragged_dot(x, rhs, GROUPS, bias=c, activation="swiglu") ** 2)  # noqa: E731
    r = lambda x, c: jnp.sum(_ragged_ref(x, rhs, GROUPS, c, "swiglu") ** 2)  # noqa: E731
    got = jax.jit(jax.vmap(jax.grad(f, argnums=(0, 1))))(lhs, bias)
    for i in range(3):  # (lax.ragged_dot's own vmap rule stops at this product)
        for g, w in zip(got, jax.grad(r, argnums=(0, 1))(lhs[i], bias[i])):
            _close(g[i], w)


# (gelu with the first mapping and the most permuted one, gated swiglu with the first; the rest
# are sweeps, CI's second step)
@pytest.mark.parametrize("activation, axes", [
    pytest.param(a, ax, id=f"axes{i}-{a}", marks=() if (a, i) in (("gelu", 0), ("gelu", 3), ("swiglu", 0)) else pytest.mark.sweep)
    for i, ax in enumerate([(0, None, None, None), (0, 0, None, 0), (None, 0, 0, None), (1, 2, 0, 1), (0, None, 0, "none")])
    for a in ("gelu", "silu", "swiglu")])
def test_ragged_vmap_stays_one_primitive(activation, axes):
    """A vmapped axis becomes a batch mode of the fused primitive (the epilogue stays with the
    product, where the kernel runs it), whichever operands it maps over, group sizes and bias
    included; values and gradients equal the unfused expression per batch."""
    shapes = {0: (3, 12, 6), None: (12, 6), 1: (12, 3, 6)}
    lhs = _data(shapes[axes[0]])[0]
    rhs = _data((4, 6, 8) if axes[1] is None else (4, 6, 3, 8) if axes[1] == 2 else (3, 4, 6, 8), seed=1)[0]
    gs = GROUPS if axes[2] is None else jnp.array([[3, 0, 5, 2], [0, 12, 0, 0], [1, 1, 1, 1]], jnp.int32)
    bias_ax = None if axes[3] == "none" else axes[3]
    bias = None if axes[3] == "none" else _data({None: (4, 8), 0: (3, 4, 8), 1: (4, 3, 8)}[bias_ax], seed=2)[0]
    f = lambda x, w, g, c: jax_cute.ragged_dot(x, w, g, bias=c, activation=activation)  # noqa: E731
    vf = jax.vmap(f, in_axes=axes[:3] + (bias_ax,))
    eqns = jax.make_jaxpr(vf)(lhs, rhs, gs, bias).eqns
    assert [e.primitive.name for e in eqns if e.primitive.name.startswith("jax_cute")] == ["jax_cute_ragged_fused"]
    take = lambda x, ax, i: x if ax is None or x is None else jnp.take(x, i, axis=ax)  # noqa: E731
    got = jax.jit(vf)(lhs, rhs, gs, bias)
    loss = lambda x, w, c: jnp.sum(jnp.sin(vf(x, w, gs, c)))  # noqa: E731
    want_loss = lambda x, w, c: sum(  # noqa: E731
        jnp.sum(jnp.sin(_ragged_ref(take(x, axes[0], i), take(w, axes[1], i), take(gs, axes[2], i),
                                    take(c, bias_ax, i), activation))) for i in range(3))
    argnums = (0, 1) if bias is None else (0, 1, 2)
    grads = jax.jit(jax.grad(loss, argnums=argnums))(lhs, rhs, bias)
    for i in range(3):
        _close(got[i], _ragged_ref(take(lhs, axes[0], i), take(rhs, axes[1], i), take(gs, axes[2], i),
                                   take(bias, bias_ax, i), activation))
    for g, w in zip(grads, jax.grad(want_loss, argnums=argnums)(lhs, rhs, bias)):
        _close(g, w)


def test_ragged_nested_vmap_with_bias():
    """Two vmapped axes, the bias mapped over the outer one only (extent 1 over the inner)."""
    lhs, rhs, bias = _data((2, 3, 12, 6), (4, 6, 8), (2, 4, 8))
    f = lambda x, c: jax_cute.ragged_dot(x, rhs, GROUPS, bias=c, activation="gelu")  # noqa: E731
    vf = jax.vmap(jax.vmap(f, in_axes=(0, None)))
    got = jax.jit(vf)(lhs, bias)
    for i in range(2):
        for j in range(3):
            _close(got[i, j], _ragged_ref(lhs[i, j], rhs, GROUPS, bias[i], "gelu"))
    grads = jax.jit(jax.grad(lambda x, c: jnp.sum(jnp.sin(vf(x, c))), argnums=(0, 1)))(lhs, bias)
    want = jax.grad(lambda x, c: sum(jnp.sum(jnp.sin(_ragged_ref(x[i, j], rhs, GROUPS, c[i], "gelu")))
                                     for i in range(2) for j in range(3)), argnums=(0, 1))(lhs, bias)
    for g, w in zip(grads, want):
        _close(g, w)


# -- dot_general and einsum ---------------------------------------------------------------------

PROJ = (((2,), (0,)), ((), ()))  # x (B, T, D) . w (D, H, K) -> (B, T, H, K): two rhs free dims


@pytest.mark.parametrize("activation, bias_shape", crossed((None, "relu", "gelu", "gelu_exact", "silu"),
                                                         [None, (3, 4), (1, 1, 3, 4), (2, 5, 3, 4), (5, 1, 1)]))
def test_dot_general_epilogue(activation, bias_shape):
    x, w = _data((2, 5, 7), (7, 3, 4))
    bias = None if bias_shape is None else _data(bias_shape, seed=5)[0]
    f = jax.jit(lambda x, w, c: jax_cute.dot_general(x, w, PROJ, bias=c, activation=activation))
    z = jax.lax.dot_general(x, w, PROJ, precision="highest") + (0 if bias is None else bias)
    _close(f(x, w, bias), apply_activation(activation, z))


@pytest.mark.parametrize("activation", ("gelu", "swiglu"))
def test_dot_general_epilogue_check_grads(activation):
    x, w = _data((2, 5, 7), (7, 3, 4) if activation == "gelu" else (7, 8))
    dn = PROJ if activation == "gelu" else (((2,), (0,)), ((), ()))
    bias, = _data(w.shape[1:], seed=5)
    check_grads(jax.jit(lambda x, w, c: jax_cute.dot_general(x, w, dn, bias=c, activation=activation)), (x, w, bias),
                order=2, modes=("rev",), atol=2e-2, rtol=2e-2)


def test_einsum_epilogue_in_the_output_order():
    """An attention-score einsum written straight into (b, h, t, s), with a (t, s) bias (a mask)
    broadcast over b and h; then under vmap and grad."""
    q, k = _data((2, 6, 3, 4), (2, 5, 3, 4))
    mask, = _data((6, 5), seed=9)
    spec = "bthd,bshd->bhts"
    f = lambda q, k, m: jax_cute.einsum(spec, q, k, bias=m, activation="silu")  # noqa: E731
    want = lambda q, k, m: jax.nn.silu(jnp.einsum(spec, q, k, precision="highest") + m)  # noqa: E731
    _close(jax.jit(f)(q, k, mask), want(q, k, mask))
    _close(jax.jit(jax.vmap(f, in_axes=(0, 0, None)))(q[None].repeat(2, 0), k[None].repeat(2, 0), mask),
           jax.vmap(want, in_axes=(0, 0, None))(q[None].repeat(2, 0), k[None].repeat(2, 0), mask))
    loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)  # noqa: E731
    for g, h in zip(jax.grad(loss(f), argnums=(0, 1, 2))(q, k, mask), jax.grad(loss(want), argnums=(0, 1, 2))(q, k, mask)):
        _close(g, h, 1e-4)


def test_einsum_swiglu_and_diagonal():
    x, w = _data((2, 5, 7), (7, 8))
    z = jnp.einsum("btd,dn->btn", x, w, precision="highest") + 0.5
    _close(jax_cute.einsum("btd,dn->btn", x, w, bias=jnp.float32(0.5), activation="swiglu"),
           jax.nn.silu(z[..., :4]) * z[..., 4:])
    d, v = _data((2, 3, 3), (2, 3, 4))
    got = jax_cute.einsum("bii,bij->bj", d, v, bias=jnp.ones((4,)), activation="relu")
    _close(got, jax.nn.relu(jnp.einsum("bii,bij->bj", d, v, precision="highest") + 1))


@pytest.mark.parametrize("call, match", [
    (lambda x, w: jax_cute.dot_general(x, w, PROJ, activation="swiglu"), "swiglu needs the product's last axis"),
    (lambda x, w: jax_cute.einsum("btd,dhk->bkth", x, w, activation="swiglu"), "swiglu needs the product's last"),
    (lambda x, w: jax_cute.einsum("btd,dhk->bthk", x, w, bias=jnp.zeros((3,))), r"bias of shape \(3,\) does not"),
    (lambda x, w: jax_cute.dot_general(x, w, PROJ, activation="elu"), "unknown activation 'elu'"),
    (lambda x, w: jax_cute.einsum("bii,bij->bj", x[:, :2, :2], w[:2, :2], bias=jnp.zeros((3,))), "does not broadcast"),
])
def test_dot_general_and_einsum_bad_epilogues(call, match):
    x, w = jnp.zeros((2, 5, 7)), jnp.zeros((7, 3, 4))
    with pytest.raises(ValueError, match=match):
        jax.jit(call).trace(x, w)


# -- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, match", [
    (dict(activation="tanh"), ValueError, "unknown activation 'tanh'"),
    (dict(bias=jnp.zeros((7,))), ValueError, r"bias of shape \(7,\) does not broadcast to the product's shape \(9, 8\)"),
    (dict(bias=jnp.zeros((1, 9, 8))), ValueError, r"bias of shape \(1, 9, 8\) does not broadcast"),
    (dict(bias=jnp.zeros((8,), jnp.int32)), TypeError, "bias must be a real floating array"),
    (dict(activation="relu", preferred_element_type=jnp.int32), TypeError, "real floating output dtype"),
])
def test_matmul_bad_input(kwargs, error, match):
    a, b = jnp.zeros((9, 7)), jnp.zeros((7, 8))
    with pytest.raises(error, match=match):
        jax.jit(functools.partial(jax_cute.matmul, **kwargs)).trace(a, b)


@pytest.mark.parametrize("bias_shape", [(), (9, 1), (1, 8), (1, 1)])
def test_matmul_bias_broadcasts_like_numpy(bias_shape):
    a, b = _data((2, 9, 7), (7, 8))
    bias, = _data(bias_shape, seed=3)
    got = jax.jit(lambda a, b, c: jax_cute.matmul(a, b, bias=c, activation="gelu"))(a, b, bias)
    _close(got, unfused(a, b, bias, "gelu"))
    g = jax.grad(lambda c: jnp.sum(jax_cute.matmul(a, b, bias=c, activation="gelu") ** 2))(bias)
    want = jax.grad(lambda c: jnp.sum(unfused(a, b, c, "gelu") ** 2))(bias)
    assert g.shape == bias_shape
    _close(g, want, 1e-4)


def test_swiglu_needs_even_n():
    with pytest.raises(ValueError, match="swiglu needs an even N.*N=7"):
        jax_cute.matmul(jnp.zeros((3, 4)), jnp.zeros((4, 7)), activation="swiglu")
    with pytest.raises(ValueError, match="swiglu needs an even N"):
        jax_cute.ragged_dot(jnp.zeros((3, 4)), jnp.zeros((2, 4, 5)), jnp.array([1, 2]), activation="swiglu")


def test_ragged_bad_input():
    x, w, gs = jnp.zeros((3, 4)), jnp.zeros((2, 4, 6)), jnp.array([1, 2])
    with pytest.raises(ValueError, match=r"bias must have shape \(G, N\) = \(2, 6\), got \(6,\)"):
        jax_cute.ragged_dot(x, w, gs, bias=jnp.zeros((6,)))
    with pytest.raises(ValueError, match="unknown activation 'elu'"):
        jax_cute.ragged_dot(x, w, gs, activation="elu")


# -- the plain path and the CUDA lowering --------------------------------------------------------

def test_plain_calls_keep_the_plain_primitive():
    a, b = jnp.zeros((4, 5)), jnp.zeros((5, 6))
    text = str(jax.make_jaxpr(jax_cute.matmul)(a, b))
    assert "jax_cute_matmul[" in text and "fused" not in text
    text = str(jax.make_jaxpr(lambda a, b: jax_cute.matmul(a, b, activation="relu"))(a, b))
    assert "jax_cute_matmul_fused" in text


def lowered(f, *shapes, dtype=jnp.bfloat16) -> str:
    args = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    with config.override(target_arch="sm_90a"):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_cuda_lowering_xla_epilogue_is_logged(caplog):
    """swiglu with N/2 = 100 (off the kernels' 64-column pairing grid) runs the GEMM kernel,
    float32 out, then the XLA epilogue, and says why."""
    f = lambda a, b, c: jax_cute.matmul(a, b, bias=c, activation="swiglu")  # noqa: E731
    with caplog.at_level(logging.INFO, logger="jax_cute"):
        text = lowered(f, (256, 128), (128, 200), (200,))
    assert text.count("stablehlo.custom_call @jax_cute_launch") == 1
    assert "dot_general" not in text
    assert any("epilogue in XLA" in r.getMessage() and "blocks of 64" in r.getMessage() for r in caplog.records)


@pytest.mark.sweep   # (15-22 s of compiles; CI's second step: the README's line stays under 10 min)
def test_cuda_lowering_of_a_fused_einsum(caplog):
    """A projection into heads with a per-(head, column) bias: one kernel with the epilogue
    inside, and three under grad."""
    f = lambda x, w, c: jax_cute.einsum("btd,dhk->bthk", x, w, bias=c, activation="gelu")  # noqa: E731
    with caplog.at_level(logging.INFO, logger="jax_cute"):
        text = lowered(f, (2, 256, 128), (128, 4, 64), (4, 64))
    assert text.count("stablehlo.custom_call @jax_cute_launch") == 1 and "dot_general" not in text
    assert not any("epilogue in XLA" in r.getMessage() for r in caplog.records)
    loss = lambda x, w, c: jnp.sum(f(x, w, c).astype(jnp.float32))  # noqa: E731
    text = lowered(jax.grad(loss, argnums=(0, 1, 2)), (2, 256, 128), (128, 4, 64), (4, 64))
    assert text.count("stablehlo.custom_call @jax_cute_launch") == 3 and "dot_general" not in text


@pytest.mark.sweep   # (16 s: CI's second step, so the README's test line stays under 10 minutes)
def test_cuda_lowering_of_gradients():
    """Forward with the pre-activation, then two gradient GEMMs: three kernel launches."""
    f = lambda a, b, c: jnp.sum(jax_cute.matmul(a, b, bias=c, activation="gelu").astype(jnp.float32))  # noqa: E731
    text = lowered(jax.grad(f, argnums=(0, 1, 2)), (256, 128), (128, 256), (256,))
    assert text.count("stablehlo.custom_call @jax_cute_launch") == 3
    assert "dot_general" not in text


@pytest.mark.parametrize("name", jax_cute.activations.names(gated=False))
def test_the_gpu_tests_float64_reference_knows_every_activation(name):
    """The GPU tests check the kernels against their own float64 activations: a new registry
    entry without one there fails them all on the GPU only, so it is caught here."""
    from test_gpu_fused import _act64

    z = np.linspace(-3, 3, 61)
    y, dy = _act64(name, z)
    want_y = apply_activation(name, jnp.asarray(z, jnp.float32))
    want_dy = jax.vmap(jax.grad(lambda t: apply_activation(name, t)))(jnp.asarray(z, jnp.float32))
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dy, want_dy, rtol=1e-5, atol=1e-6)
