"""The activation's derivative in the backward GEMM, on a Hopper GPU.

A model-written MLP (``act(x @ w1 + b1)`` cast to bf16, then ``@ w2``) through ``kernelize``:
under ``grad`` the GEMM ``dout @ w2.T`` applies act' in its epilogue (one launch for dz, no XLA
activation derivative left), and every gradient matches a float64 host reference on fresh
random data, odd sizes, NaN-prefilled outputs, strict mode (a silent fallback fails).

Run: ``pytest -m gpu tests/test_gpu_dact.py``.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cute
from jax_cute.activations import REGISTRY
# (the autouse fixtures too: a compute capability 9.0 GPU, strict mode, NaN-filled outputs)
from test_gpu_fused import _act64, _compiled, _hopper, _no_xla_epilogue, _rand, _strict_and_nan_filled, assert_close  # noqa: F401

pytestmark = pytest.mark.gpu

# (tokens M, model width D, hidden width F): an odd M, a D whose rows the plan pads, one row
SIZES = [(1000, 136, 392), (257, 100, 520), (1, 64, 136)]


def _model(act):
    fn = REGISTRY[act].function   # as a model writes it (jax.nn's functions; relu2 squares relu)

    def mlp(x, w1, b1, w2):
        h = jnp.matmul(x, w1, preferred_element_type=jnp.float32) + b1
        return jnp.matmul(fn(h).astype(jnp.bfloat16), w2, preferred_element_type=jnp.float32)

    return mlp


@pytest.mark.parametrize("act", ["relu", "gelu", "gelu_exact", "silu", "relu2"])
@pytest.mark.parametrize("m,d,f", SIZES)
def test_kernelized_mlp_backward_fuses_the_derivative(act, m, d, f):
    rng = np.random.default_rng(zlib.crc32(repr(("dact", act, m, d, f)).encode()))
    x = jnp.asarray(_rand(rng, (m, d))).astype(jnp.bfloat16)
    w1 = jnp.asarray(_rand(rng, (d, f), d ** -0.5)).astype(jnp.bfloat16)
    b1 = jnp.asarray(_rand(rng, (f,)))
    w2 = jnp.asarray(_rand(rng, (f, d), f ** -0.5)).astype(jnp.bfloat16)
    r = jnp.asarray(_rand(rng, (m, d)))
    mlp = jax_cute.kernelize(_model(act))
    grad = jax.grad(lambda *a: jnp.sum(mlp(*a) * r), argnums=(0, 1, 2, 3))

    text = _compiled(grad, x, w1, b1, w2)
    # the fused first GEMM (writing the pre-activation too), then dw2, dz (the derivative in its
    # epilogue), dx and dw1 (the second forward GEMM only makes the loss, which grad drops)
    assert text.count('custom_call_target="jax_cute_launch') == 5
    assert f".dact-{act}" in text
    _no_xla_epilogue(text)
    dx, dw1, db1, dw2 = jax.jit(grad)(x, w1, b1, w2)

    x64, w164, w264 = (np.asarray(v.astype(jnp.float32), np.float64) for v in (x, w1, w2))
    z = x64 @ w164 + np.asarray(b1, np.float64)
    h, dh_dz = _act64(act, z)
    h = np.asarray(jnp.asarray(h, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    r64 = np.asarray(r, np.float64)
    dz = (r64 @ w264.T) * dh_dz
    assert_close(dx, dz @ w164.T, 3e-2, f"dx {act}")
    assert_close(dw1, x64.T @ dz, 3e-2, f"dw1 {act}")
    assert_close(db1, dz.sum(0), 3e-2, f"db1 {act}")
    assert_close(dw2, h.T @ r64, 3e-2, f"dw2 {act}")
    assert_close(jax.jit(mlp)(x, w1, b1, w2), h @ w264, 2e-2, f"y {act}")
