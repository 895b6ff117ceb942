"""What the training examples share: their command line, which path a step took, and the timed
step loop."""

from __future__ import annotations

import argparse
import time
from typing import Callable

import jax


def parse_args(doc: str, sizes: dict, rival: str, argv: list[str] | None) -> argparse.Namespace:
    """The examples' shared options; ``rival`` names what --no-compare skips."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--size", choices=sorted(sizes), default="large" if jax.default_backend() == "gpu" else "small")
    p.add_argument("--steps", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--no-compare", action="store_true", help=f"skip the {rival} run")
    p.add_argument("--quiet", action="store_true", help="no per-step lines")
    return p.parse_args(argv)


def path_taken(step: Callable, *args) -> str:
    """Where ``step`` runs: the reference path on a CPU, or our kernels (or XLA) on a GPU."""
    if jax.default_backend() != "gpu":
        return "reference path on CPU (no GPU found)"
    dev = jax.devices()[0].device_kind
    hlo = step.lower(*args).as_text()
    return f"jax_cute kernels on {dev}" if "jax_cute_launch" in hlo else f"XLA fallback on {dev} (see the jax_cute log)"


def train(step: Callable, params, x: jax.Array, y: jax.Array, steps: int, label: str,
          verbose: bool) -> tuple[list[float], list[float]]:
    """Run ``steps`` SGD steps over the batches of (x, y); returns the losses and ms per step."""
    losses, times = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        params, loss = step(params, x[i % len(x)], y[i % len(y)])
        loss = float(loss)  # blocks until the step is done
        times.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss)
        if verbose:
            print(f"[{label}] step {i:3d}  loss {loss:10.5f}  {times[-1]:8.2f} ms/step")
    return losses, times
