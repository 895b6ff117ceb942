"""Compile-only checks of the block-scaled fp8 Hopper GEMM (sm90_gemm with GemmSpec.a_block /
b_block, and sm90_grouped's ragged_m and ragged_k with GroupedSpec's; kernels/sm90_scaled.py): no
GPU needed, a few seconds a kernel on two cores. The README's test line compiles one case of each
kind; the other specs and configs are sweeps, run in CI's second step."""

import dataclasses
import glob
import os
import re
import shutil
import subprocess
import tempfile

import pytest
import shared_result  # tests/ is on sys.path under pytest

from jax_cute import arch, cache
from jax_cute.kernels import cubin_info, sass, sm90_config, sm90_gemm, sm90_grouped
from jax_cute.kernels.abi import Dyn
from jax_cute.kernels.gemm_spec import GemmSpec, GroupedSpec

BF, F16, F32 = "bfloat16", "float16", "float32"
E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"
# DeepGEMM's dense table and odd sizes (M, N, K)
SHAPES = [(4096, 7168, 16384), (4096, 4096, 7168), (128, 7168, 16384), (1000, 1040, 1000), (1, 1, 1),
          (129, 2000, 4100)]


def scaled(a_block: int, b_block: int, c: str = BF, a: str = E4M3, b: str = E4M3, **fused) -> GemmSpec:
    return GemmSpec(a, b, c, a_block=a_block, b_block=b_block, **fused)


def _line(cases, *keep: int) -> list:
    """``cases`` as pytest params: those at the indices ``keep`` in the README's test line, the
    others sweeps (CI's second step compiles them)."""
    return [c if i in keep else pytest.param(c, marks=pytest.mark.sweep) for i, c in enumerate(cases)]


def _compile(spec: GemmSpec | GroupedSpec, cfg, family=sm90_gemm):
    """Compile and check the PTX and resources."""
    pytest.importorskip("cutlass")
    binary = shared_result.compiled(family, spec, cfg, f"test_{spec.key()}_{cfg.key()}")
    ptx = binary.ptx or ""
    assert binary.obj, "empty object"
    kinds = {E4M3: "e4m3", E5M2: "e5m2"}
    # fp8 WGMMA of the spec's operand types, k32 per instruction: four per 128-K tile
    wgmma = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.{kinds[spec.a_dtype]}"
                       rf"\.{kinds[spec.b_dtype]}", ptx)
    overlap = getattr(cfg, "overlap_promote", False)
    waves = getattr(cfg, "tile_m", 128) == 256   # two 64-row blocks a warpgroup, one partial fragment
    # overlapped: eight issue sites (the first k-tile, a run of sm90_scaled.PROMOTE_UNROLL, a
    # pair, an odd count's last); waves: each block's four; serial: three with 1-row A blocks (its
    # loop unrolled by two, and an odd count's last), else one
    serial = 12 if spec.a_block == 1 else 4
    assert len(wgmma) == (32 if overlap else 8 if waves else serial), len(wgmma)
    # the promotion: one f32 FMA per accumulator (64 per thread of a 128 x 128 tile, 128 of a
    # 256 x 128 one), after waiting for the k-tile's WGMMAs: all of them, or (overlapped) all but
    # the next k-tile's
    assert ptx.count("fma.rn.f32") >= (128 if waves else 64) and "wgmma.wait_group.sync.aligned \t0" in ptx
    assert ("wgmma.wait_group.sync.aligned \t1" in ptx) == overlap
    assert "cp.async.bulk.tensor" in ptx and "setmaxnreg.inc" in ptx
    _check_scale_loads(spec, cfg, ptx)
    res = cubin_info.resources(binary.obj)
    # no spills (overlapped, waves: no more than today's, see _OVERLAP_FRAME), none inside the k-loop
    late = overlap and spec.b_block == 1 and family is sm90_gemm
    frame = _LATE_FRAME if late else _OVERLAP_FRAME if overlap else _WAVE_FRAME if waves else 0
    assert res["local_bytes"] == 0 and res["frame_bytes"] <= frame, res
    _check_k_loop_spills(binary.obj, _K_LOOP_RELOADS.get((spec, overlap), 0))
    if overlap or waves:
        _check_not_serialized(ptx)
    _check_yield_pass(family, spec, cfg, binary.obj)
    return binary


def _check_yield_pass(family, spec, cfg, obj: bytes) -> None:
    """The dense weight gradient's objects (per-column B scales, the serial promotion) take the
    yield pass (kernels/sass.py) and it finds promotion FFMAs to edit, none left once applied;
    the overlapped promotion and the grouped family keep ptxas' marks."""
    finish = cache.object_pass(family, spec, cfg)
    assert (finish is not None) == (family is sm90_gemm and spec.b_block == 1 and not cfg.overlap_promote)
    if finish is not None:
        assert sass.promotion_edits(obj) and not sass.promotion_edits(finish(obj))


def _check_scale_loads(spec, cfg, ptx: str) -> None:
    """Both operands' scales come by TMA with their k-tile's A and B tiles and are read from
    shared memory (a 128 x 128 block's scale read from global memory by each thread left its
    latency exposed): an operand with 1-row scale blocks in a box of the tile's rows (never a
    16-byte one), one with 128-row blocks in a 16-byte box of 4 row blocks. No scale is read from
    global memory in the mainloop. Every stage barrier expects the A and B tiles' bytes (multicast
    or not, each lands whole in every CTA) plus this CTA's own scale boxes, and a stage takes four
    TMA loads."""
    tile_m, tile_n = getattr(cfg, "tile_m", 128), cfg.tile_n
    slack = sm90_config.scale_slack(spec)   # ragged_m: A's box starts 16-byte aligned, 4 rows longer
    boxes = [rows + extra if block == 1 else 4
             for rows, block, extra in ((tile_m, spec.a_block, slack), (tile_n, spec.b_block, 0))]
    assert boxes == [sm90_config.scale_box(tile_m, spec.a_block, slack), sm90_config.scale_box(tile_n, spec.b_block)]
    tx = (tile_m + tile_n) * 128 + 4 * sum(boxes)
    regs = re.findall(r"mbarrier\.arrive\.expect_tx\.\S+\s+\S+\s+\[[^]]+\],\s*(%r\d+);", ptx)
    assert regs, "no stage barrier expects bytes"
    for r in set(regs):
        assert re.search(rf"mov\.b32\s+{r}, {tx};", ptx), (r, tx)
    loads = re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::\w+\.global", ptx)
    assert len(loads) == 4 * len(regs), (len(loads), len(regs))
    main = [b for b in re.split(r"^\$L__BB\d+_\d+:", ptx, flags=re.M) if "wgmma." in b]   # basic blocks
    assert any("ld.shared.b32" in b or "ld.shared.v2.b32" in b or "ld.shared.f32" in b for b in main)
    assert not any(re.search(r"ld\.global(\.nc)?\.(f32|b32)", b) for b in main)
    _check_scale_box_starts(ptx, 2)


def _multiple_of_4(ptx: str, reg: str, depth: int = 12) -> bool:
    """Whether every PTX definition of ``reg`` makes a multiple of 4: a shift by 2 or more, a mask of
    the two low bits, a product by a multiple of 4, a constant one, or sums and differences of such
    (followed through ``depth`` definitions)."""
    defs = re.findall(rf"^\s*(\w+(?:\.\w+)*)\s+{re.escape(reg)}, ([^;]*);", ptx, flags=re.M)
    if not defs or depth == 0:
        return False

    def ok(x: str) -> bool:
        x = x.strip()
        if re.fullmatch(r"-?\d+", x):
            return int(x) % 4 == 0
        return x.startswith("%r") and _multiple_of_4(ptx, x, depth - 1)

    for op, args in defs:
        xs = [x.strip() for x in args.split(",")]
        kind = op.split(".")[0]
        if kind == "shl" and re.fullmatch(r"\d+", xs[1]) and int(xs[1]) >= 2:
            continue
        if kind == "and" and any(re.fullmatch(r"-\d+", x) and int(x) % 4 == 0 for x in xs):
            continue
        if kind == "mul" and any(ok(x) for x in xs):
            continue
        if kind == "mad" and any(ok(x) for x in xs[:2]) and ok(xs[2]):
            continue
        if kind in ("add", "sub") and all(ok(x) for x in xs):
            continue
        if kind == "mov" and ok(xs[0]):
            continue
        return False
    return True


def _check_scale_box_starts(ptx: str, boxes: int) -> None:
    """Every scale box starts 16-byte aligned along the scales' contiguous mode (its first
    coordinate a multiple of 4 rows): an unaligned TMA box start there is an illegal instruction
    on sm_90 (ragged_m's A scales at group rows such as 77 crashed an H100). The scale buffers are
    the shared-memory struct's last fields: the loads with the ``boxes`` largest destination offsets."""
    loads = re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::\w+\.global\S*\s+\[%r\d+\+(\d+)\],"
                       r"\s*\[%rd\d+, \{(%r\d+),", ptx)
    offsets = sorted({int(o) for o, _ in loads})
    assert len(offsets) == 2 + boxes, offsets
    starts = {r for o, r in loads if int(o) in offsets[2:]}
    assert len(starts) >= boxes
    for r in starts:
        assert _multiple_of_4(ptx, r), f"scale box row coordinate {r} may be unaligned"


def _nvdisasm() -> str | None:
    return shutil.which("nvdisasm") or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/nvdisasm"))), None)


def _check_k_loop_spills(obj: bytes, allowed: int) -> None:
    """Where a CUDA toolkit's nvdisasm is installed: at most ``allowed`` local-memory accesses in
    the mainloop, the SASS blocks (between branch targets) holding WGMMA instructions."""
    tool = _nvdisasm()
    if tool is None:
        return
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.cubin")
        with open(src, "wb") as f:
            f.write(obj[cubin_info.cubin_offsets(obj)[0]:])
        sass = subprocess.run([tool, "-c", src], capture_output=True, text=True, check=True).stdout
    main = [b for b in re.split(r"^\.L_x_\d+:", sass, flags=re.M) if "GMMA" in b or "WARPGROUP." in b]
    assert main, "no WGMMA in the SASS"
    spills = [line.strip() for b in main for line in b.splitlines() if re.search(r"\b(LDL|STL)\b", line)]
    assert len(spills) <= allowed, spills


_CASES = [scaled(1, 128), scaled(128, 128), scaled(1, 1, F32), scaled(128, 1, F32),
          scaled(1, 128, BF, bias=True, activation="gelu"), scaled(128, 128, F32, bias=True, activation="silu"),
          scaled(1, 128, F16, E5M2, E5M2), scaled(1, 128, BF, E4M3, E5M2), scaled(1, 1, BF, E5M2, E4M3, bias=True,
                                                                                 activation="relu"),
          # swiglu: per-column B scales, paired like B's columns (a tile's halves are in two blocks)
          scaled(1, 1, BF, bias=True, activation="swiglu"),
          # swiglu: B scales per 64 paired columns (two a tile: its gate and up halves' blocks)
          scaled(1, 64, BF, bias=True, activation="swiglu")]


# (the test line: DeepGEMM's blocks, the weight gradient's (the serial promotion, its yield
# pass), 128 x 128 blocks with a fused epilogue and an fp32 output, swiglu with paired 64-column
# B scales)
@pytest.mark.parametrize("spec", _line(_CASES, 0, 2, 5, 10), ids=lambda s: s.key())
def test_compile_scaled(spec):
    cfg = sm90_gemm.heuristic(spec, 1000, 1024 if spec.activation == "swiglu" else 1040, 1000, 1)
    _compile(spec, cfg)


@pytest.mark.parametrize("cfg", _line([sm90_gemm.Config(128, 128, 1, 2, split_k=2, epi_n=64),
                                       sm90_gemm.Config(128, 128, 1, 1, split_k=4),
                                       sm90_gemm.Config(128, 128, 2, 1, raster="n", group=16),
                                       sm90_gemm.Config(128, 128, 2, 1, pdl=True, epi_n=64, whole_c=True),
                                       sm90_gemm.Config(128, 128, 1, 2, split_k=4, overlap_promote=True),
                                       sm90_gemm.Config(128, 128, 2, 2, epi_n=64, whole_c=True, overlap_promote=True)],
                                      0, 3),
                         ids=lambda c: c.key())
def test_compile_scaled_configs(cfg):
    _compile(scaled(1, 128), cfg)


def test_scaled_heuristic_and_candidates():
    for spec in _CASES:
        cands = sm90_gemm.candidate_configs(spec)
        assert cands and all((c.tile_n, c.pingpong, c.defer) == (128, False, 0) for c in cands)
        # 256 x 128 (waves) for 1 x 128 A and 128 x 128 B scales only, never the heuristic's pick
        wave = {(c.cluster_m, c.cluster_n) for c in cands if c.tile_m == 256}
        assert wave == ({(2, 1), (1, 2)} if (spec.a_block, spec.b_block) == (1, 128) else set()), (spec, wave)
        for shape in SHAPES:
            if spec.activation == "swiglu" and shape[1] // 2 % sm90_gemm.GATED_COLUMNS:
                with pytest.raises(ValueError, match="N/2 a multiple of 64"):
                    sm90_gemm.heuristic(spec, *shape, 1)
                continue
            cfg = sm90_gemm.heuristic(spec, *shape, 1)
            assert cfg in cands and cfg.tile_m == 128, (spec, shape, cfg)
    # the overlapped promotion wherever B's scales are per 128-column block or 64 paired columns
    assert all(sm90_gemm.heuristic(spec, 4096, 4096, 4096, 1).overlap_promote == (spec.b_block in (64, 128))
               for spec in _CASES)
    # the weight gradient's (1 x 128 scales both) unsplit on one CTA; the other forms on clusters
    for spec in _CASES:
        cfg = sm90_gemm.heuristic(spec, 4096, 16384, 8192, 1)
        one_cta = (spec.a_block, spec.b_block) == (1, 1)
        assert cfg.split_k == 1 and (cfg.cluster_m * cfg.cluster_n == 1) == one_cta, (spec, cfg)
    # a single row of tiles shares A along N and splits K over idle SMs
    small = sm90_gemm.heuristic(scaled(1, 128), 128, 7168, 16384, 1)
    assert (small.cluster_m, small.cluster_n) == (1, 2) and small.split_k > 1


def test_scaled_stages_fit():
    """Each stage's scale buffers (128-byte aligned: a 128-float box per operand with 1-row
    blocks, a 4-float one with 128-row blocks) count in the shared-memory plan: the ring keeps
    what fits beside them."""
    for a_block, b_block in ((1, 128), (128, 128), (1, 1), (128, 1)):
        scale = sm90_config.scale_stage_bytes(128, 128, a_block, b_block)
        assert scale == (512 if a_block == 1 else 128) + (512 if b_block == 1 else 128)
        for c in (BF, F32):
            for cfg in sm90_gemm.candidate_configs(scaled(a_block, b_block, c)):
                scale = sm90_config.scale_stage_bytes(cfg.tile_m, 128, a_block, b_block)
                ab, epi = sm90_gemm.stage_plan(cfg.tile_n, c, 0, False, cfg.epi_n, cfg.tile_m, cfg.whole_c, False,
                                               scale)
                epi_bytes = 2 * epi * 64 * cfg.epi_n * sm90_config.ITEM[c]
                assert ab >= 3 and 1024 + ab * ((cfg.tile_m + 128) * 128 + scale) + epi_bytes <= sm90_gemm.SMEM_BYTES
    # 256 x 128 with 1 x 128 A scales: a 1 KB box a stage (256 rows) and B's 128 bytes, 3 stages
    # beside the epilogue ring
    assert sm90_config.scale_stage_bytes(256, 128, 1, 128) == 1152
    assert sm90_gemm.stage_plan(128, BF, 0, False, 64, 256, False, False, 1152) == (3, 2)
    # a 16-bit output's 128 x 128 tile, whole-share 64-column epilogue (32 KB): 6 stages (32 KB
    # each) unscaled and with 128 x 128 scales on both operands (256 bytes a stage); a 512-byte
    # buffer a stage (1 x 128 A scales, or per-column B scales) leaves 5
    wide = sm90_gemm.epilogue_for(scaled(1, 128), sm90_gemm.Config(128, 128))
    plan = lambda a, b: sm90_gemm.stage_plan(128, BF, 0, False, wide.epi_n, 128, wide.whole_c, False,  # noqa: E731
                                             sm90_config.scale_stage_bytes(128, 128, a, b))
    assert sm90_gemm.stage_plan(128, BF, 0, False, wide.epi_n, 128, wide.whole_c) == (6, 2)
    assert (plan(128, 128), plan(1, 128), plan(1, 1)) == ((6, 2), (5, 2), (5, 2))


def test_scale_boxes_start_aligned():
    """ragged_m tiles start at any group row (77, 377: fp8.grouped_linear with [0, 77, 300, 0, 523, 1]
    crashed an H100 with CUDA_ERROR_ILLEGAL_INSTRUCTION), and a TMA box must start 16-byte aligned
    along the float32 scales' contiguous mode: A's box starts at the row rounded down to 4 and holds
    the tile's 128 rows whatever their offset in it; dense and ragged_k tiles start at multiples of
    128 and keep 128-row boxes. A 128-row-block operand's box holds 4 blocks from the tile's block
    rounded down (its 16 bytes start aligned too)."""
    spec = _GROUPED[0]
    slack = sm90_config.scale_slack(spec)
    box = sm90_config.scale_box(128, 1, slack)
    assert box == 132 and box * 4 % 16 == 0 and box <= 256
    for row in list(range(0, 520)) + [2**20 + 3, 2**30 - 1]:
        start, shift = sm90_config.scale_origin(row)
        assert start % 4 == 0 and start + shift == row and 0 <= shift < 4 and shift + 128 <= box
    assert sm90_config.scale_pitch(128, 1, slack) * 4 % sm90_config.SCALE_ALIGN == 0
    assert sm90_config.scale_stage_bytes(128, 128, 1, 128, slack) == 640 + 128
    assert sm90_config.scale_stage_bytes(128, 128, 1, 1, slack) == 640 + 512
    assert sm90_config.scale_box(128, 128) == 4 == sm90_config.SCALE_BOX_ALIGN
    for other in (scaled(1, 128), scaled(1, 1), _GROUPED_K[0]):
        assert sm90_config.scale_slack(other) == 0


def test_scaled_spec_signature_and_refusals():
    spec = scaled(1, 128, bias=True, activation="gelu")
    assert spec.key().endswith(".scaled1x128") and spec.key() != dataclasses.replace(spec, b_block=1).key()
    cfg = sm90_gemm.heuristic(spec, 1000, 1040, 1000, 1)
    names = [a.name for a in sm90_gemm.signature(spec, cfg)]
    assert names == ["a", "b", "c", "sa", "sb", "bias", "stream"]
    sa = sm90_gemm.signature(spec, cfg)[3]
    # (row blocks, Kb, L), the row blocks padded to 4: TMA's 16-byte strides
    assert sa.dtype == F32 and sa.stride == (1, Dyn(4), Dyn(4)) and sa.shape[0] == Dyn(4) and sa.align == 16
    # unscaled signatures are unchanged
    assert [a.name for a in sm90_gemm.signature(GemmSpec(E4M3, E4M3, BF), cfg)] == ["a", "b", "c", "stream"]
    for bad in (GemmSpec(BF, BF, BF, a_block=1, b_block=128), scaled(1, 128, batch_modes=3),
                scaled(1, 128, BF, activation="swiglu"), scaled(1, 128, BF, activation="gelu", preact=True)):
        assert sm90_gemm.unsupported(bad), bad
    with pytest.raises(ValueError):
        GemmSpec(E4M3, E4M3, BF, a_block=1)          # both operands scaled, or neither
    with pytest.raises(ValueError):
        scaled(64, 128)
    # B scales per 64 paired columns: a gated product's only
    with pytest.raises(ValueError, match="gated"):
        scaled(1, 64, BF, activation="gelu")
    assert sm90_gemm.unsupported(scaled(1, 64, BF, activation="swiglu")) is None
    for bad_cfg in (sm90_gemm.Config(), sm90_gemm.Config(128, 128, 2, 1, pingpong=True),
                    sm90_gemm.Config(128, 128, defer=1), sm90_gemm.Config(256, 256),
                    sm90_gemm.Config(256, 128, overlap_promote=True), sm90_gemm.Config(256, 128, split_k=2)):
        with pytest.raises(ValueError):
            sm90_gemm.launcher(scaled(1, 128), bad_cfg)
    # the 256 x 128 tile: 1 x 128 A and 128 x 128 B scales only (DeepGEMM's forward and dgrad)
    for other in (scaled(128, 128), scaled(1, 1), scaled(128, 1)):
        with pytest.raises(ValueError, match="256 x 128"):
            sm90_gemm.launcher(other, sm90_gemm.Config(256, 128, epi_n=64))
    with pytest.raises(ValueError):   # the overlapped promotion is a block-scaled mainloop
        sm90_gemm.launcher(GemmSpec(BF, BF, BF), sm90_gemm.Config(overlap_promote=True))


_GROUPED = [GroupedSpec("ragged_m", E4M3, E4M3, BF, a_block=1, b_block=128),
            GroupedSpec("ragged_m", E4M3, E5M2, F32, a_block=1, b_block=1, bias=True, activation="gelu"),
            GroupedSpec("ragged_m", E4M3, E4M3, BF, a_block=1, b_block=1, bias=True, activation="swiglu"),
            GroupedSpec("ragged_m", E4M3, E4M3, BF, a_block=1, b_block=64, bias=True, activation="swiglu")]


@pytest.mark.parametrize("spec", _line(_GROUPED, 0, 3), ids=lambda s: s.key())
def test_compile_scaled_grouped(spec):
    """The heuristic's pick for DeepGEMM's grouped shape: 128 x 128 tiles on 1x2 clusters."""
    cfg = sm90_grouped.heuristic(spec, 32768, 4096, 7168, 4, 1)
    assert cfg.tile_n == 128 and cfg.cluster_n == 2 and cfg in sm90_grouped.candidate_configs(spec)
    names = [a.name for a in sm90_grouped.signature(spec, cfg)]
    assert names[:6] == ["a", "b", "c", "group_sizes", "sa", "sb"] and names[-1] == "stream"
    binary = _compile(spec, cfg, sm90_grouped)
    assert ".multicast::cluster" in binary.ptx


def test_scaled_grouped_refusals():
    ok = _GROUPED[0]
    assert sm90_grouped.unsupported(ok) is None
    for bad in (dataclasses.replace(ok, a_dtype=BF, b_dtype=BF), dataclasses.replace(ok, activation="swiglu"),
                dataclasses.replace(ok, b_major="n"), dataclasses.replace(ok, c_major="m")):
        assert sm90_grouped.unsupported(bad), bad
    with pytest.raises(ValueError):
        GroupedSpec("ragged_k", E4M3, E4M3, F32, a_block=1, b_block=128)   # ragged_k: B's scales per column
    with pytest.raises(ValueError):
        dataclasses.replace(ok, a_block=128)                              # A's scales are per row
    with pytest.raises(ValueError):
        sm90_grouped.launcher(ok, sm90_grouped.Config(tile_n=256))


# The grouped weight gradient (ragged_k): per-row A and per-column B scales, K-major operands whose
# groups start at multiples of 128 (GroupedSpec); a named variant (sm90_grouped.unverified), run-verified
_GROUPED_K = [GroupedSpec("ragged_k", E4M3, E4M3, F32, a_block=1, b_block=1),
              GroupedSpec("ragged_k", E5M2, E4M3, BF, a_block=1, b_block=1)]


@pytest.mark.parametrize("spec", _line(_GROUPED_K, 0), ids=lambda s: s.key())
def test_compile_scaled_ragged_k(spec):
    """The serial mainloop (32 column scales a thread), the grouped walk rounding group sizes up to
    128; no ragged TMA view (K-major loads at group offsets need none)."""
    for shape in ((7168, 4096, 32768, 8), (512, 2048, 1000, 3), (1, 1, 128, 1)):
        cfg = sm90_grouped.heuristic(spec, *shape, 1)
        cands = sm90_grouped.candidate_configs(spec)   # (the overlapped promotion: forced only)
        assert cfg in cands == [sm90_grouped.Config(tile_n=128), sm90_grouped.Config(tile_n=128, overlap_promote=True)]
        assert not cfg.overlap_promote
    names = [a.name for a in sm90_grouped.signature(spec, cfg)]
    assert names == ["a", "b", "c", "group_sizes", "sa", "sb", "stream"]
    assert sm90_grouped.unsupported(spec) is None and sm90_grouped.unverified(spec) == "scaled_ragged_k"
    _compile(spec, cfg, sm90_grouped)


def test_scaled_ragged_k_refusals_and_variant():
    ok = _GROUPED_K[0]
    for bad in (dataclasses.replace(ok, a_major="m", b_major="n"), dataclasses.replace(ok, lead=True),
                dataclasses.replace(ok, c_dtype="float8_e4m3fn")):
        assert sm90_grouped.unsupported(bad), bad
    # the variant is named (arch.UNVERIFIED_VARIANTS gates a named variant while it is listed);
    # the other Hopper kernels are not
    assert all(sm90_grouped.unverified(s) == "" for s in _GROUPED)
    assert sm90_grouped.unverified(GroupedSpec("ragged_k", BF, BF, BF, a_major="m", b_major="n")) == ""
    assert not arch.unverified("sm_90a", "scaled_ragged_k") and not arch.unverified("sm_90a")
    assert arch.unverified("sm_100a")


# The 256 x 128 tile (sm90_scaled.wave_mainloop): 128 accumulators and one 64-register partial
# fragment a consumer thread. Spill frame allowed: what the compile shows today (sm_90a: 24 bytes
# f32 out, 48 with bias + silu, 80-88 bf16 / f16, 136 bf16 with bias + gelu), all of it around
# the mainloop (_check_k_loop_spills: none inside).
_WAVE_FRAME = 136
_WAVE_CASES = [scaled(1, 128), scaled(1, 128, F32), scaled(1, 128, BF, bias=True, activation="gelu"),
               scaled(1, 128, F32, bias=True, activation="silu"), scaled(1, 128, F16, E4M3, E5M2)]


@pytest.mark.parametrize("spec", _line(_WAVE_CASES, 0), ids=lambda s: s.key())
def test_compile_scaled_256x128(spec):
    """DeepGEMM's per-wave promotion: fp8 WGMMAs of each 64-row block into one partial fragment,
    no spill in the k-loop, ptxas serializes no WGMMA; the A-scale box holds the tile's 256 rows."""
    cands = [c for c in sm90_gemm.candidate_configs(spec) if c.tile_m == 256]
    assert len(cands) == 2 and all(not c.overlap_promote and c.split_k == 1 for c in cands)
    _compile(spec, cands[0])


@pytest.mark.sweep   # (6 s of compile, the same mainloop as above on another cluster: CI's second step)
def test_compile_scaled_256x128_cluster_1x2():
    cfg = next(c for c in sm90_gemm.candidate_configs(scaled(1, 128)) if c.tile_m == 256 and c.cluster_n == 2)
    _compile(scaled(1, 128), cfg)


# The overlapped promotion (Config.overlap_promote): two partial fragments (64 + 2 x 64 fp32
# registers a consumer thread). Spill frame allowed: what the compile shows today (at most 128
# bytes), all of it around the mainloop but for the reloads below (see sm90_gemm.scaled_overlap).
_OVERLAP_FRAME = 128
# Local-memory accesses allowed in a k-loop (sm_90a SASS): with 128 x 128 scales on both operands
# the overlapped loop reloads one register in its unrolled run and one in its pair (an L1 hit a few
# k-tiles apart).
_K_LOOP_RELOADS = {(scaled(128, 128, F32, bias=True, activation="silu"), True): 2,
                   (scaled(128, 128), True): 2}


@pytest.mark.parametrize("spec", _line([scaled(1, 128), scaled(128, 128, F32, bias=True, activation="silu")], 0),
                         ids=lambda s: s.key())
def test_compile_scaled_overlap(spec):
    cfg = dataclasses.replace(sm90_gemm.heuristic(spec, 4096, 7168, 16384, 1), overlap_promote=True)
    assert cfg in sm90_gemm.candidate_configs(spec)
    _compile(spec, cfg)


# The overlapped promotion with per-column B scales (the weight gradient; sm90_scaled.late_columns):
# the column scales are read from the stage at the promotion. Spill frame allowed: what the
# compile shows today (sm_90a: 200 bytes dense bf16 out, 88 with f32 out and 128 x 128 A blocks,
# none ragged-K), all of it around the mainloop.
_LATE_FRAME = 200


@pytest.mark.parametrize("spec", _line([scaled(1, 1), scaled(128, 1, F32)], 0), ids=lambda s: s.key())
def test_compile_scaled_overlap_with_column_scales(spec):
    cfg = dataclasses.replace(sm90_gemm.heuristic(spec, 4096, 4096, 8192, 1), overlap_promote=True)
    assert cfg in sm90_gemm.candidate_configs(spec) and not sm90_gemm.scaled_overlap(spec)
    _compile(spec, cfg)


def test_compile_scaled_ragged_k_overlap():
    spec = _GROUPED_K[1]
    cfg = dataclasses.replace(sm90_grouped.heuristic(spec, 7168, 4096, 32768, 8, 1), overlap_promote=True)
    _compile(spec, cfg, sm90_grouped)


def test_compile_scaled_grouped_one_cta():
    """The overlapped mainloop on one CTA (no multicast): the pick where N has few, odd tiles."""
    spec = _GROUPED[0]
    cfg = sm90_grouped.heuristic(spec, 32768, 520, 7168, 4, 1)
    assert cfg.overlap_promote and cfg.cluster_n == 1 and cfg in sm90_grouped.candidate_configs(spec)
    binary = _compile(spec, cfg, sm90_grouped)
    assert ".multicast::cluster" not in binary.ptx


def test_scaled_grouped_clusters():
    """ragged_m on 1x2 clusters (A multicast to two n-tiles of one m-tile) where N's tile count is
    even or at least 9 and the grid divides into pairs; one CTA otherwise, and for 16-bit and
    ragged_k products."""
    spec = _GROUPED[0]
    picks = {n: sm90_grouped.heuristic(spec, 32768, n, 7168, 4, 1).cluster_n
             for n in (128, 256, 384, 520, 1040, 1152, 4096, 7168)}   # 520: 5 tiles, 1040: 9
    assert picks == {128: 1, 256: 2, 384: 1, 520: 1, 1040: 2, 1152: 2, 4096: 2, 7168: 2}
    assert sm90_grouped.heuristic(spec, 32768, 4096, 7168, 4, 1, num_sms=131).cluster_n == 1
    assert sm90_grouped.heuristic(_GROUPED_K[0], 4096, 4096, 7168, 4, 1).cluster_n == 1
    bf16 = GroupedSpec("ragged_m", BF, BF, BF)
    assert sm90_grouped.heuristic(bf16, 32768, 4096, 7168, 4, 1).cluster_n == 1
    cfg = sm90_grouped.heuristic(spec, 32768, 4096, 7168, 4, 1)
    with pytest.raises(ValueError):
        sm90_grouped.launcher(spec, dataclasses.replace(cfg, sms=131))
    with pytest.raises(ValueError):
        sm90_grouped.launcher(_GROUPED_K[0], dataclasses.replace(sm90_grouped.Config(tile_n=128), cluster_n=2))


def _check_not_serialized(ptx: str) -> None:
    """ptxas's own verdict on the overlapped mainloop, where a CUDA toolkit's ptxas is installed:
    it serializes every WGMMA of a kernel (warning C7514) when it cannot prove a fragment's WGMMAs
    done before the promotion reads it. (The DSL's bundled ptxas prints no warnings; a toolkit's
    may predate the DSL's PTX version, which is lowered here: the kernel uses no newer feature.)"""
    ptxas = shutil.which("ptxas") or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/ptxas"))), None)
    if ptxas is None:
        pytest.skip("no CUDA toolkit ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(re.sub(r"^\.version \d+\.\d+", ".version 8.6", ptx, flags=re.M))
        run = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
    if run.returncode:
        pytest.skip(f"this ptxas does not take the kernel: {run.stderr.strip()[:200]}")
    # (C7511: serialized for want of registers, as a copy of a partial fragment once caused)
    assert "C7514" not in run.stdout + run.stderr and "C7511" not in run.stdout + run.stderr, run.stdout + run.stderr
