"""CPU: jax_cute.ragged_dot (reference lowering) against jax.lax.ragged_dot and a float64 numpy
model of the documented bad-size rules, under jit, vmap and grad."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jax_cute import config
from jax_cute.primitives.ragged_dot import ragged_dot


def np_ragged_dot(x, w, gs) -> np.ndarray:
    """Documented semantics: negative sizes count as 0, group ends clipped at M, rest zero."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    ends = np.minimum(np.cumsum(np.maximum(np.asarray(gs, np.int64), 0)), x.shape[0])
    out = np.zeros((x.shape[0], w.shape[2]))
    for g, (s, e) in enumerate(zip(np.concatenate([[0], ends[:-1]]), ends)):
        out[s:e] = x[s:e] @ w[g]
    return out


def np_vjp(x, w, gs, ct) -> tuple[np.ndarray, np.ndarray]:
    """float64 gradients of the documented semantics: (d lhs, d rhs) for cotangent ``ct``."""
    x, w, ct = (np.asarray(a, np.float64) for a in (x, w, ct))
    ends = np.minimum(np.cumsum(np.maximum(np.asarray(gs, np.int64), 0)), x.shape[0])
    dx, dw = np.zeros_like(x), np.zeros_like(w)
    for g, (s, e) in enumerate(zip(np.concatenate([[0], ends[:-1]]), ends)):
        dx[s:e] = ct[s:e] @ w[g].T
        dw[g] = x[s:e].T @ ct[s:e]
    return dx, dw


def _data(m, k, g, n, dtype=jnp.float32, seed=0):
    # numpy data: no per-shape compilation of a random generator (keeps the file fast)
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((m, k)), dtype), jnp.asarray(rng.standard_normal((g, k, n)), dtype)


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
def test_bad_sizes_under_jit_documented(sizes):
    """Under jit the sizes are device values: negative ones count as zero, ends clip at M."""
    x, w = _data(10, 4, 3, 5)
    gs = jnp.asarray(sizes, jnp.int32)
    np.testing.assert_allclose(jax.jit(ragged_dot)(x, w, gs), np_ragged_dot(x, w, sizes), rtol=1e-5, atol=1e-5)
    # the gradients see the same clipped groups
    gx = jax.jit(jax.grad(lambda x, gs: ragged_dot(x, w, gs).sum()))(x, gs)
    np.testing.assert_allclose(gx, jax.grad(lambda x: jnp.sum(np_model_jnp(x, w, sizes)))(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bool_, jnp.complex64])
def test_dtypes_no_kernel_takes_match_lax(dtype):
    x, w = _data(10, 4, 3, 5)
    gs = jnp.asarray([3, 0, 6], jnp.int32)
    if dtype == jnp.bool_:
        x, w = x > 0, w > 0
    else:
        x, w = x.astype(dtype) * (1 + 1j), w.astype(dtype)
    want, got = jax.lax.ragged_dot(x, w, gs), jax.jit(ragged_dot)(x, w, gs)
    assert got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_concrete_negative_sizes_are_refused():
    """lax.ragged_dot lets the groups after a negative size overlap earlier rows; no kernel can,
    so concrete negative sizes are an error rather than a silently different result."""
    x, w = _data(10, 4, 3, 5)
    with pytest.raises(ValueError, match=r"negative group sizes \[3, -2, 5\]"):
        ragged_dot(x, w, jnp.asarray([3, -2, 5], jnp.int32))
    sizes = [3, 2, 9]  # past M: clipped exactly as lax.ragged_dot does
    np.testing.assert_allclose(ragged_dot(x, w, jnp.asarray(sizes, jnp.int32)),
                               jax.lax.ragged_dot(x, w, jnp.asarray(sizes, jnp.int32)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sizes,dtype", [([3, 2**32], np.int64), ([3, 4294967295], np.uint32), ([2**31], np.int64)])
def test_concrete_sizes_past_int32_are_refused(sizes, dtype):
    """Group sizes are counted in int32: a concrete size past it is an error at trace time,
    never truncated (2**32 to 0, 4294967295 to -1)."""
    x, w = _data(10, 4, len(sizes), 5)
    with pytest.raises(ValueError, match=r"do not fit int32"):
        ragged_dot(x, w, np.asarray(sizes, dtype))


def test_traced_wide_sizes_mean_the_same_rows():
    """Under jit an unsigned or 64-bit size past int32 is capped at M: the same rows as
    lax.ragged_dot gives it, not a wrapped-around small or negative size."""
    x, w = _data(10, 4, 2, 5)
    sizes = jnp.asarray([3, 4294967295], jnp.uint32)
    got = jax.jit(ragged_dot)(x, w, sizes)
    want = jax.lax.ragged_dot(x, w, jnp.asarray([3, 7], jnp.int32))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


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
        gs = jnp.asarray([2, 0, 4] if dtype == jnp.float32 else [5, 4, 0], jnp.int32)
        tol = 2e-2 if dtype == jnp.float32 else 1e-6
        # jitted: each transformation compiles once instead of dispatching op by op
        check_grads(jax.jit(lambda x, w: ragged_dot(x, w, gs)), (x, w), order=2, modes=("fwd", "rev"),
                    atol=tol, rtol=tol)


def _take(a, ax, i):
    return np.asarray(a) if ax is None else np.take(np.asarray(a), i, axis=ax)


def _batched_args(axes, b=3, m=9, k=4, g=3, n=5):
    x, w = _data(m, k, g, n)
    xb, wb = _data(b * m, k, b * g, n, seed=1)
    xb, wb = xb.reshape(b, m, k), wb.reshape(b, g, k, n)
    gsb = jnp.array([[3, 0, 5], [1, 6, 2], [9, -1, 4]], jnp.int32)  # the last: bad sizes
    gs = gsb[1]
    args = [xb if axes[0] is not None else x, wb if axes[1] is not None else w, gsb if axes[2] is not None else gs]
    return [a if ax in (None, 0) else jnp.moveaxis(a, 0, ax) for a, ax in zip(args, axes)]


AXES = [ax for ax in itertools.product((None, 0), repeat=3) if ax != (None, None, None)] + [(1, 2, 1), (2, None, 1)]


@pytest.mark.parametrize("axes", AXES)
def test_vmap_and_grad_of_vmap(axes):
    args = _batched_args(axes)
    ct = np.random.default_rng(5).standard_normal((3, 9, 5))
    out, vjp = jax.vjp(jax.jit(jax.vmap(ragged_dot, axes)), *args)
    dx, dw, _ = vjp(jnp.asarray(ct, jnp.float32))
    want_dx, want_dw = np.zeros(args[0].shape), np.zeros(args[1].shape)
    for i in range(3):
        x, w, gs = (_take(a, ax, i) for a, ax in zip(args, axes))
        np.testing.assert_allclose(out[i], np_ragged_dot(x, w, gs), rtol=1e-5, atol=1e-5)
        gx, gw = np_vjp(x, w, gs, ct[i])
        # a broadcast operand's gradient sums over the batch
        for want, got, ax in ((want_dx, gx, axes[0]), (want_dw, gw, axes[1])):
            if ax is None:
                want += got
            else:
                idx = [slice(None)] * want.ndim
                idx[ax] = i
                want[tuple(idx)] = got
    np.testing.assert_allclose(dx, want_dx, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-4, atol=1e-4)


def test_vmap_of_grad_and_nested():
    args = _batched_args((0, 0, 0))
    per = lambda x, w, g: jax.grad(lambda x, w: jnp.sum(jnp.sin(ragged_dot(x, w, g))), (0, 1))(x, w)  # noqa: E731
    per_l = lambda x, w, g: jax.grad(lambda x, w: jnp.sum(jnp.sin(jax.lax.ragged_dot(x, w, g))), (0, 1))(x, w)  # noqa: E731
    args[2] = args[2].at[2].set(jnp.array([4, 0, 4]))  # lax.ragged_dot leaves bad sizes undefined
    got = jax.jit(jax.vmap(per))(*args)
    for i in range(3):
        want = jax.jit(per_l)(args[0][i], args[1][i], args[2][i])
        for a, b in zip(got, want):
            np.testing.assert_allclose(a[i], b, rtol=1e-5, atol=1e-5)
    # nested vmap: two batch sub-modes
    x, w = _data(2 * 3 * 6, 4, 3, 5)
    gs = jnp.array([2, 1, 3], jnp.int32)
    got = jax.vmap(jax.vmap(ragged_dot, (0, None, None)), (0, None, None))(x.reshape(2, 3, 6, 4), w, gs)
    xs = np.asarray(x).reshape(6, 6, 4)
    np.testing.assert_allclose(got.reshape(6, 6, 5), np.stack([np_ragged_dot(xi, w, gs) for xi in xs]),
                               rtol=1e-5, atol=1e-5)


def test_bad_inputs():
    x, w = _data(8, 4, 2, 3)
    gs = jnp.array([4, 4], jnp.int32)
    # where lax.ragged_dot raises TypeError, so do we
    for args in ((x, jnp.ones((3, 4, 3)), gs), (x, jnp.ones((2, 5, 3)), gs), (x, w, gs.astype(jnp.float32))):
        with pytest.raises(TypeError):
            jax.lax.ragged_dot(*args)
        with pytest.raises(TypeError):
            ragged_dot(*args)
    for args in ((x[None], w, gs), (x, w, gs[None]), (x[:, :, None], w.reshape(2, 4, 3, 1), gs)):
        try:   # lax's own error where it has one; ValueError for shapes lax takes and we do not
            jax.eval_shape(jax.lax.ragged_dot, *args)
            error, match = ValueError, r"expected lhs \[M,K\]"
        except TypeError:
            error, match = TypeError, None  # the type is the contract; lax words its own message
        with pytest.raises(error, match=match):
            ragged_dot(*args)
    # other integer dtypes are used as int32
    np.testing.assert_allclose(ragged_dot(x, w, gs.astype(jnp.int16)), ragged_dot(x, w, gs))


@pytest.mark.parametrize("da,db,pet", [(jnp.bfloat16, jnp.float16, None), (jnp.float16, jnp.bfloat16, jnp.float32),
                                       (jnp.int8, jnp.float32, None)])
def test_result_dtype_and_conversions_are_lax_s(da, db, pet):
    """bf16 x f16: lax.ragged_dot converts both to bf16 (its dtype rule) and returns bf16."""
    x, w = _data(8, 4, 2, 3)
    gs = jnp.array([3, 5], jnp.int32)
    a, b = x.astype(da), w.astype(db)
    want = jax.lax.ragged_dot(a, b, gs, preferred_element_type=pet)
    got = ragged_dot(a, b, gs, preferred_element_type=pet)
    assert got.dtype == want.dtype
    np.testing.assert_allclose(np.float32(got), np.float32(want), rtol=1e-2, atol=1e-2)


def test_precision_is_validated_and_reaches_xla():
    x, w = _data(8, 4, 2, 3)
    gs = jnp.array([3, 5], jnp.int32)
    with pytest.raises(ValueError, match="Precision"):
        jax.eval_shape(lambda a, b: ragged_dot(a, b, gs, precision="bogus"), x, w)
    for kw in ({}, {"activation": "gelu"}):   # the plain and the fused epilogue's product
        text = jax.jit(lambda a, b: ragged_dot(a, b, gs, precision="highest", **kw)).lower(x, w).as_text()
        assert "HIGHEST" in text, kw
        grads = jax.jit(jax.grad(lambda a, b: ragged_dot(a, b, gs, precision="highest", **kw).sum(), (0, 1)))
        assert grads.lower(x, w).as_text().count("HIGHEST") >= 3, kw


def test_concrete_negative_sizes_closed_over_under_jit_are_refused():
    x, w = _data(10, 4, 3, 5)
    with pytest.raises(ValueError, match=r"negative group sizes \[3, -2, 5\]"):
        jax.jit(lambda a, b: ragged_dot(a, b, np.array([3, -2, 5], np.int32)))(x, w)
    with pytest.raises(ValueError, match="negative group sizes"):
        ragged_dot(x, w, [3, -2, 5])


def offset_model(x, w, sizes, offset):
    """group_offset's semantics in jnp: the rows of groups offset..offset+G-1 times rhs[0..G-1],
    every other row zero (ends clipped at M)."""
    ends = np.minimum(np.cumsum(np.maximum(np.asarray(sizes, np.int64), 0)), x.shape[0])
    starts = np.concatenate([[0], ends[:-1]])
    out = jnp.zeros((x.shape[0], w.shape[2]), x.dtype)
    for j in range(w.shape[0]):
        s, e = int(starts[offset + j]), int(ends[offset + j])
        out = out.at[s:e].set(jnp.dot(x[s:e], w[j], precision="highest"))
    return out


# (the other offsets and sizes are sweeps, run in CI's second step)
@pytest.mark.parametrize("sizes,offset", [([3, 2, 4, 1], 0), *(pytest.param(*p, marks=pytest.mark.sweep) for p in (
    ([3, 2, 4, 1], 1), ([3, 2, 4, 1], 2))), ([0, 5, 0, 9], 2), pytest.param([6, 6, 6, 6], 1, marks=pytest.mark.sweep)])
def test_group_offset_computes_the_local_groups_only(sizes, offset):
    """Expert parallelism: group_sizes counts every expert (4), rhs holds two of them."""
    x, w = _data(12, 4, 2, 5)
    gs = jnp.asarray(sizes, jnp.int32)
    want = offset_model(x, w, sizes, offset)
    f = jax.jit(lambda a, b, s, o: ragged_dot(a, b, s, group_offset=o))
    for off in (jnp.int32(offset), jnp.array([offset], jnp.int32)):
        np.testing.assert_allclose(f(x, w, gs, off), want, rtol=1e-5, atol=1e-5)
    # the gradients see the same groups
    ct = jnp.asarray(np.random.default_rng(1).standard_normal((12, 5)), jnp.float32)
    got = jax.vjp(lambda a, b: ragged_dot(a, b, gs, group_offset=offset), x, w)[1](ct)
    want = jax.vjp(lambda a, b: offset_model(a, b, sizes, offset), x, w)[1](ct)
    for g, h in zip(got, want):
        np.testing.assert_allclose(g, h, rtol=1e-5, atol=1e-5)


def test_group_offset_bad_values():
    x, w = _data(12, 4, 2, 5)
    gs = jnp.array([3, 2, 4, 1], jnp.int32)
    with pytest.raises(ValueError, match=r"outside \[0, 2\]"):
        ragged_dot(x, w, gs, group_offset=3)
    with pytest.raises(TypeError, match="integer"):
        ragged_dot(x, w, gs, group_offset=1.0)
    with pytest.raises(ValueError, match="at least G = 2"):
        ragged_dot(x, w, gs[:1], group_offset=0)
    # traced: clamped as lax.dynamic_slice clamps
    got = jax.jit(lambda o: ragged_dot(x, w, gs, group_offset=o))(jnp.int32(7))
    np.testing.assert_allclose(got, offset_model(x, w, [3, 2, 4, 1], 2), rtol=1e-5, atol=1e-5)


def _lowered_for_sm90(fn, *args) -> str:
    with config.override(target_arch="sm_90a", strict=True):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_group_offset_reaches_the_grouped_kernel():
    """Lowered for sm_90a: one launch of the grouped kernel with the offset's lead (the kernel
    compiled for it), its group sizes the lead and the 2 local groups' (3 sizes, from 8), no
    XLA dot and no pass zeroing rows afterwards; each gradient is one launch with the lead."""
    m, n = 256, 64
    args = [jax.ShapeDtypeStruct((m, 128), jnp.bfloat16), jax.ShapeDtypeStruct((2, 128, n), jnp.bfloat16),
            jax.ShapeDtypeStruct((8,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32)]
    text = _lowered_for_sm90(lambda a, b, s, o: ragged_dot(a, b, s, group_offset=o), *args)
    launches = [line for line in text.splitlines() if "stablehlo.custom_call @jax_cute_launch" in line]
    assert len(launches) == 1 and "dot_general" not in text
    assert "ragged_m_bfloat16_bfloat16_bfloat16_accfloat32_knn_lead" in launches[0]
    operands = f"(tensor<{m}x128xbf16>, tensor<2x128x{n}xbf16>, tensor<3xi32>)"
    assert launches[0].endswith(f"{operands} -> tensor<{m}x{n}xbf16>")
    assert f"tensor<{m}x{n}xi1>" not in text     # no select over the output

    def loss(a, b, s, o):
        return jnp.sum(ragged_dot(a, b, s, group_offset=o, preferred_element_type=jnp.float32))
    grads = _lowered_for_sm90(jax.grad(loss, (0, 1)), *args)
    launches = [line for line in grads.splitlines() if "stablehlo.custom_call @jax_cute_launch" in line]
    assert len(launches) == 2 and "dot_general" not in grads   # the lhs and rhs gradients
    assert all("_lead_" in line for line in launches)
    assert any("ragged_k_" in line for line in launches)


@pytest.mark.parametrize("offset", [0, 1, 2])
def test_group_offset_with_an_epilogue_and_vmap(offset):
    """The lead takes no bias (its rows stay zero through the activation), and a vmapped call
    keeps each batch's lead."""
    sizes = [3, 0, 4, 5]
    x, w = _data(12, 4, 2, 5)
    bias = jnp.asarray(np.random.default_rng(2).standard_normal((2, 5)), jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    got = jax.jit(lambda a, b, c: ragged_dot(a, b, gs, group_offset=offset, bias=c, activation="gelu"))(x, w, bias)
    prod = offset_model(x, w, sizes, offset)
    ends = np.minimum(np.cumsum(sizes), 12)
    rows = np.zeros((12, 5), np.float32)
    for j in range(2):
        rows[ends[offset + j] - sizes[offset + j]:ends[offset + j]] = bias[j]
    mask = np.zeros((12, 1), bool)
    for j in range(2):
        mask[ends[offset + j] - sizes[offset + j]:ends[offset + j]] = True
    want = jnp.where(mask, jax.nn.gelu(prod + rows), 0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    xs = jnp.stack([x, 2 * x])
    got = jax.vmap(lambda a: ragged_dot(a, w, gs, group_offset=offset))(xs)
    for i in range(2):
        np.testing.assert_allclose(got[i], offset_model(xs[i], w, sizes, offset), rtol=1e-5, atol=1e-5)
