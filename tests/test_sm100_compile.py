"""Compile-only checks of the Blackwell (sm_100a) families on a CPU machine.

Every config ``candidate_configs`` can return is compiled for sm_100a and its PTX is read for
the instructions the design depends on. Nothing here runs a kernel: these kernels have never
run on hardware (see docs/blackwell.md).
"""

import pytest
import shared_result  # tests/ is on sys.path under pytest

pytest.importorskip("cutlass")

from jax_cute.kernels import sm100_gemm, sm100_grouped  # noqa: E402
from jax_cute.kernels.gemm_spec import GemmSpec, GroupedSpec  # noqa: E402

COMMON = ("tcgen05.mma", "tcgen05.alloc", "tcgen05.dealloc", "tcgen05.ld", "tcgen05.commit",
          "tcgen05.relinquish_alloc_permit", "cp.async.bulk.tensor")


def _ptx(binary) -> str:
    return binary.ptx or ""


def _compile(family, spec, cfg):
    name = f"{family.FAMILY}_{spec.key()}_{cfg.key()}"
    binary = shared_result.compiled(family, spec, cfg, name)
    assert binary.obj[:4] == b"\x7fELF"
    return _ptx(binary)


def _check_ptx(ptx: str, cfg):
    assert ptx, "no PTX kept"
    for needle in COMMON:
        assert needle in ptx, needle
    assert "cp.async.bulk.tensor" in ptx and ".global.shared::cta" in ptx   # TMA store epilogue
    if cfg.two_cta:
        assert "tcgen05.mma.cta_group::2" in ptx and "tcgen05.alloc.cta_group::2" in ptx
        assert "tcgen05.dealloc.cta_group::2" in ptx
        assert "cta_group::1" not in ptx
    else:
        assert "cta_group::2" not in ptx and "tcgen05.mma.cta_group::1" in ptx
    if cfg.cluster_m * cfg.cluster_n > (2 if cfg.two_cta else 1):
        assert "multicast::cluster" in ptx   # TMA multicast across the cluster


# dtype / major combinations, cycled over the configs so each config compiles once
DENSE_SPECS = [
    GemmSpec("bfloat16", "bfloat16", "bfloat16"),
    GemmSpec("float16", "float16", "float32", a_major="m", b_major="n", c_major="m"),
    GemmSpec("bfloat16", "bfloat16", "float16", a_major="k", b_major="n", c_major="n"),
    GemmSpec("float16", "float16", "float16", a_major="m", b_major="k", c_major="m"),
    GemmSpec("bfloat16", "bfloat16", "float32", a_major="m", b_major="n", c_major="n"),
    GemmSpec("float16", "float16", "bfloat16", a_major="k", b_major="k", c_major="m"),
]
_DENSE_CFGS = sm100_gemm.candidate_configs(DENSE_SPECS[0])


@pytest.mark.parametrize("i", range(len(_DENSE_CFGS)), ids=[c.key() for c in _DENSE_CFGS])
def test_dense_compiles(i):
    spec = DENSE_SPECS[i % len(DENSE_SPECS)]
    cfg = sm100_gemm.candidate_configs(spec)[i]
    _check_ptx(_compile(sm100_gemm, spec, cfg), cfg)


# three batch modes (rank-5 operands), each candidate config once over dtypes and majors
B3_SPECS = [GemmSpec(i, i, o, *mj, batch_modes=3) for i, o, mj in (
    ("bfloat16", "bfloat16", "kkn"), ("float16", "float32", "knn"), ("bfloat16", "float16", "mkn"),
    ("float16", "bfloat16", "kkm"), ("float16", "float16", "kkn"), ("bfloat16", "float32", "knn"))]


@pytest.mark.parametrize("i", range(len(_DENSE_CFGS)), ids=[c.key() for c in _DENSE_CFGS])
def test_dense_three_batch_modes_compile(i):
    spec = B3_SPECS[i % len(B3_SPECS)]
    assert sm100_gemm.BATCH_MODES == (1, 3) and sm100_gemm.unsupported(spec) is None
    cfg = sm100_gemm.candidate_configs(spec)[i]
    ptx = _compile(sm100_gemm, spec, cfg)
    _check_ptx(ptx, cfg)
    assert "cp.async.bulk.tensor.5d" in ptx and "cp.async.bulk.tensor.3d" not in ptx   # (rows, cols, L0, L1, L2)


GROUPED_SPECS = {
    "ragged_m": [GroupedSpec("ragged_m", "bfloat16", "bfloat16", "bfloat16"),
                 GroupedSpec("ragged_m", "float16", "float16", "float32", a_major="m", b_major="n", c_major="m"),
                 GroupedSpec("ragged_m", "bfloat16", "bfloat16", "float16", b_major="n")],
    "ragged_k": [GroupedSpec("ragged_k", "bfloat16", "bfloat16", "float32", a_major="m", b_major="n"),
                 GroupedSpec("ragged_k", "float16", "float16", "bfloat16"),
                 GroupedSpec("ragged_k", "bfloat16", "bfloat16", "bfloat16", a_major="m", b_major="k", c_major="m")],
}
_GROUPED_CASES = [(mode, i) for mode, specs in GROUPED_SPECS.items()
                  for i in range(len(sm100_grouped.candidate_configs(specs[0])))]


@pytest.mark.parametrize("mode,i", _GROUPED_CASES,
                         ids=[f"{m}-{sm100_grouped.candidate_configs(GROUPED_SPECS[m][0])[i].key()}"
                              for m, i in _GROUPED_CASES])
def test_grouped_compiles(mode, i):
    specs = GROUPED_SPECS[mode]
    spec = specs[i % len(specs)]
    cfg = sm100_grouped.candidate_configs(spec)[i]
    ptx = _compile(sm100_grouped, spec, cfg)
    _check_ptx(ptx, cfg)
    if mode == "ragged_m":
        assert "st.global" in ptx   # row-predicated store of tiles that cross a group's end


# --- host-side contract (no compiling) ------------------------------------------------------------

def test_heuristics_return_candidates():
    shapes = [(1, 8, 8, 1), (256, 256, 64, 1), (4096, 4096, 4096, 1), (8192, 1024, 512, 4), (100, 5000, 72, 3)]
    for spec in DENSE_SPECS:
        cands = {dataclasses_key(c) for c in sm100_gemm.candidate_configs(spec)}
        for m, n, k, l in shapes:
            for sms in (148, 132, 20):
                assert dataclasses_key(sm100_gemm.heuristic(spec, m, n, k, l, num_sms=sms)) in cands
    for mode, specs in GROUPED_SPECS.items():
        cands = {dataclasses_key(c) for c in sm100_grouped.candidate_configs(specs[0])}
        for m, n, k, l in shapes:
            for g in (1, 8, 128):
                for sms in (148, 20):
                    assert dataclasses_key(sm100_grouped.heuristic(specs[0], m, n, k, g, l, num_sms=sms)) in cands


def test_three_batch_modes_take_the_same_configs():
    for three in B3_SPECS:
        one = GemmSpec(three.a_dtype, three.b_dtype, three.c_dtype, three.a_major, three.b_major, three.c_major)
        assert sm100_gemm.candidate_configs(three) == sm100_gemm.candidate_configs(one)
        for m, n, k, l in [(2048, 2048, 128, 8 * 16), (128, 256, 64, 3), (4096, 4096, 4096, 1)]:
            assert sm100_gemm.heuristic(three, m, n, k, l) == sm100_gemm.heuristic(one, m, n, k, l)


def dataclasses_key(cfg):
    return cfg.key()


def test_unsupported_and_contract():
    assert sm100_gemm.unsupported(GemmSpec("float32", "float32", "float32"))
    assert sm100_gemm.unsupported(GemmSpec("bfloat16", "float16", "float32"))
    assert sm100_gemm.candidate_configs(GemmSpec("float8_e4m3fn", "float8_e4m3fn", "bfloat16")) == []
    assert sm100_grouped.unsupported(GemmSpec("bfloat16", "bfloat16", "bfloat16"))
    for fam in (sm100_gemm, sm100_grouped):
        assert fam.ARCH == "sm_100a"
    for spec in DENSE_SPECS:
        assert sm100_gemm.workspace(spec, _DENSE_CFGS[0], 128, 128, 64, 1) == []
        assert sm100_gemm.signature(spec, _DENSE_CFGS[0]) == spec.signature()
    for specs in GROUPED_SPECS.values():
        assert not any(c.two_cta for c in sm100_grouped.candidate_configs(specs[0])) or specs[0].mode == "ragged_m"
    keys = [c.key() for c in _DENSE_CFGS]
    assert len(set(keys)) == len(keys)
