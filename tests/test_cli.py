"""``python -m jax_cute``: usage errors are one line, and precompile reports what it cannot do."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def cli(*args: str, cache_dir=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if cache_dir is not None:
        env["JAX_CUTE_CACHE_DIR"] = str(cache_dir)
    return subprocess.run([sys.executable, "-m", "jax_cute", *args], capture_output=True, text=True, env=env,
                          timeout=600)


# (a process each: the test line runs one error of each source, argparse's own, a choice, ours;
# the others are sweeps, run in CI's second step)
@pytest.mark.parametrize("args,says", [
    ((), "choose a command: cache"),
    pytest.param(("cache",), "choose a cache command", marks=pytest.mark.sweep),
    pytest.param(("bogus",), "invalid choice: 'bogus'", marks=pytest.mark.sweep),
    (("cache", "precompile", "--arch", "sm_89", "--matmul", "8x8,8x8"), "invalid choice: 'sm_89'"),
    pytest.param(("cache", "precompile", "--arch", "sm_90a"), "at least one --matmul or --ragged", marks=pytest.mark.sweep),
    (("cache", "precompile", "--arch", "sm_90a", "--matmul", "8x8"), "expected AxB,CxD"),
])
def test_usage_errors_are_one_line(args, says):
    out = cli(*args)
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], out.stderr


def test_cache_list_on_an_empty_cache(tmp_path):
    out = cli("cache", "list", cache_dir=tmp_path)
    assert out.returncode == 0 and "(0 entries)" in out.stdout


def test_precompile_reports_a_problem_no_kernel_covers_in_one_line(tmp_path):
    """f64 has no kernel: precompile names the problem and the reason, and exits 1."""
    out = cli("cache", "precompile", "--arch", "sm_100a", "--matmul", "64x64,64x64:float64", cache_dir=tmp_path)
    assert out.returncode == 1, out.stderr
    errors = [ln for ln in out.stderr.splitlines() if "cache precompile:" in ln]
    assert len(errors) == 1 and "sm_100a matmul 64x64,64x64:float64" in errors[0], out.stderr
    assert "Traceback" not in out.stderr and "no kernel: " in errors[0] and "strict" not in errors[0].lower()
