"""Host cost of launching one GEMM: tiny and small independent products, 8 or 32 per jit.

For 128x256x64 the device work is a few microseconds, so the time per product is what it costs
to launch it (jax_cute: XLA's custom call, our FFI handler and the DSL's launcher, which encodes
the TMA descriptors; XLA: its own GEMM launch). The larger sizes show where launches stop
mattering. jax_cute.matmul vs jnp.matmul in one process, rotated rounds (benchmarks/common.py),
with chain_effect.py's loop.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from chain_effect import time_chains  # noqa: E402
from common import suite_main  # noqa: E402

SHAPES = [(128, 256, 64), (1024, 1024, 1024), (2048, 2048, 2048)]
CHAINS = (8, 32)


def run(args: argparse.Namespace) -> list[dict]:
    if args.smoke:
        return time_chains("launch", SHAPES[:1], CHAINS[:1], 2)
    return time_chains("launch", SHAPES, CHAINS, 5)


if __name__ == "__main__":
    suite_main(run, __doc__.splitlines()[0])
