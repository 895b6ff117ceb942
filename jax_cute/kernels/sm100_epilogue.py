"""The Blackwell GEMM's fused epilogue (DSL parts of sm100_kernel): what runs on one subtile's
float32 accumulators after their TMEM load, before the one rounding to C's dtype.

The arch-neutral pieces are kernels/epilogue.py's mixins, shared with the Hopper kernel:
:class:`~jax_cute.kernels.epilogue.ColumnBiasEpilogue` (a float32 bias per output column),
:class:`~jax_cute.kernels.epilogue.ActivationEpilogue` and
:class:`~jax_cute.kernels.epilogue.DerivativeEpilogue`. :class:`Sm100Epilogue` feeds them the
fragment, its elements' tile coordinates and, for a derivative, Z's values at them; the
pre-activation output's second store is sm100_kernel's (``store_tma``).
"""

from __future__ import annotations

from jax_cute.kernels.bundle import Bundle
from jax_cute.kernels.dsl import cute, cutlass, Float32
from jax_cute.kernels.epilogue import ActivationEpilogue, ColumnBiasEpilogue, DerivativeEpilogue


class EpilogueRegs(Bundle):
    """One epilogue warp's TMEM -> register -> smem copies and store path, the same for every
    tile, and what a fused epilogue reads: the tile coordinates of each subtile's fragment
    elements (T2R, M, N, SUB), the bias, D's TMA atom, TMA tensor and tensor, Z and its
    register fragment, C's extents and the group sizes (grouped)."""

    __slots__ = ("t2r", "tTR_tAcc", "tTR_rAcc", "thr_t2r", "tTR_rC", "r2s", "tRS_rC", "tRS_sC", "n_sub", "epi_tile",
                 "sC", "tma_c", "mC_tma", "mC", "c_pipe", "epi_bar", "tidx", "coords", "bias", "tma_d", "mD_tma",
                 "mD", "mZ", "tTR_rZ", "mM", "nN", "gs")


class Sm100Epilogue(DerivativeEpilogue, ActivationEpilogue, ColumnBiasEpilogue):
    """The fused variants of the Blackwell epilogue (``self.fuse_bias``, ``self.act``,
    ``self.preact``, ``self.dact``), applied to ``ep.tTR_rAcc``, subtile ``s`` of the CTA tile
    whose first row and column are ``at`` = (row, column, batch) and whose bias is ``bias``
    (tile_bias)."""

    fuse_bias: bool
    act: str
    preact: bool
    dact: str

    @property
    def fused(self) -> bool:
        return self.fuse_bias or bool(self.act) or bool(self.dact)

    @property
    def reads_coords(self) -> bool:
        """Whether the epilogue needs its elements' tile coordinates (to read the bias or Z)."""
        return self.fuse_bias or bool(self.dact)

    def tile_bias(self, ep: EpilogueRegs, g, l) -> tuple:
        """(bias, scale) of a tile of group ``g`` and batch ``l``: dense, the (N,) bias and None;
        grouped, the group's row of the (N, G, L or 1) bias (L extent 1: one for every batch) and
        1, or 0 for the zero tail past the last group, which adds none."""
        if self.mode == "dense":
            return ep.bias, None
        n_groups = ep.gs.shape[0]
        row = ep.bias[(None, cutlass.min(g, n_groups - 1), cutlass.min(l, ep.bias.shape[2] - 1))]
        return row, cutlass.select_(g < n_groups, Float32(1.0), Float32(0.0))

    def pre_activation(self, ep: EpilogueRegs, s: int, col, bias: tuple) -> None:
        """The bias of the tile at column ``col`` added: the pre-activation A·B + bias (what D
        stores)."""
        if self.fuse_bias:
            self.add_column_bias(ep.tTR_rAcc, ep.coords[(None, None, None, s)], bias[0], col, ep.nN, bias[1])

    def post_activation(self, ep: EpilogueRegs, s: int, at: tuple) -> None:
        """The activation, or the product scaled by the derivative at Z (what C stores)."""
        self.activate(ep.tTR_rAcc)
        if self.dact:
            self.scale_by_derivative(ep.tTR_rAcc, self.z_fragment(ep, s, at))

    def z_fragment(self, ep: EpilogueRegs, s: int, at: tuple):
        """Z's values at subtile ``s``'s elements, read into ``ep.tTR_rZ``; coordinates past C's
        extents are clamped to its edge (those elements are never stored)."""
        coords, z = ep.coords[(None, None, None, s)], ep.tTR_rZ
        row, col, l = at
        mZ = ep.mZ[(None, None, l)]
        for i in range(cute.size(z)):
            crd = coords[i]
            z[i] = mZ[(cutlass.min(row + crd[0], ep.mM - 1), cutlass.min(col + crd[1], ep.nN - 1))]
        return z
