"""The fused epilogues every arch's kernels compute (bias, the non-gated activations, the
pre-activation output under ``grad``, the derivative in a kernelized MLP's backward GEMM, a
ragged_dot's epilogue with its pre-activation), on a
Hopper GPU or, opted in (``JAX_CUTE_UNVERIFIED_KERNELS=1``), a Blackwell one: the checks of
tests/test_gpu_fused.py and tests/test_gpu_dact.py that hold for both, so that a B200 run of
``pytest -m gpu`` reads the sm_100a epilogues against the same float64 reference. Strict mode
(a silent fallback fails), NaN-prefilled outputs, odd sizes, every element.

Run: ``pytest -m gpu tests/test_gpu_fused_any_arch.py`` (on a B200 with JAX_CUTE_UNVERIFIED_KERNELS=1).
"""

from __future__ import annotations

import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cute
from jax_cute import config
from jax_cute.primitives import ragged_fused
from test_gpu_fused import (_act64, _compiled, _no_xla_epilogue, _ragged_want, _rand, _strict_and_nan_filled,  # noqa: F401
                            assert_close, reference)
from test_gpu_dact import _model

pytestmark = pytest.mark.gpu

ACTS = (None, "relu", "gelu", "gelu_exact", "silu", "relu2")
EPILOGUES = [(a, b) for a in ACTS for b in (False, True) if a is not None or b]


@pytest.fixture(autouse=True, scope="module")
def _hopper_or_opted_in_blackwell():
    cc = jax.devices()[0].compute_capability if jax.default_backend() == "gpu" else None
    if not (cc == "9.0" or (cc == "10.0" and config.unverified_kernels())):
        pytest.skip(f"needs a compute capability 9.0 GPU (or 10.0 with JAX_CUTE_UNVERIFIED_KERNELS=1), got {cc}")


def _operands(seed: tuple, m: int, k: int, n: int, bias_dtype=jnp.float32):
    rng = np.random.default_rng(zlib.crc32(repr(seed).encode()))
    a16 = jnp.asarray(_rand(rng, (m, k))).astype(jnp.bfloat16)
    b16 = jnp.asarray(_rand(rng, (k, n), 1 / math.sqrt(k))).astype(jnp.bfloat16)
    return rng, a16, b16, jnp.asarray(_rand(rng, (n,))).astype(bias_dtype)


def _f32(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("activation, with_bias", EPILOGUES)
def test_forward(activation, with_bias, out_dtype):
    m, k, n = 300, 100, 1002   # a K and N the plan pads, tiles past M and N
    _, a16, b16, bias = _operands(("fwd", activation, with_bias, out_dtype), m, k, n)
    bias = bias if with_bias else None
    f = lambda a, b, c: jax_cute.matmul(a, b, bias=c, activation=activation,  # noqa: E731
                                        preferred_element_type=out_dtype)
    text = _compiled(f, a16, b16, bias)
    assert text.count('custom_call_target="jax_cute_launch') == 1
    _no_xla_epilogue(text)
    got = jax.jit(f)(a16, b16, bias)
    want = reference(_f32(a16), _f32(b16), None if bias is None else np.asarray(bias), activation, 0.0)[0]
    # bfloat16: one rounding (2^-9) and the MUFU tanh/exp; float32: accumulation order only
    assert_close(got, want, 1e-2 if out_dtype == jnp.bfloat16 else 1e-5, f"y {activation}")


@pytest.mark.parametrize("activation", ACTS[1:])
def test_gradients_with_the_pre_activation(activation):
    """Under grad the forward kernel also writes the pre-activation the backward reads."""
    m, k, n = 257, 136, 392
    rng, a16, b16, bias = _operands(("grad", activation), m, k, n, jnp.bfloat16)
    r16 = jnp.asarray(_rand(rng, (m, n))).astype(jnp.bfloat16)

    def loss(a, b, c):
        y = jax_cute.matmul(a, b, bias=c, activation=activation)
        return jnp.sum(y.astype(jnp.float32) * r16.astype(jnp.float32))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    text = _compiled(grad, a16, b16, bias)
    assert text.count('custom_call_target="jax_cute_launch') >= 3, "forward and two gradient GEMMs"
    assert ".preact" in text
    got = jax.jit(grad)(a16, b16, bias)
    want = reference(_f32(a16), _f32(b16), _f32(bias), activation, np.asarray(_f32(r16), np.float64))[1:]
    for g, w, name in zip(got, want, ("da", "db", "dbias")):
        assert_close(g, w, 3e-2, f"{name} {activation}")


@pytest.mark.parametrize("act", ["relu", "gelu", "gelu_exact", "silu"])
def test_kernelized_mlp_backward_fuses_the_derivative(act):
    m, d, f = 257, 100, 520
    rng = np.random.default_rng(zlib.crc32(repr(("dact", act)).encode()))
    x = jnp.asarray(_rand(rng, (m, d))).astype(jnp.bfloat16)
    w1 = jnp.asarray(_rand(rng, (d, f), d ** -0.5)).astype(jnp.bfloat16)
    b1 = jnp.asarray(_rand(rng, (f,)))
    w2 = jnp.asarray(_rand(rng, (f, d), f ** -0.5)).astype(jnp.bfloat16)
    r = jnp.asarray(_rand(rng, (m, d)))
    grad = jax.grad(lambda *a: jnp.sum(jax_cute.kernelize(_model(act))(*a) * r), argnums=(0, 1, 2, 3))
    text = _compiled(grad, x, w1, b1, w2)
    assert text.count('custom_call_target="jax_cute_launch') == 5 and f".dact-{act}" in text
    _no_xla_epilogue(text)
    dx, dw1, db1, dw2 = jax.jit(grad)(x, w1, b1, w2)
    x64, w164, w264 = (np.asarray(_f32(v), np.float64) for v in (x, w1, w2))
    z = x64 @ w164 + np.asarray(b1, np.float64)
    h, dh_dz = _act64(act, z)
    h = np.asarray(_f32(jnp.asarray(h, jnp.float32).astype(jnp.bfloat16)), np.float64)
    dz = (np.asarray(r, np.float64) @ w264.T) * dh_dz
    for g, w, name in ((dx, dz @ w164.T, "dx"), (dw1, x64.T @ dz, "dw1"), (db1, dz.sum(0), "db1"),
                       (dw2, h.T @ np.asarray(r, np.float64), "dw2")):
        assert_close(g, w, 3e-2, f"{name} {act}")


@pytest.mark.parametrize("activation, with_bias", [("gelu", True), ("relu2", False), ("silu", True)])
def test_ragged_epilogue_with_the_pre_activation(activation, with_bias):
    """ragged_m: y and z from one launch, an empty group, a group crossing tiles, a one-row group,
    rows past the last group zero in both."""
    m, k, n, sizes = 1000, 264, 392, (0, 333, 1, 600)
    rng = np.random.default_rng(zlib.crc32(repr(("ragged", activation, with_bias)).encode()))
    x16 = jnp.asarray(_rand(rng, (m, k))).astype(jnp.bfloat16)
    w16 = jnp.asarray(_rand(rng, (len(sizes), k, n), 1 / math.sqrt(k))).astype(jnp.bfloat16)
    bias = jnp.asarray(_rand(rng, (len(sizes), n))) if with_bias else None
    args = (x16, w16, jnp.asarray(sizes, jnp.int32)) + ((bias,) if with_bias else ())
    f = lambda x, w, gs, *c: jax_cute.ragged_dot(x, w, gs, bias=c[0] if c else None,  # noqa: E731
                                                 activation=activation)
    eqn = next(e for e in jax.make_jaxpr(f)(*args).eqns if e.primitive is ragged_fused.ragged_fused_p)
    g = lambda *xs: ragged_fused.ragged_fused_p.bind(*xs, **dict(eqn.params, preact=True))  # noqa: E731
    text = _compiled(g, *args)
    assert text.count('custom_call_target="jax_cute_launch') == 1 and ".preact" in text
    _no_xla_epilogue(text)
    y, z = jax.jit(g)(*args)
    y64, z64, *_ = _ragged_want(_f32(x16), _f32(w16), None if bias is None else np.asarray(bias), sizes, activation)
    assert_close(y, y64, 1e-2, f"y {activation}")
    assert_close(z, z64, 1e-2, f"z {activation}")
