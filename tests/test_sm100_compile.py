"""Compile-only checks of the Blackwell (sm_100a) families on a CPU machine.

Every config ``candidate_configs`` can return is compiled for sm_100a and its PTX is read for
the instructions the design depends on, fused epilogues included (the bias load, the
activation's instructions, the output conversion), and a fused product lowered for sm_100a is
one kernel call. The README's test line compiles one case of each kind (a 1-CTA and a 2-CTA
config, each mode, one epilogue of each sort); the rest are sweeps, run in CI's second step.
Nothing here runs a kernel: these kernels have never run on hardware (see docs/blackwell.md).
"""

import re

import jax
import jax.numpy as jnp
import pytest
import shared_result  # tests/ is on sys.path under pytest

pytest.importorskip("cutlass")

import jax_cute  # noqa: E402
from jax_cute import config  # noqa: E402
from jax_cute.kernels import cubin_info, epilogue, sm100_gemm, sm100_grouped  # noqa: E402
from jax_cute.kernels.gemm_spec import GemmSpec, GroupedSpec  # noqa: E402

COMMON = ("tcgen05.mma", "tcgen05.alloc", "tcgen05.dealloc", "tcgen05.ld", "tcgen05.commit",
          "tcgen05.relinquish_alloc_permit", "cp.async.bulk.tensor")


def _cases(cases, test_line, ids) -> list:
    """``cases`` as pytest params: those at the indices ``test_line`` in the README's test line, the
    others sweeps."""
    return [pytest.param(*(c if isinstance(c, tuple) else (c,)), id=i,
                         marks=() if n in test_line else pytest.mark.sweep) for n, (c, i) in enumerate(zip(cases, ids))]


def _ptx(binary) -> str:
    return binary.ptx or ""


def _binary(family, spec, cfg):
    binary = shared_result.compiled(family, spec, cfg, f"{family.FAMILY}_{spec.key()}_{cfg.key()}")
    assert binary.obj[:4] == b"\x7fELF"
    return binary


def _compile(family, spec, cfg):
    return _ptx(_binary(family, spec, cfg))


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


# (the test line: a 1-CTA and a 2-CTA config)
_DENSE_CASES = _cases(range(len(_DENSE_CFGS)), (0, 3), [c.key() for c in _DENSE_CFGS])
assert [_DENSE_CFGS[i].two_cta for i in (0, 3)] == [False, True]


@pytest.mark.parametrize("i", _DENSE_CASES)
def test_dense_compiles(i):
    spec = DENSE_SPECS[i % len(DENSE_SPECS)]
    cfg = sm100_gemm.candidate_configs(spec)[i]
    _check_ptx(_compile(sm100_gemm, spec, cfg), cfg)


# three batch modes (rank-5 operands), each candidate config once over dtypes and majors
B3_SPECS = [GemmSpec(i, i, o, *mj, batch_modes=3) for i, o, mj in (
    ("bfloat16", "bfloat16", "kkn"), ("float16", "float32", "knn"), ("bfloat16", "float16", "mkn"),
    ("float16", "bfloat16", "kkm"), ("float16", "float16", "kkn"), ("bfloat16", "float32", "knn"))]


@pytest.mark.parametrize("i", _DENSE_CASES)
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


# (the test line: each mode's first config)
@pytest.mark.parametrize("mode,i", _cases(_GROUPED_CASES, [_GROUPED_CASES.index((m, 0)) for m in GROUPED_SPECS],
                                          [f"{m}-{sm100_grouped.candidate_configs(GROUPED_SPECS[m][0])[i].key()}"
                                           for m, i in _GROUPED_CASES]))
def test_grouped_compiles(mode, i):
    specs = GROUPED_SPECS[mode]
    spec = specs[i % len(specs)]
    cfg = sm100_grouped.candidate_configs(spec)[i]
    ptx = _compile(sm100_grouped, spec, cfg)
    _check_ptx(ptx, cfg)
    if mode == "ragged_m":
        assert "st.global" in ptx   # row-predicated store of tiles that cross a group's end


# --- fused epilogues ------------------------------------------------------------------------------

BF, F16, F32 = "bfloat16", "float16", "float32"
# (spec, candidate index): every activation, with and without the bias, with the pre-activation
# output and as a derivative, each output dtype, M-major C and three batch modes, spread over
# the configs (2-CTA ones included). The test line compiles the bias alone, gelu with the bias
# and the pre-activation output, silu's accurate form (a float32 output) and a derivative; the
# others are sweeps.
FUSED_CASES = [
    (GemmSpec(BF, BF, BF, bias=True), 0),
    (GemmSpec(F16, F16, F16, "m", "n", "m", bias=True, activation="relu"), 1),
    (GemmSpec(BF, BF, BF, bias=True, activation="gelu"), 2),
    (GemmSpec(BF, BF, F32, bias=True, activation="gelu_exact"), 3),
    (GemmSpec(BF, BF, BF, "k", "n", "n", bias=True, activation="silu"), 4),
    (GemmSpec(BF, BF, BF, "k", "k", "m", activation="relu2"), 5),
    (GemmSpec(F16, F16, F32, activation="silu"), 0),
    (GemmSpec(BF, BF, BF, bias=True, activation="gelu", batch_modes=3), 1),
    (GemmSpec(BF, BF, BF, bias=True, activation="gelu", preact=True), 2),
    (GemmSpec(F16, F16, F32, "m", "n", "m", activation="relu", preact=True), 3),
    (GemmSpec(BF, BF, BF, bias=True, activation="silu", preact=True, batch_modes=3), 0),
    (GemmSpec(BF, BF, BF, dact="gelu"), 4),
    (GemmSpec(F16, F16, F32, "m", "n", "m", dact="silu"), 5),
    (GemmSpec(BF, BF, BF, "k", "n", "n", dact="relu2"), 1),
    (GemmSpec(F16, F16, F16, dact="gelu_exact"), 0),
]
# what each piece of the epilogue leaves in the PTX (more of it than a plain kernel's has)
BIAS_LOAD = "ld.global.b32"
FAST_TANH = "tanh.approx.f32"   # gelu, and silu's tanh form, for 16-bit outputs
EX2 = "ex2.approx"              # the accurate forms (float32 outputs): exp through MUFU ex2
# relu's compare with zero: on the float32 accumulator, or (a derivative) on Z as read
RELU = re.compile(r"setp\.\w+\.(f32|bf16|f16)\s")
CONVERT = {BF: "cvt.rn.bf16x2.f32", F16: "cvt.rn.f16x2.f32"}
Z_LOAD = {BF: "ld.global.b16", F16: "ld.global.b16", F32: "ld.global.b32"}   # a dact epilogue's reads of Z


def _needles(spec: GemmSpec | GroupedSpec) -> list:
    fast = spec.c_dtype != F32
    act = {"relu": [RELU], "relu2": [RELU], "gelu": [FAST_TANH if fast else EX2],
           "gelu_exact": [EX2] if not fast else [], "silu": [FAST_TANH if fast else EX2], "": []}
    # the derivatives take exp(-|z|) (gelu, silu) or exp(-z^2/2) (gelu_exact) through ex2
    derivative = {"relu": [RELU], "relu2": [RELU], "gelu": [EX2], "gelu_exact": [EX2], "silu": [EX2], "": []}
    dact = getattr(spec, "dact", "")   # (a GroupedSpec has none)
    return [BIAS_LOAD] * spec.bias + act[spec.activation] + derivative[dact] + [Z_LOAD[spec.c_dtype]] * bool(dact)


def _count(ptx: str, needle) -> int:
    return len(needle.findall(ptx)) if isinstance(needle, re.Pattern) else ptx.count(needle)


def _check_fused(family, spec, cfg, plain: str) -> str:
    """``spec``'s kernel compiled, its PTX holding every piece of its epilogue (more of each than
    ``plain``, a plain kernel's PTX, has) and its cubin no register spills; returns the PTX."""
    binary = _binary(family, spec, cfg)
    ptx = _ptx(binary)
    _check_ptx(ptx, cfg)
    for needle in _needles(spec):
        assert _count(ptx, needle) > _count(plain, needle), needle
    if spec.c_dtype in CONVERT:   # the one rounding to the output dtype, two values at a time
        assert CONVERT[spec.c_dtype] in ptx
    # the pre-activation output D: a fourth TMA descriptor (a, b, c, d)
    assert ptx.count("prefetch.tensormap") == (4 if spec.preact else 3) == plain.count("prefetch.tensormap") + spec.preact
    res = cubin_info.resources(binary.obj)
    assert res["local_bytes"] == 0 and res["frame_bytes"] == 0, res   # no register spills
    return ptx


@pytest.mark.parametrize("spec,i", _cases(FUSED_CASES, (0, 6, 8, 11), [f"{s.key()}-{i}" for s, i in FUSED_CASES]))
def test_fused_epilogue_compiles(spec, i):
    assert sm100_gemm.unsupported(spec) is None
    cfg = sm100_gemm.candidate_configs(spec)[i]
    _check_fused(sm100_gemm, spec, cfg, _compile(sm100_gemm, DENSE_SPECS[0], _DENSE_CFGS[0]))


# ragged_m: the bias row of each tile's group; tiles crossing a group's end store D and C
# row-predicated (the test line: the first; the others are sweeps)
GROUPED_FUSED_CASES = [
    (GroupedSpec("ragged_m", BF, BF, BF, bias=True, activation="gelu"), 0),
    (GroupedSpec("ragged_m", BF, BF, BF, b_major="n", bias=True, activation="silu", preact=True), 2),
    (GroupedSpec("ragged_m", F16, F16, F32, "m", "k", "m", activation="relu", preact=True), 1),
    (GroupedSpec("ragged_m", BF, BF, F16, bias=True), 0),
]


@pytest.mark.parametrize("spec,i", _cases(GROUPED_FUSED_CASES, (0,), [f"{s.key()}-{i}" for s, i in GROUPED_FUSED_CASES]))
def test_grouped_fused_epilogue_compiles(spec, i):
    assert sm100_grouped.unsupported(spec) is None
    cfg = sm100_grouped.candidate_configs(spec)[i]
    plain = _compile(sm100_grouped, GROUPED_SPECS["ragged_m"][0], sm100_grouped.candidate_configs(spec)[0])
    ptx = _check_fused(sm100_grouped, spec, cfg, plain)
    assert "st.global" in ptx   # the row-predicated stores


def _arg_names(spec) -> list[str]:
    return [a.name for a in sm100_gemm.signature(spec, _DENSE_CFGS[0]) if hasattr(a, "dtype")]


def test_fused_epilogue_contract():
    assert set(sm100_gemm.EPILOGUES) == {"bias", *epilogue.ACTIVATIONS, "preact", "dact"}
    assert set(sm100_grouped.EPILOGUES) == {"bias", *epilogue.ACTIVATIONS, "preact"}
    spec = GemmSpec(BF, BF, BF, bias=True, activation="gelu")
    assert _arg_names(spec) == ["a", "b", "c", "bias"]
    assert _arg_names(GemmSpec(BF, BF, BF, bias=True, activation="gelu", preact=True)) == ["a", "b", "c", "bias", "d"]
    assert _arg_names(GemmSpec(BF, BF, BF, dact="gelu")) == ["a", "b", "c", "z"]
    assert sm100_gemm.candidate_configs(spec) == _DENSE_CFGS
    refused = {GemmSpec(BF, BF, BF, bias=True, activation="swiglu"): "gated",
               GemmSpec(BF, BF, BF, activation="geglu"): "no fused epilogue for activation",
               GemmSpec(BF, BF, BF, dact="swiglu"): "derivative of 'swiglu'",
               GemmSpec(BF, BF, BF, dact="gelu", batch_modes=3): "one batch mode",
               GroupedSpec("ragged_m", BF, BF, BF, bias=True, activation="swiglu"): "gated"}
    for s, why in refused.items():
        fam = sm100_grouped if isinstance(s, GroupedSpec) else sm100_gemm
        assert why in fam.unsupported(s) and fam.candidate_configs(s) == []


def test_fused_product_lowers_to_one_kernel_for_sm100():
    """Strict mode: a fused matmul lowered for sm_100a on a CPU machine is one call of the
    Blackwell kernel with the epilogue inside (no XLA fallback, no XLA epilogue)."""
    f = lambda x, w, b: jax_cute.matmul(x, w, bias=b, activation="gelu")  # noqa: E731
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((256, 128), (128, 256), (256,))]
    with config.override(target_arch="sm_100a", unverified_kernels=True, strict=True):
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @jax_cute_launch") == 1 and "arch_major = 10" in text
    assert "sm100_gemm" in text and ".bias.gelu." in text
    assert "dot_general" not in text and "tanh" not in text and "erf" not in text


@pytest.mark.sweep   # (13 s: CI's second step, so the README's test line stays under 10 minutes)
def test_fused_grouped_product_lowers_to_one_kernel_for_sm100():
    """The same for ragged_dot with a bias per group, and under grad: the forward stores the
    pre-activation, then the two gradient GEMMs (ragged_k, ragged_m)."""
    f = lambda x, w, gs, b: jax_cute.ragged_dot(x, w, gs, bias=b, activation="gelu")  # noqa: E731
    args = [jax.ShapeDtypeStruct((512, 128), jnp.bfloat16), jax.ShapeDtypeStruct((4, 128, 256), jnp.bfloat16),
            jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((4, 256), jnp.bfloat16)]
    loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32))  # noqa: E731
    with config.override(target_arch="sm_100a", unverified_kernels=True, strict=True):
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 3))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    names = re.findall(r'name = "(sm100_grouped[^"]*)"', text)
    assert len(names) == text.count("stablehlo.custom_call @jax_cute_launch") == 1
    assert names[0].startswith("sm100_grouped.ragged_m.") and ".bias.gelu." in names[0] and "tanh" not in text
    names = re.findall(r'name = "(sm100_grouped[^"]*)"', grad)
    assert len(names) == grad.count("stablehlo.custom_call @jax_cute_launch") == 3
    assert ".bias.gelu.preact." in names[0] and "dot_general" not in grad


def test_mlp_gradient_lowers_to_kernels_for_sm100():
    """The gradient of a kernelized two-layer MLP lowered for sm_100a: the forward GEMM stores the
    pre-activation too, the backward GEMM of the activated operand scales by the derivative in
    its epilogue, and nothing of the product or the activation is left to XLA."""
    def mlp(x, w1, b1, w2):
        h = jax.nn.gelu(jnp.matmul(x, w1, preferred_element_type=jnp.float32) + b1).astype(jnp.bfloat16)
        return jnp.sum(jnp.sin(h @ w2).astype(jnp.float32))

    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((256, 128), (128, 256), (256,), (256, 128))]
    grad = jax.jit(jax.grad(jax_cute.kernelize(mlp), argnums=(0, 1, 2, 3)))
    with config.override(target_arch="sm_100a", unverified_kernels=True, strict=True):
        text = grad.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    names = re.findall(r'name = "(sm100_gemm[^"]*)"', text)
    assert len(names) == text.count("stablehlo.custom_call @jax_cute_launch") == 6
    assert sum(".bias.gelu.preact." in n for n in names) == 1 and sum(".dact-gelu." in n for n in names) == 1
    assert "dot_general" not in text and "tanh" not in text and "erf" not in text


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
