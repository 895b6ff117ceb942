"""CPU machine, CUDA lowering: ragged_dot, its gradients and vmap lower to our grouped kernels
(``jax_cute_launch`` custom calls) with no transposes, copies, gathers, concatenations or pads:
every layout change is in the kernels' strides. Strict mode turns any fallback into an error."""

import jax
import jax.numpy as jnp
import pytest

import jax_cute
from jax_cute import kernels
from jax_cute.primitives.ragged_dot import ragged_dot

try:
    kernels.family("grouped", "sm_90a")
    _MISSING = None
except ImportError as e:  # the only reason to skip: the kernel family itself is not importable
    _MISSING = f"jax_cute.kernels.family('grouped', 'sm_90a') cannot be imported: {e}"

pytestmark = pytest.mark.skipif(_MISSING is not None, reason=_MISSING or "")

FORBIDDEN = ("stablehlo.transpose", "stablehlo.copy", "stablehlo.gather", "stablehlo.concatenate", "stablehlo.pad")
M, K, G, N, B = 256, 128, 4, 192, 3
X = jax.ShapeDtypeStruct((M, K), jnp.bfloat16)
W = jax.ShapeDtypeStruct((G, K, N), jnp.bfloat16)
GS = jax.ShapeDtypeStruct((G,), jnp.int32)
XB = jax.ShapeDtypeStruct((B, M, K), jnp.bfloat16)
WB = jax.ShapeDtypeStruct((B, G, K, N), jnp.bfloat16)
GSB = jax.ShapeDtypeStruct((B, G), jnp.int32)


def _lower(f, *args) -> str:
    with jax_cute.config.override(target_arch="sm_90a", strict=True):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _loss(f):
    return lambda x, w, g: jnp.sum(f(x, w, g).astype(jnp.float32))


CASES = {
    "forward": (ragged_dot, (X, W, GS), 1),
    "forward_f32_out": (lambda x, w, g: ragged_dot(x, w, g, preferred_element_type=jnp.float32), (X, W, GS), 1),
    "grad_lhs": (jax.grad(_loss(ragged_dot), 0), (X, W, GS), 1),
    "grad_rhs": (jax.grad(_loss(ragged_dot), 1), (X, W, GS), 1),
    "grad_both": (jax.grad(_loss(ragged_dot), (0, 1)), (X, W, GS), 2),
    "vmap_lhs_sizes": (jax.vmap(ragged_dot, (0, None, 0)), (XB, W, GSB), 1),
    "vmap_all": (jax.vmap(ragged_dot), (XB, WB, GSB), 1),
    "grad_of_vmap": (jax.grad(_loss(jax.vmap(ragged_dot, (0, None, 0))), (0, 1)), (XB, W, GSB), 2),
    "vmap_of_grad": (jax.vmap(jax.grad(_loss(ragged_dot), (0, 1))), (XB, WB, GSB), 2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_lowers_to_grouped_kernels(name):
    f, args, launches = CASES[name]
    text = _lower(f, *args)
    assert text.count("jax_cute_launch") >= launches, text
    bad = [op for op in FORBIDDEN if op in text]
    assert not bad, f"{name}: {bad} in the lowered module"


def test_a_group_past_the_tma_extent_falls_back_with_the_reason(caplog):
    """The grouped kernels address a group in a TMA mode of 2**30 rows: a longer lhs (which one
    group could fill) goes to XLA, logged, or raises in strict mode."""
    big = jax.ShapeDtypeStruct((2**30 + 128, K), jnp.bfloat16)
    with pytest.raises(jax_cute.FallbackError, match="past the grouped kernels' TMA extent"):
        _lower(ragged_dot, big, W, GS)
    with jax_cute.config.override(target_arch="sm_90a"), caplog.at_level("WARNING", logger="jax_cute"):
        text = jax.jit(ragged_dot).trace(big, W, GS).lower(lowering_platforms=("cuda",)).as_text()
    assert "@jax_cute_launch" not in text and "TMA extent" in caplog.text


def test_tail_split_workspace():
    """Where K holds enough k-tiles, the forward runs the walk's tail split: the launch takes a
    128 x 256 fp32 partial tile per CTA (132 on sm_90a) and 132 int32 arrival counters, which
    start zeroed; with a short K it takes neither."""
    x, w = jax.ShapeDtypeStruct((M, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((G, 2048, 512), jnp.bfloat16)
    text = _lower(ragged_dot, x, w, GS)
    assert f"tensor<{132 * 128 * 256}xf32>" in text and "tensor<132xi32>" in text
    assert "dense<0> : tensor<i32>" in text        # the counters' zero fill (broadcast)
    short = _lower(ragged_dot, X, jax.ShapeDtypeStruct((G, K, 512), jnp.bfloat16), GS)
    assert f"tensor<{132 * 128 * 256}xf32>" not in short and "tensor<132xi32>" not in short
