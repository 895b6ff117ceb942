"""jax_cute.matmul on the CPU (reference path, which reads buffers through the layouts)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_cute

RNG = np.random.default_rng(1234)


def rand(shape, dtype=np.float32):
    return jnp.asarray(RNG.standard_normal(shape).astype(np.float32)).astype(dtype)


def ref_matmul(a, b, ta=False, tb=False, pet=None):
    a = jnp.swapaxes(a, -1, -2) if ta else a
    b = jnp.swapaxes(b, -1, -2) if tb else b
    return jnp.matmul(a.astype(np.float32), b.astype(np.float32)).astype(pet or a.dtype)


TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 2e-3}


@pytest.mark.parametrize("sa,sb", [
    ((7, 5), (5, 3)), ((1, 9), (9, 1)), ((4, 7, 5), (5, 3)), ((7, 5), (4, 5, 3)),
    ((2, 1, 7, 5), (3, 5, 6)), ((5,), (5, 3)), ((7, 5), (5,)), ((5,), (5,)), ((3, 0, 4), (4, 2)),
])
def test_matches_jnp_matmul(sa, sb):
    a, b = rand(sa), rand(sb)
    out = jax.jit(jax_cute.matmul)(a, b)
    want = jnp.matmul(a, b)
    assert out.shape == want.shape and out.dtype == want.dtype
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ta,tb", list(itertools.product([False, True], repeat=2)))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_transposes_and_dtypes(ta, tb, dtype):
    m, n, k = 13, 6, 9
    a = rand((3, k, m) if ta else (3, m, k), dtype)
    b = rand((n, k) if tb else (k, n), dtype)
    out = jax_cute.matmul(a, b, transpose_a=ta, transpose_b=tb)
    want = ref_matmul(a, b, ta, tb)
    assert out.dtype == dtype
    np.testing.assert_allclose(out.astype(np.float32), want.astype(np.float32), rtol=TOL[dtype], atol=TOL[dtype] * 4)


def test_integer_inputs_are_exact():
    a = jnp.asarray(RNG.integers(-3, 4, (6, 5)), jnp.int32)
    b = jnp.asarray(RNG.integers(-3, 4, (5, 4)), jnp.int32)
    np.testing.assert_array_equal(jax_cute.matmul(a, b), jnp.matmul(a, b))


def test_preferred_element_type_and_mixed_precision_gradient():
    a, b = rand((8, 16), jnp.bfloat16), rand((16, 4), jnp.bfloat16)
    out = jax_cute.matmul(a, b, preferred_element_type=jnp.float32)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, ref_matmul(a, b, pet=jnp.float32), rtol=1e-2, atol=1e-2)
    ga, gb = jax.grad(lambda a, b: jax_cute.matmul(a, b, preferred_element_type=jnp.float32).sum(), (0, 1))(a, b)
    assert ga.dtype == jnp.bfloat16 and gb.dtype == jnp.bfloat16
    # The f32 cotangent is rounded once to bf16 (documented); here it is all ones, so exact.
    np.testing.assert_allclose(ga.astype(np.float32), jnp.broadcast_to(b.astype(np.float32).sum(1), (8, 16)),
                               rtol=1e-2, atol=1e-2)


AXES = [0, 1, 2, None]


@pytest.mark.parametrize("ia,ib", [(x, y) for x in AXES for y in AXES if (x, y) != (None, None)])
@pytest.mark.parametrize("out_axis", [0, 2])
def test_vmap_every_axis(ia, ib, out_axis):
    bsz, m, k, n = 3, 5, 4, 6

    def batched(shape, axis):
        if axis is None:
            return rand(shape)
        return rand(shape[:axis] + (bsz,) + shape[axis:])

    a, b = batched((m, k), ia), batched((k, n), ib)
    ia2, ib2 = (ia if ia is None else min(ia, 2)), (ib if ib is None else min(ib, 2))
    f = jax.vmap(jax_cute.matmul, in_axes=(ia2, ib2), out_axes=out_axis)
    g = jax.vmap(jnp.matmul, in_axes=(ia2, ib2), out_axes=out_axis)
    np.testing.assert_allclose(jax.jit(f)(a, b), g(a, b), rtol=1e-5, atol=1e-5)


def test_nested_vmap_and_transposes():
    a, b = rand((4, 5, 3, 6)), rand((2, 6, 3, 4))  # batch axes sit at different places per level

    def f(x, y):
        return jax_cute.matmul(x, y, transpose_b=True)

    def g(x, y):
        return jnp.matmul(x, jnp.swapaxes(y, -1, -2))

    inner = dict(in_axes=(1, 2))
    outer = dict(in_axes=(0, 3))
    want = jax.vmap(jax.vmap(g, **inner), **outer)(a, b)
    got = jax.jit(jax.vmap(jax.vmap(f, **inner), **outer))(a, b)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# the test line keeps both transposed; the batched, broadcast, transposed case, the plain and the
# one-sided batched cases are sweeps (CI's second step)
@pytest.mark.parametrize("sa,sb,ta,tb", [
    ((4, 5), (3, 4), True, True),
    *(pytest.param(*p, marks=pytest.mark.sweep) for p in (
        ((2, 1, 5, 4), (3, 3, 4), False, True), ((5, 4), (4, 3), False, False), ((2, 5, 4), (4, 3), False, False),
        ((5, 4), (2, 4, 3), False, False))),
])
def test_gradients_to_second_order(sa, sb, ta, tb):
    a, b = rand(sa), rand(sb)
    check_grads(lambda x, y: jax_cute.matmul(x, y, transpose_a=ta, transpose_b=tb), (a, b), order=2,
                modes=("fwd", "rev"), atol=2e-2, rtol=2e-2)
    ga = jax.grad(lambda x, y: (jax_cute.matmul(x, y, transpose_a=ta, transpose_b=tb) ** 2).sum(), (0, 1))(a, b)
    gr = jax.grad(lambda x, y: (ref_matmul(x, y, ta, tb) ** 2).sum(), (0, 1))(a, b)
    for x, y in zip(ga, gr):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)


def test_vmap_of_grad_and_grad_of_vmap():
    a, b = rand((3, 5, 4)), rand((3, 4, 2))
    loss = lambda x, y: jnp.sin(jax_cute.matmul(x, y)).sum()  # noqa: E731
    ref = lambda x, y: jnp.sin(jnp.matmul(x, y)).sum()  # noqa: E731
    vg = jax.jit(jax.vmap(jax.grad(loss, (0, 1))))(a, b)
    vr = jax.vmap(jax.grad(ref, (0, 1)))(a, b)
    gv = jax.grad(lambda x, y: jax.vmap(loss)(x, y).sum(), (0, 1))(a, b)
    for x, y, z in zip(vg, vr, gv):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(z, y, rtol=1e-5, atol=1e-5)


def test_jvp_matches_jnp():
    a, b, da, db = rand((5, 4)), rand((4, 3)), rand((5, 4)), rand((4, 3))
    _, t = jax.jvp(jax_cute.matmul, (a, b), (da, db))
    _, tr = jax.jvp(jnp.matmul, (a, b), (da, db))
    np.testing.assert_allclose(t, tr, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_fp8_inputs_and_their_bf16_gradients(dtype):
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.integers(-4, 5, (40, 64)), dtype)
    w = jnp.asarray(rng.integers(-4, 5, (24, 64)), dtype)
    xf, wf = np.asarray(x, np.float32), np.asarray(w, np.float32)
    y = jax_cute.matmul(x, w, transpose_b=True, preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(np.asarray(y), xf @ wf.T)
    # the cotangent is rounded once to bf16 (not to fp8), the gradient GEMMs run in bf16 and
    # their results are rounded to the operand's fp8 dtype
    ct = rng.integers(-3, 4, (40, 24)).astype(np.float32) / 2   # exact sums: no order sensitivity
    gx, gw = jax.grad(lambda a, b: (jax_cute.matmul(a, b, transpose_b=True, preferred_element_type=jnp.float32)
                                    * ct).sum(), (0, 1))(x, w)
    ct16 = np.asarray(jnp.asarray(ct).astype(jnp.bfloat16), np.float32)

    def rounded(v):
        return np.asarray(jnp.asarray(v).astype(jnp.bfloat16).astype(dtype), np.float32)

    assert gx.dtype == dtype and gw.dtype == dtype
    np.testing.assert_array_equal(np.asarray(gx, np.float32), rounded(ct16 @ wf))
    np.testing.assert_array_equal(np.asarray(gw, np.float32), rounded(ct16.T @ xf))


@pytest.mark.parametrize("a,b,kw", [
    ((5, 4), (3, 2), {}),                              # K differs: TypeError, as jnp.matmul's
    ((), (3,), {}),                                    # a scalar: ValueError
    ((2, 5, 4), (3, 4, 2), {}),                        # batches do not broadcast: ValueError
    ((5, 4), (4, 2), {"precision": "bogus"}),          # lax's precision check, at trace time
    ((5, 4), (4, 2), {"preferred_element_type": "not a dtype"}),
])
def test_bad_input_raises_what_jnp_matmul_raises(a, b, kw):
    x, y = rand(a), rand(b)
    with pytest.raises(Exception) as want:
        jnp.matmul(x, y, **kw)
    with pytest.raises(type(want.value)):
        jax.eval_shape(lambda p, q: jax_cute.matmul(p, q, **kw), x, y)


def test_transpose_flags_must_be_bool():
    with pytest.raises(ValueError, match="transpose_a"):
        jax_cute.matmul(rand((3,)), rand((3, 2)), transpose_a=True)
    for bad in ("yes", 1, None, jnp.bool_(True)):
        with pytest.raises(TypeError, match="transpose_b must be a bool"):
            jax_cute.matmul(rand((3, 2)), rand((3, 2)), transpose_b=bad)
    a, b = rand((3, 2)), rand((3, 2))
    np.testing.assert_allclose(jax_cute.matmul(a, b, transpose_a=np.bool_(True)), a.T @ b, rtol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.complex64, jnp.bool_, jnp.int8, jnp.float64])
def test_dtypes_no_kernel_takes_match_jnp_matmul(dtype):
    """Complex, bool and integer products run (on the reference path, or XLA's fallback on a GPU)
    with jnp.matmul's result, dtype included."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((3, 5, 4)) + (1j * rng.standard_normal((3, 5, 4)) if dtype == jnp.complex64 else 0)
    b = rng.standard_normal((4, 6)) + (1j * rng.standard_normal((4, 6)) if dtype == jnp.complex64 else 0)
    if dtype == jnp.bool_:
        a, b = a > 0.5, b > 0.5
    with jax.enable_x64(dtype == jnp.float64):
        a, b = jnp.asarray(a, dtype), jnp.asarray(b, dtype)
        want, got = jnp.matmul(a, b), jax.jit(jax_cute.matmul)(a, b)
        assert got.dtype == want.dtype
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ours,ref,sa,sb", [
    (jax_cute.matmul, jnp.matmul, (256, 128), (4, 128, 64)),                     # a broadcast
    (jax.vmap(jax_cute.matmul, in_axes=(1, None)), jax.vmap(jnp.matmul, in_axes=(1, None)),
     (64, 4, 32), (32, 16)),                                                        # b broadcast
    (jax.vmap(jax_cute.matmul, in_axes=(None, 0)), jax.vmap(jnp.matmul, in_axes=(None, 0)),
     (64, 32), (3, 32, 16)),                                                        # a broadcast
])
def test_broadcast_operand_gradients_through_partials(ours, ref, sa, sb):
    """16-bit gradients of a batch-broadcast operand, summed from per-batch f32 partials."""
    a, b = rand(sa, jnp.bfloat16), rand(sb, jnp.bfloat16)
    ga, gb = jax.jit(jax.grad(lambda x, y: (ours(x, y).astype(jnp.float32) ** 2).sum(), (0, 1)))(a, b)
    ra, rb = jax.grad(lambda x, y: (ref(x, y) ** 2).sum(), (0, 1))(a.astype(jnp.float32), b.astype(jnp.float32))
    for x, y in ((ga, ra), (gb, rb)):
        assert x.dtype == jnp.bfloat16
        np.testing.assert_allclose(x.astype(np.float32), y, rtol=3e-2, atol=3e-2 * float(jnp.abs(y).max()))
