"""Block-scaled fp8 (jax_cute.fp8): quantization against a numpy reference, every scaled product
against a float64 product of the dequantised values, the fp8 training products' gradients
against the same recipe computed in float64, kernelize(fp8=...), vmap/jit, and errors.

Data in DeepGEMM's test style: normal values, and heavy-tailed ones (each row times a random
power of two, plus a few large outliers), on sizes that are not multiples of 128.
"""

from __future__ import annotations

import importlib
import logging

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp8_bound  # tests/ is on sys.path under pytest
import scanned_stack
import jax_cute
from jax_cute import arch, config
from jax_cute.fp8 import (WEIGHTS, BlockScaled, Blockwise, dequantize, grouped_linear, linear, quantize,
                          quantize_grouped, ragged_k_dot)

E4M3 = np.dtype(jnp.float8_e4m3fn)


@pytest.fixture(autouse=True)
def _quiet():
    # every scaled call logs its fallback to XLA (no kernel yet); keep the test log readable
    logging.getLogger("jax_cute").setLevel(logging.ERROR)
    yield
    logging.getLogger("jax_cute").setLevel(logging.NOTSET)


data = fp8_bound.data


def bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8)


# -- numpy references -------------------------------------------------------------------------

def np_quantize(x: np.ndarray, block: tuple[int, ...], pow2: bool = False):
    """Values and scales by the definition: per block amax / 448 (or the power of two above)."""
    block = (1,) * (x.ndim - len(block)) + tuple(block)
    nb = tuple(-(-n // b) for n, b in zip(x.shape, block))
    scales = np.ones(nb, np.float32)
    for idx in np.ndindex(*nb):
        sl = tuple(slice(i * b, (i + 1) * b) for i, b in zip(idx, block))
        amax = np.float32(np.max(np.abs(x[sl]))) if x[sl].size else np.float32(0)
        if amax > 0:
            s = np.float32(amax * np.float32(1 / 448))
            if pow2:
                s = np.float32(2.0 ** np.ceil(np.log2(np.float64(amax) / 448.0)))
            scales[idx] = s
    full = scales
    for ax, b in enumerate(block):
        full = np.repeat(full, b, axis=ax)
    full = full[tuple(slice(0, n) for n in x.shape)]
    values = np.clip(x / full, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return values, scales, full


_dequantize = jax.jit(dequantize)


def deq(q: BlockScaled) -> np.ndarray:
    return np.asarray(_dequantize(q), np.float64)


def rel(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-300))


def calc_diff(out, ref) -> float:
    """DeepGEMM's similarity measure: 1 - 2<x,y> / (|x|^2 + |y|^2)."""
    x, y = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(1 - 2 * np.sum(x * y) / np.sum(x * x + y * y))


# -- quantize ----------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,block,kind,pow2", [
    ((300, 200), (1, 128), "normal", False), ((300, 200), (1, 128), "heavy", True),
    ((3, 130, 257), (1, 128), "heavy", False), ((256, 384), (128, 128), "normal", True),
    ((200, 130), (128, 128), "heavy", False), ((200, 130), (128, 128), "heavy", True),
    ((257, 96), (128, 1), "heavy", False), ((1, 5), (1, 128), "normal", True)])
def test_quantize_matches_definition(shape, block, kind, pow2):
    x = data(shape, kind)
    q = jax.jit(lambda x: quantize(x, block, pow2_scales=pow2))(x)
    values, scales, full = np_quantize(x, block, pow2)
    assert q.values.dtype == E4M3 and q.scales.dtype == np.float32 and q.blocks[-len(block):] == block
    np.testing.assert_array_equal(np.asarray(q.scales), scales)
    np.testing.assert_array_equal(np.asarray(q.values).view(np.uint8), values.view(np.uint8))
    # round trip: within half an e4m3 step of each value (relative 2^-4), or of the subnormal step
    err = np.abs(deq(q) - x)
    assert np.all(err <= np.maximum(np.abs(x) * 2.0 ** -4, full * 2.0 ** -10) * (1 + 1e-6))
    assert np.max(np.abs(np.asarray(q.values, np.float32))) <= 448
    if pow2:
        m, _ = np.frexp(np.asarray(q.scales))
        assert np.all(m == 0.5)


def test_quantize_zero_blocks_and_bf16_input():
    x = np.zeros((4, 256), np.float32)
    x[1, 130] = -3.0
    q = quantize(jnp.asarray(x, jnp.bfloat16))
    s = np.float32(3) * np.float32(1 / 448)
    np.testing.assert_array_equal(np.asarray(q.scales), np.asarray([[1, 1], [1, s], [1, 1], [1, 1]], np.float32))
    np.testing.assert_allclose(deq(q), x, rtol=1e-6)


@pytest.mark.parametrize("sizes", [[100, 0, 150, 30], [0, 0, 0, 0], [128, 128, 44, 0], [500, 7, 0, 0]])
def test_quantize_grouped_blocks_restart_at_groups(sizes):
    t = 300
    x = data((5, t), "heavy", 1)
    q = jax.jit(quantize_grouped)(x, np.asarray(sizes, np.int32))
    ends = np.minimum(np.cumsum(np.clip(sizes, 0, None)), t)
    starts = np.concatenate([[0], ends[:-1]])
    want = np.zeros_like(x)
    j = 0
    for s, e in zip(starts, ends):  # every group quantized on its own, blocks from its start
        for b in range(s, e, 128):
            v, sc, _ = np_quantize(x[:, b:min(b + 128, e)], (1, 128))
            np.testing.assert_array_equal(np.asarray(q.scales[:, j]), sc[:, 0])
            want[:, b:min(b + 128, e)] = v.astype(np.float32) * sc
            j += 1
    assert q.scales.shape == (5, (t + 127 * 4) // 128)
    np.testing.assert_array_equal(np.asarray(q.scales[:, j:]), 1)
    np.testing.assert_array_equal(deq(q), want)  # elements past the last group are zero


def test_block_scaled_is_a_pytree_and_transposes():
    q = quantize(data((256, 384), "normal"), "128x128")
    leaves, tree = jax.tree.flatten(q)
    assert len(leaves) == 2 and jax.tree.unflatten(tree, leaves).block == q.block
    t = q.T
    np.testing.assert_array_equal(deq(t), deq(q).T)
    assert t.scales.shape == (3, 2)


# -- scaled products -----------------------------------------------------------------------

@pytest.mark.parametrize("kind,m,k,n", [("normal", 200, 300, 160), *(pytest.param(*p, marks=pytest.mark.sweep) for p in (
    ("heavy", 64, 128, 256), ("heavy", 3, 300, 130)))])
def test_scaled_matmul_forward(kind, m, k, n):
    x, w = data((m, k), kind, 2), data((k, n), kind, 3)
    xq, wq = quantize(x), quantize(w, "128x128")
    ref = deq(xq) @ deq(wq)
    out = jax.jit(lambda a, b: jax_cute.matmul(a, b, preferred_element_type=jnp.float32))(xq, wq)
    assert out.dtype == np.float32 and rel(out, ref) <= 1e-3 and rel(out, ref) < 1e-5
    # the weight stored (N, K), as many checkpoints are: transpose_b
    wt = quantize(w.T, "128x128")
    out_t = jax_cute.matmul(xq, wt, transpose_b=True, preferred_element_type=jnp.float32)
    assert rel(out_t, ref) < 1e-5
    bf = jax_cute.matmul(xq, wq)  # bfloat16 by default
    assert bf.dtype == jnp.bfloat16
    assert calc_diff(bf, ref) < 1e-3
    np.testing.assert_allclose(np.asarray(bf, np.float32), np.asarray(jnp.asarray(ref, jnp.bfloat16), np.float32),
                               rtol=2 ** -7, atol=1e-30)


@pytest.mark.parametrize("kind", ["normal", "heavy"])
def test_gpu_accuracy_bound_catches_a_wrong_scale(kind):
    """test_gpu_fp8's element-wise bound (fp8_bound: 1e-3 of the row max, half an ulp, 2^-11 of
    sum|a b| for the tensor core's accumulation) is loose enough for the hardware and still tight
    enough to see one scale block off by 1%: through the reference path here, the right product
    passes it and products with one A or one B scale (a 128-K block) perturbed fail it."""
    x, w = data((256, 256), kind, 20), data((256, 384), "normal", 21)
    xq, wq = quantize(x), quantize(w, "128x128")
    out = jax_cute.matmul(xq, wq, preferred_element_type=jnp.float32)
    a, b = jnp.asarray(deq(xq)), jnp.asarray(deq(wq))
    fp8_bound.check(out, a @ b, fp8_bound.abs_product(a, b))

    def off(q: BlockScaled, index) -> BlockScaled:
        return BlockScaled(q.values, q.scales.at[index].multiply(1.01), q.block, q.group_sizes)

    for xw, ww in ((off(xq, (7, 1)), wq), (xq, off(wq, (1, 2)))):
        wrong = jnp.asarray(deq(xw)) @ jnp.asarray(deq(ww))
        with pytest.raises(AssertionError, match="elements off"):
            fp8_bound.check(out, wrong, fp8_bound.abs_product(a, b))


def test_scaled_products_of_every_block_form():
    """1x128 x 1x128 (a weight gradient), 128x128 x 1x128, batch dims, several free dims."""
    a, b = data((256, 300), "heavy", 4), data((130, 300), "heavy", 5)
    for ba, bb in [((1, 128), (1, 128)), ((128, 128), (1, 128)), ((1, 128), (128, 128))]:
        qa, qb = quantize(a, ba), quantize(b, bb)
        out = jax_cute.dot_general(qa, qb, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        assert rel(out, deq(qa) @ deq(qb).T) < 1e-5, (ba, bb)
    x, y = data((2, 3, 40, 256), "normal", 6), data((2, 256, 3, 24), "normal", 7)
    qx, qy = quantize(x), quantize(np.moveaxis(y, 1, -1))  # blocks along the contracting axis
    qy = BlockScaled(jnp.moveaxis(qy.values, -1, 1), jnp.moveaxis(qy.scales, -1, 1), (1, 128, 1, 1))
    out = jax_cute.dot_general(qx, qy, (((3,), (1,)), ((0,), (0,))), preferred_element_type=jnp.float32)
    ref = np.einsum("bhtk,bkje->bhtje", deq(qx), deq(qy))
    assert out.shape == ref.shape and rel(out, ref) < 1e-5


@pytest.mark.parametrize("activation", [None, *(pytest.param(a, marks=pytest.mark.sweep) for a in ("relu",)), "gelu",
                                        pytest.param("silu", marks=pytest.mark.sweep), "swiglu"])
def test_scaled_epilogue(activation):
    x, w, bias = data((100, 256), "normal", 8), data((256, 256), "normal", 9), data((256,), "normal", 10)
    xq, wq = quantize(x), quantize(w, "128x128")
    z = deq(xq) @ deq(wq) + bias
    ref = np.asarray(jax_cute.activations.apply_activation(activation, jnp.asarray(z, jnp.float32)))
    out = jax_cute.matmul(xq, wq, bias=bias, activation=activation, preferred_element_type=jnp.float32)
    assert out.shape == ref.shape and rel(out, ref) < 1e-5


@pytest.mark.parametrize("kind,sizes", [("heavy", [100, 0, 150, 30]), *(pytest.param(*p, marks=pytest.mark.sweep) for p in (
    ("normal", [0, 300, 0, 0]), ("heavy", [90, 90, 90, 90])))])
def test_scaled_ragged_dot(kind, sizes):
    m, k, n = 300, 260, 136
    x, w = data((m, k), kind, 11), data((4, k, n), kind, 12)
    gs = np.asarray(sizes, np.int32)
    xq, wq = quantize(x), quantize(w, "128x128")
    ends = np.minimum(np.cumsum(gs), m)
    starts = np.concatenate([[0], ends[:-1]])
    ref = np.zeros((m, n))
    for g, (s, e) in enumerate(zip(starts, ends)):
        ref[s:e] = deq(xq)[s:e] @ deq(wq)[g]
    out = jax.jit(lambda a, b, s: jax_cute.ragged_dot(a, b, s, preferred_element_type=jnp.float32))(xq, wq, gs)
    assert rel(out, ref) < 1e-5
    bias = data((4, n), "normal", 13)
    out = jax_cute.ragged_dot(xq, wq, gs, bias=bias, activation="relu", preferred_element_type=jnp.float32)
    inside = (np.arange(m) < ends[-1])[:, None]
    group = np.minimum(np.searchsorted(ends, np.arange(m), side="right"), 3)
    assert rel(out, np.where(inside, np.maximum(ref + bias[group], 0), 0)) < 1e-5


@pytest.mark.parametrize("sizes", [[100, 0, 150, 30], *(pytest.param(s, marks=pytest.mark.sweep) for s in (
    [300, 0, 0, 0], [1, 2, 3, 4]))])
def test_ragged_k_dot(sizes):
    t, p, q = 300, 136, 72
    a, b = data((p, t), "heavy", 14), data((q, t), "heavy", 15)
    gs = np.asarray(sizes, np.int32)
    qa, qb = quantize_grouped(a, gs), quantize_grouped(b, gs)
    ends = np.minimum(np.cumsum(gs), t)
    starts = np.concatenate([[0], ends[:-1]])
    da, db = deq(qa), deq(qb)
    ref = np.stack([da[:, s:e] @ db[:, s:e].T for s, e in zip(starts, ends)])
    out = jax.jit(ragged_k_dot)(qa, qb, gs)
    assert out.dtype == np.float32 and out.shape == (4, p, q)
    assert rel(out, ref) < 1e-5


def _kernel_walk(qa: BlockScaled, qb: BlockScaled, gs) -> np.ndarray:
    """What the ragged-K kernel computes, in numpy, from the operands its lowering passes it: T laid
    out group-aligned (scaled.group_aligned), the group sizes clipped to T and rounded up to 128 by
    the kernel's scan, group g's k-tile j at 128 (f_g + j) with scale block f_g + j of both."""
    from jax_cute.fp8 import scaled
    t, tb = qa.shape[1], qa.scales.shape[1]
    a = np.asarray(scaled.group_aligned(qa.values, gs, tb), np.float64)
    b = np.asarray(scaled.group_aligned(qb.values, gs, tb), np.float64)
    sa, sb = np.asarray(qa.scales, np.float64), np.asarray(qb.scales, np.float64)
    ends = np.minimum(np.cumsum(np.maximum(gs, 0)), t)
    sizes = np.diff(ends, prepend=0)
    out = np.zeros((len(gs), a.shape[0], b.shape[0]))
    f = 0
    for g, size in enumerate(sizes):
        for j in range(-(-size // 128)):
            k = slice(128 * (f + j), 128 * (f + j + 1))
            out[g] += (a[:, k] @ b[:, k].T) * sa[:, f + j, None] * sb[None, :, f + j]
        f += -(-size // 128)
    return out


@pytest.mark.parametrize("sizes", [*(pytest.param(s, marks=pytest.mark.sweep) for s in (
    [0, 300, 77, 0, 523, 1], [128, 256, 0], [1000])), [5, 0, 0]])
def test_ragged_k_kernel_layout(sizes):
    """The ragged-K kernel's operands (group-aligned T, every k-tile one scale block of one group,
    zeros past each group's end) give the product the reference computes: the layout the kernel's
    walk assumes, checked on the CPU."""
    t, p, q = 1000, 40, 24
    gs = np.asarray(sizes, np.int32)
    qa, qb = quantize_grouped(data((p, t), "heavy", 31), gs), quantize_grouped(data((q, t), "normal", 32), gs)
    want = np.asarray(jax.jit(ragged_k_dot)(qa, qb, gs), np.float64)
    assert rel(_kernel_walk(qa, qb, gs), want) < 1e-6


def _sm90_text(f, *args, opt_in: bool = False, strict: bool = False) -> str:
    """``f``'s StableHLO lowered for sm_90a on this machine."""
    with config.override(target_arch="sm_90a", unverified_kernels=opt_in, strict=strict):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _assert_one_kernel(text: str, *marks: str) -> None:
    """One launch of our kernel (its name holding ``marks``) and no XLA dot in ``text``."""
    assert text.count("@jax_cute_launch") == 1 and "stablehlo.dot_general" not in text
    assert all(m in text for m in marks), marks


def test_ragged_k_lowers_to_the_hopper_kernel(caplog, monkeypatch):
    """Lowered for sm_90a on the CPU: the ragged-K product is our custom call (the block-scaled
    ragged_k kernel; no dot left). Listed as an unverified variant (as a new kernel is until its
    GPU tests pass) it is opt-in: without the opt-in it stays XLA's with a log line saying why and
    how to opt in, and strict mode raises."""
    pytest.importorskip("cutlass")
    sizes = jnp.asarray([0, 100, 300, 77, 0, 523], jnp.int32)
    x, y = data((256, 1000), "normal", 33), data((200, 1000), "normal", 34)

    def fresh():   # a new function each time: no cached lowering
        return lambda x, y: ragged_k_dot(quantize_grouped(x, sizes), quantize_grouped(y, sizes), sizes)

    text = _sm90_text(fresh(), x, y, strict=True)
    # the GEMM, and x's group-aligned layout by the transposing kernel (y's 200 rows are not whole
    # 64-row tiles: XLA's gather)
    assert text.count("@jax_cute_launch") == 2 and "stablehlo.dot_general" not in text
    assert "ragged_k" in text and "scaled1x1" in text and text.count('name = "fp8_aligned_transpose"') == 1
    monkeypatch.setattr(arch, "UNVERIFIED_VARIANTS", {"sm_90a": frozenset({"scaled_ragged_k"})})
    assert _sm90_text(fresh(), x, y, opt_in=True, strict=True).count("@jax_cute_launch") == 2
    logging.getLogger("jax_cute").setLevel(logging.WARNING)
    with caplog.at_level(logging.WARNING, logger="jax_cute"):
        text = _sm90_text(fresh(), x, y)
    assert "@jax_cute_launch" not in text and "stablehlo.dot_general" in text
    assert "not yet run on hardware" in caplog.text and "JAX_CUTE_UNVERIFIED_KERNELS=1" in caplog.text
    with pytest.raises(jax_cute.FallbackError, match="not yet run on hardware"):
        _sm90_text(fresh(), x, y, strict=True)


def test_aligned_transpose_reference_is_the_group_aligned_gather():
    """The transposing kernel's reference (what it must compute, from token-major values) is
    the group-aligned layout the ragged-K lowering gathers otherwise."""
    from jax_cute.fp8 import wgrad_operands as wo
    from jax_cute.fp8.quantize import group_blocks
    from jax_cute.fp8.scaled import group_aligned

    t, sizes = 1000, jnp.asarray([300, 0, 451, 249], jnp.int32)
    xt = jnp.asarray(np.random.default_rng(5).integers(0, 256, (t, 192), dtype=np.uint8)).view(jnp.float8_e4m3fn)
    _, bstart, blen, _ = group_blocks(sizes, t)
    got, want = wo.transpose_reference(xt, bstart, blen), group_aligned(xt.T, sizes, bstart.shape[0])
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
    assert wo.supported(192) and not wo.supported(200) and not wo.supported(0)


@pytest.mark.parametrize("launcher, dtype, values", [("quantize_rows_and_tokens", "bfloat16", 128),
                                                     pytest.param("quantize_tokens", "float32", 64, marks=pytest.mark.sweep)])
def test_quantizer_kernels_divide_by_a_corrected_reciprocal(launcher, dtype, values):
    """The one-pass quantizers (kernels/fp8_operands.py) compile for sm_90a with each value's
    quotient a multiply by the block's reciprocal and two FMAs (div.rn kept for extreme scales),
    without spills, every 16-byte load of the staged tile issued before its first store to shared
    memory (loads behind per-row branches kept one in flight a thread), and 16-byte fp8 stores."""
    pytest.importorskip("cutlass")
    from jax_cute.kernels import abi, build, cubin_info, fp8_operands

    t, r, nb = 1024, 256, 8
    def arg(name, dt, shape):
        return abi.TensorArg(name, dt, shape, tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape))), align=16)
    both = launcher == "quantize_rows_and_tokens"   # (values: a thread's, 64 a block)
    outs = [arg("out0", "float8_e4m3fn", (t, r)), arg("out1", "float32", (t, r // 128))] if both else []
    sig = (abi.StreamArg(), arg("in0", dtype, (t, r)), arg("in1", "int32", (nb,)), arg("in2", "int32", (nb,)),
           *outs, arg(f"out{len(outs)}", "float8_e4m3fn", (r, 128 * nb)), arg(f"out{len(outs) + 1}", "float32", (r, nb)))
    binary = build.compile_launcher(getattr(fp8_operands, launcher), sig, arch="sm_90a", name=launcher, keep_ptx=True)
    res = cubin_info.resources(binary.obj)
    assert res["local_bytes"] == 0, res
    ptx = binary.ptx
    assert ptx.count("fma.rn.f32") == 2 * values and ptx.count("mul.f32") >= values and "div.rn.f32" in ptx
    # four 16-byte stores for each 64-value block a thread writes (_store_quantized), no byte stores
    assert ptx.count("st.global.v4") == 4 * (2 if both else 1) and "st.global.b8" not in ptx
    staging = ptx.split("st.shared")[0]
    assert staging.count("ld.global.v4") == 8 * (2 if dtype == "float32" else 1) and "bra" not in staging.split("ld.global.v4")[-1]


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float32", marks=pytest.mark.sweep)])
def test_weight_quantizer_kernel_compiles_for_sm90(dtype):
    """The weights' one-pass quantizer (kernels/fp8_operands.quantize_weight) compiles for sm_90a
    with the signature cute_call gives a single weight (a (1, K, N) stack): the block's amax
    reduced across the warp by shuffles, each thread's 64 values of a row and 64 of a column
    divided as the other quantizers divide, no spills, and 16-byte global loads and stores (with
    a stride of 1 on the extent-1 axis they compiled to single bytes, 5.6x slower on an H200)."""
    pytest.importorskip("cutlass")
    from jax_cute.kernels import build, cubin_info, fp8_operands
    from jax_cute.primitives.cute_call import _signature

    S = jax.ShapeDtypeStruct
    outs = [S((1, 256, 384), E4M3), S((1, 384, 256), E4M3), S((1, 2, 3), np.float32)]
    sig = _signature([S((1, 256, 384), dtype)], outs, [None], [None] * 3)
    binary = build.compile_launcher(fp8_operands.quantize_weight, sig, arch="sm_90a", name="quantize_weight",
                                    keep_ptx=True)
    assert cubin_info.resources(binary.obj)["local_bytes"] == 0
    ptx = binary.ptx
    assert ptx.count("fma.rn.f32") == 2 * 128 and "shfl.sync.bfly" in ptx and "div.rn.f32" in ptx
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx and "st.global.b8" not in ptx


@pytest.mark.parametrize("dtype", [E4M3, np.dtype(jnp.float8_e5m2)], ids=["e4m3", "e5m2"])
def test_quantize_tokens_reference_is_the_quantizer(dtype):
    """The token kernel's reference (what it must compute) is the quantizer's result, in the
    group-aligned layout: uniform blocks as ``quantize(x, (128, 1)).T`` zero-padded to whole
    blocks, group blocks as ``quantize_grouped(x.T)`` gathered group-aligned; an all-zero block
    (scale 1), a partial last block, an empty group and tokens past the last group."""
    from jax_cute.fp8 import wgrad_operands as wo
    from jax_cute.fp8.quantize import group_blocks
    from jax_cute.fp8.scaled import group_aligned

    t, r = 1000, 192
    x = np.array(data((t, r), "heavy", 41))
    x[128:256] = 0
    x = jnp.asarray(x)
    values, scales = wo.quantize_reference(x, *wo.uniform_blocks(t), dtype)
    q = quantize(x, (128, 1), dtype=dtype).T
    assert values.shape == (r, 1024) and scales.shape == q.scales.shape
    np.testing.assert_array_equal(bits(values[:, :t]), bits(q.values))
    np.testing.assert_array_equal(bits(values[:, t:]), 0)
    np.testing.assert_array_equal(np.asarray(scales), np.asarray(q.scales))
    assert np.all(np.asarray(scales)[:, 1] == 1)
    sizes = jnp.asarray([300, 0, 451, 199], jnp.int32)
    _, bstart, blen, _ = group_blocks(sizes, t)
    values, scales = wo.quantize_reference(x, bstart, blen, dtype)
    qg = quantize_grouped(x.T, sizes, dtype=dtype)
    np.testing.assert_array_equal(bits(values), bits(group_aligned(qg.values, sizes, bstart.shape[0])))
    np.testing.assert_array_equal(np.asarray(scales), np.asarray(qg.scales))


def test_rows_and_group_tokens_reference():
    """What the grouped layer's one-pass quantizer computes (its reference, which runs here):
    ``quantize(x, "1x128")``'s rows inside the groups, zeros with scale 1 past the last group, and
    the token kernel's group-aligned blocks."""
    from jax_cute.fp8 import wgrad_operands as wo
    from jax_cute.fp8.quantize import group_blocks

    x, sizes = data((300, 256), "heavy", 7), jnp.asarray([130, 0, 150], jnp.int32)   # 20 tokens past the end
    rows, (values, scales) = jax.jit(wo.quantize_rows_and_group_tokens)(x, sizes)
    q = quantize(x, "1x128")
    np.testing.assert_array_equal(bits(rows.values[:280]), bits(q.values[:280]))
    np.testing.assert_array_equal(np.asarray(rows.scales[:280]), np.asarray(q.scales[:280]))
    assert not bits(rows.values[280:]).any() and (np.asarray(rows.scales[280:]) == 1).all()
    want = wo.quantize_reference(x, *group_blocks(sizes, 300)[1:3], E4M3)
    np.testing.assert_array_equal(bits(values), bits(want[0]))
    np.testing.assert_array_equal(np.asarray(scales), np.asarray(want[1]))


@pytest.mark.sweep   # (a kernel compile: CI's second step)
def test_rows_and_group_tokens_kernel_compiles_for_sm90():
    """The grouped layer's quantizer compiles for sm_90a as two kernels in one launch: the
    rows-and-tokens kernel over the group blocks, then the one that writes the rows past the last
    group (zeros, 16-byte stores; scale 1); no spills."""
    pytest.importorskip("cutlass")
    from jax_cute.kernels import build, cubin_info, fp8_operands
    from jax_cute.primitives.cute_call import _signature

    S = jax.ShapeDtypeStruct
    t, r, nb = 300, 256, 5
    ins = [S((t, r), jnp.bfloat16), S((nb,), np.int32), S((nb,), np.int32), S((1,), np.int32)]
    outs = [S((t, r), E4M3), S((t, r // 128), np.float32), S((r, 128 * nb), E4M3), S((r, nb), np.float32)]
    binary = build.compile_launcher(fp8_operands.quantize_rows_and_group_tokens,
                                    _signature(ins, outs, [None] * 4, [None] * 4), arch="sm_90a",
                                    name="quantize_rows_and_group_tokens", keep_ptx=True)
    assert cubin_info.resources(binary.obj)["local_bytes"] == 0
    entries = binary.ptx.split(".entry")[1:]
    assert len(entries) == 2
    zero = next(e for e in entries if "_zero_rows_kernel" in e.splitlines()[0])
    assert "st.global.v4" in zero and "st.global.b8" not in zero


@pytest.mark.parametrize("grouped, k, out", [(False, 192, jnp.float32), (True, 192, jnp.float32),
                                              *(pytest.param(*c, marks=pytest.mark.sweep)   # (5 s each)
                                                for c in ((False, 256, jnp.bfloat16), (True, 256, jnp.bfloat16)))],
                         ids=["dense", "grouped", "dense-rows", "grouped-weights"])
def test_wgrad_operand_kernel_path_is_the_xla_path(grouped, k, out, monkeypatch):
    """The gradients with the operands quantized by the kernels' path (the token kernels' and the
    weight kernel's, whose forward operand is its transposed copy read back transposed; their
    references here) equal, bit for bit, those with XLA's quantization: 300 tokens (a partial
    block: the kernel's operands are zero-padded), an empty group and tokens past the last group
    (which the grouped kernel's rows quantize as zeros). An operand whose columns are whole 1 x 128
    blocks (the cotangent, N = 128; x with K = 256) is quantized both ways (1 x 128 along its
    columns, and along the tokens) in one kernel."""
    pytest.importorskip("cutlass")
    lin = importlib.import_module("jax_cute.fp8.linear")

    m, n = 300, 128
    x, c = jnp.asarray(data((m, k), "heavy", 42), jnp.bfloat16), data((m, n), "normal", 43)
    w = data((3, k, n) if grouped else (k, n), "normal", 44)
    sizes = jnp.asarray([130, 0, 150], jnp.int32)

    def grads():   # a new function each time: no cached trace
        def loss(x, w):
            y = grouped_linear(x, w, sizes, out_dtype=out) if grouped else linear(x, w, out_dtype=out)
            return jnp.sum(y.astype(jnp.float32) * c)
        f = jax.jit(jax.grad(loss, (0, 1)))
        return f, f(x, w)

    f, by_kernel = grads()
    jaxpr = str(jax.make_jaxpr(f)(x, w))
    # x (K = 192 or 256) and the cotangent (N = 128) each both ways in one kernel where its columns
    # are whole blocks (a grouped layer's over its group blocks)
    both = 1 + (k % 128 == 0)
    counts = [jaxpr.count(f"fp8_quantize_{name}") for name in ("tokens", "rows_and_tokens", "rows_and_group_tokens")]
    assert counts == ([2 - both, 0, both] if grouped else [2 - both, both, 0])
    # the weights by the weight kernel where K and N are whole blocks
    assert jaxpr.count("fp8_quantize_weight") == (k % 128 == 0)
    monkeypatch.setattr(lin, "_wgrad_kernels", lambda rows, pow2: None)
    monkeypatch.setattr(lin, "weight_kernel", lambda shape, dtype: None)
    f, by_xla = grads()
    assert "fp8_quantize" not in str(jax.make_jaxpr(f)(x, w))
    for a, b in zip(by_kernel, by_xla):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.sweep   # (15-22 s of compiles; CI's second step: the README's line stays under 10 min)
def test_grouped_linear_and_kernelize_wgrad_reach_the_kernel():
    """fp8.grouped_linear's weight gradient, and kernelize(fp8="blockwise") of a MoE's ragged_dot,
    lowered for sm_90a in strict mode: all three grouped products are our kernels (forward, dgrad
    and the ragged-K wgrad)."""
    pytest.importorskip("cutlass")
    x, we = jnp.ones((300, 256), jnp.bfloat16), jnp.ones((3, 256, 128), jnp.float32)
    gs = jnp.asarray([100, 0, 150], jnp.int32)

    def linear_loss(we, x):
        return jnp.sum(grouped_linear(x, we, gs, out_dtype=jnp.float32))

    def moe_loss(we, x):
        return jnp.sum(jax.lax.ragged_dot(x, we.astype(jnp.bfloat16), gs, preferred_element_type=jnp.float32) ** 2)

    for loss in (linear_loss, moe_loss):
        fn = loss if loss is linear_loss else jax_cute.kernelize(loss, fp8="blockwise")
        text = _sm90_text(jax.value_and_grad(lambda w, x: fn(w, x), (0, 1)), we, x, strict=True)
        # forward, dgrad, the ragged-K wgrad and its two operands, quantized into the group-aligned
        # layout each with its 1 x 128 blocks for the forward product or dgrad, and the experts'
        # weights in both layouts
        assert text.count("@jax_cute_launch") == 6 and "stablehlo.dot_general" not in text, loss
        assert "ragged_k.float8_e4m3fn" in text and text.count('name = "fp8_quantize_rows_and_group_tokens"') == 2
        assert text.count('name = "fp8_quantize_weight"') == 1


@pytest.mark.parametrize("kernel", [True, False], ids=["weight-kernel", "xla"])
def test_a_checkpoint_policy_keeps_the_quantized_weights(kernel):
    """Under ``jax.checkpoint`` saving ``fp8.WEIGHTS``, the backward pass's recomputation reads the
    forward pass's fp8 weights: the weight is quantized once (twice with the default policy),
    by the weight kernel or by XLA (power-of-two scales), and the gradients are the same bits."""
    if kernel:
        pytest.importorskip("cutlass")
    recipe = Blockwise(pow2_scales=not kernel)
    x, w = data((256, 256), "normal", 3), data((256, 384), "normal", 4)

    def grad(policy):
        def loss(x, w):
            block = lambda x: jnp.tanh(linear(x, w, recipe=recipe, out_dtype=jnp.float32))  # noqa: E731
            return jnp.sum(jax.checkpoint(block, policy=policy)(x))
        g = jax.jit(jax.grad(loss, (0, 1)))
        text = str(jax.make_jaxpr(g)(x, w))
        return text.count("fp8_quantize_weight") if kernel else text.count("reduce_max"), g(x, w)

    (default, by_default), (kept, by_policy) = grad(None), grad(jax.checkpoint_policies.save_only_these_names(WEIGHTS))
    assert (default, kept) == (2, 1) if kernel else default - kept == 1
    for a, b in zip(by_default, by_policy):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_vmap_of_scaled_products():
    x, w = data((3, 50, 256), "normal", 16), data((3, 256, 130), "normal", 17)
    qx = quantize(x)
    qw = quantize(w, "128x128")
    out = jax.jit(jax.vmap(lambda a, b: jax_cute.matmul(a, b, preferred_element_type=jnp.float32)))(qx, qw)
    ref = np.einsum("bmk,bkn->bmn", deq(qx), deq(qw))
    assert rel(out, ref) < 1e-5
    # one weight for every batch element (in_axes None), and vmap of quantize itself
    w0 = quantize(w[0], "128x128")
    out = jax.vmap(lambda a: jax_cute.matmul(quantize(a), w0, preferred_element_type=jnp.float32))(x)
    assert rel(out, np.einsum("bmk,kn->bmn", deq(qx), deq(w0))) < 1e-5
    gs = np.asarray([20, 30], np.int32)
    wg = quantize(data((2, 256, 64), "normal", 18), "128x128")
    out = jax.vmap(lambda a: jax_cute.ragged_dot(a, wg, gs, preferred_element_type=jnp.float32))(qx)
    ref = np.stack([np.concatenate([deq(qx)[i, :20] @ deq(wg)[0], deq(qx)[i, 20:] @ deq(wg)[1]]) for i in range(3)])
    assert rel(out, ref) < 1e-5


# -- training products --------------------------------------------------------------------

def test_linear_gradients_are_the_fp8_recipe():
    """Forward and both gradients against the same quantised operands multiplied in float64."""
    m, k, n = 200, 300, 136
    x, w, c = data((2, m // 2, k), "heavy", 19), data((k, n), "normal", 20), data((m, n), "normal", 21)
    xb = jnp.asarray(x, jnp.bfloat16)
    loss = lambda x, w: jnp.sum(linear(x, w, out_dtype=jnp.float32).reshape(m, n) * c)  # noqa: E731
    val, (dx, dw) = jax.jit(jax.value_and_grad(loss, (0, 1)))(xb, w)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == np.float32 and dw.shape == (k, n)
    x2 = np.asarray(xb, np.float32).reshape(m, k)
    wq = quantize(w, "128x128")
    y = deq(quantize(x2)) @ deq(wq)
    assert abs(float(val) - np.sum(y * c)) <= 1e-5 * np.sum(np.abs(y * c))
    dx_ref = deq(quantize(c)) @ deq(wq).T
    dw_ref = deq(quantize(x2.T)) @ deq(quantize(c.T)).T
    assert rel(np.asarray(dx, np.float32).reshape(m, k), dx_ref) < 4e-3  # dx rounded to bf16
    assert rel(dw, dw_ref) < 1e-5
    # and the recipe is a fair approximation of the exact gradient (fp8: a few percent)
    assert rel(dw, x2.T @ c) < 0.1


def test_grouped_linear_gradients_are_the_fp8_recipe():
    m, k, n, sizes = 250, 260, 136, np.asarray([100, 0, 120, 20], np.int32)
    x, w, c = data((m, k), "heavy", 22), data((4, k, n), "normal", 23), data((m, n), "normal", 24)
    loss = lambda x, w: jnp.sum(grouped_linear(x, w, sizes, out_dtype=jnp.float32) * c)  # noqa: E731
    dx, dw = jax.jit(jax.grad(loss, (0, 1)))(x, w)
    ends = np.minimum(np.cumsum(sizes), m)
    starts = np.concatenate([[0], ends[:-1]])
    wq, cq = quantize(w, "128x128"), deq(quantize(c))
    xg, cg = deq(quantize_grouped(x.T, sizes)), deq(quantize_grouped(c.T, sizes))
    dx_ref = np.zeros((m, k))
    dw_ref = np.zeros((4, k, n))
    for g, (s, e) in enumerate(zip(starts, ends)):
        dx_ref[s:e] = cq[s:e] @ deq(wq)[g].T
        dw_ref[g] = xg[:, s:e] @ cg[:, s:e].T
    assert rel(dx, dx_ref) < 1e-5 and rel(dw, dw_ref) < 1e-5
    np.testing.assert_array_equal(np.asarray(dx)[ends[-1]:], 0)


def _unfused(z, bias, activation, out_dtype):
    """act(z + bias) as an unfused model computes it: float32 product, bias, cast, activation."""
    z = z if bias is None else z + bias.astype(jnp.float32)
    z = z.astype(out_dtype).astype(jnp.float32)
    return jax_cute.activations.apply_activation(activation, z).astype(out_dtype)


# (the test line: gelu with the bias, relu without; the others are sweeps, CI's second step)
@pytest.mark.parametrize("activation,out_dtype,with_bias", [
    ("gelu", jnp.bfloat16, True), pytest.param("gelu", jnp.float32, True, marks=pytest.mark.sweep),
    ("relu", jnp.bfloat16, False), *(pytest.param(*p, marks=pytest.mark.sweep) for p in (
        ("silu", jnp.float32, True), (None, jnp.bfloat16, True)))])
def test_fused_linear_is_the_unfused_recipe(activation, out_dtype, with_bias):
    """act(x @ w + bias) fused (bias in the kernel, act' formed once in the backward) against the
    same recipe unfused: linear in float32, then the bias, the rounding and the activation in jnp."""
    m, k, n = 200, 300, 136
    x = jnp.asarray(data((2, m // 2, k), "normal", 40), jnp.bfloat16)
    w, c = data((k, 2, n // 2), "normal", 41) * 0.06, data((2, m // 2, 2, n // 2), "normal", 42)
    b = jnp.asarray(data((n // 2,), "normal", 43), jnp.bfloat16) if with_bias else None  # broadcast over w's axis 1

    def fused(x, w, b):
        return jnp.sum(linear(x, w, bias=b, activation=activation, out_dtype=out_dtype).astype(jnp.float32) * c)

    def unfused(x, w, b):
        return jnp.sum(_unfused(linear(x, w, out_dtype=jnp.float32), b, activation, out_dtype).astype(jnp.float32) * c)

    argnums = (0, 1, 2) if with_bias else (0, 1)
    val, grads = jax.jit(jax.value_and_grad(fused, argnums))(x, w, b)
    want_val, want = jax.jit(jax.value_and_grad(unfused, argnums))(x, w, b)
    assert abs(float(val) - float(want_val)) <= 1e-6 * abs(float(want_val))
    # Both round dz = g * act'(z) once to g's dtype. The two programs form act'(z) in float32
    # with different fusions (and FMA contractions), so in bfloat16 a few of dz's m * n elements
    # may round the other way, each by one bf16 ulp (2^-8 relative): allow 8 such elements.
    bound = 1e-5 + (2.0 ** -8 * np.sqrt(8 / (m * n)) if out_dtype == jnp.bfloat16 else 0)
    for got, ref in zip(grads, want):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert rel(got, ref) < bound


@pytest.mark.parametrize("activation", ["gelu", pytest.param("relu2", marks=pytest.mark.sweep)])
def test_fused_grouped_linear_is_the_unfused_recipe(activation):
    m, k, n, sizes = 250, 260, 136, np.asarray([100, 0, 120, 20], np.int32)
    x, w, c = data((m, k), "normal", 44), data((4, k, n), "normal", 45) * 0.06, data((m, n), "normal", 46)
    b = data((4, n), "normal", 47)
    ends = np.minimum(np.cumsum(sizes), m)
    group = np.searchsorted(ends, np.arange(m), side="right")
    inside = (group < 4)[:, None]

    def fused(x, w, b):
        return jnp.sum(grouped_linear(x, w, sizes, bias=b, activation=activation, out_dtype=jnp.bfloat16) * c)

    def unfused(x, w, b):
        z = grouped_linear(x, w, sizes, out_dtype=jnp.float32)
        row_bias = jnp.where(inside, b[np.minimum(group, 3)], 0)  # rows past the last group: no bias
        return jnp.sum(_unfused(z, row_bias, activation, jnp.bfloat16) * c)

    val, grads = jax.jit(jax.value_and_grad(fused, (0, 1, 2)))(x, w, b)
    want_val, want = jax.jit(jax.value_and_grad(unfused, (0, 1, 2)))(x, w, b)
    assert abs(float(val) - float(want_val)) <= 1e-6 * abs(float(want_val))
    for got, ref in zip(grads, want):
        assert got.dtype == ref.dtype and rel(got, ref) < 1e-5
    np.testing.assert_array_equal(np.asarray(grads[0])[ends[-1]:], 0)


# (the grouped layer is a sweep, CI's second step: the README's line stays under 10 min)
@pytest.mark.parametrize("grouped", [False, pytest.param(True, marks=pytest.mark.sweep)],
                         ids=["linear", "grouped_linear"])
def test_swiglu_linear_is_the_unfused_recipe(grouped):
    """swiglu(x @ w + bias) (w's gate columns, then its up columns) against the same recipe
    unfused: the product in float32, then the bias, the rounding and swiglu in jnp; the backward
    pass's dz is swiglu's vector-Jacobian product, twice the output's width. Grouped: rows past
    the last group are zero, with a zero gradient."""
    m, k, n, sizes = 250, 260, 2 * 136, np.asarray([100, 0, 120, 20], np.int32)
    x = jnp.asarray(data((m, k), "normal", 48), jnp.bfloat16)
    w = data((4, k, n) if grouped else (k, n), "normal", 49) * 0.06
    b = data((4, n) if grouped else (n,), "normal", 50)
    c = data((m, n // 2), "normal", 51)
    ends = np.minimum(np.cumsum(sizes), m)
    group = np.searchsorted(ends, np.arange(m), side="right")

    def product(x, w, **kw):
        return grouped_linear(x, w, sizes, **kw) if grouped else linear(x, w, **kw)

    def fused(x, w, b):
        y = product(x, w, bias=b, activation="swiglu", out_dtype=jnp.bfloat16)
        assert y.shape == (m, n // 2)
        return jnp.sum(y.astype(jnp.float32) * c)

    def unfused(x, w, b):
        bias = jnp.where((group < 4)[:, None], b[np.minimum(group, 3)], 0) if grouped else b
        return jnp.sum(_unfused(product(x, w, out_dtype=jnp.float32), bias, "swiglu", jnp.bfloat16).astype(jnp.float32)
                       * c)

    val, grads = jax.jit(jax.value_and_grad(fused, (0, 1, 2)))(x, w, b)
    want_val, want = jax.jit(jax.value_and_grad(unfused, (0, 1, 2)))(x, w, b)
    assert abs(float(val) - float(want_val)) <= 1e-6 * abs(float(want_val))
    bound = 1e-5 + 2.0 ** -8 * np.sqrt(8 / (m * n))   # (dz's bf16 rounding: test_fused_linear_is_the_unfused_recipe)
    for got, ref in zip(grads, want):
        assert got.dtype == ref.dtype and got.shape == ref.shape and rel(got, ref) < bound
    if grouped:
        np.testing.assert_array_equal(np.asarray(grads[0])[ends[-1]:], 0)


def _mlp_loss(p, x):
    """A small transformer-ish block: two weight products and an attention-like batched product."""
    h = jnp.einsum("btd,df->btf", x.astype(jnp.bfloat16), p["w1"].astype(jnp.bfloat16),
                   preferred_element_type=jnp.float32)
    h = jax.nn.gelu(h).astype(jnp.bfloat16)
    s = jnp.einsum("btf,bsf->bts", h, h, preferred_element_type=jnp.float32)
    y = jnp.einsum("btf,fd->btd", h, p["w2"].astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    return jnp.mean(y ** 2) + 1e-3 * jnp.mean(s)


def _mlp_loss_fp8(p, x, fused: bool = True):
    """The same block written with jax_cute.fp8.linear by hand: gelu and the cast fused as kernelize
    fuses them (the pre-activation rounded to bf16 first), or (``fused=False``) after it in f32."""
    x, w1 = x.astype(jnp.bfloat16), p["w1"].astype(jnp.bfloat16)
    if fused:
        h = linear(x, w1, activation="gelu", out_dtype=jnp.bfloat16)
    else:
        h = jax.nn.gelu(linear(x, w1, out_dtype=jnp.float32)).astype(jnp.bfloat16)
    s = jnp.einsum("btf,bsf->bts", h, h, preferred_element_type=jnp.float32)
    y = linear(h, p["w2"].astype(jnp.bfloat16), out_dtype=jnp.float32)
    return jnp.mean(y ** 2) + 1e-3 * jnp.mean(s)


def test_kernelize_fp8_trains_weight_products_in_fp8():
    rng = np.random.default_rng(25)
    p = {"w1": jnp.asarray(rng.standard_normal((256, 384)) * 0.06, jnp.float32),
         "w2": jnp.asarray(rng.standard_normal((384, 256)) * 0.05, jnp.float32)}
    x = jnp.asarray(rng.standard_normal((2, 64, 256)), jnp.float32)
    f = jax_cute.kernelize(_mlp_loss, fp8="blockwise")
    val, grads = jax.jit(jax.value_and_grad(f))(p, x)
    fp8 = [q.fp8 for q in f.report.products]
    assert fp8 == [True, False, True], f.report  # the attention-like batched product stays 16-bit
    assert [q.epilogue for q in f.report.products] == ["gelu", "", ""], f.report
    # the hand-written model, its attention-like product on jax_cute's bf16 path as kernelize puts it;
    # unfused, kernelize computes what it did before (gelu after the f32 product)
    for fuse in (True, False):
        kf = jax_cute.kernelize(_mlp_loss, fp8="blockwise", fuse_epilogues=fuse)
        got_val, got = (val, grads) if fuse else jax.jit(jax.value_and_grad(kf))(p, x)
        want_val, want = jax.jit(jax.value_and_grad(jax_cute.kernelize(lambda p, x: _mlp_loss_fp8(p, x, fuse))))(p, x)
        assert abs(float(got_val) - float(want_val)) <= 1e-6 * abs(float(want_val)), fuse
        for name in p:
            assert got[name].dtype == np.float32
            assert rel(got[name], want[name]) < 1e-5, (name, fuse)
        unfused_val, unfused = got_val, got
    # fused, the pre-activation and its gradient are rounded to bf16 (the fused output's dtype) where
    # unfused they were f32: the fp8 quantization of the gradient rounds a few elements the other way
    assert abs(float(val) - float(unfused_val)) <= 1e-3 * abs(float(unfused_val))
    assert all(rel(grads[n], unfused[n]) < 0.05 for n in p)
    bf16_val, bf16 = jax.jit(jax.value_and_grad(_mlp_loss))(p, x)
    assert abs(float(val) - float(bf16_val)) < 0.05 * abs(float(bf16_val))
    assert all(rel(grads[n], bf16[n]) < 0.1 for n in p)
    # exclude keeps a product in 16 bit
    keep = jax_cute.kernelize(_mlp_loss, fp8=Blockwise(exclude=lambda lhs, rhs, out: rhs.shape == (384, 256)))
    keep(p, x)
    assert [q.fp8 for q in keep.report.products] == [True, False, False]


# (the grouped stack is a sweep, CI's second step: the README's line stays under 10 min)
@pytest.mark.parametrize("grouped", [False, pytest.param(True, marks=pytest.mark.sweep)], ids=["dense", "grouped"])
def test_kernelize_quantizes_a_scanned_stack_once(grouped, monkeypatch):
    """kernelize(fp8=...) quantizes a scanned stack's weights (and a weight the scan closes over)
    once, before the scan, by one weight-kernel call each, through a transpose and a checkpoint;
    the loss and every gradient are the same bits as quantizing each layer's weights in the body."""
    pytest.importorskip("cutlass")   # (the weight kernel; without it XLA quantizes in the body)
    from jax_cute.fp8 import scan_weights
    p, x, sizes = scanned_stack.case(grouped, layers=3, d=128, f=256, tokens=96, sizes=(40, 50))  # (6 rows in no group)
    loss = lambda p, x: scanned_stack.loss(p, x, sizes)  # noqa: E731

    def run():
        f = jax_cute.kernelize(loss, fp8="blockwise")
        calls = scanned_stack.weight_kernel_calls(jax.make_jaxpr(jax.value_and_grad(f))(p, x))
        return calls, f.report, jax.jit(jax.value_and_grad(f))(p, x)

    calls, report, (val, grads) = run()
    assert calls == {0: 3}, calls   # w1, w2 (transposed), shared: before the scan
    assert [q.fp8 for q in report.products] == [True] * 3, report
    assert all(q.where.startswith("scan/") for q in report.products), report   # (inside the checkpoint)
    monkeypatch.setattr(scan_weights, "targets", lambda *a: [])   # each layer's weights in the body
    per_layer_calls, _, (per_layer_val, per_layer) = run()
    assert per_layer_calls.get(1, 0) >= 2, per_layer_calls   # (JAX hoists the loop constant's itself)
    np.testing.assert_array_equal(np.asarray(val), np.asarray(per_layer_val))
    for name in p:
        np.testing.assert_array_equal(np.asarray(grads[name]), np.asarray(per_layer[name]), err_msg=name)
    want_val, want = jax.value_and_grad(loss)(p, x)   # (bf16 products)
    assert abs(float(val) - float(want_val)) < 0.05 * abs(float(want_val))
    assert all(rel(grads[n], want[n]) < 0.1 for n in p)


def _mlp_bias_loss(p, x, hand_written: bool = False):
    """A dense MLP whose first product has a bias and gelu after it (the GPT example's shape of it)."""
    x, w1, w2 = x.astype(jnp.bfloat16), p["w1"].astype(jnp.bfloat16), p["w2"].astype(jnp.bfloat16)
    if hand_written:
        h = linear(x, w1, bias=p["b1"], activation="gelu", out_dtype=jnp.bfloat16)
        y = linear(h, w2, out_dtype=jnp.float32)
    else:
        h = jnp.einsum("btd,df->btf", x, w1, preferred_element_type=jnp.float32) + p["b1"]
        h = jax.nn.gelu(h).astype(jnp.bfloat16)
        y = jnp.einsum("btf,fd->btd", h, w2, preferred_element_type=jnp.float32)
    return jnp.mean(y ** 2)


def _mlp_bias_params(seed: int):
    rng = np.random.default_rng(seed)
    return ({"w1": jnp.asarray(rng.standard_normal((256, 384)) * 0.06, jnp.float32),
             "b1": jnp.asarray(rng.standard_normal((384,)) * 0.5, jnp.float32),
             "w2": jnp.asarray(rng.standard_normal((384, 256)) * 0.05, jnp.float32)},
            jnp.asarray(rng.standard_normal((2, 64, 256)), jnp.float32))


def test_kernelize_fp8_fuses_bias_and_gelu():
    """kernelize(fp8=...) of ``gelu(x @ w1 + b1) @ w2``: the first product is fp8.linear with its
    bias and gelu fused, reported so; it computes what the hand-written fused layers compute, and
    what the unfused fp8 products computed before to within the bf16 rounding of the pre-activation."""
    p, x = _mlp_bias_params(48)
    f = jax_cute.kernelize(_mlp_bias_loss, fp8="blockwise")
    val, grads = jax.jit(jax.value_and_grad(f))(p, x)
    assert [(q.fp8, q.epilogue, q.chained) for q in f.report.products] == [(True, "bias + gelu", ""),
                                                                           (True, "", "")], f.report
    assert "with bias + gelu fused in block-scaled fp8" in str(f.report)
    want_val, want = jax.jit(jax.value_and_grad(lambda p, x: _mlp_bias_loss(p, x, True)))(p, x)
    assert abs(float(val) - float(want_val)) <= 1e-6 * abs(float(want_val))
    for name in p:
        assert grads[name].dtype == np.float32 and rel(grads[name], want[name]) < 1e-5, name
    unfused = jax_cute.kernelize(_mlp_bias_loss, fp8="blockwise", fuse_epilogues=False)
    old_val, old = jax.jit(jax.value_and_grad(unfused))(p, x)
    assert [q.epilogue for q in unfused.report.products] == ["", ""]
    assert abs(float(val) - float(old_val)) <= 1e-3 * abs(float(old_val))
    assert all(rel(grads[n], old[n]) < 0.05 for n in p)


def test_kernelize_fp8_epilogue_of_a_weight_on_the_left():
    """``vmap(w @ v + b)`` then gelu (Equinox's Linear): the swapped product with its epilogue, the
    transpose absorbed; ``gelu(w @ xᵀ)`` (no transpose after) is fused and transposed back; a bias
    that is not one value per output column (a residual) is left to XLA, the product still fp8."""
    rng = np.random.default_rng(49)
    ws = [jnp.asarray(rng.standard_normal((130, 256)) * 0.05, jnp.float32) for _ in range(3)]
    b = jnp.asarray(rng.standard_normal((130,)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((40, 256)), jnp.float32)
    bf = jnp.bfloat16

    def loss(ws, b, x):
        h = jnp.tanh(x).astype(bf)  # computed: the weights are on the left
        y1 = jax.vmap(lambda v: ws[0].astype(bf) @ v + b.astype(bf))(h)
        y2 = jax.nn.gelu(jnp.matmul(ws[1].astype(bf), h.T, preferred_element_type=jnp.float32))
        y3 = jax.nn.gelu(jnp.matmul(h, ws[2].T.astype(bf), preferred_element_type=jnp.float32) + jnp.tanh(y2.T))
        return jnp.sum(jax.nn.gelu(y1).astype(jnp.float32) ** 2) + jnp.sum(y2 ** 2) + jnp.sum(y3)

    def hand_written(ws, b, x):
        h = jnp.tanh(x).astype(bf)
        y1 = linear(h, ws[0].T.astype(bf), bias=b.astype(bf), activation="gelu", out_dtype=jnp.float32)
        y2 = linear(h, ws[1].T.astype(bf), activation="gelu", out_dtype=jnp.float32).T
        y3 = jax.nn.gelu(linear(h, ws[2].T.astype(bf), out_dtype=jnp.float32) + jnp.tanh(y2.T))
        return jnp.sum(y1 ** 2) + jnp.sum(y2 ** 2) + jnp.sum(y3)

    f = jax_cute.kernelize(loss, fp8="blockwise")
    val, g = jax.jit(jax.value_and_grad(f, (0, 1)))(ws, b, x)
    assert sorted((q.fp8, q.epilogue) for q in f.report.products) == [(True, ""), (True, "bias + gelu"),
                                                                      (True, "gelu")], f.report
    want_val, want = jax.jit(jax.value_and_grad(hand_written, (0, 1)))(ws, b, x)
    assert abs(float(val) - float(want_val)) <= 1e-6 * abs(float(want_val))
    for got, ref in zip(jax.tree.leaves(g), jax.tree.leaves(want)):
        assert rel(got, ref) < 1e-5


@pytest.mark.sweep   # (12 s: CI's second step, so the README's test line stays under 10 minutes)
def test_kernelize_fp8_ragged_dot():
    rng = np.random.default_rng(26)
    sizes = jnp.asarray([40, 0, 70, 18], jnp.int32)
    w = jnp.asarray(rng.standard_normal((4, 256, 130)) * 0.05, jnp.float32)
    x = jnp.asarray(rng.standard_normal((128, 256)), jnp.bfloat16)

    def loss(w, x):
        y = jax.lax.ragged_dot(x, w.astype(jnp.bfloat16), sizes, preferred_element_type=jnp.float32)
        return jnp.sum(y ** 2)

    f = jax_cute.kernelize(loss, fp8="blockwise")
    g = jax.jit(jax.grad(f))(w, x)
    assert [q.fp8 for q in f.report.products] == [True]
    want = jax.jit(jax.grad(lambda w, x: jnp.sum(grouped_linear(x, w.astype(jnp.bfloat16), sizes,
                                                                out_dtype=jnp.float32) ** 2)))(w, x)
    assert rel(g, want) < 1e-5
    # an activation after it is fused (fp8.grouped_linear(..., activation=))
    act_loss = lambda w, x: jnp.sum(jax.nn.gelu(jax.lax.ragged_dot(  # noqa: E731
        x, w.astype(jnp.bfloat16), sizes, preferred_element_type=jnp.float32)) ** 2)
    f = jax_cute.kernelize(act_loss, fp8="blockwise")
    g = jax.jit(jax.grad(f))(w, x)
    assert [(q.fp8, q.epilogue) for q in f.report.products] == [(True, "gelu")], f.report
    want = jax.jit(jax.grad(lambda w, x: jnp.sum(grouped_linear(x, w.astype(jnp.bfloat16), sizes, activation="gelu",
                                                                out_dtype=jnp.float32) ** 2)))(w, x)
    assert rel(g, want) < 1e-5


# -- dispatch and errors ----------------------------------------------------------------------

def test_fallback_is_logged_and_strict_mode_raises(caplog, monkeypatch):
    """Products no kernel takes (a kernel variant listed as never run on a GPU, unless opted in:
    here the ragged-K weight gradient's) are fallbacks when traced; the products
    the Hopper kernels take are not (on the CPU they run the reference unlogged)."""
    xq, wq = quantize(data((8, 128), "normal")), quantize(data((128, 128), "normal"), "128x128")
    we = quantize(data((2, 128, 128), "normal"), "128x128")
    sizes = jnp.asarray([3, 5], jnp.int32)
    xt, yt = quantize_grouped(data((8, 16), "normal").T, sizes), quantize_grouped(data((8, 24), "normal").T, sizes)
    logging.getLogger("jax_cute").setLevel(logging.WARNING)
    with caplog.at_level(logging.WARNING, logger="jax_cute"):
        jax_cute.matmul(xq, wq)
        jax_cute.ragged_dot(xq, we, sizes)
        ragged_k_dot(xt, yt, sizes)
        assert not caplog.text
        monkeypatch.setattr(arch, "UNVERIFIED_VARIANTS", {"sm_90a": frozenset({"scaled_ragged_k"})})
        with config.override(unverified_kernels=True):
            ragged_k_dot(xt, yt, sizes)
        assert not caplog.text
        ragged_k_dot(xt, yt, sizes)
    assert "ragged-K" in caplog.text and "not yet run on hardware" in caplog.text
    assert "JAX_CUTE_UNVERIFIED_KERNELS=1" in caplog.text
    with config.override(strict=True):
        jax_cute.matmul(xq, wq, bias=jnp.ones((128,)), activation="gelu")
        jax_cute.ragged_dot(xq, we, sizes, activation="relu")
        with pytest.raises(jax_cute.FallbackError, match="block-scaled"):
            ragged_k_dot(xt, yt, sizes)
        monkeypatch.setattr(arch, "UNVERIFIED_VARIANTS", {})
        ragged_k_dot(xt, yt, sizes)
        jax_cute.matmul(xq, wq, activation="swiglu")   # (gated: test_gated_lowers_to_the_hopper_kernel)
        jax_cute.ragged_dot(xq, we, sizes, activation="swiglu")


@pytest.mark.sweep   # (10 s: CI's second step, so the README's test line stays under 10 minutes)
def test_dense_lowers_to_the_hopper_kernel():
    """Lowered for sm_90a on the CPU (no device needed) in strict mode: the dense scaled product
    is our custom call, with its epilogue, and no XLA dot is left; odd sizes are padded to the
    16-byte strides TMA needs (K's padding is never read: the kernel's K stays 1000)."""
    pytest.importorskip("cutlass")
    x, w = data((1000, 1000), "normal"), data((1000, 1040), "heavy")

    def f(x, w, bias):
        return jax_cute.matmul(quantize(x, "1x128"), quantize(w, "128x128"), bias=bias, activation="gelu")

    _assert_one_kernel(_sm90_text(f, x, w, jnp.ones((1040,)), strict=True), "scaled1x128", ".bias.gelu")


def test_gated_lowers_to_the_hopper_kernel(caplog):
    """swiglu pairs column j with j + N/2, in different 128-column weight blocks: lowered for
    sm_90a in strict mode, the dense and grouped products with 128 x 128 weight blocks are our
    kernel reading B's scales per 64 paired columns (two a tile, gathered from the blocks' in
    XLA), no XLA dot left; an N/2 no kernel tile pairs (not a multiple of 64) falls back, logged
    with the reason. (128 x 1 weight blocks: test_gated_per_column_scales_lower_to_the_hopper_kernel.)"""
    pytest.importorskip("cutlass")
    x, w, we = data((300, 256), "normal"), data((256, 640), "normal", 1), data((3, 256, 640), "normal", 2)
    sizes = jnp.asarray([100, 0, 150], jnp.int32)

    def dense(x, w, bias):
        return jax_cute.matmul(quantize(x, "1x128"), quantize(w, "128x128"), bias=bias, activation="swiglu")

    def grouped(x, we):
        return jax_cute.ragged_dot(quantize(x, "1x128"), quantize(we, "128x128"), sizes, activation="swiglu")

    for f, args in ((dense, (x, w, jnp.ones((640,)))), (grouped, (x, we))):
        _assert_one_kernel(_sm90_text(f, *args, strict=True), "scaled1x64.", "swiglu")
    with config.override(target_arch="sm_90a"), caplog.at_level(logging.WARNING, logger="jax_cute"):
        text = jax.jit(dense).trace(x, w[:, :96], jnp.ones((96,))).lower(lowering_platforms=("cuda",)).as_text()
    assert "@jax_cute_launch" not in text
    assert "pair gate and up columns in blocks of 64" in caplog.text


@pytest.mark.sweep   # (a compile; CI's second step: the README's line stays under 10 min)
def test_gated_per_column_scales_lower_to_the_hopper_kernel():
    """swiglu of 128 x 1 weight blocks (scales per column) lowered for sm_90a in strict mode: our
    kernel reads B's scales per column through the same pairing as B's columns."""
    pytest.importorskip("cutlass")
    x, w = data((300, 256), "normal"), data((256, 640), "normal", 1)

    def dense(x, w, bias):
        return jax_cute.matmul(quantize(x, "1x128"), quantize(w, "128x1"), bias=bias, activation="swiglu")

    _assert_one_kernel(_sm90_text(dense, x, w, jnp.ones((640,)), strict=True), "scaled1x1.", "swiglu")


@pytest.mark.sweep   # (15-22 s of compiles; CI's second step: the README's line stays under 10 min)
def test_kernelize_fp8_epilogue_lowers_to_the_hopper_kernel():
    """kernelize(fp8=...) of ``gelu(x @ w1 + b1) @ w2`` and its gradient, lowered for sm_90a in
    strict mode: five block-scaled GEMMs (two forward, two wgrad, the second layer's dgrad: x is
    not differentiated), the first forward one with the bias in its epilogue, the two wgrads'
    four operands quantized by the token kernel, each together with its 1 x 128 blocks for the
    other product (the forward's or dgrad's), in one pass, and each weight in both its layouts by
    the weight kernel; no XLA dot is left."""
    pytest.importorskip("cutlass")
    p, x = _mlp_bias_params(50)
    f = jax_cute.kernelize(_mlp_bias_loss, fp8="blockwise")
    text = _sm90_text(jax.value_and_grad(f), p, x, strict=True)
    assert text.count("@jax_cute_launch") == 11 and "stablehlo.dot_general" not in text
    assert text.count('name = "fp8_quantize_weight"') == 2
    assert text.count('name = "fp8_quantize_rows_and_tokens"') == 4 and 'name = "fp8_quantize_tokens"' not in text
    assert f.report.products[0].epilogue == "bias + gelu"
    assert len([ln for ln in text.splitlines() if "scaled1x128" in ln and ".bias" in ln]) == 1, text


def test_errors():
    x, w = quantize(data((8, 256), "normal")), quantize(data((256, 128), "normal"), "128x128")
    with pytest.raises(TypeError, match="quantize it"):
        jax_cute.matmul(x, jnp.ones((256, 128), jnp.bfloat16))
    with pytest.raises(ValueError, match="contracting extents differ|share K"):
        jax_cute.matmul(x, quantize(data((128, 128), "normal"), "128x128"))
    with pytest.raises(ValueError, match="blocks of 128"):
        jax_cute.matmul(x, quantize(data((256, 128), "normal"), (1, 128)))  # K in blocks of 1
    with pytest.raises(ValueError, match="need scales of shape"):
        jax_cute.matmul(BlockScaled(x.values, x.scales[:, :1], x.block), w)
    with pytest.raises(TypeError, match="float8"):
        jax_cute.matmul(BlockScaled(x.values.astype(jnp.bfloat16), x.scales, x.block), w)
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        jax_cute.matmul(x, w, preferred_element_type=jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="exactly one dimension"):
        q3 = quantize(data((4, 2, 128), "normal"))
        jax_cute.dot_general(q3, q3, (((1, 2), (1, 2)), ((), ())))
    with pytest.raises(ValueError, match="free axes"):
        jax_cute.matmul(quantize(data((2, 256, 256), "normal"), "128x128"), w)
    with pytest.raises(ValueError, match="bias"):
        jax_cute.matmul(x, w, bias=jnp.ones((3,)))
    with pytest.raises(ValueError, match="block"):
        quantize(jnp.ones((4, 4)), "1x128x128")
    with pytest.raises(TypeError, match="floating"):
        quantize(jnp.ones((4, 4), jnp.int32))
    with pytest.raises(TypeError, match="dtype"):
        quantize(jnp.ones((4, 4)), dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="group-aligned"):
        ragged_k_dot(quantize(data((8, 256), "normal")), quantize(data((8, 256), "normal")), jnp.ones((2,), jnp.int32))
    with pytest.raises(ValueError, match="group_offset"):
        jax_cute.ragged_dot(x, quantize(data((2, 256, 128), "normal"), "128x128"), jnp.asarray([4, 4]), group_offset=0)
    with pytest.raises(TypeError, match="not differentiated"):
        jax.grad(lambda s: jnp.sum(jax_cute.matmul(BlockScaled(x.values, s, x.block), w,
                                                   preferred_element_type=jnp.float32)))(x.scales)
    with pytest.raises(ValueError, match="fp8 must be"):
        jax_cute.kernelize(_mlp_loss, fp8="tensorwise")
    with pytest.raises(TypeError, match="16- or 32-bit"):
        linear(x.values, jnp.ones((256, 4)))
    with pytest.raises(TypeError, match="w_quantized must be the pair"):
        linear(jnp.ones((4, 256)), jnp.ones((256, 128)), w_quantized=w)
    with pytest.raises(ValueError, match=r"w_quantized must be float8_e4m3fn \(256, 128\)"):
        linear(jnp.ones((4, 256)), jnp.ones((256, 128)), w_quantized=(w, x))
    with pytest.raises(ValueError, match="share K"):
        linear(jnp.ones((4, 8)), jnp.ones((9, 4)))
    with pytest.raises(ValueError, match="bias must broadcast"):
        linear(jnp.ones((4, 8)), jnp.ones((8, 4)), bias=jnp.ones((5,)))
    for w_shape in ((8, 5), (8, 2, 4)):   # a gated activation pairs the halves of one even N
        with pytest.raises(ValueError, match="one even N"):
            linear(jnp.ones((4, 8)), jnp.ones(w_shape), activation="swiglu")
    with pytest.raises(ValueError, match=r"bias must be \(G, N\)"):
        grouped_linear(jnp.ones((4, 8)), jnp.ones((2, 8, 4)), jnp.asarray([2, 2]), bias=jnp.ones((4,)))


@pytest.mark.parametrize("moe", [False, True])
def test_gpt_example_fp8_products(moe):
    """kernelize(fp8=...) of the GPT example's loss (traced only): the weight products, dense and
    grouped, are fp8; attention's batched products, the tied LM head and the router are not."""
    pytest.importorskip("optax")
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
    import gpt_training as gpt

    cfg = gpt.dataclasses.replace(gpt.SIZES["tiny"], moe=moe)
    params = gpt.init_params(jax.random.key(0), cfg)
    tokens = gpt.batches(jax.random.key(1), cfg)[0]
    f = jax_cute.kernelize(lambda p, t: gpt.loss_fn(p, t, cfg), fp8=gpt.fp8_recipe(cfg))
    jax.eval_shape(jax.value_and_grad(f), params, tokens)
    fp8 = {(q.primitive, q.shapes[1]) for q in f.report.products if q.fp8}
    kept = {(q.primitive, q.shapes[1]) for q in f.report.products if not q.fp8}
    d, e = cfg.d_model, cfg.experts
    want = {("dot_general", (d, 3, cfg.heads, cfg.head_dim)), ("dot_general", (cfg.heads, cfg.head_dim, d))}
    want |= {("ragged_dot_general", (e, d, cfg.d_ff)), ("ragged_dot_general", (e, cfg.d_ff, d))} if moe else \
        {("dot_general", (d, cfg.d_ff)), ("dot_general", (cfg.d_ff, d))}
    assert fp8 == want, f.report
    assert ("dot_general", (cfg.vocab, d)) in kept and all(len(s) == 4 for p, s in kept if p == "dot_general"
                                                           and s[0] != cfg.vocab and s != (d, e))


# (the test line: the activations' and weights' blocks at the smallest size; the DeepGEMM size
# and the other block forms are sweeps, run in CI's second step)
@pytest.mark.parametrize("m,n,k,blocks", [(1, 1, 1, ("1x128", "128x128")),
                                           pytest.param(1, 8, 128, ("1x128", (128, 1)), marks=pytest.mark.sweep),
                                           pytest.param(129, 257, 130, ("128x128", "128x128"), marks=pytest.mark.sweep),
                                           pytest.param(300, 7168, 2048, ("1x128", "128x128"), marks=pytest.mark.sweep),
                                           pytest.param(4096, 512, 384, ("128x128", (128, 1)), marks=pytest.mark.sweep)])
def test_odd_sizes_lower_to_the_kernel(m, n, k, blocks):
    """Every size and block form the GPU tests run reaches the kernel (strict mode: no fallback)."""
    pytest.importorskip("cutlass")
    x, w = jnp.ones((m, k), jnp.float32), jnp.ones((k, n), jnp.float32)

    def f(x, w):
        return jax_cute.matmul(quantize(x, blocks[0]), quantize(w, blocks[1]), preferred_element_type=jnp.float32)

    with config.override(target_arch="sm_90a", strict=True):
        text = jax.jit(f).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("@jax_cute_launch") == 1


def test_kernel_scales_are_padded_for_tma():
    """The kernel's scales: (L, Kb, row blocks) with the row blocks zero-padded to a multiple of 4
    (16-byte TMA strides), and the reference's first-use check reads them back unpadded."""
    from jax_cute.fp8 import scaled

    s = jnp.arange(1, 31, dtype=jnp.float32).reshape(2, 5, 3)   # (L, row blocks, Kb)
    t = scaled._block_major(s)
    assert t.shape == scaled._block_major_aval(s).shape == (2, 3, 8)
    np.testing.assert_array_equal(t[:, :, :5], jnp.swapaxes(s, 1, 2))
    assert not np.asarray(t[:, :, 5:]).any()
    np.testing.assert_array_equal(scaled._row_major(t, 5), s)
    assert scaled._block_major(s[0, :4]).shape == (1, 3, 4)   # an (M, Kb) operand's, already whole


@pytest.mark.sweep   # (11 s: CI's second step, so the README's test line stays under 10 minutes)
def test_batched_and_vmapped_products_lower_to_the_kernel():
    pytest.importorskip("cutlass")
    a, b = jnp.ones((3, 200, 640), jnp.float32), jnp.ones((3, 640, 300), jnp.float32)

    def f(a, b):
        y = jax_cute.matmul(quantize(a, "1x128"), quantize(b, "128x128"))
        return y + jax.vmap(lambda x, y: jax_cute.matmul(quantize(x, "1x128"), quantize(y, (128, 1))))(a, b)

    with config.override(target_arch="sm_90a", strict=True):
        text = jax.jit(f).trace(a, b).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("@jax_cute_launch") == 2


@pytest.mark.parametrize("k,b_block", [(1000, "128x128"), pytest.param(1024, (128, 1), marks=pytest.mark.sweep)])
def test_grouped_lowers_to_the_hopper_kernel(k, b_block):
    """ragged_dot of block-scaled operands (K padded to 16 bytes when it is not) and fp8.grouped_linear's
    forward and dgrad reach the grouped kernel in strict mode; its ragged-K weight gradient stays XLA's."""
    pytest.importorskip("cutlass")
    x, w = jnp.ones((1000, k), jnp.float32), jnp.ones((4, k, 512), jnp.float32)
    gs = jnp.asarray([100, 300, 0, 500], jnp.int32)

    def f(x, w, bias):
        return jax_cute.ragged_dot(quantize(x, "1x128"), quantize(w, b_block), gs, bias=bias, activation="gelu")

    with config.override(target_arch="sm_90a", strict=True):
        text = jax.jit(f).trace(x, w, jnp.ones((4, 512))).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("@jax_cute_launch") == 1 and "stablehlo.dot_general" not in text


@pytest.mark.sweep   # (25 s: CI's second step, so the README's test line stays under 10 minutes)
def test_lowers_for_cuda_as_xla_ops(monkeypatch):
    """Lowered for a GPU (no device needed): the dense and grouped layers' six fp8 GEMMs (forward,
    dgrad, wgrad) are our kernels; a product no kernel takes (here the ragged-K wgrad, listed as
    an unverified variant) is XLA ops, its per-block products bf16 x bf16 -> f32 (exact for fp8
    values)."""
    pytest.importorskip("cutlass")
    x, w = jnp.ones((256, 256), jnp.bfloat16), jnp.ones((256, 384), jnp.float32)
    we, gs = jnp.ones((2, 256, 128), jnp.float32), jnp.asarray([100, 156], jnp.int32)

    def loss(x, w, we):
        y = linear(x, w, out_dtype=jnp.float32)
        return jnp.sum(y) + jnp.sum(grouped_linear(x, we, gs, out_dtype=jnp.float32))

    def lowered():
        with config.override(target_arch="sm_90a"):
            return jax.jit(jax.value_and_grad(loss, (0, 1, 2))).trace(x, w, we).lower(
                lowering_platforms=("cuda",)).as_text()

    text = lowered()
    # six GEMMs, the four wgrad operands quantized by the token kernels, each together with its
    # 1 x 128 blocks for the forward product or dgrad (the grouped layer's over its group blocks),
    # and both layers' weights in both layouts by the weight kernel
    assert text.count("@jax_cute_launch") == 12 and "f8E4M3FN" in text and "stablehlo.dot_general" not in text
    assert text.count('name = "fp8_quantize_rows_and_group_tokens"') == 2
    assert text.count('name = "fp8_quantize_rows_and_tokens"') == 2 and 'name = "fp8_quantize_tokens"' not in text
    assert text.count('name = "fp8_quantize_weight"') == 2
    monkeypatch.setattr(arch, "UNVERIFIED_VARIANTS", {"sm_90a": frozenset({"scaled_ragged_k"})})
    text = lowered()
    assert text.count("@jax_cute_launch") == 11
    dots = [ln for ln in text.splitlines() if "stablehlo.dot_general" in ln]
    assert dots and all("bf16" in ln and "-> tensor<" in ln and ln.rstrip().endswith("xf32>") for ln in dots), dots[:3]


def test_kernelize_fp8_takes_a_weight_on_the_left():
    """``w @ x`` (Equinox's Linear under vmap) is the swapped product, transposed back."""
    rng = np.random.default_rng(27)
    w = jnp.asarray(rng.standard_normal((130, 256)) * 0.05, jnp.float32)
    x = jnp.asarray(rng.standard_normal((40, 256)), jnp.float32)

    def loss(w, x):
        h = jnp.tanh(x)  # an activation: computed, not an input (two inputs: the second is the weight)
        y = jax.vmap(lambda v: w.astype(jnp.bfloat16) @ v.astype(jnp.bfloat16))(h)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    f = jax_cute.kernelize(loss, fp8="blockwise")
    g = jax.jit(jax.grad(f))(w, x)
    assert [q.fp8 for q in f.report.products] == [True], f.report
    want = jax.jit(jax.grad(lambda w, x: jnp.sum(linear(jnp.tanh(x).astype(jnp.bfloat16), w.T.astype(jnp.bfloat16))
                                                 .astype(jnp.float32) ** 2)))(w, x)
    assert rel(g, want) < 1e-5


def test_vmap_of_the_fp8_gradients():
    rng = np.random.default_rng(28)
    x = jnp.asarray(rng.standard_normal((2, 64, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((2, 256, 130)), jnp.float32)
    fn = lambda x, w: jnp.sum(linear(x, w) ** 2)  # noqa: E731 (grouped: its primitives' vmap is tested above)
    grad = jax.jit(jax.grad(fn, (0, 1)))
    batched = jax.jit(jax.vmap(jax.grad(fn, (0, 1))))(x, w)
    for i in range(2):
        for got, want in zip(batched, grad(x[i], w[i])):
            np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(want))


@pytest.mark.sweep   # (CI's second step: it compiles the step's kernels)
def test_training_step_exports_for_the_gpu():
    """An fp8.linear training step exported for CUDA on this CPU machine: serialized with every
    kernel in it (the quantizers, the weight kernel, the three GEMMs), and read back."""
    pytest.importorskip("cutlass")
    from jax import export

    x, w = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16), jax.ShapeDtypeStruct((256, 512), jnp.float32)
    step = jax.jit(jax.value_and_grad(lambda w, x: jnp.mean(linear(x, w, out_dtype=jnp.float32) ** 2)))
    with config.override(target_arch="sm_90a", strict=True):
        exp = export.export(step, platforms=["cuda"], disabled_checks=jax_cute.export_disabled_checks())(w, x)
    again = export.deserialize(exp.serialize())
    assert again.mlir_module().count("@jax_cute_launch") == 5, again.mlir_module().count("@jax_cute_launch")
    assert [a.shape for a in again.out_avals] == [(), (256, 512)]
