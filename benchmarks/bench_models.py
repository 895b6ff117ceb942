"""Models suite: a GPT decoder's training step (examples/gpt_training.py), kernelized with
jax_cute.kernelize against the same model on XLA (and kernelized without fusing the MLP's gelu
into its first GEMM and its derivative into the backward GEMM of the second), dense and with a
mixture-of-experts feed-forward, bf16 with f32 master weights and AdamW."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import gpt_training as gpt  # noqa: E402
from common import Impl, measure, suite_main  # noqa: E402


def run(args: argparse.Namespace) -> list[dict]:
    rounds = 2 if args.smoke else args.rounds
    recs: list[dict] = []
    for moe in (False, True):
        cfg = dataclasses.replace(gpt.SIZES["tiny" if args.smoke else "h200"], moe=moe)
        params, opt_state, tx = gpt.init_train_state(jax.random.key(0), cfg)
        data = gpt.batches(jax.random.key(1), cfg)
        ffn = f"MoE top-{cfg.top_k} of {cfg.experts}" if moe else "dense MLP"
        case = (f"GPT train step, d_model {cfg.d_model}, {cfg.heads} heads, {cfg.layers} layers, {ffn}, "
                f"{cfg.batch}x{cfg.seq} tokens, vocab {cfg.vocab}")
        recs += measure("models", "e2e", case,
                        [Impl("jax_cute", gpt.make_step(cfg, tx, kernelized=True)),
                         Impl("xla", gpt.make_step(cfg, tx, kernelized=False)),
                         Impl("jax_cute_unfused", gpt.make_step(cfg, tx, kernelized=True, fuse_epilogues=False))],
                        lambda s: (params, opt_state, data[s % len(data)]), 0.0, rounds=rounds, check=False,
                        meta={"dtype": "bfloat16"})
    return recs


if __name__ == "__main__":
    suite_main(run, __doc__.splitlines()[0])
