"""Checkpoint policies and scans on a Hopper GPU, in strict mode with NaN-filled outputs, on
fresh random data at odd sizes: a kernelized MLP under ``jax.checkpoint(policy=dots_saveable)``
launches no GEMM twice (as many kernels as without checkpoint, fewer than ``nothing_saveable``;
the loss's value is returned too, so the forward products stay live) and its gradients match a
float64 host reference; a kernelized stack under ``lax.scan`` runs each GEMM once and matches
the stack in float32.

Run: ``pytest -m gpu tests/test_gpu_remat.py``.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cute
from jax_cute import config
# (the autouse fixtures too: a compute capability 9.0 GPU, strict mode, NaN-filled outputs)
from test_gpu_fused import _act64, _compiled, _hopper, _rand, _strict_and_nan_filled, assert_close  # noqa: F401

pytestmark = pytest.mark.gpu

LAUNCH = 'custom_call_target="jax_cute_launch'


def mlp(x, w1, b1, w2):
    h = jax.nn.gelu(jnp.matmul(x, w1, preferred_element_type=jnp.float32) + b1)
    return jnp.matmul(h.astype(jnp.bfloat16), w2, preferred_element_type=jnp.float32)


@pytest.mark.parametrize("m,d,f", [(1000, 136, 392), (257, 100, 520)])
def test_dots_saveable_launches_each_gemm_once(m, d, f):
    rng = np.random.default_rng(zlib.crc32(repr(("remat", m, d, f)).encode()))
    x = jnp.asarray(_rand(rng, (m, d))).astype(jnp.bfloat16)
    w1 = jnp.asarray(_rand(rng, (d, f), d ** -0.5)).astype(jnp.bfloat16)
    b1 = jnp.asarray(_rand(rng, (f,)))
    w2 = jnp.asarray(_rand(rng, (f, d), f ** -0.5)).astype(jnp.bfloat16)
    r = jnp.asarray(_rand(rng, (m, d)))

    def grad(fn):   # (with the value: jax.grad alone would let XLA drop the forward's second GEMM)
        return jax.value_and_grad(lambda *a: jnp.sum(fn(*a) * r), argnums=(0, 1, 2, 3))

    kmlp = jax_cute.kernelize(mlp)
    launches = {name: _compiled(grad(jax.checkpoint(kmlp, policy=getattr(jax.checkpoint_policies, name))),
                                x, w1, b1, w2).count(LAUNCH)
                for name in ("dots_saveable", "nothing_saveable")}
    assert launches["dots_saveable"] == _compiled(grad(kmlp), x, w1, b1, w2).count(LAUNCH), launches
    assert launches["dots_saveable"] < launches["nothing_saveable"], launches

    _, (dx, dw1, db1, dw2) = jax.jit(grad(jax.checkpoint(kmlp, policy=jax.checkpoint_policies.dots_saveable)))(x, w1, b1, w2)
    x64, w164, w264 = (np.asarray(v.astype(jnp.float32), np.float64) for v in (x, w1, w2))
    h, dh_dz = _act64("gelu", x64 @ w164 + np.asarray(b1, np.float64))
    h = np.asarray(jnp.asarray(h, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    r64 = np.asarray(r, np.float64)
    dz = (r64 @ w264.T) * dh_dz
    assert_close(dx, dz @ w164.T, 3e-2, "dx")
    assert_close(dw1, x64.T @ dz, 3e-2, "dw1")
    assert_close(db1, dz.sum(0), 3e-2, "db1")
    assert_close(dw2, h.T @ r64, 3e-2, "dw2")


def _stack_loss(layer, dtype):
    def loss(w1, w2, x):
        def body(c, w):
            return layer(c, *w), None
        y, _ = jax.lax.scan(body, x.astype(dtype), (w1.astype(dtype), w2.astype(dtype)))
        return jnp.mean(y.astype(jnp.float32) ** 2)
    return loss


def _layer(x, w1, w2, dtype):
    h = jax.nn.gelu(jnp.matmul(x, w1, preferred_element_type=jnp.float32)).astype(dtype)
    return x + jnp.matmul(h, w2, preferred_element_type=jnp.float32).astype(dtype)


@pytest.mark.parametrize("n,t,d,f", [(4, 1024, 256, 1024), (3, 520, 136, 392)])
@pytest.mark.parametrize("policy", [None, "dots_saveable"])
def test_scanned_stack_launches_each_gemm_once(policy, n, t, d, f):
    """Under ``lax.scan`` the stack saves each layer's fused-GEMM outputs (gelu's output and its
    pre-activation) into stacked buffers. At the first size XLA (jaxlib 0.11.2) writes them there
    through its dynamic-slice fusion, which, without the barrier on a call's several outputs
    (custom_call.kernel_call), ran that GEMM twice per layer: 7 launches for a stack of 6 GEMMs.
    The value and gradients match the stack in float32. Outputs are not NaN-filled here: those
    are aliased inputs, and calls with aliased outputs keep no barrier."""
    rng = np.random.default_rng(zlib.crc32(repr(("scan", policy, n, t, d, f)).encode()))
    w1 = jnp.asarray(_rand(rng, (n, d, f), d ** -0.5)).astype(jnp.bfloat16)
    w2 = jnp.asarray(_rand(rng, (n, f, d), f ** -0.5)).astype(jnp.bfloat16)
    x = jnp.asarray(_rand(rng, (t, d))).astype(jnp.bfloat16)
    layer = jax_cute.kernelize(functools.partial(_layer, dtype=jnp.bfloat16))
    if policy:
        layer = jax.checkpoint(layer, policy=getattr(jax.checkpoint_policies, policy))
    step = jax.value_and_grad(_stack_loss(layer, jnp.bfloat16), argnums=(0, 1))
    with config.override(nan_fill=False):
        assert _compiled(step, w1, w2, x).count(LAUNCH) == 6
        value, (g1, g2) = jax.jit(step)(w1, w2, x)
    with jax.default_matmul_precision("highest"):
        ref, (r1, r2) = jax.jit(jax.value_and_grad(_stack_loss(functools.partial(_layer, dtype=jnp.float32), jnp.float32), argnums=(0, 1)))(w1, w2, x)
    assert_close(value, np.asarray(ref, np.float64), 3e-2, "loss")
    assert_close(g1, np.asarray(r1, np.float64), 3e-2, "dw1")
    assert_close(g2, np.asarray(r2, np.float64), 3e-2, "dw2")
