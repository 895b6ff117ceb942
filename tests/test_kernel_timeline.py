"""benchmarks/kernel_timeline.py's CPU side: kernel events to timed runs and their medians."""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))

import kernel_timeline as kt  # noqa: E402


def _run(t0, durs, gaps, name="k", stream="s0"):
    """Events of one timed run: kernels of ``durs`` ns, each after the previous one plus a gap."""
    evs, t = [], t0
    for i, d in enumerate(durs):
        t += gaps[i - 1] if i else 0
        evs.append((t, t + d, name, stream))
        t += d
    return evs


def test_bursts_split_at_idle_stretches_and_keep_overlap():
    a = _run(0, [20_000] * 3, [1_000, 2_000])
    b = _run(5_000_000, [20_000] * 3, [-500, 500], stream="s1")   # overlap (PDL) stays in its run
    out = kt.bursts(list(reversed(a + b)))            # the trace's line order does not matter
    assert [len(x) for x in out] == [3, 3]
    s = kt.burst_stats(out[1])
    assert s["gap_us"] == [-0.5, 0.5] and s["dur_us"] == [20.0] * 3
    assert s["span_us"] == 60.0 and s["streams"] == 1
    assert kt.burst_stats(a + b[:1])["streams"] == 2
    assert len(kt.bursts(_run(0, [1_000] * 2, [kt.PHASE_GAP_NS + 1]))) == 2
    assert len(kt.bursts(_run(0, [1_000] * 2, [kt.PHASE_GAP_NS - 1]))) == 1


def _case(impls, calls=2):
    return {"shape": [2048] * 3, "flops": 2.0 * 2048 ** 3, "calls": calls, "impls": impls}


def test_report_splits_gaps_inside_calls_from_call_boundaries(tmp_path, capsys):
    chain, calls = kt.CHAIN, 2
    n = chain * calls
    # 8 kernels per call, 1 us apart inside a call and 10 us apart at the call boundary
    gaps = [10_000 if (i + 1) % chain == 0 else 1_000 for i in range(n - 1)]
    xla = [{**kt.burst_stats(_run(0, [25_000] * n, gaps, "nvjet")), "wall_us": 500.0} for _ in range(3)]
    # one product as two kernels (0.5 us apart): per-product figures must not double
    gaps2 = [10_000 if (i + 1) % (2 * chain) == 0 else 500 for i in range(2 * n - 1)]
    split = [{**kt.burst_stats(_run(0, [12_500] * (2 * n), gaps2, "a")), "wall_us": 500.0} for _ in range(3)]
    text = kt.report_case(_case({"xla": xla, "split": split}, calls))
    row = {x.split()[0]: x.split() for x in text.splitlines()[2:]}
    k_prod, dur, inner, edge, span, wall, tf_k = (float(v) for v in row["xla"][1:8])
    assert (k_prod, dur, inner, edge) == (1.0, 25.0, 1.0, 10.0)
    assert abs(span - (n * 25 + (n - 2) * 1 + 10) / n) < 0.01
    assert wall == 500.0 / n
    assert abs(tf_k - 2.0 * 2048 ** 3 / 25e-6 / 1e12) < 0.1
    assert row["split"][1:5] == ["2.00", "12.50", "0.50", "10.00"]
    assert abs(float(row["split"][7]) - tf_k) < 0.1    # rate from kernel time: both kernels count
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"device": "H200", "jax": "0", "commit": "c", "chain": chain,
                                "cases": [_case({"xla": xla}, calls), {"shape": [1, 2, 3], "unlabelled": xla}]}))
    kt.cmd_report(str(path))
    out = capsys.readouterr().out
    assert "2048x2048x2048" in out and "unlabelled" in out


def test_markdown_compares_the_primitive_with_xla():
    n = kt.CHAIN * 2

    def runs(dur_ns, gap_ns):
        return [{**kt.burst_stats(_run(0, [dur_ns] * n, [gap_ns] * (n - 1))), "wall_us": 1.0} for _ in range(3)]
    case = _case({"xla": runs(25_000, -1_000), "jax_cute.matmul": runs(24_000, 0), "*t128x256": runs(24_000, 0)})
    rec = {"device": "H200", "jax": "0.11", "commit": "abc", "chain": kt.CHAIN, "date": "d", "cases": [case]}
    text = "\n".join(kt.markdown(rec, "t"))
    row = next(x for x in text.splitlines() if x.startswith("| 2048x2048x2048"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # span: 16 kernels of 25 us overlapping by 1 us, per product: (16 * 25 - 15) / 16
    assert cells[1:4] == ["25.00", "-1.00", "24.06"] and cells[4:7] == ["24.00", "0.00", "24.00"]
    assert cells[7] == "1.003×"
    assert "*t128x256" in text      # every config in the details block
