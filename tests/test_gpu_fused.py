"""Fused epilogues on a Hopper GPU: every activation, with and without bias, odd sizes,
NaN-prefilled outputs, forward and gradients against a float64 host reference, every element.

Run: ``pytest -m gpu tests/test_gpu_fused.py`` (strict mode: a silent XLA fallback fails).
"""

from __future__ import annotations

import dataclasses
import math
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cute
from jax_cute import config
from jax_cute.kernels import sm90_gemm
from jax_cute.kernels.gemm_spec import GemmSpec
from jax_cute.primitives import fused, ragged_fused

pytestmark = pytest.mark.gpu

ACTS = (None, "relu", "gelu", "gelu_exact", "silu", "relu2", "swiglu")
# (M, K, N): odd extents (rows, an unaligned K and N that the plan pads, a 1-row product)
SIZES = [(257, 136, 392), (300, 100, 1002), (1, 64, 130)]


@pytest.fixture(autouse=True, scope="module")
def _hopper():
    cc = jax.devices()[0].compute_capability if jax.default_backend() == "gpu" else None
    if cc != "9.0":
        pytest.skip(f"needs a compute capability 9.0 GPU, got {cc}")


@pytest.fixture(autouse=True)
def _strict_and_nan_filled():
    # Strict: a fallback to XLA raises. NaN fill: an output element no kernel writes stays NaN.
    with config.override(strict=True, nan_fill=True):
        yield


def _rand(rng, shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def _act64(name, z):
    """The activation and its derivative in float64 (numpy), as jax.nn defines them."""
    if name is None:
        return z, np.ones_like(z)
    if name == "relu":
        return np.maximum(z, 0), (z > 0).astype(z.dtype)
    if name == "gelu":
        c = math.sqrt(2 / math.pi)
        t = np.tanh(c * (z + 0.044715 * z ** 3))
        return 0.5 * z * (1 + t), 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * c * (1 + 3 * 0.044715 * z * z)
    if name == "gelu_exact":
        erf = np.vectorize(math.erf, otypes=[np.float64])(z / math.sqrt(2))
        return 0.5 * z * (1 + erf), 0.5 * (1 + erf) + z * np.exp(-z * z / 2) / math.sqrt(2 * math.pi)
    if name == "silu":
        s = 1 / (1 + np.exp(-z))
        return z * s, s * (1 + z * (1 - s))
    if name == "relu2":
        return np.maximum(z, 0) ** 2, 2 * np.maximum(z, 0)
    raise ValueError(name)


def reference(a, b, bias, activation, r):
    """float64 forward y and, for the cotangent r of y, the gradients of a, b and bias."""
    z = a.astype(np.float64) @ b.astype(np.float64)
    if bias is not None:
        z = z + bias.astype(np.float64)
    if activation == "swiglu":
        h = z.shape[-1] // 2
        (sg, dsg), up = _act64("silu", z[:, :h]), z[:, h:]
        y = sg * up
        dz = np.concatenate([r * dsg * up, r * sg], axis=1)
    else:
        y, d = _act64(activation, z)
        dz = r * d
    return y, dz @ b.T.astype(np.float64), a.T.astype(np.float64) @ dz, dz.sum(0)


def assert_close(got, want, tol, what):
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert np.isfinite(got).all(), f"{what}: {np.count_nonzero(~np.isfinite(got))} non-finite elements"
    scale = max(np.abs(want).max(), 1e-30)
    err = np.abs(got - want) - tol * np.abs(want)
    worst = np.unravel_index(np.argmax(err), err.shape)
    assert err.max() <= tol * scale, (f"{what}: |got - want| {np.abs(got - want)[worst]:.3g} at {worst} "
                                      f"(want {want[worst]:.6g}, got {got[worst]:.6g}, scale {scale:.3g})")


def _compiled(f, *args) -> str:
    return jax.jit(f).lower(*args).compile().as_text()


def _no_xla_epilogue(text: str) -> None:
    """No HLO instruction of an activation (the names also occur in the text's stack traces)."""
    ops = re.findall(r"\b(logistic|tanh|exponential|erf)\(", text)
    assert not ops, ops


# every epilogue: each activation with and without bias, and bias alone (no epilogue at all is
# the plain kernel, tests/test_gpu_matmul.py; a skip would count as a failure under -m gpu)
EPILOGUES = [(a, b) for a in ACTS for b in (False, True) if a is not None or b]


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("activation, with_bias", EPILOGUES)
@pytest.mark.parametrize("size", SIZES)
def test_forward(size, activation, with_bias, out_dtype):
    m, k, n = size
    rng = np.random.default_rng(zlib.crc32(repr((size, activation, with_bias, out_dtype)).encode()))
    a16 = jnp.asarray(_rand(rng, (m, k))).astype(jnp.bfloat16)
    b16 = jnp.asarray(_rand(rng, (k, n), 1 / math.sqrt(k))).astype(jnp.bfloat16)
    bias = jnp.asarray(_rand(rng, (n,))) if with_bias else None
    f = lambda a, b, c: jax_cute.matmul(a, b, bias=c, activation=activation,  # noqa: E731
                                        preferred_element_type=out_dtype)
    text = _compiled(f, a16, b16, bias)
    assert 'custom_call_target="jax_cute_launch' in text and "cublas" not in text.lower()
    got = jax.jit(f)(a16, b16, bias)
    assert got.dtype == out_dtype
    a, b = np.asarray(a16.astype(jnp.float32)), np.asarray(b16.astype(jnp.float32))
    want = reference(a, b, None if bias is None else np.asarray(bias), activation, 0.0)[0]
    # bfloat16: one rounding (2^-9) and the MUFU tanh/exp; float32: accumulation order only
    assert_close(got, want, 1e-2 if out_dtype == jnp.bfloat16 else 1e-5, f"y {size} {activation}")


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("activation", ACTS)
def test_gradients(activation, with_bias):
    m, k, n = 300, 136, 392
    rng = np.random.default_rng(zlib.crc32(repr((activation, with_bias)).encode()))
    a16 = jnp.asarray(_rand(rng, (m, k))).astype(jnp.bfloat16)
    b16 = jnp.asarray(_rand(rng, (k, n), 1 / math.sqrt(k))).astype(jnp.bfloat16)
    bias = jnp.asarray(_rand(rng, (n,))).astype(jnp.bfloat16) if with_bias else None
    n_out = n // 2 if activation == "swiglu" else n
    r16 = jnp.asarray(_rand(rng, (m, n_out))).astype(jnp.bfloat16)

    def loss(a, b, c):
        y = jax_cute.matmul(a, b, bias=c, activation=activation)
        return jnp.sum(y.astype(jnp.float32) * r16.astype(jnp.float32))

    argnums = (0, 1, 2) if with_bias else (0, 1)
    grad = jax.grad(loss, argnums=argnums)
    text = _compiled(grad, a16, b16, bias)
    # the two gradient GEMMs, and the forward one where the activation's derivative needs its
    # pre-activation (a linear loss of a linear product never runs the forward)
    calls = 3 if activation else 2
    assert text.count('custom_call_target="jax_cute_launch') >= calls, "forward and two gradient GEMMs"
    got = jax.jit(grad)(a16, b16, bias)
    a, b = np.asarray(a16.astype(jnp.float32)), np.asarray(b16.astype(jnp.float32))
    c = None if bias is None else np.asarray(bias.astype(jnp.float32))
    _, da, db, dc = reference(a, b, c, activation, np.asarray(r16.astype(jnp.float32), np.float64))
    # bfloat16 residual and cotangent, rounded once each before the gradient GEMMs
    for g, w, name in zip(got, (da, db, dc), ("da", "db", "dbias")):
        assert g.dtype == jnp.bfloat16
        assert_close(g, w, 3e-2, f"{name} {activation}")


# -- einsum and kernelize: the same kernels through other entry points ---------------------------

@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_exact", "silu", "relu2"])
def test_einsum_epilogue_in_kernel(activation):
    """A projection into heads, ``btd,dhk->bthk``, with a per-(head, column) bias: N is two
    free dims of the weight; one launch, epilogue inside, every element against float64."""
    rng = np.random.default_rng(zlib.crc32(repr(("einsum", activation)).encode()))
    x16 = jnp.asarray(_rand(rng, (3, 77, 136))).astype(jnp.bfloat16)
    w16 = jnp.asarray(_rand(rng, (136, 4, 96), 1 / math.sqrt(136))).astype(jnp.bfloat16)
    bias = jnp.asarray(_rand(rng, (4, 96)))
    f = lambda x, w, c: jax_cute.einsum("btd,dhk->bthk", x, w, bias=c, activation=activation)  # noqa: E731
    text = _compiled(f, x16, w16, bias)
    assert text.count('custom_call_target="jax_cute_launch') == 1
    _no_xla_epilogue(text)
    got = jax.jit(f)(x16, w16, bias)
    a = np.asarray(x16.astype(jnp.float32)).reshape(-1, 136)
    b = np.asarray(w16.astype(jnp.float32)).reshape(136, -1)
    want = reference(a, b, np.asarray(bias).reshape(-1), activation, 0.0)[0].reshape(got.shape)
    assert_close(got, want, 1e-2, f"einsum {activation}")


@pytest.mark.parametrize("activation", ["gelu", "silu"])
def test_kernelize_fuses_a_models_epilogue(activation):
    """A layer as a model writes it (bf16 product to f32, bias, jax.nn activation, cast to bf16)
    through kernelize: the forward is one launch with the epilogue inside; forward and
    gradients (forward with the pre-activation, two gradient GEMMs) against float64."""
    m, k, n = 300, 136, 392
    rng = np.random.default_rng(zlib.crc32(repr(("kernelize", activation)).encode()))
    a16 = jnp.asarray(_rand(rng, (m, k))).astype(jnp.bfloat16)
    b16 = jnp.asarray(_rand(rng, (k, n), 1 / math.sqrt(k))).astype(jnp.bfloat16)
    bias = jnp.asarray(_rand(rng, (n,))).astype(jnp.bfloat16)
    r16 = jnp.asarray(_rand(rng, (m, n))).astype(jnp.bfloat16)
    act = getattr(jax.nn, activation)

    def layer(x, w, c):
        return act(jnp.dot(x, w, preferred_element_type=jnp.float32) + c.astype(jnp.float32)).astype(jnp.bfloat16)

    f = jax_cute.kernelize(layer)
    text = _compiled(f, a16, b16, bias)
    assert text.count('custom_call_target="jax_cute_launch') == 1
    _no_xla_epilogue(text)
    assert [p.epilogue for p in f.report.products] == [f"bias + {activation}"]
    a, b, c = (np.asarray(t.astype(jnp.float32)) for t in (a16, b16, bias))
    y, da, db, dc = reference(a, b, c, activation, np.asarray(r16.astype(jnp.float32), np.float64))
    assert_close(jax.jit(f)(a16, b16, bias), y, 1e-2, f"y {activation}")
    loss = lambda x, w, c: jnp.sum(f(x, w, c).astype(jnp.float32) * r16.astype(jnp.float32))  # noqa: E731
    grad = jax.grad(loss, argnums=(0, 1, 2))
    assert _compiled(grad, a16, b16, bias).count('custom_call_target="jax_cute_launch') == 3
    for g, w, name in zip(jax.jit(grad)(a16, b16, bias), (da, db, dc), ("da", "db", "dbias")):
        assert_close(g, w, 3e-2, f"{name} {activation}")


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("activation, with_bias", [("gelu", True), ("relu", True), ("silu", False),
                                                    ("gelu_exact", True)])
@pytest.mark.parametrize("size", SIZES + [(2048, 8192, 1032)])   # (the last: long K, cooperative tiles)
def test_preact_output(size, activation, with_bias, out_dtype):
    """A differentiated forward's kernel writes y = act(z) and the pre-activation z, both from
    the same float32 values, each rounded once."""
    m, k, n = size
    rng = np.random.default_rng(zlib.crc32(repr(("preact", size, activation, with_bias, out_dtype)).encode()))
    a16 = jnp.asarray(_rand(rng, (m, k))).astype(jnp.bfloat16)
    b16 = jnp.asarray(_rand(rng, (k, n), 1 / math.sqrt(k))).astype(jnp.bfloat16)
    bias = jnp.asarray(_rand(rng, (n,))) if with_bias else None
    args = (a16, b16) + ((bias,) if with_bias else ())
    f = lambda a, b, *c: jax_cute.matmul(a, b, bias=c[0] if c else None, activation=activation,  # noqa: E731
                                         preferred_element_type=out_dtype)
    # the primitive jax.grad binds: the same call with the pre-activation output asked for
    eqn = next(e for e in jax.make_jaxpr(f)(*args).eqns if e.primitive is fused.fused_p)
    g = lambda *xs: fused.fused_p.bind(*xs, **dict(eqn.params, preact=True))  # noqa: E731
    text = _compiled(g, *args)
    assert text.count('custom_call_target="jax_cute_launch') == 1 and "tanh" not in text
    y, z = jax.jit(g)(*args)
    a, b = np.asarray(a16.astype(jnp.float32)), np.asarray(b16.astype(jnp.float32))
    c = None if bias is None else np.asarray(bias)
    z64 = reference(a, b, c, None, 0.0)[0]
    tol = 1e-2 if out_dtype == jnp.bfloat16 else 1e-5
    assert y.dtype == z.dtype == out_dtype
    assert_close(z, z64, tol, f"z {size} {activation}")
    assert_close(y, _act64(activation, z64)[0], tol, f"y {size} {activation}")


def test_tiles_the_heuristic_picks_for_fused_epilogues():
    """Every tile family the heuristic picks for a 16-bit fused activation runs here: the
    cooperative 128x256 tile (the ring with a pre-activation output), split-K (forward, long K,
    few tiles). Pingpong 128x128 is not picked (autotune's candidate; fp8's pick, see
    test_gated_fp8)."""
    def pick(m, k, n, preact):
        spec = GemmSpec("bfloat16", "bfloat16", "bfloat16", "k", "n", "n", bias=True, activation="gelu",
                        preact=preact)
        return sm90_gemm.heuristic(spec, m, n, k, 1)
    assert not pick(1000, 776, 1032, False).pingpong and not pick(300, 136, 392, True).pingpong
    long_fwd, long_pre = pick(2048, 8192, 1032, False), pick(2048, 8192, 1032, True)
    assert long_fwd.split_k > 1 and not long_pre.pingpong and long_pre.tile_n == 256
    rng = np.random.default_rng(11)
    m, k, n = 2048, 8192, 1032
    a16 = jnp.asarray(_rand(rng, (m, k))).astype(jnp.bfloat16)
    b16 = jnp.asarray(_rand(rng, (k, n), 1 / math.sqrt(k))).astype(jnp.bfloat16)
    bias = jnp.asarray(_rand(rng, (n,)))
    got = jax.jit(lambda a, b, c: jax_cute.matmul(a, b, bias=c, activation="gelu"))(a16, b16, bias)
    a, b = np.asarray(a16.astype(jnp.float32)), np.asarray(b16.astype(jnp.float32))
    assert_close(got, reference(a, b, np.asarray(bias), "gelu", 0.0)[0], 1e-2, "split-K fused")


# swiglu in the kernel: N/2 on the 64-column grid (192: 128-wide tiles; 1408: 128x256 tiles),
# odd rows, a 1-row product, a batched product with a shared weight
GATED_SIZES = [(257, 136, 384), (300, 100, 2816), (1, 64, 128), (2048, 4096, 2816), (3, 301, 72, 256)]


def _gated_args(size, with_bias, seed, k_major_b=False):
    *lead, k, n = size
    rng = np.random.default_rng(zlib.crc32(repr(seed).encode()))
    a16 = jnp.asarray(_rand(rng, (*lead, k))).astype(jnp.bfloat16)
    b16 = jnp.asarray(_rand(rng, (n, k) if k_major_b else (k, n), 1 / math.sqrt(k))).astype(jnp.bfloat16)
    bias = jnp.asarray(_rand(rng, (n,))) if with_bias else None
    return a16, b16, bias


def _gated_want(a16, b16, bias, k_major_b=False):
    """float64 (z, swiglu(z)) of every row (leading axes flattened)."""
    a = np.asarray(a16.astype(jnp.float32)).reshape(-1, a16.shape[-1])
    b = np.asarray(b16.astype(jnp.float32))
    z = reference(a, b.T if k_major_b else b, None if bias is None else np.asarray(bias), None, 0.0)[0]
    h = z.shape[1] // 2
    return z, _act64("silu", z[:, :h])[0] * z[:, h:]


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("preact", [False, True])
@pytest.mark.parametrize("size", GATED_SIZES)
def test_gated_in_kernel(size, preact, with_bias, out_dtype):
    """swiglu in the epilogue: one launch writes silu(gate) * up (and, as a differentiated forward,
    the pre-activation z in [gate | up] order), no XLA epilogue."""
    a16, b16, bias = _gated_args(size, with_bias, ("gated", size, preact, with_bias, out_dtype))
    args = (a16, b16) + ((bias,) if with_bias else ())
    f = lambda a, b, *c: jax_cute.matmul(a, b, bias=c[0] if c else None, activation="swiglu",  # noqa: E731
                                         preferred_element_type=out_dtype)
    eqn = next(e for e in jax.make_jaxpr(f)(*args).eqns if e.primitive is fused.fused_p)
    g = lambda *xs: fused.fused_p.bind(*xs, **dict(eqn.params, preact=preact))  # noqa: E731
    text = _compiled(g, *args)
    assert text.count('custom_call_target="jax_cute_launch') == 1
    _no_xla_epilogue(text)
    outs = jax.jit(g)(*args)
    z64, y64 = _gated_want(a16, b16, bias)
    tol = 1e-2 if out_dtype == jnp.bfloat16 else 1e-5
    assert len(outs) == (2 if preact else 1)
    assert_close(np.asarray(outs[0].astype(jnp.float32)).reshape(y64.shape), y64, tol, f"y {size}")
    if preact:
        assert_close(np.asarray(outs[1].astype(jnp.float32)).reshape(z64.shape), z64, tol, f"z {size}")


@pytest.mark.parametrize("size", [(300, 136, 384), (1000, 4096, 2816)])
def test_gated_k_major_weight(size):
    """A weight passed as (N, K) (transpose_b): B's N mode is paired through its row stride."""
    a16, b16, bias = _gated_args(size, True, ("gated-k", size), k_major_b=True)
    f = lambda a, b, c: jax_cute.matmul(a, b, transpose_b=True, bias=c, activation="swiglu")  # noqa: E731
    text = _compiled(f, a16, b16, bias)
    assert text.count('custom_call_target="jax_cute_launch') == 1
    _no_xla_epilogue(text)
    assert_close(jax.jit(f)(a16, b16, bias), _gated_want(a16, b16, bias, k_major_b=True)[1], 1e-2, "y")


def test_gated_fp8():
    """fp8 inputs (both contiguous along K) with swiglu and a bias: the pingpong 128x128 pick."""
    a16, b16, bias = _gated_args((2048, 4096, 2816), True, ("gated-fp8",), k_major_b=True)
    a8, b8 = a16.astype(jnp.float8_e4m3fn), b16.astype(jnp.float8_e4m3fn)
    f = lambda a, b, c: jax_cute.matmul(a, b, transpose_b=True, bias=c, activation="swiglu",  # noqa: E731
                                        preferred_element_type=jnp.bfloat16)
    text = _compiled(f, a8, b8, bias)
    assert text.count('custom_call_target="jax_cute_launch') == 1
    _no_xla_epilogue(text)
    a32, b32 = a8.astype(jnp.float32), b8.astype(jnp.float32)
    assert_close(jax.jit(f)(a8, b8, bias), _gated_want(a32, b32, bias, k_major_b=True)[1], 1e-2, "y fp8")


@pytest.mark.parametrize("with_bias", [False, True])
def test_gated_gradients(with_bias):
    """The gradients of a swiglu product whose forward runs in the kernel (it saves z)."""
    m, k, n = 300, 136, 384
    rng = np.random.default_rng(zlib.crc32(repr(("gated-grad", with_bias)).encode()))
    a16 = jnp.asarray(_rand(rng, (m, k))).astype(jnp.bfloat16)
    b16 = jnp.asarray(_rand(rng, (k, n), 1 / math.sqrt(k))).astype(jnp.bfloat16)
    bias = jnp.asarray(_rand(rng, (n,))).astype(jnp.bfloat16) if with_bias else None
    r16 = jnp.asarray(_rand(rng, (m, n // 2))).astype(jnp.bfloat16)

    def loss(a, b, c):
        y = jax_cute.matmul(a, b, bias=c, activation="swiglu")
        return jnp.sum(y.astype(jnp.float32) * r16.astype(jnp.float32))

    grad = jax.grad(loss, argnums=(0, 1, 2) if with_bias else (0, 1))
    assert _compiled(grad, a16, b16, bias).count('custom_call_target="jax_cute_launch') == 3
    got = jax.jit(grad)(a16, b16, bias)
    a, b = np.asarray(a16.astype(jnp.float32)), np.asarray(b16.astype(jnp.float32))
    c = None if bias is None else np.asarray(bias.astype(jnp.float32))
    _, da, db, dc = reference(a, b, c, "swiglu", np.asarray(r16.astype(jnp.float32), np.float64))
    for g, w, name in zip(got, (da, db, dc), ("da", "db", "dbias")):
        assert_close(g, w, 3e-2, f"{name} swiglu")


# ragged_dot: (M, K, N, group sizes) with empty groups, rows past the last group (zeros, no
# bias), a group of one row; N = 384 (128-wide tiles), 2816 (128x256), 392 (not gated: the last
# tile is partly past N)
RAGGED = [(300, 136, 384, (100, 0, 150, 30)), (1000, 264, 2816, (0, 333, 1, 600)), (129, 64, 392, (129, 0, 0, 0))]
RAGGED_EPILOGUES = [(case, a, b) for case in RAGGED for a, b in EPILOGUES if a != "swiglu" or case[2] % 128 == 0]


def _ragged_want(x, w, bias, sizes, activation, r=None):
    """float64 (y, z) per group and, for a cotangent r of y, (dx, dw, dbias)."""
    g, n = w.shape[0], w.shape[2]
    n_out = n // 2 if activation == "swiglu" else n
    y, z = np.zeros((x.shape[0], n_out)), np.zeros((x.shape[0], n))
    dx, dw, db = np.zeros(x.shape), np.zeros(w.shape), np.zeros((g, n))
    hi = 0
    for i, size in enumerate(sizes):
        lo, hi = hi, hi + size
        c = None if bias is None else bias[i]
        z[lo:hi] = reference(x[lo:hi], w[i], c, None, 0.0)[0]
        y[lo:hi], dx[lo:hi], dw[i], db[i] = reference(x[lo:hi], w[i], c, activation,
                                                       0.0 if r is None else r[lo:hi])
    return y, z, dx, dw, db


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("case, activation, with_bias", RAGGED_EPILOGUES)
def test_ragged_epilogue_in_kernel(case, activation, with_bias, out_dtype):
    """The grouped kernel's epilogue: y, and as a differentiated forward also z, each from one
    launch with no XLA epilogue; rows past the last group zero in both."""
    m, k, n, sizes = case
    rng = np.random.default_rng(zlib.crc32(repr(("ragged", case, activation, with_bias, out_dtype)).encode()))
    x16 = jnp.asarray(_rand(rng, (m, k))).astype(jnp.bfloat16)
    w16 = jnp.asarray(_rand(rng, (len(sizes), k, n), 1 / math.sqrt(k))).astype(jnp.bfloat16)
    bias = jnp.asarray(_rand(rng, (len(sizes), n))) if with_bias else None
    gs = jnp.asarray(sizes, jnp.int32)
    args = (x16, w16, gs) + ((bias,) if with_bias else ())
    f = lambda x, w, gs, *c: jax_cute.ragged_dot(x, w, gs, bias=c[0] if c else None,  # noqa: E731
                                                 activation=activation, preferred_element_type=out_dtype)
    eqn = next(e for e in jax.make_jaxpr(f)(*args).eqns if e.primitive is ragged_fused.ragged_fused_p)
    preact = activation is not None
    g = lambda *xs: ragged_fused.ragged_fused_p.bind(*xs, **dict(eqn.params, preact=preact))  # noqa: E731
    text = _compiled(g, *args)
    assert text.count('custom_call_target="jax_cute_launch') == 1
    _no_xla_epilogue(text)
    outs = jax.jit(g)(*args)
    x, w = np.asarray(x16.astype(jnp.float32)), np.asarray(w16.astype(jnp.float32))
    y64, z64, *_ = _ragged_want(x, w, None if bias is None else np.asarray(bias), sizes, activation)
    tol = 1e-2 if out_dtype == jnp.bfloat16 else 1e-5
    assert_close(outs[0], y64, tol, f"y {case} {activation}")
    if preact:
        assert_close(outs[1], z64, tol, f"z {case} {activation}")


@pytest.mark.parametrize("activation", ["gelu", "swiglu", "relu"])
def test_ragged_epilogue_gradients(activation):
    m, k, n, sizes = 300, 136, 384, (100, 0, 150, 30)
    rng = np.random.default_rng(zlib.crc32(repr(("ragged-grad", activation)).encode()))
    x16 = jnp.asarray(_rand(rng, (m, k))).astype(jnp.bfloat16)
    w16 = jnp.asarray(_rand(rng, (4, k, n), 1 / math.sqrt(k))).astype(jnp.bfloat16)
    b16 = jnp.asarray(_rand(rng, (4, n))).astype(jnp.bfloat16)
    r16 = jnp.asarray(_rand(rng, (m, n // 2 if activation == "swiglu" else n))).astype(jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)

    def loss(x, w, c):
        y = jax_cute.ragged_dot(x, w, gs, bias=c, activation=activation)
        return jnp.sum(y.astype(jnp.float32) * r16.astype(jnp.float32))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    assert _compiled(grad, x16, w16, b16).count('custom_call_target="jax_cute_launch') == 3
    got = jax.jit(grad)(x16, w16, b16)
    want = _ragged_want(*(np.asarray(t.astype(jnp.float32)) for t in (x16, w16, b16)), sizes, activation,
                        np.asarray(r16.astype(jnp.float32), np.float64))[2:]
    for gv, wv, name in zip(got, want, ("dx", "dw", "dbias")):
        assert_close(gv, wv, 3e-2, f"{name} {activation}")


@pytest.mark.parametrize("activation, bias", [("gelu", None), ("silu", "per batch"), ("relu", "shared"),
                                              (None, "per batch")])
def test_ragged_epilogue_under_vmap(activation, bias):
    """vmap of ragged_dot with an activation and/or a bias (one per batch, or one shared), the
    group sizes mapped too: one grouped launch runs the batch with its epilogue; under grad
    three. Each batch's y, dx (and its share of dw and dbias) against float64."""
    m, k, n = 300, 136, 384
    sizes = [(100, 0, 150, 30), (0, 300, 0, 0), (1, 1, 297, 1)]
    rng = np.random.default_rng(zlib.crc32(repr(("ragged-vmap", activation, bias)).encode()))
    x16 = jnp.asarray(_rand(rng, (3, m, k))).astype(jnp.bfloat16)
    w16 = jnp.asarray(_rand(rng, (4, k, n), 1 / math.sqrt(k))).astype(jnp.bfloat16)
    c16 = {None: None, "per batch": (3, 4, n), "shared": (4, n)}[bias]
    c16 = None if c16 is None else jnp.asarray(_rand(rng, c16)).astype(jnp.bfloat16)
    r16 = jnp.asarray(_rand(rng, (3, m, n))).astype(jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    f = jax.vmap(lambda x, w, g, c: jax_cute.ragged_dot(x, w, g, bias=c, activation=activation),
                 in_axes=(0, None, 0, 0 if bias == "per batch" else None))

    def loss(x, w, c):
        return jnp.sum(f(x, w, gs, c).astype(jnp.float32) * r16.astype(jnp.float32))

    text = _compiled(lambda x, w, c: f(x, w, gs, c), x16, w16, c16)
    assert text.count('custom_call_target="jax_cute_launch') == 1
    _no_xla_epilogue(text)
    argnums = (0, 1) if bias is None else (0, 1, 2)
    grad = jax.grad(loss, argnums=argnums)
    # the forward kernel (writing the pre-activation too) and the two gradient GEMMs; without an
    # activation the loss is linear in y and the forward GEMM is dead
    launches = 2 if activation is None else 3
    assert _compiled(grad, x16, w16, c16).count('custom_call_target="jax_cute_launch') == launches
    y = jax.jit(lambda x, w, c: f(x, w, gs, c))(x16, w16, c16)
    grads = jax.jit(grad)(x16, w16, c16)
    x, w = np.asarray(x16.astype(jnp.float32)), np.asarray(w16.astype(jnp.float32))
    c = None if c16 is None else np.asarray(c16.astype(jnp.float32))
    r = np.asarray(r16.astype(jnp.float32), np.float64)
    dw_want, dc_want = np.zeros(w.shape), np.zeros(() if c is None else c.shape)
    for i in range(3):
        ci = None if c is None else c[i] if bias == "per batch" else c
        y64, _, dx64, dw64, dc64 = _ragged_want(x[i], w, ci, sizes[i], activation, r[i])
        assert_close(y[i], y64, 1e-2, f"y[{i}] {activation} {bias}")
        assert_close(grads[0][i], dx64, 3e-2, f"dx[{i}] {activation} {bias}")
        dw_want += dw64
        if bias == "per batch":
            dc_want[i] = dc64
        elif bias == "shared":
            dc_want += dc64
    assert_close(grads[1], dw_want, 3e-2, f"dw {activation} {bias}")
    if bias is not None:
        assert_close(grads[2], dc_want, 3e-2, f"dbias {activation} {bias}")


@pytest.mark.parametrize("activation", ["gelu", "silu"])
def test_kernelize_fuses_an_activation_after_ragged_dot(activation):
    """An MoE expert layer as a model writes it (lax.ragged_dot to f32, a jax.nn activation, a
    cast to bf16) through kernelize: one grouped launch with the activation inside; forward and
    gradients against float64, empty groups and rows past the last group included."""
    m, k, n, sizes = RAGGED[1]
    rng = np.random.default_rng(zlib.crc32(repr(("kernelize ragged", activation)).encode()))
    x16 = jnp.asarray(_rand(rng, (m, k))).astype(jnp.bfloat16)
    w16 = jnp.asarray(_rand(rng, (len(sizes), k, n), 1 / math.sqrt(k))).astype(jnp.bfloat16)
    r16 = jnp.asarray(_rand(rng, (m, n))).astype(jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    act = getattr(jax.nn, activation)
    f = jax_cute.kernelize(lambda x, w, gs: act(jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32))
                           .astype(jnp.bfloat16))
    text = _compiled(f, x16, w16, gs)
    assert text.count('custom_call_target="jax_cute_launch') == 1
    _no_xla_epilogue(text)
    assert [p.epilogue for p in f.report.products] == [activation]
    x, w, r = (np.asarray(t.astype(jnp.float32)) for t in (x16, w16, r16))
    y64, _, dx, dw, _ = _ragged_want(x, w, None, sizes, activation, r.astype(np.float64))
    assert_close(jax.jit(f)(x16, w16, gs), y64, 1e-2, f"y {activation}")
    loss = lambda x, w: jnp.sum(f(x, w, gs).astype(jnp.float32) * r16.astype(jnp.float32))  # noqa: E731
    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(x16, w16)
    for g, want, name in zip(got, (dx, dw), ("dx", "dw")):
        assert_close(g, want, 3e-2, f"{name} {activation}")


def test_kernelize_fuses_a_vmapped_linear_layer():
    """vmap of ``w @ x + b`` then gelu (Equinox's Linear and MLP): the transposed product is
    taken with its operands swapped, so one launch writes gelu(X·Wᵀ + b) in the batch's order."""
    rng = np.random.default_rng(zlib.crc32(b"vmapped linear"))
    x16 = jnp.asarray(_rand(rng, (300, 136))).astype(jnp.bfloat16)
    w16 = jnp.asarray(_rand(rng, (392, 136), 1 / math.sqrt(136))).astype(jnp.bfloat16)
    b16 = jnp.asarray(_rand(rng, (392,))).astype(jnp.bfloat16)
    f = jax_cute.kernelize(lambda x, w, b: jax.vmap(lambda v: jax.nn.gelu(w @ v + b))(x))
    text = _compiled(f, x16, w16, b16)
    assert text.count('custom_call_target="jax_cute_launch') == 1
    _no_xla_epilogue(text)
    assert [p.epilogue for p in f.report.products] == ["bias + gelu"]
    x, w, b = (np.asarray(t.astype(jnp.float32)) for t in (x16, w16, b16))
    # bf16 result: the model's bf16 gelu and ours (f32, rounded once) differ by bf16 rounding
    assert_close(jax.jit(f)(x16, w16, b16), reference(x, w.T, b, "gelu", 0.0)[0], 1e-2, "vmapped linear")


# -- the activation-derivative epilogue (GemmSpec.dact: C = act'(Z) * A·Bᵀ) ------------------------
# These launch the sm90_gemm kernel through the kernels layer, binding its arguments (a, b, c,
# z) themselves, to reach configs and layouts the primitive's routing does not pick
# (test_gpu_dact.py takes the routed path). (M, K, N): partial tiles along both modes, an N
# whose rows need padding (and the per-element edge stores), one row, and tiles all inside.
DACT_SIZES = [(257, 144, 392), (300, 144, 1002), (1, 64, 130), (512, 256, 1024)]


def _padded(n: int, dtype) -> int:
    """n rounded up to 16 bytes of dtype (a TMA stride)."""
    per = 16 // jnp.dtype(dtype).itemsize
    return -(-n // per) * per


def _dact_call(spec: GemmSpec, cfg: sm90_gemm.Config, a, b, z):
    """The kernel of (spec, cfg) on a (M, K) and b (N, K), both contiguous along K, and z (M, N).
    C and Z are laid out alike: contiguous along N (c_major "n") or M, the other stride padded to
    16 bytes; Z's padding is NaN, so a read of it shows. Returns C as (M, N)."""
    from jax_cute.cache import family_binary
    from jax_cute.custom_call import kernel_call

    (m, k), n = a.shape, b.shape[0]
    c_dt = jnp.dtype(spec.c_dtype)
    if spec.c_major == "n":
        pad = _padded(n, c_dt)
        stride, zbuf = (pad, 1, m * pad), jnp.full((m, pad), jnp.nan, c_dt).at[:, :n].set(z)
    else:
        pad = _padded(m, c_dt)
        stride, zbuf = (1, pad, n * pad), jnp.full((n, pad), jnp.nan, c_dt).at[:, :m].set(z.T)
    binary = family_binary(sm90_gemm, "sm_90a", spec, cfg)

    def f(a, b, zb):
        return kernel_call(binary, {"a": (a.reshape(-1), (m, k, 1), (k, 1, m * k)),
                                    "b": (b.reshape(-1), (n, k, 1), (k, 1, n * k)),
                                    "z": (zb.reshape(-1), (m, n, 1), stride)},
                           {"c": (jax.ShapeDtypeStruct((zbuf.size,), c_dt), (m, n, 1), stride)})["c"]

    c = jax.jit(f)(a, b, zbuf).reshape(zbuf.shape)
    return c[:, :n] if spec.c_major == "n" else c[:, :m].T


def _dact_case(spec: GemmSpec, size, seed):
    """Inputs of a dact product (z spread wide, into the activations' tails) and the float64
    reference from the values the kernel reads."""
    m, k, n = size
    rng = np.random.default_rng(zlib.crc32(repr((spec.key(), size, seed)).encode()))
    a = jnp.asarray(_rand(rng, (m, k))).astype(spec.a_dtype)
    b = jnp.asarray(_rand(rng, (n, k), 1 / math.sqrt(k))).astype(spec.b_dtype)
    z = jnp.asarray(_rand(rng, (m, n), 3.0)).astype(spec.c_dtype)
    a64, b64, z64 = (np.asarray(t.astype(jnp.float32), np.float64) for t in (a, b, z))
    return a, b, z, (a64 @ b64.T) * _act64(spec.dact, z64)[1]


def _dact_configs(spec: GemmSpec, size) -> dict[str, sm90_gemm.Config]:
    m, k, n = size
    coop = sm90_gemm.epilogue_for(spec, sm90_gemm.Config())
    return {"pick": sm90_gemm.heuristic(spec, m, n, k, 1), "coop": coop,
            "ring": dataclasses.replace(coop, whole_c=False), "pingpong": sm90_gemm._PINGPONG_128}


# 16-bit outputs: one rounding (bf16: 2^-9) and gelu_exact's fast erf; float32: the derivative's
# MUFU ex2 and rcp forms, a few float32 ulps
_DACT_TOL = {"bfloat16": 1e-2, "float16": 1e-2, "float32": 1e-4}


@pytest.mark.parametrize("which", ["pick", "coop", "ring", "pingpong"])
@pytest.mark.parametrize("dact", ["relu", "gelu", "gelu_exact", "silu", "relu2"])
def test_dact_epilogue(dact, which):
    """Every activation's derivative in the tiles a dact product takes: the heuristic's pick,
    the cooperative 128x256 tile with its whole-share epilogue and with the ring, pingpong
    128x128 (bf16 in and out, C and Z contiguous along N)."""
    spec = GemmSpec("bfloat16", "bfloat16", "bfloat16", "k", "k", "n", dact=dact)
    for size in DACT_SIZES:
        a, b, z, want = _dact_case(spec, size, which)
        cfg = _dact_configs(spec, size)[which]
        assert_close(_dact_call(spec, cfg, a, b, z), want, _DACT_TOL[spec.c_dtype], f"{dact} {size} {cfg.key()}")


@pytest.mark.parametrize("which", ["pick", "pingpong"])
@pytest.mark.parametrize("a_dtype, c_dtype, c_major", [("bfloat16", "bfloat16", "m"), ("float16", "float16", "n"),
                                                       ("bfloat16", "float32", "n"), ("float16", "float32", "m"),
                                                       ("float8_e4m3fn", "bfloat16", "n")])
@pytest.mark.parametrize("dact", ["relu", "gelu", "gelu_exact", "silu", "relu2"])
def test_dact_dtypes_and_layouts(dact, a_dtype, c_dtype, c_major, which):
    """fp16, fp32 (the accurate forms) and 8-bit-input products, C and Z contiguous along M."""
    spec = GemmSpec(a_dtype, a_dtype, c_dtype, "k", "k", c_major, dact=dact)
    for size in DACT_SIZES:
        a, b, z, want = _dact_case(spec, size, which)
        cfg = _dact_configs(spec, size)[which]
        assert_close(_dact_call(spec, cfg, a, b, z), want, _DACT_TOL[c_dtype], f"{dact} {size} {cfg.key()}")


def test_dact_relu_selects_the_cotangent():
    """relu's derivative selects, as jax.nn.relu's JVP does: a NaN product where z <= 0 gives 0,
    where z > 0 it stays NaN."""
    spec = GemmSpec("bfloat16", "bfloat16", "bfloat16", "k", "k", "n", dact="relu")
    a, b, z, _ = _dact_case(spec, (300, 144, 392), "nan")
    a = a.at[7].set(jnp.nan)
    got = np.asarray(_dact_call(spec, sm90_gemm.heuristic(spec, 300, 392, 144, 1), a, b, z).astype(jnp.float32))
    positive = np.asarray(z[7].astype(jnp.float32)) > 0
    assert np.isnan(got[7][positive]).all() and (got[7][~positive] == 0).all()
    assert np.isfinite(np.delete(got, 7, axis=0)).all()
