"""Compile-only checks of the fused epilogues of the sm90_gemm family (no GPU needed).

Every configuration the heuristic picks for a fused spec compiles for sm_90a with WGMMA and no
register spills; the fused lowering emits one kernel and no XLA epilogue; routing reports the
cases that keep the XLA epilogue.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import pytest
import shared_result  # tests/ is on sys.path under pytest

import jax_cute
from jax_cute import config
from jax_cute.kernels import cubin_info, epilogue, sm90_gemm
from jax_cute.kernels.gemm_spec import GemmSpec

BF, F16, F32 = "bfloat16", "float16", "float32"
SHAPES = [(8192, 14336, 4096, 1), (8192, 4096, 14336, 1), (4096, 4096, 4096, 1), (64, 4096, 16384, 1),
          (1000, 1032, 776, 3), (1, 1, 1, 1), (100000, 64, 64, 1)]


def _compile(spec: GemmSpec, cfg: sm90_gemm.Config):
    pytest.importorskip("cutlass")
    binary = shared_result.compiled(sm90_gemm, spec, cfg, f"test_{spec.key()}_{cfg.key()}")
    ptx = binary.ptx or ""
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    res = cubin_info.resources(binary.obj)
    assert res["local_bytes"] == 0 and res["frame_bytes"] == 0, (spec.key(), cfg.key(), res)
    return ptx


def _picks(spec: GemmSpec) -> list[sm90_gemm.Config]:
    return sorted({sm90_gemm.heuristic(spec, *s) for s in SHAPES}, key=lambda c: c.key())


def test_family_declares_its_epilogues():
    assert set(sm90_gemm.EPILOGUES) == {"bias", *epilogue.ACTIVATIONS, "swiglu", "preact", "dact"}
    assert sm90_gemm.unsupported(GemmSpec(BF, BF, BF, bias=True, activation="gelu")) is None
    assert sm90_gemm.unsupported(GemmSpec(BF, BF, BF, bias=True, activation="swiglu")) is None
    assert "geglu" in sm90_gemm.unsupported(GemmSpec(BF, BF, BF, activation="geglu"))
    # cache keys of plain specs are unchanged; fused ones name their epilogue
    assert GemmSpec(BF, BF, BF).key() == "bfloat16.bfloat16.bfloat16.accfloat32.kkn"
    assert GemmSpec(BF, BF, BF, bias=True, activation="silu").key().endswith(".kkn.bias.silu")
    assert GemmSpec(BF, BF, BF, activation="relu", preact=True).key().endswith(".kkn.relu.preact")
    with pytest.raises(ValueError, match="needs an activation"):
        GemmSpec(BF, BF, BF, bias=True, preact=True)


def test_epilogue_tables_cover_the_registry():
    """Every activation the kernels declare has its DSL function and derivative, and no table
    holds a name the registry lacks (a new activation adds entries to both)."""
    tables = epilogue.table_names()
    assert set(tables["activation"]) == set(epilogue.ACTIVATIONS)
    assert set(tables["derivative"]) == set(epilogue.ACTIVATIONS)
    assert set(tables["gated"]) == set(epilogue.GATED)
    with pytest.raises(ValueError, match="no kernel epilogue"):
        epilogue.activation("geglu", None, fast=True)


def test_fused_signature_and_configs():
    spec = GemmSpec(BF, BF, BF, bias=True, activation="relu")
    names = [a.name for a in sm90_gemm.signature(spec, sm90_gemm.Config(split_k=2)) if hasattr(a, "dtype")]
    assert names == ["a", "b", "c", "bias", "splitk_partials", "splitk_flags"]
    cands = sm90_gemm.candidate_configs(spec)
    assert cands and not any(c.defer for c in cands)
    assert all(c in cands for c in _picks(spec))
    with pytest.raises(ValueError, match="deferred epilogue cannot fuse"):
        sm90_gemm.launcher(spec, dataclasses.replace(sm90_gemm.Config(epi_n=32), defer=2))


def test_preact_signature_and_configs():
    """The pre-activation output d follows the bias; its tiles are unsplit, with a bias in the
    ring epilogue (the whole share spills there), without one in the whole share."""
    spec = GemmSpec(BF, BF, BF, "k", "n", "m", bias=True, activation="gelu", preact=True)
    cfg = sm90_gemm.heuristic(spec, 8192, 4096, 14336, 1)   # long K: the cooperative tile
    sig = [a for a in sm90_gemm.signature(spec, cfg) if hasattr(a, "dtype")]
    assert [a.name for a in sig] == ["a", "b", "c", "bias", "d"]
    assert sig[4].stride == sig[2].stride and sig[4].dtype == BF   # laid out like c
    cands = sm90_gemm.candidate_configs(spec)
    assert cands and all(c.split_k == 1 and not c.defer for c in cands)
    assert all(c in cands for c in _picks(spec)) and not cfg.pingpong and not cfg.whole_c
    no_bias = dataclasses.replace(spec, bias=False)
    assert sm90_gemm.heuristic(no_bias, 8192, 4096, 14336, 1).whole_c
    with pytest.raises(ValueError, match="pre-activation output needs unsplit"):
        sm90_gemm.launcher(spec, sm90_gemm.Config(split_k=2))


def test_fused_epilogues_keep_the_cooperative_pick():
    """A fused activation (an inference forward, a training step's pre-activation output, an
    activation's derivative) takes the cooperative 128x256 tile at short and long K, as plain
    GEMMs do: the heuristic serves the sustained case, where pingpong loses."""
    for spec in (GemmSpec(BF, BF, BF, "k", "n", "n", bias=True, activation="gelu"),
                 GemmSpec(BF, BF, BF, "k", "n", "n", bias=True, activation="gelu", preact=True),
                 GemmSpec(BF, BF, BF, "k", "n", "n", activation="swiglu", preact=True),
                 GemmSpec(BF, BF, BF, "k", "k", "n", dact="gelu"),
                 GemmSpec(BF, BF, BF, "k", "n", "n", bias=True), GemmSpec(BF, BF, BF, "k", "n", "n")):
        for m, n, k in ((8192, 14336, 4096), (8192, 8192, 8192), (2048, 8192, 2048)):
            cfg = sm90_gemm.heuristic(spec, m, n, k, 1)
            assert not cfg.pingpong and (cfg.tile_m, cfg.tile_n) == (128, 256), (spec.key(), m, n, k, cfg.key())


@pytest.mark.sweep
@pytest.mark.parametrize("c_dtype", [BF, F32])
@pytest.mark.parametrize("majors", ["kkn", "mnm"])
def test_every_heuristic_pick_compiles(c_dtype, majors):
    """bias + gelu (the longest epilogue) in every config the heuristic picks."""
    spec = GemmSpec(BF if c_dtype == BF else F16, BF if c_dtype == BF else F16, c_dtype, *majors,
                    bias=True, activation="gelu")
    for cfg in _picks(spec):
        _compile(spec, cfg)


@pytest.mark.sweep   # (CI runs the sweeps in its second step)
@pytest.mark.parametrize("bias, activation", [(True, "")] + [(b, a) for a in epilogue.ACTIVATIONS for b in (False, True)])
def test_every_epilogue_compiles(bias, activation):
    spec = GemmSpec(BF, BF, BF, bias=bias, activation=activation)
    ptx = _compile(spec, sm90_gemm.heuristic(spec, 8192, 14336, 4096, 1))
    if activation == "gelu":
        assert "tanh.approx.f32" in ptx  # 16-bit output: the MUFU tanh


@pytest.mark.sweep
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("c_dtype", [BF, F32])
def test_every_preact_pick_compiles(c_dtype, bias):
    """gelu (with and without bias) and the pre-activation output in every config the heuristic picks."""
    spec = GemmSpec(BF, BF, c_dtype, bias=bias, activation="gelu", preact=True)
    for cfg in _picks(spec):
        _compile(spec, cfg)


def lowered(f, *shapes, dtype=jnp.bfloat16) -> str:
    args = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    with config.override(target_arch="sm_90a"):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


# (the other activations, each a kernel of its own to compile, are sweeps)
@pytest.mark.parametrize("activation", [a if a == "gelu" else pytest.param(a, marks=pytest.mark.sweep)
                                        for a in epilogue.ACTIVATIONS])
def test_fused_lowering_is_one_kernel(activation, caplog):
    f = lambda x, w, c: jax_cute.matmul(x, w, bias=c, activation=activation)  # noqa: E731
    with caplog.at_level(logging.INFO, logger="jax_cute"):
        text = lowered(f, (300, 256), (256, 520), (520,))
    assert text.count("stablehlo.custom_call @jax_cute_launch") == 1
    for op in ("dot_general", "stablehlo.tanh", "stablehlo.exponential", "stablehlo.maximum", "chlo.erf"):
        assert op not in text, op
    assert any(f".bias.{activation}" in r.getMessage() for r in caplog.records)


def test_batched_bias_keeps_the_xla_epilogue(caplog):
    """A bias per batch is not one (N,) row: the kernel GEMM, then the epilogue in XLA."""
    f = jax.vmap(lambda x, w, c: jax_cute.matmul(x, w, bias=c, activation="relu"))
    with caplog.at_level(logging.INFO, logger="jax_cute"):
        text = lowered(f, (2, 256, 128), (2, 128, 256), (2, 256))
    assert text.count("stablehlo.custom_call @jax_cute_launch") == 1
    assert any("epilogue in XLA" in r.getMessage() for r in caplog.records)


@pytest.mark.sweep   # (19 s each: CI's second step, so the README's test line stays under 10 minutes)
@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_differentiated_forward_is_one_kernel(activation, caplog):
    """Under grad the forward kernel writes y and the pre-activation z (no float32 product, no
    XLA epilogue): three kernels in all, and the activation's derivative in XLA."""
    def loss(x, w, c):
        return jnp.sum(jax_cute.matmul(x, w, bias=c, activation=activation).astype(jnp.float32))

    with caplog.at_level(logging.INFO, logger="jax_cute"):
        text = lowered(jax.grad(loss, argnums=(0, 1, 2)), (300, 256), (256, 520), (520,))
    assert text.count("stablehlo.custom_call @jax_cute_launch") == 3
    assert "dot_general" not in text
    assert any(f".bias.{activation}.preact" in r.getMessage() for r in caplog.records)
    assert not any("epilogue in XLA" in r.getMessage() for r in caplog.records)


# gated (swiglu) products: N holds [gate | up]; N/2 = 14336, 1408 (tiles of 256 pair 128 columns
# of each), 64 * 3 (only 128-wide tiles pair whole blocks), and a 3-batch product
GATED_SHAPES = [(8192, 28672, 4096, 1), (8192, 2816, 4096, 1), (4096, 384, 1024, 1), (1000, 1024, 776, 3),
                (64, 4096, 4096, 1), (1, 128, 64, 1)]


def _gated_picks(spec: GemmSpec) -> list[sm90_gemm.Config]:
    return sorted({sm90_gemm.heuristic(spec, *s) for s in GATED_SHAPES}, key=lambda c: c.key())


def test_gated_tiles_pair_whole_blocks():
    """Every pick pairs halves of whole 64-column blocks: a 128x256 tile needs N/2 % 128 == 0,
    else the 128-wide tiles; N/2 off the 64-column grid has no kernel."""
    spec = GemmSpec(BF, BF, BF, "k", "n", "n", bias=True, activation="swiglu")
    for m, n, k, l in GATED_SHAPES:
        cfg = sm90_gemm.heuristic(spec, m, n, k, l)
        assert (n // 2) % (cfg.tile_n // 2) == 0, (n, cfg)
    assert sm90_gemm.heuristic(spec, 4096, 384, 1024, 1).tile_n == 128
    with pytest.raises(ValueError, match="multiple of 64"):
        sm90_gemm.heuristic(spec, 4096, 200, 1024, 1)
    assert all(c.tile_n in (128, 256) for c in sm90_gemm.candidate_configs(spec))
    f8 = "float8_e4m3fn"   # fp8's pingpong pick, too (128x160 elsewhere)
    f8_spec = GemmSpec(f8, f8, BF, "k", "k", "n", activation="swiglu")
    assert all(sm90_gemm.heuristic(f8_spec, *s).tile_n in (128, 256) for s in GATED_SHAPES)
    with pytest.raises(ValueError, match="pairs halves"):
        sm90_gemm.launcher(spec, sm90_gemm.Config(128, 160, 2, 1, pingpong=True))


# (every case 14 s: a sweep, run in CI's second step, so the README's test line stays under 10
# minutes; test_gated_k_major_b_compiles keeps a gated kernel's compile in that line)
@pytest.mark.parametrize("c_dtype", [BF, F32])
@pytest.mark.parametrize("bias, preact", [(True, False), (False, True), (True, True)])
@pytest.mark.sweep
def test_every_gated_pick_compiles(c_dtype, bias, preact):
    """swiglu, with and without bias and the pre-activation output, in every config the
    heuristic picks (N-major B and C, as a weight (K, N) and its output)."""
    spec = GemmSpec(BF, BF, c_dtype, "k", "n", "n", bias=bias, activation="swiglu", preact=preact)
    for cfg in _gated_picks(spec):
        _compile(spec, cfg)


@pytest.mark.parametrize("a_dtype", [BF, pytest.param("float8_e4m3fn", marks=pytest.mark.sweep)])
def test_gated_k_major_b_compiles(a_dtype):
    """B contiguous along K (a weight passed as (N, K); fp8's only layout): its N mode is paired
    by stride too."""
    spec = GemmSpec(a_dtype, a_dtype, BF, "k", "k", "n", bias=True, activation="swiglu", preact=True)
    _compile(spec, sm90_gemm.heuristic(spec, 8192, 28672, 4096, 1))


@pytest.mark.sweep   # (10 s: CI's second step, so the README's test line stays under 10 minutes)
def test_gated_lowering_is_one_kernel(caplog):
    """swiglu in the kernel: one launch writes the N/2 output columns, no XLA epilogue; under grad
    the forward also writes the pre-activation."""
    f = lambda x, w, c: jax_cute.matmul(x, w, bias=c, activation="swiglu")  # noqa: E731
    with caplog.at_level(logging.INFO, logger="jax_cute"):
        text = lowered(f, (300, 256), (256, 640), (640,))
    assert text.count("stablehlo.custom_call @jax_cute_launch") == 1
    for op in ("dot_general", "stablehlo.tanh", "stablehlo.logistic", "stablehlo.exponential"):
        assert op not in text, op
    assert any(".bias.swiglu" in r.getMessage() for r in caplog.records)

    def loss(x, w, c):
        return jnp.sum(jax_cute.matmul(x, w, bias=c, activation="swiglu").astype(jnp.float32))

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jax_cute"):
        text = lowered(jax.grad(loss, argnums=(0, 1, 2)), (300, 256), (256, 640), (640,))
    assert text.count("stablehlo.custom_call @jax_cute_launch") == 3
    assert any(".bias.swiglu.preact" in r.getMessage() for r in caplog.records)
    assert not any("epilogue in XLA" in r.getMessage() for r in caplog.records)



# -- the activation-derivative epilogue (GemmSpec.dact: C = act'(Z) * A·B) ----------------------

def _dact_configs(spec: GemmSpec) -> dict[str, sm90_gemm.Config]:
    """The cooperative 128x256 tile the heuristic picks at long K (the whole share for 16-bit C),
    the same tile with the ring of 64-wide subtiles, and pingpong 128x128 (autotune's candidate)."""
    coop = sm90_gemm.heuristic(spec, 8192, 4096, 14336, 1)
    return {"coop": coop, "ring": dataclasses.replace(coop, whole_c=False), "pingpong": sm90_gemm._PINGPONG_128}


def test_dact_spec():
    """dact scales the bare product: no bias, activation or pre-activation output with it; its
    key names it and every other spec keeps its key; z follows c, laid out like it."""
    for other in (dict(bias=True), dict(activation="gelu"), dict(activation="relu", preact=True)):
        with pytest.raises(ValueError, match="dact"):
            GemmSpec(BF, BF, BF, dact="gelu", **other)
    assert GemmSpec(BF, BF, BF, dact="silu").key() == "bfloat16.bfloat16.bfloat16.accfloat32.kkn.dact-silu"
    assert GemmSpec(BF, BF, F32, "k", "n", "m").key() == "bfloat16.bfloat16.float32.accfloat32.knm"
    assert (GemmSpec(F16, F16, F16, "m", "k", "n", batch_modes=3, bias=True, activation="gelu", preact=True).key()
            == "float16.float16.float16.accfloat32.mkn.b3.bias.gelu.preact")
    for majors in ("kkn", "mnm"):
        spec = GemmSpec(BF, BF, F32, *majors, dact="gelu")
        sig = [a for a in sm90_gemm.signature(spec, _dact_configs(spec)["coop"]) if hasattr(a, "dtype")]
        assert [a.name for a in sig] == ["a", "b", "c", "z"]
        assert (sig[3].dtype, sig[3].shape, sig[3].stride) == (sig[2].dtype, sig[2].shape, sig[2].stride)
    assert sm90_gemm.unsupported(GemmSpec("float8_e4m3fn", "float8_e4m3fn", BF, dact="relu")) is None
    assert "softplus" in sm90_gemm.unsupported(GemmSpec(BF, BF, BF, dact="softplus"))
    assert "one batch mode" in sm90_gemm.unsupported(GemmSpec(BF, BF, BF, batch_modes=3, dact="gelu"))
    assert sm90_gemm.candidate_configs(GemmSpec(BF, BF, BF, batch_modes=3, dact="gelu")) == []


@pytest.mark.parametrize("c_dtype", [BF, F32])
def test_dact_configs(c_dtype):
    """Unsplit tiles without a deferred epilogue (the tile's sums are scaled before any
    conversion), none of the tiles that spill with it (256x128, pingpong 128x160); the heuristic's
    picks are candidates (8-bit inputs too, whose pick would be 128x160 on 4096x14336x4096), and
    a 16-bit product keeps the cooperative tile (a training step's GEMM, see heuristic)."""
    spec = GemmSpec(BF, BF, c_dtype, "k", "n", "n", dact="gelu")
    cands = sm90_gemm.candidate_configs(spec)
    assert cands and all(c.split_k == 1 and not c.defer for c in cands)
    assert not any(c.tile_m == 256 or c.tile_n == 160 for c in cands)
    f8 = "float8_e4m3fn"
    f8_spec = GemmSpec(f8, f8, c_dtype, "k", "k", "n", dact="gelu")
    f8_cands = sm90_gemm.candidate_configs(f8_spec)
    assert sm90_gemm.heuristic(f8_spec, 4096, 14336, 4096, 1) in f8_cands   # (128x160 without dact)
    assert all(c in f8_cands for c in _picks(f8_spec))
    assert all(c in cands for c in _picks(spec)), _picks(spec)
    assert not sm90_gemm.heuristic(spec, 8192, 14336, 4096, 1).pingpong
    assert not sm90_gemm.heuristic(spec, 8192, 4096, 14336, 1).pingpong
    assert all(c in cands for c in _dact_configs(spec).values())
    with pytest.raises(ValueError, match="unsplit tiles"):
        sm90_gemm.launcher(spec, sm90_gemm.Config(split_k=2))
    with pytest.raises(ValueError, match="deferred epilogue"):
        sm90_gemm.launcher(dataclasses.replace(spec, c_dtype=BF), sm90_gemm.Config(epi_n=32, defer=2))


def _compile_dact(spec: GemmSpec, cfg: sm90_gemm.Config) -> None:
    ptx = _compile(spec, cfg)   # (WGMMA, TMA, no spills)
    assert "ld.global" in ptx   # Z, read by the epilogue
    if spec.dact in ("gelu", "silu"):   # exp(-|u|) forms (MUFU ex2), not 1 - tanh^2 of MUFU tanh
        assert "ex2.approx" in ptx and "tanh.approx.f32" not in ptx


@pytest.mark.sweep   # (CI runs the sweeps in its second step)
@pytest.mark.parametrize("which", ["coop", "ring", "pingpong"])
@pytest.mark.parametrize("dact", epilogue.ACTIVATIONS)
def test_every_dact_epilogue_compiles(dact, which):
    spec = GemmSpec(BF, BF, BF, "k", "n", "n", dact=dact)
    cfg = _dact_configs(spec)[which]
    assert cfg.whole_c == (which == "coop") and cfg.tile_n == (128 if which == "pingpong" else 256)
    _compile_dact(spec, cfg)


# Every case is a sweep, run in CI's second step (the cooperative tile with C contiguous along M
# took 20 s, too long for the README's test line); silu differs from gelu only in the
# derivative's math.
_DACT_CASES = [pytest.param(F16, F16, "kkn", "pingpong", marks=pytest.mark.sweep),
               pytest.param(BF, BF, "mnm", "coop", marks=pytest.mark.sweep),   # (20 s)
               *(pytest.param(*p, marks=pytest.mark.sweep) for p in (
                   (F16, F16, "kkn", "coop"), (BF, BF, "mnm", "pingpong"),
                   (BF, F32, "kkn", "coop"), (BF, F32, "kkn", "pingpong"),
                   (F16, F32, "mnm", "coop"), (F16, F32, "mnm", "pingpong")))]


@pytest.mark.parametrize("in_dt, c_dtype, majors, which", _DACT_CASES)
@pytest.mark.parametrize("dact", ["gelu", pytest.param("silu", marks=pytest.mark.sweep)])
def test_dact_dtypes_and_layouts_compile(dact, in_dt, c_dtype, majors, which):
    """fp16 and fp32 outputs (fp32: the ring of 32-wide subtiles), C (and Z) contiguous along N
    or M."""
    spec = GemmSpec(in_dt, in_dt, c_dtype, *majors, dact=dact)
    _compile_dact(spec, _dact_configs(spec)[which])


# -- the grouped kernel's epilogues (ragged_dot) --------------------------------------------------

def _grouped_compile(spec, n):
    pytest.importorskip("cutlass")
    from jax_cute.kernels import build, sm90_grouped

    cfg = sm90_grouped.heuristic(spec, 16384, n, 4096, 8, 1)
    binary = build.compile_launcher(sm90_grouped.launcher(spec, cfg), sm90_grouped.signature(spec, cfg),
                                    arch="sm_90a", name=f"test_{spec.key()}_{cfg.key()}", keep_ptx=True)
    res = cubin_info.resources(binary.obj)
    assert res["local_bytes"] == 0 and res["frame_bytes"] == 0, (spec.key(), cfg.key(), res)
    return binary


@pytest.mark.sweep   # (CI runs the sweeps in its second step)
@pytest.mark.parametrize("n", [2816, 1408])   # 128x256 and 128x128 tiles (swiglu: both 128x256)
@pytest.mark.parametrize("c_dtype", [BF, F32])
@pytest.mark.parametrize("bias, activation, preact", [
    (True, "", False), (True, "gelu", False), (False, "silu", True), (True, "gelu_exact", True),
    (True, "relu", True), (True, "swiglu", False), (False, "swiglu", True), (True, "swiglu", True)])
def test_every_grouped_epilogue_compiles(c_dtype, bias, activation, preact, n):
    """Without register spills, in the tiles the heuristic picks (K = 4096: with the tail split's
    workspaces where there is no pre-activation output)."""
    from jax_cute.kernels.gemm_spec import GroupedSpec

    spec = GroupedSpec("ragged_m", BF, BF, c_dtype, "k", "n", "n", bias=bias, activation=activation, preact=preact)
    names = [a.name for a in _grouped_compile(spec, n).signature if hasattr(a, "dtype")]
    assert names == (["a", "b", "c", "group_sizes"] + ["bias"] * bias + ["d"] * preact
                     + ["splitk_partials", "splitk_flags"] * (not preact))


def test_grouped_spec_checks():
    from jax_cute.kernels import sm90_grouped
    from jax_cute.kernels.gemm_spec import GroupedSpec

    with pytest.raises(ValueError, match="needs mode ragged_m"):
        GroupedSpec("ragged_k", BF, BF, BF, "m", "n", "n", bias=True)
    spec = GroupedSpec("ragged_m", BF, BF, BF, "k", "n", "n", activation="swiglu")
    assert sm90_grouped.heuristic(spec, 4096, 28672, 4096, 8, 1).tile_n == 256
    assert sm90_grouped.heuristic(spec, 4096, 384, 4096, 8, 1).tile_n == 128   # N/2 = 192: 64 + 64 pairs
    with pytest.raises(ValueError, match="multiple of 64"):
        sm90_grouped.heuristic(spec, 4096, 200, 4096, 8, 1)
    assert GroupedSpec("ragged_m", BF, BF, BF).key() == "ragged_m.bfloat16.bfloat16.bfloat16.accfloat32.kkn"


@pytest.mark.parametrize("activation", [pytest.param(a, marks=pytest.mark.sweep) for a in ("gelu", "swiglu")])   # (9-17 s)
def test_grouped_lowering_is_one_kernel(activation, caplog):
    """ragged_dot's bias and activation run in the grouped kernel: one launch, no XLA epilogue;
    under grad the forward writes the pre-activation and the gradient GEMMs are the two grouped
    kernels (three launches)."""
    gs = jnp.array([100, 0, 150, 30], jnp.int32)

    def f(x, w, c):
        return jax_cute.ragged_dot(x, w, gs, bias=c, activation=activation)

    with caplog.at_level(logging.INFO, logger="jax_cute"):
        text = lowered(f, (300, 256), (4, 256, 640), (4, 640))
    assert text.count("stablehlo.custom_call @jax_cute_launch") == 1
    for op in ("dot_general", "stablehlo.tanh", "stablehlo.logistic", "stablehlo.exponential"):
        assert op not in text, op
    assert any(f".bias.{activation}" in r.getMessage() and "ragged_m" in r.getMessage() for r in caplog.records)

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jax_cute"):
        text = lowered(jax.grad(lambda *xs: jnp.sum(f(*xs).astype(jnp.float32)), argnums=(0, 1, 2)),
                       (300, 256), (4, 256, 640), (4, 640))
    assert text.count("stablehlo.custom_call @jax_cute_launch") == 3
    assert any(f".bias.{activation}.preact" in r.getMessage() for r in caplog.records)
    assert not any("epilogue in XLA" in r.getMessage() for r in caplog.records)


@pytest.mark.sweep   # (21 s: CI's second step, so the README's test line stays under 10 minutes)
@pytest.mark.parametrize("activation", ["gelu", "silu"])
def test_grouped_vmap_is_one_kernel(activation, caplog):
    """vmap of ragged_dot with an activation: the grouped kernel runs the batch with the
    activation in its epilogue (one launch, no XLA epilogue); under grad three launches. A bias
    per batch, or one shared by every batch, is read by the kernel too."""
    gs = jnp.array([[100, 0, 150, 30], [0, 300, 0, 0]], jnp.int32)
    f = jax.vmap(lambda x, w, g: jax_cute.ragged_dot(x, w, g, activation=activation), in_axes=(0, None, 0))
    with caplog.at_level(logging.INFO, logger="jax_cute"):
        text = lowered(lambda x, w: f(x, w, gs), (2, 300, 256), (4, 256, 640))
        grad_text = lowered(jax.grad(lambda x, w: jnp.sum(f(x, w, gs).astype(jnp.float32)), argnums=(0, 1)),
                            (2, 300, 256), (4, 256, 640))
    assert text.count("stablehlo.custom_call @jax_cute_launch") == 1
    assert grad_text.count("stablehlo.custom_call @jax_cute_launch") == 3
    for op in ("dot_general", "stablehlo.tanh", "stablehlo.logistic", "stablehlo.exponential"):
        assert op not in text, op
    assert any(f".{activation}" in r.getMessage() and "L=2" in r.getMessage() for r in caplog.records)
    assert not any("epilogue in XLA" in r.getMessage() for r in caplog.records)

    for bias_axis in (0, None):
        caplog.clear()
        fb = jax.vmap(lambda x, w, c: jax_cute.ragged_dot(x, w, gs[0], bias=c, activation=activation),
                      in_axes=(0, None, bias_axis))
        with caplog.at_level(logging.INFO, logger="jax_cute"):
            text = lowered(fb, (2, 300, 256), (4, 256, 640), (2, 4, 640) if bias_axis == 0 else (4, 640))
        assert text.count("stablehlo.custom_call @jax_cute_launch") == 1
        assert any(f".bias.{activation}" in r.getMessage() and "L=2" in r.getMessage() for r in caplog.records)
        assert not any("epilogue in XLA" in r.getMessage() for r in caplog.records)


def test_grouped_off_the_column_grid_keeps_the_xla_epilogue(caplog):
    gs = jnp.array([100, 200], jnp.int32)
    f = lambda x, w: jax_cute.ragged_dot(x, w, gs, activation="swiglu")  # noqa: E731
    with caplog.at_level(logging.INFO, logger="jax_cute"):
        text = lowered(f, (300, 256), (2, 256, 200))
    assert text.count("stablehlo.custom_call @jax_cute_launch") == 1
    assert any("epilogue in XLA" in r.getMessage() and "blocks of 64" in r.getMessage() for r in caplog.records)
