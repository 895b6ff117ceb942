"""Compile-only checks of the sm90_gemm family (no GPU needed; about a minute on two cores)."""

import dataclasses
import os
import pickle
import re
import warnings

import pytest
import shared_result  # tests/ is on sys.path under pytest

from jax_cute.kernels import cubin_info, sm90_gemm
from jax_cute.kernels.gemm_spec import GemmSpec, GroupedSpec

BF, F16, F32 = "bfloat16", "float16", "float32"
BENCH = [(8192, 8192, 8192, 1), (4096, 14336, 4096, 1), (4096, 4096, 4096, 1), (2048, 2048, 2048, 1),
         (4096, 4096, 14336, 1), (16384, 2048, 2048, 1), (512, 8192, 8192, 1)]
ODD = [(1, 1, 1, 1), (64, 4096, 16384, 1), (256, 4096, 8192, 1), (1000, 1032, 776, 3), (128, 128, 65536, 1),
       (100000, 64, 64, 1), (64, 100000, 64, 2)]


def sweeps(*cases):
    """``cases`` as sweeps: CI's second step compiles them, the README's test line one case of each
    kind beside them."""
    return [pytest.param(*c, marks=pytest.mark.sweep) for c in cases]


def _compile(spec, cfg):
    pytest.importorskip("cutlass")
    import os
    # the DSL writes the kept PTX there and reads it back: it must exist
    os.makedirs(os.environ.get("CUTE_DSL_DUMP_DIR") or ".", exist_ok=True)
    name = f"test_{spec.key()}_{cfg.key()}"
    binary = shared_result.compiled(sm90_gemm, spec, cfg, name)
    ptx = binary.ptx or ""
    assert binary.obj, "empty object"
    assert "wgmma.mma_async" in ptx
    assert "cp.async.bulk.tensor" in ptx                       # TMA loads and stores
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx  # warp-specialised register split
    assert "fence.proxy.async" in ptx                           # smem writes -> TMA store
    if cfg.cluster_m * cfg.cluster_n > 1:
        assert ".multicast::cluster" in ptx
    # programmatic dependent launch: wait for the previous grid, then release the next one
    assert ("griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx) == cfg.pdl
    if cfg.split_k > 1:
        assert "atom.global" in ptx and "fence.acq_rel.gpu" in ptx   # split-K arrival counter
    # register spills (a spilling GEMM computes right but slowly): none, except a 16-byte stack
    # frame in the 128x256 configs that hold the most live state next to their accumulators
    # (4-way split-K and deferred epilogues with 64-wide subtiles, ptxas 13, 2026-11-22; an
    # unaligned C's element-wise stores, 2026-11-29)
    res = cubin_info.resources(binary.obj)
    heavy = cfg.tile_n == 256 and ((cfg.epi_n == 64 and (cfg.split_k == 4 or cfg.defer)) or not spec.c_aligned)
    assert res["local_bytes"] == 0 and res["frame_bytes"] <= (16 if heavy else 0), res
    return binary


def test_unsupported_reasons():
    assert sm90_gemm.unsupported(GemmSpec(BF, BF, BF)) is None
    assert sm90_gemm.unsupported(GemmSpec(F16, F16, F32, "m", "n", "m")) is None
    assert sm90_gemm.unsupported(GemmSpec("float8_e4m3fn", "float8_e4m3fn", BF, "k", "k", "n")) is None
    assert sm90_gemm.unsupported(GemmSpec("float8_e4m3fn", "float8_e5m2", BF, "k", "k", "n")) is None
    for bad in (GemmSpec("float8_e4m3fn", "float8_e4m3fn", BF, "k", "n", "n"),
                GemmSpec("float8_e5m2", "float8_e5m2", F32, "m", "k", "n"),
                GemmSpec("float8_e4m3fn", "float8_e5m2", BF, "k", "n", "n"), GemmSpec(BF, F16, BF),
                GemmSpec(BF, "float8_e4m3fn", BF, "k", "k", "n"), GemmSpec(BF, BF, "int32"),
                GemmSpec(F32, F32, F32), GemmSpec(BF, BF, BF, acc_dtype=F16), GroupedSpec("ragged_m", BF, BF, BF)):
        reason = sm90_gemm.unsupported(bad)
        assert isinstance(reason, str) and reason, bad
        assert sm90_gemm.candidate_configs(bad) == []
        with pytest.raises(ValueError):
            sm90_gemm.launcher(bad, sm90_gemm.Config())


@pytest.mark.parametrize("majors", ["kkn", "knn", "mnm", "mkn"])
def test_heuristic_picks_a_candidate(majors):
    spec = GemmSpec(BF, BF, BF, *majors)
    cands = sm90_gemm.candidate_configs(spec)
    assert len(set(cands)) == len(cands)
    for m, n, k, l in BENCH + ODD:
        cfg = sm90_gemm.heuristic(spec, m, n, k, l)
        assert cfg in cands, (m, n, k, l, cfg)
    # the big squares: cooperative 128x256 tiles (both consumer warpgroups on one tile), B
    # multicast over a 2x1 cluster, M fastest in bands of 8 clusters (DRAM reads near cuBLAS's),
    # no PDL, for 16-bit outputs the whole-share epilogue with 64-wide subtiles, whatever the
    # tiles per CTA; pingpong and the deferred epilogue only through autotune (H200
    # measurements, 2026-11-22 and 23)
    big = sm90_gemm.heuristic(spec, 8192, 8192, 8192, 1)
    assert (big.tile_m, big.tile_n, big.cluster_m, big.cluster_n, big.split_k, big.pingpong,
            big.raster, big.group, big.pdl) == (128, 256, 2, 1, 1, False, "m", 8, False)
    assert (big.defer, big.epi_n, big.whole_c) == (0, 64, True)
    for shape in ((16384, 1536, 1024), (16384, 2048, 2048), (4096, 14336, 4096), (2048, 2048, 2048),
                  (4096, 4096, 4096), (4096, 4096, 14336), (512, 8192, 8192)):
        assert sm90_gemm.heuristic(spec, *shape, 1) == big, shape
    # the epilogues the whole-share one replaced stay autotune candidates
    for old in (sm90_gemm.Config(epi_n=64), sm90_gemm.Config(defer=sm90_gemm.DEFER)):
        assert old in cands
    assert sm90_gemm._PINGPONG_160 in cands and sm90_gemm._PINGPONG in cands   # autotune may time them
    # too few output tiles and a long K: split it
    split = sm90_gemm.heuristic(spec, 256, 4096, 8192, 1)
    # split tiles keep the ring (only the last split of a tile stores it)
    assert split.split_k > 1 and split.defer == 0 and split.epi_n == 64 and not split.whole_c
    assert sm90_gemm.heuristic(spec, 64, 4096, 16384, 1).cluster_m == 1
    # 256x128 tiles (Pallas's shape) and pingpong: autotune only for 16-bit inputs
    assert all(sm90_gemm.heuristic(spec, *s[:3], 1).tile_m == 128 for s in BENCH + ODD)
    f32 = sm90_gemm.heuristic(GemmSpec(BF, BF, F32, *majors), 8192, 8192, 8192, 1)
    # no room for a deferred fp32 copy, nor for a whole fp32 share next to 3 A/B stages
    assert (f32.epi_n, f32.defer, f32.whole_c) == (32, 0, False)


def test_workspace_matches_signature():
    spec = GemmSpec(BF, BF, BF)
    for cfg in sm90_gemm.candidate_configs(spec):
        sig_names = [a.name for a in sm90_gemm.signature(spec, cfg)]
        ws = sm90_gemm.workspace(spec, cfg, 1000, 1032, 776, 3)
        assert sig_names[:3] == ["a", "b", "c"] and sig_names[-1] == "stream"
        assert sig_names[3:-1] == [w.name for w in ws]
        for w in ws:
            assert w.nbytes > 0 and w.nbytes % 16 == 0
        if cfg.split_k > 1:
            flags = [w for w in ws if w.name == "splitk_flags"][0]
            assert flags.zeroed
            parts = [w for w in ws if w.name == "splitk_partials"][0]
            tiles = (-(-1000 // 128) + 1) // 2 * 2 if cfg.cluster_m == 2 else -(-1000 // 128)
            assert parts.nbytes >= 4 * cfg.split_k * tiles * cfg.tile_m * cfg.tile_n


_E4M3 = GemmSpec("float8_e4m3fn", "float8_e4m3fn", BF, "k", "k", "n")


@pytest.mark.sweep   # (every heuristic pick compiles in the default run; CI runs the sweep too)
@pytest.mark.parametrize("spec,cfg", [(s, c) for s in (GemmSpec(BF, BF, BF), _E4M3)
                                      for c in sm90_gemm.candidate_configs(s)],
                         ids=lambda x: x.key() if hasattr(x, "key") else str(x))
def test_compile_every_candidate(spec, cfg):
    _compile(spec, cfg)


_MAIN = sm90_gemm.Config()
# the test line: bf16, and fp16 in and fp32 out of an M-major split-K tile; the other input and
# output dtypes, majors and N-first raster are sweeps
_COMBOS = [(BF, BF, "kkn", _MAIN), (F16, F32, "mnm", sm90_gemm.Config(128, 128, 1, 2, split_k=4)),
           *sweeps(*[(a, c, "kkn", _MAIN) for a in (BF, F16) for c in (BF, F16, F32) if (a, c) != (BF, BF)],
                   (F16, F32, "knm", _MAIN),
                   *[(BF, BF, mj, _MAIN) for mj in ("knn", "mkn", "mnm")], (BF, BF, "mnm", sm90_gemm.Config(raster="n")),
                   (BF, F16, "knn", sm90_gemm.Config(128, 256, 2, 1, split_k=2)))]


@pytest.mark.parametrize("in_dt,out_dt,majors,cfg", _COMBOS,
                         ids=lambda x: x.key() if dataclasses.is_dataclass(x) else str(x))
def test_compile_dtypes_and_majors(in_dt, out_dt, majors, cfg):
    _compile(GemmSpec(in_dt, in_dt, out_dt, *majors), cfg)


def test_config_validation():
    C = sm90_gemm.Config
    spec = GemmSpec(BF, BF, BF)
    for bad in (C(64, 256), C(128, 256, pingpong=True), C(64, 256, 2, 1, split_k=2, pingpong=True),
                C(128, 256, 4, 1), C(96, 256), C(128, 224), C(64, 160, 2, 1, pingpong=True),
                C(128, 192, 2, 1, pingpong=True), C(epi_n=48), C(128, 160, epi_n=64),
                C(64, 256, 2, 1, pingpong=True, defer=1), C(split_k=2, defer=1), C(defer=4)):
        with pytest.raises(ValueError):
            sm90_gemm.launcher(spec, bad)
    with pytest.raises(ValueError, match="16-bit output"):   # no room for an fp32 copy
        sm90_gemm.launcher(GemmSpec(BF, BF, F32), C(defer=1))
    assert C(epi_n=64, defer=2).key().endswith(".e64.df2")
    assert C(epi_n=64, whole_c=True).key().endswith(".e64.wc")
    assert C(64, 256, 2, 1, pingpong=True).key().endswith(".pp")
    assert not C().key().endswith(".pp")
    assert C(pdl=True).key() != C().key() and C(pdl=True).key().endswith(".pdl")
    assert C(epi_n=64).key().endswith(".e64") and C().key() == "t128x256.c2x1.rm8.sk1.st0"
    assert C(sms=116).key() == C().key() + ".sm116" and C(sms=sm90_gemm.NUM_SMS).key() == C().key()
    with pytest.raises(ValueError, match="holds no 2x1 cluster"):
        sm90_gemm.launcher(spec, C(sms=1))


def _budgets() -> list[dict]:
    """A bf16 GEMM's default config on all 132 SMs and on 116, each compiled as
    build.compile_launcher compiles it (named "budget", its PTX kept): the object, the PTX and
    the compiled module's IR. Compiled once per test run for the two tests below (whichever
    asks first, on any worker)."""
    pytest.importorskip("cutlass")

    def compile_both():
        from jax_cute.kernels import abi, build, dsl_env

        build.load_runtime_globally()
        from jax_cute.kernels import dsl

        spec, out = GemmSpec(BF, BF, BF), []
        for sms in (sm90_gemm.NUM_SMS, 116):
            cfg = sm90_gemm.Config(sms=sms)
            with dsl_env.program_name_only():
                compiled = dsl.cute.compile(sm90_gemm.launcher(spec, cfg), *abi.fake_args(sm90_gemm.signature(spec, cfg)),
                                            options=f"--gpu-arch {sm90_gemm.ARCH} --keep-ptx")
                obj = compiled.dump_to_object(build.symbol_for("budget"))
            ptx = getattr(compiled.artifacts, "PTX", None)
            if ptx and len(ptx) < 4096 and os.path.isfile(ptx):   # (as build.compile_launcher reads it)
                with open(ptx) as f:
                    ptx = f.read()
            out.append({"obj": bytes(obj), "ptx": ptx, "ir": str(compiled.ir_module).splitlines()})
        return out

    return shared_result.once("test_sm90_gemm_compile-budgets", compile_both, dumps=pickle.dumps, loads=pickle.loads)


def test_sm_budget_is_a_launch_parameter():
    """Config.sms caps the persistent grid in the host launcher: the kernel's PTX is the same for
    every budget, the object (its launcher) is not."""
    assert sm90_gemm.Config(sms=sm90_gemm.NUM_SMS) == sm90_gemm.Config()
    got = _budgets()
    assert got[0]["ptx"] and got[0]["ptx"] == got[1]["ptx"]
    assert got[0]["obj"] != got[1]["obj"]


def test_sm_budget_caps_the_grid_and_changes_nothing_else():
    """The compiled module (the host launcher, with the kernel's binary embedded) of a
    2x1-cluster config on 116 SMs differs from the one on all 132 in one constant: the
    persistent grid's bound of 58 clusters, not 66."""
    ir = [b["ir"] for b in _budgets()]
    assert len(ir[0]) == len(ir[1])
    changed = [(a, b) for a, b in zip(*ir) if a != b]
    assert len(changed) == 1, changed
    assert "constant(66 : i32)" in changed[0][0] and "constant(58 : i32)" in changed[0][1], changed


# (the test line: one pingpong tile, the 2x2 cluster and PDL; the other pingpong tiles are sweeps)
_EXTRA = [(F16, F32, "mnm", sm90_gemm.Config(64, 128, 1, 2, pingpong=True)),
          (BF, BF, "knn", sm90_gemm.Config(128, 256, 2, 2)),
          (BF, BF, "knn", sm90_gemm.Config(pdl=True)),
          *sweeps((F16, BF, "mkn", sm90_gemm.Config(64, 256, 2, 1, pingpong=True)),
                  (BF, BF, "knn", sm90_gemm.Config(128, 160, 2, 1, pingpong=True)),
                  (F16, F32, "mnm", sm90_gemm.Config(128, 128, 1, 2, pingpong=True)),
                  (BF, F16, "mkm", sm90_gemm.Config(128, 128, 1, 1, pingpong=True, epi_n=64)),
                  (F16, F16, "mnm", sm90_gemm.Config(split_k=2, epi_n=64)))]


@pytest.mark.parametrize("in_dt,out_dt,majors,cfg", _EXTRA,
                         ids=lambda x: x.key() if dataclasses.is_dataclass(x) else str(x))
def test_compile_pingpong_2x2_and_pdl(in_dt, out_dt, majors, cfg):
    binary = _compile(GemmSpec(in_dt, in_dt, out_dt, *majors), cfg)
    if cfg.pingpong:
        # per-warpgroup epilogue barriers and mainloop turn tokens (register barrier ids)
        assert "bar.arrive" in binary.ptx
    # a 128-row pingpong tile is two m64 WGMMAs per k-step for one warpgroup
    assert f"m64n{cfg.tile_n}k16" in binary.ptx


_DEFER = [(BF, F16, "knm", sm90_gemm.Config(128, 128, 1, 2, defer=3)),
          *sweeps((BF, BF, "knn", sm90_gemm.Config(epi_n=64, defer=2)), (F16, F16, "mkm", sm90_gemm.Config(defer=1)))]


@pytest.mark.parametrize("in_dt,out_dt,majors,cfg", _DEFER,
                         ids=lambda x: x.key() if dataclasses.is_dataclass(x) else str(x))
def test_compile_deferred_epilogue(in_dt, out_dt, majors, cfg):
    # the output-dtype copy of the accumulators lives next to them without spills (_compile),
    # and the epilogue is emitted twice: under the next tile's WGMMAs and after the last tile
    ptx = _compile(GemmSpec(in_dt, in_dt, out_dt, *majors), cfg).ptx
    plain = _compile(GemmSpec(in_dt, in_dt, out_dt, *majors), dataclasses.replace(cfg, defer=0)).ptx
    assert ptx.count("stmatrix") == 2 * plain.count("stmatrix") > 0
    # WGMMA batches are emitted by `start` and the loop of `rest` in both; with more than one
    # deferred k-tile `rest` also peels its first batch (it hands their stages back together)
    peeled = 3 if cfg.defer > 1 else 2
    assert 2 * ptx.count("wgmma.mma_async") == peeled * plain.count("wgmma.mma_async") > 0
    assert ("cvt.rn.bf16x2.f32" if out_dt == BF else "cvt.rn.f16x2.f32") in ptx


_WHOLE = [(BF, BF, "knn", sm90_gemm.Config(epi_n=64, whole_c=True)),
          *sweeps((BF, BF, "knn", sm90_gemm.Config(128, 128, 2, 1, pingpong=True, epi_n=64, whole_c=True)),
                  (F16, F16, "mkm", sm90_gemm.Config(whole_c=True)),
                  (BF, F32, "mnm", sm90_gemm.Config(128, 128, 1, 2, whole_c=True)),
                  (BF, BF, "kkn", sm90_gemm.Config(split_k=2, epi_n=64, whole_c=True)))]


@pytest.mark.parametrize("in_dt,out_dt,majors,cfg", _WHOLE,
                         ids=lambda x: x.key() if dataclasses.is_dataclass(x) else str(x))
def test_compile_whole_share_epilogue(in_dt, out_dt, majors, cfg):
    # the ring's stores are waited for once per tile (before the ring is refilled) and once at
    # the kernel's end; the plain ring waits after every subtile's store. Same smem writes.
    spec = GemmSpec(in_dt, in_dt, out_dt, *majors)
    ptx = _compile(spec, cfg).ptx
    plain = _compile(spec, dataclasses.replace(cfg, whole_c=False)).ptx
    subtiles = ((cfg.tile_m if cfg.pingpong else cfg.tile_m // 2) // 64) * (cfg.tile_n // cfg.epi_n)
    assert ptx.count("cp.async.bulk.wait_group.read") == 2
    assert plain.count("cp.async.bulk.wait_group.read") == subtiles + 1
    assert ptx.count("cp.async.bulk.commit_group") == plain.count("cp.async.bulk.commit_group") == subtiles
    assert ptx.count("stmatrix") == plain.count("stmatrix")
    assert sm90_gemm.stage_plan(cfg.tile_n, out_dt, 0, cfg.pingpong, cfg.epi_n, cfg.tile_m, True)[1] == subtiles


def test_pingpong_hands_over_before_drain():
    # a pingpong warpgroup passes the mainloop turn (a named-barrier arrive) once its unit's last
    # WGMMAs are issued and only then waits for them, so the other warpgroup's WGMMAs queue
    # behind them instead of starting on idle tensor cores
    ptx = _compile(GemmSpec(BF, BF, BF, "k", "n", "n"),
                   sm90_gemm.Config(128, 128, 2, 1, pingpong=True, epi_n=64, whole_c=True)).ptx
    hand_over = re.search(r"\bbar\.arrive\b", ptx)
    drain = re.search(r"wgmma\.wait_group\.sync\.aligned\s+0;", ptx)
    assert hand_over and drain and hand_over.start() < drain.start()
    assert re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx[:hand_over.start()])


def test_ragged_edge_store_path():
    # a C whose contiguous extent is not 16-byte aligned is stored with predicated st.global at
    # that edge (a TMA store there would write the padding behind it): the path must exist
    binary = _compile(GemmSpec(BF, BF, BF, "k", "k", "n"), sm90_gemm.Config(128, 128, 1, 1))
    assert "st.global" in binary.ptx


_TMA_STORE = re.compile(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared")


# an unaligned C (a 50257-word vocabulary's logits): the heuristic's pick (pingpong 64x256 tiles'
# rings of 32-wide subtiles for a plain 16-bit C, 128x128 with a fused epilogue) and a 128x128 ring,
# 16- and 32-bit C contiguous along N or M, a fused bias and gelu (sweeps, CI's second step)
@pytest.mark.parametrize("c_dt, c_major, fused, cfg", [
    (BF, "n", {}, None), *sweeps((F32, "n", {}, sm90_gemm.Config(128, 128, 2, 1)), (BF, "m", {}, sm90_gemm.Config(128, 128, 1, 2)),
                                 (BF, "n", dict(bias=True, activation="gelu"), None))],
    ids=["bf16-n", "f32-n-128", "bf16-m-128", "bf16-n-bias-gelu"])
def test_unaligned_c_is_stored_without_tma(c_dt, c_major, fused, cfg):
    """GemmSpec.c_aligned False: every subtile of C is written with per-element st.global (C's
    strides are not TMA's 16-byte multiples); no TMA store is left, the loads stay TMA's."""
    spec = GemmSpec(BF, BF, c_dt, "k", "k", c_major, c_aligned=False, **fused)
    assert spec.key().endswith(".cunaligned") and spec != dataclasses.replace(spec, c_aligned=True)
    sig = {a.name: a for a in sm90_gemm.signature(spec, sm90_gemm.Config(128, 128, 2, 1))}
    assert all(s.div == 1 for s in sig["c"].stride if not isinstance(s, int))
    if cfg is None:
        cfg = sm90_gemm.heuristic(spec, 8192, 50257, 768, 1)
        want = (128, 64, False, True) if fused else (256, 32, True, False)
        assert (cfg.tile_n, cfg.epi_n, cfg.pingpong, cfg.whole_c) == want, cfg
    ptx = _compile(spec, cfg).ptx
    assert not _TMA_STORE.search(ptx) and "st.global" in ptx and "cp.async.bulk.tensor" in ptx
    assert _TMA_STORE.search(_compile(dataclasses.replace(spec, c_aligned=True), cfg).ptx)
    with pytest.raises(ValueError, match="unaligned C"):
        GemmSpec(BF, BF, BF, "k", "k", "n", c_aligned=False, activation="gelu", preact=True)


_FP8 = [("float8_e4m3fn", BF, sm90_gemm._PINGPONG_160),   # (the heuristic's fp8 pick; the others are sweeps)
        *sweeps(("float8_e4m3fn", BF, sm90_gemm._PINGPONG), ("float8_e5m2", F32, sm90_gemm.Config(128, 128, 1, 2, split_k=2)))]


@pytest.mark.parametrize("in_dt,out_dt,cfg", _FP8, ids=lambda x: x.key() if dataclasses.is_dataclass(x) else str(x))
def test_compile_fp8(in_dt, out_dt, cfg):
    # 8-bit inputs: 128-element k-tiles (one 128-byte row), WGMMA k32 on e4m3/e5m2 operands
    spec = GemmSpec(in_dt, in_dt, out_dt, "k", "k", "n")
    assert sm90_gemm.tile_k(in_dt) == 128 and sm90_gemm.heuristic(spec, 4096, 4096, 4096, 1) in \
        sm90_gemm.candidate_configs(spec)
    binary = _compile(spec, cfg)
    kind = "e4m3" if "e4m3" in in_dt else "e5m2"
    assert f"wgmma.mma_async.sync.aligned.m64n{cfg.tile_n}k32.f32.{kind}.{kind}" in binary.ptx
    assert "cp.async.bulk.tensor" in binary.ptx


@pytest.mark.parametrize("a_dt,b_dt", [("float8_e4m3fn", "float8_e5m2"), *sweeps(("float8_e5m2", "float8_e4m3fn"))])
def test_compile_mixed_fp8(a_dt, b_dt):
    # WGMMA multiplies e4m3 by e5m2 in one instruction: each operand keeps its own type
    spec = GemmSpec(a_dt, b_dt, BF, "k", "k", "n")
    assert sm90_gemm.unsupported(spec) is None
    cfg = sm90_gemm.heuristic(spec, 1000, 1032, 784, 1)
    kinds = [d.split("_")[1][:4] for d in (a_dt, b_dt)]
    assert f"k32.f32.{kinds[0]}.{kinds[1]}" in _compile(spec, cfg).ptx


def test_fp8_heuristic_takes_pingpong_where_waves_waste():
    # 8-bit k-tiles run twice as fast, so a cooperative tile's exposed epilogue weighs twice as
    # much: 128x160 pingpong ran fp8 4096x14336x4096 at 1323 against 1252 TFLOP/s for the
    # cooperative 128x256 (XLA 1353); on 8192^3 they tied and on 2048^3 pingpong lost 14% (H200,
    # 2026-11-24). 16-bit inputs keep the cooperative tile (pingpong loses sustained).
    spec = GemmSpec("float8_e4m3fn", "float8_e4m3fn", BF, "k", "k", "n")
    assert sm90_gemm.heuristic(spec, 4096, 14336, 4096, 1) == sm90_gemm._PINGPONG_160
    for shape in ((8192, 8192, 8192), (2048, 2048, 2048), (4096, 4096, 14336), (512, 8192, 8192)):
        assert not sm90_gemm.heuristic(spec, *shape, 1).pingpong, shape
    assert not sm90_gemm.heuristic(GemmSpec(BF, BF, BF, "k", "k", "n"), 4096, 14336, 4096, 1).pingpong


# (the test line: one tile of each width; the other dtypes and majors are sweeps)
_WIDTHS = [(BF, F32, "kkn", sm90_gemm.Config(128, 160)),
           (BF, BF, "knn", sm90_gemm.Config(128, 192, raster="n", group=16)),
           *sweeps((BF, BF, "knn", sm90_gemm.Config(128, 160, raster="n", group=16)),
                   (F16, F16, "mnm", sm90_gemm.Config(128, 160, 1, 2)),
                   ("float8_e4m3fn", BF, "kkn", sm90_gemm.Config(128, 160)),
                   (BF, F32, "mkn", sm90_gemm.Config(128, 192, 1, 2)))]


_TALL = [(BF, BF, "kkn", sm90_gemm.Config(256, 128, epi_n=64)),
         *sweeps((BF, BF, "mnm", sm90_gemm.Config(256, 128, 1, 2, epi_n=64, whole_c=True)),
                 (BF, F32, "knn", sm90_gemm.Config(256, 128, split_k=2)),
                 ("float8_e4m3fn", BF, "kkn", sm90_gemm.Config(256, 128, 1, 1, epi_n=32, defer=2)))]


@pytest.mark.parametrize("in_dt,out_dt,majors,cfg", _TALL,
                         ids=lambda x: x.key() if dataclasses.is_dataclass(x) else str(x))
def test_compile_256_row_cooperative_tiles(in_dt, out_dt, majors, cfg):
    # each warpgroup runs two m64 WGMMAs per k-step (its rows 0-63 and 128-191, or 64-127 and
    # 192-255) into 128 x 128 accumulators, and stores both row blocks
    spec = GemmSpec(in_dt, in_dt, out_dt, *majors)
    binary = _compile(spec, cfg)
    k = 32 if in_dt.startswith("float8") else 16
    assert f"wgmma.mma_async.sync.aligned.m64n128k{k}" in binary.ptx
    plain = dataclasses.replace(cfg, whole_c=False, defer=0)
    per_wg = 2 * (cfg.tile_n // cfg.epi_n)
    if not cfg.defer and cfg.split_k == 1:
        assert binary.ptx.count("cp.async.bulk.commit_group") == per_wg
    assert sm90_gemm.tiles_per_cta(plain, 8192, 8192, 1) == 16 * cfg.split_k
    assert sm90_gemm.Config(256, 128, epi_n=64) in sm90_gemm.candidate_configs(GemmSpec(BF, BF, BF))


@pytest.mark.parametrize("in_dt,out_dt,majors,cfg", _WIDTHS,
                         ids=lambda x: x.key() if dataclasses.is_dataclass(x) else str(x))
def test_compile_160_and_192_wide_tiles(in_dt, out_dt, majors, cfg):
    ptx = _compile(GemmSpec(in_dt, in_dt, out_dt, *majors), cfg).ptx
    k = 32 if in_dt.startswith("float8") else 16
    assert f"wgmma.mma_async.sync.aligned.m64n{cfg.tile_n}k{k}" in ptx


def test_epilogue_ring_divides_the_subtiles_and_everything_fits():
    tiles = [(tm, tn, False) for tm, tn in sm90_gemm._COOP_TILES] + [(tm, tn, True) for tm, tn in sm90_gemm._PINGPONG_TILES]
    for tm, tn, pp in tiles:
        for c_dt in (BF, F32):
            for epi_n in (32, 64):
                if tn % epi_n:
                    continue
                ab, depth = sm90_gemm.stage_plan(tn, c_dt, 0, pp, epi_n, tm)
                item = 4 if c_dt == F32 else 2
                # each consumer warpgroup's ring holds 64 x epi_n subtiles of its own rows
                subtiles = ((tm if pp else tm // 2) // 64) * (tn // epi_n)
                assert subtiles % depth == 0 and ab >= 4, (tm, tn, pp, c_dt, epi_n, ab, depth)
                assert ab * (tm + tn) * 128 + 2 * depth * 64 * epi_n * item + 1024 <= sm90_gemm.SMEM_BYTES
    # cooperative 16-bit 128x256: 4-deep ring of 64x32 or 2-deep of 64x64 subtiles per warpgroup
    assert sm90_gemm.stage_plan(256, BF, 0, False, 32) == (4, 4)
    assert sm90_gemm.stage_plan(256, BF, 0, False, 64) == (4, 2)
    # whole share: a slot per subtile of the warpgroup's 64 x 256 share (32 KB each), 3 stages;
    # 128x128: 6 stages either way; pingpong 128x160: its whole 128 x 160 tile per warpgroup
    assert sm90_gemm.stage_plan(256, BF, 0, False, 64, 128, True) == (3, 4)
    assert sm90_gemm.stage_plan(128, BF, 0, False, 64, 128, True) == (6, 2)
    assert sm90_gemm.stage_plan(160, BF, 0, True, 32, 128, True) == (4, 10)
    # 256x128 (two 64 x 128 row blocks per warpgroup): 4 stages beside a 2-deep ring of 64x64
    # subtiles, 3 beside a whole 128 x 128 share
    assert sm90_gemm.stage_plan(128, BF, 0, False, 64, 256) == (4, 2)
    assert sm90_gemm.stage_plan(128, BF, 0, False, 64, 256, True) == (3, 4)
    # a whole fp32 128x256 share leaves 2 stages: refused
    assert sm90_gemm.stage_plan(256, F32, 0, False, 32, 128, True)[0] == 2
    with pytest.raises(ValueError, match="3 needed"):
        sm90_gemm.launcher(GemmSpec(BF, BF, F32), sm90_gemm.Config(whole_c=True))


def test_no_optimization_warnings():
    # the split-K partial copies are the kernel's longest static loops (a 128x256 tile's 128
    # accumulators per thread): the DSL warns about static loops of 64 or more iterations
    from cutlass.base_dsl.ast_helpers import DSLOptimizationWarning
    spec, cfg = GemmSpec(BF, BF, BF), sm90_gemm.Config(split_k=4, epi_n=64)
    _compile(spec, cfg)   # the DSL installs its warning filters when first used
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _compile(spec, cfg)
    assert not [w for w in seen if issubclass(w.category, DSLOptimizationWarning)]
    assert not hasattr(sm90_gemm.Config(), "trace")   # no timing build


# Three batch modes (rank-5 operands: attention's (B, T, H, D) activations, nested vmap): the
# heuristic's cooperative tiles with either cluster, split-K, and autotune's pingpong and
# deferred epilogues, over input/output dtypes and majors (the test line: the heuristic's tile;
# the rest are sweeps)
C = sm90_gemm.Config
_B3 = [(BF, BF, "kkn", C(epi_n=64, whole_c=True)),
       *sweeps((BF, F32, "kkn", C(128, 128, 1, 2, split_k=4)),
               (BF, BF, "kkn", C(epi_n=64, whole_c=True, pdl=True)),
               (F16, F32, "knn", C()),
               (BF, F16, "mkn", C(128, 128, 2, 1, epi_n=64, whole_c=True)),
               (F16, F16, "kkm", C(128, 256, 1, 2, epi_n=64, whole_c=True)),
               (BF, F32, "kkm", C(128, 128, 1, 2)),
               (F16, F16, "kkn", C(128, 128, 1, 1, epi_n=64, whole_c=True)),
               (BF, BF, "knn", C(128, 256, 2, 1, split_k=2, epi_n=64)),
               (F16, BF, "mkn", C(128, 256, 1, 2, split_k=4, epi_n=64)),
               (BF, BF, "kkm", sm90_gemm._PINGPONG),
               (F16, F32, "knn", C(128, 128, 2, 1, pingpong=True)),
               (BF, BF, "mkn", C(defer=sm90_gemm.DEFER)))]
del C


@pytest.mark.parametrize("in_dt,out_dt,majors,cfg", _B3,
                         ids=lambda x: x.key() if dataclasses.is_dataclass(x) else str(x))
def test_compile_three_batch_modes(in_dt, out_dt, majors, cfg):
    spec = GemmSpec(in_dt, in_dt, out_dt, *majors, batch_modes=3)
    assert dataclasses.replace(cfg, pdl=False) in sm90_gemm.candidate_configs(spec)
    ptx = _compile(spec, cfg).ptx
    # every TMA map spans (rows, cols, L0, L1, L2); the unaligned-edge stores are there too
    assert "cp.async.bulk.tensor.5d" in ptx and "cp.async.bulk.tensor.3d" not in ptx
    assert "st.global" in ptx


def test_three_batch_modes_configs():
    assert sm90_gemm.BATCH_MODES == (1, 3)
    for majors in ("kkn", "mnm"):
        for out in (BF, F32):
            one, three = GemmSpec(BF, BF, out, *majors), GemmSpec(BF, BF, out, *majors, batch_modes=3)
            assert sm90_gemm.unsupported(three) is None
            cands = sm90_gemm.candidate_configs(three)
            assert cands == sm90_gemm.candidate_configs(one)
            for m, n, k, l in BENCH + ODD + [(2048, 2048, 128, 8 * 16), (2048, 128, 2048, 8 * 16)]:
                want, got = sm90_gemm.heuristic(one, m, n, k, l), sm90_gemm.heuristic(three, m, n, k, l)
                # except an fp32 128x256 tile split 4 ways, which spills with three batch modes
                assert got == want or (out == F32 and (want.tile_n, want.split_k) == (256, 4)
                                       and (got.tile_n, got.split_k) != (256, 4) and got in cands)


def test_launcher_takes_the_signature_in_order():
    """The launcher is derived from the ABI signature: one parameter per argument, named and
    typed after it, in the order the handler fills them."""
    import inspect

    pytest.importorskip("cutlass")
    from jax_cute.kernels import abi, launch

    for spec, cfg in ((GemmSpec(BF, BF, BF, bias=True, activation="gelu", preact=True), sm90_gemm.Config()),
                      (GemmSpec(BF, BF, F32, bias=True), sm90_gemm.Config(split_k=2)),
                      (GemmSpec(BF, BF, BF, dact="silu"), sm90_gemm.Config())):
        sig = sm90_gemm.signature(spec, cfg)
        params = inspect.signature(launch.launcher_for(sig, lambda **kw: None)).parameters
        assert list(params) == [a.name for a in sig]
        assert [p.annotation for p in params.values()] == [launch.annotation(a) for a in sig]
    with pytest.raises(ValueError, match="distinct"):
        launch.launcher_for((abi.StreamArg(), abi.StreamArg()), lambda **kw: None)


def test_persistent_grid_holds_only_co_resident_clusters():
    """A 2x2 cluster's four CTAs share a GPC: 30 of the 33 that 132 SMs would hold run at once on
    an H200 (cudaOccupancyMaxActiveClusters), so the grid (and the time model's tiles a CTA)
    counts 30; the rest would run as a second wave. 1- and 2-CTA clusters all fit."""
    from jax_cute.kernels.sm90_config import co_resident_clusters
    assert [co_resident_clusters(132, s) for s in (1, 2, 4)] == [132, 66, 30]
    assert co_resident_clusters(116, 4) == 26 and co_resident_clusters(116, 2) == 58
    c21, c22 = sm90_gemm.Config(128, 256, 2, 1), sm90_gemm.Config(128, 256, 2, 2)
    assert sm90_gemm.tiles_per_cta(c21, 8192, 8192, 1) == 16      # 2048 tiles on 132 CTAs
    assert sm90_gemm.tiles_per_cta(c22, 8192, 8192, 1) == 18      # 2048 tiles on 120 CTAs
