"""Kernel-level comparison of our dense GEMM with XLA's cuBLAS kernel under Nsight Compute.

  ncu --profile-from-start off --clock-control none --csv --metrics METRICS \\
      python benchmarks/ncu_probe.py run --bins DIR > probe.csv      # GPU machine
  python benchmarks/ncu_probe.py report probe.csv                    # anywhere

`run` loads the devcheck's compiled objects (benchmarks/devcheck_sm90_gemm.py build), warms up
XLA's jnp.matmul and our configs on each benchmark shape (random bf16 data, jnp.matmul's
layouts), then calls each REPS times between cuProfilerStart and cuProfilerStop, so ncu records
only those kernels (not XLA's autotuning). ncu runs kernels one at a time: the numbers are
kernel time and SM clock with no launch gaps and no overlap, which tells per-clock efficiency
(cycles) apart from power-limited clocks and from launch overhead. `report` prints, per shape,
each kernel's median duration, TFLOP/s, SM clock and cycles.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

METRICS = ("gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__cycles_elapsed.max,"
           "dram__bytes_read.sum,dram__bytes_write.sum")
REPS = 3
# starts the line on which `run` prints the order of its calls, for `report` to label ncu's rows
_MARK = "NCU_PROBE"


def _profiler(start: bool) -> None:
    cuda = ctypes.CDLL("libcuda.so.1")
    rc = (cuda.cuProfilerStart if start else cuda.cuProfilerStop)()
    if rc != 0:
        raise RuntimeError(f"cuProfiler{'Start' if start else 'Stop'} returned {rc}")


def cmd_run(bins: str, shapes: list[tuple[int, int, int]], names: list[str] | None, reps: int = REPS) -> None:
    import jax
    import jax.numpy as jnp
    from devcheck_sm90_gemm import _timed_call, bench_specs, label
    from jax_cute.kernels import sm90_gemm

    index = json.load(open(os.path.join(bins, "index.json")))
    configs = {x["name"]: x for x in index if x["purpose"] == "perf"}
    spec = bench_specs()["kn"]
    plan = []  # (label, fn, args): the order ncu will see them in
    for (m, n, k) in shapes:
        e = [x for x in index if x["purpose"] == "bench" and x["tag"] == "kn" and tuple(x["shape"]) == (m, n, k)]
        if not e:
            raise SystemExit(f"no devcheck bench entry for {m}x{n}x{k} kn in {bins}")
        ka, kb = jax.random.split(jax.random.PRNGKey(m + n + k))
        args = (jax.random.normal(ka, (m, k), jnp.bfloat16), jax.random.normal(kb, (k, n), jnp.bfloat16))
        plan.append((f"{m}x{n}x{k} xla", jax.jit(jnp.matmul), args))
        for name in e[0]["configs"]:
            if names and not any(s in name for s in names):
                continue
            cfg = sm90_gemm.Config(**configs[name]["config"])
            tag = ("*" if name == e[0]["pick"] else "") + label(configs[name])
            plan.append((f"{m}x{n}x{k} {tag}", _timed_call(bins, name, spec, cfg, m, n, k, "kn"), args))
    for _, fn, args in plan:              # compile, autotune and load everything first
        jax.block_until_ready(fn(*args))
        jax.block_until_ready(fn(*args))
    order = []
    _profiler(True)
    for label, fn, args in plan:
        for _ in range(reps):
            jax.block_until_ready(fn(*args))
            order.append(label)
    _profiler(False)
    # ncu's CSV goes to stdout after the program's output; the labels tell the rows apart
    print(_MARK + " " + json.dumps(order), flush=True)


def cmd_report(path: str) -> None:
    text = open(path).read().splitlines()
    order = next(json.loads(x[len(_MARK) + 1:]) for x in text if x.startswith(_MARK))
    recs = list(csv.DictReader(x for x in text if x.startswith('"')))  # ncu's CSV rows only
    kernels: dict[str, dict[str, float]] = {}  # kernel id -> metric -> value
    names: dict[str, str] = {}
    for r in recs:
        kid = r["ID"]
        names[kid] = r["Kernel Name"]
        unit = r.get("Metric Unit", "")
        v = float(r["Metric Value"].replace(",", ""))
        # to microseconds and MHz (ncu picks its units per value)
        scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
                 "hz": 1e-6, "khz": 1e-3, "mhz": 1.0, "ghz": 1e3, "cycle/second": 1e-6,
                 "cycle/nsecond": 1e3, "cycle/usecond": 1.0,
                 # DRAM traffic to MB
                 "byte": 1e-6, "kbyte": 1e-3, "mbyte": 1.0, "gbyte": 1e3}.get(unit.lower(), 1.0)
        kernels.setdefault(kid, {})[r["Metric Name"]] = v * scale
    ids = sorted(kernels, key=int)
    metric = lambda i, name: kernels[i].get(name, 0.0)  # noqa: E731
    if len(ids) != len(order):
        # not one kernel per call (XLA added a kernel somewhere): list them all, in order
        print(f"{len(ids)} kernels for {len(order)} calls; raw list (order of calls: {order})")
        for i in ids:
            print(f"{metric(i, 'gpu__time_duration.sum'):9.1f} us {metric(i, 'sm__cycles_elapsed.avg.per_second'):6.0f}"
                  f" MHz  {names[i][:120]}")
        return
    table: dict[str, list[tuple[float, float, float]]] = {}
    first: dict[str, str] = {}  # label -> name of its first kernel
    for i, label in zip(ids, order):
        table.setdefault(label, []).append((metric(i, "gpu__time_duration.sum"),
                                            metric(i, "sm__cycles_elapsed.avg.per_second"),
                                            metric(i, "sm__cycles_elapsed.max"),
                                            metric(i, "dram__bytes_read.sum"),
                                            metric(i, "dram__bytes_write.sum")))
        first.setdefault(label, names[i])
    print(f"{'case':48s} {'us':>8s} {'TFLOP/s':>8s} {'MHz':>6s} {'kcycles':>8s} {'DRAM rd MB':>10s} "
          f"{'wr MB':>7s}  kernel")
    for label, vals in table.items():
        m, n, k = map(int, label.split()[0].split("x"))
        dur, clk, cyc, rd, wr = (statistics.median(v[j] for v in vals) for j in range(5))
        print(f"{label:48s} {dur:8.1f} {2.0 * m * n * k / (dur * 1e-6) / 1e12:8.1f} {clk:6.0f} {cyc / 1e3:8.1f} "
              f"{rd:10.1f} {wr:7.1f}  {first[label][:100]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--bins", required=True)
    r.add_argument("--shapes", default="2048x2048x2048,8192x8192x8192,512x8192x8192,4096x14336x4096")
    r.add_argument("--configs", default="", help="comma-separated substrings of binary names to keep")
    r.add_argument("--reps", type=int, default=REPS, help="profiled calls per kernel")
    rep = sub.add_parser("report")
    rep.add_argument("csv")
    a = p.parse_args()
    if a.cmd == "run":
        shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
        cmd_run(a.bins, shapes, [s for s in a.configs.split(",") if s] or None, a.reps)
    else:
        cmd_report(a.csv)


if __name__ == "__main__":
    main()
