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


def x64_cases(narrow, wide, both=()):
    """(case, x64) pairs: 32-bit cases with x64 off, 64-bit ones with it on, ``both`` both ways
    (x64 changes what 64-bit types and requests canonicalize to, not 32-bit products)."""
    return ([(c, False) for c in list(narrow) + list(both)] + [(c, True) for c in list(wide) + list(both)])


def _name(c) -> str:
    return "-".join(np.dtype(d).name if d is not None else "None" for d in (c if isinstance(c, tuple) else (c,)))


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
    return check_all([(ours, theirs, args)])[0]


def check_all(cases, compare=None) -> list:
    """For each (ours, theirs, args): the same exception type from both when traced, else our
    result and JAX's, each side compiled once for all cases (compiles dominate the runtime).
    With ``compare``, each pair is checked with it (default ``assert_same``)."""
    ok = []
    for ours, theirs, args in cases:
        try:
            jax.eval_shape(theirs, *args)
        except Exception as e:  # noqa: BLE001 - the type is what is compared
            with pytest.raises(type(e)):
                jax.eval_shape(ours, *args)
            continue
        ok.append((ours, theirs, args))
    run = lambda k: jax.jit(lambda xs: [c[k](*a) for c, a in zip(ok, xs)])([c[2] for c in ok])  # noqa: E731
    got, want = run(0), run(1)
    for g, w in zip(got, want):
        (compare or assert_same)(g, w)
    out, it = [], iter(zip(got, want))
    for case in cases:
        out.append(next(it) if any(case is c for c in ok) else (None, None))
    return out


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


@pytest.mark.parametrize("dtype,x64", x64_cases(NARROW[1:5] + NARROW[6:8], WIDE, [np.bool_, jnp.float16, np.complex64]),
                         ids=lambda c: _name(c) if not isinstance(c, bool) else ("x64" if c else "x32"))
def test_dot_general_every_dtype(dtype, x64):
    with jax.enable_x64(x64):
        _dot_general_cases(dtype)


def _dot_general_cases(dtype):
    check_all([(lambda x, y, dn=dn: jax_cute.dot_general(x, y, dn, precision="highest"),
                lambda x, y, dn=dn: jax.lax.dot_general(x, y, dn, precision="highest"),
                (rand(sa, dtype), rand(sb, dtype, 1))) for sa, sb, dn in DOT_GENERAL])


PREFERRED = [(np.int8, np.int32), (np.int8, np.float32), (np.int32, np.float32), (jnp.bfloat16, np.float32),
             (jnp.float16, np.float32), (np.float32, jnp.bfloat16), (np.bool_, np.int32),
             (np.int32, np.int64), (np.uint32, np.uint64), (np.float32, np.float64), (jnp.bfloat16, np.float64),
             (np.complex64, np.complex128), (np.int16, np.int64)]


@pytest.mark.parametrize("case,x64", x64_cases(PREFERRED[:7], [], PREFERRED[7:]),
                         ids=lambda c: _name(c) if not isinstance(c, bool) else ("x64" if c else "x32"))
def test_preferred_element_type_accumulates_there(case, x64):
    with jax.enable_x64(x64):
        _preferred_case(*case)


def _preferred_case(dtype, pet):
    """lax accumulates in preferred_element_type: int32 -> int64 at K = 4096 is exact, f32 -> f64
    is float64 accuracy (with x64 off, the 64-bit type is canonicalized to 32 bits as lax does)."""
    k = 4096
    big = np.dtype(dtype).kind in "iu" and np.dtype(dtype).itemsize == 4
    a = jnp.asarray(np.full((2, k), 2**20 if big else 1), dtype) if big else rand((2, k), dtype)
    b = jnp.asarray(np.full((k, 3), 2**20 if big else 1), dtype) if big else rand((k, 3), dtype, 1)
    dn = (((1,), (0,)), ((), ()))
    check_all([(lambda x, y: jax_cute.dot_general(x, y, dn, preferred_element_type=pet),
                lambda x, y: jax.lax.dot_general(x, y, dn, preferred_element_type=pet), (a, b)),
               (lambda x, y: jax_cute.matmul(x, y, preferred_element_type=pet),
                lambda x, y: jnp.matmul(x, y, preferred_element_type=pet), (a, b)),
               (lambda x, y: jax_cute.einsum("ik,kj->ij", x, y, preferred_element_type=pet),
                lambda x, y: jnp.einsum("ik,kj->ij", x, y, preferred_element_type=pet), (a, b))])


def test_uint64_is_summed_in_uint64():
    with jax.enable_x64(True):
        a, b = jnp.asarray([2**40, 1], jnp.uint64), jnp.asarray([1, 1], jnp.uint64)
        assert int(jax_cute.dot_general(a, b, (((0,), (0,)), ((), ())))) == 2**40 + 1
        assert int(jax_cute.matmul(a, b)) == 2**40 + 1
        assert int(jax_cute.einsum("i,i->", a, b)) == 2**40 + 1


MIXED = [np.bool_, np.int8, np.uint8, np.int32, jnp.float16, jnp.bfloat16, np.float32, jnp.float8_e4m3fn,
         jnp.float8_e5m2]


@pytest.mark.parametrize("lhs", MIXED, ids=lambda d: np.dtype(d).name)
def test_dot_general_mixed_dtypes_follow_lax(lhs):
    """lax.dot_general's own dtype rule (not jnp's promotion): e4m3fn x e5m2 computes, f16 x bf16
    gives bf16, and strict promotion (which lax ignores) raises nothing lax does not."""
    dn = (((1,), (0,)), ((), ()))

    def close(got, want):
        assert got.dtype == want.dtype
        np.testing.assert_allclose(np.float32(got), np.float32(want), rtol=0.25, atol=0.25)

    with jax.numpy_dtype_promotion("strict"):
        check_all([(lambda x, y: jax_cute.dot_general(x, y, dn), lambda x, y: jax.lax.dot_general(x, y, dn),
                    (rand((3, 8), lhs), rand((8, 2), rhs, 1))) for rhs in MIXED], close)


# -- jnp.matmul (lax_numpy_test.py: testMatmul) ---------------------------------------------------

MATMUL = [((3,), (3,)), ((2, 3), (3,)), ((3,), (3, 4)), ((2, 3), (3, 4)), ((1, 2, 3), (3, 4)),
          ((2, 1, 3, 4), (5, 4, 2)), ((3, 2, 4), (3, 4, 5)), ((3, 4), (1, 4, 5)), ((2, 3, 4), (4,)),
          ((4,), (2, 4, 3)), ((3, 0), (0, 2)), ((0, 3), (3, 2))]


@pytest.mark.parametrize("dtypes,x64", [((np.float32, np.float32), False), ((np.float32, np.float32), True),
                                        ((jnp.bfloat16, jnp.bfloat16), False), ((np.int32, np.int32), True),
                                        ((np.bool_, np.bool_), False), ((np.complex64, np.complex64), True),
                                        ((jnp.bfloat16, jnp.float16), False), ((np.int8, np.float32), True),
                                        ((np.uint8, np.int8), False)], ids=str)
def test_matmul_shapes_and_dtypes(dtypes, x64):
    with jax.enable_x64(x64):
        _matmul_shapes(dtypes)


def _matmul_shapes(dtypes):
    check_all([(lambda x, y: jax_cute.matmul(x, y, precision="highest"),
                lambda x, y: jnp.matmul(x, y, precision="highest"), (rand(sa, dtypes[0]), rand(sb, dtypes[1], 1)))
               for sa, sb in MATMUL])


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


# (bool and int32: sweeps, CI's second step)
@pytest.mark.parametrize("dtype,x64", [(np.float32, False), pytest.param(np.bool_, False, marks=pytest.mark.sweep),
                                       pytest.param(np.int32, True, marks=pytest.mark.sweep), (np.complex64, True)], ids=str)
def test_einsum_dask_cases(dtype, x64):
    with jax.enable_x64(x64):
        check_all([(lambda *xs, e=e: jax_cute.einsum(e, *xs, precision="highest"),
                    lambda *xs, e=e: jnp.einsum(e, *xs, precision="highest"), _dask_operands(e, dtype))
                   for e in DASK])


EINSUM = [("i,j,k->ijk", [(3,), (4,), (5,)]), ("ij,j->i", [(3, 4), (4,)]), ("ijk,j->i", [(3, 4, 5), (4,)]),
          ("iji,i->j", [(3, 4, 3), (3,)]), ("ij,ij->", [(3, 4), (3, 4)]), ("nij,jk->nik", [(10, 2, 3), (3, 4)]),
          ("sa,shb->shab", [(2, 1), (2, 3, 4)]), ("ijk->kij", [(3, 4, 5)]), ("...ijk->...ki", [(2, 3, 4, 5)]),
          ("iijkk->ik", [(3, 3, 5, 4, 4)]), ("ij...,jk...->ik...", [(2, 3, 5, 1), (3, 4, 5, 1)]),
          ("ijj,k->ik", [(2, 3, 3), (4,)]), ("ij,ij,jk->ik", [(2, 3), (2, 3), (3, 4)]),
          ("ijkl,ijml->ijkm", [(1, 8, 20, 4), (1, 8, 20, 4)]), ("cij,cjk->cik", [(3, 4, 5), (3, 1, 6)]),
          ("cij,cjk->cik", [(1, 4, 5), (3, 5, 6)]), ("cij,cjk->cik", [(1, 4, 5), (3, 1, 6)]),
          ("...ij,...j", [(2, 1, 3, 3), (2, 4, 3)]), ("bij,bjk->bik", [(1, 2, 3), (4, 3, 5)]),
          ("ntk,kd,dc->nc", [(2, 6, 5), (5, 4), (4, 3)])]


# (float32 operands: x64 changes none of it; with x64 on, a sweep)
@pytest.mark.parametrize("x64", [False, pytest.param(True, marks=pytest.mark.sweep)], ids=["x32", "x64"], indirect=True)
def test_einsum_cases_and_gradients(x64):
    def value_and_grads(f, spec):
        def run(*xs):
            loss = lambda *ys: jnp.sum(jnp.sin(f(spec, *ys, precision="highest")))  # noqa: E731
            return f(spec, *xs, precision="highest"), jax.grad(loss, tuple(range(len(xs))))(*xs)
        return run

    def close(got, want):
        assert_same(got[0], want[0])
        for g, w in zip(got[1], want[1]):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)

    check_all([(value_and_grads(jax_cute.einsum, spec), value_and_grads(jnp.einsum, spec),
                [rand(s, np.float32, i) for i, s in enumerate(shapes)]) for spec, shapes in EINSUM], close)


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
def test_einsum_mixed_precision(lhs):
    check_all([(lambda x, y: jax_cute.einsum("a,a->a", x, y), lambda x, y: jnp.einsum("a,a->a", x, y),
                (rand((10,), lhs), rand((10,), rhs, 1))) for rhs in MIXED[:7]])


# -- lax.ragged_dot (lax_test.py: testRaggedDot) --------------------------------------------------

@pytest.mark.parametrize("case,x64", x64_cases([(jnp.bfloat16, None), (jnp.float16, np.float32), (np.int8, np.int32),
                                                (np.complex64, None)], [],
                                               [(np.float32, None), (np.int32, np.int64), (np.float32, np.float64)]),
                         ids=lambda c: _name(c) if not isinstance(c, bool) else ("x64" if c else "x32"))
def test_ragged_dot_dtypes(case, x64):
    with jax.enable_x64(x64):
        _ragged_cases(*case)


def _ragged_cases(dtype, pet):
    rng = np.random.default_rng(3)
    # lax.ragged_dot does not canonicalize a 64-bit preferred_element_type under x32 (it fails
    # to lower); ours gives the 32-bit type, as lax.dot_general does
    lax_pet = None if pet is None else jax.dtypes.canonicalize_dtype(pet)
    cases = []
    for m, k, n, g in [(5, 1, 1, 1), (50, 4, 10, 3), (100, 8, 6, 5), (64, 16, 2, 4)]:
        cuts = np.sort(rng.integers(0, m + 1, g - 1))
        gs = jnp.asarray(np.diff(np.concatenate([[0], cuts, [m]])), jnp.int32)
        cases.append((lambda x, y, s: jax_cute.ragged_dot(x, y, s, preferred_element_type=pet),
                      lambda x, y, s: jax.lax.ragged_dot(x, y, s, preferred_element_type=lax_pet),
                      (rand((m, k), dtype), rand((g, k, n), dtype, 1), gs)))
    check_all(cases)


# -- weak types (Python scalars, and arithmetic on them) -------------------------------------------

def weak(value, shape=()):
    """A weakly typed array, as a Python scalar and arithmetic on one give."""
    return jnp.broadcast_to(jnp.asarray(value), shape)


def types(tree):
    """(dtype, weak type, shape) of every leaf."""
    return [(np.dtype(a.dtype).name, a.weak_type, tuple(a.shape)) for a in jax.tree.leaves(tree)]


# (name, operand): strong arrays, weak arrays of every rank, Python scalars
OPERANDS = {r: [(np.dtype(d).name, lambda d=d, s=(3,) * r: rand(s, d)) for d in (jnp.bfloat16, np.float32, np.int32)]
            + [(f"weak {type(v).__name__}", lambda v=v, s=(3,) * r: weak(v, s)) for v in (1.5, 2, 1 + 2j)]
            for r in (1, 2, 3)}
OPERANDS[0] = [("weak float", lambda: weak(1.5)), ("float", lambda: 1.5), ("int", lambda: 2),
               ("bfloat16", lambda: rand((), jnp.bfloat16)), ("float32", lambda: rand((), np.float32))]

# (ours, JAX's, ranks of the operands)
WEAK_PRODUCTS = [
    ("matmul", lambda x, y, p: jax_cute.matmul(x, y, preferred_element_type=p),
     lambda x, y, p: jnp.matmul(x, y, preferred_element_type=p), [(1, 1), (2, 2), (2, 1), (3, 2)]),
    ("dot_general", lambda x, y, p: jax_cute.dot_general(x, y, (((x.ndim - 1,), (0,)), ((), ())),
                                                         preferred_element_type=p),
     lambda x, y, p: jax.lax.dot_general(x, y, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=p),
     [(1, 1), (2, 2), (2, 1)]),
    ("outer", lambda x, y, p: jax_cute.dot_general(x, y, (((), ()), ((), ())), preferred_element_type=p),
     lambda x, y, p: jax.lax.dot_general(x, y, (((), ()), ((), ())), preferred_element_type=p), [(0, 2), (2, 0)]),
    ("einsum", lambda x, y, p: jax_cute.einsum("...i,i...->...", x, y, preferred_element_type=p),
     lambda x, y, p: jnp.einsum("...i,i...->...", x, y, preferred_element_type=p), [(1, 1), (2, 2), (3, 1)]),
    ("einsum scale", lambda x, y, p: jax_cute.einsum(",ij->ij", x, y, preferred_element_type=p),
     lambda x, y, p: jnp.einsum(",ij->ij", x, y, preferred_element_type=p), [(0, 2)]),
]


def _weak_cases():
    for name, ours, theirs, ranks in WEAK_PRODUCTS:
        for ra, rb in ranks:
            for (na, a), (nb, b) in itertools.product(OPERANDS[ra], OPERANDS[rb]):
                if not ("weak" in na + nb or isinstance(a(), (int, float)) or isinstance(b(), (int, float))):
                    continue   # strong x strong: the other tests' business
                yield f"{name}-{na}-{nb}-r{ra}{rb}", ours, theirs, a, b


WEAK_CASES = list(_weak_cases())


def _floats(*xs) -> tuple[int, ...]:
    return tuple(i for i, x in enumerate(xs) if jnp.issubdtype(jnp.result_type(x), jnp.inexact))


def _grad(f, argnums):
    return jax.grad(lambda *xs: jnp.sum(f(*xs)).real.astype(np.float32), argnums)


# every case with and without preferred_element_type=float32 and x64 (weak types under x64:
# test_weak_types_eager_and_jit, test_ragged_dot_weak_types): sweeps (CI's second step; 12 s a case)
@pytest.mark.parametrize("pet", [None, np.float32], ids=["default", "f32"])
@pytest.mark.parametrize("x64", [False, True], ids=["x32", "x64"], indirect=True)
@pytest.mark.sweep
def test_weak_types_are_jax_s(x64, pet):
    """Result dtype and weak type as JAX's (traced, under vmap and grad) for weakly typed
    operands: a weak operand does not widen a strong one (bf16 @ weak float is bf16), an int
    array times a weak float is a weak float, weak times weak is weak."""
    for case, ours, theirs, a, b in WEAK_CASES:
        x, y = a(), b()
        traced = [lambda f: jax.eval_shape(lambda u, v: f(u, v, pet), x, y)]
        if jnp.ndim(x) and jnp.ndim(y):
            traced.append(lambda f: jax.eval_shape(jax.vmap(lambda u, v: f(u, v, pet)), jnp.stack([x, x]),
                                                   jnp.stack([y, y])))
        if _floats(x, y):
            traced.append(lambda f: jax.eval_shape(_grad(lambda u, v: f(u, v, pet), _floats(x, y)), x, y))
        for run in traced:
            try:
                want = types(run(theirs))
            except Exception as e:  # noqa: BLE001 - the type is what is compared
                with pytest.raises(type(e)):
                    run(ours)
                continue
            assert types(run(ours)) == want, case


def test_weak_types_eager_and_jit(x64):
    """The same, run eagerly and under jit, values included."""
    cases = [(lambda x, y: jax_cute.matmul(x, y), jnp.matmul, (weak(1.5, (2, 3)), weak(2.0, (3, 4)))),
             (lambda x, y: jax_cute.matmul(x, y), jnp.matmul, (rand((2, 3), jnp.bfloat16), weak(2.0, (3,)))),
             (lambda x, y: jax_cute.matmul(x, y), jnp.matmul, (rand((2, 3), np.int32), weak(0.5, (3, 2)))),
             (lambda x, y: jax_cute.einsum("ij,jk", x, y), lambda x, y: jnp.einsum("ij,jk", x, y),
              (weak(1.5, (2, 3)), weak(2, (3, 4)))),
             (lambda x, y: jax_cute.einsum(",ij", x, y), lambda x, y: jnp.einsum(",ij", x, y),
              (weak(3.0), rand((2, 3), jnp.bfloat16))),
             (lambda x, y: jax_cute.dot_general(x, y, (((1,), (0,)), ((), ()))),
              lambda x, y: jax.lax.dot_general(x, y, (((1,), (0,)), ((), ()))), (weak(1.5, (2, 3)), weak(2.0, (3,))))]
    for ours, theirs, args in cases:
        for run in (lambda f: f(*args), lambda f: jax.jit(f)(*args)):
            got, want = run(ours), run(theirs)
            assert types(got) == types(want)
            assert_same(got, want)


@pytest.mark.parametrize("lhs,rhs", [("weak", "weak"), ("weak", "strong"), ("strong", "weak")])
def test_ragged_dot_weak_types(x64, lhs, rhs):
    """lax.ragged_dot's result is never weak (its group sizes are strong), but its dtype
    follows the weak operand's: bf16 x weak float is f32 in lax, as its dtype rule gives."""
    x = weak(1.5, (6, 4)) if lhs == "weak" else rand((6, 4), jnp.bfloat16)
    w = weak(0.5, (2, 4, 3)) if rhs == "weak" else rand((2, 4, 3), jnp.bfloat16, 1)
    gs = jnp.asarray([2, 3], jnp.int32)
    for pet in (None, np.float32):
        def run(f, xs):
            return f(*xs, gs, preferred_element_type=pet)
        got, want = run(jax_cute.ragged_dot, (x, w)), run(jax.lax.ragged_dot, (x, w))
        assert types(got) == types(want)
        assert_same(got, want)
        grads = [jax.eval_shape(jax.grad(lambda *xs: jnp.sum(run(f, xs)).astype(np.float32), (0, 1)), x, w)
                 for f in (jax_cute.ragged_dot, jax.lax.ragged_dot)]
        assert types(grads[0]) == types(grads[1])
