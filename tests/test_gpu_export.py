"""jax.export across processes (``pytest -m gpu``): a function using jax_cute is exported on a
CPU-only process with an explicit target arch, serialised, and run here on the GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jax_cute

pytestmark = pytest.mark.gpu

_EXPORTER = textwrap.dedent("""
    import sys, jax, jax.numpy as jnp, jax_cute
    from jax import export
    def f(a, b):
        y = jax_cute.matmul(a, b, transpose_b=True)
        return y, jax.grad(lambda a, b: jax_cute.matmul(a, b, transpose_b=True).astype(jnp.float32).sum(),
                           argnums=(0, 1))(a, b)
    args = [jax.ShapeDtypeStruct((520, 264), jnp.bfloat16), jax.ShapeDtypeStruct((136, 264), jnp.bfloat16)]
    exp = export.export(jax.jit(f), platforms=["cuda"], disabled_checks=jax_cute.export_disabled_checks())(*args)
    assert jax.devices()[0].platform == "cpu"
    open(sys.argv[1], "wb").write(exp.serialize())
""")


def test_exported_on_cpu_runs_here(tmp_path):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    blob = tmp_path / "f.bin"
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_CUTE_TARGET_ARCH="sm_90a", JAX_CUTE_STRICT="1",
               JAX_CUTE_CACHE_DIR=str(tmp_path / "cache"))
    subprocess.run([sys.executable, "-c", _EXPORTER, str(blob)], env=env, check=True, timeout=300)
    exp = export.deserialize(blob.read_bytes())
    assert exp.mlir_module().count("jax_cute_launch") >= 3
    rng = np.random.default_rng(42)
    a = jnp.asarray(rng.standard_normal((520, 264)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((136, 264)), jnp.bfloat16)
    y, (ga, gb) = exp.call(a, b)
    ref = np.asarray(a, np.float32) @ np.asarray(b, np.float32).T
    assert np.abs(np.asarray(y, np.float32) - ref).max() / np.abs(ref).max() < 1e-2
    ones = np.ones((520, 136), np.float32)
    np.testing.assert_allclose(np.asarray(ga, np.float32), ones @ np.asarray(b, np.float32), rtol=2e-2, atol=2e-1)
    np.testing.assert_allclose(np.asarray(gb, np.float32), ones.T @ np.asarray(a, np.float32), rtol=2e-2, atol=2e-1)
    assert jax_cute.runtime.stats()["launches"] >= 3
