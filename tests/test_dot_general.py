"""jax_cute.dot_general and jax_cute.einsum on the CPU: lax's semantics and errors, layouts that
need no transpose, and the flat kernel problems they become."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_cute
from jax_cute import config
from jax_cute.primitives.dot_general import contraction_layouts
from jax_cute.problem.gemm_plan import flatten_gemm


def rand(shape, dtype=np.float32, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


DOT_GENERAL = [
    ((7, 3), (7, 5), (((0,), (0,)), ((), ()))),                       # dW = x^T dy
    ((4, 6, 5), (4, 5, 3), (((2,), (1,)), ((0,), (0,)))),             # batched matmul
    ((6, 4, 5), (5, 3, 4), (((2,), (0,)), ((1,), (2,)))),             # batch and contraction anywhere
    ((2, 3, 4, 5), (3, 5, 4, 6), (((2, 3), (2, 1)), ((1,), (0,)))),   # two contracting dims
    ((2, 3, 4), (3, 2, 5), (((), ()), ((0, 1), (1, 0)))),             # two batch dims, no contraction
    ((1, 7), (7, 1), (((1,), (0,)), ((), ()))),                       # extents of 1
    ((5,), (5,), (((0,), (0,)), ((), ()))),                           # a dot product
]


@pytest.mark.parametrize("sa,sb,dn", DOT_GENERAL)
def test_dot_general_matches_lax(sa, sb, dn):
    a, b = rand(sa), rand(sb, seed=1)
    want = jax.lax.dot_general(a, b, dn, precision="highest")
    got = jax.jit(lambda x, y: jax_cute.dot_general(x, y, dn))(a, b)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    check_grads(jax.jit(lambda x, y: jax_cute.dot_general(x, y, dn)), (a, b), order=2, modes=("rev",),
                atol=2e-2, rtol=2e-2)


def test_dot_general_under_vmap_and_preferred_type():
    a, b = rand((3, 5, 4), jnp.bfloat16), rand((4, 6), jnp.bfloat16, seed=1)
    dn = (((1,), (0,)), ((), ()))
    got = jax.vmap(lambda x: jax_cute.dot_general(x, b, dn, preferred_element_type=jnp.float32))(a)
    want = jax.vmap(lambda x: jax.lax.dot_general(x, b, dn, preferred_element_type=jnp.float32))(a)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dn,match", [
    ((((1,), (1,)), ((), ())), "contracting dimensions to have the same shape"),
    ((((1,), (0,)), ((0,), (0,))), "batch dimensions"),
    ((((2,), (0,)), ((), ())), "out of bounds|rank"),
    ((((1, 1), (0, 0)), ((), ())), "repeated|duplicate|distinct"),
])
def test_dot_general_errors_are_lax_errors(dn, match):
    a, b = rand((4, 5)), rand((5, 3))
    with pytest.raises(TypeError, match=match):
        jax.lax.dot_general(a, b, dn)
    with pytest.raises(TypeError, match=match):
        jax_cute.dot_general(a, b, dn)


EINSUMS = [
    ("bthd,bshd->bhts", (2, 5, 3, 4), (2, 6, 3, 4)),   # attention scores, written (b, h, t, s)
    ("bhts,bshd->bthd", (2, 3, 5, 6), (2, 6, 3, 4)),   # attention values, written (b, t, h, d)
    ("ij,jk", (3, 4), (4, 5)),
    ("ij,kj->ik", (3, 4), (5, 4)),
    ("...ij,...jk->...ik", (2, 3, 4), (2, 4, 5)),
    ("...ij,jk", (2, 3, 4), (4, 5)),
    ("bij,bjk->kib", (2, 3, 4), (2, 4, 5)),
    ("ij,jk->", (3, 4), (4, 5)),
    ("iaj,jk->ik", (3, 2, 4), (4, 5)),                  # 'a' only in one operand: summed first
    ("i,i->", (5,), (5,)),
    ("i,j->ij", (3,), (4,)),
]


@pytest.mark.parametrize("spec,sa,sb", EINSUMS)
def test_einsum_matches_jnp(spec, sa, sb):
    a, b = rand(sa), rand(sb, seed=1)
    want = jnp.einsum(spec, a, b, precision="highest")
    got = jax.jit(lambda x, y: jax_cute.einsum(spec, x, y))(a, b)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    gw = jax.grad(lambda x, y: (jnp.einsum(spec, x, y) ** 2).sum(), (0, 1))(a, b)
    gg = jax.grad(lambda x, y: (jax_cute.einsum(spec, x, y) ** 2).sum(), (0, 1))(a, b)
    for x, y in zip(gg, gw):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spec,sa,sb", [("ii,ij->j", (4, 4), (4, 3)), *(pytest.param(*p, marks=pytest.mark.sweep) for p in (   # (7-9 s)
                                             ("ii,ij->ij", (4, 4), (4, 3)), ("iji,jk->ik", (3, 2, 3), (2, 5))))])
def test_einsum_diagonal_is_masked_then_a_gemm(spec, sa, sb):
    """A repeated index within an operand is a diagonal: masked and summed as jnp.einsum does,
    and the product is still our GEMM (lowered for sm_90a: no XLA dot)."""
    a, b = rand(sa), rand(sb, seed=1)
    np.testing.assert_allclose(jax_cute.einsum(spec, a, b), jnp.einsum(spec, a, b), rtol=1e-5, atol=1e-5)
    args = [jax.ShapeDtypeStruct(sa, jnp.bfloat16), jax.ShapeDtypeStruct(sb, jnp.bfloat16)]
    with config.override(target_arch="sm_90a"):
        text = jax.jit(lambda x, y: jax_cute.einsum(spec, x, y)).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "jax_cute_launch" in text and "dot_general" not in text


@pytest.mark.parametrize("spec,shapes,error", [
    ("ij,jk,kl->il", [(3, 4), (4, 5)], ValueError),            # fewer operands than the subscripts name
    ("ijk,jk->i", [(3, 4), (4, 5)], ValueError),               # rank
    ("ij,kj->ik", [(3, 4), (4, 5)], ValueError),               # extents
    ("ij,jk->iz", [(3, 4), (4, 5)], ValueError),               # output index in no operand
])
def test_einsum_bad_subscripts_raise_what_jnp_raises(spec, shapes, error):
    args = [rand(s) for s in shapes]
    with pytest.raises(error) as want:
        jnp.einsum(spec, *args)
    with pytest.raises(error) as got:
        jax_cute.einsum(spec, *args)
    assert str(got.value) == str(want.value)


def test_attention_layouts_need_no_copy():
    """Both attention products keep q, k, v and the output where they lie: M, N and K are single
    strided modes and the batch is two modes (b, h) that the kernel takes as they are."""
    B, T, S, H, D = 2, 128, 64, 4, 64
    g, _ = contraction_layouts((B, T, H, D), (B, S, H, D), ([3], [3]), ([0, 2], [0, 2]), [0, 1, 2, 3])
    flat = flatten_gemm(g, ["bfloat16"] * 3)
    assert not isinstance(flat, str) and not flat.copies
    assert (flat.m, flat.n, flat.k, flat.l) == (T, S, D, B * H) and flat.batch_modes == 3
    assert flat.a.shape == (T, D, H, B, 1) and flat.a.stride[:4] == (H * D, 1, D, T * H * D)
    assert flat.c.shape == (T, S, H, B, 1) and flat.c.stride[:4] == (S, 1, T * S, H * T * S)
    # probabilities (b, h, t, s) times v (b, s, h, d) written as (b, t, h, d)
    g, _ = contraction_layouts((B, H, T, S), (B, S, H, D), ([3], [1]), ([0, 1], [0, 2]), [0, 2, 1, 3])
    flat = flatten_gemm(g, ["bfloat16"] * 3)
    assert not isinstance(flat, str) and not flat.copies and flat.b.major == "n"
    assert flat.c.shape == (T, D, H, B, 1) and flat.c.stride[:4] == (H * D, 1, D, T * H * D)


def test_one_batch_mode_keeps_the_rank_3_problem():
    """Products whose batch coalesces keep the one-batch-mode kernel problem."""
    g, _ = contraction_layouts((4, 16, 32), (4, 32, 24), ([2], [1]), ([0], [0]))
    flat = flatten_gemm(g, ["bfloat16"] * 3)
    assert flat.batch_modes == 1 and flat.a.shape == (16, 32, 4) and flat.c.stride == (24, 1, 16 * 24)


@pytest.mark.sweep   # (15-22 s of compiles; CI's second step: the README's line stays under 10 min)
def test_a_mode_listed_slowest_first_still_coalesces():
    """The output projection of attention, bthd,hde->bte: its weight gradient contracts (b, t)
    and its input gradient writes (h, d) sub-modes; whatever order autodiff lists them in, each
    mode is one contiguous run of memory, so the kernels take them without a copy."""
    spec = "bthd,hde->bte"
    f = jax.grad(lambda x, w: (jax_cute.einsum(spec, x, w).astype(jnp.float32) ** 2).sum(), (0, 1))
    args = [jax.ShapeDtypeStruct((2, 64, 4, 64), jnp.bfloat16), jax.ShapeDtypeStruct((4, 64, 256), jnp.bfloat16)]
    with config.override(target_arch="sm_90a", strict=True):
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @jax_cute_launch") == 3
    assert "stablehlo.transpose" not in text and "dot_general" not in text


def test_einsum_broadcasts_an_extent_1_index_as_jnp():
    a, b = rand((1, 2, 3)), rand((4, 3, 5), seed=1)
    got, want = jax_cute.einsum("bij,bjk->bik", a, b), jnp.einsum("bij,bjk->bik", a, b, precision="highest")
    assert got.shape == want.shape == (4, 2, 5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_einsum_of_three_operands_runs_each_product_on_our_kernel():
    spec, shapes = "ij,jk,kl->il", [(64, 32), (32, 48), (48, 16)]
    ops = [rand(s, seed=i) for i, s in enumerate(shapes)]
    np.testing.assert_allclose(jax_cute.einsum(spec, *ops), jnp.einsum(spec, *ops, precision="highest"),
                               rtol=1e-4, atol=1e-4)
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
    with config.override(target_arch="sm_90a", strict=True):
        text = jax.jit(lambda *xs: jax_cute.einsum(spec, *xs)).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @jax_cute_launch") == 2 and "dot_general" not in text


def test_einsum_sums_an_unshared_index_in_the_operand_dtype():
    """jnp.einsum sums 'a' (only in the first operand) with lax.reduce in the operand's dtype:
    bool stays bool (a logical or), int8 wraps; jnp.sum would widen both to int32."""
    for x, y, spec in ((jnp.ones((2, 1), bool), jnp.ones((2,), bool), "ba,b->"),
                       (jnp.full((2, 20), 10, jnp.int8), jnp.ones((2,), jnp.int8), "ba,b->b")):
        got, want = jax_cute.einsum(spec, x, y), jnp.einsum(spec, x, y)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_dot_general_uses_lax_s_dtype_rule_not_jnp_promotion():
    dn = (((1,), (0,)), ((), ()))
    a, b = jnp.ones((4, 8), jnp.float8_e4m3fn), jnp.ones((8, 2), jnp.float8_e5m2)
    got, want = jax_cute.dot_general(a, b, dn), jax.lax.dot_general(a, b, dn)
    assert got.dtype == want.dtype == jnp.float8_e5m2
    np.testing.assert_array_equal(np.float32(got), np.float32(want))
    with jax.numpy_dtype_promotion("strict"):
        got = jax_cute.dot_general(rand((4, 8)), rand((8, 2), jnp.bfloat16), dn)
    assert got.dtype == jax.lax.dot_general(rand((4, 8)), rand((8, 2), jnp.bfloat16), dn).dtype


@pytest.mark.parametrize("f", [lambda x, y: jax_cute.dot_general(x, y, (((1,), (0,)), ((), ())), precision="bogus"),
                               lambda x, y: jax_cute.einsum("ij,jk->ik", x, y, precision="bogus"),
                               lambda x, y: jax_cute.dot_general(x, y, (((1,), (0,)), ((), ())),
                                                                 preferred_element_type="bogus")],
                         ids=["dot_general", "einsum", "preferred_element_type"])
def test_bad_precision_is_a_trace_time_error(f):
    with pytest.raises((ValueError, TypeError)):
        jax.eval_shape(f, rand((4, 8)), rand((8, 2)))


@pytest.mark.parametrize("precision", [("highest", "default"), ["highest", "highest"], "float32",
                                       jax.lax.DotAlgorithmPreset.F32_F32_F32])
def test_every_precision_form_lax_takes(precision):
    a, b, dn = rand((8, 16)), rand((16, 4), seed=1), (((1,), (0,)), ((), ()))
    got = jax.jit(lambda x, y: jax_cute.dot_general(x, y, dn, precision=precision))(a, b)
    np.testing.assert_allclose(got, jax.lax.dot_general(a, b, dn, precision=precision), rtol=1e-6, atol=1e-6)
    got = jax_cute.ragged_dot(a, b[None], jnp.array([8]), precision=precision)
    np.testing.assert_allclose(got, jax.lax.ragged_dot(a, b[None], jnp.array([8]), precision=precision),
                               rtol=1e-6, atol=1e-6)


def test_wide_preferred_element_type_accumulates_in_it():
    """int32 -> int64 at K = 4096 with values 2**20: exact only if summed in int64, as lax does."""
    with jax.enable_x64(True):
        a, b = jnp.full((2, 4096), 2**20, jnp.int32), jnp.full((4096, 3), 2**20, jnp.int32)
        dn = (((1,), (0,)), ((), ()))
        got = jax_cute.dot_general(a, b, dn, preferred_element_type=jnp.int64)
        assert got.dtype == jnp.int64 and int(got[0, 0]) == 4096 * 2**40
        x, y = rand((2, 4096)), rand((4096, 3), seed=1)
        got = jax_cute.einsum("ik,kj->ij", x, y, preferred_element_type=jnp.float64)
        want = np.asarray(x, np.float64) @ np.asarray(y, np.float64)
        np.testing.assert_allclose(got, want, rtol=1e-12)
