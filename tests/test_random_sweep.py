"""A randomized sweep of GEMMs (tests/sweep_cases.py): on the CPU, each case lowered for sm_90a
runs our kernels, except at most 2% that fall back, each naming its reason (strict mode raises
it); on a GPU (``-m gpu``), every case matches a float32 reference, every element checked."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sweep_cases import cases

import jax_cute
from jax_cute import config

CASES = cases()


def _fallbacks(case, caplog) -> list[str]:
    args = [jax.ShapeDtypeStruct(s, case.dtype) for s in case.shapes]
    caplog.clear()
    with config.override(target_arch="sm_90a"), caplog.at_level(logging.WARNING, logger="jax_cute"):
        text = jax.jit(case.ours).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    reasons = [r.getMessage() for r in caplog.records if "falling back to XLA" in r.getMessage()]
    assert reasons or "jax_cute_launch" in text, case.name
    return reasons


def test_at_most_two_percent_of_16_bit_cases_fall_back(caplog):
    fell = {c.name: r for c in CASES if (r := _fallbacks(c, caplog))}
    assert len(fell) <= 0.02 * len(CASES), "\n".join(f"{k}: {v[0]}" for k, v in fell.items())
    for name, reasons in fell.items():  # each names its reason
        assert all(": falling back to XLA: " in r and r.split(": falling back to XLA: ")[1] for r in reasons), name


def test_strict_mode_names_the_reason_of_a_fallback():
    case = next(c for c in CASES if "matmul" in c.name)
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in case.shapes]  # f32: no kernel takes it
    with config.override(target_arch="sm_90a", strict=True), pytest.raises(jax_cute.FallbackError) as err:
        jax.jit(case.ours).trace(*args).lower(lowering_platforms=("cuda",))
    assert err.value.reason and "float32" in err.value.reason


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_case_matches_a_float32_reference_on_the_gpu(case):
    rng = np.random.default_rng(abs(hash(case.name)) % 2**32)
    args = [jnp.asarray(rng.standard_normal(s, dtype=np.float32)).astype(case.dtype) for s in case.shapes]
    with config.override(nan_fill=True):
        got = jax.jit(case.ours)(*args)
    want = case.ref(*(a.astype(jnp.float32) for a in args))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert g.shape == w.shape and np.isfinite(g).all(), case.name
        scale = max(float(np.abs(w).max()), 1e-6)
        # 16-bit operands are exact in f32; the error is the output's rounding (or the
        # cotangent's, for gradients) relative to the largest entry
        assert float(np.abs(g - w).max()) / scale < 2e-2, case.name
