"""jax_cute.matmul on a Hopper GPU (``pytest -m gpu``).

Every test first checks, from the compiled HLO, that our kernel runs (our custom call, no cuBLAS
GEMM), then compares with a float32 reference on fresh random data. Tolerance: the largest
absolute error over the largest reference magnitude, 1e-2 for 16-bit outputs (one bf16
rounding of the result) and 1e-4 for f32 outputs (f32 accumulation order only).
"""

from __future__ import annotations

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
import jax_cute
from jax_cute import config
from concurrently import run_concurrently

pytestmark = pytest.mark.gpu

_seed = iter(range(10_000))


@pytest.fixture(autouse=True, scope="module")
def _hopper():
    cc = jax.devices()[0].compute_capability if jax.default_backend() == "gpu" else None
    # Hopper runs our verified kernels; a B200 runs the Blackwell ones when they are opted in.
    if not (cc == "9.0" or (cc == "10.0" and config.unverified_kernels())):
        pytest.skip(f"needs a compute capability 9.0 GPU (or 10.0 with JAX_CUTE_UNVERIFIED_KERNELS=1), got {cc}")


@pytest.fixture(autouse=True)
def _strict_and_nan_filled():
    # Strict: a silent fallback would pass the numerics and prove nothing about our kernel.
    # NaN fill: an output element the kernel never writes stays NaN and fails the comparison.
    with config.override(strict=True, nan_fill=True):
        yield


def rand(shape, dtype=jnp.bfloat16):
    rng = np.random.default_rng(next(_seed))
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)


def compiled_text(f, *args) -> str:
    return jax.jit(f).lower(*args).compile().as_text()


def assert_ours(f, *args, calls: int | None = None) -> None:
    text = compiled_text(f, *args)
    assert "jax_cute_launch" in text, "our custom call is missing"
    assert "cublas" not in text.lower(), "a cuBLAS GEMM is in the compiled module"
    if calls is not None:
        assert text.count('custom_call_target="jax_cute_launch"') == calls


def check(out, ref, dtype) -> None:
    out = np.asarray(out.astype(jnp.float32))
    ref = np.asarray(ref, np.float32)
    assert out.shape == ref.shape and np.isfinite(out).all()
    tol = 1e-4 if dtype == jnp.float32 else 1e-2
    err = np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30)
    assert err <= tol, f"relative error {err:.2e} > {tol}"


def ref_mm(a, b, ta=False, tb=False):
    a = jnp.swapaxes(a, -1, -2) if ta else a
    b = jnp.swapaxes(b, -1, -2) if tb else b
    return jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32), precision="highest")


SHAPES = [(1000, 1032, 776), (264, 136, 72), (8, 16, 8), (4096, 4096, 4096), (512, 8192, 8192), (130, 2056, 1032)]


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("out", [jnp.bfloat16, jnp.float32])
def test_random_data(m, n, k, out):
    a, b = rand((m, k)), rand((k, n))
    f = lambda x, y: jax_cute.matmul(x, y, preferred_element_type=out)  # noqa: E731
    assert_ours(f, a, b, calls=1)
    check(jax.jit(f)(a, b), ref_mm(a, b), out)


@pytest.mark.parametrize("epilogue", ["heuristic", "deferred"])
@pytest.mark.parametrize("k", [128, 192, 1000])
def test_epilogues_with_many_tiles_per_cta(k, epilogue, monkeypatch):
    """11 (K 128, 192) or 5 tiles per CTA, partial tiles along N, with the heuristic's
    whole-share epilogue (K = 128: the next tile's mainloop is 2 k-tiles, shorter than its
    stores) and with the deferred one (autotune's candidate): K = 128 leaves no k-tile after
    the deferred ones, 192 one (the stages are handed back together after it), 1000 many.
    Random data, then small integers (exact)."""
    import dataclasses

    from jax_cute.kernels import sm90_gemm
    from jax_cute.kernels.gemm_spec import GemmSpec
    m, n = (10000, 2056) if k < 1000 else (4000, 2056)
    pick = sm90_gemm.heuristic(GemmSpec("bfloat16", "bfloat16", "bfloat16", "k", "n", "n"), m, n, k, 1)
    assert pick.whole_c and sm90_gemm.tiles_per_cta(pick, m, n, 1) >= 5, pick
    want = pick if epilogue == "heuristic" else dataclasses.replace(pick, whole_c=False, epi_n=32,
                                                                    defer=sm90_gemm.DEFER)
    used = []
    monkeypatch.setattr(sm90_gemm, "heuristic", lambda *a, **kw: used.append(want) or want)
    jax.clear_caches()     # the other variant's executable must not be reused
    f = lambda x, y: jax_cute.matmul(x, y)  # noqa: E731
    a, b = rand((m, k)), rand((k, n))
    assert_ours(f, a, b, calls=1)
    assert used and set(used) == {want}
    check(jax.jit(f)(a, b), ref_mm(a, b), jnp.bfloat16)
    rng = np.random.default_rng(next(_seed))
    ai = jnp.asarray(rng.integers(-2, 3, (m, k)), jnp.bfloat16)
    bi = jnp.asarray(rng.integers(-2, 3, (k, n)), jnp.bfloat16)
    got = np.asarray(jax.jit(f)(ai, bi).astype(jnp.float32))
    # f32 accumulation of small integers is exact; the bf16 output rounds it once
    exact = np.asarray(ai, np.float32) @ np.asarray(bi, np.float32)
    np.testing.assert_array_equal(got, np.asarray(jnp.asarray(exact).astype(jnp.bfloat16).astype(jnp.float32)))
    jax.clear_caches()


@pytest.mark.parametrize("whole", [False, True])
@pytest.mark.parametrize("ta,tb", [(False, False), (True, True)])
@pytest.mark.parametrize("m,n,k", [(1000, 1032, 776), (264, 136, 72), (4096, 4096, 4096), (600, 4100, 300)])
def test_256_row_cooperative_tiles(m, n, k, ta, tb, whole, monkeypatch):
    """The 256 x 128 cooperative tile (autotune's candidate of Pallas's shape): each warpgroup
    owns two interleaved 64-row blocks, so a wrong block mapping leaves NaN rows or swaps them."""
    from jax_cute.kernels import sm90_gemm
    want = sm90_gemm.Config(256, 128, epi_n=64, whole_c=whole)
    monkeypatch.setattr(sm90_gemm, "heuristic", lambda *a, **kw: want)
    jax.clear_caches()
    a = rand((k, m) if ta else (m, k))
    b = rand((n, k) if tb else (k, n))
    f = lambda x, y: jax_cute.matmul(x, y, transpose_a=ta, transpose_b=tb)  # noqa: E731
    assert_ours(f, a, b, calls=1)
    check(jax.jit(f)(a, b), ref_mm(a, b, ta, tb), jnp.bfloat16)
    jax.clear_caches()


@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_every_layout(ta, tb, dtype):
    m, n, k = 520, 264, 1000
    a = rand((k, m) if ta else (m, k), dtype)
    b = rand((n, k) if tb else (k, n), dtype)
    f = lambda x, y: jax_cute.matmul(x, y, transpose_a=ta, transpose_b=tb)  # noqa: E731
    assert_ours(f, a, b, calls=1)
    check(jax.jit(f)(a, b), ref_mm(a, b, ta, tb), dtype)


def test_small_integers_are_exact():
    rng = np.random.default_rng(next(_seed))
    a = jnp.asarray(rng.integers(-4, 5, (1000, 776)), jnp.bfloat16)
    b = jnp.asarray(rng.integers(-4, 5, (776, 1032)), jnp.bfloat16)
    f = lambda x, y: jax_cute.matmul(x, y, preferred_element_type=jnp.float32)  # noqa: E731
    assert_ours(f, a, b)
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(a, b)), np.asarray(ref_mm(a, b)))


@pytest.mark.parametrize("sa,sb", [((3, 1000, 776), (3, 776, 520)), ((4, 264, 136), (136, 72)),
                                   ((264, 136), (5, 136, 72))])
def test_batched_and_broadcast(sa, sb):
    a, b = rand(sa), rand(sb)
    assert_ours(jax_cute.matmul, a, b, calls=1)
    check(jax.jit(jax_cute.matmul)(a, b), ref_mm(a, b), jnp.bfloat16)


@pytest.mark.parametrize("in_axes", [(0, 0), (1, None), (None, 2), (0, 1)])
def test_vmap(in_axes):
    bsz, m, k, n = 6, 264, 520, 136

    def make(shape, axis):
        return rand(shape) if axis is None else rand(shape[:axis] + (bsz,) + shape[axis:])

    a, b = make((m, k), in_axes[0]), make((k, n), in_axes[1])
    f = jax.vmap(jax_cute.matmul, in_axes=in_axes)
    assert_ours(f, a, b, calls=1)
    check(jax.jit(f)(a, b), jax.vmap(ref_mm, in_axes=in_axes)(a, b), jnp.bfloat16)


@pytest.mark.parametrize("sa,sb", [((520, 264), (264, 136)), ((4, 520, 264), (264, 136))])
def test_grad(sa, sb):
    a, b, w = rand(sa), rand(sb), rand(sa[:-1] + (sb[-1],))

    def loss(f):
        return lambda x, y: (f(x, y).astype(jnp.float32) * w.astype(jnp.float32)).sum()

    g = jax.grad(loss(jax_cute.matmul), (0, 1))
    assert_ours(g, a, b, calls=2)
    ga, gb = jax.jit(g)(a, b)
    ra, rb = jax.grad(loss(ref_mm), (0, 1))(a.astype(jnp.float32), b.astype(jnp.float32))
    check(ga, ra, jnp.bfloat16)
    check(gb, rb, jnp.bfloat16)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("m,n,k", [(1000, 1032, 784), (264, 136, 80), (4096, 4096, 4096),
                                   (2000, 2900, 520), (1000, 14336, 1024)])   # (pingpong 128x128, 128x160)
@pytest.mark.parametrize("out", [jnp.bfloat16, jnp.float32])
def test_fp8_inputs(dtype, m, n, k, out):
    # fp8 WGMMA takes both operands K-major: x (M, K) @ w (N, K)^T. The reference multiplies the
    # same fp8-rounded values in f32, so only accumulation order and the output rounding differ.
    # Tolerance 1e-2 even for f32 outputs: Hopper's fp8 WGMMA accumulates in reduced precision
    # inside each instruction chain (we do not promote partial sums to f32 per k-tile), measured
    # 1e-4..5e-3 relative error on an H200; small integers stay exact (next test).
    x, w = rand((m, k), dtype), rand((n, k), dtype)
    f = lambda a, b: jax_cute.matmul(a, b, transpose_b=True, preferred_element_type=out)  # noqa: E731
    assert_ours(f, x, w, calls=1)
    check(jax.jit(f)(x, w), ref_mm(x, w, tb=True), jnp.bfloat16)


def test_fp8_small_integers_are_exact_and_grads_run_in_bf16():
    rng = np.random.default_rng(next(_seed))
    x = jnp.asarray(rng.integers(-4, 5, (520, 272)), jnp.float8_e4m3fn)
    w = jnp.asarray(rng.integers(-4, 5, (264, 272)), jnp.float8_e4m3fn)
    f = lambda a, b: jax_cute.matmul(a, b, transpose_b=True, preferred_element_type=jnp.float32)  # noqa: E731
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(x, w)), np.asarray(ref_mm(x, w, tb=True)))
    # integer cotangent: every sum is exact in f32, so bf16 then fp8 rounding match bit for bit
    ct = jnp.asarray(rng.integers(-2, 3, (520, 264)), jnp.float32)
    g = jax.grad(lambda a, b: (f(a, b) * ct).sum(), (0, 1))
    assert_ours(g, x, w, calls=2)                    # both gradient GEMMs on the bf16 kernel
    gx, gw = jax.jit(g)(x, w)
    assert gx.dtype == x.dtype and gw.dtype == w.dtype

    def rounded(v):  # the documented rule: bf16 gradient GEMM, then rounded to the fp8 dtype
        return np.asarray(jnp.asarray(v).astype(jnp.bfloat16).astype(jnp.float8_e4m3fn).astype(jnp.float32))

    c, xf, wf = (np.asarray(v, np.float32) for v in (ct, x, w))
    np.testing.assert_array_equal(np.asarray(gx.astype(jnp.float32)), rounded(c @ wf))
    np.testing.assert_array_equal(np.asarray(gw.astype(jnp.float32)), rounded(c.T @ xf))


@pytest.mark.parametrize("sa,sb", [((1001, 1003), (1003, 517)), ((64, 7), (7, 33)), ((3, 130, 7), (3, 7, 127))])
def test_misaligned_sizes_run_the_kernel_on_padded_rows(sa, sb):
    """Rows that are not a multiple of 16 bytes (no TMA stride) are padded, never left to XLA's
    dot; every output element matches, padding included nowhere in the result."""
    a, b = rand(sa), rand(sb)
    with config.override(strict=True, nan_fill=True):
        f = lambda x, y: jax_cute.matmul(x, y)  # noqa: E731
        text = compiled_text(f, a, b)
        assert "jax_cute_launch" in text and "dot(" not in text
        check(jax.jit(f)(a, b), ref_mm(a, b), jnp.bfloat16)


def test_two_threads_at_once():
    pairs = [(rand((1000, 776)), rand((776, 1032))) for _ in range(2)]
    f = jax.jit(jax_cute.matmul)
    f(*pairs[0]).block_until_ready()
    results: dict[int, object] = {}

    def work(i):
        for _ in range(20):
            results[i] = f(*pairs[i]).block_until_ready()

    run_concurrently(work, [(0,), (1,)])
    for i in range(2):
        check(results[i], ref_mm(*pairs[i]), jnp.bfloat16)


def test_autotune_times_every_candidate_and_remembers_the_winner(tmp_path, caplog):
    """JAX_CUTE_AUTOTUNE=1: the first lowering of a problem times every candidate config on this
    GPU (interleaved rounds), keeps the fastest in autotune.json and runs it; a later lowering of
    the same problem reuses it without timing again; results stay right."""
    import json
    import logging

    from jax_cute import autotune
    from jax_cute.kernels import sm90_gemm
    from jax_cute.kernels.gemm_spec import GemmSpec

    a, b = rand((2048, 1024)), rand((1024, 2048))
    spec = GemmSpec("bfloat16", "bfloat16", "bfloat16", "k", "n", "n")
    candidates = {c.key() for c in sm90_gemm.candidate_configs(spec)}
    with config.override(autotune=True, cache_dir=str(tmp_path)), \
            caplog.at_level(logging.INFO, logger="jax_cute"):
        f = lambda x, y: jax_cute.matmul(x, y)  # noqa: E731
        text = compiled_text(f, a, b)
        timed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("jax_cute autotune ")]
        assert len(timed) == 1, timed
        entry = json.loads((tmp_path / "autotune.json").read_text())[
            autotune.problem_key(sm90_gemm, "sm_90a", spec, (2048, 2048, 1024, 1))]
        assert entry["config"] in candidates and entry["timed"] == len(candidates), entry
        print(timed[0])  # every candidate's rate, fastest first
        # a ~15 us product is timed 8 to a jit (one per call timed host dispatch: ~150 TFLOP/s for
        # every candidate on an H200; chained, ~320: still bound by the launch's host cost)
        assert entry["chain"] == autotune.CHAIN, entry
        assert "jax_cute_launch" in text and entry["config"] in text  # the winner runs
        check(jax.jit(f)(a, b), ref_mm(a, b), jnp.bfloat16)
        caplog.clear()
        g = lambda x, y: jax_cute.matmul(x, y) * 1  # noqa: E731  (a new function: lowered again)
        assert entry["config"] in compiled_text(g, a, b)
        assert not [r for r in caplog.records if r.getMessage().startswith("jax_cute autotune ")]


def test_stream_launch_with_pdl_orders_dependent_products():
    """command_buffer off: our calls go to the stream target with PDL kernels, which may start
    while the kernel before them drains. Four products back to back, each reading the one
    before (the third split-K, so an XLA zero-fill sits in front of it), must each see their
    input complete: every stage is checked against a float32 product of the input it actually
    got, on two input sets (a stale read would see the first set's data)."""
    dims = [(1000, 776), (776, 1032), (1032, 2056), (2056, 136), (136, 520)]

    def chain(x, *ws):
        outs = [x]
        for w in ws:
            outs.append(jax_cute.matmul(outs[-1], w))
        return outs[1:]

    with config.override(command_buffer=False, nan_fill=False):  # fills would sit between kernels
        f = jax.jit(lambda x, *ws: chain(x, *ws))
        for trial in range(2):
            x = rand(dims[0])
            # each weight scaled to keep the products near unit size
            ws = [(rand(d).astype(jnp.float32) / np.sqrt(d[0])).astype(jnp.bfloat16) for d in dims[1:]]
            if trial == 0:
                text = compiled_text(f, x, *ws)
                assert text.count('custom_call_target="jax_cute_launch_stream"') == 4, "stream calls missing"
                assert "cublas" not in text.lower() and text.count(".pdl") >= 4
                assert re.search(r"\.sk[2-8]\.", text), "the split-K stage is missing"
            outs = f(x, *ws)
            for i, (inp, w) in enumerate(zip([x, *outs[:-1]], ws)):
                check(outs[i], ref_mm(inp, w), jnp.bfloat16)


_GRAPH_PROBE = textwrap.dedent("""
    import sys, numpy as np, jax, jax.numpy as jnp, jax_cute
    f = jax.jit(lambda x, y: jax_cute.matmul(jnp.tanh(x), y) * 2)
    rng = np.random.default_rng(0)
    for rep in range(3):  # replays must see new input values
        a = jnp.asarray(rng.standard_normal((520, 264)), jnp.bfloat16)
        b = jnp.asarray(rng.standard_normal((264, 136)), jnp.bfloat16)
        out = np.asarray(f(a, b).astype(jnp.float32))
        ref = np.asarray(jnp.matmul(jnp.tanh(a).astype(jnp.float32), b.astype(jnp.float32)) * 2)
        assert np.abs(out - ref).max() / np.abs(ref).max() < 2e-2, rep
    sys.path.insert(0, sys.argv[-1]); import graph_capture; graph_capture.report(sys.argv[1], lambda: f(a, b))
""")


def test_captured_in_a_cuda_graph(tmp_path):
    """XLA command buffers (CUDA graphs) capture our custom call, and replays see new inputs."""
    env = graph_capture.child_env(str(tmp_path), JAX_CUTE_STRICT="1")
    out = subprocess.run([sys.executable, "-c", _GRAPH_PROBE, str(tmp_path), str(pathlib.Path(__file__).parent)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "CAPTURED True" in out.stdout, out.stdout + out.stderr[-2000:]


@pytest.mark.parametrize("da,db", [(jnp.float8_e4m3fn, jnp.float8_e5m2), (jnp.float8_e5m2, jnp.float8_e4m3fn)])
def test_mixed_fp8_inputs(da, db):
    """e4m3 x e5m2 (lax.dot_general's rule: no promotion) on one WGMMA, against f32 products of
    the same values."""
    x, w = rand((1000, 784), da), rand((1032, 784), db)
    f = lambda a, b: jax_cute.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)  # noqa: E731
    assert_ours(f, x, w, calls=1)
    check(jax.jit(f)(x, w), ref_mm(x, w, tb=True), jnp.bfloat16)
