"""Models suite: a GPT decoder's training step (examples/gpt_training.py), kernelized with
jax_cute.kernelize against the same model on XLA (and kernelized without fusing the MLP's gelu
into its first GEMM and its derivative into the backward GEMM of the second), dense and with a
mixture-of-experts feed-forward, bf16 with f32 master weights and AdamW. The like-for-like XLA row
runs the model with its products' f32 cotangents rounded to bf16 (as jax_cute's gradient GEMMs take
them), so the gradient GEMMs run in bf16 on XLA too."""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from typing import Iterator

import jax
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import gpt_training as gpt  # noqa: E402
from common import Impl, gpt_train_cases, measure, suite_main  # noqa: E402


def _bf16_cotangent(product, differentiable: int = 2):
    """``product(*operands)`` with an f32 result whose cotangent is rounded once to the operands'
    dtype: the gradient products then run on 16-bit inputs with 16-bit outputs. Operands past
    the first ``differentiable`` (group sizes) get no cotangent."""
    @jax.custom_vjp
    def f(*operands):
        return product(*operands, preferred_element_type=gpt.F32)

    def fwd(*operands):
        return f(*operands), operands

    def bwd(operands, ct):
        dtype = operands[0].dtype
        diff, rest = operands[:differentiable], operands[differentiable:]
        _, vjp = jax.vjp(lambda *xs: product(*xs, *rest, preferred_element_type=dtype), *diff)
        return (*vjp(ct.astype(dtype)), *(None for _ in rest))

    f.defvjp(fwd, bwd)
    return f


def _mm_bf16_grads(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return _bf16_cotangent(functools.partial(jax.numpy.einsum, spec))(a.astype(gpt.COMPUTE), b.astype(gpt.COMPUTE))


def _grouped_mm_bf16_grads(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    return _bf16_cotangent(lax.ragged_dot)(x.astype(gpt.COMPUTE), w.astype(gpt.COMPUTE), sizes)


@contextlib.contextmanager
def bf16_gradient_products() -> Iterator[None]:
    """While jit traces the step: the example's products (``gpt.mm``, ``gpt.grouped_mm``) with
    bf16 cotangents."""
    saved = gpt.mm, gpt.grouped_mm
    gpt.mm, gpt.grouped_mm = _mm_bf16_grads, _grouped_mm_bf16_grads
    try:
        yield
    finally:
        gpt.mm, gpt.grouped_mm = saved


def run(args: argparse.Namespace) -> list[dict]:
    rounds = 2 if args.smoke else args.rounds
    recs: list[dict] = []
    for moe, cfg, tx, make_args, case in gpt_train_cases(gpt, args.smoke):
        recs += measure("models", "e2e", case,
                        [Impl("jax_cute", gpt.make_step(cfg, tx, kernelized=True)),
                         Impl("xla", gpt.make_step(cfg, tx, kernelized=False)),
                         Impl("xla_bf16_grads", gpt.make_step(cfg, tx, kernelized=False),
                              context=bf16_gradient_products),
                         Impl("jax_cute_unfused", gpt.make_step(cfg, tx, kernelized=True, fuse_epilogues=False))],
                        make_args, 0.0, rounds=rounds, check=False, meta={"dtype": "bfloat16"})
    return recs


if __name__ == "__main__":
    suite_main(run, __doc__.splitlines()[0])
