"""The collective suite (benchmarks/bench_collective.py) in its --smoke mode on 2 CPU devices, so
the script cannot rot between GPU runs: every row runs, the rings agree with XLA's product, and
each flag set's subprocess (windowed einsum, copy-engine collective-permutes) reports its rows
with its flags. Nothing here is a timing."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from jax_cute.config import RING_SMS_DEFAULT

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAIN = {"jax_cute", "jax_cute_sms0", "jax_cute_sms8", "jax_cute_stream", "jax_cute_unidirectional",
        "jax_cute_no_ring", "xla", "local_gemm"}
MEMCPY = MAIN - {"local_gemm"}


@pytest.mark.sweep   # 20 s: CI's second step, not the README's line
def test_collective_suite_smoke(tmp_path):
    out = tmp_path / "records.json"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
           "BENCH_COLLECTIVE_RING_SMS": "0,8", "BENCH_COLLECTIVE_FLAG_SETS": "windowed,memcpy_p2p"}
    for var in ("JAX_CUTE_COLLECTIVE_MATMUL", "JAX_CUTE_RING_SMS"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_collective.py"), "--smoke",
                           "--records", str(out)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["device_count"] == 2
    recs = data["records"]
    assert not [r for r in recs if r["error"]], [r for r in recs if r["error"]]
    cases = {r["case"] for r in recs}
    assert len(cases) == 4
    for case in cases:
        main = {r["impl"]: r for r in recs if r["case"] == case and r["table"] == "collective"}
        windowed = {r["impl"] for r in recs if r["case"] == case and r["table"] == "collective_windowed"}
        memcpy = {r["impl"]: r for r in recs if r["case"] == case and r["table"] == "collective_memcpy_p2p"}
        assert MAIN - {"local_gemm"} <= set(main) and windowed >= {"jax_cute", "xla_windowed"}, case
        assert MEMCPY <= set(memcpy) and "pallas" not in memcpy, case
        assert ("local_gemm" in main) == ("fwd+bwd" not in case), case
        assert "--xla_gpu_use_memcpy_local_p2p=true" in memcpy["jax_cute"]["xla_flags"], case
        assert "memcpy" not in main["jax_cute"]["xla_flags"] and main["jax_cute"]["ring_sms"] == RING_SMS_DEFAULT, case
        assert set(main["jax_cute"]["schedule"]) == {"permutes", "async", "over_gemm"}, case
        for impl, r in main.items():
            assert r["ms"] > 0, (case, impl)
            if "fwd+bwd" not in case and impl != "jax_cute" and (impl != "local_gemm" or "all-gather" in case):
                # f16/bf16 products against the ring's (the first row): rounding apart
                assert r["max_rel_err"] < 2e-2, (case, impl, r["max_rel_err"])


def test_schedule_counts_permutes_scheduled_over_our_gemms():
    """bench_collective.schedule reads a compiled program's order: a permute whose start and
    done enclose one of our launches (directly or in a called command buffer) overlaps it; one
    marked is_sync does not run asynchronously."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_collective import schedule

    text = """HloModule jit_f, is_scheduled=true

%command_buffer (p: bf16[8,8]) -> bf16[8,8] {
  %p = bf16[8,8]{1,0} parameter(0)
  ROOT %cc = bf16[8,8]{1,0} custom-call(%p), custom_call_target="jax_cute_launch"
}

ENTRY %main (a: bf16[8,8]) -> bf16[8,8] {
  %a = bf16[8,8]{1,0} parameter(0)
  %collective-permute-start = (bf16[8,8]{1,0}, bf16[8,8]{1,0}) collective-permute-start(%a), backend_config={"collective_backend_config":{"is_sync":false}}
  %call = bf16[8,8]{1,0} call(%a), to_apply=%command_buffer
  %collective-permute-done = bf16[8,8]{1,0} collective-permute-done(%collective-permute-start)
  %collective-permute-start.1 = (bf16[8,8]{1,0}, bf16[8,8]{1,0}) collective-permute-start(%call), backend_config={"collective_backend_config":{"is_sync":true}}
  %collective-permute-done.1 = bf16[8,8]{1,0} collective-permute-done(%collective-permute-start.1)
  ROOT %cc.2 = bf16[8,8]{1,0} custom-call(%collective-permute-done.1), custom_call_target="jax_cute_launch"
}
"""
    assert schedule(text) == {"permutes": 2, "async": 1, "over_gemm": 1}
