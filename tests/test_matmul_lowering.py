"""The CUDA lowering of jax_cute.matmul, checked on a machine without a GPU.

With ``target_arch="sm_90a"`` the lowering compiles our Hopper kernel with the DSL (offline) and
emits the ``jax_cute_launch`` custom call. Every copy-free case must lower to custom calls with
no transpose, copy, gather, concatenate or pad around them; the documented non-copy-free cases
log one copy; unsupported ones fall back to XLA with a log line, or raise in strict mode.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import pytest

import jax_cute
from jax_cute import config

FORBIDDEN = ("stablehlo.transpose", "stablehlo.copy", "stablehlo.gather", "stablehlo.concatenate", "stablehlo.pad")
BF16 = jnp.bfloat16


def lowered(f, *shapes, dtype=BF16) -> str:
    args = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    with config.override(target_arch="sm_90a"):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def assert_copy_free(text: str, calls: int) -> None:
    assert text.count("stablehlo.custom_call @jax_cute_launch") == calls, text[:2000]
    for op in FORBIDDEN:
        assert op not in text, f"{op} in the lowered module"
    assert "dot_general" not in text  # nothing fell back to XLA


COPY_FREE = {
    "plain": (lambda a, b: jax_cute.matmul(a, b), [(256, 128), (128, 64)]),
    "transpose_a": (lambda a, b: jax_cute.matmul(a, b, transpose_a=True), [(128, 256), (128, 64)]),
    "transpose_b": (lambda a, b: jax_cute.matmul(a, b, transpose_b=True), [(256, 128), (64, 128)]),
    "both_transposed": (lambda a, b: jax_cute.matmul(a, b, transpose_a=True, transpose_b=True),
                        [(128, 256), (64, 128)]),
    "batched_both": (lambda a, b: jax_cute.matmul(a, b), [(4, 256, 128), (4, 128, 64)]),
    "broadcast_b": (lambda a, b: jax_cute.matmul(a, b), [(4, 256, 128), (128, 64)]),
    "broadcast_a": (lambda a, b: jax_cute.matmul(a, b), [(256, 128), (4, 128, 64)]),
    "vmap_a_axis0": (jax.vmap(jax_cute.matmul, in_axes=(0, None)), [(4, 256, 128), (128, 64)]),
    "vmap_a_axis1": (jax.vmap(jax_cute.matmul, in_axes=(1, None)), [(256, 4, 128), (128, 64)]),
    "vmap_both": (jax.vmap(jax_cute.matmul, in_axes=(0, 1)), [(4, 256, 128), (128, 4, 64)]),
    "vmap_b_only": (jax.vmap(jax_cute.matmul, in_axes=(None, 0)), [(256, 128), (4, 128, 64)]),
    # Nested levels are copy-free when they coalesce into the kernel's one batch mode.
    "nested_vmap": (jax.vmap(jax.vmap(jax_cute.matmul)), [(2, 3, 256, 128), (2, 3, 128, 64)]),
    "nested_vmap_folds_into_m": (jax.vmap(jax.vmap(jax_cute.matmul, in_axes=(0, None)), in_axes=(0, None)),
                                 [(2, 3, 256, 128), (128, 64)]),
}


@pytest.mark.parametrize("case", sorted(COPY_FREE))
def test_copy_free_forward(case):
    f, shapes = COPY_FREE[case]
    assert_copy_free(lowered(f, *shapes), 1)


# The gradient of an operand broadcast over a batch sums over that batch. Where the batch
# continues K in memory it joins the reduction (the common x @ W weight gradient); elsewhere
# (broadcast_a, vmap_b_only, vmap_a_axis1) the kernel writes per-batch f32 partials that one
# reduction sums: still no copy, transpose or XLA dot.
@pytest.mark.parametrize("case", sorted(COPY_FREE))
def test_copy_free_gradients(case, caplog):
    f, shapes = COPY_FREE[case]
    loss = lambda *xs: f(*xs).astype(jnp.float32).sum()  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="jax_cute"):
        text = lowered(jax.grad(loss, argnums=(0, 1)), *shapes)
    assert_copy_free(text, 2)
    assert not [r for r in caplog.records if "copying operand" in r.getMessage()]


def test_mixed_precision_gradient_converts_once():
    def loss(a, b):
        return jax_cute.matmul(a, b, preferred_element_type=jnp.float32).sum()
    text = lowered(jax.grad(loss, argnums=(0, 1)), (256, 128), (128, 64))
    assert_copy_free(text, 2)
    assert text.count("stablehlo.convert") <= 2


def test_custom_call_carries_the_object_and_layouts():
    text = lowered(jax_cute.matmul, (256, 128), (128, 64))
    for attr in ("object = dense<", "arg_words", "arg_kinds", "symbol =", "arch_major = 9"):
        assert attr in text


def test_stream_launch_takes_the_stream_target_and_the_pdl_kernel():
    """command_buffer off: the call goes to the target XLA never records into a CUDA graph, and
    the Hopper kernel is its programmatic-dependent-launch build; the default does neither."""
    graph = lowered(lambda a, b: jax_cute.matmul(a, b), (256, 128), (128, 64))
    with config.override(command_buffer=False):
        stream = lowered(lambda a, b: jax_cute.matmul(a, b), (256, 128), (128, 64))
    assert "@jax_cute_launch(" in graph and "@jax_cute_launch_stream" not in graph
    assert "@jax_cute_launch_stream(" in stream and "@jax_cute_launch(" not in stream
    assert ".pdl" not in graph and ".pdl" in stream


def test_command_buffer_switch_reads_the_environment(monkeypatch):
    assert config.command_buffer()
    monkeypatch.setenv("JAX_CUTE_COMMAND_BUFFER", "0")
    assert not config.command_buffer()
    with config.override(command_buffer=True):
        assert config.command_buffer()


def test_vmap_over_the_contiguous_axis_logs_one_copy(caplog):
    f = jax.vmap(jax_cute.matmul, in_axes=(2, None))
    with caplog.at_level(logging.WARNING, logger="jax_cute"):
        text = lowered(f, (256, 128, 4), (128, 64))
    assert text.count("@jax_cute_launch") == 1
    copies = [r for r in caplog.records if "copying operand a" in r.getMessage()]
    assert len(copies) == 1


def test_misaligned_rows_are_padded_not_copied_or_left_to_xla(caplog):
    """K * 2 bytes is not a multiple of 16: the rows of A are padded to 128 elements (a pad XLA
    can fuse into A's producer), never transposed, copied or left to XLA's dot."""
    with caplog.at_level(logging.WARNING, logger="jax_cute"), config.override(strict=True):
        text = lowered(jax_cute.matmul, (256, 127), (127, 64))
    assert text.count("stablehlo.custom_call @jax_cute_launch") == 1 and "dot_general" not in text
    assert text.count("stablehlo.pad") == 1 and "stablehlo.transpose" not in text
    assert any("padding a from (256, 127) to (256, 128)" in r.getMessage() for r in caplog.records)


@pytest.mark.sweep   # (12 s: CI's second step, so the README's test line stays under 10 minutes)
def test_lm_head_with_a_50257_word_vocabulary_runs_the_kernel_forward_and_backward():
    """GPT-2's vocabulary: the Hopper kernel writes the logits (8192, 50257) where they are (rows
    of 100514 bytes, not a TMA stride: stored without TMA), no padded buffer and no slice; the
    gradients read the cotangent padded to 50264 (an operand's rows must be TMA strides). The
    Blackwell kernel stores with TMA only: its logits go through padded rows and a slice."""
    def loss(x, w):
        return jax_cute.matmul(x, w, transpose_b=True, preferred_element_type=jnp.float32).sum()

    def head(x, w):
        return jax_cute.matmul(x, w, transpose_b=True)

    with config.override(strict=True):
        fwd = lowered(head, (8192, 768), (50257, 768))
        bwd = lowered(jax.grad(loss, (0, 1)), (8192, 768), (50257, 768))
    assert fwd.count("stablehlo.custom_call @jax_cute_launch") == 1 and "dot_general" not in fwd
    assert "50264" not in fwd and "stablehlo.slice" not in fwd and "stablehlo.transpose" not in fwd
    assert ".cunaligned" in fwd
    assert bwd.count("stablehlo.custom_call @jax_cute_launch") == 2 and "dot_general" not in bwd
    assert "stablehlo.transpose" not in bwd and "tensor<8192x50264xbf16>" in bwd
    with config.override(strict=True, target_arch="sm_100a", unverified_kernels=True):
        fwd = jax.jit(lambda x, w: head(x, w)).trace(*(jax.ShapeDtypeStruct(s, BF16) for s in ((8192, 768), (50257, 768)))
                                                    ).lower(lowering_platforms=("cuda",)).as_text()
    assert "tensor<8192x50264xbf16>" in fwd and "stablehlo.slice" in fwd and ".cunaligned" not in fwd


# Switches are read when a function is lowered and JAX caches lowerings per function, so each
# test lowers a function of its own.
def test_unsupported_dtype_falls_back_and_strict_raises(caplog):
    with caplog.at_level(logging.WARNING, logger="jax_cute"):
        text = lowered(lambda a, b: jax_cute.matmul(a, b), (64, 64), (64, 64), dtype=jnp.float32)
    assert "@jax_cute_launch" not in text and "dot_general" in text
    assert any("falling back to XLA" in r.getMessage() and "float32" in r.getMessage() for r in caplog.records)
    with config.override(strict=True), pytest.raises(jax_cute.FallbackError, match="float32"):
        lowered(lambda a, b: jax_cute.matmul(a, b), (64, 64), (64, 64), dtype=jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_fp8_inputs_run_the_kernel_when_both_are_k_major(dtype):
    f = lambda x, w: jax_cute.matmul(x, w, transpose_b=True, preferred_element_type=BF16)  # noqa: E731
    text = lowered(f, (256, 128), (64, 128), dtype=dtype)
    assert_copy_free(text, 1)
    assert "float8" in text and "sm90_gemm.float8" in text


def test_e4m3_by_e5m2_runs_one_kernel():
    """lax.dot_general keeps e4m3fn x e5m2 as it is (no promotion): one WGMMA kernel takes both."""
    args = [jax.ShapeDtypeStruct((256, 128), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((64, 128), jnp.float8_e5m2)]
    f = lambda x, w: jax_cute.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=BF16)  # noqa: E731
    with config.override(target_arch="sm_90a"):
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert_copy_free(text, 1)
    assert "sm90_gemm.float8_e4m3fn.float8_e5m2" in text


def test_fp8_gradients_run_on_the_bf16_kernel():
    def loss(x, w):
        return jax_cute.matmul(x, w, transpose_b=True, preferred_element_type=jnp.float32).sum()

    text = lowered(jax.grad(loss, (0, 1)), (256, 128), (64, 128), dtype=jnp.float8_e4m3fn)
    assert text.count("stablehlo.custom_call @jax_cute_launch") == 2 and "dot_general" not in text
    assert text.count("sm90_gemm.bfloat16.bfloat16.bfloat16") == 2   # fp8 -> bf16 is exact


def test_fp8_with_n_major_b_falls_back_and_strict_says_why(caplog):
    f = lambda x, w: jax_cute.matmul(x, w, preferred_element_type=BF16)  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="jax_cute"):
        text = lowered(f, (256, 128), (128, 64), dtype=jnp.float8_e4m3fn)
    assert "@jax_cute_launch" not in text and "dot_general" in text
    with config.override(strict=True), pytest.raises(jax_cute.FallbackError, match="contiguous along K"):
        lowered(lambda x, w: jax_cute.matmul(x, w, preferred_element_type=BF16), (256, 128), (128, 64),
                dtype=jnp.float8_e4m3fn)


def test_no_target_arch_without_gpu_falls_back(caplog):
    args = [jax.ShapeDtypeStruct((64, 64), BF16)] * 2
    with caplog.at_level(logging.WARNING, logger="jax_cute"):
        text = jax.jit(jax_cute.matmul).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "@jax_cute_launch" not in text
    assert any("JAX_CUTE_TARGET_ARCH" in r.getMessage() for r in caplog.records)


def test_export_serialises_on_a_cpu_machine():
    from jax import export

    args = [jax.ShapeDtypeStruct((256, 128), BF16), jax.ShapeDtypeStruct((128, 64), BF16)]
    with config.override(target_arch="sm_90a"):
        exp = export.export(jax.jit(jax_cute.matmul), platforms=["cuda"],
                            disabled_checks=jax_cute.export_disabled_checks())(*args)
    blob = exp.serialize()
    again = export.deserialize(blob)
    assert "jax_cute_launch" in again.mlir_module()


@pytest.mark.parametrize("shapes,says", [
    ([(2**31, 64), (64, 64)], "M=2147483648 is past the kernels' int32 extents"),
    ([(64, 2**31), (2**31, 64)], "K=2147483648 is past the kernels' int32 extents"),
    ([(2**31 - 1, 64), (64, 64)], "M=2147483647 is past"),   # rounding up to tiles would overflow Int32
    ([(2**22, 64), (64, 2**22)], "output tiles of 64x64 are past the kernels' int32 tile count"),
])
def test_extents_past_int32_fall_back_with_the_reason(caplog, shapes, says):
    """Nothing is compiled or allocated: the shapes alone send the call to XLA (logged), or
    raise in strict mode."""
    with caplog.at_level(logging.WARNING, logger="jax_cute"):
        text = lowered(lambda a, b: jax_cute.matmul(a, b), *shapes)
    assert "@jax_cute_launch" not in text and "dot_general" in text
    assert any("falling back to XLA" in r.getMessage() and says in r.getMessage() for r in caplog.records)
    with config.override(strict=True), pytest.raises(jax_cute.FallbackError, match=says):
        lowered(lambda a, b: jax_cute.matmul(a, b, preferred_element_type=jnp.float32), *shapes)


@pytest.mark.parametrize("preset,kernel", [("DEFAULT", True), ("BF16_BF16_F32", True), ("F32_F32_F32", False),
                                            ("BF16_BF16_BF16", False), ("F16_F16_F32", False)])
def test_a_dot_algorithm_runs_on_the_kernel_only_where_it_computes_it(preset, kernel, caplog):
    """bf16 operands: the kernels multiply them as given into a float32 accumulator, which is
    BF16_BF16_F32; an algorithm asking for other operand or accumulator types is XLA's."""
    p = getattr(jax.lax.DotAlgorithmPreset, preset)
    f = lambda a, b: jax_cute.matmul(a, b, precision=p, preferred_element_type=jnp.float32)  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="jax_cute"):
        text = lowered(f, (256, 128), (128, 64))
    assert ("stablehlo.custom_call @jax_cute_launch" in text) == kernel
    assert any(f"dot algorithm {p}" in r.getMessage() for r in caplog.records) == (not kernel)
    if not kernel:
        g = lambda a, b: jax_cute.matmul(a, b, precision=p)  # noqa: E731 (not f: its lowering is cached)
        with config.override(strict=True), pytest.raises(jax_cute.FallbackError, match="dot algorithm"):
            lowered(g, (256, 128), (128, 64))
