"""Run benchmark suites on a GPU and write JSON; or turn JSON files into BENCHMARKS.md and plots.

    python benchmarks/run.py --suite matmul,ragged,launch --out benchmarks/results/h100.json
    python benchmarks/run.py --report benchmarks/results/*.json

Each suite runs in its own process (fresh GPU memory; the launch suite needs its own XLA_FLAGS).
The report reads only the JSON: it runs on any machine and prints only what was measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SUITES = {"matmul": "bench_matmul.py", "ragged": "bench_ragged.py", "launch": "bench_launch.py"}
IMPL_ORDER = ["jax_cute", "xla", "pallas"]
IMPL_LABEL = {"jax_cute": "jax_cute", "xla": "XLA", "pallas": "Pallas", "xla_bf16_grads": "XLA, bf16 gradient GEMMs"}


# -- running ----------------------------------------------------------------------------------

def _commit() -> str:
    if os.environ.get("JAX_CUTE_COMMIT"):
        return os.environ["JAX_CUTE_COMMIT"]
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}  # read-only: never touch the index
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True, env=env).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=ROOT, env=env).returncode != 0
    return head + ("+uncommitted-changes" if dirty else "")


def run_suites(suites: list[str], out: str, extra: list[str]) -> dict:
    # No jax backend in this process: it would take the GPU memory the suites need.
    result = {"device": None, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": _commit(), "suites": suites, "records": [], "suite_errors": {}}
    try:
        from importlib.metadata import version
        result["cutlass_dsl_version"] = version("nvidia-cutlass-dsl")
    except Exception:  # noqa: BLE001 - the GPU machine may carry only the DSL's runtime
        pass
    for suite in suites:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
            path = tmp.name
        print(f"== suite {suite}", flush=True)
        proc = subprocess.run([sys.executable, str(HERE / SUITES[suite]), "--records", path, *extra])
        try:
            got = json.loads(Path(path).read_text())
            result["records"] += got["records"]
            for k in ("device", "backend", "device_count", "jax_version"):
                result[k] = result.get(k) or got.get(k)
        except (OSError, ValueError, KeyError) as e:
            result["suite_errors"][suite] = f"exit {proc.returncode}: no records ({e})"
        finally:
            Path(path).unlink(missing_ok=True)
        if proc.returncode:
            result["suite_errors"].setdefault(suite, f"exit {proc.returncode}")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out}: {len(result['records'])} records from {result['device']}")
    return result


# -- report -----------------------------------------------------------------------------------

def _fmt(v: float | None, digits: int = 1) -> str:
    if v is None:
        return "—"
    if abs(v) >= 10:
        return f"{v:.{digits}f}"
    return f"{v:.2f}" if abs(v) >= 1 else f"{v:.3g}"  # small values keep 3 significant digits


def _impls(recs: list[dict]) -> list[str]:
    seen = {r["impl"] for r in recs}
    return [i for i in IMPL_ORDER if i in seen] + sorted(seen - set(IMPL_ORDER))


def _by_case(recs: list[dict]) -> dict[str, dict[str, dict]]:
    cases: dict[str, dict[str, dict]] = {}
    for r in recs:
        cases.setdefault(r["case"], {})[r["impl"]] = r
    return cases


def _cell(r: dict | None, key: str, digits: int) -> str:
    if r is None:
        return "—"
    if r.get("error"):
        return "failed"
    text = _fmt(r.get(key), digits)
    if r.get("impl") == "jax_cute" and r.get("kernel") is False:
        text += " (XLA fallback)"  # it ran, but not on our kernel: never present it as ours
    return text


def table(recs: list[dict], key: str, unit: str, higher_better: bool, digits: int = 1) -> list[str]:
    """Markdown rows: one per case, a column per implementation, then jax_cute vs each rival."""
    impls = _impls(recs)
    rivals = [i for i in impls if i != "jax_cute"] if "jax_cute" in impls else []
    head = ["case"] + [f"{IMPL_LABEL.get(i, i)} ({unit})" for i in impls] + \
           [f"jax_cute vs {IMPL_LABEL.get(i, i)}" for i in rivals]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case, by in _by_case(recs).items():
        row = [case] + [_cell(by.get(i), key, digits) for i in impls]
        ours = by.get("jax_cute")
        for i in rivals:
            a, b = (ours or {}).get(key), (by.get(i) or {}).get(key)
            ok = ours and not ours.get("error") and ours.get("kernel") is not False and b and not by[i].get("error")
            # Ratio > 1 always means jax_cute is better (more TFLOP/s, or less time).
            row.append(f"{(a / b if higher_better else b / a):.2f}×" if ok and a else "—")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def plot(recs: list[dict], key: str, ylabel: str, title: str, path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install 'jax-cute[bench]'): tables only, no plots")
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = _by_case(recs)
    impls = _impls(recs)
    if not cases:
        return False
    width = 0.8 / len(impls)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(cases) + 2), 4.5))
    for j, impl in enumerate(impls):
        xs, ys = [], []
        for i, by in enumerate(cases.values()):
            r = by.get(impl)
            if r and not r.get("error") and r.get(key) is not None:  # plot only what was measured
                xs.append(i + (j - (len(impls) - 1) / 2) * width)
                ys.append(r[key])
        ax.bar(xs, ys, width, label=IMPL_LABEL.get(impl, impl))
    ax.set_xticks(range(len(cases)), list(cases), rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)   # (the repo rides along on every GPU run, next to the 64 MiB DSL bundle)
    plt.close(fig)
    return True


SECTIONS = [  # (table, record key, unit, higher is better, title, digits)
    ("gemm", "tflops", "TFLOP/s", True, "GEMM, bf16 (M×N×K)", 1),
    ("ragged", "tflops", "TFLOP/s", True, "Grouped GEMM (ragged_dot), bf16", 1),
    ("e2e", "ms", "ms", False, "End-to-end steps (time per call)", 2),
    ("launch", "us_per_iter", "µs/iter", False, "Launch overhead (tiny kernel in a fori_loop, command buffers off)", 2),
]


def first_call_section(path: str) -> list[str]:
    """Markdown for bench_first_call.py records: one fresh process per row."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    out = [f"## {Path(path).stem}: first call of jax_cute.matmul in a fresh process", "",
           "Phases of the first call, jax_cute vs jnp.matmul (XLA) in the same process. *warm*: the kernel "
           "comes from the disk cache; *cold*: empty cache, the DSL compiles it during lowering.", "",
           "| mode | shape | DSL compiler imported | jax_cute lower / compile / first run (ms) | "
           "XLA lower / compile / first run (ms) | jax_cute lowering cost (ms) |", "|---|---|---|---|---|---|"]
    for r in rows:
        ours, xla = r["jax_cute"], r["xla"]
        ms = lambda d: " / ".join(f"{d[k] * 1e3:.0f}" for k in ("lower_s", "compile_s", "first_run_s"))  # noqa: E731
        out.append(f"| {r.get('mode', '?')} | {r['shape']} | {r['cutlass_imported']} | {ms(ours)} | {ms(xla)} | "
                   f"{(ours['lower_s'] + ours['first_run_s']) * 1e3:.0f} |")
    return out + ["", "The lowering cost is our lowering (cache load or compile) plus the first run, where the "
                  "handler loads the module onto the device; XLA's own compile of the module follows either way.", ""]


def skew_section(path: str) -> list[str]:
    """Markdown for benchmarks/skew_ratio.py: skewed vs uniform sizes timed in one measurement."""
    data = json.loads(Path(path).read_text())
    out = [f"## {Path(path).stem}: skewed vs uniform group sizes, interleaved", "",
           f"- device: {data.get('device', '?')}, date {data.get('date', '?')}, jax_cute commit "
           f"`{data.get('commit', '?')}`, {data.get('rounds', '?')} rounds",
           "- jax_cute.ragged_dot forward on the same operands with the suite's uniform and "
           "Dirichlet(0.3) sizes, both timed in every round (rotated order), so the ratio carries "
           "no drift between two separate measurements.", "",
           "| case | uniform (TFLOP/s) | Dirichlet(0.3) (TFLOP/s) | skewed / uniform | per-round range |",
           "|---|---|---|---|---|"]
    for r in data.get("rows", []):
        rr = r.get("ratio_rounds") or []
        span = f"{min(rr):.3f}–{max(rr):.3f}" if rr else "—"
        ratio = f"{r['ratio']:.3f}" if r.get("ratio") else "failed"
        out.append(f"| {r['case']} | {r['uniform_tflops']:.1f} | {r['skewed_tflops']:.1f} | {ratio} | {span} |")
    return out + [""]


def report_order(files: list[str]) -> list[str]:
    """The result files among ``files`` (.json suites, .jsonl first-call records; other files such
    as example logs are skipped): dense GEMM first, then its kernel timeline, grouped, skew ratio,
    launch, first call."""
    rank = {"matmul": 0, "timeline": 1, "energy": 1, "example": 1, "clock": 1, "ragged": 2, "skew": 3, "launch": 4}
    kept = [f for f in files if f.endswith((".json", ".jsonl"))]
    for f in sorted(set(files) - set(kept)):
        print(f"skipping {f}: not a results file")
    return sorted(kept, key=lambda f: (f.endswith(".jsonl"),
                                       min((r for k, r in rank.items() if k in Path(f).stem), default=5), f))


def report(files: list[str], md: str, plots: str) -> str:
    out = ["# Benchmarks", "",
           "Generated by `python benchmarks/run.py --report` from the JSON files below; every number is "
           "a measurement in those files (median over interleaved rounds, see benchmarks/common.py). "
           "Ratios > 1 mean jax_cute is faster. \"failed\" means the implementation did not run on that "
           "case; \"XLA fallback\" means jax_cute ran without its kernel.", ""]
    notes = Path(__file__).with_name("notes.md")  # hand-written reading notes, kept with the code
    if notes.exists():
        out += [notes.read_text().strip(), ""]
    for f in files:
        if f.endswith(".jsonl"):  # first-call latency records (benchmarks/bench_first_call.py)
            out += first_call_section(f)
            continue
        data = json.loads(Path(f).read_text())
        if data.get("probe") == "example":  # benchmarks/example_probe.py
            import example_probe
            out += [f"## {Path(f).stem}: the CuTe DSL's Hopper GEMM example beside ours and XLA", "",
                    f"- device: {data['device']}, date {data['date']}, jax_cute commit `{data['commit']}`, "
                    f"jax {data['jax']}; {data['chain']} products per call; round order after each round's "
                    f"first implementation: {data.get('order', 'rotate')}", "", "```"]
            out += example_probe.report(data) + ["```", ""]
            continue
        if data.get("probe") == "clock":  # benchmarks/clock_trace.py
            import clock_trace
            out += [f"## {Path(f).stem}: one window right after another", "",
                    f"- device: {data['device']}, date {data['date']}, jax_cute commit `{data['commit']}`, "
                    f"{data['window_s'] * 1e3:.0f} ms windows after {data['idle_s'] * 1e3:.0f} ms idle", "", "```"]
            out += [clock_trace.report_case(c) for c in data["cases"]] + ["```", ""]
            continue
        if "window_s" in data:  # benchmarks/energy_probe.py
            import energy_probe
            out += [f"## {Path(f).stem}: energy under sustained load", "",
                    f"- device: {data['device']}, date {data['date']}, jax_cute commit `{data['commit']}`", "", "```"]
            out += [energy_probe.report_case(*c["shape"], c["impls"]) for c in data["cases"]] + ["```", ""]
            continue
        if data.get("probe") == "swap":  # benchmarks/swap_probe.py
            import swap_probe
            out += [f"## {Path(f).stem}: operand roles exchanged (C^T = B^T A^T)", "",
                    f"- device: {data['device']}, date {data['date']}, jax_cute commit `{data['commit']}`", "", "```"]
            out += [swap_probe.report(c) for c in data["cases"]] + ["```", ""]
            continue
        if data.get("probe") in ("launch", "dispatch"):  # benchmarks/launch_probe.py (was dispatch_probe)
            import launch_probe
            out += [f"## {Path(f).stem}: launch modes and configs, timed as the suite times", "",
                    f"- device: {data['device']}, date {data['date']}, jax_cute commit `{data['commit']}`, "
                    f"jax {data['jax']}; {data['chain']} products per call for GEMMs; *dispatch*: host time "
                    "until a round's calls returned, per call; *launches/call*: our handler's launches per "
                    "call (0: XLA replayed a recorded graph)", "", "```"]
            out += launch_probe.report(data) + ["```", ""]
            continue
        if "cases" in data and "records" not in data:  # benchmarks/kernel_timeline.py
            import kernel_timeline
            out += kernel_timeline.markdown(data, f"{Path(f).stem}: kernel timeline (device trace)")
            continue
        if "rows" in data and "records" not in data:  # benchmarks/skew_ratio.py
            out += skew_section(f)
            continue
        stem = Path(f).stem
        header = (f"device {data.get('device', '?')}, date {data.get('date', '?')}, "
                  f"jax_cute commit {data.get('commit', '?')}, jax {data.get('jax_version', '?')}")
        print(f"{f}: {header}")
        out += [f"## {stem}", "", f"- device: {data.get('device', '?')} ({data.get('backend', '?')})",
                f"- date: {data.get('date', '?')}", f"- jax_cute commit: `{data.get('commit', '?')}`",
                f"- jax: {data.get('jax_version', '?')}"
                + (f", nvidia-cutlass-dsl {data['cutlass_dsl_version']}" if data.get("cutlass_dsl_version") else ""),
                ""]
        for suite, err in (data.get("suite_errors") or {}).items():
            out += [f"- suite `{suite}` did not finish: {err}", ""]
        recs = data.get("records", [])
        for tbl, key, unit, hb, title, digits in SECTIONS:
            rs = [r for r in recs if r.get("table") == tbl]
            if not rs:
                continue
            out += [f"### {title}", ""] + table(rs, key, unit, hb, digits) + [""]
            png = Path(plots) / f"{stem}_{tbl}.png"
            if plot(rs, key, unit, f"{title} — {data.get('device', '?')}, {str(data.get('date', '?'))[:10]}", png):
                rel = os.path.relpath(png, Path(md).resolve().parent if Path(md).parent != Path("") else ".")
                out += [f"![{title}]({rel})", ""]
            fails = [r for r in rs if r.get("error")]
            if fails:
                out += ["<details><summary>failures</summary>", ""]
                out += [f"- {r['case']} / {r['impl']}: {r['error']}" for r in fails] + ["", "</details>", ""]
    text = "\n".join(out)
    Path(md).write_text(text)
    print(f"wrote {md} and plots under {plots}")
    return text


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", help="comma-separated: " + ",".join(SUITES))
    p.add_argument("--out", help="results JSON (with --suite)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes: checks the scripts, not speed")
    p.add_argument("--rounds", type=int, help="timed rounds per case (default 7)")
    p.add_argument("--report", nargs="+", metavar="JSON", help="write BENCHMARKS.md and plots from these files")
    p.add_argument("--md", default=str(ROOT / "BENCHMARKS.md"))
    p.add_argument("--plots", default=str(HERE / "plots"))
    args = p.parse_args(argv)
    if args.report:
        report(report_order(args.report), args.md, args.plots)
    elif args.suite:
        suites = [s.strip() for s in args.suite.split(",") if s.strip()]
        unknown = [s for s in suites if s not in SUITES]
        if unknown or not args.out:
            p.error(f"unknown suites {unknown}" if unknown else "--out is required with --suite")
        extra = (["--smoke"] if args.smoke else []) + (["--rounds", str(args.rounds)] if args.rounds else [])
        run_suites(suites, args.out, extra)
    else:
        p.error("give --suite ... --out ..., or --report FILES")


if __name__ == "__main__":
    main()
