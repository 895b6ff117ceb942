"""Hopper (sm_90a) GEMM: C[m, n, l] = sum_k A[m, k, l] * B[n, k, l] (see gemm_spec.GemmSpec), and
the grouped GEMMs of gemm_spec.GroupedSpec (family sm90_grouped) as modes of its tile scheduler.

Kernel shape (one persistent CTA per SM, 384 threads):
- warpgroup 0 is the producer: its first warp walks the tile sequence and issues TMA loads of
  A and B k-slices into a ring of shared-memory stages (multicast to the other CTAs of a 2x1,
  1x2 or 2x2 cluster, which share the same B or A slice); it then keeps only 40 registers
  (setmaxnreg).
- warpgroups 1 and 2 are the consumers (232 registers each). Cooperative (128 x 128..256 and
  256 x 128 tiles): each owns half the rows of every tile (64, or two 64-row blocks of a
  256-row tile, interleaved: warpgroup 1 rows 0-63 and 128-191), runs WGMMA from shared memory
  into fp32 accumulators and releases stages back to the producer(s). Pingpong (Config.pingpong, 64- or
  128-row tiles): each warpgroup owns alternate whole tiles; their mainloops take turns
  (named-barrier tokens) so one warpgroup's epilogue runs under the other's mainloop.
- epilogue: each consumer warpgroup stores its own 64-row blocks (its own named barrier,
  shared-memory ring of 64 x epi_n subtiles and store warp) with TMA, clipped at the tensor edge, so the two
  never wait on each other between mainloops.
- fused epilogue (GemmSpec.bias / activation, EPILOGUES): after a subtile's accumulators are
  copied out, each element adds the float32 bias of its output column (read from global memory,
  L1-cached; the column from an identity tensor partitioned like the accumulators) and the
  activation (kernels/epilogue.py) runs on the fragment, before the one rounding to C's dtype.
- pre-activation output (GemmSpec.preact, unsplit tiles): the epilogue runs two passes over the
  warpgroup's subtiles, first A·B + bias rounded to D's dtype (the residual of a differentiated
  forward), then the activation of the same float32 values rounded to C's dtype. With the whole
  share (no bias: see epilogue_for) the second pass refills the slots once the first pass's
  stores have read them.
- dact epilogue (GemmSpec.dact, unsplit tiles, one batch mode): the backward of an activation
  fused into its gradient GEMM, C = act'(Z) * A·B, scaled in float32 before the one rounding.
  Each thread reads Z (laid out like C) from global memory at its accumulators' coordinates, a
  subtile's loads all issued before its derivative so their latencies overlap. Tiles on Z's edge
  clamp the coordinates (elements past the edge are never stored) and take half a subtile at a
  time: with all its loads in flight next to the accumulators, registers spilled.
- gated activation (GemmSpec.activation "swiglu": B's N holds [gate | up] halves, C has N/2
  columns): B's N mode is read as (tile_n / 2, 2, N / tile_n) with strides (1, N/2, tile_n / 2)
  in its N stride, so the TMA loads of one tile bring tile_n / 2 gate columns and the up columns
  that pair with them, and each accumulator fragment holds both (the WGMMA layout repeats every 8
  columns, so column j and j + tile_n / 2 sit in the same thread). The C pass pairs each gate
  subtile with the up subtile half a row block to its right and writes a tile_n / 2 wide tile.
  The bias is paired like B; the pre-activation output D keeps the [gate | up] order, each row
  block's halves stored to their own tile_n / 2 wide tiles of D. N / 2 must be a multiple of
  tile_n / 2 (GATED_COLUMNS for the narrowest tile), and B takes one batch mode: its paired N
  spends three of the five dimensions of a TMA tensor (grouped: B's batch mode is dropped).
- block-scaled fp8 (GemmSpec.a_block / b_block, docs/fp8.md): one k-tile is one 128-K scale
  block. The producer loads each k-tile's scales of both operands with TMA into the stage beside
  its A and B tiles, on the same barrier (each CTA its own boxes; the stage's bytes count them,
  so the ring may hold a stage fewer): the tile's rows' for 1-row blocks, a 16-byte box holding
  the tile's one block for 128-row blocks. Each consumer warpgroup issues a k-tile's WGMMAs
  into a fresh fp32 fragment, reads the scales of its own rows and columns (the accumulator
  layout's coordinates, from a partitioned identity tensor) into registers, waits for the
  WGMMAs, hands the stage back and adds the fragment
  times sa[row] * sb[column] to its accumulators (two-level accumulation). The overlapped mainloop
  (Config.overlap_promote, the heuristic's with 128-column B scales) keeps a second partial
  fragment so that a warpgroup's next k-tile's WGMMAs run under its promotion; the serial one
  relies on the other warpgroup's WGMMAs for that. Two or three fp32 fragments per thread:
  128 x 128 cooperative tiles (sm90_scaled). 256 x 128 tiles (1 x 128 A and 128 x 128 B scales,
  forced configs only) promote each warpgroup's two 64-row blocks in turn through one partial
  fragment (DeepGEMM's waves: 128 accumulators + 64 partial registers a thread). A gated
  activation's tile pairs gate and up halves from different 128-column blocks: it reads B's
  scales per column (b_block 1), paired like B's N mode (serial mainloop), or per 64 paired
  columns (gemm_spec.PAIRED_BLOCK: two a k-tile, given in the paired order; overlapped).
- TMA stores write whole 16-byte chunks, so where C's contiguous extent is not a multiple of 16
  bytes the subtiles on that edge are stored with predicated per-element stores instead.
- work is a linear sequence of (cluster tile, batch, k-split) units in a grouped ("swizzled")
  raster order; every CTA strides through it by the number of resident clusters.
- three batch modes (GemmSpec.batch_modes=3): the launcher groups each rank-5 operand's batch
  modes into one nested mode (its TMA tensor map keeps five dimensions). Units still walk a
  linear batch l; where a tile is addressed, l is split over C's batch extents and each input's
  coordinate clamped per mode (0 where it is broadcast). Split-K counters keep the linear l.
- split-K (Config.split_k = S > 1): each unit covers 1/S of the k-tiles, writes its fp32
  partial tile to a workspace and bumps a per-tile counter; the CTA that arrives last sums the
  S partials in split order (deterministic) and runs the epilogue, then resets the counter.
- whole-share epilogue (Config.whole_c, the heuristic's pick for 16-bit outputs): each
  warpgroup's ring has a slot for every subtile of its share of the tile (64 KB for 128 x 256
  in bf16, leaving 3 A/B stages instead of 4). Its stores are issued as each subtile is written
  and only waited for before the next tile's epilogue refills the ring, so the epilogue costs
  the conversion and shared-memory writes (~1.4k cycles per tile) instead of a chain of store
  round trips (~2.6k).
- deferred epilogue (Config.defer = d > 0, cooperative, unsplit, 16-bit C; the heuristic's for
  an unaligned C, else autotune only): a
  warpgroup converts its finished accumulators to the output dtype in registers, issues the
  first d k-tiles of its next tile's WGMMAs, and only then stores the previous tile (the
  cooperative tile's 128 accumulator registers leave room for the 64 of a 16-bit copy, not for
  a second fp32 set). Per-tile SM clock stamps on an H200 show that
  issuing WGMMAs stalls once about two are queued, so most of the d k-tiles run while they are
  being issued; the stores then hide under only ~0.5k cycles of tensor work.
- programmatic dependent launch (Config.pdl, off by default): the grid is launched so that its
  CTAs may start while the previous kernel on the stream drains. Each CTA initialises its
  barriers and prefetches its TMA descriptors, then waits (griddepcontrol.wait) for that kernel
  to complete before any global read or write, and releases the next grid at once
  (griddepcontrol.launch_dependents). Inside XLA's CUDA graphs our call is a child graph, where
  PDL cannot act, so only stream launches (jax_cute.config command_buffer off) use it.

Grouped scheduling (GroupedSpec ragged_m / ragged_k; cooperative 128-row tiles on one CTA):
- one CTA per SM walks a linear tile index over (batch, group, tile), start blockIdx, step the
  grid size. Every warp that needs the schedule (the TMA warp and each MMA warp) maps its index
  to a tile itself with a warp-wide prefix scan of the group sizes, 32 groups at a time, keeping
  the current chunk's scan in registers: nothing is precomputed, no workspace is needed, and
  replays with new sizes are exact (CUDA-graph safe).
- tail split (ragged_m, 16-bit, Config.split_k = S > 1, sm90_grouped.Config.tail_split): the
  tiles fill whole rounds of the grid but a last, partial one, whose tiles stay on as many SMs
  and leave the rest idle. Each warp first scans every group size for the tile count; where the
  last round fills at most half the grid, its tiles are cut along K into up to S units of at
  least TAIL_MIN_K_TILES k-tiles, published and folded as split-K's (a workspace of one fp32 tile
  a CTA, counters reset by the last arrival).
- ragged_m tiles start at their group's first row, so a tile never mixes groups; rows past the
  last group are a pseudo-group with no K loop whose tiles store zeros. ragged_k tiles are
  (group, m-tile, n-tile) with the K loop over the group's rows; empty groups store zeros.
- group ends need no tile alignment thanks to the "ragged TMA" descriptor trick (also used by
  Triton and quack): the ragged mode is given extent 2**30 and two extra modes whose strides
  (2**34 - s, s) cancel modulo 2**64, so a tile at (offset, length) is addressed at coordinate
  2**30 - length in the ragged mode. TMA's own bounds check then zero-fills loads and drops
  stores past the group end, with one descriptor built on the host for the whole launch.

This module holds what routing needs (configs, heuristic, signature, workspace) and imports no
DSL: the kernel itself is in sm90_kernel (with its parts in sm90_mainloop, sm90_schedulers and
sm90_epilogue), imported only when a launcher is built.
"""

import dataclasses
from typing import Callable

from jax_cute.kernels import abi, sass
from jax_cute.kernels import epilogue as fused_epilogue
from jax_cute.kernels.gemm_spec import PAIRED_BLOCK, SCALE_K, GemmSpec, GroupedSpec, Workspace
# (Config, SMEM_BYTES and tile_k are part of the family's interface: tests and tools read them here)
from jax_cute.kernels.sm90_config import (ITEM, NUM_SMS, SMEM_BYTES, Config, co_resident_clusters, is_gated,
                                          scale_slack, scale_stage_bytes, stage_plan, tile_k, wg_rows)

__all__ = ["FAMILY", "ARCH", "BATCH_MODES", "EPILOGUES", "GATED_COLUMNS", "SPLITS_K", "NUM_SMS", "SMEM_BYTES", "Config",
           "unsupported", "candidate_configs", "heuristic", "signature", "workspace", "workspace_args", "launcher",
           "make_launcher", "epilogue_for", "tile_k", "tiles_per_cta", "stage_plan", "DEFER"]

FAMILY = "sm90_gemm"
ARCH = "sm_90a"
BATCH_MODES = (1, 3)    # dense GemmSpec.batch_modes taken (grouped specs: one)
SPLITS_K = True         # heuristic takes split_k (the dispatch passes a requested one)
# fused epilogues (GemmSpec.bias, GemmSpec.activation; dense specs): C = act(A·B + bias[n]) in
# float32 on each register fragment before the one rounding (kernels/epilogue.py); "dact":
# GemmSpec.dact, an activation's derivative at an input z scaling the product
EPILOGUES = ("bias", *fused_epilogue.ACTIVATIONS, *fused_epilogue.GATED, "preact", "dact")
# a gated activation pairs gate and up columns inside one tile of tile_n / 2 of each, so N / 2
# must be a multiple of the narrowest pairing (see the module notes)
GATED_COLUMNS = 64

_FP8 = ("float8_e4m3fn", "float8_e5m2")
_IN_DTYPES = ("bfloat16", "float16", *_FP8)
_OUT_DTYPES = ("bfloat16", "float16", "float32")


# --- static configuration -----------------------------------------------------------------------

def unsupported(spec) -> str | None:
    if not isinstance(spec, GemmSpec):
        return f"{FAMILY} runs dense GEMMs only, not {type(spec).__name__}"
    if spec.a_dtype not in _IN_DTYPES:
        return f"{FAMILY}: input dtype {spec.a_dtype} not supported ({', '.join(_IN_DTYPES)})"
    if spec.b_dtype != spec.a_dtype and not (spec.a_dtype in _FP8 and spec.b_dtype in _FP8):
        return f"{FAMILY}: A and B must share a dtype, or both be fp8 ({spec.a_dtype} vs {spec.b_dtype})"
    if spec.a_dtype in _FP8 and (spec.a_major, spec.b_major) != ("k", "k"):
        # WGMMA takes 8-bit operands from shared memory only K-major (contiguous along K)
        return (f"{FAMILY}: fp8 inputs need A and B contiguous along K (A {spec.a_major}-major, "
                f"B {spec.b_major}-major given; for a @ b pass b as (N, K) with transpose_b=True)")
    if spec.c_dtype not in _OUT_DTYPES:
        return f"{FAMILY}: output dtype {spec.c_dtype} not supported ({', '.join(_OUT_DTYPES)})"
    if spec.acc_dtype != "float32":
        return f"{FAMILY}: accumulation must be float32, not {spec.acc_dtype}"
    acts = (*fused_epilogue.ACTIVATIONS, *fused_epilogue.GATED)
    if spec.activation and spec.activation not in acts:
        return f"{FAMILY}: no fused epilogue for activation {spec.activation!r} ({', '.join(acts)})"
    if spec.activation in fused_epilogue.GATED and spec.batch_modes > 1:
        return f"{FAMILY}: a gated activation takes one batch mode (B's paired N spends three TMA dimensions)"
    dact = getattr(spec, "dact", "")
    if dact and dact not in fused_epilogue.ACTIVATIONS:
        return (f"{FAMILY}: no fused epilogue for the derivative of {dact!r} "
                f"({', '.join(fused_epilogue.ACTIVATIONS)})")
    if dact and spec.batch_modes != 1:
        return f"{FAMILY}: an activation's derivative (dact) takes one batch mode"
    if spec.scaled:
        return _scaled_unsupported(spec)
    return None


def _scaled_unsupported(spec: GemmSpec) -> str | None:
    """Why the block-scaled kernel does not take ``spec`` (fp8, K-major: checked above), or None."""
    if spec.a_dtype not in _FP8:
        return f"{FAMILY}: block scales take fp8 operands, not {spec.a_dtype}"
    if spec.batch_modes != 1:
        return f"{FAMILY}: a block-scaled product takes one batch mode"
    if spec.preact:
        return f"{FAMILY}: a block-scaled product writes no pre-activation output"
    if is_gated(spec) and spec.b_block == SCALE_K:
        # (a tile's gate and up halves sit in different 128-column blocks: per-column scales read
        # through the same pairing as B's columns, or two a tile, per 64 paired columns)
        return (f"{FAMILY}: a gated block-scaled product takes B scales per column or per {PAIRED_BLOCK} "
                f"paired columns (b_block 1 or {PAIRED_BLOCK}), not {spec.b_block}")
    return None


def _preact(spec) -> bool:
    return spec.preact


def _fused(spec) -> bool:
    return spec.bias or bool(spec.activation)


def _dact(spec) -> bool:
    return bool(getattr(spec, "dact", ""))


def _check_config(config: Config) -> None:
    tiles = _PINGPONG_TILES if config.pingpong else _COOP_TILES
    if (config.tile_m, config.tile_n) not in tiles:
        raise ValueError(f"{FAMILY}: unsupported tile {config.tile_m}x{config.tile_n} (tiles are "
                         + ", ".join(f"{m}x{n}" for m, n in tiles) + (" with pingpong)" if config.pingpong else ")"))
    if config.pingpong and config.split_k != 1:
        raise ValueError(f"{FAMILY}: pingpong does not split K")
    if (config.cluster_m, config.cluster_n) not in ((1, 1), (2, 1), (1, 2), (2, 2)):
        raise ValueError(f"{FAMILY}: unsupported cluster {config.cluster_m}x{config.cluster_n}")
    if config.raster not in ("m", "n") or config.group < 1 or not 1 <= config.split_k <= 16:
        raise ValueError(f"{FAMILY}: bad raster/group/split in {config}")
    if config.epi_n not in (32, 64) or config.tile_n % config.epi_n:
        raise ValueError(f"{FAMILY}: epilogue subtiles are 32 or 64 wide and divide tile_n ({config})")
    if config.sms < config.cluster_m * config.cluster_n:
        raise ValueError(f"{FAMILY}: a grid on {config.sms} SMs holds no {config.cluster_m}x{config.cluster_n} cluster")
    if config.defer and (config.pingpong or config.split_k != 1 or not 1 <= config.defer <= 3):
        raise ValueError(f"{FAMILY}: a deferred epilogue (1 to 3 k-tiles) needs the cooperative "
                         f"kernel without split-K ({config})")


def _check_scaled_config(spec: GemmSpec, config: Config) -> None:
    if config.pingpong or config.defer or (config.tile_m, config.tile_n) not in _SCALED_TILES:
        raise ValueError(f"{FAMILY}: block-scaled tiles are cooperative "
                         + ", ".join(f"{m}x{n}" for m, n in _SCALED_TILES) + f" without a deferred epilogue ({config})")
    reason = _wave_refusal(spec, config)
    if reason:
        raise ValueError(reason)


def _wave_refusal(spec: GemmSpec, config: Config) -> str | None:
    """Why the 256 x 128 block-scaled tile (sm90_scaled.wave_mainloop) does not run ``spec`` with
    ``config``, or None (also for 128-row tiles)."""
    if config.tile_m != 256:
        return None
    if (spec.a_block, spec.b_block) != (1, SCALE_K):
        # the tile spans two 128-row A blocks, and per-column B scales are 32 floats a thread
        # beside 128 accumulators and the partial fragment: DeepGEMM's forward and dgrad only
        # (1 x 128 both, the weight gradient: 0.98-1.04x the 128 x 128 pick on an H200,
        # 2026-11-30, spilling 152-216 bytes around the mainloop)
        return (f"{FAMILY}: the 256 x 128 block-scaled tile takes 1 x 128 A scales and 128 x 128 B scales "
                f"(a_block 1, b_block 128), not a_block {spec.a_block}, b_block {spec.b_block}")
    if config.overlap_promote or config.split_k != 1:
        return (f"{FAMILY}: the 256 x 128 block-scaled tile promotes one 64-row block at a time through one "
                f"partial fragment, unsplit (no overlap_promote or split-K: {config})")
    return None


DEFER = 2   # k-tiles of the next tile issued before a deferred epilogue's stores (autotune)


def epilogue_for(spec, config: Config) -> Config:
    """The epilogue a cooperative config runs with a 16-bit output: 64-wide subtiles, and the
    whole-share mode when K is not split (see the notes above heuristic). fp32 outputs keep a ring of 32-wide subtiles: a whole 128x256 fp32 share
    would leave 2 A/B stages."""
    if config.pingpong or ITEM[spec.c_dtype] != 2 or config.tile_n % 64:
        return config
    # With a bias and the pre-activation output, the whole share leaves a few registers spilled
    # (the first pass keeps the tile's sums live), and on an H200 it ran no faster than the ring
    # (8192x4096->14336: 1.57-1.59 ms both), so those tiles keep the ring.
    whole = config.split_k == 1 and not (_preact(spec) and spec.bias)
    return dataclasses.replace(config, epi_n=64, whole_c=whole)


# block-scaled tiles: the accumulators and one or two k-tiles' partial products fit the
# consumers' registers for 128 x 128 cooperative tiles (64 + 64, or 64 + 2 x 64, per thread);
# 256 x 128 (two 64-row blocks a warpgroup) promotes block by block through one 64-register
# fragment beside 128 accumulators (DeepGEMM's waves; _wave_refusal says which specs it takes).
# The heuristic ranks the 128 x 128 tiles: on an H200 (2026-11-29, one process, bf16 out) the
# 256 x 128 tile ran 984-1046 TFLOP/s on 4096x7168x16384 against 987 for the 128 x 128 pick
# and 960-977 on 4096x4096x7168 against 1024, and the fp8 GPT training steps were equal.
_SCALED_TILES = [(128, 128), (256, 128)]


def scaled_overlap(spec) -> bool:
    """Whether the heuristic runs a block-scaled product with the overlapped promotion
    (Config.overlap_promote; sm90_scaled). With 128-column B blocks a thread's scales are three
    floats a k-tile and its consumer registers hold both partial fragments: ptxas spills (up to
    128 bytes, sm_90a) around each tile's mainloop, not inside it but for two reloads with 128 x
    128 A scales (tests/test_sm90_scaled_compile.py). Per-column B scales (b_block 1: 32 a
    thread) keep the serial mainloop; forced, the overlapped one reads them from the stage at the
    promotion (sm90_scaled.late_columns: 88-200 bytes spilled around the mainloop, none inside).
    A gated product's scales per 64 paired columns are four floats a k-tile: overlapped."""
    return spec.scaled and spec.b_block in (SCALE_K, PAIRED_BLOCK)


def _scaled_candidates(spec) -> list[Config]:
    out = [Config(128, 128, cm, cn, "m", 8, split) for split in (1, 2, 4) for cm, cn in ((2, 1), (1, 2))]
    out.append(Config(128, 128, 1, 1, "m", 8, 1))
    out += [dataclasses.replace(c, overlap_promote=True) for c in out]
    out = [epilogue_for(spec, c) for c in out]
    # forced configs only (the heuristic takes 128-row tiles, autotune skips block-scaled
    # products); a ring of 64-wide subtiles: the whole share spills 168 bytes around the
    # mainloop (bf16, sm_90a), the ring 88
    return out + [dataclasses.replace(epilogue_for(spec, c), whole_c=False)
                  for c in (Config(256, 128, cm, cn, "m", 8, 1) for cm, cn in ((2, 1), (1, 2)))
                  if not _wave_refusal(spec, c)]


def _unaligned_widths(spec) -> tuple[int, ...]:
    """Tile widths for an unaligned C (GemmSpec.c_aligned False), whose subtiles the consumers
    store element by element: beside a 128 x 256 tile's fp32 accumulators that loop fits a
    16-bit C's 32-wide subtiles only (sm_90a: 16 bytes of stack; 104 with 64-wide ones)."""
    return (128, 256) if ITEM[spec.c_dtype] == 2 else (128,)


def candidate_configs(spec) -> list[Config]:
    if unsupported(spec):
        return []
    if spec.scaled:
        return _scaled_candidates(spec)
    if not spec.c_aligned:
        aligned = candidate_configs(dataclasses.replace(spec, c_aligned=True))
        out = [c for c in aligned if c.tile_n == 128]
        if 256 in _unaligned_widths(spec):
            out += [dataclasses.replace(c, whole_c=False, epi_n=32) for c in aligned if c.tile_n == 256]
            out.append(_UNALIGNED_PINGPONG)
        return list(dict.fromkeys(out))
    out = []
    for split in (1, 2, 4):
        for tn in (256, 128):
            for cm, cn in ((2, 1), (1, 2)):
                out.append(Config(128, tn, cm, cn, "m", 8, split))
    out.append(Config(128, 256, 2, 1, "n", 8, 1))
    out.append(Config(128, 128, 1, 1, "m", 8, 1))
    out.append(Config(128, 256, 2, 1, "n", 16, 1))   # N fastest in bands of 16: an autotune candidate
    out.append(Config(256, 128, 2, 1, "m", 8, 1, epi_n=64))   # Pallas's shape (see _COOP_TILES)
    out += [_PINGPONG, _PINGPONG_160, _PINGPONG_128]
    out = [epilogue_for(spec, c) for c in out]
    # each whole-share tile also with the other epilogues, for autotune: the ring of 64-wide
    # subtiles stored after each mainloop, and the deferred epilogue
    out += [v for c in out if c.whole_c
            for v in (dataclasses.replace(c, whole_c=False), dataclasses.replace(c, whole_c=False, epi_n=32, defer=DEFER))]
    if _fused(spec) or _dact(spec):   # a deferred epilogue converts before the fused epilogue would run
        out = [c for c in out if not c.defer]
    if _preact(spec) or _dact(spec):   # (the second output, and Z's reads, in unsplit tiles only)
        out = [c for c in out if c.split_k == 1]
    if is_gated(spec):    # (tiles whose halves are whole 64-column blocks)
        out = [c for c in out if c.tile_n in (128, 256)]
    if _dact(spec):
        # next to Z's reads, the 256x128 tile (two row blocks per warpgroup) and pingpong 128x160
        # (160 accumulators) spill registers with a float32 C, 256x128 with an M-major C too
        out = [c for c in out if c.tile_m != 256 and c != _PINGPONG_160]
    return list(dict.fromkeys(out))


# The heuristic ranks the unsplit and split cooperative tiles with _estimate. Where it picks the
# unsplit 128x256 2x1-cluster tile, that tile runs M fastest inside bands of 8 clusters with
# the whole-share epilogue (16-bit outputs). Why, from H200 measurements (2026-11-21 to -24;
# docs/performance.md has more):
# - whole-share epilogue (Config.whole_c): per-tile SM clock stamps put a tile's epilogue at
#   1.35-1.42k cycles, against 2.6-2.75k for the 2-deep ring of 64-wide subtiles and 2.15k for
#   the deferred one; the next mainloop then takes ~1-2% more cycles per k-tile at K <= 2048.
#   Kernel cycles under ncu against the deferred epilogue: -2.6% on 16384x1536x1024, -0.5% on
#   16384x2048x2048, -1.5% on 4096^3, +0.5% on 8192^3. Deferral on top of it (3 stages) starves
#   the mainloop.
# - deferred epilogue (autotune only; an unaligned C: see heuristic): stores under the next tile's first 2
#   k-tiles; it costs ~3.4k cycles once per CTA and saves ~0.5k per tile.
# - raster: N fastest in bands of 16 reads 1477 MB of DRAM on 8192^3 and 654 MB on
#   4096x14336x4096, against 1229 / 492 MB for M fastest in bands of 8 and 1204 / 453 MB for
#   cuBLAS. On a board held at its 700 W cap, the extra traffic costs clock in sustained runs.
# - 64-wide epilogue subtiles: half the store rounds (and barriers) per tile; equal or up to 4%
#   faster in short windows, equal in sustained ones. Split-K tiles keep them.
# - a 4-deep ring of 32-wide subtiles with 4 A/B stages takes 0.9-1.4% more cycles than the whole
#   share on 16384x1536x1024 and 16384x2048x2048, and runs 3-5% slower with shuffled rounds.
# - pingpong (64x256 or 128x160 tiles, one warpgroup's epilogue under the other's mainloop) is
#   an autotune candidate only for 16-bit products, fused epilogues included (8-bit inputs: see
#   heuristic). 128x160 wins 2-7% in short (50-60 ms) windows on
#   4096x14336x4096, 16384x2048x2048 and 16384x1536x1024 and loses 1-3% in sustained 1 s
#   windows: it moves ~20% more bytes through shared memory per FLOP, and at the 700 W cap
#   energy per FLOP sets the rate. A training loop runs at that cap, so the heuristic serves the
#   sustained case. 128x128 with 6 stages takes 2-6% fewer cycles than the pick at K <= 2048
#   but runs 3-4% lower clocks and loses 1.6-3.7% sustained; 64x256 loses in both windows.
#   At K = 1024 (16384x1536x1024, 8 x 2048x1536x1024, 8192x4096x1024, 8192x14336x1024; H200,
#   2026-11-30, single products) 128x128 won 2-6% in 50 ms windows and tied in 1 s ones (within
#   0.7%), and no candidate beat the pick sustained; cuBLAS led both windows by 2-6% there.

# Cooperative tile widths. 160 and 192 could leave fewer SMs idle in the last wave on some
# shapes (cuBLAS runs 4096x14336x4096 with 128x160 tiles; N-major B then takes 64-byte swizzle
# atoms). They compute correctly on an H200 but run 5-25% slower than 128x256, so
# neither the heuristic nor candidate_configs offers them.
_TILE_NS = (128, 160, 192, 256)
# cooperative tiles (each consumer warpgroup holds tile_m * tile_n / 256 fp32 accumulators per
# thread): 256 x 128 gives each warpgroup two 64 x 128 row blocks, the shape of Pallas's fastest
# Hopper matmul configuration (two warpgroups stacked along M, 128 x 128 each)
_COOP_TILES = [(128, n) for n in _TILE_NS] + [(256, 128)]
_PINGPONG = Config(64, 256, 2, 1, "n", 8, 1, pingpong=True)
_PINGPONG_160 = Config(128, 160, 2, 1, pingpong=True)
_PINGPONG_128 = Config(128, 128, 2, 1, pingpong=True)
# pingpong tiles (one warpgroup's accumulators: tile_m * tile_n / 128 fp32 registers per thread)
# an unaligned 16-bit C's pick (see heuristic): M fastest, 32-wide subtiles (64-wide spill)
_UNALIGNED_PINGPONG = dataclasses.replace(_PINGPONG, raster="m", epi_n=32)
_PINGPONG_TILES = [(64, 128), (64, 256), (128, 128), (128, 160)]


def _tile_grid(config: Config, m: int, n: int, l: int) -> tuple[int, int, int]:
    """Output tiles along M and N (rounded up to whole clusters) and the batch count."""
    tm = -(-max(m, 1) // config.tile_m)
    tn = -(-max(n, 1) // config.tile_n)
    return (-(-tm // config.cluster_m) * config.cluster_m, -(-tn // config.cluster_n) * config.cluster_n, l)


def _estimate(config: Config, m: int, n: int, k: int, l: int, num_sms: int, bk: int) -> float:
    """Rough time model (units of one 128 x 128 x k-tile MMA step on one SM, the same for every
    input dtype: an 8-bit k-tile is twice as deep and WGMMA runs it twice as fast) used to rank
    configs. A tile's epilogue costs 2 per 128 x 128 of it; 128 x 128 tiles run their MMAs at
    0.88 of a 128 x 256 tile's rate."""
    epi = 2.0
    csize = config.cluster_m * config.cluster_n
    waves = tiles_per_cta(config, m, n, l, num_sms)
    k_tiles = -(-max(k, 1) // bk)
    k_per_unit = -(-k_tiles // config.split_k)
    size = config.tile_m * config.tile_n / (128 * 128)
    speed = 1.0 if size > 1 else 0.88              # 128x128 tiles reach less of peak
    if config.pingpong:
        # the mainloops run back to back; only the CTA's last epilogue is not under the other
        # warpgroup's mainloop
        return waves * k_per_unit * size / speed + epi * size
    # mainloop + epilogue. A deferred epilogue is charged in full too: it hides under the next
    # tile only where a CTA has one, and the split/unsplit ranking was tuned with this charge
    # (re-ranking with the deferral credited is for a measured session)
    step = k_per_unit * size / speed + epi * size
    if config.split_k > 1:
        step += 3.0 * size                               # partial write, counter, fold
    return waves * step * (1.02 if csize == 1 else 1.0)


def heuristic(spec, m: int, n: int, k: int, l: int, num_sms: int = NUM_SMS, split_k: int | None = None) -> Config:
    """The config to run ``spec`` on an M x N x K problem of L batches. ``split_k``: the split
    the caller needs (the order in which each output element's float32 partial sums are added
    depends on it alone, see the module notes), ranked among the configs of that split where
    there are any; None: any split."""
    reason = unsupported(spec)
    if reason:
        raise ValueError(reason)
    cands = [c for c in candidate_configs(spec)
             if c.raster == "m" and c.group == 8 and not c.pingpong and c.tile_m == 128 and c == epilogue_for(spec, c)]
    if spec.scaled:
        cands = [c for c in cands if c.cluster_m * c.cluster_n > 1 and c.overlap_promote == scaled_overlap(spec)]
    if spec.batch_modes > 1 and ITEM[spec.c_dtype] == 4:
        # an fp32 128x256 tile split 4 ways spills registers with three batch modes (16-96 bytes)
        cands = [c for c in cands if not (c.tile_n == 256 and c.split_k == 4)]
    if is_gated(spec):   # a tile pairs tile_n / 2 gate columns with as many up columns
        cands = [c for c in cands if (n // 2) % (c.tile_n // 2) == 0]
        if not cands:
            raise ValueError(f"{FAMILY}: a gated activation needs N/2 a multiple of {GATED_COLUMNS}, got N={n}")
    tiles_m = -(-max(m, 1) // 128)
    if tiles_m == 1:   # a 2x1 cluster would idle half its CTAs; share A along N instead
        cands = [c for c in cands if c.cluster_m == 1]
    else:
        cands = [c for c in cands if c.cluster_m == 2]
    if split_k is not None:
        cands = [c for c in cands if c.split_k == split_k] or cands
    bk = tile_k(spec.a_dtype)
    best = min(cands, key=lambda c: (_estimate(c, m, n, k, l, num_sms, bk), c.split_k, -c.tile_n))
    if not spec.c_aligned and spec.a_dtype not in _FP8:
        # Every subtile of an unaligned C is stored element by element, a long epilogue beside
        # the short mainloops of an LM head (K = 768). Pingpong 64 x 256 tiles run one warpgroup's
        # stores under the other's mainloop: on an H200 (2026-11-29, 8192x50257x768 forward, one
        # process, 50 ms windows) 587 TFLOP/s against 489-531 for the cooperative 128 x 256 tile
        # (half as many subtiles per FLOP as 128 x 128: 477-494), 411 for pingpong 128 x 128 and
        # 533-583 for XLA. One row of tiles (M <= 128) keeps the cooperative tile on a 1 x 2 cluster.
        # (a fused epilogue's extra live state beside that loop spills 40 bytes: 128 x 128 there)
        wide = (_UNALIGNED_PINGPONG if tiles_m > 1
                else dataclasses.replace(best, tile_n=256, whole_c=False, epi_n=32, defer=0))
        if not _fused(spec) and wide in candidate_configs(spec):
            return wide
    # A fused activation (bias, pre-activation output, a derivative's reads of Z) keeps the
    # cooperative pick too. Pingpong 128x128 hides the activation's epilogue under the other
    # warpgroup's mainloop and wins short windows (H100, 2026-11-26, bias + gelu, 50 ms: 2-12%
    # on 4096x4096->14336, 4096^3, 16384x4096->4096, 2048x2048->8192), but at the power cap the
    # cooperative tile wins: 1 s windows 3.5% (8192x4096->14336), 6% (4096^3), 11% (8192^3, where
    # it also wins short windows); GELU block forward + backward 1.5%, 2.3% with the derivative
    # chained, SwiGLU block 4%. As for plain GEMMs, the heuristic serves the sustained case.
    if spec.scaled and (spec.a_block, spec.b_block) == (1, 1) and best.split_k == 1:
        # The weight gradient's serial mainloop (1 x 128 scales on both operands) runs on one CTA:
        # on a cluster a multicast stage is refilled only once both CTAs' consumers have released
        # it, so each CTA's promotion stalls its partner's loads. On an H200 (2026-11-30, two
        # runs, one process each, bits equal) one CTA ran 1.02-1.11x the 2x1 cluster on
        # 4096x16384x8192, 16384x4096x8192 and 4096^3 with a bf16 output (the training step's;
        # f32 within the runs' noise), 1x2 as 2x1, 2x2 5-7% slower. With 128 x 128 A blocks
        # (and per-column B scales) the cluster ran 1.07x one CTA (f32 out, one run): kept.
        return dataclasses.replace(best, cluster_m=1, cluster_n=1)
    if spec.a_dtype in _FP8 and tiles_m > 1 and not spec.scaled and split_k in (None, 1):
        # 8-bit k-tiles run twice as fast, so the cooperative tile's exposed epilogue weighs twice
        # as much: the pingpong tiles win where the model says they save 3% or more
        # (a gated tile pairs halves of 64-column blocks: not 160 wide; dact: see candidate_configs)
        pps = (_PINGPONG_128,) if is_gated(spec) or _dact(spec) or not spec.c_aligned else (_PINGPONG_160, _PINGPONG_128)
        pp = min(pps, key=lambda c: _estimate(c, m, n, k, l, num_sms, bk))
        if _estimate(pp, m, n, k, l, num_sms, bk) < 0.97 * _estimate(best, m, n, k, l, num_sms, bk):
            return pp
    return best


def tiles_per_cta(config: Config, m: int, n: int, l: int, num_sms: int = NUM_SMS) -> int:
    """Most output tiles (units, with split-K) one CTA of the persistent grid runs."""
    tm, tn, _ = _tile_grid(config, m, n, l)
    csize = config.cluster_m * config.cluster_n
    return -(-(tm * tn * l * config.split_k) // (co_resident_clusters(num_sms, csize) * csize))


# --- arguments and workspace ----------------------------------------------------------------

def workspace_args(config: Config) -> tuple:
    """The split-K (dense) or tail-split (grouped) workspaces' arguments: fp32 partial tiles
    and int32 arrival counters, or none when K is not split."""
    if config.split_k == 1:
        return ()
    return (abi.TensorArg("splitk_partials", "float32", (abi.DYN,), (1,), align=16),
            abi.TensorArg("splitk_flags", "int32", (abi.DYN,), (1,), align=16))


def signature(spec, config: Config) -> abi.Signature:
    """(a, b, c[, sa, sb][, bias][, d][, splitk_partials, splitk_flags], stream); sa and sb the
    block scales (GemmSpec.scale_args), bias is float32 (N,), d the pre-activation output (laid
    out like c); workspaces are 1-D, nbytes/4 long. dact: (a, b, c, z, stream), z the
    pre-activation input (laid out like c)."""
    if _dact(spec):
        return spec.signature((spec.dact_arg(),))
    bias = (spec.bias_arg(),) if spec.bias else ()
    d = (spec.preact_arg(),) if _preact(spec) else ()
    return spec.signature(spec.scale_args() + bias + d + workspace_args(config))


def workspace(spec, config: Config, m: int, n: int, k: int, l: int) -> list[Workspace]:
    if config.split_k == 1:
        return []
    tm, tn, _ = _tile_grid(config, m, n, l)
    tiles = tm * tn * l
    return [Workspace("splitk_partials", 4 * config.split_k * tiles * config.tile_m * config.tile_n, False),
            Workspace("splitk_flags", 16 * (-(-tiles // 4)), True)]


def finish_object(spec, config) -> Callable[[bytes], bytes] | None:
    """The pass over a compiled object of ``spec`` and ``config`` (build.compile_launcher's
    ``finish``): the weight gradient's serial promotion (per-column B scales) lets its FFMAs
    yield (kernels/sass.py says where that was measured); the overlapped promotion keeps ptxas'
    marks, which ran faster than every edit tried, and so does the grouped family (its ragged-K
    weight gradient ran 1-2% slower with the pass)."""
    return sass.yield_in_promotion if spec.scaled and spec.b_block == 1 and not config.overlap_promote else None


def launcher(spec, config: Config):
    reason = unsupported(spec)
    if reason:
        raise ValueError(reason)
    _check_config(config)
    if spec.scaled:
        _check_scaled_config(spec, config)
    elif config.overlap_promote:
        raise ValueError(f"{FAMILY}: overlap_promote applies to block-scaled products only ({config})")
    if config.defer and ITEM[spec.c_dtype] != 2:
        # the converted copy of the accumulators must fit next to them in the register file
        raise ValueError(f"{FAMILY}: a deferred epilogue needs a 16-bit output, not {spec.c_dtype}")
    if config.defer and _fused(spec):
        raise ValueError(f"{FAMILY}: a deferred epilogue cannot fuse a bias or activation ({config})")
    if _preact(spec) and config.split_k != 1:
        raise ValueError(f"{FAMILY}: a pre-activation output needs unsplit tiles ({config})")
    if not spec.c_aligned and config.tile_n not in _unaligned_widths(spec):
        raise ValueError(f"{FAMILY}: an unaligned {spec.c_dtype} C takes tiles "
                         + " or ".join(map(str, _unaligned_widths(spec))) + f" wide ({config})")
    if _dact(spec) and (config.split_k != 1 or config.defer):
        raise ValueError(f"{FAMILY}: an activation's derivative (dact) needs unsplit tiles and no deferred "
                         f"epilogue ({config})")
    if is_gated(spec) and config.tile_n not in (128, 256):
        raise ValueError(f"{FAMILY}: a gated activation pairs halves of 128- or 256-wide tiles ({config})")
    return make_launcher(spec, config, config.sms)


def make_launcher(spec: GemmSpec | GroupedSpec, config: Config, sms: int = NUM_SMS):
    """The @cute.jit launcher of the kernel with the tile scheduler ``spec`` asks for: the dense
    raster on at most ``sms`` SMs for a GemmSpec, the ragged_m / ragged_k walk on ``sms`` CTAs for
    a GroupedSpec (a cooperative 128-row tile, unsplit, on one CTA or, ragged_m, a 1x2 cluster;
    sm90_grouped checks the spec)."""
    grouped = isinstance(spec, GroupedSpec)
    if grouped and (config.tile_m != 128 or config.pingpong or config.defer or config.pdl
                    or config.cluster_m != 1 or config.cluster_n not in (1, 2)
                    or (config.cluster_n > 1 and spec.mode != "ragged_m")):
        raise ValueError(f"{FAMILY}: grouped tiles are cooperative 128-row tiles on one CTA (ragged_m: or a 1x2 "
                         f"cluster) ({config})")
    if grouped and config.split_k != 1 and (spec.mode != "ragged_m" or spec.scaled or spec.preact
                                            or config.cluster_n != 1 or not 2 <= config.split_k <= 4):
        # (RaggedWalk.tail_plan: the last round's tiles split 2 to 4 ways along K)
        raise ValueError(f"{FAMILY}: a grouped tail split (2 to 4 ways) runs 16-bit ragged_m products on one "
                         f"CTA without a pre-activation output ({config})")
    # the epilogue reuses its smem ring round-robin across tiles: subtiles per tile must fill it
    rows = wg_rows(config.tile_m, config.pingpong)
    ab_stages, epi_stages = stage_plan(config.tile_n, spec.c_dtype, config.stages, config.pingpong,
                                        config.epi_n, config.tile_m, config.whole_c, is_gated(spec),
                                        scale_stage_bytes(config.tile_m, config.tile_n, spec.a_block, spec.b_block,
                                                          scale_slack(spec)))
    # (a gated C pass stores half the subtiles: stage_plan's depth divides that count too)
    assert (rows // 64) * (config.tile_n // config.epi_n) % epi_stages == 0
    if config.whole_c and ab_stages < 3:
        # two stages cannot keep loads ahead of the tensor cores
        raise ValueError(f"{FAMILY}: a whole-share epilogue of {spec.c_dtype} leaves {ab_stages} A/B "
                         f"stage(s) for a {config.tile_m}x{config.tile_n} tile (3 needed)")
    # imported here: the kernel module imports the DSL's compiler, which routing must not need
    from jax_cute.kernels import sm90_kernel

    return sm90_kernel.make_launcher(spec, config, sms, spec.signature(workspace_args(config)) if grouped
                                     else signature(spec, config))
