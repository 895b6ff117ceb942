"""benchmarks/ncu_probe.py's report: ncu's CSV (units as ncu picks them) to per-case rates."""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))

import ncu_probe  # noqa: E402

_HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
         '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def _row(kid, kernel, metric, unit, value):
    return (f'"{kid}","1","python3","h","{kernel}","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0",'
            f'"Command line profiler metrics","{metric}","{unit}","{value}"')


def test_report_converts_units_and_labels_kernels(tmp_path, capsys):
    order = ["2048x2048x2048 xla", "2048x2048x2048 xla", "2048x2048x2048 *t128x256", "2048x2048x2048 *t128x256"]
    rows = []
    # the same durations in the units ncu may choose: ns, nsecond, us, ms
    for kid, (kernel, unit, dur) in enumerate([("nvjet", "ns", "25,500"), ("nvjet", "nsecond", "25,500"),
                                               ("kernel_cutlass", "us", "26.0"), ("kernel_cutlass", "ms", "0.026")]):
        rows += [_row(kid, kernel, "gpu__time_duration.sum", unit, dur),
                 _row(kid, kernel, "sm__cycles_elapsed.avg.per_second", "hz", "1,600,000,000"),
                 _row(kid, kernel, "sm__cycles_elapsed.max", "cycle", "42,000"),
                 # DRAM traffic in the units ncu may choose (to MB)
                 _row(kid, kernel, "dram__bytes_read.sum", ("Mbyte", "Gbyte", "Kbyte", "byte")[kid],
                      ("25.17", "0.02517", "25,170", "25,170,000")[kid]),
                 _row(kid, kernel, "dram__bytes_write.sum", "Mbyte", "8.39")]
    path = tmp_path / "probe.csv"
    path.write_text("\n".join(["==PROF== Connected", ncu_probe._MARK + " " + json.dumps(order), _HEAD, *rows]))
    ncu_probe.cmd_report(str(path))
    out = {line.split("  ")[0].strip(): line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    xla, ours = out["2048x2048x2048 xla"], out["2048x2048x2048 *t128x256"]
    flops = 2.0 * 2048 ** 3
    assert float(xla[2]) == 25.5 and float(ours[2]) == 26.0                 # microseconds
    assert abs(float(xla[3]) - flops / 25.5e-6 / 1e12) < 0.1                 # TFLOP/s
    assert float(xla[4]) == 1600 and float(xla[5]) == 42.0                   # MHz, kcycles
    assert float(xla[6]) == 25.2 and float(ours[6]) == 25.2 and float(xla[7]) == 8.4   # MB
    assert xla[8] == "nvjet" and ours[8] == "kernel_cutlass"


def test_report_lists_kernels_when_calls_do_not_match(tmp_path, capsys):
    order = ["8x8x8 xla"]
    rows = [_row(k, "k", "gpu__time_duration.sum", "us", "1.0") for k in range(2)]
    path = tmp_path / "probe.csv"
    path.write_text("\n".join([ncu_probe._MARK + " " + json.dumps(order), _HEAD, *rows]))
    ncu_probe.cmd_report(str(path))
    assert "2 kernels for 1 calls" in capsys.readouterr().out
