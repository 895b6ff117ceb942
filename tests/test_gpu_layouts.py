"""On a GPU: products whose operands jax_cute reads where they lie, against a float32 reference on
fresh random data (every element, outputs NaN-filled before each launch), with no transpose,
copy or XLA dot in the compiled HLO around our kernels."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cute
from jax_cute import config

pytestmark = pytest.mark.gpu

BF16 = jnp.bfloat16
# an HLO instruction "%name = type opcode(...)" whose opcode moves or multiplies data on XLA's side
_FORBIDDEN = re.compile(r"= \S+ (transpose|copy|dot)\(|custom_call_target=\"__cublas|triton_gemm")


def rand(shape, seed, dtype=BF16):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def f32(f):
    """``f`` on float32 copies of its arguments, at full precision."""
    def g(*args):
        with jax.default_matmul_precision("highest"):
            return f(*(a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in args))
    return g


def check(f, ref, *args, calls: int, tol: float = 2e-2) -> None:
    """``f`` runs ``calls`` jax_cute kernels and nothing XLA would copy or multiply with, and
    every element of its result is within ``tol`` of ``ref`` relative to the largest entry."""
    with config.override(strict=True, nan_fill=True):
        compiled = jax.jit(f).lower(*args).compile()
        got = compiled(*args)
    text = compiled.as_text()
    assert text.count('custom_call_target="jax_cute_launch"') == calls, text[:3000]
    bad = [ln.strip() for ln in text.splitlines() if _FORBIDDEN.search(ln)]
    assert not bad, "\n".join(bad[:10])
    want = jax.jit(f32(ref))(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == w.shape
        g32 = g.astype(jnp.float32)
        assert bool(jnp.isfinite(g32).all()), "unwritten (NaN) or non-finite elements"
        err = float(jnp.max(jnp.abs(g32 - w)) / jnp.maximum(jnp.max(jnp.abs(w)), 1e-30))
        assert err <= tol, f"relative error {err:.2e}"


def test_nested_vmap_of_a_product_with_a_broadcast_operand():
    f = jax.vmap(jax.vmap(jax_cute.matmul, in_axes=(0, None)), in_axes=(1, None))
    r = jax.vmap(jax.vmap(jnp.matmul, in_axes=(0, None)), in_axes=(1, None))
    check(f, r, rand((4, 3, 256, 64), 0), rand((64, 2048), 1), calls=1)


def test_vmap_over_a_batched_product():
    f = jax.vmap(jax_cute.matmul, in_axes=(1, 1))     # two batch modes that do not coalesce
    check(f, jax.vmap(jnp.matmul, in_axes=(1, 1)), rand((2, 3, 200, 136), 2), rand((2, 3, 136, 264), 3), calls=1)


def test_vmap_over_a_batched_product_with_a_broadcast_rhs():
    f = jax.vmap(jax_cute.matmul, in_axes=(1, None))
    check(f, jax.vmap(jnp.matmul, in_axes=(1, None)), rand((2, 3, 200, 136), 4), rand((2, 136, 264), 5), calls=1)


@pytest.mark.parametrize("spec,sa,sb", [("bthd,bshd->bhts", (2, 384, 4, 128), (2, 256, 4, 128)),
                                        ("bhts,bshd->bthd", (2, 4, 384, 256), (2, 256, 4, 128))])
def test_attention_einsums_read_and_write_their_layouts(spec, sa, sb):
    check(lambda x, y: jax_cute.einsum(spec, x, y), lambda x, y: jnp.einsum(spec, x, y),
          rand(sa, 6), rand(sb, 7), calls=1)


def test_attention_einsum_gradients():
    spec = "bthd,bshd->bhts"
    f = jax.grad(lambda q, k: (jax_cute.einsum(spec, q, k).astype(jnp.float32) ** 2).sum() * 1e-3, (0, 1))
    r = jax.grad(lambda q, k: (jnp.einsum(spec, q, k) ** 2).sum() * 1e-3, (0, 1))
    check(f, r, rand((2, 256, 4, 64), 8), rand((2, 192, 4, 64), 9), calls=3)


def test_weight_gradient_form_of_dot_general():
    dn = (((0,), (0,)), ((), ()))   # dW = x^T dy, contracting the token axis of both
    check(lambda x, dy: jax_cute.dot_general(x, dy, dn), lambda x, dy: jax.lax.dot_general(x, dy, dn),
          rand((1000, 264), 10), rand((1000, 520), 11), calls=1)


@pytest.mark.parametrize("m, n, out, fused", [(1000, 1031, BF16, False), (777, 50257, jnp.float32, False),
                                          (1000, 1031, BF16, True), (130, 333, jnp.float16, True)])
def test_unaligned_output_rows_are_written_where_they_lie(m, n, out, fused):
    """Output rows of N elements that are not a multiple of 16 bytes (N = 1031, a 50257-word
    vocabulary): the kernel stores them without TMA, where they lie: no padded output buffer and
    no slice after it (B, whose rows are N wide too, is padded: an operand's rows must be TMA
    strides); with a fused bias and gelu too."""
    x, w = rand((m, 776), 20), rand((776, n), 21)
    b = rand((n,), 22, jnp.float32) if fused else None
    act = "gelu" if fused else None

    def ours(x, w):
        return jax_cute.matmul(x, w, preferred_element_type=out, bias=b, activation=act)

    def ref(x, w):
        y = x @ w + (0 if b is None else b)
        return jax.nn.gelu(y) if fused else y

    check(ours, ref, x, w, calls=1)
    with config.override(strict=True):
        text = jax.jit(ours).lower(x, w).compile().as_text()
    pads = re.findall(r"= \S+\[(\d+),(\d+)\]\S* pad\(", text)
    assert "slice(" not in text and all(int(r) == 776 for r, _ in pads), pads


def test_lm_head_with_a_50257_word_vocabulary_forward_and_backward():
    m, k, v = 2048, 768, 50257
    x, w = rand((m, k), 12), rand((v, k), 13)
    labels = jax.random.randint(jax.random.key(14), (m,), 0, v)

    def xent(mm):
        def loss(x, w):
            logits = mm(x, w).astype(jnp.float32)
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))
        return loss

    ours = lambda x, w: jax_cute.matmul(x, w, transpose_b=True)  # noqa: E731
    check(ours, lambda x, w: x @ w.T, x, w, calls=1)
    # float32 logits, as training computes its loss: bf16 logits of magnitude ~30 would move the
    # softmax by up to 10% against the float32 reference, whoever rounds them
    ours32 = lambda x, w: jax_cute.matmul(x, w, transpose_b=True, preferred_element_type=jnp.float32)  # noqa: E731
    check(jax.grad(xent(ours32), (0, 1)), jax.grad(xent(lambda x, w: x @ w.T), (0, 1)), x, w, calls=3)
