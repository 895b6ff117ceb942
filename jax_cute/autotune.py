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

import fcntl
import json
import logging
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_cute import arch as arch_info
from jax_cute import config
from jax_cute.cache import atomic_write, family_binary, untrusted_reason
from jax_cute.cache_key import kernel_sources_digest
from jax_cute.custom_call import kernel_call, workspace_outputs

logger = logging.getLogger("jax_cute")
_lock = threading.Lock()
CHAIN_BELOW_FLOPS = 2e11
CHAIN = 8


def _table_path() -> Path | None:
    """``autotune.json`` in the cache directory, or None where the cache would not use it."""
    root = config.cache_dir()
    return None if untrusted_reason(root) else root / "autotune.json"


def _load() -> dict:
    """The table of winners; {} (with a warning, to be filled again) if it is unreadable or is
    not a JSON object."""
    path = _table_path()
    if path is None:
        return {}
    try:
        table = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        logger.warning("jax_cute autotune: ignoring %s (%s); problems will be tuned again", path, e)
        return {}
    if not isinstance(table, dict):
        logger.warning("jax_cute autotune: ignoring %s (a JSON %s, not an object); problems will be tuned again",
                       path, type(table).__name__)
        return {}
    return table


def _known(table: dict, key: str, candidates: dict):
    """The recorded winner for ``key`` among ``candidates``, or None (unknown, malformed: warned)."""
    entry = table.get(key)
    if entry is None:
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("config"), str):
        logger.warning("jax_cute autotune: ignoring the malformed entry for %s (%r); tuning it again", key, entry)
        return None
    return candidates.get(entry["config"])


def _record(key: str, entry: dict) -> None:
    """Add ``entry`` under ``key``: read, update and replace the table atomically, under an fcntl
    lock, so processes tuning at once keep each other's winners. A failure is only logged."""
    path = _table_path()
    if path is None:
        return
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(path.with_name("autotune.json.lock"), "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when closed
            table = _load()
            table[key] = entry
            atomic_write(path, json.dumps(table, indent=1, sort_keys=True).encode())
    except OSError as e:
        logger.warning("jax_cute autotune: could not record the winner for %s in %s (%s)", key, path, e)


def problem_key(fam, arch: str, spec, dims: tuple[int, ...]) -> str:
    """The table's key: the kernel sources' digest stands for the family's code."""
    code = (kernel_sources_digest() or "unkeyed")[:16]
    return f"{fam.FAMILY}/{code}/{arch}/{spec.key()}/{'x'.join(map(str, dims))}"


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
        known = _known(_load(), key, candidates)
        if known is not None:
            return known
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
        _record(key, {"config": best, "seconds": results[best], "timed": len(results), "chain": chain})
        return candidates[best]
