"""Host cost of launching one GEMM: tiny and small independent products, 8 or 32 per jit.

For 128x256x64 the device work is a few microseconds, so the time per product is what it costs
to launch it (jax_cute: XLA's custom call, our FFI handler and the DSL's launcher, which encodes
the TMA descriptors; XLA: its own GEMM launch). The larger sizes show where launches stop
mattering. jax_cute.matmul vs jnp.matmul in one process, rotated rounds (benchmarks/common.py).
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

SHAPES = [(128, 256, 64), (1024, 1024, 1024), (2048, 2048, 2048)]
CHAINS = (8, 32)


def run(args: argparse.Namespace) -> list[dict]:
    recs: list[dict] = []
    for m, n, k in SHAPES[:1] if args.smoke else SHAPES:
        mk = lambda s, m=m, n=n, k=k: tuple(  # noqa: E731
            jax.random.normal(key, sh, jnp.bfloat16)
            for key, sh in zip(jax.random.split(jax.random.key(s)), [(m, k), (k, n)]))
        for chain in CHAINS[:1] if args.smoke else CHAINS:
            recs += measure("launch", "gemm", f"{m}x{n}x{k} chain {chain}",
                            [Impl("jax_cute", jax_cute.matmul), Impl("xla", jnp.matmul)], mk, 2.0 * m * n * k,
                            chain=chain, rounds=2 if args.smoke else 5, meta={"m": m, "n": n, "k": k})
    return recs


if __name__ == "__main__":
    suite_main(run, __doc__.splitlines()[0])
