"""What the training examples share: their command line, which path a step took, and the timed
step loop."""

from __future__ import annotations

import argparse
import statistics
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
    lowered = step.lower(*args)
    hlo = lowered.as_text()
    if "jax_cute_launch" not in hlo and "CustomSPMDPartitioning" in hlo:
        hlo = lowered.compile().as_text()  # sharded products become kernels when partitioned
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


def compare_line(names: tuple[str, str], ms: float, ref_ms: float) -> str:
    """``names[0]`` against ``names[1]`` in words: both step times, then which is faster and by
    how much (always a factor >= 1, so the sentence reads one way only)."""
    faster = ref_ms >= ms
    factor = ref_ms / ms if faster else ms / ref_ms
    line = (f"{names[0]} step {ms:.2f} ms, {names[1]} step {ref_ms:.2f} ms: "
            f"{names[0]} {factor:.2f}x {'faster' if faster else 'slower'}")
    if jax.default_backend() != "gpu":
        line += " (no GPU: both ran plain XLA ops, not jax_cute kernels)"
    return line


def train_and_compare(step: Callable, ref_step: Callable | None, params, x: jax.Array, y: jax.Array,
                      steps: int, *, names: tuple[str, str], labels: tuple[str, str], flops: float,
                      gemms: str, verbose: bool) -> dict:
    """Train with ``step`` and, unless ``ref_step`` is None, again with ``ref_step`` from the same
    start; print a line per run and one comparing their median step times, and fail when the
    loss did not go down. ``names`` head the printed lines, ``labels`` the per-step lines;
    ``flops`` per step are reported as TFLOP/s in ``gemms``."""
    losses, times = train(step, params, x, y, steps, labels[0], verbose)
    ms = statistics.median(times[1:] or times)  # the first step includes compilation
    width = max(len(n) for n in names) + 1
    print(f"{names[0] + ':':<{width}} loss {losses[0]:.5f} -> {losses[-1]:.5f}; median {ms:.2f} ms/step "
          f"({flops / ms / 1e9:.1f} TFLOP/s in the {gemms})")
    out = {"losses": losses, "ms": ms}
    if ref_step is not None:
        ref_losses, ref_times = train(ref_step, params, x, y, steps, labels[1], False)
        ref_ms = statistics.median(ref_times[1:] or ref_times)
        print(f"{names[1] + ':':<{width}} loss {ref_losses[0]:.5f} -> {ref_losses[-1]:.5f}; median {ref_ms:.2f} ms/step "
              f"({flops / ref_ms / 1e9:.1f} TFLOP/s in the {gemms})")
        out.update(ref_losses=ref_losses, ref_ms=ref_ms, comparison=compare_line(names, ms, ref_ms))
        print(out["comparison"])
    if not losses[-1] < losses[0]:
        raise SystemExit(f"loss did not go down: {losses[0]} -> {losses[-1]}")
    return out
