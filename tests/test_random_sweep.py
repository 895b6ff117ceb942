"""A randomized sweep of GEMMs (tests/sweep_cases.py): on the CPU, each case lowered for sm_90a
runs our kernels, except at most 2% that fall back, each naming its reason (strict mode raises
it); on a GPU (``-m gpu``), every case matches a float32 reference, every element checked."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sweep_cases import cases, einsum_specs

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


@pytest.mark.sweep   # hundreds of lowerings (40 s): CI's second step, not the README's line
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


# -- two-operand einsums with labels in random orders --------------------------------------------

EINSUMS = einsum_specs()


def _einsum_lowering(f, sa, sb, caplog) -> tuple[str, list[str]]:
    args = [jax.ShapeDtypeStruct(sa, jnp.bfloat16), jax.ShapeDtypeStruct(sb, jnp.bfloat16)]
    caplog.clear()
    with config.override(target_arch="sm_90a"), caplog.at_level(logging.WARNING, logger="jax_cute"):
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return text, [r.getMessage() for r in caplog.records]


@pytest.mark.sweep   # (16 s: CI's second step, so the README's test line stays under 10 minutes)
def test_random_einsums_run_our_kernel_with_at_most_one_copy_per_operand(caplog):
    """Where the layouts do not coalesce into the kernel's (M, N, K, L) modes, an operand is
    copied once (and an output that cannot be written as it lies is written row-major and
    copied once): every case lowers to our kernel, none to XLA's dot."""
    off = []
    for spec, sa, sb in EINSUMS:
        fwd = lambda x, y: jax_cute.einsum(spec, x, y)  # noqa: E731
        text, logs = _einsum_lowering(fwd, sa, sb, caplog)
        if "jax_cute_launch" not in text or "dot_general" in text:
            off.append((spec, [m for m in logs if "falling back" in m]))
        # and its two gradient GEMMs
        grad_text, _ = _einsum_lowering(jax.grad(lambda x, y: fwd(x, y).astype(jnp.float32).sum(), (0, 1)),
                                        sa, sb, caplog)
        if grad_text.count("stablehlo.custom_call @jax_cute_launch") < 2 or "dot_general" in grad_text:
            off.append((spec, "gradient"))
        for operand in ("a", "b"):
            assert sum(f"copying operand {operand}" in m for m in logs) <= 1, (spec, logs)
        assert sum("writing the output through one copy" in m for m in logs) <= 1, (spec, logs)
    assert len(off) <= 0.05 * 2 * len(EINSUMS), off


FOUR_BATCH = ("abcdmk,dcbakn->abcdmn", (2, 3, 4, 5, 64, 32), (5, 4, 3, 2, 32, 64))


def test_four_batch_indices_in_different_orders_copy_each_operand_once(caplog):
    """Batch modes that coalesce into more than the kernels' three: both operands are copied
    into row-major (L, rows, K) buffers and the output written through one copy."""
    spec, sa, sb = FOUR_BATCH
    text, logs = _einsum_lowering(lambda x, y: jax_cute.einsum(spec, x, y), sa, sb, caplog)
    assert text.count("stablehlo.custom_call @jax_cute_launch") == 1 and "dot_general" not in text
    assert sum("copying operands a and b into row-major buffers" in m for m in logs) == 1, logs


# (the test line: two random einsums and the four batch indices; six more random ones: sweeps)
@pytest.mark.parametrize("spec,sa,sb", [*EINSUMS[:2], *(pytest.param(*e, marks=pytest.mark.sweep) for e in EINSUMS[2:8]),
                                        FOUR_BATCH], ids=[s for s, _, _ in EINSUMS[:8] + [FOUR_BATCH]])
def test_a_rewritten_problem_is_the_product(spec, sa, sb):
    """The copies a rewritten problem makes (operands into row-major buffers, the row-major output
    into the requested layout), checked on the CPU with the reference product standing in for
    the kernel."""
    from jax_cute.primitives.dot_general import contraction_layouts
    from jax_cute.problem.gemm_plan import Rewrite, canonical_output, canonical_problem
    from jax_cute.primitives.gemm import reference

    lhs, rest = spec.split(",")
    rhs, out = rest.split("->")
    rng = np.random.default_rng(0)
    a, b = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in (sa, sb))
    batch = [c for c in out if c in lhs and c in rhs]
    contract = [c for c in lhs if c in rhs and c not in out]
    logical = batch + [c for c in lhs if c not in rhs] + [c for c in rhs if c not in lhs]
    g, _ = contraction_layouts(sa, sb, ([lhs.index(c) for c in contract], [rhs.index(c) for c in contract]),
                               ([lhs.index(c) for c in batch], [rhs.index(c) for c in batch]),
                               [logical.index(c) for c in out])
    want = jnp.einsum(spec, a, b, precision="highest")
    params = dict(out_dtype="float32", acc_dtype="float32", precision="highest")
    for copy_operands, canonical in ((False, canonical_output(g)), (True, canonical_problem(g))):
        r = Rewrite(g, canonical, copy_operands, "")
        got = r.run(lambda x, y: reference(x, y, layouts=canonical, **params), a, b)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("spec,sa,sb", einsum_specs(48, seed=2, big=True) + [FOUR_BATCH], ids=str)
def test_random_einsums_match_a_float32_reference_on_the_gpu(spec, sa, sb):
    rng = np.random.default_rng(0)
    a, b = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in (sa, sb))
    with config.override(nan_fill=True):   # (the CPU sweep counts fallbacks; here every value counts)
        got = jax.jit(lambda x, y: jax_cute.einsum(spec, x, y))(a, b)
    want = jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32), precision="highest")
    g, w = np.asarray(got, np.float32), np.asarray(want)
    assert g.shape == w.shape and np.isfinite(g).all()
    assert float(np.abs(g - w).max()) / max(float(np.abs(w).max()), 1e-6) < 2e-2
