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

from jax_cute.config import RING_SMS_DEFAULT

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAIN = {"jax_cute", "jax_cute_sms0", "jax_cute_sms8", "jax_cute_unidirectional", "jax_cute_no_ring", "xla",
        "local_gemm"}
MEMCPY = MAIN - {"local_gemm"}


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
        for impl, r in main.items():
            assert r["ms"] > 0, (case, impl)
            if "fwd+bwd" not in case and impl != "jax_cute" and (impl != "local_gemm" or "all-gather" in case):
                # f16/bf16 products against the ring's (the first row): rounding apart
                assert r["max_rel_err"] < 2e-2, (case, impl, r["max_rel_err"])
