"""GPU (H100/H200): ragged_dot on the grouped kernels against a float32 reference on fresh
random data, under jit, grad and vmap, with outputs NaN-filled before each launch so an
unwritten element shows. Each test first checks the compiled module launches our kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cute
from jax_cute.primitives.ragged_dot import ragged_dot

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _nan_fill_strict():
    with jax_cute.config.override(nan_fill=True, strict=True):
        yield


def ref_f32(x, w, gs):
    """float32 reference of the documented semantics (clipped sizes, trailing rows zero)."""
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(gs, 0)), x.shape[0])
    rows = jnp.arange(x.shape[0])
    gid = jnp.sum(rows[:, None] >= ends[None, :], axis=1)  # G for rows past the last group
    out = jnp.zeros((x.shape[0], w.shape[2]), jnp.float32)
    for g in range(w.shape[0]):  # one dense GEMM per group, masked to its rows
        y = jnp.dot(x.astype(jnp.float32), w[g].astype(jnp.float32), precision="highest")
        out = jnp.where((gid == g)[:, None], y, out)
    return out


def _sizes(kind, m, g, rng):
    if kind == "uniform":
        s = np.full(g, m // g)
    elif kind == "skewed":
        s = np.floor(rng.dirichlet(np.full(g, 0.3)) * m).astype(int)
    else:  # empty groups, and rows past the sum
        s = rng.integers(0, 2 * m // g, g)
        s[:: 3] = 0
        s = np.minimum(np.cumsum(s), m - 7) - np.concatenate([[0], np.minimum(np.cumsum(s), m - 7)[:-1]])
    return jnp.asarray(s, jnp.int32)


def _data(m, k, g, n, seed, dtype=jnp.bfloat16):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return (jax.random.normal(k1, (m, k), jnp.float32).astype(dtype),
            (jax.random.normal(k2, (g, k, n), jnp.float32) / np.sqrt(k)).astype(dtype))


def _assert_kernel(f, *args):
    assert "jax_cute_launch" in jax.jit(f).lower(*args).compile().as_text()


def _close(got, want, tol=2e-2):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert not np.isnan(got).any(), "unwritten (NaN) output elements"
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1.0, float(np.abs(want).max())))


SHAPES = [(1000, 256, 8, 384), (4096, 512, 16, 1024), (300, 128, 3, 136)]


@pytest.mark.parametrize("m,k,g,n", SHAPES)
@pytest.mark.parametrize("kind", ["uniform", "skewed", "empty"])
def test_forward_and_grads(m, k, g, n, kind):
    rng = np.random.default_rng(m + g)
    x, w = _data(m, k, g, n, seed=m * g)
    gs = _sizes(kind, m, g, rng)
    _assert_kernel(ragged_dot, x, w, gs)
    _close(jax.jit(ragged_dot)(x, w, gs), ref_f32(x, w, gs))
    ct = jax.random.normal(jax.random.key(7), (m, n), jnp.float32).astype(jnp.bfloat16)
    f = lambda x, w: ragged_dot(x, w, gs)  # noqa: E731
    vjp = jax.jit(lambda x, w, ct: jax.vjp(f, x, w)[1](ct))
    _assert_kernel(vjp, x, w, ct)
    dx, dw = vjp(x, w, ct)
    rdx, rdw = jax.vjp(lambda x, w: ref_f32(x, w, gs), x.astype(jnp.float32), w.astype(jnp.float32))[1](
        ct.astype(jnp.float32))
    _close(dx, rdx)
    _close(dw, rdw)


@pytest.mark.parametrize("m,k,g,n", SHAPES)
@pytest.mark.parametrize("epilogue", [None, "gelu", "swiglu"])
def test_forward_and_grads_on_1x2_clusters(m, k, g, n, epilogue):
    """ragged_m tiles on 1x2 clusters (A multicast to n-tiles of one m-tile; an odd n-tile count
    leaves the last cluster's second tile out of bounds), forced for every grouped product:
    forward (with a bias and an activation, the pre-activation output under grad) and lhs gradient
    on skewed sizes with empty groups and rows past the last group."""
    import dataclasses
    from unittest import mock

    from jax_cute.kernels import sm90_grouped
    pick = sm90_grouped.heuristic

    def forced(spec, *args, **kwargs):
        cfg = pick(spec, *args, **kwargs)
        return dataclasses.replace(cfg, cluster_n=2, tail_split=1) if spec.mode == "ragged_m" else cfg

    rng = np.random.default_rng(m + g + 5)
    x, w = _data(m, k, g, 2 * n if epilogue == "swiglu" else n, seed=m * g + 1)
    bias = (jax.random.normal(jax.random.key(9), (g, w.shape[2]), jnp.float32) * 0.5).astype(jnp.bfloat16)
    gs = _sizes("empty" if epilogue else "skewed", m, g, rng)
    act = {None: lambda z: z, "gelu": jax.nn.gelu,
           "swiglu": lambda z: jax.nn.silu(z[:, :n]) * z[:, n:]}[epilogue]

    def f(x, w, gs):
        if epilogue is None:
            return ragged_dot(x, w, gs)
        return ragged_dot(x, w, gs, bias=bias, activation=epilogue)

    def ref(x, w, gs):
        z = ref_f32(x, w, gs)
        if epilogue is not None:   # bias on the rows of a group only (the zero tail stays 0)
            ends = jnp.minimum(jnp.cumsum(jnp.maximum(gs, 0)), x.shape[0])
            gid = jnp.sum(jnp.arange(x.shape[0])[:, None] >= ends[None, :], axis=1)
            z = z + jnp.where((gid < g)[:, None], bias.astype(jnp.float32)[jnp.minimum(gid, g - 1)], 0.0)
        return act(z)

    ct = jax.random.normal(jax.random.key(8), (m, n), jnp.float32).astype(jnp.bfloat16)
    vjp = jax.jit(lambda x, w, ct: jax.vjp(lambda x, w: f(x, w, gs), x, w)[1](ct))
    with mock.patch.object(sm90_grouped, "heuristic", forced):
        _assert_kernel(f, x, w, gs)
        _close(jax.jit(f)(x, w, gs), ref(x, w, gs))
        _assert_kernel(vjp, x, w, ct)
        dx, dw = vjp(x, w, ct)
    rdx, rdw = jax.vjp(lambda x, w: ref(x, w, gs), x.astype(jnp.float32), w.astype(jnp.float32))[1](
        ct.astype(jnp.float32))
    _close(dx, rdx)
    _close(dw, rdw)


@pytest.mark.parametrize("sms", [132, 16])
@pytest.mark.parametrize("kind", ["uniform", "skewed", "empty"])
@pytest.mark.parametrize("m,k,g,n", [(600, 2304, 3, 2304), (1000, 2048, 8, 2304)])
def test_tail_split(m, k, g, n, kind, sms):
    """The ragged_m walk's last, partial round of tiles split along K into up to four units whose
    fp32 partials the last to arrive folds (Config.tail_split), forced for every ragged_m product
    it takes: on the full grid (every tile in the tail) and on 16 CTAs (whole rounds first),
    forward with and without a fused bias + gelu, and the lhs gradient; the same bits on a second
    run (the fold sums in split order)."""
    import dataclasses
    from unittest import mock

    from jax_cute.kernels import sm90_grouped
    pick = sm90_grouped.heuristic
    taken = []

    def forced(spec, *args, **kwargs):
        cfg = pick(spec, *args, **kwargs)
        if spec.mode == "ragged_m" and not spec.preact:
            taken.append(spec)
            return dataclasses.replace(cfg, tail_split=4, sms=sms, cluster_n=1)
        return cfg

    rng = np.random.default_rng(m + g + 11)
    x, w = _data(m, k, g, n, seed=m * g + 3)
    bias = (jax.random.normal(jax.random.key(4), (g, n), jnp.float32) * 0.5).astype(jnp.bfloat16)
    gs = _sizes(kind, m, g, rng)
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(gs, 0)), m)
    gid = jnp.sum(jnp.arange(m)[:, None] >= ends[None, :], axis=1)
    fused = lambda x, w, gs: ragged_dot(x, w, gs, bias=bias, activation="gelu")  # noqa: E731
    ref_fused = jax.nn.gelu(ref_f32(x, w, gs) + jnp.where((gid < g)[:, None],
                                                           bias.astype(jnp.float32)[jnp.minimum(gid, g - 1)], 0.0))
    ct = jax.random.normal(jax.random.key(6), (m, n), jnp.float32).astype(jnp.bfloat16)
    dlhs = jax.jit(lambda x, w, ct: jax.vjp(lambda x: ragged_dot(x, w, gs), x)[1](ct)[0])
    plain = lambda x, w, gs: ragged_dot(x, w, gs)  # noqa: E731  (this test's own jit cache entries)
    with mock.patch.object(sm90_grouped, "heuristic", forced):
        _assert_kernel(plain, x, w, gs)
        got = jax.jit(plain)(x, w, gs)
        again = jax.jit(plain)(x, w, gs)
        got_fused = jax.jit(fused)(x, w, gs)
        _assert_kernel(dlhs, x, w, ct)
        dx = dlhs(x, w, ct)
    assert len(taken) >= 3
    _close(got, ref_f32(x, w, gs))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(again))
    _close(got_fused, ref_fused)
    rdx = jax.vjp(lambda x: ref_f32(x, w.astype(jnp.float32), gs), x.astype(jnp.float32))[1](ct.astype(jnp.float32))[0]
    _close(dx, rdx)


def test_vmap_lhs_and_sizes():
    b, m, k, g, n = 3, 512, 256, 4, 256
    rng = np.random.default_rng(1)
    x = jax.random.normal(jax.random.key(2), (b, m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(3), (g, k, n), jnp.float32) / 16).astype(jnp.bfloat16)
    gs = jnp.stack([_sizes(kind, m, g, rng) for kind in ("uniform", "skewed", "empty")])
    f = jax.vmap(ragged_dot, (0, None, 0))
    _assert_kernel(f, x, w, gs)
    got = jax.jit(f)(x, w, gs)
    for i in range(b):
        _close(got[i], ref_f32(x[i], w, gs[i]))
    loss = lambda x, w: jnp.sum(f(x, w, gs).astype(jnp.float32) ** 2)  # noqa: E731
    _assert_kernel(jax.grad(loss, (0, 1)), x, w)
    dx, dw = jax.jit(jax.grad(loss, (0, 1)))(x, w)
    rl = lambda x, w: sum(jnp.sum(ref_f32(x[i], w, gs[i]) ** 2) for i in range(b))  # noqa: E731
    rdx, rdw = jax.grad(rl, (0, 1))(x.astype(jnp.float32), w.astype(jnp.float32))
    _close(dx, rdx, 5e-2)
    _close(dw, rdw, 5e-2)


def test_replay_with_new_sizes():
    m, k, g, n = 2048, 256, 8, 512
    x, w = _data(m, k, g, n, seed=11)
    f = jax.jit(ragged_dot)
    _assert_kernel(ragged_dot, x, w, _sizes("uniform", m, g, np.random.default_rng(0)))
    rng = np.random.default_rng(3)
    for kind in ("uniform", "skewed", "empty", "skewed"):
        gs = _sizes(kind, m, g, rng)
        _close(f(x, w, gs), ref_f32(x, w, gs))
    # documented bad sizes: negative counts as zero, ends clipped at M
    bad = jnp.asarray([-5, m, 300, -1, 7, 0, m, 2], jnp.int32)
    _close(f(x, w, bad), ref_f32(x, w, bad))


_GRAPH_PROBE = """
import sys, numpy as np, jax, jax.numpy as jnp, jax_cute
jax_cute.config.set(strict=True)
f = jax.jit(lambda x, w, gs: jax_cute.ragged_dot(jnp.tanh(x), w, gs) * 2)
rng = np.random.default_rng(0)
m, k, n, g = 520, 264, 136, 5
for rep in range(3):  # replays see new inputs and new group sizes
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((g, k, n)), jnp.bfloat16)
    cuts = np.sort(rng.integers(0, m + 1, g - 1))
    gs = jnp.asarray(np.diff(np.concatenate([[0], cuts, [m]])), jnp.int32)
    out = np.asarray(f(x, w, gs), np.float32)
    ref = np.asarray(jax.lax.ragged_dot(jnp.tanh(x).astype(jnp.float32), w.astype(jnp.float32), gs)) * 2
    assert np.abs(out - ref).max() / np.abs(ref).max() < 2e-2, rep
sys.path.insert(0, sys.argv[2]); import graph_capture; graph_capture.report(sys.argv[1], lambda: f(x, w, gs))
"""


def test_captured_in_a_cuda_graph(tmp_path):
    """XLA command buffers capture the grouped kernel; replays with new group sizes are right."""
    import pathlib
    import subprocess
    import sys

    import graph_capture

    env = graph_capture.child_env(str(tmp_path))
    out = subprocess.run([sys.executable, "-c", _GRAPH_PROBE, str(tmp_path), str(pathlib.Path(__file__).parent)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "CAPTURED True" in out.stdout, out.stdout + out.stderr[-2000:]


def ref_offset_f32(x, w, gs, offset):
    """float32 reference of group_offset: groups offset..offset+G-1 (of all of ``gs``) times
    w[0..G-1], every other row zero."""
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(gs, 0)), x.shape[0])
    starts = jnp.concatenate([jnp.zeros((1,), ends.dtype), ends[:-1]])
    rows = jnp.arange(x.shape[0])[:, None]
    out = jnp.zeros((x.shape[0], w.shape[2]), jnp.float32)
    for j in range(w.shape[0]):
        y = jnp.dot(x.astype(jnp.float32), w[j].astype(jnp.float32), precision="highest")
        out = jnp.where((rows >= starts[offset + j]) & (rows < ends[offset + j]), y, out)
    return out


# odd sizes, empty groups (local ones included), rows past the last group
OFFSET_SIZES = [37, 0, 129, 1, 255, 0, 77, 301]


@pytest.mark.parametrize("offset", [0, 2, 5], ids=["first", "middle", "last"])
def test_group_offset_forward_and_grads(offset):
    """Experts split across devices: 8 experts in group_sizes, 3 in rhs from ``offset``. The
    kernels run only the local groups' tiles and store zeros elsewhere (NaN-filled outputs show
    an unwritten row); the gradients' grouped GEMMs (ragged_m and ragged_k) take the offset too."""
    m, k, n, g = 1000, 256, 192, 3
    x, w = _data(m, k, g, n, seed=offset + 1)
    gs = jnp.asarray(OFFSET_SIZES, jnp.int32)
    off = jnp.int32(offset)
    f = lambda x, w, o: ragged_dot(x, w, gs, group_offset=o)  # noqa: E731
    _assert_kernel(f, x, w, off)
    _close(jax.jit(f)(x, w, off), ref_offset_f32(x, w, gs, offset))
    ct = jax.random.normal(jax.random.key(offset), (m, n), jnp.float32).astype(jnp.bfloat16)
    vjp = jax.jit(lambda x, w, o, ct: jax.vjp(lambda x, w: f(x, w, o), x, w)[1](ct))
    _assert_kernel(vjp, x, w, off, ct)
    dx, dw = vjp(x, w, off, ct)
    rdx, rdw = jax.vjp(lambda x, w: ref_offset_f32(x, w, gs, offset), x.astype(jnp.float32),
                       w.astype(jnp.float32))[1](ct.astype(jnp.float32))
    _close(dx, rdx)
    _close(dw, rdw)
