"""Launch overhead: per-iteration time of a tiny cute_call kernel vs the same jnp op.

Both run ``iters`` times inside one jitted ``lax.fori_loop`` (each iteration depends on the
last), so what is left per iteration is launch cost plus a few microseconds of work. Both
update the loop carry in place, as XLA's fusion does (the kernel through
``input_output_aliases``); the row *new output buffer* writes a fresh buffer that XLA then
copies into the carry each iteration. Command
buffers (CUDA graphs) are turned off, ``XLA_FLAGS=--xla_gpu_enable_command_buffer=``, so each
kernel is a real launch; run.py starts this suite in its own process with that flag.
"""

from __future__ import annotations

import argparse
import os
import sys

if "--xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):
    # Must be set before jax initialises its backend.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

from common import Impl, measure, suite_main  # noqa: E402


def run(args: argparse.Namespace) -> list[dict]:
    from custom_kernel import axpby_raw  # the example's a * alpha + b kernel

    iters = 10 if args.smoke else 1000
    recs: list[dict] = []
    for n in ((1024,) if args.smoke else (1024, 1 << 20)):
        def looped(step):
            def f(a, b):
                alpha = jnp.float32(0.5)  # |alpha| < 1 keeps the chain bounded
                return jax.lax.fori_loop(0, iters, lambda i, x: step(x, b, alpha), a)
            return f

        mk = lambda s, n=n: (jax.random.normal(jax.random.key(s), (n,), jnp.float32),  # noqa: E731
                             jax.random.normal(jax.random.key(s + 1), (n,), jnp.float32))
        rs = measure("launch", "launch", f"a*alpha+b f32 n={n}, {iters} iterations",
                     [Impl("jax_cute", looped(lambda x, b, s: axpby_raw(x, b, s, in_place=True))),
                      Impl("xla", looped(lambda x, b, s: x * s + b)),
                      Impl("jax_cute_new_buffer", looped(axpby_raw))],
                     mk, 0.0, rounds=3 if args.smoke else args.rounds, target_s=0.05,
                     meta={"n": n, "iters": iters, "xla_flags": os.environ.get("XLA_FLAGS", "")})
        for r in rs:  # per-iteration time is what this suite is about
            r["us_per_iter"] = None if r["ms"] is None else r["ms"] * 1e3 / iters
        recs += rs
    return recs


if __name__ == "__main__":
    suite_main(run, __doc__.splitlines()[0])
