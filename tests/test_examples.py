"""CPU checks of the examples (tiny sizes, in-process) and of the benchmark report generator.

The JSON the report test writes is synthetic and lives only in pytest's tmp_path.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_mlp_training_loss_goes_down(capsys):
    import mlp_training

    out = mlp_training.main(["--size", "tiny", "--steps", "8", "--quiet"])
    assert out["losses"][-1] < 0.8 * out["losses"][0]
    assert out["ref_losses"] == pytest.approx(out["losses"], rel=1e-4)  # same math as jnp.matmul on CPU
    assert "CPU" in out["path"]
    printed = capsys.readouterr().out
    assert "path: reference path on CPU (no GPU found)" in printed
    assert out["comparison"] in printed
    assert out["comparison"].startswith(f"jax_cute.matmul step {out['ms']:.2f} ms, jnp.matmul step {out['ref_ms']:.2f} ms: "
                                        "jax_cute.matmul ")


def test_moe_training_loss_goes_down(capsys):
    import moe_training

    out = moe_training.main(["--size", "tiny", "--steps", "8", "--quiet"])
    assert out["losses"][-1] < 0.9 * out["losses"][0]
    assert out["ref_losses"] == pytest.approx(out["losses"], rel=1e-4)
    printed = capsys.readouterr().out
    assert "path: reference path on CPU (no GPU found)" in printed
    assert "jax_cute.ragged_dot step " in out["comparison"] and ", jax.lax.ragged_dot step " in out["comparison"]


def test_gpt_training_kernelized_matches_plain(capsys):
    pytest.importorskip("optax")
    import gpt_training

    out = gpt_training.main(["--size", "tiny", "--steps", "6", "--quiet"])
    assert out["path"] == "reference path on CPU (no GPU found)"
    assert out["max_rel_diff"] <= 1e-3 and out["losses"] == pytest.approx(out["ref_losses"], rel=1e-3)
    printed = capsys.readouterr().out
    assert "path: reference path on CPU (no GPU found)" in printed
    assert "max relative difference between the loss curves" in printed
    assert out["comparison"] in printed
    assert out["comparison"].startswith(f"kernelized step {out['ms']:.2f} ms, plain XLA step {out['ref_ms']:.2f} ms: "
                                        "kernelized ")


def test_comparison_says_which_way():
    from training_loop import compare_line

    assert compare_line(("jax_cute", "lax"), 10.0, 13.8).startswith(
        "jax_cute step 10.00 ms, lax step 13.80 ms: jax_cute 1.38x faster")
    assert compare_line(("jax_cute", "lax"), 13.8, 10.0).startswith(
        "jax_cute step 13.80 ms, lax step 10.00 ms: jax_cute 1.38x slower")


def test_custom_kernel_matches_and_lowers_for_sm90a():
    pytest.importorskip("cutlass")
    import custom_kernel

    out = custom_kernel.main(["--n", "1027", "--batch", "3"])
    assert out["path"] == "reference path on CPU (no GPU found)"
    assert out["err_float32"] <= 1e-5 and out["vmap_err"] <= 1e-5 and out["grad_err"] <= 1e-5
    assert out["sm90a_lowered"]


def test_custom_kernel_grad_against_autodiff():
    import custom_kernel

    a, b = jax.random.normal(jax.random.key(0), (2, 33))
    f = lambda a, b, s: jnp.sum(jnp.sin(custom_kernel.axpby(a, b, s)))  # noqa: E731
    g = lambda a, b, s: jnp.sum(jnp.sin(a * s + b))  # noqa: E731
    for x, y in zip(jax.grad(f, (0, 1, 2))(a, b, 0.7), jax.grad(g, (0, 1, 2))(a, b, jnp.float32(0.7))):
        assert jnp.allclose(x, y, rtol=1e-5, atol=1e-5)


def test_measure_records_failures_without_crashing():
    from common import Impl, measure

    def broken(a, b):
        raise ValueError("rival cannot do this shape")

    mk = lambda s: tuple(jax.random.normal(k, (8, 8)) for k in jax.random.split(jax.random.key(s)))  # noqa: E731
    recs = measure("t", "gemm", "8x8x8", [Impl("xla", jnp.matmul), Impl("pallas", broken)], mk, 2.0 * 8 ** 3,
                   rounds=2)
    ok, bad = recs
    assert ok["ms"] > 0 and ok["tflops"] > 0 and len(ok["rounds_ms"]) == 2
    assert bad["ms"] is None and "rival cannot" in bad["error"]


def test_measure_chain_times_independent_products():
    from common import Impl, measure

    seen = []

    def probe(a, b):
        seen.append(a.shape)          # traced once per product in the chained program
        return a @ b

    mk = lambda s: tuple(jax.random.normal(k, (8, 8)) for k in jax.random.split(jax.random.key(s)))  # noqa: E731
    rec, = measure("t", "gemm", "8x8x8", [Impl("xla", probe)], mk, 2.0 * 8 ** 3, rounds=2, chain=3)
    assert rec["chain"] == 3 and rec["ms"] > 0 and len(seen) == 3


def test_report_order_skips_logs_and_puts_dense_first():
    import run
    files = ["r/h200-examples.log", "r/h200-first-call.jsonl", "r/h200-launch.json", "r/h200-ragged.json",
             "r/h200-matmul.json"]
    assert run.report_order(files) == ["r/h200-matmul.json", "r/h200-ragged.json", "r/h200-launch.json",
                                       "r/h200-first-call.jsonl"]


def test_report_renders_first_call_rows(tmp_path):
    import run
    phases = lambda lo, co, fr: {"lower_s": lo, "compile_s": co, "first_run_s": fr}  # noqa: E731
    path = tmp_path / "h200-first-call.jsonl"
    path.write_text(json.dumps({"shape": "64x64x64", "device": "NVIDIA H200", "date": "2026-11-21", "mode": "warm",
                                "cutlass_imported": False, "jax_cute": phases(0.015, 0.013, 0.004),
                                "xla": phases(0.002, 0.39, 0.001)}) + "\n")
    text = run.report([str(path)], str(tmp_path / "B.md"), str(tmp_path / "plots"))
    assert "Measured on NVIDIA H200, 2026-11-21" in text
    assert "| warm | 64x64x64 | False | 15 / 13 / 4 | 2 / 390 / 1 | 19 |" in text


def test_report_from_synthetic_json(tmp_path):
    pytest.importorskip("matplotlib")
    import run

    def rec(table, case, impl, **kw):
        base = {"suite": "synthetic", "table": table, "case": case, "impl": impl, "error": None, "ms": None,
                "tflops": None}
        return {**base, **kw}

    data = {"device": "SYNTHETIC-TEST-DEVICE", "date": "2000-01-01T00:00:00+00:00", "commit": "abcdef0123",
            "jax_version": "0.0-test", "suites": ["matmul", "ragged", "launch"], "records": [
                rec("gemm", "64x64x64", "jax_cute", ms=2.0, tflops=100.0, kernel=True),
                rec("gemm", "64x64x64", "xla", ms=4.0, tflops=50.0),
                rec("gemm", "64x64x64", "pallas", error="RuntimeError: synthetic failure"),
                rec("gemm", "32x32x32", "jax_cute", ms=1.0, tflops=7.0, kernel=False),
                rec("gemm", "32x32x32", "xla", ms=1.0, tflops=7.0),
                rec("e2e", "step", "jax_cute", ms=3.0, kernel=True), rec("e2e", "step", "xla", ms=6.0),
                rec("launch", "tiny", "jax_cute", ms=5.0, us_per_iter=5.0, kernel=True),
                rec("launch", "tiny", "xla", ms=4.0, us_per_iter=4.0),
            ]}
    src = tmp_path / "synthetic.json"
    src.write_text(json.dumps(data))
    md, plots = tmp_path / "BENCHMARKS.md", tmp_path / "plots"
    run.main(["--report", str(src), "--md", str(md), "--plots", str(plots)])
    text = md.read_text()
    assert "Measured on SYNTHETIC-TEST-DEVICE, 2000-01-01 (jax 0.0-test); from `synthetic.json`" in text
    assert "abcdef0" not in text  # the page names device, date and software, not commits
    assert "| 64x64x64 | 100.0 | 50.0 | failed | 2.00× | — |" in text   # ratio vs XLA; Pallas failed
    assert "7.00 (XLA fallback)" in text                                # never presented as our kernel
    assert "| step | 3.00 | 6.00 | 2.00× |" in text                     # time: ratio = theirs / ours
    assert "| tiny | 5.00 | 4.00 | 0.80× |" in text
    assert "### Grouped GEMM" not in text                               # nothing unmeasured is written
    assert sorted(p.name for p in plots.iterdir()) == ["synthetic_e2e.png", "synthetic_gemm.png",
                                                       "synthetic_launch.png"]


def test_gpt_training_noise_replaces_that_fraction_of_tokens():
    pytest.importorskip("optax")
    import gpt_training as gpt

    cfg = gpt.Config(vocab=256, d_model=64, heads=2, layers=1, seq=512, batch=8)
    clean = np.asarray(gpt.batches(jax.random.key(1), cfg, 3))
    noisy = np.asarray(gpt.batches(jax.random.key(1), cfg, 3, noise=0.1))
    assert clean.shape == noisy.shape == (3, 8, 513)
    changed = clean != noisy
    assert not changed[..., 0].any()                      # each sequence's first token is kept
    assert 0.08 < changed[..., 1:].mean() < 0.11          # 10% redrawn, a few land on the same token
    with pytest.raises(SystemExit, match="--noise"):
        gpt.main(["--size", "tiny", "--steps", "1", "--noise", "1.5"])


@pytest.mark.sweep   # (8 s of tracing: CI's second step, so the README's line stays under 10 minutes)
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_gpt_fp8_step_quantizes_each_weight_once(moe, monkeypatch):
    """The GPT example's fp8 step keeps its layers' quantized weights through ``checkpoint``
    (``KEEP_FP8_WEIGHTS``): the backward pass's recomputation quantizes no weight again, where
    the default policy quantizes each twice."""
    pytest.importorskip("optax")
    import dataclasses

    import gpt_training as gpt

    cfg = dataclasses.replace(gpt.SIZES["tiny"], moe=moe)
    params, opt, tx = gpt.init_train_state(jax.random.key(0), cfg)
    tokens = gpt.batches(jax.random.key(1), cfg)[0]

    def named_weights(policy) -> int:
        monkeypatch.setattr(gpt, "KEEP_FP8_WEIGHTS", policy)
        step = gpt.make_step(cfg, tx, kernelized=True, fp8=True)
        return str(jax.make_jaxpr(step)(params, opt, tokens)).count("name=jax_cute.fp8.weights")

    # attention's two weight products and the MLP's (or the experts') two, their values and scales
    # named once in the scanned layer (twice with the default policy: the recomputation's too)
    assert (named_weights(gpt.KEEP_FP8_WEIGHTS), named_weights(None)) == (4 * 2, 4 * 2 * 2)
