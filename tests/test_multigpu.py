"""The same kernels on every GPU of one process (``pytest -m multigpu`` on a 2+ GPU machine).

Our handler loads each kernel module once per device; each device runs its own copy on its
own stream. Kept out of ``-m gpu`` so a one-GPU machine does not count it as skipped.
"""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cute

pytestmark = pytest.mark.multigpu


def test_matmul_and_cute_call_on_every_device():
    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip("needs two GPUs")
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "custom_kernel.py"
    spec = importlib.util.spec_from_file_location("custom_kernel_example", path)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    rng = np.random.default_rng(0)
    with jax_cute.config.override(strict=True, nan_fill=True):
        mm = jax.jit(jax_cute.matmul)
        axpby = jax.jit(ex.axpby_raw)
        for i, dev in enumerate(devices):
            a = jax.device_put(jnp.asarray(rng.standard_normal((1000, 776)), jnp.bfloat16), dev)
            b = jax.device_put(jnp.asarray(rng.standard_normal((776, 1032)), jnp.bfloat16), dev)
            out = mm(a, b)
            assert out.devices() == {dev}
            ref = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
            assert np.abs(np.asarray(out, np.float32) - ref).max() / np.abs(ref).max() < 1e-2, i
            x = jax.device_put(jnp.asarray(rng.standard_normal(10_007), jnp.float32), dev)
            y = jax.device_put(jnp.asarray(rng.standard_normal(10_007), jnp.float32), dev)
            got = axpby(x, y, jax.device_put(jnp.asarray([2.0], jnp.float32), dev))
            np.testing.assert_array_equal(np.asarray(got), np.asarray(x) * 2 + np.asarray(y))
    stats = jax_cute.runtime.stats()
    assert stats["modules_created"] >= 2 * len(devices)  # one module per kernel per device
