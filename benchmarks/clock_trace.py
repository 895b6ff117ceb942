"""The SM clock through two back-to-back timing windows: what a GEMM inherits from the one before.

  python benchmarks/clock_trace.py run [--shapes 16384x2048x2048,...] [--out F.json]   # GPU machine
  python benchmarks/clock_trace.py report F.json

The suite times implementations one after another (benchmarks/common.py), and in session 13 our
kernel ran 5-7% slower right after cuBLAS than right after one of ours, while cuBLAS ran about
alike after either. This probe looks at the clock behind that: for every ordered pair of
implementations (XLA's jnp.matmul, jax_cute.matmul) it lets the board idle for IDLE_S, runs the
first for about WINDOW_S and the second for about WINDOW_S (CHAIN products per call, the calls
dispatched back to back and waited for once, as the suite does), while a thread samples the SM
clock and board power (NVML) every SAMPLE_S. Per window it keeps the time per product and the
median clock over the window's first HEAD_S and over all of it. On the H200 in session 13
NVML's readings did not resolve these windows (1965 MHz and 220-290 W throughout, samples every
~0.5 ms), so what this probe measured there is the time per product: cold first windows and
second windows by predecessor.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHAIN = 8
WINDOW_S = 0.05
HEAD_S = 0.01
IDLE_S = 0.3
SAMPLE_S = 0.0005
REPS = 3
SHAPES = [(16384, 2048, 2048), (16384, 1536, 1024), (8192, 8192, 8192)]


class Sampler(threading.Thread):
    """(time, SM MHz, board mW) every SAMPLE_S until stopped; NVML calls release the GIL."""

    def __init__(self, nvml):
        super().__init__(daemon=True)
        self.nvml, self.samples, self.stop = nvml, [], threading.Event()

    def run(self) -> None:
        import ctypes

        mw = ctypes.c_uint()
        while not self.stop.is_set():
            self.nvml.lib.nvmlDeviceGetPowerUsage(self.nvml.dev, ctypes.byref(mw))
            self.samples.append((time.perf_counter(), self.nvml.sm_clock_mhz(), mw.value))
            time.sleep(SAMPLE_S)


def window(fn, args, calls: int) -> tuple[float, float, int]:
    """(start, end, calls) of ``calls`` calls of ``fn`` dispatched back to back, then one wait (as
    the suite times them: a wait per call would leave the GPU idle between calls)."""
    import jax

    t0 = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return t0, time.perf_counter(), calls


def summarize(samples, t0: float, t1: float, calls: int) -> dict:
    inside = [s for s in samples if t0 <= s[0] <= t1]
    head = [s for s in inside if s[0] <= t0 + HEAD_S] or inside[:1]
    return {"us_per_product": (t1 - t0) / (calls * CHAIN) * 1e6, "calls": calls,
            "mhz_head": statistics.median(s[1] for s in head) if head else None,
            "mhz": statistics.median(s[1] for s in inside) if inside else None,
            "watts": statistics.median(s[2] for s in inside) / 1e3 if inside else None,
            "samples": len(inside)}


def cmd_run(out: str, shapes, reps: int) -> None:
    import jax
    import jax.numpy as jnp

    import jax_cute
    from common import write_result
    from energy_probe import Nvml

    jax_cute.config.set(strict=True)
    nvml = Nvml()
    dev = jax.devices()[0]
    rec = {"probe": "clock", "device": dev.device_kind, "jax": jax.__version__, "chain": CHAIN,
           "window_s": WINDOW_S, "idle_s": IDLE_S, "commit": os.environ.get("JAX_CUTE_COMMIT", "unknown"),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "cases": []}
    impls = {"xla": jnp.matmul, "jax_cute": lambda a, b: jax_cute.matmul(a, b)}
    for (m, n, k) in shapes:
        keys = jax.random.split(jax.random.key(m + n + k), 2 * CHAIN)
        args = tuple((jax.random.normal(keys[2 * j], (m, k), jnp.bfloat16),
                      jax.random.normal(keys[2 * j + 1], (k, n), jnp.bfloat16)) for j in range(CHAIN))
        fns = {name: jax.jit(lambda *sets, f=f: [f(*s) for s in sets]) for name, f in impls.items()}
        n_calls = {}
        for name, f in fns.items():
            for _ in range(3):
                jax.block_until_ready(f(*args))
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            n_calls[name] = max(1, round(WINDOW_S / (time.perf_counter() - t0)))
        pairs = [(a, b) for a in fns for b in fns]
        runs = []
        for rep in range(reps):
            for first, second in pairs[rep % len(pairs):] + pairs[:rep % len(pairs)]:
                time.sleep(IDLE_S)
                sampler = Sampler(nvml)
                sampler.start()
                w1 = window(fns[first], args, n_calls[first])
                w2 = window(fns[second], args, n_calls[second])
                sampler.stop.set()
                sampler.join()
                runs.append({"first": first, "second": second, "rep": rep,
                             "first_window": summarize(sampler.samples, *w1),
                             "second_window": summarize(sampler.samples, *w2)})
        case = {"shape": [m, n, k], "runs": runs}
        rec["cases"].append(case)
        print(report_case(case), flush=True)
    write_result(out, rec)


def report_case(case: dict) -> str:
    m, n, k = case["shape"]
    lines = [f"{m}x{n}x{k}: second window after the first (medians over reps)",
             "  first -> second          second µs/prod  MHz first 10 ms  MHz all   W   | first µs/prod  MHz"]
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in case["runs"]:
        groups.setdefault((r["first"], r["second"]), []).append(r)
    for (a, b), rs in groups.items():
        med = lambda w, key: statistics.median(r[w][key] for r in rs if r[w][key] is not None)  # noqa: E731
        lines.append(f"  {a:>8s} -> {b:<12s} {med('second_window', 'us_per_product'):14.1f} "
                     f"{med('second_window', 'mhz_head'):15.0f} {med('second_window', 'mhz'):8.0f} "
                     f"{med('second_window', 'watts'):5.0f}   | {med('first_window', 'us_per_product'):12.1f} "
                     f"{med('first_window', 'mhz'):6.0f}")
    return "\n".join(lines)


def main() -> None:
    import argparse

    from common import parse_shapes

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", default="")
    r.add_argument("--shapes", default="")
    r.add_argument("--reps", type=int, default=REPS)
    sub.add_parser("report").add_argument("path")
    a = p.parse_args()
    if a.cmd == "run":
        cmd_run(a.out, parse_shapes(a.shapes, SHAPES), a.reps)
    else:
        rec = json.load(open(a.path))
        print(f"{rec['device']}, {rec['date']}, jax {rec['jax']}, commit {rec['commit']}, "
              f"windows {rec['window_s'] * 1e3:.0f} ms after {rec['idle_s'] * 1e3:.0f} ms idle")
        print("\n".join(report_case(c) for c in rec["cases"]))


if __name__ == "__main__":
    main()
