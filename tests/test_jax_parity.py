"""JAX's own dot, dot_general, matmul, einsum and ragged_dot cases (after jax-ml/jax's
tests/lax_test.py, lax_numpy_test.py and lax_numpy_einsum_test.py) with our functions in place
of JAX's: the same values, dtypes and exception types, with x64 off and on.

Every case runs on the reference path (CPU), which is what a GPU falls back to; the kernels'
numerics are the GPU tests' business.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cute

NARROW = [np.bool_, np.int8, np.uint8, np.int32, np.uint32, jnp.float16, jnp.bfloat16, np.float32, np.complex64]
WIDE = [np.int64, np.uint64, np.float64, np.complex128]   # only with x64


@pytest.fixture(params=[False, True], ids=["x32", "x64"])
def x64(request):
    with jax.enable_x64(request.param):
        yield request.param


def rand(shape, dtype, seed=0):
    """Small values (exact in every dtype's products), signed where the dtype is."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return jnp.asarray(rng.random(shape) > 0.5)
    if dtype.kind in "iu":
        lo = 0 if dtype.kind == "u" else -4
        return jnp.asarray(rng.integers(lo, 5, shape), dtype)
    x = rng.standard_normal(shape)
    if dtype.kind == "c":
        x = x + 1j * rng.standard_normal(shape)
    return jnp.asarray(x.astype(np.complex128 if dtype.kind == "c" else np.float64)).astype(dtype)


def tol(dtype) -> float:
    d = np.dtype(dtype)
    if d.kind in "biu":
        return 0.0
    per_component = d.itemsize // 2 if d.kind == "c" else d.itemsize
    return {1: 0.25, 2: 2e-2, 4: 1e-5, 8: 1e-12}[per_component]


def assert_same(got, want, dtype=None):
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    t = tol(dtype or want.dtype)
    g, w = np.asarray(got), np.asarray(want)
    if w.dtype.kind not in "biufc" or w.dtype == np.float16:   # bf16, fp8: compare in float32
        g, w = g.astype(np.float32), w.astype(np.float32)
    if t == 0:
        np.testing.assert_array_equal(g, w)
    else:
        np.testing.assert_allclose(g, w, rtol=t, atol=t)


def both(ours, theirs, *args):
    """Our result and JAX's, or the same exception type from both."""
    try:
        want = theirs(*args)
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        with pytest.raises(type(e)):
            ours(*args)
        return None, None
    return ours(*args), want


# -- lax.dot_general (lax_test.py: testDot, testDotGeneralContractAndBatch, testDotPreferredElement)

DOT_GENERAL = [
    ((3,), (3,), (((0,), (0,)), ((), ()))),
    ((4, 3), (3,), (((1,), (0,)), ((), ()))),
    ((4, 3), (3, 6), (((1,), (0,)), ((), ()))),
    ((3, 4), (3, 6), (((0,), (0,)), ((), ()))),
    ((3, 3, 2), (3, 2, 4), (((2,), (1,)), ((0,), (0,)))),
    ((3, 4, 2, 4), (3, 4, 3, 2), (((2,), (3,)), ((0, 1), (0, 1)))),
    ((4, 5, 3), (3, 2, 5), (((1, 2), (2, 0)), ((), ()))),
    ((2, 3), (3, 2), (((), ()), ((), ()))),                          # an outer product
]


@pytest.mark.parametrize("dtype", NARROW + WIDE, ids=lambda d: np.dtype(d).name)
def test_dot_general_every_dtype(dtype, x64):
    if dtype in WIDE and not x64:
        pytest.skip("64-bit dtypes need x64")
    for sa, sb, dn in DOT_GENERAL:
        a, b = rand(sa, dtype), rand(sb, dtype, 1)
        got, want = both(lambda x, y: jax_cute.dot_general(x, y, dn, precision="highest"),
                         lambda x, y: jax.lax.dot_general(x, y, dn, precision="highest"), a, b)
        if want is not None:
            assert_same(got, want)


PREFERRED = [(np.int8, np.int32), (np.int8, np.float32), (np.int32, np.float32), (jnp.bfloat16, np.float32),
             (jnp.float16, np.float32), (np.float32, jnp.bfloat16), (np.bool_, np.int32),
             (np.int32, np.int64), (np.uint32, np.uint64), (np.float32, np.float64), (jnp.bfloat16, np.float64),
             (np.complex64, np.complex128), (np.int16, np.int64)]


@pytest.mark.parametrize("dtype,pet", PREFERRED, ids=lambda d: np.dtype(d).name)
def test_preferred_element_type_accumulates_there(dtype, pet, x64):
    """lax accumulates in preferred_element_type: int32 -> int64 at K = 4096 is exact, f32 -> f64
    is float64 accuracy (with x64 off, the 64-bit type is canonicalized to 32 bits as lax does)."""
    k = 4096
    big = np.dtype(dtype).kind in "iu" and np.dtype(dtype).itemsize == 4
    a = jnp.asarray(np.full((2, k), 2**20 if big else 1), dtype) if big else rand((2, k), dtype)
    b = jnp.asarray(np.full((k, 3), 2**20 if big else 1), dtype) if big else rand((k, 3), dtype, 1)
    dn = (((1,), (0,)), ((), ()))
    got, want = both(lambda x, y: jax_cute.dot_general(x, y, dn, preferred_element_type=pet),
                     lambda x, y: jax.lax.dot_general(x, y, dn, preferred_element_type=pet), a, b)
    if want is None:
        return
    assert_same(got, want, np.float64 if np.dtype(want.dtype) == np.float64 else None)
    got = jax_cute.matmul(a, b, preferred_element_type=pet)
    assert_same(got, jnp.matmul(a, b, preferred_element_type=pet))
    got = jax_cute.einsum("ik,kj->ij", a, b, preferred_element_type=pet)
    assert_same(got, jnp.einsum("ik,kj->ij", a, b, preferred_element_type=pet))


def test_uint64_is_summed_in_uint64():
    with jax.enable_x64(True):
        a, b = jnp.asarray([2**40, 1], jnp.uint64), jnp.asarray([1, 1], jnp.uint64)
        assert int(jax_cute.dot_general(a, b, (((0,), (0,)), ((), ())))) == 2**40 + 1
        assert int(jax_cute.matmul(a, b)) == 2**40 + 1
        assert int(jax_cute.einsum("i,i->", a, b)) == 2**40 + 1


MIXED = [np.bool_, np.int8, np.uint8, np.int32, jnp.float16, jnp.bfloat16, np.float32, jnp.float8_e4m3fn,
         jnp.float8_e5m2]


@pytest.mark.parametrize("lhs", MIXED, ids=lambda d: np.dtype(d).name)
def test_dot_general_mixed_dtypes_follow_lax(lhs, x64):
    """lax.dot_general's own dtype rule (not jnp's promotion): e4m3fn x e5m2 computes, f16 x bf16
    gives bf16, and strict promotion raises nothing lax does not."""
    dn = (((1,), (0,)), ((), ()))
    for rhs in MIXED:
        a, b = rand((3, 8), lhs), rand((8, 2), rhs, 1)
        for promotion in ("standard", "strict"):
            with jax.numpy_dtype_promotion(promotion):
                got, want = both(lambda x, y: jax_cute.dot_general(x, y, dn),
                                 lambda x, y: jax.lax.dot_general(x, y, dn), a, b)
            if want is not None:
                assert got.dtype == want.dtype, (lhs, rhs)
                np.testing.assert_allclose(np.float32(got), np.float32(want), rtol=0.25, atol=0.25)


# -- jnp.matmul (lax_numpy_test.py: testMatmul) ---------------------------------------------------

MATMUL = [((3,), (3,)), ((2, 3), (3,)), ((3,), (3, 4)), ((2, 3), (3, 4)), ((1, 2, 3), (3, 4)),
          ((2, 1, 3, 4), (5, 4, 2)), ((3, 2, 4), (3, 4, 5)), ((3, 4), (1, 4, 5)), ((2, 3, 4), (4,)),
          ((4,), (2, 4, 3)), ((3, 0), (0, 2)), ((0, 3), (3, 2))]


@pytest.mark.parametrize("dtypes", [(np.float32, np.float32), (jnp.bfloat16, jnp.bfloat16), (np.int32, np.int32),
                                    (np.bool_, np.bool_), (np.complex64, np.complex64), (jnp.bfloat16, jnp.float16),
                                    (np.int8, np.float32), (np.uint8, np.int8)], ids=str)
def test_matmul_shapes_and_dtypes(dtypes, x64):
    for sa, sb in MATMUL:
        a, b = rand(sa, dtypes[0]), rand(sb, dtypes[1], 1)
        got, want = both(lambda x, y: jax_cute.matmul(x, y, precision="highest"),
                         lambda x, y: jnp.matmul(x, y, precision="highest"), a, b)
        if want is not None:
            assert_same(got, want)


# -- jnp.einsum (lax_numpy_einsum_test.py) ---------------------------------------------------------

DASK = ["abc,bad->abcd", "abcdef,bcdfg->abcdeg", "ea,fb,abcd,gc,hd->efgh", "ab,b", "aa", "a,a->", "a,a->a", "a,a",
        "a,b", "a,b,c", "a", "ba,b", "ba,b->", "defab,fedbc->defac", "ab...,bc...->ac...", "a...a", "abc...->cba...",
        "...ab->...a", "a...a->a...", "...abc,...abcd->...d", "ab...,b->ab...", "aa->a", "ab,ab,c->c", "aab,bc->ac",
        "aab,bcc->ac", "fdf,cdd,ccd,afe->ae", "fff,fae,bef,def->abd"]


def _dask_operands(einstr, dtype):
    ins = einstr.split("->")[0].split(",")
    dims = itertools.cycle([2, 3, 4])
    sizes = defaultdict(lambda: next(dims))
    return [rand(tuple(sizes[c] for c in names.replace("...", "01")), dtype, i) for i, names in enumerate(ins)]


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.complex64, np.bool_], ids=lambda d: np.dtype(d).name)
def test_einsum_dask_cases(dtype, x64):
    for einstr in DASK:
        ops = _dask_operands(einstr, dtype)
        assert_same(jax_cute.einsum(einstr, *ops, precision="highest"),
                    jnp.einsum(einstr, *ops, precision="highest"))


EINSUM = [("i,j,k->ijk", [(3,), (4,), (5,)]), ("ij,j->i", [(3, 4), (4,)]), ("ijk,j->i", [(3, 4, 5), (4,)]),
          ("iji,i->j", [(3, 4, 3), (3,)]), ("ij,ij->", [(3, 4), (3, 4)]), ("nij,jk->nik", [(10, 2, 3), (3, 4)]),
          ("sa,shb->shab", [(2, 1), (2, 3, 4)]), ("ijk->kij", [(3, 4, 5)]), ("...ijk->...ki", [(2, 3, 4, 5)]),
          ("iijkk->ik", [(3, 3, 5, 4, 4)]), ("ij...,jk...->ik...", [(2, 3, 5, 1), (3, 4, 5, 1)]),
          ("ijj,k->ik", [(2, 3, 3), (4,)]), ("ij,ij,jk->ik", [(2, 3), (2, 3), (3, 4)]),
          ("ijkl,ijml->ijkm", [(1, 8, 20, 4), (1, 8, 20, 4)]), ("cij,cjk->cik", [(3, 4, 5), (3, 1, 6)]),
          ("cij,cjk->cik", [(1, 4, 5), (3, 5, 6)]), ("cij,cjk->cik", [(1, 4, 5), (3, 1, 6)]),
          ("...ij,...j", [(2, 1, 3, 3), (2, 4, 3)]), ("bij,bjk->bik", [(1, 2, 3), (4, 3, 5)]),
          ("ntk,kd,dc->nc", [(2, 6, 5), (5, 4), (4, 3)])]


@pytest.mark.parametrize("spec,shapes", EINSUM, ids=[s for s, _ in EINSUM])
def test_einsum_cases_and_gradients(spec, shapes, x64):
    ops = [rand(s, np.float32, i) for i, s in enumerate(shapes)]
    assert_same(jax_cute.einsum(spec, *ops, precision="highest"), jnp.einsum(spec, *ops, precision="highest"))
    grad = lambda f: jax.grad(lambda *xs: jnp.sum(jnp.sin(f(spec, *xs, precision="highest"))),  # noqa: E731
                              tuple(range(len(ops))))(*ops)
    for g, w in zip(grad(jax_cute.einsum), grad(jnp.einsum)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("optimize", [True, False, "optimal", "auto", "greedy", "eager"], ids=str)
def test_einsum_optimize_modes(optimize):
    for spec, shapes in [("i->", [(3,)]), ("ii->i", [(4, 4)]), ("ij,jk", [(3, 4), (4, 3)]),
                         ("ij,jkl,klm", [(2, 2), (2, 3, 4), (3, 4, 2)])]:
        ops = [rand(s, np.float32, i) for i, s in enumerate(shapes)]
        np.testing.assert_allclose(jax_cute.einsum(spec, *ops, optimize=optimize), np.einsum(spec, *ops),
                                   rtol=1e-4, atol=1e-4)
    ops = [rand(s, np.float32) for s in [(2, 2), (2, 3, 4), (3, 4, 2)]]
    path, _ = jnp.einsum_path("ij,jkl,klm", *ops, optimize=optimize)
    np.testing.assert_allclose(jax_cute.einsum("ij,jkl,klm", *ops, optimize=path), np.einsum("ij,jkl,klm", *ops),
                               rtol=1e-4, atol=1e-4)


def test_einsum_errors_are_jnp_s():
    arrs = [rand(s, np.float32) for s in [(2, 3), (2, 4), (2, 5)]]
    with pytest.raises(NotImplementedError, match="3 or more operands"):
        jax_cute.einsum("ij,ik,il->jkl", *arrs, optimize=[(0, 1, 2)])
    with pytest.raises(ValueError, match="Precision"):
        jax_cute.einsum("ij,ik->jk", *arrs[:2], precision="bogus")


def test_einsum_sums_keep_the_dtype():
    """An index only one operand has is summed in that operand's dtype, as jnp does (bool stays
    bool, int8 wraps), not widened by jnp.sum."""
    b = jnp.ones((2, 1), bool)
    assert_same(jax_cute.einsum("ba,b->", b, jnp.ones((2,), bool)), jnp.einsum("ba,b->", b, jnp.ones((2,), bool)))
    i8 = jnp.full((2, 20), 10, jnp.int8)
    assert_same(jax_cute.einsum("ba,b->b", i8, jnp.ones((2,), jnp.int8)),
                jnp.einsum("ba,b->b", i8, jnp.ones((2,), jnp.int8)))


def test_einsum_inf_nan_on_a_diagonal():
    x = jnp.asarray([[[np.inf, np.inf], [1.0, 1.0]]])
    np.testing.assert_array_equal(jax_cute.einsum("baa->ba", x), np.einsum("baa->ba", np.asarray(x)))


@pytest.mark.parametrize("lhs", MIXED[:7], ids=lambda d: np.dtype(d).name)
def test_einsum_mixed_precision(lhs, x64):
    for rhs in MIXED[:7]:
        a, b = rand((10,), lhs), rand((10,), rhs, 1)
        got, want = both(lambda x, y: jax_cute.einsum("a,a->a", x, y), lambda x, y: jnp.einsum("a,a->a", x, y), a, b)
        if want is not None:
            assert_same(got, want)


# -- lax.ragged_dot (lax_test.py: testRaggedDot) --------------------------------------------------

@pytest.mark.parametrize("dtype,pet", [(np.float32, None), (jnp.bfloat16, None), (jnp.float16, np.float32),
                                       (np.int8, np.int32), (np.int32, np.int64), (np.float32, np.float64),
                                       (np.complex64, None)], ids=str)
def test_ragged_dot_dtypes(dtype, pet, x64):
    rng = np.random.default_rng(3)
    for m, k, n, g in [(5, 1, 1, 1), (50, 4, 10, 3), (100, 8, 6, 5), (64, 16, 2, 4)]:
        cuts = np.sort(rng.integers(0, m + 1, g - 1))
        gs = jnp.asarray(np.diff(np.concatenate([[0], cuts, [m]])), jnp.int32)
        a, b = rand((m, k), dtype), rand((g, k, n), dtype, 1)
        got, want = both(lambda x, y: jax_cute.ragged_dot(x, y, gs, preferred_element_type=pet),
                         lambda x, y: jax.lax.ragged_dot(x, y, gs, preferred_element_type=pet), a, b)
        if want is not None:
            assert_same(got, want)
