"""Blackwell (sm_100a) grouped GEMM with device-side group sizes (gemm_spec.GroupedSpec).

Same persistent tcgen05 kernel as ``sm100_gemm`` (TMA multicast loads, UMMA into TMEM,
TMEM -> registers -> smem -> TMA store); only the work decomposition differs, and it is
computed on the device from ``group_sizes`` every time a tile is taken (nothing at compile
or launch time depends on the sizes, so the launch is CUDA-graph safe and needs no workspace):

* ``ragged_m``: each cluster tile covers rows of exactly one group (or of the zero tail past
  the last group). Tiles start at the group's first row, so A rows of another group can
  enter the accumulator only in rows that are never stored: a tile that crosses the group's
  end stores row-predicated from registers instead of by TMA (TMA clips only at M). The
  work list has ceil(M/R) + G + 1 slots per (n-tile, batch); unused slots are skipped.
* ``ragged_k``: one output tile per (m, n, group, batch); the k loop starts at the group's
  first row and the last k-tile's columns past the group's end are zeroed in smem before
  the UMMA reads them. Empty groups are stored as zeros.

Fused epilogues (ragged_m; EPILOGUES): the dense kernel's bias, activation and pre-activation
output, the bias read from the row of the tile's group (the zero rows past the last group take
none); a tile crossing its group's end stores D, like C, row-predicated.

Compile-verified only: never run on hardware.
"""

import math

from jax_cute.kernels import abi
from jax_cute.kernels import epilogue as fused_epilogue
from jax_cute.kernels import sm100_gemm
from jax_cute.kernels.gemm_spec import GroupedSpec, Workspace
from jax_cute.kernels.sm100_gemm import Config

FAMILY = "sm100_grouped"
ARCH = sm100_gemm.ARCH
# fused epilogues of ragged_m specs (GroupedSpec.bias, activation, preact)
EPILOGUES = ("bias", *fused_epilogue.ACTIVATIONS, "preact")

_CANDIDATES = {
    "ragged_m": (
        Config(128, 128),
        Config(128, 256, cluster_m=2),
        Config(256, 256, cluster_m=2, two_cta=True),
    ),
    # ragged_k zeroes the tail k-columns of its own smem before its own UMMA reads them, so
    # it stays with cta_group::1 (a 2-CTA MMA would read the peer's smem unzeroed)
    "ragged_k": (
        Config(128, 128),
        Config(128, 256, cluster_m=2),
        Config(128, 128, cluster_n=2),
    ),
}


def unsupported(spec) -> str | None:
    if not isinstance(spec, GroupedSpec) or spec.mode not in _CANDIDATES:
        return f"sm100_grouped: unsupported spec {spec}"
    if spec.lead:
        return "sm100_grouped takes no lead of rows before the groups (ragged_dot's group_offset)"
    return sm100_gemm.unsupported(spec)


def candidate_configs(spec) -> list[Config]:
    return [] if unsupported(spec) else list(_CANDIDATES[spec.mode])


def heuristic(spec, m, n, k, g, l, num_sms: int = 148) -> Config:
    """Group sizes are unknown on the host: size tiles for the total (M for ragged_m,
    M x N x G output tiles for ragged_k)."""
    cands = _CANDIDATES[spec.mode]
    if spec.mode == "ragged_m":
        tiles = math.ceil(m / 256) * math.ceil(n / 256) * l
        cfg = cands[2] if tiles >= num_sms else cands[1] if n >= 256 and tiles * 2 >= num_sms else cands[0]
    else:
        tiles = math.ceil(m / 128) * math.ceil(n / 256) * g * l
        cfg = cands[1] if tiles >= num_sms and n >= 256 else cands[0]
    return cfg


def signature(spec, config) -> abi.Signature:
    return spec.signature()


def workspace(spec, config, m, n, k, g, l) -> list[Workspace]:
    return []


def launcher(spec, config):
    if why := unsupported(spec):
        raise ValueError(why)
    if spec.mode == "ragged_k" and config.two_cta:
        raise ValueError("sm100_grouped: ragged_k runs with cta_group::1 only")
    return sm100_gemm.make_launcher(spec, config)
