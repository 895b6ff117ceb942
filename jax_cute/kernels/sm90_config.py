"""The Hopper GEMM's configuration and shared-memory plan: what both the family module
(sm90_gemm, routing) and the kernel (sm90_kernel, DSL) need. Imports no DSL.
"""

from __future__ import annotations

import dataclasses

from jax_cute.kernels import epilogue as fused_epilogue

NUM_SMS = 132            # H100 SXM / H200: the persistent grid's default bound (Config.sms)
SMEM_BYTES = 232448      # opt-in dynamic shared memory per block on sm_90 (227 KiB)
ROW_BYTES = 128          # a k-tile row is one 128-byte swizzle atom: 64 16-bit or 128 8-bit elements
ITEM = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}
SCALE_ALIGN = 128        # bytes between a stage's scale buffers (a TMA destination's alignment)
# a grouped tail-split unit's fewest k-tiles (sm90_schedulers.RaggedWalk.tail_plan): on an H200
# (2026-11-29) units of 8 to 11 k-tiles (K = 2048, 128 x 128 tiles) ran 2-3% slower than unsplit,
# publishing and folding their fp32 partials costing what the split saved
TAIL_MIN_K_TILES = 16


@dataclasses.dataclass(frozen=True)
class Config:
    tile_m: int = 128
    tile_n: int = 256
    cluster_m: int = 2     # CTAs along M sharing (multicasting) each B slice
    cluster_n: int = 1     # CTAs along N sharing each A slice
    raster: str = "m"      # which cluster index moves fastest inside a group band
    group: int = 8         # band width of the grouped raster, in clusters
    split_k: int = 1
    stages: int = 0        # A/B ring depth; 0 fills shared memory
    # pingpong: each consumer warpgroup owns whole 64 x tile_n tiles (alternate tiles of the
    # CTA's sequence), so one warpgroup's epilogue overlaps the other's mainloop
    pingpong: bool = False
    # programmatic dependent launch (see sm90_gemm's notes), set by the dispatch for stream
    # launches (dispatch.launch_mode): on an H200 it leaves kernel time unchanged (ncu); inside
    # graphs it makes back-to-back products 3-8% slower, on the stream 2-3% faster on short
    # products (docs/performance.md)
    pdl: bool = False
    # width of the epilogue's subtiles (64 rows x epi_n columns per consumer warpgroup): 64 halves
    # the number of store rounds per tile and gives a 16-bit N-major C 128-byte swizzle atoms
    epi_n: int = 32
    # deferred epilogue (see sm90_gemm's notes): k-tiles of the next tile issued before the
    # previous tile's stores; 0 stores each tile right after its mainloop
    defer: int = 0
    # whole-share epilogue: a ring slot for every subtile of a warpgroup's share of the tile
    # (3 A/B stages instead of 4 for 128x256), so each store is issued as its subtile is
    # written and none waits for another's smem read inside a tile
    whole_c: bool = False
    # SMs the persistent grid may fill (dense: a cap on its clusters, grouped: its size). Fewer
    # than the device has leaves SMs free for kernels that run beside it, such as a collective
    # ring's NCCL transfers (dispatch sets it from GemmRequest.free_sms). A launch parameter of
    # the host launcher: the kernel's code is the same for every value.
    sms: int = NUM_SMS
    # block-scaled only (sm90_scaled): two partial-product fragments, so k-tile kt + 1's WGMMAs
    # run on the tensor cores while k-tile kt's partial sums are promoted with their scales
    overlap_promote: bool = False

    def key(self) -> str:
        return (f"t{self.tile_m}x{self.tile_n}.c{self.cluster_m}x{self.cluster_n}."
                f"r{self.raster}{self.group}.sk{self.split_k}.st{self.stages}" + (".pp" if self.pingpong else "")
                + (".pdl" if self.pdl else "") + (f".e{self.epi_n}" if self.epi_n != 32 else "")
                + (f".df{self.defer}" if self.defer else "") + (".wc" if self.whole_c else "")
                + (f".sm{self.sms}" if self.sms != NUM_SMS else "") + (".op" if self.overlap_promote else ""))


def co_resident_clusters(sms: int, size: int) -> int:
    """Clusters of ``size`` CTAs (one CTA an SM) that run at once on ``sms`` SMs. A cluster's CTAs
    share a GPC, and Hopper's GPCs place 4-CTA clusters on pairs of TPCs, some with a TPC left
    over: cudaOccupancyMaxActiveClusters gives 66 of 66 2-CTA clusters and 30 of 33 4-CTA ones on
    an H200 (2026-11-29). A persistent grid of more clusters than fit runs the rest as a second
    wave (a 2x2 grid of 33 clusters took twice the time of the 30 that fit)."""
    return sms // size if size <= 2 else sms // size * 10 // 11


def is_gated(spec) -> bool:
    return spec.activation in fused_epilogue.GATED


def tile_k(in_dtype: str) -> int:
    """K extent of one k-tile: a 128-byte row of the input dtype."""
    return ROW_BYTES // ITEM[in_dtype]


def wg_rows(tile_m: int, pingpong: bool) -> int:
    """Rows of each tile one consumer warpgroup computes and stores, in 64-row blocks: pingpong its
    whole tile, cooperative half of it."""
    return tile_m if pingpong else tile_m // 2


# A TMA load's box must start 16-byte aligned along the tensor's contiguous mode: an unaligned
# start raises CUDA_ERROR_ILLEGAL_INSTRUCTION on sm_90 (seen on an H200 for M-major bf16 A at
# group rows, sm90_grouped; on an H100 for 16-byte scale boxes at unaligned row blocks and for
# ragged_m's 1-row A-scale boxes at group rows such as 77). Scales are float32: 4 rows.
SCALE_BOX_ALIGN = 16 // ITEM["float32"]


def scale_slack(spec) -> int:
    """Rows A's 1-row-block scale box holds beyond the tile's: ragged_m tiles start at any group
    row, so the box starts at that row rounded down to SCALE_BOX_ALIGN (scale_origin) and holds
    SCALE_BOX_ALIGN rows more (0 elsewhere: dense and ragged_k tiles start at multiples of 128)."""
    return SCALE_BOX_ALIGN if getattr(spec, "mode", "") == "ragged_m" and spec.a_block == 1 else 0


def scale_origin(row):
    """(the box's first row, the tile's first row's offset in it) of a scale box for a tile
    starting at ``row`` >= 0 (a Python or DSL integer): the box starts 16-byte aligned."""
    start = row // SCALE_BOX_ALIGN * SCALE_BOX_ALIGN
    return start, row - start


def scale_box(tile_rows: int, block: int, slack: int = 0) -> int:
    """float32 scales of an operand a stage holds (one TMA box a k-tile): with 1-row blocks the
    tile's rows plus ``slack`` (scale_slack); with 128-row blocks SCALE_BOX_ALIGN row blocks from
    the tile's rounded down to a multiple of SCALE_BOX_ALIGN (scale_origin)."""
    return tile_rows + slack if block == 1 else SCALE_BOX_ALIGN


def scale_pitch(tile_rows: int, block: int, slack: int = 0) -> int:
    """float32 elements between two stages' scale buffers of one operand."""
    per = SCALE_ALIGN // ITEM["float32"]
    return -(-scale_box(tile_rows, block, slack) // per) * per


def scale_stage_bytes(tile_m: int, tile_n: int, a_block: int, b_block: int, a_slack: int = 0) -> int:
    """Shared memory of one stage's block scales (0 when unscaled; ``a_slack``: scale_slack)."""
    if not a_block:
        return 0
    return ITEM["float32"] * (scale_pitch(tile_m, a_block, a_slack) + scale_pitch(tile_n, b_block))


def stage_plan(tile_n: int, c_dtype: str, stages: int, pingpong: bool = False,
                epi_n: int = 32, tile_m: int = 128, whole_c: bool = False, gated: bool = False,
                scale_bytes: int = 0) -> tuple[int, int]:
    """(A/B stages, epilogue ring depth) for a tile_m x tile_n x tile_k tile.

    Each consumer warpgroup stores its own rows of output (cooperative: its half of the tile, in
    64-row blocks; pingpong: its whole tile) through its own ring of 64 x epi_n subtiles. The ring is
    reused round-robin across tiles, so its depth divides a warpgroup's subtiles per tile.
    Cooperative: as deep as fits in 16 KB per warpgroup (the A/B ring keeps the rest); pingpong:
    2 deep (its A/B stages matter more). whole_c: one slot per subtile of the warpgroup's share.
    gated: the C pass stores half the subtiles, and the depth divides that count too.
    scale_bytes: a block-scaled stage's scale buffers (scale_stage_bytes), loaded with its k-tile."""
    sub_bytes = 64 * epi_n * ITEM[c_dtype]
    subtiles = (wg_rows(tile_m, pingpong) // 64) * (tile_n // epi_n)
    stored = subtiles // 2 if gated else subtiles
    if pingpong:
        epi_stages = 2 if stored % 2 == 0 else 1
        ab_bytes = (tile_m + tile_n) * ROW_BYTES
    else:
        epi_stages = max(d for d in range(1, stored + 1) if stored % d == 0 and (d == 1 or d * sub_bytes <= 16384))
        ab_bytes = (tile_m + tile_n) * ROW_BYTES
    ab_bytes += scale_bytes
    if whole_c:
        epi_stages = subtiles
    epi_bytes = 2 * sub_bytes * epi_stages
    fit = (SMEM_BYTES - 1024 - epi_bytes) // ab_bytes
    return (min(stages, fit) if stages else fit), epi_stages
