"""Checkpoint policies on a Hopper GPU: a kernelized MLP under ``jax.checkpoint(policy=
dots_saveable)`` launches no GEMM twice (as many kernels as without checkpoint, fewer than
``nothing_saveable``), in strict mode with NaN-filled outputs, and its gradients match a float64
host reference on fresh random data at odd sizes.

Run: ``pytest -m gpu tests/test_gpu_remat.py``.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cute
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

    def grad(fn):
        return jax.grad(lambda *a: jnp.sum(fn(*a) * r), argnums=(0, 1, 2, 3))

    kmlp = jax_cute.kernelize(mlp)
    launches = {name: _compiled(grad(jax.checkpoint(kmlp, policy=getattr(jax.checkpoint_policies, name))),
                                x, w1, b1, w2).count(LAUNCH)
                for name in ("dots_saveable", "nothing_saveable")}
    assert launches["dots_saveable"] == _compiled(grad(kmlp), x, w1, b1, w2).count(LAUNCH), launches
    assert launches["dots_saveable"] < launches["nothing_saveable"], launches

    dx, dw1, db1, dw2 = jax.jit(grad(jax.checkpoint(kmlp, policy=jax.checkpoint_policies.dots_saveable)))(x, w1, b1, w2)
    x64, w164, w264 = (np.asarray(v.astype(jnp.float32), np.float64) for v in (x, w1, w2))
    h, dh_dz = _act64("gelu", x64 @ w164 + np.asarray(b1, np.float64))
    h = np.asarray(jnp.asarray(h, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    r64 = np.asarray(r, np.float64)
    dz = (r64 @ w264.T) * dh_dz
    assert_close(dx, dz @ w164.T, 3e-2, "dx")
    assert_close(dw1, x64.T @ dz, 3e-2, "dw1")
    assert_close(db1, dz.sum(0), 3e-2, "db1")
    assert_close(dw2, h.T @ r64, 3e-2, "dw2")
