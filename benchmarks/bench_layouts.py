"""Layouts suite: products whose operands jax_cute reads where they lie, against XLA, bf16.

Multi-head attention's two einsums on (B, T, H, D) activations (XLA transposes to (B, H, T, D)
around its batched GEMM; jax_cute reads and writes the layouts as they are), a GPT-2 LM head
(vocabulary 50257: rows that are not a multiple of 16 bytes) forward and through a cross-entropy
loss's gradients, and a vmap of a batched product against the same product written flat.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax_cute  # noqa: E402
from common import Impl, measure, suite_main  # noqa: E402

DT = jnp.bfloat16


def normal(seed: int, *shapes) -> tuple:
    return tuple(jax.random.normal(k, s, DT) for k, s in zip(jax.random.split(jax.random.key(seed), len(shapes)), shapes))


def xent(einsum_or_matmul):
    """Mean cross-entropy of logits = x @ w.T against labels; its gradient w.r.t. x and w."""
    def loss(x, w, labels):
        logits = einsum_or_matmul(x, w).astype(jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))
    return jax.grad(loss, (0, 1))


def run(args: argparse.Namespace) -> list[dict]:
    rounds = 2 if args.smoke else args.rounds
    recs: list[dict] = []
    b, t, h, d = (2, 128, 2, 64) if args.smoke else (8, 2048, 16, 128)
    flops = 2.0 * b * h * t * t * d
    for spec, shapes in (("bthd,bshd->bhts", [(b, t, h, d), (b, t, h, d)]),
                         ("bhts,bshd->bthd", [(b, h, t, t), (b, t, h, d)])):
        recs += measure("layouts", "gemm", f"attention {spec} B={b} T={t} H={h} D={d}",
                        [Impl("jax_cute", lambda x, y, s=spec: jax_cute.einsum(s, x, y)),
                         Impl("xla", lambda x, y, s=spec: jnp.einsum(s, x, y))],
                        lambda s, shapes=shapes: normal(s, *shapes), flops, rounds=rounds,
                        meta={"dtype": "bfloat16"})

    m, k, v = (256, 64, 1000) if args.smoke else (8192, 768, 50257)
    ours = lambda x, w: jax_cute.matmul(x, w, transpose_b=True)  # noqa: E731
    xla = lambda x, w: jnp.matmul(x, w.T)  # noqa: E731
    mk = lambda s: normal(s, (m, k), (v, k))  # noqa: E731
    recs += measure("layouts", "gemm", f"LM head forward {m}x{v}x{k}", [Impl("jax_cute", ours), Impl("xla", xla)],
                    mk, 2.0 * m * v * k, rounds=rounds, meta={"dtype": "bfloat16"})
    labels = jax.random.randint(jax.random.key(7), (m,), 0, v)
    mkl = lambda s: (*normal(s, (m, k), (v, k)), labels)  # noqa: E731
    recs += measure("layouts", "gemm", f"LM head cross-entropy gradients {m}x{v}x{k}",
                    [Impl("jax_cute", xent(ours)), Impl("xla", xent(xla))], mkl, 2 * 2.0 * m * v * k,
                    rounds=rounds, meta={"dtype": "bfloat16"})

    vb, lb, mm, nn, kk = (2, 2, 64, 128, 64) if args.smoke else (2, 4, 2048, 1536, 1024)
    # vmap over axis 1 of a product batched along axis 0: two batch modes that do not coalesce
    mkv = lambda s: normal(s, (lb, vb, mm, kk), (lb, vb, kk, nn))  # noqa: E731
    recs += measure("layouts", "gemm", f"vmap of batched {vb}x{lb}x({mm}x{nn}x{kk})",
                    [Impl("jax_cute", jax.vmap(jax_cute.matmul, in_axes=(1, 1))),
                     Impl("xla", jax.vmap(jnp.matmul, in_axes=(1, 1)))],
                    mkv, 2.0 * vb * lb * mm * nn * kk, rounds=rounds, meta={"dtype": "bfloat16"})
    mkf = lambda s: normal(s, (vb * lb, mm, kk), (vb * lb, kk, nn))  # noqa: E731
    recs += measure("layouts", "gemm", f"flat batched {vb * lb}x({mm}x{nn}x{kk})",
                    [Impl("jax_cute", jax_cute.matmul), Impl("xla", jnp.matmul)],
                    mkf, 2.0 * vb * lb * mm * nn * kk, rounds=rounds, meta={"dtype": "bfloat16"})
    return recs


if __name__ == "__main__":
    suite_main(run, __doc__.splitlines()[0])
