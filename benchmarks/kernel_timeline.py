"""Where a chained GEMM call spends its device time: kernel durations and the gaps between them.

  python benchmarks/kernel_timeline.py run --bins DIR [--out FILE.json]   # GPU machine
  python benchmarks/kernel_timeline.py report FILE.json                   # anywhere

The suite times CHAIN independent products per jit end to end; Nsight Compute times kernels one
at a time. The two disagree (for 2048³ ours was 0.93x XLA in the suite but 0.98x in kernel time),
so the difference lies between kernels, between calls, or on the host. `run` records a
jax.profiler trace (CUPTI kernel timestamps, no serialisation) while it times, as the suite does,
CALLS back-to-back calls of each implementation (jax_cute.matmul, jnp.matmul and the devcheck's
compiled configs from benchmarks/devcheck_sm90_gemm.py build) in rotated rounds on random bf16
data, and splits the GPU's kernel events into one phase per timed run. Per implementation and
shape it keeps each kernel's duration, the idle gaps inside a call and at call boundaries, the
device span and the host's wall time. `report` prints their medians.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import re
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CHAIN = 8
CALLS = 10           # calls per timed run, back to back as in the suite (benchmarks/common.py)
ROUNDS = 5
# Timed runs are separated by PHASE_IDLE_S of sleep, so an idle device stretch of over
# PHASE_GAP_NS ends one run's kernels; inside a run the device idles only where the host
# falls behind.
PHASE_IDLE_S = 0.003
PHASE_GAP_NS = 1_000_000
SHAPES = [(2048, 2048, 2048), (16384, 2048, 2048), (4096, 4096, 4096), (8192, 8192, 8192),
          (4096, 14336, 4096), (512, 8192, 8192)]


def bursts(events: list[tuple], gap_ns: int = PHASE_GAP_NS) -> list[list[tuple]]:
    """Kernel events (start_ns, end_ns, ...), sorted by start, split where the device idles
    longer than ``gap_ns``."""
    out: list[list[tuple]] = []
    for ev in sorted(events):
        if out and ev[0] - max(e[1] for e in out[-1]) <= gap_ns:
            out[-1].append(ev)
        else:
            out.append([ev])
    return out


def burst_stats(burst: list[tuple]) -> dict:
    """Durations, the gaps before the 2nd..nth kernel (negative: overlap) and the span, in us;
    events are (start_ns, end_ns, name[, stream line])."""
    durs = [(e[1] - e[0]) / 1e3 for e in burst]
    gaps = [(burst[i][0] - burst[i - 1][1]) / 1e3 for i in range(1, len(burst))]
    return {"kernels": len(burst), "dur_us": durs, "gap_us": gaps,
            "span_us": (max(e[1] for e in burst) - burst[0][0]) / 1e3,
            "names": sorted({e[2] for e in burst}), "streams": len({e[3:] for e in burst})}


def _gpu_kernel_events(trace_dir: str) -> list[tuple[int, int, str, str]]:
    from jax.profiler import ProfileData

    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise SystemExit(f"no xplane.pb under {trace_dir}")
    data = ProfileData.from_file(sorted(paths)[-1])
    plane = data.find_plane_with_name("/device:GPU:0")
    if plane is None:
        raise SystemExit("the trace has no /device:GPU:0 plane: " + ", ".join(p.name for p in data.planes))
    evs = []
    for line in plane.lines:
        # CUPTI puts each stream on its own line (named after the kinds of work it ran, so a
        # stream that also ran a memset says so); drop copies and memsets, keep kernels
        for e in line.events:
            if e.name.lower().startswith(("memcpy", "memset")):
                continue
            evs.append((int(e.start_ns), int(e.start_ns + e.duration_ns), e.name, line.name))
    if not evs:
        print("no kernel events; GPU lines: " + "; ".join(f"{l.name} ({len(list(l.events))})" for l in plane.lines),
              flush=True)
    return evs


def cmd_run(bins: str, out: str, shapes, rounds: int, hlo_dir: str = "") -> None:
    import jax
    import jax_cute
    from common import _chained, round_order
    from devcheck_sm90_gemm import _timed_call, bench_specs, chained_impls, chained_operands
    from jax_cute.kernels import sm90_gemm

    # strict: a fallback to XLA (no compiler, no cached kernel) raises instead of timing XLA twice
    jax_cute.config.set(strict=True)
    index = json.load(open(os.path.join(bins, "index.json")))
    dev = jax.devices()[0]
    records = {"device": dev.device_kind, "jax": jax.__version__, "chain": CHAIN,
               "commit": os.environ.get("JAX_CUTE_COMMIT", "unknown"),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "xla_flags": os.environ.get("XLA_FLAGS", ""), "cases": []}
    pdl = next((x for x in index if x["name"] == "c_bf16_knn_bf16_pdl"), None)
    for (m, n, k) in shapes:
        if not any(x["purpose"] == "bench" and tuple(x["shape"]) == (m, n, k) for x in index):
            print(f"skip {m}x{n}x{k}: no devcheck bench entry", flush=True)
            continue
        impls = chained_impls(bins, m, n, k, CHAIN)
        if pdl is not None:   # the check config with PDL on, timed on every shape
            cfg = sm90_gemm.Config(**pdl["config"])
            impls[cfg.key() + "+pdl"] = jax.jit(_chained(_timed_call(bins, pdl["name"], bench_specs()["kn"], cfg,
                                                                     m, n, k, "kn")))
        args = chained_operands(m, n, k, CHAIN, m * 7 + n * 3 + k)
        for label in list(impls):          # compile, autotune (XLA) and load before tracing
            try:
                jax.block_until_ready(impls[label](*args))
            except Exception as ex:  # noqa: BLE001 - e.g. no compiler and no cached kernel
                print(f"{m}x{n}x{k} {label}: {type(ex).__name__}: {str(ex)[:300]}", flush=True)
                del impls[label]
        labels = list(impls)
        if hlo_dir:
            os.makedirs(hlo_dir, exist_ok=True)
            for label in ("xla", "jax_cute.matmul"):
                if label in impls:
                    with open(os.path.join(hlo_dir, f"{m}x{n}x{k}_{label}.hlo.txt"), "w") as f:
                        f.write(impls[label].lower(*args).compile().as_text())
        order = []
        trace_dir = tempfile.mkdtemp(prefix="jc_timeline_")
        with jax.profiler.trace(trace_dir):
            for r in range(rounds):
                for label in round_order(labels, r):
                    # as the suite times: CALLS calls back to back, then one block
                    t0 = time.perf_counter()
                    for _ in range(CALLS):
                        res = impls[label](*args)
                    jax.block_until_ready(res)
                    order.append((label, (time.perf_counter() - t0) * 1e6))
                    del res
                    time.sleep(PHASE_IDLE_S)   # an idle stretch on the device ends the phase
        phases = bursts(_gpu_kernel_events(trace_dir), PHASE_GAP_NS)
        if len(phases) != len(order):
            print(f"{m}x{n}x{k}: {len(phases)} phases for {len(order)} timed runs; kept unlabelled", flush=True)
            records["cases"].append({"shape": [m, n, k], "unlabelled": [burst_stats(b) for b in phases]})
            continue
        case = {"shape": [m, n, k], "flops": 2.0 * m * n * k, "calls": CALLS, "impls": {}}
        for (label, wall_us), b in zip(order, phases):
            case["impls"].setdefault(label, []).append({**burst_stats(b), "wall_us": wall_us})
        records["cases"].append(case)
        print(report_case(case), flush=True)
    if out:
        with open(out, "w") as f:
            f.write(dumps(records))


def dumps(records: dict) -> str:
    """JSON with every list of numbers on one line (the raw durations are most of the file)."""
    text = json.dumps(records, indent=1)
    return re.sub(r"\[\s+(-?[0-9][-0-9.e+,\s]*?)\s+\]",
                  lambda m: "[" + ",".join(x.strip() for x in m.group(1).split(",")) + "]", text)


def _med(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def impl_stats(case: dict, label: str) -> dict:
    """Medians over one implementation's timed runs: kernels per product, kernel duration, the
    idle gap between kernels of one call ("inner") and at call boundaries ("edge"; negative:
    overlap), device span and host wall time per product (us)."""
    runs = case["impls"][label]
    products = case.get("calls", 1) * CHAIN
    per_prod = statistics.median(r["kernels"] for r in runs) / products
    kpc = max(1, round(per_prod * CHAIN))   # kernels per call; gap i sits before kernel i+1
    return {"per_prod": per_prod, "kernel": _med([d for r in runs for d in r["dur_us"]]),
            "inner": _med([g for r in runs for i, g in enumerate(r["gap_us"]) if (i + 1) % kpc]),
            "edge": _med([g for r in runs for i, g in enumerate(r["gap_us"]) if (i + 1) % kpc == 0]),
            "span": _med([r["span_us"] for r in runs]) / products,
            "wall": _med([r["wall_us"] for r in runs if "wall_us" in r]) / products}


def report_case(case: dict) -> str:
    """impl_stats of every implementation, and the rates they give."""
    m, n, k = case["shape"]
    lines = [f"{m}x{n}x{k}: {case.get('calls', 1)} calls of {CHAIN} products per timed run; medians over runs (us)",
             f"  {'impl':34s} {'k/prod':>6s} {'kernel':>8s} {'gap':>6s} {'g@call':>6s} {'span/p':>8s} "
             f"{'wall/p':>8s} {'TF kern':>8s} {'TF span':>8s} {'TF wall':>8s}  names"]
    tf = lambda us: case["flops"] / us / 1e6 if us == us and us > 0 else float("nan")  # noqa: E731
    for label, runs in case["impls"].items():
        st = impl_stats(case, label)
        names = ",".join(x[:40] for x in runs[0]["names"])
        lines.append(f"  {label:34s} {st['per_prod']:6.2f} {st['kernel']:8.2f} {st['inner']:6.2f} {st['edge']:6.2f} "
                     f"{st['span']:8.2f} {st['wall']:8.2f} {tf(st['kernel'] * st['per_prod']):8.1f} "
                     f"{tf(st['span']):8.1f} {tf(st['wall']):8.1f}  {names}")
    return "\n".join(lines)


def markdown(rec: dict, title: str) -> list[str]:
    """A BENCHMARKS.md section: XLA against jax_cute.matmul per shape, then every config."""
    out = [f"## {title}", "",
           f"- device: {rec['device']}, date {rec.get('date', '?')}, jax_cute commit `{rec['commit']}`, "
           f"jax {rec['jax']}, XLA_FLAGS {rec.get('xla_flags') or '(none)'}",
           f"- per timed run {CALLS} calls of {rec['chain']} products, back to back; kernel times from a "
           "jax.profiler (CUPTI) trace; *span*: the device's time per product from first kernel start "
           "to last kernel end, call boundaries included; *gap*: median idle time between kernels "
           "of one call (negative: the next kernel started before the previous one ended)", "",
           "| case | XLA kernel (µs) | XLA gap (µs) | XLA span (µs) | jax_cute kernel (µs) | jax_cute gap (µs) "
           "| jax_cute span (µs) | jax_cute vs XLA (span) |", "|---|---|---|---|---|---|---|---|"]
    full = []
    for case in rec["cases"]:
        if "impls" not in case:
            continue
        m, n, k = case["shape"]
        if "xla" in case["impls"] and "jax_cute.matmul" in case["impls"]:
            x, j = impl_stats(case, "xla"), impl_stats(case, "jax_cute.matmul")
            out.append(f"| {m}x{n}x{k} | {x['kernel']:.2f} | {x['inner']:.2f} | {x['span']:.2f} | {j['kernel']:.2f} "
                       f"| {j['inner']:.2f} | {j['span']:.2f} | {x['span'] / j['span']:.3f}× |")
        full.append(report_case(case))
    return out + ["", "<details><summary>every config (devcheck objects; * marks the heuristic's pick)</summary>",
                  "", "```", *full, "```", "", "</details>", ""]


def cmd_report(path: str) -> None:
    rec = json.load(open(path))
    print(f"device {rec['device']}, date {rec.get('date', '?')}, jax {rec['jax']}, commit {rec['commit']}, "
          f"XLA_FLAGS {rec.get('xla_flags') or '(none)'}")
    for case in rec["cases"]:
        if "impls" in case:
            print(report_case(case))
        else:
            print(f"{case['shape']}: unlabelled bursts {[b['kernels'] for b in case['unlabelled']]}")


def main() -> None:
    from common import parse_shapes, probe_cli

    p, r = probe_cli(__doc__.splitlines()[0], ROUNDS)
    r.add_argument("--hlo", default="", help="write the compiled HLO of XLA's and jax_cute's chains here")
    a = p.parse_args()
    if a.cmd == "run":
        cmd_run(a.bins, a.out, parse_shapes(a.shapes, SHAPES), a.rounds, a.hlo)
    else:
        cmd_report(a.path)


if __name__ == "__main__":
    main()
