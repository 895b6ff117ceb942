"""A user kernel through jax_cute.cute_call on the GPU (``pytest -m gpu``): the example kernel
``out = a * alpha + b`` must match jnp exactly (alpha = 2 makes a*alpha exact, so FMA or not,
one rounding), inside jit, fori_loop, a CUDA graph and two threads."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import graph_capture
from jax_cute import config
from concurrently import run_concurrently

pytestmark = pytest.mark.gpu

_EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "custom_kernel.py"


@pytest.fixture(scope="module")
def example():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    spec = importlib.util.spec_from_file_location("custom_kernel_example", _EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def data(n, dtype, seed):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal(n), dtype), jnp.asarray(rng.standard_normal(n), dtype)


ALPHA = jnp.asarray([2.0], jnp.float32)


def ref(a, b):
    return (a.astype(jnp.float32) * 2.0 + b.astype(jnp.float32)).astype(a.dtype)


@pytest.mark.parametrize("n", [1, 1000, 4096, 1_000_003])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_exact_on_random_data(example, n, dtype):
    with config.override(strict=True, nan_fill=True):
        f = jax.jit(example.axpby_raw)
        a, b = data(n, dtype, n)
        assert "jax_cute_launch" in f.lower(a, b, ALPHA).compile().as_text()
        np.testing.assert_array_equal(np.asarray(f(a, b, ALPHA)), np.asarray(ref(a, b)))


def test_inside_fori_loop(example):
    a, b = data(4099, jnp.float32, 7)

    @jax.jit
    def loop(a, b):
        return jax.lax.fori_loop(0, 5, lambda i, x: example.axpby_raw(x, b, ALPHA) * 0.5, a)

    want = a
    for _ in range(5):
        want = ref(want, b) * 0.5
    np.testing.assert_array_equal(np.asarray(loop(a, b)), np.asarray(want))


def _while_bodies(hlo: str) -> list[str]:
    """The text of each while loop's body computation in compiled HLO."""
    names = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    blocks = re.split(r"\n(?=\S)", hlo)  # a computation starts at column 0
    return [b for b in blocks if re.match(r"%?([\w.\-]+) ", b) and re.match(r"%?([\w.\-]+) ", b).group(1) in names]


def test_in_place_loop_carry_is_updated_in_its_buffer(example):
    a, b = data(4099, jnp.float32, 9)
    a_before = np.asarray(a)

    def loop(steps, in_place):
        body = lambda i, x: example.axpby_raw(x, b, ALPHA, in_place=in_place)  # noqa: E731
        return jax.jit(lambda a, b: jax.lax.fori_loop(0, steps, body, a))

    want = a
    for _ in range(5):
        want = ref(want, b)
    for in_place in (False, True):
        np.testing.assert_array_equal(np.asarray(loop(5, in_place)(a, b)), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(a), a_before)  # the caller's array is not written
    # a long loop (not unrolled): with the carry aliased, no copy is left in the body
    bodies = _while_bodies(loop(1000, True).lower(a, b).compile().as_text())
    assert bodies, "no while loop in the compiled program"
    assert not any(re.search(r"\bcopy(-start)?\(", body) for body in bodies), bodies


def test_two_threads(example):
    f = jax.jit(example.axpby_raw)
    inputs = [data(100_003, jnp.float32, s) for s in (1, 2)]
    f(*inputs[0], ALPHA).block_until_ready()
    out = {}

    def work(i):
        for _ in range(50):
            out[i] = f(*inputs[i], ALPHA).block_until_ready()

    run_concurrently(work, [(0,), (1,)])
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(ref(*inputs[i])))


_PROBE = textwrap.dedent("""
    import importlib.util, sys, numpy as np, jax, jax.numpy as jnp
    spec = importlib.util.spec_from_file_location("ex", sys.argv[2]); ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    alpha = jnp.asarray([2.0], jnp.float32)
    f = jax.jit(lambda a, b: ex.axpby_raw(jnp.sin(a), b, alpha) + 1)
    rng = np.random.default_rng(0)
    for rep in range(3):
        a = jnp.asarray(rng.standard_normal(5000), jnp.float32); b = jnp.asarray(rng.standard_normal(5000), jnp.float32)
        want = np.asarray(jnp.sin(a)) * 2 + np.asarray(b) + 1
        np.testing.assert_allclose(np.asarray(f(a, b)), want, rtol=1e-6, atol=1e-6)
    sys.path.insert(0, sys.argv[-1]); import graph_capture; graph_capture.report(sys.argv[1], lambda: f(a, b))
""")


def test_captured_in_a_cuda_graph(example, tmp_path):
    env = dict(os.environ, XLA_FLAGS=graph_capture.graph_flags(str(tmp_path)))
    out = subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path), str(_EXAMPLE), str(pathlib.Path(__file__).parent)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "CAPTURED True" in out.stdout, out.stdout + out.stderr[-2000:]
