"""Does timing 8 independent products per jit change the jax_cute / XLA ratio?

The GEMM suite (bench_matmul.py) times every shape as CHAIN independent products inside one
jit, so that a 30 us product is timed on the device rather than by host dispatch. XLA may
schedule those independent dots differently from a chain of our custom calls (which run one
after another on XLA's stream). This script times the same shapes both ways, one product per
call and 8 per call, jax_cute.matmul and jnp.matmul in the same process with
benchmarks/common.measure (rotated rounds, fresh random bf16 data), and prints the ratios.
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

# products of at least ~0.1 TFLOP: long enough (>0.15 ms) that one per call times the device
SHAPES = [(8192, 8192, 8192), (4096, 14336, 4096), (4096, 4096, 14336), (16384, 2048, 2048),
          (4096, 4096, 4096)]
SMOKE_SHAPES = [(128, 256, 64)]
CHAINS = (1, 8)


def time_chains(suite: str, shapes, chains, rounds: int) -> list[dict]:
    """jax_cute.matmul and jnp.matmul on each (M, N, K) in ``shapes``, timed with each chain
    length in ``chains`` (independent products per jit); prints jax_cute / XLA per case."""
    recs: list[dict] = []
    for m, n, k in shapes:
        mk = lambda s, m=m, n=n, k=k: tuple(  # noqa: E731
            jax.random.normal(key, sh, jnp.bfloat16)
            for key, sh in zip(jax.random.split(jax.random.key(s)), [(m, k), (k, n)]))
        for chain in chains:
            recs += measure(suite, "gemm", f"{m}x{n}x{k} chain {chain}",
                            [Impl("jax_cute", jax_cute.matmul), Impl("xla", jnp.matmul)], mk,
                            2.0 * m * n * k, rounds=rounds, chain=chain,
                            meta={"m": m, "n": n, "k": k, "dtype": "bfloat16"})
    by = {}
    for r in recs:
        by.setdefault(r["case"], {})[r["impl"]] = r.get("ms")
    print(f"\n{'case':32s} {'jax_cute ms':>12s} {'xla ms':>9s} {'ratio':>6s}")
    for case, v in by.items():
        if v.get("jax_cute") and v.get("xla"):
            print(f"{case:32s} {v['jax_cute']:12.4f} {v['xla']:9.4f} {v['xla'] / v['jax_cute']:6.3f}")
    return recs


def run(args: argparse.Namespace) -> list[dict]:
    return time_chains("chain", SMOKE_SHAPES if args.smoke else SHAPES, CHAINS, 2 if args.smoke else args.rounds)


if __name__ == "__main__":
    suite_main(run, __doc__.splitlines()[0])
