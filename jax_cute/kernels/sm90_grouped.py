"""Hopper (sm_90a) grouped GEMM for mixture-of-experts, group sizes read on the device.

The kernel is ``sm90_gemm``'s with its grouped tile scheduler (see its module notes); this module
holds the family's configs and heuristic. Two modes of :class:`~jax_cute.kernels.gemm_spec.GroupedSpec`:

* ``ragged_m`` (forward, lhs gradient): rows of A are split into groups; group g multiplies by
  B[:, :, g]. Tiles start at the first row of their group, so a tile never mixes groups; it may
  *read* rows of the next group but its store is clipped at the group end. Rows past the last
  group are a pseudo-group with no K loop: its tiles store 0.
* ``ragged_k`` (rhs gradient): K (tokens) is split into groups; every (g, m-tile, n-tile) is a
  tile whose K loop runs over that group's rows only; empty groups store 0.

Fused epilogues (ragged_m, EPILOGUES): the dense kernel's, with the bias row of the tile's
group (tiles never mix groups; the zero tail takes no bias, and every activation maps 0 to 0),
the pre-activation output D stored with C's clipped TMA view, and swiglu's paired halves.

Block-scaled fp8 (GroupedSpec.a_block / b_block): the dense kernel's scaled mainloop (sm90_scaled)
on 128 x 128 tiles. ragged_m: A's scales loaded at the tile's rows (tiles start at group rows),
B's at the tile's group; the heuristic runs these tiles on 1x2 clusters (Config.cluster_n: two
n-tiles of one m-tile share each A k-tile by multicast). ragged_k (the grouped weight gradient): A
and B are contiguous along K (fp8 WGMMA), where no TMA view clips K at a group end and unaligned
group starts are unaligned box coordinates along the contiguous mode; so the caller lays K out
with every group starting at a multiple of 128 and zero-filled to the next one (GroupedSpec), and
the walk rounds each group size up to 128: group g's k-range starts at 128 f_g, f_g its first
scale block, and its k-tile j is scale block f_g + j of both operands (per-row A and per-column B
scales: the serial mainloop, or the overlapped one forced).

Clipping at group ends uses TMA views whose ragged mode needs a 16-byte-multiple stride, so
ragged_k needs MN-major A and B, and ragged_m an N-major C (what ragged_dot and its gradients
use). Nothing is precomputed on the host: no workspace, and replays with new sizes are exact.
"""

import dataclasses

from jax_cute.kernels import abi, sm90_gemm
from jax_cute.kernels.epilogue import GATED
from jax_cute.kernels.gemm_spec import PAIRED_BLOCK, SCALE_K, GroupedSpec, Workspace
from jax_cute.kernels.sm90_config import TAIL_MIN_K_TILES

FAMILY = "sm90_grouped"
ARCH = "sm_90a"

_IN_DTYPES = ("bfloat16", "float16")
_FP8 = ("float8_e4m3fn", "float8_e5m2")
_OUT_DTYPES = ("bfloat16", "float16", "float32")
TILE_M = 128
# ragged_m's tail split: the last round's tiles cut into up to this many units along K
TAIL_SPLIT = 4
# ragged_m only (see unsupported); an activation's derivative (dact) is the dense kernel's alone
EPILOGUES = tuple(e for e in sm90_gemm.EPILOGUES if e != "dact")
GATED_COLUMNS = sm90_gemm.GATED_COLUMNS


@dataclasses.dataclass(frozen=True)
class Config:
    tile_n: int = 256     # tile_m is always 128 (two consumer warpgroups of 64 rows)
    raster: int = 8       # m-tiles per raster panel (L2 reuse of B)
    sms: int = 132        # persistent grid size
    overlap_promote: bool = False   # block-scaled: sm90_gemm.Config's overlapped promotion
    # ragged_m: CTAs of a cluster along N (1 or 2), on n-tiles of one m-tile (one group), which
    # multicast each A k-tile: half of A's L2 reads (B's cannot be shared: tiles along M start
    # at group rows, and neighbours may be in different groups)
    cluster_n: int = 1
    # ragged_m, 16-bit: the tiles of the walk's last, partial round of the grid are each split
    # along K into up to this many units (sm90_schedulers.RaggedWalk.tail_plan), so that round
    # fills the SMs; 1: none
    tail_split: int = 1

    def key(self) -> str:
        return (f"n{self.tile_n}.r{self.raster}.sm{self.sms}" + (".op" if self.overlap_promote else "")
                + (f".c1x{self.cluster_n}" if self.cluster_n != 1 else "")
                + (f".ts{self.tail_split}" if self.tail_split != 1 else ""))


def unsupported(spec) -> str | None:
    if not isinstance(spec, GroupedSpec) or spec.mode not in ("ragged_m", "ragged_k"):
        return "sm90_grouped runs GroupedSpec ragged_m / ragged_k only"
    if spec.scaled:
        return _scaled_unsupported(spec)
    if spec.a_dtype not in _IN_DTYPES or spec.b_dtype != spec.a_dtype:
        return f"inputs must both be bf16 or both fp16, got {spec.a_dtype}/{spec.b_dtype}"
    if spec.c_dtype not in _OUT_DTYPES:
        return f"output dtype {spec.c_dtype} not supported"
    if spec.acc_dtype != "float32":
        return "accumulation must be float32"
    if spec.activation and spec.activation not in EPILOGUES:
        return f"no fused epilogue for activation {spec.activation!r}"
    if spec.mode == "ragged_m" and spec.c_major != "n":
        return "ragged_m needs an N-major output (clipped TMA store along M)"
    if spec.mode == "ragged_m" and spec.a_major != "k":
        # Tiles start at arbitrary group rows, which for M-major A is the TMA box start along
        # the contiguous mode: an H200 raises CUDA_ERROR_ILLEGAL_INSTRUCTION unless it is
        # 16-byte aligned (2026-11-21: groups on multiples of 8 rows pass, 143-row groups trap).
        # ragged_dot's forward and lhs gradient use K-major A; the routing falls back.
        return ("ragged_m with M-major A is not supported: group starts are unaligned TMA "
                "coordinates along A's contiguous mode (illegal instruction on sm_90a)")
    if spec.mode == "ragged_k" and (spec.a_major != "m" or spec.b_major != "n"):
        return "ragged_k needs MN-major A and B (clipped TMA loads along K)"
    return None


def unverified(spec) -> str:
    """The name of ``spec``'s kernel variant when it has never run on a GPU (arch.UNVERIFIED_VARIANTS
    lists the names; routing takes it only opted in), else ""."""
    return "scaled_ragged_k" if isinstance(spec, GroupedSpec) and spec.scaled and spec.mode == "ragged_k" else ""


def _scaled_unsupported(spec: GroupedSpec) -> str | None:
    """Why the block-scaled grouped kernel does not take ``spec`` (blocks: GroupedSpec checks), or None."""
    if spec.mode == "ragged_k" and spec.lead:
        return "a block-scaled ragged_k product takes no lead (group offset)"
    if spec.a_dtype not in _FP8 or spec.b_dtype not in _FP8:
        return f"block scales take fp8 operands, got {spec.a_dtype}/{spec.b_dtype}"
    if (spec.a_major, spec.b_major, spec.c_major) != ("k", "k", "n"):
        return "a block-scaled grouped product reads A and B contiguous along K and writes C contiguous along N"
    if spec.c_dtype not in _OUT_DTYPES or spec.acc_dtype != "float32":
        return f"output dtype {spec.c_dtype} (accumulating in {spec.acc_dtype}) not supported"
    if spec.preact or (spec.activation and spec.activation not in EPILOGUES):
        return "a block-scaled grouped product fuses a bias and activations, and writes no pre-activation output"
    if spec.activation in GATED and spec.b_block == SCALE_K:
        return (f"a gated block-scaled grouped product takes B scales per column or per {PAIRED_BLOCK} paired "
                f"columns (b_block 1 or {PAIRED_BLOCK}), not {spec.b_block}")
    return None


def candidate_configs(spec) -> list[Config]:
    if spec.scaled and spec.mode == "ragged_k":
        # per-column B scales: the heuristic's serial mainloop, or the overlapped one forced
        # (sm90_gemm.scaled_overlap)
        return [Config(tile_n=128), Config(tile_n=128, overlap_promote=True)]
    if spec.scaled:
        cands = [Config(tile_n=128), Config(tile_n=128, overlap_promote=True)]
        return cands + [dataclasses.replace(c, cluster_n=2) for c in cands]
    if spec.mode == "ragged_m":
        tails = [] if spec.preact else [Config(tile_n=tn, tail_split=TAIL_SPLIT) for tn in (256, 128)]
        return [Config(tile_n=256), Config(tile_n=128), *tails, Config(tile_n=256, cluster_n=2)]
    return [Config(tile_n=256), Config(tile_n=128)]


def heuristic(spec, m, n, k, g, l, num_sms: int = 132) -> Config:
    # 128x256 is the most efficient tile; 128x128 where 256-wide tiles would pad N by 128
    # columns or more (N % 256 in (0, 128]: the last 256-wide tile is at least half empty)
    # or, for ragged_k, where there are too few tiles to fill the SMs.
    # Measured on an H200 (2026-11-21, rotated timing, the suite's group sizes): at N=1408 the
    # ragged_m forward on 128x128 beat 128x256 by 1-6% on uniform and 4-10% on Dirichlet(0.3)
    # group sizes in two runs; the ragged_k rhs gradient at N=1408, also on 128x128 since,
    # held its speed in the suite (605 vs 603 TFLOP/s uniform). Multiples of 256 keep 128x256.
    tile_n = 128 if n <= 128 or 0 < n % 256 <= 128 or spec.scaled else 256   # (scaled: see sm90_gemm)
    if spec.activation in GATED:
        if (n // 2) % GATED_COLUMNS:
            raise ValueError(f"{FAMILY}: a gated activation needs N/2 a multiple of {GATED_COLUMNS}, got N={n}")
        # a tile pairs tile_n / 2 gate columns with as many up columns
        tile_n = 256 if (n // 2) % 128 == 0 and tile_n == 256 else 128
    if spec.preact and spec.bias and spec.activation == "gelu_exact" and spec.c_dtype == "float32":
        # float32's accurate erf beside a bias and the pre-activation output spills 8 bytes of
        # the 128x256 tile's registers (sm_90a); the 128-wide tile has room
        tile_n = 128
    if spec.mode == "ragged_k" and -(-m // TILE_M) * -(-n // 256) * g * l < 2 * num_sms:
        tile_n = 128
    cluster_n = 2 if _multicast_pays(spec, n, tile_n, num_sms) else 1
    return Config(tile_n=tile_n, sms=num_sms, overlap_promote=sm90_gemm.scaled_overlap(spec), cluster_n=cluster_n,
                  tail_split=TAIL_SPLIT if _tail_split_pays(spec, k, g, cluster_n) else 1)


def _tail_split_pays(spec, k, g, cluster_n) -> bool:
    """The tail split (Config.tail_split) for 16-bit ragged_m products on one CTA whose K holds
    two splits' worth of k-tiles at least, with at most 64 groups. The kernel splits only a last,
    partial round of tiles (at most half the grid); to know it, every warp first scans all group
    sizes, 32 a step: with 128 groups that scan cost 1.5% (H200, 2026-11-29)."""
    return (spec.mode == "ragged_m" and not spec.scaled and not spec.preact and cluster_n == 1
            and -(-k // 64) >= 2 * TAIL_MIN_K_TILES and g <= 64)


def _multicast_pays(spec, n, tile_n, num_sms) -> bool:
    """A 1x2 cluster for block-scaled ragged_m: an fp8 128x128 k-tile's MMAs take half the time
    of a 16-bit one's, so without multicast its A and B reads are what the tile waits for. On
    4 x 8192 x 4096 x 7168 (H200, 2026-11-29, one process) 1185 TFLOP/s against 1040 on one CTA,
    results equal bit for bit. 16-bit grouped products ran within -1% and +3% of one CTA, so they
    keep it. An odd count of n-tiles leaves one tile of every row of clusters out of bounds
    (computed, never stored): clusters only where that wastes at most a tenth."""
    tiles = -(-n // tile_n)
    return spec.scaled and spec.mode == "ragged_m" and num_sms % 2 == 0 and (tiles % 2 == 0 or tiles >= 9)


def signature(spec, config) -> abi.Signature:
    return spec.signature(sm90_gemm.workspace_args(kernel_config(spec, config)))


def workspace(spec, config, m, n, k, g, l) -> list[Workspace]:
    """A tail split's: a 128 x tile_n fp32 partial tile per CTA of the grid (the tail has at most
    as many units) and an arrival counter per tail tile (zeroed; the kernel resets what it uses)."""
    if config.tail_split == 1:
        return []
    return [Workspace("splitk_partials", 4 * config.sms * TILE_M * config.tile_n, False),
            Workspace("splitk_flags", 16 * (-(-config.sms // 4)), True)]


def kernel_config(spec, config: Config) -> sm90_gemm.Config:
    """The shared kernel's config: a cooperative 128 x tile_n tile on a 1 x cluster_n cluster
    (tiles start at group rows, so only CTAs along N share a slice to multicast), panels of
    `raster` m-tiles, and the dense kernel's epilogue for the output dtype (16-bit: the whole share of 64-wide subtiles;
    measured on an H200 against the 32-wide ring, 1.02x geometric mean over the grouped suite,
    2026-11-24)."""
    cfg = sm90_gemm.epilogue_for(spec, sm90_gemm.Config(TILE_M, config.tile_n, 1, config.cluster_n, "m", config.raster,
                                                        overlap_promote=config.overlap_promote))
    # (a tail split stores whole tiles as the unsplit walk does: the same epilogue)
    cfg = dataclasses.replace(cfg, split_k=config.tail_split)
    # the pre-activation output's two passes over the whole share (or a ring of 64-wide
    # subtiles) leave the walker's registers short for elementwise activations (an 8-16 byte
    # stack frame with silu): those tiles take the ring of 32-wide subtiles. A gated epilogue's
    # second pass holds half the subtiles and fits.
    if spec.preact and spec.activation not in GATED:
        return dataclasses.replace(cfg, whole_c=False, epi_n=32)
    return cfg


def launcher(spec, config: Config):
    why = unsupported(spec)
    if why:
        raise ValueError(f"{FAMILY}: {why}")
    if config.overlap_promote and not spec.scaled:
        raise ValueError(f"{FAMILY}: overlap_promote applies to block-scaled products only ({config})")
    if spec.scaled and config.tile_n != 128:
        raise ValueError(f"{FAMILY}: block-scaled tiles are 128 x 128 ({config})")
    # (the cluster itself, 1 or 2 CTAs along N and ragged_m only, sm90_gemm.make_launcher checks)
    if config.sms % config.cluster_n:
        raise ValueError(f"{FAMILY}: a grid of {config.sms} CTAs does not divide into clusters of {config.cluster_n}")
    return sm90_gemm.make_launcher(spec, kernel_config(spec, config), config.sms)
