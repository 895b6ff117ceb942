"""benchmarks/devcheck_sm90_gemm.py's index helpers (no GPU, no DSL)."""

import dataclasses
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))

import devcheck_sm90_gemm as devcheck  # noqa: E402
from jax_cute.kernels import sm90_gemm  # noqa: E402


def test_reports_name_configs_by_key_unless_the_entry_carries_a_label():
    cfg = sm90_gemm.Config(128, 160, pingpong=True)
    entry = {"name": "p_kn_x", "config": dataclasses.asdict(cfg), "purpose": "perf"}
    assert devcheck.label(entry) == "t128x160.c2x1.rm8.sk1.st0.pp"
    # an object built from another commit: same config, told apart by its label
    assert devcheck.label({**entry, "label": "old:" + cfg.key()}) == "old:t128x160.c2x1.rm8.sk1.st0.pp"
    # an index written before Config grew epi_n still loads (the field defaults to 32)
    old = {k: v for k, v in dataclasses.asdict(sm90_gemm.Config()).items() if k != "epi_n"}
    assert devcheck.label({"config": old}) == sm90_gemm.Config().key()


def test_every_check_and_sweep_config_is_valid():
    for name, spec, cfg in devcheck.CHECKS:
        sm90_gemm._check_config(cfg)
        assert sm90_gemm.unsupported(spec) is None, name
    for cfg in devcheck.SWEEP + devcheck.THIN_EXTRA + devcheck.SMALL_EXTRA:
        sm90_gemm._check_config(cfg)
    assert len({n for n, _, _ in devcheck.CHECKS}) == len(devcheck.CHECKS)
