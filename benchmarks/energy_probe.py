"""Energy per product of our dense GEMM and XLA's, under sustained load (NVML's energy counter).

  python benchmarks/energy_probe.py run --bins DIR [--out FILE.json]    # GPU machine

The H200 here caps board power at 700 W, and on random bf16 data both kernels run into it: under
that cap the sustained rate is set by energy per FLOP, not by cycles. Short windows (a device
trace, a cool GPU under ncu) show our kernel within 1-3% of cuBLAS; the suite's longer windows
show 5-8%. This script times each implementation for WINDOW_S seconds at a stretch, CHAIN
independent products per call, in rotated rounds, and reads the board's energy counter
(nvmlDeviceGetTotalEnergyConsumption, mJ) and the SM clock around each window. It prints per
implementation the medians of TFLOP/s, average power, joules per PFLOP and the SM clock.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CHAIN = 8
WINDOW_S = 1.0
ROUNDS = 4
SHAPES = [(8192, 8192, 8192), (4096, 14336, 4096), (16384, 2048, 2048)]


class Nvml:
    """The few NVML calls this needs, through ctypes (no pynvml on the GPU machine)."""

    def __init__(self, index: int = 0):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._ok(self.lib.nvmlInit_v2())
        self.dev = ctypes.c_void_p()
        self._ok(self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.dev)))

    @staticmethod
    def _ok(rc: int) -> None:
        if rc != 0:
            raise RuntimeError(f"NVML call failed with {rc}")

    def energy_mj(self) -> int:
        v = ctypes.c_ulonglong()
        self._ok(self.lib.nvmlDeviceGetTotalEnergyConsumption(self.dev, ctypes.byref(v)))
        return v.value

    def sm_clock_mhz(self) -> int:
        v = ctypes.c_uint()
        self._ok(self.lib.nvmlDeviceGetClockInfo(self.dev, 1, ctypes.byref(v)))  # NVML_CLOCK_SM
        return v.value


def window(fn, args, nvml: Nvml, seconds: float) -> dict:
    """Run ``fn(*args)`` back to back for about ``seconds``; time, energy and clock samples."""
    import jax

    jax.block_until_ready(fn(*args))
    calls, clocks = 0, []
    e0, t0 = nvml.energy_mj(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(4):
            out = fn(*args)
        calls += 4
        jax.block_until_ready(out)
        clocks.append(nvml.sm_clock_mhz())
    t1, e1 = time.perf_counter(), nvml.energy_mj()
    return {"calls": calls, "s": t1 - t0, "mj": e1 - e0, "mhz": statistics.median(clocks)}


def cmd_run(bins: str, out: str, shapes, rounds: int, names: list[str], window_s: float = WINDOW_S) -> None:
    import jax
    import jax_cute
    from common import round_order
    from devcheck_sm90_gemm import chained_impls, chained_operands

    jax_cute.config.set(strict=True)
    nvml = Nvml()
    rec = {"device": jax.devices()[0].device_kind, "commit": os.environ.get("JAX_CUTE_COMMIT", "unknown"),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "window_s": window_s, "chain": CHAIN, "cases": []}
    for (m, n, k) in shapes:
        # without the devcheck's objects only XLA and the primitive (the heuristic's pick) run
        impls = chained_impls(bins, m, n, k, CHAIN, keep=names)
        args = chained_operands(m, n, k, CHAIN, m + 3 * n + 7 * k)
        for f in impls.values():
            jax.block_until_ready(f(*args))
        flop = 2.0 * m * n * k * CHAIN
        runs: dict[str, list[dict]] = {label: [] for label in impls}
        for r in range(rounds):
            for label in round_order(list(impls), r):
                w = window(impls[label], args, nvml, window_s)
                w["tflops"] = flop * w["calls"] / w["s"] / 1e12
                w["watts"] = w["mj"] / 1e3 / w["s"]
                w["j_per_pflop"] = w["mj"] / 1e3 / (flop * w["calls"] / 1e15)
                runs[label].append(w)
        rec["cases"].append({"shape": [m, n, k], "impls": runs})
        print(report_case(m, n, k, runs, window_s), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(rec, f, indent=1)


def report_case(m: int, n: int, k: int, runs: dict, window_s: float = WINDOW_S) -> str:
    lines = [f"{m}x{n}x{k}: medians over rounds of {window_s:g} s windows",
             f"  {'impl':32s} {'TFLOP/s':>8s} {'W':>6s} {'J/PFLOP':>8s} {'SM MHz':>7s}"]
    for label, ws in runs.items():
        med = lambda key: statistics.median(w[key] for w in ws)  # noqa: E731
        lines.append(f"  {label:32s} {med('tflops'):8.1f} {med('watts'):6.0f} {med('j_per_pflop'):8.1f} "
                     f"{med('mhz'):7.0f}")
    return "\n".join(lines)


def main() -> None:
    from common import parse_shapes, probe_cli

    p, r = probe_cli(__doc__.splitlines()[0], ROUNDS)
    r.add_argument("--configs", default="t128x256.c2x1.rm8.sk1.st0.df2,t128x256.c2x1.rm8.sk1.st0.e64,t128x160.c2x1.rm8.sk1.st0.pp",
                   help="config keys (devcheck objects) to time besides the primitive and XLA")
    r.add_argument("--window", type=float, default=WINDOW_S, help="seconds per timed window")
    a = p.parse_args()
    if a.cmd == "run":
        cmd_run(a.bins, a.out, parse_shapes(a.shapes, SHAPES), a.rounds, [s for s in a.configs.split(",") if s],
                a.window)
    else:
        rec = json.load(open(a.path))
        print(f"device {rec['device']}, date {rec['date']}, commit {rec['commit']}")
        for c in rec["cases"]:
            print(report_case(*c["shape"], c["impls"], rec.get("window_s", WINDOW_S)))


if __name__ == "__main__":
    main()
