"""Scan suite: a stack of MLP layers under ``lax.scan`` (the way models repeat their blocks),
each layer under ``jax.checkpoint`` with a remat policy or none, the value and gradient of a
loss: ``jax_cute.kernelize`` (gelu in the first GEMM's epilogue, its derivative in the backward
GEMM of the second) against the same stack on XLA, as written (float32 product outputs, so its
gradient GEMMs take float32 cotangents) and with bf16 product outputs (bf16 gradient GEMMs, as
ours; its gelu reads the rounded product). The policies see plain dots either way."""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax_cute  # noqa: E402
from common import Impl, measure, suite_main  # noqa: E402

BF16 = jnp.bfloat16
# (policy, prevent_cse): the last, as JAX documents it safe inside a scan, reads the residuals in place
POLICIES = (("dots_saveable", True), ("nothing_saveable", True), (None, True), ("dots_saveable", False))


def _mm(a, b):
    return jnp.matmul(a, b, preferred_element_type=jnp.float32)


def layer(x, w, mm=_mm):
    w1, w2 = w
    h = jax.nn.gelu(mm(x, w1)).astype(BF16)
    return x + mm(h, w2).astype(BF16)


def step(policy: str | None, kernelized: bool, mm=_mm, prevent_cse: bool = True):
    """The loss's value and its gradient in both stacked weights."""
    lay = jax_cute.kernelize(layer) if kernelized else (lambda x, w: layer(x, w, mm))
    if policy:
        lay = jax.checkpoint(lay, policy=getattr(jax.checkpoint_policies, policy), prevent_cse=prevent_cse)

    def loss(w1, w2, x):
        y, _ = jax.lax.scan(lambda c, w: (lay(c, w), None), x, (w1, w2))
        return jnp.mean(y.astype(jnp.float32) ** 2)
    return jax.value_and_grad(loss, argnums=(0, 1))


def run(args: argparse.Namespace) -> list[dict]:
    t, d, f, n = (64, 32, 128, 2) if args.smoke else (8192, 2048, 8192, 4)

    def make_args(seed):
        k = jax.random.split(jax.random.key(seed), 3)
        return (jax.random.normal(k[0], (n, d, f), BF16) * d ** -0.5,
                jax.random.normal(k[1], (n, f, d), BF16) * f ** -0.5,
                jax.random.normal(k[2], (t, d), BF16))

    recs: list[dict] = []
    for policy, cse in POLICIES:
        case = (f"{n} layers, {t} tokens, d_model {d}, MLP {f}, "
                + (f"checkpoint {policy}" if policy else "no checkpoint") + ("" if cse else ", prevent_cse=False"))
        recs += measure("scan", "scan", case,
                        [Impl("jax_cute", step(policy, True, prevent_cse=cse)),
                         Impl("xla", step(policy, False, prevent_cse=cse)),
                         Impl("xla_bf16", step(policy, False, jnp.matmul, cse))],
                        make_args, 12.0 * t * d * f * n, rounds=2 if args.smoke else args.rounds,
                        target_s=0.01 if args.smoke else 0.25, meta={"dtype": "bfloat16", "policy": policy, "prevent_cse": cse})
    return recs


if __name__ == "__main__":
    suite_main(run, __doc__.splitlines()[0])
