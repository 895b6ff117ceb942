"""Where a kernel's warps wait, instruction by instruction, from an Nsight Compute source export.

  tools/gpu_session.sh ncu-source          # GPU machine: writes source_sass.csv (+ .ncu-rep)
  python benchmarks/ncu_source.py source_sass.csv [--top 25] [--kernel 1]

The export (`ncu -i rep --page source --csv --print-source sass`) holds one block per profiled
kernel: every SASS instruction with its warp-state samples, split by stall reason. For each
kernel this prints the samples per opcode family and the instructions with the most samples,
each with its two largest stall reasons, so the cost of a barrier, an mbarrier wait, a WGMMA
wait or an epilogue store shows up as a share of all samples. Sampling is statistical: compare
shares between kernels of one export, not absolute counts between exports.
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import re

_STALL = re.compile(r"^stall_(\w+)$")   # the all-samples columns (not the "(Not Issued)" ones)


def kernels(path: str) -> list[tuple[str, list[dict[str, str]]]]:
    """[(kernel name, rows)] in export order."""
    out: list[tuple[str, list[dict[str, str]]]] = []
    block: list[str] = []
    name = ""
    def flush() -> None:
        if block:
            out.append((name, list(csv.DictReader(io.StringIO("".join(block))))))
    for line in open(path):
        if line.startswith('"Kernel Name"'):
            flush()
            name = next(csv.reader([line]))[1]
            block = []
        else:
            block.append(line)
    flush()
    return out


def _num(x: str | None) -> float:
    try:
        return float((x or "0").replace(",", ""))
    except ValueError:
        return 0.0


def family(sass: str) -> str:
    """Opcode without predicate, modifiers and operands: '@!P0 SYNCS.PHASECHK.TRANS64 ...' -> 'SYNCS'."""
    words = [w for w in sass.split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else "?"


def summarise(name: str, rows: list[dict[str, str]], top: int) -> str:
    samples = [(_num(r.get("Warp Stall Sampling (All Samples)")), r) for r in rows]
    total = sum(s for s, _ in samples) or 1.0
    stalls = [c for c in (rows[0].keys() if rows else []) if _STALL.match(c or "")]
    fam: collections.Counter[str] = collections.Counter()
    for s, r in samples:
        fam[family(r.get("Source", ""))] += s
    lines = [f"== {name[:110]}", f"   {len(rows)} instructions, {total:.0f} samples",
             "   by opcode: " + ", ".join(f"{f} {100 * s / total:.1f}%" for f, s in fam.most_common(12))]
    for s, r in sorted(samples, key=lambda x: -x[0])[:top]:
        why = sorted(((_num(r.get(c)), c[6:]) for c in stalls), reverse=True)[:2]
        lines.append(f"   {100 * s / total:5.1f}%  {r.get('Address', ''):>6s}  {r.get('Source', '')[:64]:64s} "
                     + ", ".join(f"{w} {100 * v / max(s, 1):.0f}%" for v, w in why if v))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--kernel", type=int, action="append", help="index in the export (default: all)")
    a = p.parse_args()
    for i, (name, rows) in enumerate(kernels(a.csv)):
        if a.kernel is None or i in a.kernel:
            print(f"[{i}] " + summarise(name, rows, a.top))


if __name__ == "__main__":
    main()
