"""Optional autotuning (``JAX_CUTE_AUTOTUNE=1``): time every candidate config on the GPU once per
problem and remember the winner on disk (``<cache dir>/autotune.json``).

Without it, configs come from each family's heuristic. Tuning runs when a problem is first
lowered on a machine whose GPU is the target; winners found elsewhere are reused as they are.
Candidates are timed without the debug NaN prefill, in interleaved rounds; a problem of fewer
than CHAIN_BELOW_FLOPS (a few hundred microseconds) is timed as CHAIN independent products in
one jit, since one per call would time the host's dispatch rather than the kernel. Even so,
timed from inside a lowering, products of a few tens of microseconds ran at about half the
suite's rate on an H200 (2026-11-22): rankings below that size are unreliable.
"""

from __future__ import annotations

import json
import logging
import os
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_cute import arch as arch_info
from jax_cute import config
from jax_cute.cache import family_binary
from jax_cute.custom_call import kernel_call, workspace_outputs

logger = logging.getLogger("jax_cute")
_lock = threading.Lock()
CHAIN_BELOW_FLOPS = 2e11
CHAIN = 8


def _table_path() -> Path:
    return config.cache_dir() / "autotune.json"


def _load() -> dict:
    try:
        return json.loads(_table_path().read_text())
    except (OSError, ValueError):
        return {}


def _store(table: dict) -> None:
    path = _table_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def problem_key(fam, arch: str, spec, dims: tuple[int, ...]) -> str:
    return f"{fam.FAMILY}/v{fam.VERSION}/{arch}/{spec.key()}/{'x'.join(map(str, dims))}"


def round_order(items: Sequence, r: int) -> list:
    """Round ``r``'s order: item ``r`` (mod their number) first, so that the clock's ramp after
    an idle gap is not always charged to the same item, then the rest in a random order seeded
    by ``r``, because on an H200 a short window's time also depends on which kernel ran just
    before it (4-8%): under a fixed cycle every item has the same neighbour."""
    k = r % len(items) if items else 0
    rest = list(items[k + 1:]) + list(items[:k])
    random.Random(r).shuffle(rest)
    return list(items[k:k + 1]) + rest


def _time_interleaved(fns: dict, args, window: float = 0.02, rounds: int = 5) -> dict[str, float]:
    """Median seconds per call of each (warmed-up) function, sampled in rounds ordered by
    round_order, each after one untimed call of its first function (timing each to completion
    in a fixed order would charge the clock's ramp and drift to the same candidates). A sample
    is about ``window`` seconds of back-to-back calls."""
    names = list(fns)
    reps = {}
    for n in names:
        t = time.perf_counter()
        jax.block_until_ready(fns[n](*args))
        reps[n] = max(3, min(200, int(window / max(time.perf_counter() - t, 1e-6))))
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        turn = round_order(names, r)
        jax.block_until_ready(fns[turn[0]](*args))
        for n in turn:
            t = time.perf_counter()
            for _ in range(reps[n]):
                out = fns[n](*args)
            jax.block_until_ready(out)
            samples[n].append((time.perf_counter() - t) / reps[n])
    return {n: statistics.median(v) for n, v in samples.items()}


def tuned_gemm_config(fam, arch: str, spec, flat, dts, default):
    """The best config for a dense GEMM problem (timed here if unknown), or ``default``."""
    key = problem_key(fam, arch, spec, (flat.m, flat.n, flat.k, flat.l))
    candidates = {c.key(): c for c in fam.candidate_configs(spec)}
    with _lock:
        known = _load().get(key)
        if known and known["config"] in candidates:
            return candidates[known["config"]]
        if arch_info.device_arch() != arch:
            return default  # nothing here to time on
        rng = np.random.default_rng(0)

        def cosize(op) -> int:  # the buffer a flat operand spans
            return 1 + sum((s - 1) * d for s, d in zip(op.shape, op.stride))

        def operands():
            return (jnp.asarray(rng.standard_normal(cosize(flat.a), dtype=np.float32)).astype(dts[0]),
                    jnp.asarray(rng.standard_normal(cosize(flat.b), dtype=np.float32)).astype(dts[1]))

        a, b = operands()
        c_size = cosize(flat.c)
        fns = {}
        for name, cfg in candidates.items():
            try:
                binary = family_binary(fam, arch, spec, cfg)
                ws = fam.workspace(spec, cfg, flat.m, flat.n, flat.k, flat.l)
                outs = {"c": (jax.ShapeDtypeStruct((c_size,), dts[2]), flat.c.shape, flat.c.stride)}
                outs.update(workspace_outputs(binary, ws))
                zeroed = [w.name for w in ws if w.zeroed]
                fn = lambda x, y, binary=binary, outs=outs, zeroed=zeroed: kernel_call(  # noqa: E731
                    binary, {"a": (x, flat.a.shape, flat.a.stride), "b": (y, flat.b.shape, flat.b.stride)},
                    outs, zeroed=zeroed, nan_fill=False)["c"]
                jax.block_until_ready(jax.jit(fn)(a, b))  # builds, loads and runs it once
                fns[name] = fn
            except Exception as e:  # noqa: BLE001 - a config that fails here is just not chosen
                logger.warning("jax_cute autotune: %s failed on %s: %s", name, key, e)
        if not fns:
            return default
        flops = 2 * flat.m * flat.n * flat.k * flat.l
        chain = CHAIN if flops < CHAIN_BELOW_FLOPS else 1
        pairs = (tuple(operands() for _ in range(chain - 1)) + ((a, b),))
        results = _time_interleaved(
            {n: jax.jit(lambda ps, fn=fn: [fn(x, y) for x, y in ps]) for n, fn in fns.items()}, (pairs,))
        results = {n: t / chain for n, t in results.items()}
        best = min(results, key=results.get)
        logger.info("jax_cute autotune %s: %s", key, ", ".join(
            f"{n} {flops / t / 1e12:.0f} TFLOP/s" for n, t in sorted(results.items(), key=lambda kv: kv[1])))
        table = _load()
        table[key] = {"config": best, "seconds": results[best], "timed": len(results), "chain": chain}
        _store(table)
        return candidates[best]
