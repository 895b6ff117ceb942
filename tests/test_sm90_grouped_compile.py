"""CPU-only: every candidate config of the sm90_grouped family compiles for sm_90a (CI's sweep; the
README's test line compiles one of each kind), and its PTX holds the Hopper pieces the design
relies on (WGMMA, TMA, setmaxnreg, warp shuffles)."""

import os
import warnings

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest

pytest.importorskip("cutlass")

from jax_cute.kernels import build, sm90_gemm, sm90_grouped as fam  # noqa: E402
from jax_cute.kernels.gemm_spec import GroupedSpec  # noqa: E402


def _specs():
    for dt in ("bfloat16", "float16"):
        for bm in ("k", "n"):   # M-major A is refused for ragged_m (see unsupported())
            yield GroupedSpec("ragged_m", dt, dt, dt, a_major="k", b_major=bm)
        yield GroupedSpec("ragged_k", dt, dt, dt, a_major="m", b_major="n")
    # other outputs: fp32 (the rhs gradient is often kept in fp32) and an M-major ragged_k out
    yield GroupedSpec("ragged_m", "bfloat16", "bfloat16", "float32")
    yield GroupedSpec("ragged_k", "bfloat16", "bfloat16", "float32", a_major="m", b_major="n")
    yield GroupedSpec("ragged_k", "bfloat16", "bfloat16", "bfloat16", a_major="m", b_major="n", c_major="m")
    # ragged_dot's group_offset: a lead of rows before the groups (forward, both gradients, an epilogue)
    yield GroupedSpec("ragged_m", "bfloat16", "bfloat16", "bfloat16", b_major="n", lead=True)
    yield GroupedSpec("ragged_m", "bfloat16", "bfloat16", "float32", a_major="k", b_major="k", lead=True)
    yield GroupedSpec("ragged_k", "bfloat16", "bfloat16", "bfloat16", a_major="m", b_major="n", lead=True)
    yield GroupedSpec("ragged_m", "bfloat16", "bfloat16", "bfloat16", b_major="n", bias=True, activation="silu",
                      lead=True)


# the test line: the forward's 256-wide tile, a 128-wide ragged_k (a weight gradient), an fp32
# output, and a lead of rows with a fused epilogue; every other (spec, config) is a sweep
_TEST_LINE = {("ragged_m.bfloat16.bfloat16.bfloat16.accfloat32.knn", "n256.r8.sm132"),
              ("ragged_k.bfloat16.bfloat16.bfloat16.accfloat32.mnn", "n128.r8.sm132"),
              ("ragged_m.bfloat16.bfloat16.float32.accfloat32.kkn", "n128.r8.sm132"),
              ("ragged_m.bfloat16.bfloat16.bfloat16.accfloat32.knn.bias.silu.lead", "n128.r8.sm132"),
              ("ragged_m.bfloat16.bfloat16.bfloat16.accfloat32.knn", "n256.r8.sm132.ts4")}
CASES = [pytest.param(s, c, id=f"{s.key()}-{c.key()}",
                      marks=() if (s.key(), c.key()) in _TEST_LINE else pytest.mark.sweep)
         for s in _specs() for c in fam.candidate_configs(s)]
assert sum(not p.marks for p in CASES) == len(_TEST_LINE)


def test_contract():
    assert fam.FAMILY == "sm90_grouped" and fam.ARCH == "sm_90a"
    spec = GroupedSpec("ragged_m", "bfloat16", "bfloat16", "bfloat16", b_major="n")
    cfg = fam.heuristic(spec, 16384, 14336, 4096, 8, 1)
    assert cfg in fam.candidate_configs(spec) and cfg.tail_split == fam.TAIL_SPLIT
    # the tail split's partials (a 128 x tile_n fp32 tile per CTA) and zeroed arrival counters
    assert [(w.name, w.nbytes, w.zeroed) for w in fam.workspace(spec, cfg, 16384, 14336, 4096, 8, 1)] == [
        ("splitk_partials", 4 * 132 * 128 * 256, False), ("splitk_flags", 16 * 33, True)]
    assert fam.workspace(spec, fam.Config(256), 16384, 14336, 4096, 8, 1) == []
    assert fam.unsupported(spec) is None
    # documented limits of the clipped-TMA design
    assert fam.unsupported(GroupedSpec("ragged_k", "bfloat16", "bfloat16", "bfloat16")) is not None
    assert fam.unsupported(GroupedSpec("ragged_m", "bfloat16", "bfloat16", "bfloat16", c_major="m")) is not None
    assert fam.unsupported(GroupedSpec("ragged_m", "float32", "float32", "float32")) is not None
    assert fam.unsupported(GroupedSpec("ragged_m", "bfloat16", "bfloat16", "bfloat16", a_major="m")) is not None


def test_heuristic_tile_n():
    """128-wide tiles where 256-wide ones would leave the last N tile at least half empty."""
    fwd = GroupedSpec("ragged_m", "bfloat16", "bfloat16", "bfloat16", b_major="n")
    picks = {n: fam.heuristic(fwd, 32768, n, 2048, 64, 1).tile_n
             for n in (64, 128, 1408, 1536, 1600, 1700, 4096, 14336, 16384, 16400)}
    assert picks == {64: 128, 128: 128, 1408: 128, 1536: 256, 1600: 128, 1700: 256, 4096: 256, 14336: 256,
                     16384: 256, 16400: 128}
    # ragged_k: too few (m, n) tiles per group to fill the SMs twice -> 128-wide
    drhs = GroupedSpec("ragged_k", "bfloat16", "bfloat16", "bfloat16", a_major="m", b_major="n")
    assert fam.heuristic(drhs, 4096, 14336, 16384, 8, 1).tile_n == 256
    assert fam.heuristic(drhs, 256, 512, 16384, 2, 1).tile_n == 128


def test_heuristic_tail_split():
    """The tail split where K holds two splits of TAIL_MIN_K_TILES k-tiles or more, on one-CTA
    16-bit ragged_m products without a pre-activation output."""
    fwd = GroupedSpec("ragged_m", "bfloat16", "bfloat16", "bfloat16", b_major="n")
    assert [fam.heuristic(fwd, 16384, 4096, k, 8, 1).tail_split for k in (512, 1984, 2000, 14336)] == [1, 1, 4, 4]
    assert [fam.heuristic(fwd, 16384, 4096, 4096, g, 1).tail_split for g in (64, 65)] == [4, 1]
    for spec in (GroupedSpec("ragged_m", "bfloat16", "bfloat16", "bfloat16", activation="gelu", preact=True),
                 GroupedSpec("ragged_k", "bfloat16", "bfloat16", "bfloat16", a_major="m", b_major="n"),
                 GroupedSpec("ragged_m", "float8_e4m3fn", "float8_e4m3fn", "bfloat16", a_block=1, b_block=128)):
        assert fam.heuristic(spec, 16384, 4096, 4096, 8, 1).tail_split == 1, spec.key()
        assert all(c.tail_split == 1 for c in fam.candidate_configs(spec))


@pytest.mark.parametrize("spec,cfg", CASES)
def test_compiles(spec, cfg):
    assert fam.unsupported(spec) is None
    kb = build.compile_launcher(fam.launcher(spec, cfg), fam.signature(spec, cfg), arch=fam.ARCH,
                                name=f"{fam.FAMILY}.{spec.key()}.{cfg.key()}", keep_ptx=True)
    assert kb.obj
    ptx = kb.ptx or ""
    assert "wgmma.mma_async" in ptx
    assert "cp.async.bulk.tensor" in ptx                       # TMA loads and stores
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx  # warp specialisation
    assert "shfl.sync" in ptx                                   # device-side group scan
    assert f"n{cfg.tile_n}k16" in ptx                           # the configured WGMMA tile
    assert "Sm90Gemm" in ptx                                    # the dense family's kernel
    assert ("multicast::cluster" in ptx) == (cfg.cluster_n > 1)  # A shared along a 1x2 cluster
    # a tail split counts each split tile's arrivals with an acquire-release atomic add
    assert ("atom.global.acq_rel.add" in ptx) == (cfg.tail_split > 1)


def test_launcher_is_the_shared_kernel(monkeypatch):
    """The grouped family is a scheduler mode of sm90_gemm's kernel, as sm100_grouped is of sm100_gemm's."""
    calls = []
    monkeypatch.setattr(sm90_gemm, "make_launcher", lambda *a: calls.append(a) or "launch")
    spec = GroupedSpec("ragged_m", "bfloat16", "bfloat16", "bfloat16", b_major="n")
    cfg = fam.Config(tile_n=128, raster=4, sms=100)
    assert fam.launcher(spec, cfg) == "launch"
    # with the dense kernel's epilogue for a 16-bit output: the whole share of 64-wide subtiles
    assert calls == [(spec, sm90_gemm.Config(128, 128, 1, 1, "m", 4, epi_n=64, whole_c=True), 100)]
    calls.clear()
    # a tail split keeps the unsplit walk's epilogue (it stores whole tiles)
    assert fam.launcher(spec, fam.Config(tile_n=256, tail_split=4)) == "launch"
    assert calls == [(spec, sm90_gemm.Config(128, 256, 1, 1, "m", 8, 4, epi_n=64, whole_c=True), 132)]
    monkeypatch.undo()
    for bad in (sm90_gemm.Config(128, 128, 1, 1, split_k=8), sm90_gemm.Config(128, 128, 1, 2, split_k=2),
                sm90_gemm.Config(128, 128, 2, 1), sm90_gemm.Config(64, 256, 1, 1, pingpong=True)):
        with pytest.raises(ValueError):   # grouped tiles: cooperative, one CTA to split the tail 2-4 ways
            sm90_gemm.make_launcher(spec, bad)
    # the tail split: 16-bit ragged_m without a pre-activation output
    for other in (GroupedSpec("ragged_k", "bfloat16", "bfloat16", "bfloat16", a_major="m", b_major="n"),
                  GroupedSpec("ragged_m", "bfloat16", "bfloat16", "bfloat16", activation="silu", preact=True),
                  GroupedSpec("ragged_m", "float8_e4m3fn", "float8_e4m3fn", "bfloat16", a_block=1, b_block=128)):
        with pytest.raises(ValueError, match="tail split"):
            sm90_gemm.make_launcher(other, sm90_gemm.Config(128, 128, 1, 1, split_k=2))


def test_no_optimization_warnings():
    from cutlass.base_dsl.ast_helpers import DSLOptimizationWarning
    spec = GroupedSpec("ragged_k", "bfloat16", "bfloat16", "float32", a_major="m", b_major="n")
    cfg = fam.Config(tile_n=256)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):   # the DSL installs its warning filters when first used
            build.compile_launcher(fam.launcher(spec, cfg), fam.signature(spec, cfg), arch=fam.ARCH, name="warn_check")
            warnings.simplefilter("always")
    assert not [w for w in seen if issubclass(w.category, DSLOptimizationWarning)]
