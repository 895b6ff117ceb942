"""benchmarks/tile_trace.py's phase arithmetic and benchmarks/ncu_source.py's export parser."""

import json
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))

import ncu_source  # noqa: E402
import tile_trace  # noqa: E402
from jax_cute.kernels import sm90_gemm  # noqa: E402


def _stamps(records, wraps_at=None):
    st = np.zeros((2, 2, sm90_gemm.TRACE_TILES, sm90_gemm.TRACE_WORDS), np.int64)
    for slot in range(2):
        for wg in range(2):
            st[slot, wg, 0] = [100, 7, 0, 0]
            for i, r in enumerate(records, 1):
                st[slot, wg, i] = r
    return (st % 2**32).tolist()


def test_plain_epilogue_phases():
    # per tile: start t, first k-tile issued t+50, stored t+1300, mainloop done t+1000
    recs = [[t, t + 50, t + 1300, t + 1000] for t in (200, 1600, 3000)]
    p = tile_trace.phases({"key": "t128x256.e64.tr", "stamps": _stamps(recs)})
    assert p == {"first_wait": 50, "mainloop": 1000, "epilogue": 300, "gap": 100, "span": 4200, "tiles": 3}


def test_deferred_phases_and_a_wrapping_clock():
    # deferred: 0 start, 1 first k-tiles issued, 2 previous tile stored, 3 mainloop done; the
    # last record is the final store (words 0 and 2); the 32-bit clock wraps in the middle
    base = 2**32 - 1500
    recs = [[base + t, base + t + 80, base + t + 80 + (400 if i else 0), base + t + 1200]
            for i, t in enumerate((0, 1300, 2600))]
    recs.append([base + 3900, 0, base + 4300, 0])
    p = tile_trace.phases({"key": "t128x256.df2.tr", "stamps": _stamps(recs)})
    # mainloop = issue of the first k-tiles + the rest: 80 + 1120 for the first tile (nothing
    # stored under it), 80 + 720 after it; the final store ends 2700 cycles after the start
    assert p == {"first_wait": 80, "mainloop": 800, "epilogue": 400, "gap": 100, "span": 2700, "tiles": 3}


def test_report_prints_every_record(tmp_path, capsys):
    recs = [[t, t + 50, t + 1300, t + 1000] for t in (200, 1600)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"device": "H200", "date": "d", "commit": "c", "records": [
        {"shape": [2048, 2048, 2048], "config": "e64", "key": "t128x256.e64.tr", "rel_err": 2e-3, "k_tiles": 32,
         "stamps": _stamps(recs)}]}))
    tile_trace.cmd_report(str(path))
    out = capsys.readouterr().out
    assert "2048x2048x2048" in out and "t128x256.e64.tr" in out


def test_ncu_source_export_is_split_per_kernel(tmp_path):
    head = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
            '"stall_barrier","stall_long_sb","stall_barrier (Not Issued)"\n')
    text = ('"Kernel Name","nvjet_a",\n' + head
            + '"0x10","HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16], R24","30","20","0","0","0"\n'
            + '"0x20","@!P0  BRA 0x10","70","60","0","65","0"\n'
            + '"Kernel Name","kernel_cutlass_b",\n' + head
            + '"0x10","WARPGROUP.DEPBAR.LE gsb0, 0x1","1,000","900","990","0","0"\n')
    path = tmp_path / "src.csv"
    path.write_text(text)
    ks = ncu_source.kernels(str(path))
    assert [k for k, _ in ks] == ["nvjet_a", "kernel_cutlass_b"]
    assert ncu_source.family("@!P0  BRA 0x10") == "BRA"
    out = ncu_source.summarise(*ks[0], top=2)
    assert "BRA 70.0%" in out and "long_sb 93%" in out
    assert "WARPGROUP 100.0%" in ncu_source.summarise(*ks[1], top=1)
