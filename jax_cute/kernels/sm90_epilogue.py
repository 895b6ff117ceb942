"""The Hopper GEMM's epilogue (DSL parts of sm90_kernel): accumulators -> output dtype -> shared
memory ring -> TMA store, one 64 x epi_n subtile at a time, and the fused variants as small
mixins the kernel class composes:

- :class:`BiasEpilogue`: the float32 bias of each output column (grouped: of the tile's group);
- :class:`GatedEpilogue`: B's N mode read as paired [gate | up] halves, C half as wide;
- :class:`PreactEpilogue`: the pre-activation A·B + bias as a second output D;
- :class:`DActEpilogue`: the product scaled by an activation's derivative at an input Z;
- :class:`~jax_cute.kernels.epilogue.ActivationEpilogue` (arch-neutral, in kernels/epilogue.py):
  an elementwise activation of the float32 fragment.

:class:`Sm90Epilogue` runs the subtile loop and calls each variant's hook where its math goes;
a hook whose variant the spec does not ask for emits nothing.

The activations themselves (and their derivatives) are kernels/epilogue.py's table, which any
arch's epilogue applies to float32 fragments.
"""

from __future__ import annotations


from jax_cute.kernels import epilogue as fused_epilogue
from jax_cute.kernels.epilogue import ActivationEpilogue
from jax_cute.kernels.bundle import Bundle
from jax_cute.kernels.dsl import cute, cutlass, cpasync, Float32

const_expr = cutlass.const_expr
range_constexpr = cutlass.range_constexpr

_DACT_CHUNK = 8             # fragment elements a dact epilogue takes the derivative of at once


def paired_halves(t, dim: int, h: int):
    """``t`` with its N mode ``dim`` (extent N: [gate | up] halves) read as (h, 2, N / 2h):
    each bn = 2h columns of the result are h gate columns followed by the h up columns that
    pair with them (a gated epilogue; N / 2 is a multiple of h)."""
    n, s = t.shape[dim], t.stride[dim]
    half = n // 2
    shape = tuple((h, 2, half // h) if i == dim else t.shape[i] for i in range(cute.rank(t)))
    stride = tuple((s, s * half, s * h) if i == dim else t.stride[i] for i in range(cute.rank(t)))
    return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=stride))


def aligned_view(c, n_major: bool):
    """C (M, N, L)'s memory viewed with its strides rounded up to multiples of 16 bytes: a tensor
    a TMA tensor map can describe, for an output whose own strides cannot (GemmSpec.c_aligned
    False), whose TMA atom never stores."""
    div = 128 // c.element_type.width
    m, n = c.shape[0], c.shape[1]
    inner = n if n_major else m
    row = cute.assume((cutlass.Int64(inner) + div - 1) // div * div, divby=div)
    batch = cute.assume(row * (m if n_major else n), divby=div)
    stride = (row, 1, batch) if n_major else (1, row, batch)
    return cute.make_tensor(c.iterator, cute.make_layout(c.shape, stride=stride))


class WarpgroupEpilogue(Bundle):
    """What one consumer warpgroup's epilogue uses for every tile, built once per kernel: its
    smem ring and register fragments, its barrier, store warp and ring slots."""

    __slots__ = (
        "sC",  # the smem ring (both warpgroups' halves)
        "r2s",  # registers -> smem tiled copy
        "tRS_r32",  # one subtile in float32
        "tRS_rC",  # one subtile in the output dtype
        "tRS_sC",  # this thread's view of the ring
        "n_rd",  # fragment elements per subtile
        "n_epi",  # subtiles per warpgroup and tile
        "row_blk",  # the warpgroup's first 64-row block of a tile
        "epi_bar",  # its named barrier
        "warp_id",
        "etid",  # thread index inside the warpgroup
        "store_warp",  # the warp that issues its TMA stores
        "buf0",  # its first ring slot
        "gmem_c",  # C as laid out in global memory
        "ragged",  # C's contiguous extent is not a multiple of 16 bytes (dense)
        "coords",  # bias: each fragment element's (row, column) in the tile
        "tRS_u32",  # gated: the up values' fragment (the gate's is tRS_r32)
    )


class BiasEpilogue:
    """A float32 bias per output column (grouped: the tile's group's row), added to the
    accumulators before anything else."""

    def bias_of(self, bias, coords, i: int, tn, gmem_c):
        """The float32 bias of fragment element ``i``'s product column in tile column ``tn``;
        columns past N read the last bias (they are never stored). Gated: the bias is paired
        like B, whose N the tiles divide. Grouped: ``bias`` is (the group's row, its weight:
        1, or 0 for the zero tail)."""
        col = tn * self.bn + coords[i][1]
        if const_expr(not self.glu):
            col = cutlass.min(col, gmem_c.shape[1] - 1)
        if const_expr(self.mode != "dense"):
            row, keep = bias
            return row[col] * keep
        return bias[col]

    def add_bias_first(self, wge: WarpgroupEpilogue, tRS_acc, bias, tn) -> None:
        """The bias added into all of a tile's accumulators before the passes (pingpong with a
        pre-activation output: each tile compiles without spills only in its own order)."""
        n_rd, coords, gmem_c = wge.n_rd, wge.coords, wge.gmem_c
        if const_expr(self.fuse_bias):
            for e in range(wge.n_epi):
                for v in range(n_rd):
                    i = e * n_rd + v
                    tRS_acc[i] = tRS_acc[i] + self.bias_of(bias, coords, i, tn, gmem_c)

    def add_bias(self, wge: WarpgroupEpilogue, tRS_acc, src: int, last: bool, bias, tn) -> None:
        """Subtile ``src``'s bias, added to its float32 values (and, before a second pass,
        stored back into the accumulators)."""
        tRS_r32, n_rd, coords, gmem_c = wge.tRS_r32, wge.n_rd, wge.coords, wge.gmem_c
        for v in range(n_rd):
            tRS_r32[v] = tRS_r32[v] + self.bias_of(bias, coords, src * n_rd + v, tn, gmem_c)
        if const_expr(not last):
            for v in range(n_rd):
                tRS_acc[src * n_rd + v] = tRS_r32[v]


class GatedEpilogue:
    """A gated activation (GemmSpec.activation in GATED): B's N holds [gate | up] halves, read
    paired (:func:`paired_halves`) so one fragment holds both; C's tiles are half as wide."""

    def gate(self, wge: WarpgroupEpilogue, tRS_acc, src: int, add_bias: bool, bias, tn) -> None:
        """The gated activation of gate subtile ``src`` (in ``tRS_r32``) and the up subtile half
        a row block to its right."""
        tRS_r32, tRS_u32, n_rd, coords, gmem_c = wge.tRS_r32, wge.tRS_u32, wge.n_rd, wge.coords, wge.gmem_c
        per_row = self.bn // self.epi_tile[1]
        up = (src + per_row // 2) * n_rd
        for v in range(n_rd):
            tRS_u32[v] = tRS_acc[up + v]
        if const_expr(add_bias):
            for v in range(n_rd):
                tRS_u32[v] = tRS_u32[v] + self.bias_of(bias, coords, up + v, tn, gmem_c)
        tRS_r32.store(fused_epilogue.gated(self.act, tRS_r32.load(), tRS_u32.load(),
                                           fast=self.c_t.width == 16))


class PreactEpilogue:
    """The pre-activation output D (GemmSpec.preact): a first pass over the subtiles stores
    A·B + bias in D's dtype before the activation's pass stores C."""

    def half_tiles(self, mD):
        """Gated: D's tiles (bn / 2 wide) from a gate tile to the up tile paired with it."""
        return (mD.shape[1] // 2) // self.cbn if const_expr(self.glu) else 0

    def d_tiles(self, gate, up):
        """The pre-activation's output tiles of a product tile: one, or (gated) the gate
        tile and the up tile its second half of columns goes to."""
        return (gate, up) if const_expr(self.glu) else (gate,)

    def d_partitions(self, pre, sC) -> tuple | None:
        """The TMA partitions of each D tile (d_tiles) of ``pre`` = (atom, tiles, tensor)."""
        if const_expr(self.preact):
            return tuple(cpasync.tma_partition(pre[0], 0, cute.make_layout(1), cute.group_modes(sC, 0, 2),
                                               cute.zipped_divide(t, self.epi_tile))[1] for t in pre[1])
        return None


class DActEpilogue:
    """An activation's derivative at Z (GemmSpec.dact) scaling the product, Z read from global
    memory at the accumulators' coordinates."""

    @cute.jit
    def z_tile(self, tZ, mZ, at, off, tm, tn):
        """What scale_by_dact reads tile (tm, tn)'s Z with: this thread's elements ``tZ``
        (ordered like tRS_acc), a view with Z's strides at the first of them, their static
        offsets ``off`` from it (``at``: its tile coordinates), the rows and columns Z has
        left from it, and whether the tile lies inside Z."""
        near = cute.make_tensor(tZ.iterator, cute.make_layout((self.bm, self.bn),
                                                              stride=(mZ.stride[0], mZ.stride[1])))
        inside = (tm + 1) * self.bm <= mZ.shape[0] and (tn + 1) * self.bn <= mZ.shape[1]
        return (tZ, near, off, mZ.shape[0] - tm * self.bm - at[0], mZ.shape[1] - tn * self.bn - at[1],
                inside)

    @cute.jit
    def scale_by_dact(self, z, tRS_z, tRS_r32, src: cutlass.Constexpr, n_rd: cutlass.Constexpr):
        """``tRS_r32`` times act'(Z) at the elements of accumulator subtile ``src`` (``z``: see
        z_tile), with Z read into ``tRS_z``.

        Inside Z every load of the subtile is issued before the derivative (a 16-bit Z
        contiguous along N is read in pairs, 32 bits a load). On Z's edge the coordinates are
        clamped to its extents (elements past them are never stored) and the subtile goes in
        halves, each under a branch that skips a half lying wholly past the edge: loads are not
        hoisted out of a branch, so half of them are in flight (all 32 clamped 16-bit loads of
        a 128x256 tile's subtile, next to its 128 accumulators, spilled)."""
        tZ, near, off, m_left, n_left, inside = z
        fast = self.c_t.width == 16
        if inside:
            for v in range_constexpr(n_rd):
                tRS_z[v] = tZ[src * n_rd + v]
            self.scale_chunks(tRS_z, tRS_r32, 0, n_rd, fast)
        else:
            half = n_rd // 2
            for h in range_constexpr(0, n_rd, half):
                els = [src * n_rd + v for v in range(h, h + half)]
                if min(off[i][0] for i in els) < m_left and min(off[i][1] for i in els) < n_left:
                    for v in range_constexpr(h, h + half):
                        i = src * n_rd + v
                        r, c = cutlass.min(off[i][0], m_left - 1), cutlass.min(off[i][1], n_left - 1)
                        tRS_z[v] = near[(r, c)]
                    self.scale_chunks(tRS_z, tRS_r32, h, half, fast)

    @cute.jit
    def scale_chunks(self, tRS_z, tRS_r32, first: cutlass.Constexpr, count: cutlass.Constexpr,
                     fast: cutlass.Constexpr):
        """Elements [first, first + count) of ``tRS_r32`` times act'(``tRS_z``), _DACT_CHUNK at a
        time: over a whole subtile the derivative's temporaries, next to the tile's
        accumulators, spilled."""
        for h in range_constexpr(first, first + count, _DACT_CHUNK):
            zs = cute.make_tensor(tRS_z.iterator + h, cute.make_layout(_DACT_CHUNK))
            gs = cute.make_tensor(tRS_r32.iterator + h, cute.make_layout(_DACT_CHUNK))
            gs.store(fused_epilogue.scaled_by_derivative(self.dact, zs.load().to(Float32), gs.load(), fast=fast))


class Sm90Epilogue(DActEpilogue, PreactEpilogue, GatedEpilogue, ActivationEpilogue, BiasEpilogue):
    """Each consumer warpgroup's store of its rows of a tile, with the fused variants' hooks."""

    @cute.jit
    def epilogue(self, wge: WarpgroupEpilogue, tma_c, gC_t, tRS_acc, tm, tn, l, converted: cutlass.Constexpr = False,
                 bias=None, pre=None, z=None):
        """One warpgroup's rows of the tile: acc -> output dtype -> smem ring -> TMA store,
        one 64 x epi_n subtile at a time, one named barrier per subtile.

        whole_c: the ring has a slot per subtile. After one wait for the previous tile's
        stores (issued a mainloop ago), each subtile's store is issued as soon as it is
        written, and nobody waits on them until the next tile's epilogue. (Issuing them all
        after the last subtile takes the same epilogue time, and the next mainloop runs ~2%
        slower per k-tile at K = 1024 on an H200.)

        Otherwise the ring (depth d) is used round-robin across tiles (n_epi is a multiple of
        d). After committing subtile e the store warp waits until at most d - 2 stores still
        read smem, so by the next barrier the buffer that subtile e + 2 refills is free; a
        1-deep ring needs a second barrier instead.

        A subtile that crosses C's contiguous edge while that edge is not 16-byte aligned
        (`ragged`) is written by all the warpgroup's threads with predicated stores instead.
        ``converted``: ``tRS_acc`` already holds the output dtype (the deferred epilogue's copy).
        ``l``: the tile's batch coordinate in ``gmem_c`` (a tuple with three batch modes).
        ``pre``: (TMA atom, tile, tensor) of the pre-activation output D (GemmSpec.preact):
        a first pass over the subtiles stores D's values (ring positions e, then n_epi + e).
        ``z``: a dact epilogue's reads of the pre-activation input Z (unsplit dense tiles; see
        z_tile).
        """
        sC, tRS_r32, tRS_rC, n_rd, n_epi = wge.sC, wge.tRS_r32, wge.tRS_rC, wge.n_rd, wge.n_epi
        row_blk, epi_bar, warp_id, store_warp = wge.row_blk, wge.epi_bar, wge.warp_id, wge.store_warp
        bSG_sC, bSG_gC = cpasync.tma_partition(
            tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2),
            cute.zipped_divide(gC_t, self.epi_tile))
        bSG_gD = self.d_partitions(pre, sC)   # per D tile (d_tiles)
        em = self.epi_tile[0]
        per_row = self.bn // self.epi_tile[1]
        if const_expr(self.cfg.whole_c):
            # one slot per subtile: the previous tile's stores left them a mainloop ago
            if warp_id == store_warp:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            epi_bar.arrive_and_wait()
        passes = 2 if const_expr(self.preact) else 1
        tRS_z = cute.make_rmem_tensor(tRS_r32.shape, self.c_t) if const_expr(self.dact) else None
        # Both passes start from A·B + bias, added in place into the accumulators: before the
        # passes (pingpong) or by the first pass (cooperative). ptxas keeps every register of
        # these tiles busy, and each tile compiles without spills only in its own order.
        bias_first = self.preact and self.pp
        if const_expr(bias_first):
            self.add_bias_first(wge, tRS_acc, bias, tn)
        for p in range_constexpr(passes):
            last = p == passes - 1   # (static) the pass that writes C
            if const_expr(p == 1):
                if const_expr(self.cfg.whole_c):
                    # the first pass's stores must have read the slots the second one refills
                    if warp_id == store_warp:
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
                    epi_bar.arrive_and_wait()
            # a gated activation's C pass pairs each gate subtile (first half of a row block's
            # columns) with the up subtile half a row block to its right: half the subtiles
            gate = self.glu and last
            per_out = per_row // 2 if const_expr(gate) else per_row
            for e in range_constexpr(n_epi // 2 if const_expr(gate) else n_epi):
                blk, e_n = row_blk + self.blk_step * (e // per_out), e % per_out
                src = (e // per_out) * per_row + e_n   # the accumulator subtile (gate's)
                m0 = tm * self.bm + blk * em
                n0 = tn * (self.cbn if const_expr(last) else self.bn) + e_n * self.epi_tile[1]
                if const_expr(converted):
                    for v in range_constexpr(n_rd):
                        tRS_rC[v] = tRS_acc[src * n_rd + v]
                else:
                    add_bias = self.fuse_bias and p == 0 and not bias_first
                    self.visit_subtile(wge, tRS_acc, src, last, add_bias, bias, tn, z, tRS_z)
                if const_expr(last):
                    self.store_subtile(wge, tma_c, bSG_sC, bSG_gC, wge.gmem_c, p * n_epi + e, blk, e_n, m0, n0, l)
                else:
                    # (gated: the gate and up halves of the row block go to their own D tiles)
                    half = per_row // 2 if const_expr(self.glu) else per_row
                    self.store_subtile(wge, pre[0], bSG_sC, bSG_gD[e_n // half], pre[2], e, blk, e_n % half, m0, n0, l)

    def visit_subtile(self, wge: WarpgroupEpilogue, tRS_acc, src: int, last: bool, add_bias: bool, bias, tn, z,
                      tRS_z) -> None:
        """Accumulator subtile ``src`` -> float32 -> each fused variant's hook -> ``wge.tRS_rC``
        in the output dtype. ``last``: the pass that writes C (a first pass writes D)."""
        tRS_r32, n_rd = wge.tRS_r32, wge.n_rd
        for v in range(n_rd):
            tRS_r32[v] = tRS_acc[src * n_rd + v]
        if const_expr(add_bias):
            self.add_bias(wge, tRS_acc, src, last, bias, tn)
        if const_expr(self.glu and last):
            self.gate(wge, tRS_acc, src, add_bias, bias, tn)
        elif const_expr(last):   # (nested: the DSL's rewritten `and` takes no str like self.act)
            self.activate(tRS_r32)
            if const_expr(self.dact):
                self.scale_by_dact(z, tRS_z, tRS_r32, src, n_rd)
        wge.tRS_rC.store(tRS_r32.load().to(self.c_t))

    def subtile_coord(self, idx, c_n: bool):
        """(row, column) in a subtile of its ``idx``-th element, consecutive ones along C's
        contiguous mode (N if ``c_n``, else M): how the element-wise stores walk a subtile."""
        em, en = self.epi_tile
        if c_n:
            return idx // en, idx % en
        return idx % em, idx // em

    @cute.jit
    def store_subtile(self, wge: WarpgroupEpilogue, tma, bSG_sC, bSG_g, gmem, pos: cutlass.Constexpr, blk, e_n,
                      m0, n0, l):
        """Registers ``wge.tRS_rC`` -> ring slot of position ``pos`` -> subtile (blk, e_n) of the
        output ``gmem`` (TMA atom ``tma``, tile partition ``bSG_g``); see epilogue()."""
        sC, r2s, tRS_rC, tRS_sC, ragged, etid = wge.sC, wge.r2s, wge.tRS_rC, wge.tRS_sC, wge.ragged, wge.etid
        store_warp, buf0, epi_bar, warp_id = wge.store_warp, wge.buf0, wge.epi_bar, wge.warp_id
        em, en = self.epi_tile
        depth = self.epi_stages
        c_n = self.c_lay.is_n_major_c()
        m_ext, n_ext = gmem.shape[0], gmem.shape[1]
        buf = buf0 + pos % depth
        cute.copy(r2s, tRS_rC, tRS_sC[(None, None, None, buf)])
        # generic-proxy smem writes must be visible to the TMA (async proxy) store
        cute.arch.fence_proxy("async.shared", space="cta")
        epi_bar.arrive_and_wait()
        edge = True   # an unaligned C: every subtile (its TMA atom never stores)
        if const_expr(self.c_aligned):
            edge = ragged and ((n0 + en > n_ext) if const_expr(c_n) else (m0 + em > m_ext))
        if const_expr(self.mode == "dense"):   # (grouped: never ragged, C may be rank 4)
            if edge:
                if const_expr(self.nb > 1):
                    gmem_t = gmem[(None, None, l)]   # one batch offset held live, not three
                n_it = (em * en) // self.epi_threads
                if const_expr(self.c_aligned):
                    # a ragged edge: each value read where it is stored (fewest registers: beside
                    # a deferred epilogue, reading ahead spills)
                    for it in range_constexpr(n_it):
                        r, q = self.subtile_coord(etid + it * self.epi_threads, c_n)
                        if m0 + r < m_ext and n0 + q < n_ext:
                            if const_expr(self.nb == 1):
                                gmem[(m0 + r, n0 + q, l)] = sC[(r, q, buf)]
                            else:
                                gmem_t[(m0 + r, n0 + q)] = sC[(r, q, buf)]
                else:
                    # every subtile: all of a thread's values read from shared memory first,
                    # outside the bounds checks (read and stored one by one, each store waited
                    # for its read's latency)
                    vals, coords = [], []
                    for it in range_constexpr(n_it):
                        r, q = self.subtile_coord(etid + it * self.epi_threads, c_n)
                        vals.append(sC[(r, q, buf)])
                        coords.append((r, q))
                    for it in range_constexpr(n_it):
                        r, q = coords[it]
                        if m0 + r < m_ext and n0 + q < n_ext:
                            if const_expr(self.nb == 1):
                                gmem[(m0 + r, n0 + q, l)] = vals[it]
                            else:
                                gmem_t[(m0 + r, n0 + q)] = vals[it]
        if warp_id == store_warp:
            if not edge:
                cute.copy(tma, bSG_sC[(None, buf)], bSG_g[(None, (blk, e_n))])
            cute.arch.cp_async_bulk_commit_group()
            if const_expr(not self.cfg.whole_c):
                cute.arch.cp_async_bulk_wait_group(max(depth - 2, 0), read=True)
        if const_expr(depth == 1):
            epi_bar.arrive_and_wait()
