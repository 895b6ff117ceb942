"""Scaling suite: the GPT training step of examples/gpt_training.py on 1, 2, 4, ... of the
visible GPUs, data parallel (dense MLP) and expert parallel (MoE), with the same per-GPU batch at
every device count, jax_cute (kernelized) against the same model and sharding on XLA; the
data-parallel case also as jax_cute_float32_sums: the weight gradients' sums over devices in
float32 (``float32_partial_sums`` on: twice the bytes), beside the default bf16 sums.

    BENCH_SCALING_DEVICES=1,4 BENCH_SCALING_MODELS=dense python benchmarks/run.py --suite scaling ..."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax

import jax_cute

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import gpt_training as gpt  # noqa: E402
from common import Impl, measure, suite_main  # noqa: E402

PER_DEVICE_BATCH = 16  # sequences of 1024 tokens per GPU


def device_counts(available: int) -> list[int]:
    """1, 2, 4, ... up to the devices there are."""
    counts, n = [], 1
    while n <= available:
        counts.append(n)
        n *= 2
    return counts


def _selected(name: str, default: list) -> list:
    """``BENCH_SCALING_<name>``'s comma-separated choice out of ``default`` (all when unset)."""
    raw = os.environ.get(f"BENCH_SCALING_{name}", "")
    return [d for d in default if not raw or str(d) in raw.split(",")]


def run(args: argparse.Namespace) -> list[dict]:
    rounds = 2 if args.smoke else args.rounds
    recs: list[dict] = []
    for moe in [name == "moe" for name in _selected("MODELS", ["dense", "moe"])]:
        for n in _selected("DEVICES", device_counts(len(jax.devices()))):
            size = gpt.SIZES["tiny" if args.smoke else "h200"]
            cfg = dataclasses.replace(size, moe=moe, batch=(2 if args.smoke else PER_DEVICE_BATCH) * n)
            params, opt_state, tx = gpt.init_train_state(jax.random.key(0), cfg)
            mesh = gpt.make_mesh({"data": n})
            gpt.check_mesh(cfg, mesh)
            params, opt_state, shardings = gpt.shard_train_state(params, opt_state, tx, cfg, mesh)
            data = [gpt.place(d, shardings[2]) for d in gpt.batches(jax.random.key(1), cfg)]
            kind = "MoE top-2 of 8, expert parallel" if moe else "dense MLP, data parallel"
            case = f"{kind}, {n} GPU{'s' if n > 1 else ''} ({cfg.batch // n}x{cfg.seq} tokens per GPU)"
            impls = [Impl("jax_cute", gpt.make_step(cfg, tx, kernelized=True, mesh=mesh, shardings=shardings)),
                     Impl("xla", gpt.make_step(cfg, tx, kernelized=False, mesh=mesh, shardings=shardings))]
            if n > 1 and not moe:
                step = gpt.make_step(cfg, tx, kernelized=True, mesh=mesh, shardings=shardings)
                impls.append(Impl("jax_cute_float32_sums", step,
                                  context=lambda: jax_cute.config.override(float32_partial_sums=True)))
            got = measure("scaling", "scaling", case, impls, lambda s: (params, opt_state, data[s % len(data)]),
                          0.0, rounds=rounds, check=False,
                          meta={"dtype": "bfloat16", "devices": n, "moe": moe, "tokens": cfg.batch * cfg.seq})
            for r in got:
                if r["ms"]:
                    r["tokens_per_s_per_device"] = r["tokens"] / (r["ms"] * 1e-3) / n
            recs += got
    return recs


if __name__ == "__main__":
    suite_main(run, __doc__.splitlines()[0])
