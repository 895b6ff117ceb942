"""The Blackwell GEMM's configuration and shared-memory plan: what both the family modules
(sm100_gemm, sm100_grouped: routing) and the kernel (sm100_kernel, DSL) need. Imports no DSL.
"""

from __future__ import annotations

import dataclasses

NUM_SMS = 148            # B200; bounds the persistent grid (compiled in, like sm90_gemm)
SMEM_BYTES = 232448      # opt-in shared memory per CTA on sm_100
TMEM_COLS = 512          # tensor memory columns per SM
THREADS = 192            # 4 epilogue warps, 1 MMA warp, 1 TMA warp


@dataclasses.dataclass(frozen=True)
class Config:
    """tile_m is the MMA tile (256 needs two_cta: each CTA of a pair owns 128 rows)."""

    tile_m: int = 128
    tile_n: int = 128
    cluster_m: int = 1
    cluster_n: int = 1
    two_cta: bool = False

    def __post_init__(self):
        v = 2 if self.two_cta else 1
        if self.tile_m != 128 * v:
            raise ValueError(f"tile_m {self.tile_m} does not fit two_cta={self.two_cta}")
        if self.tile_n % 32 or not 32 <= self.tile_n <= 256 or self.cluster_m % v:
            raise ValueError(f"bad config {self}")
        if self.cluster_m * self.cluster_n > 16 or any(c & (c - 1) for c in (self.cluster_m, self.cluster_n)):
            raise ValueError(f"cluster {self.cluster_m}x{self.cluster_n} is not a power of two <= 16")

    def key(self) -> str:
        return (f"t{self.tile_m}x{self.tile_n}.c{self.cluster_m}x{self.cluster_n}"
                f".{'2cta' if self.two_cta else '1cta'}")


def ab_stages(config: Config, in_bytes: int, c_stage_bytes: int) -> int:
    """Smem ring depth: what is left after the epilogue staging and barriers."""
    v = 2 if config.two_cta else 1
    bk = 64  # four 16-wide UMMA k-steps of a 16-bit type per stage
    per_stage = (config.tile_m // v + config.tile_n // v) * bk * in_bytes
    return max(2, min(8, (SMEM_BYTES - c_stage_bytes - 2048) // per_stage))
