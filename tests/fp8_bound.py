"""The accuracy bound of block-scaled fp8 products (tests/test_gpu_fp8.py checks the Hopper kernel
with it; tests/test_fp8.py shows on the CPU that it still catches a wrong scale).

Per output element: |out - ref| <= 1e-3 * max|ref| over its row + ulp(out)/2 * |ref|
+ C * sum_k |a_k b_k| (``abs_product``: |A| @ |B| of the dequantised operands), and DeepGEMM's
global measure 1 - 2 sum(out * ref) / sum(out^2 + ref^2) <= 1e-3 (the issue's criterion).

- 1e-3 * row max: the issue's relative error, rows normalised on their own so heavy-tailed rows
  are held to their own scale;
- ulp/2 * |ref|: the one rounding to a 16-bit output;
- C * sum_k |a_k b_k|: the tensor core's own accumulation. Hopper's fp8 WGMMA does not add in
  float32: it keeps about 14 significant bits (DeepSeek-V3, section 3.3.2), each instruction
  (k32) aligning its addends (the running sum and its 32 products) to the largest exponent among
  them. Every addend of a 128-K block is at most that block's sum_k |a_k b_k|, so the error is a
  fraction of the sum of magnitudes, whatever the result's own size; the kernel promotes each
  block's partial sum into float32 after its four instructions. How large a fraction the
  hardware loses is measured, not derived: if only the sum were truncated once per instruction
  it would be at most 4 * 2^-13 = 2^-11; each product truncated on its own allows up to 33 times
  that. On an H100 (2026-11-27) C = 2^-11 failed one element of 180000 (e5m2 operands, float32
  out) at 1.06 of the bound, with sum|a b| at 0.8 of its row max (no outlier, no cancellation),
  and C = 2^-10 one element of 823680 of a ragged-K product (heavy-tailed data, float32 out) at
  1.00 of the bound. C = 2^-9 is half the worst case of truncating each product. The elements that use the term are ordinary ones, not those with
  outlier products (test_gpu_fp8.test_error_model prints how much of it the hardware uses).

The activation tests compare act(out + bias) with act(ref + bias), the first two terms on the
latter and C on the product's sum|a b| (gelu and silu are at most 1.13-Lipschitz, relu 1; their
data, normal, stay far inside the bound).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

TOL = 1e-3
C_ACC = 2.0 ** -9   # the fp8 tensor core's accumulation (see above)
_HALF_ULP = {np.dtype(jnp.bfloat16): 2.0 ** -8, np.dtype(jnp.float16): 2.0 ** -11, np.dtype(jnp.float32): 0.0}


def data(shape, kind: str, seed: int = 0) -> np.ndarray:
    """Test data in DeepGEMM's style: "normal"; "heavy" (rows times powers of two from 2^-12 to
    2^11, one element in 500 times 1000); "student_t" (3 degrees of freedom)."""
    rng = np.random.default_rng(seed)
    if kind == "student_t":
        x = rng.standard_t(3, size=shape).astype(np.float32)
    else:
        x = rng.standard_normal(shape).astype(np.float32)
    if kind == "heavy":
        rows = int(np.prod(shape[:-1]))
        x = x * np.exp2(rng.integers(-12, 12, size=(rows, 1))).reshape(*shape[:-1], 1).astype(np.float32)
        flat = x.reshape(-1)
        idx = rng.choice(flat.size, size=max(1, flat.size // 500), replace=False)
        flat[idx] *= 1000.0
        x = flat.reshape(shape)
    return x


def abs_product(a, b) -> jax.Array:
    """sum_k |a_k b_k| for every element of a @ b (leading axes batch, as in jnp.matmul)."""
    return jnp.matmul(jnp.abs(a), jnp.abs(b), precision=jax.lax.Precision.HIGHEST)


def _check_global(o: np.ndarray, r: np.ndarray) -> None:
    """DeepGEMM's global measure 1 - 2 sum(o r) / sum(o^2 + r^2) <= TOL."""
    diff = 1.0 - 2.0 * float((o * r).sum()) / max(float((o * o + r * r).sum()), 1e-300)
    assert diff <= TOL, f"DeepGEMM's difference {diff:.2e}"


def check(out, ref, abs_prod) -> None:
    """Assert the bound above on every element and DeepGEMM's global measure."""
    o = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
    r = np.asarray(ref, np.float64)
    s = np.asarray(abs_prod, np.float64)
    assert o.shape == r.shape == s.shape and np.isfinite(o).all(), "non-finite or unwritten output elements"
    scale = np.abs(r.reshape(-1, r.shape[-1])).max(axis=-1).reshape(*r.shape[:-1], 1)
    bound = TOL * scale + _HALF_ULP[np.dtype(out.dtype)] * np.abs(r) + C_ACC * s + 1e-30
    err = np.abs(o - r)
    bad = err > bound
    if bad.any():
        # how the offenders' sums of magnitudes compare with their rows' scale (a report)
        ratio = s / np.maximum(scale, 1e-30)
        raise AssertionError(
            f"{bad.sum()} of {bad.size} elements off (worst {float((err / bound).max()):.2f} of the bound), e.g. "
            f"{np.argwhere(bad)[:3].tolist()}; sum|a b| / row max there {np.round(ratio[bad][:3], 1).tolist()}, "
            f"median {float(np.median(ratio)):.1f}")
    _check_global(o, r)


def check_swiglu(out, z, abs_prod) -> None:
    """``out`` = swiglu(z) = silu(g) * u, z = [g | u] the product's float32 pre-activation (bias
    included) and ``abs_prod`` its sum_k |a_k b_k|. The kernel applies swiglu to its float32
    accumulators, each off from z by at most e = TOL * (its row's max |z|) + C_ACC * sum|a b|
    (as ``check``); so |out - ref| <= 1.1 |u| e_g + |silu(g)| e_u + e_g e_u (|silu'| < 1.1), plus
    the output's rounding; and DeepGEMM's global measure."""
    o = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
    z, s = np.asarray(z, np.float64), np.asarray(abs_prod, np.float64)
    h = z.shape[-1] // 2
    e = TOL * np.abs(z).max(axis=-1, keepdims=True) + C_ACC * s
    g, u, eg, eu = z[..., :h], z[..., h:], e[..., :h], e[..., h:]
    silu = 0.5 * g * (1.0 + np.tanh(0.5 * g))   # (g * sigmoid(g), without overflow)
    r = silu * u
    assert o.shape == r.shape and np.isfinite(o).all(), "non-finite or unwritten output elements"
    bound = 1.1 * np.abs(u) * eg + np.abs(silu) * eu + eg * eu + _HALF_ULP[np.dtype(out.dtype)] * np.abs(r) + 1e-30
    bad = np.abs(o - r) > bound
    assert not bad.any(), (f"{bad.sum()} of {bad.size} elements off (worst {float((np.abs(o - r) / bound).max()):.2f} "
                           f"of the bound), e.g. {np.argwhere(bad)[:3].tolist()}")
    _check_global(o, r)
