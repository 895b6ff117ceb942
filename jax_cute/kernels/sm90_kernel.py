"""The Hopper GEMM kernel (family sm90_gemm, and sm90_grouped's schedulers): the DSL half.

sm90_gemm holds the design notes, configs and everything routing needs; this module imports the
DSL and is imported only when a kernel is built (sm90_gemm.make_launcher).
"""

from __future__ import annotations


from jax_cute.kernels import epilogue as fused_epilogue
from jax_cute.kernels import abi
from jax_cute.kernels.bundle import Bundle
from jax_cute.kernels.dsl import cute, cutlass, pipeline, sm90_utils, cpasync, warpgroup, warp
from jax_cute.kernels.dsl import memory, LayoutEnum
from jax_cute.kernels.dsl import Int32, Int64, Float32
from jax_cute.kernels.gemm_spec import SCALE_K, GemmSpec, GroupedSpec
from jax_cute.kernels.sm90_config import (SCALE_ALIGN, Config, co_resident_clusters, is_gated, scale_origin,
                                          scale_slack, scale_stage_bytes, stage_plan, tile_k, wg_rows)
from jax_cute.kernels.sm90_epilogue import Sm90Epilogue, WarpgroupEpilogue, aligned_view, paired_halves
from jax_cute.kernels.launch import launcher_for
from jax_cute.kernels.sm90_mainloop import mainloop_finish, mainloop_rest, mainloop_start
from jax_cute.kernels.sm90_scaled import ScaledMainloop, ScaleLoads
from jax_cute.kernels.sm90_schedulers import DenseRaster, ragged_tensor, scheduler_for, split_range

const_expr = cutlass.const_expr
range_constexpr = cutlass.range_constexpr

_ITEM_OF = {16: 2, 32: 4}   # output element width in bits -> bytes


class Cta(Bundle):
    """What every warp of the CTA sees: the kernel's arguments (see Sm90Gemm.kernel), its smem
    tensors and A/B pipeline, and where the thread sits."""

    __slots__ = (
        "tma_a",
        "mA",
        "tma_b",
        "mB",
        "tma_c",
        "mC",
        "gmem_c",
        "ws",  # dense: split-K partials (or None); grouped: the group sizes
        "flags",  # dense: split-K counters (or None); grouped: K
        "bias",
        "tma_d",
        "mD",
        "gmem_d",
        "mZ",
        "tiled_mma",
        "wg_mma",
        "sA",
        "sB",
        "sC",
        "st",  # the smem struct (barriers, split-K's arrival flag)
        "ab_pipe",
        "a_mask",
        "b_mask",
        "tidx",
        "warp_id",
        "wg",
        "cc",  # the CTA's coordinate in its cluster
        "scales",  # block-scaled: sm90_scaled.ScaleLoads, else None
        "tail_ws",  # grouped tail split (Config.split_k > 1): the tail units' fp32 partials, else None
        "tail_flags",  # its per-tile arrival counters, else None
    )


class Schedule(Bundle):
    """The tile schedule's extents and partitions (dense or grouped fields), and the CTA's
    first unit and stride."""

    __slots__ = (
        "la_last",  # A's and B's last batch (or extents with three batch modes)
        "lb_last",
        "first",
        "stride",
        # dense
        "k_tiles",
        "cl_m",
        "cl_n",
        "batches",
        "total",
        "c_ext",
        "tAsA",
        "tAgA",
        "tBsB",
        "tBgB",
        "gC",
        "gD",
        "gZ",
        # grouped
        "gs",
        "ext",
    )


class Consumer(Bundle):
    """One consumer warpgroup's MMA state and epilogue."""

    __slots__ = (
        "tiled_mma",
        "acc",
        "tCrA",
        "tCrB",
        "tRS_acc",
        "frag",
        "acc_flat",
        "ctid",
        "turn_mine",
        "turn_other",
        "both_bar",
        "z_thr",
        "z_at",
        "z_off",
        "wge",
        "ts",  # block-scaled: the thread's scales (sm90_scaled.ThreadScales), else None
    )


class Sm90Gemm(ScaledMainloop, Sm90Epilogue):
    """The persistent warp-specialised Hopper GEMM of one spec and config (see sm90_gemm's notes):
    ``run`` (host) builds the TMA atoms and launches ``kernel``, whose producer and consumer
    parts take their tiles from ``self.sched`` (sm90_schedulers), run the mainloop
    (sm90_mainloop) and store through the epilogue and its variants' hooks (sm90_epilogue)."""

    def __init__(self, spec: GemmSpec | GroupedSpec, config: Config, sms: int):
        # the tile scheduler: the dense raster, or a GroupedSpec's ragged_m / ragged_k walk
        self.mode = spec.mode if isinstance(spec, GroupedSpec) else "dense"
        self.nb = 1 if isinstance(spec, GroupedSpec) else spec.batch_modes
        self.sms = sms          # SMs the grid may fill (dense: a cap, grouped: its size)
        self.sched = scheduler_for(spec, config)
        self.cfg = config
        self.bm, self.bn, self.bk = config.tile_m, config.tile_n, tile_k(spec.a_dtype)
        self.cm, self.cn = config.cluster_m, config.cluster_n
        self.split = config.split_k
        self.pp = config.pingpong
        # block-scaled fp8 (sm90_scaled): rows of A and of B per scale, 0 when unscaled
        self.a_block, self.b_block = getattr(spec, "a_block", 0), getattr(spec, "b_block", 0)
        self.scaled = self.a_block > 0
        # rows A's scale box holds beyond the tile's (ragged_m: boxes start 16-byte aligned)
        self.a_slack = scale_slack(spec) if self.scaled else 0
        self.ab_stages, self.epi_stages = stage_plan(
            config.tile_n, spec.c_dtype, config.stages, self.pp, config.epi_n, config.tile_m, config.whole_c,
            is_gated(spec), scale_stage_bytes(config.tile_m, config.tile_n, self.a_block, self.b_block, self.a_slack))
        # every consumer warpgroup stores its own 64 output rows (its own named barrier, smem
        # ring and store warp), so neither waits on the other between mainloops
        self.epi_tile = (64, config.epi_n)
        # rows of each tile a consumer warpgroup owns, and the step between its 64-row blocks
        # (cooperative tiles interleave the warpgroups' blocks: 0, 2 and 1, 3 of 256 rows)
        self.wg_rows = wg_rows(config.tile_m, self.pp)
        self.blk_step = 1 if self.pp else 2
        # fused epilogue: bias per output column (grouped: the tile's group's row), then the activation
        self.fuse_bias = spec.bias
        self.act = spec.activation
        self.preact = spec.preact
        # C's strides not multiples of 16 bytes: every subtile is stored per element (no TMA store)
        self.c_aligned = getattr(spec, "c_aligned", True)
        # the derivative of this activation at z scales the product (dense, unsplit tiles)
        self.dact = getattr(spec, "dact", "")
        # gated activation: B's N mode paired (paired_halves); C's (and D's) tiles are half as wide
        self.glu = self.act in fused_epilogue.GATED
        self.cbn = self.bn // 2 if self.glu else self.bn
        # registers per thread (setmaxnreg; 40 + 2 x 232 fill the 64K register file): the
        # overlapped promotion's two partial fragments, and a 256-row block-scaled tile's partial
        # fragment beside 128 accumulators, take 8 of the producer's
        wide = config.overlap_promote or (self.scaled and config.tile_m == 256)
        self.producer_regs, self.consumer_regs = (24, 240) if wide else (40, 232)
        self.threads = 384
        self.mma_threads = 256
        self.epi_threads = 128

    # ----------------------------------------------------------------------- host side
    def launch(self, a, b, c, stream, group_sizes=None, bias=None, d=None, z=None, splitk_partials=None,
               splitk_flags=None, sa=None, sb=None) -> None:
        """The launcher's body (kernels/launch.py), its arguments named as the ABI signature
        names them (sm90_gemm.signature, GroupedSpec.signature)."""
        scales = (sa, sb) if self.scaled else None
        if isinstance(self.sched, DenseRaster):
            self.run(a, b, c, splitk_partials, splitk_flags, stream, bias, d, z, scales)
        else:
            self.run(a, b, c, group_sizes, None, stream, bias, d, None, scales, (splitk_partials, splitk_flags))

    @cute.jit
    def run(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, ws, flags, stream, bias=None, d=None,
            z=None, scales=None, tail=(None, None)):
        """Dense: ``ws``/``flags`` are the split-K partials and arrival counters (or None),
        ``bias`` the fused epilogue's float32 (N,) bias (or None), ``d`` its pre-activation
        output (or None), ``z`` a dact epilogue's pre-activation input (or None), ``scales``
        a block-scaled product's (sa, sb) (or None).
        Grouped: ``ws`` holds the group sizes; the kernel gets K in ``flags``; ``bias`` is
        (N, G, L or 1); ``tail`` the tail split's (partials, counters) (or Nones)."""
        if const_expr(self.glu):
            b = paired_halves(b, 0, self.bn // 2)
            if const_expr(self.mode != "dense"):
                # (N', K, G, L) -> (N', K, G): a TMA tensor has at most five dimensions, and
                # the paired N takes three (fused grouped launches have one batch)
                b = b[(None, None, None, 0)]
            if const_expr(self.fuse_bias):
                bias = paired_halves(bias, 0, self.bn // 2)
            if const_expr(self.scaled and self.b_block == 1):   # per-column B scales, paired as B's columns
                # (per 64 paired columns, gemm_spec.PAIRED_BLOCK, they come in the paired order)
                scales = (scales[0], paired_halves(scales[1], 0, self.bn // 2))
        if const_expr(self.nb > 1):
            # (rows, cols, L0, L1, L2) -> (rows, cols, (L0, L1, L2)): tiles and TMA views see
            # one (nested) batch mode; the TMA tensor maps still span all five dimensions
            a, b, c = cute.group_modes(a, 2, 5), cute.group_modes(b, 2, 5), cute.group_modes(c, 2, 5)
            if const_expr(self.preact):
                d = cute.group_modes(d, 2, 5)
        # A and B share a dtype, except fp8, where WGMMA multiplies e4m3 by e5m2 as well
        a_t, b_t, c_t = a.element_type, b.element_type, c.element_type
        self.a_t, self.b_t, self.c_t = a_t, b_t, c_t
        a_lay, b_lay = LayoutEnum.from_tensor(a), LayoutEnum.from_tensor(b)
        c_lay = LayoutEnum.from_tensor(c)
        self.c_lay = c_lay
        def warpgroups_mma(along_m):
            return sm90_utils.make_trivial_tiled_mma(
                a_t, b_t, a_lay.sm90_mma_major_mode(), b_lay.sm90_mma_major_mode(), Float32,
                (along_m, 1, 1), tiler_mn=(64, self.bn))
        tiled_mma = warpgroups_mma(1 if self.pp else 2)
        # one warpgroup's 64 x bn share of the tile: the epilogue's register layout
        wg_mma = warpgroups_mma(1)
        a_k = a_lay.sm90_mma_major_mode() == cute.nvgpu.OperandMajorMode.K
        b_k = b_lay.sm90_mma_major_mode() == cute.nvgpu.OperandMajorMode.K
        # Swizzled smem layouts WGMMA reads directly (128B atoms along the major mode).
        sa = cute.tile_to_shape(
            warpgroup.make_smem_layout_atom(
                sm90_utils.get_smem_layout_atom(a_lay, a_t, self.bk if a_k else self.bm), a_t),
            (self.bm, self.bk, self.ab_stages), order=(0, 1, 2) if a_k else (1, 0, 2))
        sb = cute.tile_to_shape(
            warpgroup.make_smem_layout_atom(
                sm90_utils.get_smem_layout_atom(b_lay, b_t, self.bk if b_k else self.bn), b_t),
            (self.bn, self.bk, self.ab_stages), order=(0, 1, 2) if b_k else (1, 0, 2))
        c_n = c_lay.is_n_major_c()
        sc = cute.tile_to_shape(
            warpgroup.make_smem_layout_atom(
                sm90_utils.get_smem_layout_atom(
                    c_lay, c_t, self.epi_tile[1] if c_n else self.epi_tile[0]), c_t),
            (*self.epi_tile, self.epi_stages * 2), order=(0, 1, 2) if c_n else (1, 0, 2))

        # TMA: A multicast along the cluster's N extent, B along its M extent.
        def load_atom(t, s_staged, box, mcast):
            op = cpasync.CopyBulkTensorTileG2SMulticastOp() if mcast > 1 else cpasync.CopyBulkTensorTileG2SOp()
            return cpasync.make_tiled_tma_atom(op, t, cute.slice_(s_staged, (None, None, 0)), box,
                                               num_multicast=mcast)

        # grouped: the ragged mode of the TMA views is clipped at each tile's group end
        a_src, b_src, c_dst, d_dst = a, b, c, d
        if const_expr(self.mode == "ragged_m"):
            c_dst = ragged_tensor(c, 0)
            if const_expr(self.preact):
                d_dst = ragged_tensor(d, 0)
        if const_expr(self.mode == "ragged_k" and not self.scaled):
            # (block-scaled: K-major groups at multiples of 128, zero-filled; see RaggedK)
            a_src, b_src = ragged_tensor(a, 1), ragged_tensor(b, 1)
        tma_a, tA = load_atom(a_src, sa, (self.bm, self.bk), self.cn)
        tma_b, tB = load_atom(b_src, sb, (self.bn, self.bk), self.cm)
        if const_expr(not self.c_aligned):
            # the TMA atom is built (the epilogue's partitions take its shapes) but never stores:
            # over a view of C's memory with its strides rounded up to 16 bytes, a legal tensor map
            c_dst = aligned_view(c, c_n)
        tma_c, tC = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), c_dst, cute.slice_(sc, (None, None, 0)), self.epi_tile)
        tma_d, tD = None, None
        if const_expr(self.preact):   # d: c's dtype and layout, so c's staging ring serves it
            tma_d, tD = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), d_dst, cute.slice_(sc, (None, None, 0)), self.epi_tile)
        if const_expr(self.scaled):   # (tma_sa or None, sa's TMA or global tensor, tma_sb, sb's)
            scales = self.scale_atoms(*scales)

        if const_expr(self.mode == "dense"):
            # Persistent grid: one cluster per resident slot of the SMs it may fill, never more
            # than there are units.
            tiles_m = (c.shape[0] + self.bm - 1) // self.bm
            tiles_n = (c.shape[1] + self.cbn - 1) // self.cbn
            units = ((tiles_m + self.cm - 1) // self.cm) * ((tiles_n + self.cn - 1) // self.cn) \
                * self.sched.batch_count(c) * self.split
            slots = co_resident_clusters(self.sms, self.cm * self.cn)
            n_clusters = cutlass.max(cutlass.min(units, slots), 1)
        else:
            # grouped work is known on the device only: every cluster that fits
            n_clusters = co_resident_clusters(self.sms, self.cm * self.cn)
            flags = a.shape[1]      # K, which the ragged_k views no longer carry

        self.storage = self.smem_struct(a_t, b_t, c_t, sa, sb, sc)
        tail = tuple(tail) if const_expr(self.mode != "dense" and self.split > 1) else ()
        self.kernel(tma_a, tA, tma_b, tB, tma_c, tC, c, ws, flags, (tiled_mma, wg_mma), (sa, sb, sc),
                    (bias, tma_d, tD, d, z, scales) + tail).launch(
            grid=[self.cm, self.cn, n_clusters], block=[self.threads, 1, 1],
            cluster=[self.cm, self.cn, 1], min_blocks_per_mp=1, stream=stream, use_pdl=self.cfg.pdl)

    def smem_struct(self, a_t, b_t, c_t, sa, sb, sc):
        """The kernel's shared memory: barriers, split-K's flag, the A/B ring, C's ring and (block
        scaled) the stages' scale buffers."""
        mem, align = cute.struct.MemRange, cute.struct.Align
        fields = {"bars": mem[cutlass.Int64, self.ab_stages * 2], "last": mem[cutlass.Int32, 4],
                  "sA": align[mem[a_t, cute.cosize(sa)], 1024], "sB": align[mem[b_t, cute.cosize(sb)], 1024],
                  "sC": align[mem[c_t, cute.cosize(sc)], 1024]}
        if self.scaled:
            for name, lay in zip(("sSA", "sSB"), self.scale_layouts()):
                fields[name] = align[mem[Float32, cute.cosize(lay)], SCALE_ALIGN]
        return cute.struct(type("Storage", (), {"__annotations__": fields}))

    @cute.jit
    def load(self, ab_pipe, prod, a, b, k0, kc, ts=None):
        """TMA loads of k-tiles [k0, k0 + kc) of one unit into the A/B ring (block-scaled: and
        their scales, ``ts`` the unit's sm90_scaled.TileScales, on the same barrier). ``a``, ``b``:
        each operand's (TMA atom, its global k-tiles, its smem stages, multicast mask)."""
        tma_a, tAgA_t, tAsA, a_mask = a
        tma_b, tBgB_t, tBsB, b_mask = b
        for kt in range(kc):
            ab_pipe.producer_acquire(prod)
            bar = ab_pipe.producer_get_barrier(prod)
            cute.copy(tma_a, tAgA_t[(None, k0 + kt)], tAsA[(None, prod.index)],
                      tma_bar_ptr=bar, mcast_mask=a_mask)
            cute.copy(tma_b, tBgB_t[(None, k0 + kt)], tBsB[(None, prod.index)],
                      tma_bar_ptr=bar, mcast_mask=b_mask)
            if const_expr(self.scaled):
                self.load_scales(ts, k0 + kt, prod.index, bar)
            ab_pipe.producer_commit(prod)
            prod.advance()
        return prod
    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
               tma_c: cute.CopyAtom, mC: cute.Tensor, gmem_c: cute.Tensor, ws, flags, mmas, smem_layouts, fused):
        """One persistent CTA: barriers and smem, the tile schedule, then warpgroup 0 produces
        (TMA loads) and warpgroups 1 and 2 consume (WGMMA and the epilogue). ``mmas``: (the
        consumers' tiled MMA, one warpgroup's); ``smem_layouts``: A's, B's and C's staged smem
        layouts; ``fused``: (bias, D's TMA atom and tensor, D, Z, block scales), each None when
        unused, then a grouped tail split's partials and counters."""
        tiled_mma, wg_mma = mmas
        sa_layout, sb_layout, sc_layout = smem_layouts
        bias, tma_d, mD, gmem_d, mZ, scales = fused[:6]
        tail_ws, tail_flags = fused[6:] if const_expr(len(fused) > 6) else (None, None)
        tidx, _, _ = cute.arch.thread_idx()
        warp_id = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = cute.arch.make_warp_uniform(tidx // 128)
        if warp_id == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            cpasync.prefetch_descriptor(tma_c)
            if const_expr(self.preact):
                cpasync.prefetch_descriptor(tma_d)
            if const_expr(self.scaled):
                for atom in (scales[0], scales[2]):
                    if const_expr(atom is not None):
                        cpasync.prefetch_descriptor(atom)

        cta_layout = cute.make_layout((self.cm, self.cn, 1))
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cc = cta_layout.get_flat_coord(rank)
        # Multicast masks: the CTAs sharing this CTA's row of A (same m) / column of B.
        a_mask = cute.make_layout_image_mask(cta_layout, cc, mode=1) if const_expr(self.cn > 1) else 0
        b_mask = cute.make_layout_image_mask(cta_layout, cc, mode=0) if const_expr(self.cm > 1) else 0

        smem = memory.SmemAllocator()
        st = smem.allocate(self.storage)
        stage_bytes = cute.size_in_bytes(self.a_t, cute.slice_(sa_layout, (None, None, 0))) + \
            cute.size_in_bytes(self.b_t, cute.slice_(sb_layout, (None, None, 0)))
        if const_expr(self.scaled):
            # the A/B tiles land whole in every CTA of the cluster (multicast); each CTA loads
            # its own scale boxes, so its barrier counts them once
            stage_bytes += self.scale_tx_bytes()
        # Every consumer warp releases a stage to each CTA that multicasts into it.
        mcast = self.cm + self.cn - 1
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.bars.data_ptr(), num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, mcast * (4 if self.pp else 8)),
            tx_count=stage_bytes, cta_layout_vmnk=cute.make_layout((1, self.cm, self.cn, 1)),
            defer_sync=True)
        pipeline.pipeline_init_arrive(cluster_shape_mn=(self.cm, self.cn), is_relaxed=True)

        sA = st.sA.get_tensor(sa_layout.outer, swizzle=sa_layout.inner)
        sB = st.sB.get_tensor(sb_layout.outer, swizzle=sb_layout.inner)
        sC = st.sC.get_tensor(sc_layout.outer, swizzle=sc_layout.inner)
        if const_expr(self.scaled):
            ssa, ssb = self.scale_layouts()
            scales = ScaleLoads(scales[0], scales[1], st.sSA.get_tensor(ssa), scales[2], scales[3],
                                st.sSB.get_tensor(ssb))
        cta = Cta(tma_a, mA, tma_b, mB, tma_c, mC, gmem_c, ws, flags, bias, tma_d, mD, gmem_d, mZ,
                  tiled_mma, wg_mma, sA, sB, sC, st, ab_pipe, a_mask, b_mask, tidx, warp_id, wg, cc, scales,
                  tail_ws, tail_flags)

        if const_expr(self.mode == "dense"):
            sch = self.dense_schedule(cta)
        else:
            sch = self.grouped_schedule(cta)
        sch.first, sch.stride = cute.arch.block_idx()[2], cute.arch.grid_dim()[2]

        pipeline.pipeline_init_wait(cluster_shape_mn=(self.cm, self.cn))
        if const_expr(self.cfg.pdl):
            # Everything above only touched shared memory and kernel parameters. Wait for
            # the previous grid on the stream (it may still be writing our inputs, or
            # reading the buffer we are about to write), then let the next grid launch: its
            # CTAs take SMs as ours exit and wait the same way (a no-op without PDL).
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()

        if wg == 0:
            self.producer(cta, sch)
        else:
            self.consumer(cta, sch)

    def dense_schedule(self, cta: Cta) -> Schedule:
        """The dense raster's tiles, TMA partitions and unit count."""
        mA, mB, mC, mD, mZ, sA, sB, cc = cta.mA, cta.mB, cta.mC, cta.mD, cta.mZ, cta.sA, cta.sB, cta.cc
        tma_a, tma_b = cta.tma_a, cta.tma_b
        gA = cute.local_tile(mA, (self.bm, self.bk), (None, None, None))   # (bm,bk,M/bm,K/bk,L)
        gB = cute.local_tile(mB, (self.bn, self.bk), (None, None, None))
        gC = cute.local_tile(mC, (self.bm, self.cbn), (None, None, None))   # (bm,cbn,M/bm,N/bn,L)
        gD = None   # (gated: tiles of bn / 2 columns; a tile's up half is nt_half tiles right)
        if const_expr(self.preact):
            gD = cute.local_tile(mD, (self.bm, self.cbn), (None, None, None))
        gZ = cute.local_tile(mZ, (self.bm, self.bn), (None, None, None)) if const_expr(self.dact) else None
        tAsA, tAgA = cpasync.tma_partition(tma_a, cc[1], cute.make_layout(self.cn),
                                           cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cpasync.tma_partition(tma_b, cc[0], cute.make_layout(self.cm),
                                           cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))

        k_tiles = cute.size(gA, mode=[3])
        cl_m = (cute.size(gC, mode=[2]) + self.cm - 1) // self.cm
        cl_n = (cute.size(gC, mode=[3]) + self.cn - 1) // self.cn
        batches = self.sched.batch_count(mC)
        total = cl_m * cl_n * batches * self.split
        c_ext = None   # C's batch extents, to split a linear batch index (three modes)
        if const_expr(self.nb == 1):
            la_last, lb_last = mA.shape[2] - 1, mB.shape[2] - 1   # extent 1: broadcast batch 0
        else:
            c_ext = mC.shape[2]
            la_last, lb_last = mA.shape[2], mB.shape[2]   # extents (see ab_batch)
        return Schedule(la_last, lb_last, k_tiles=k_tiles, cl_m=cl_m, cl_n=cl_n, batches=batches, total=total,
                        c_ext=c_ext, tAsA=tAsA, tAgA=tAgA, tBsB=tBsB, tBgB=tBgB, gC=gC, gD=gD, gZ=gZ)

    def grouped_schedule(self, cta: Cta) -> Schedule:
        """The grouped walk's extents: ``ws`` holds the group sizes (G, L or 1), ``flags`` K.
        The ragged views keep L in mode 2."""
        mA, mB, gmem_c = cta.mA, cta.mB, cta.gmem_c
        gs = cta.ws
        c_batch = 2 if const_expr(self.mode == "ragged_m") else 3
        ext = (gmem_c.shape[0], gmem_c.shape[1], cta.flags, gs.shape[0], gmem_c.shape[c_batch], gs.shape[1])
        la_last = mA.shape[2] - 1
        if const_expr(self.glu):
            lb_last = 0   # (B's batch mode dropped in run())
        else:
            lb_last = (mB.shape[3] if const_expr(self.mode == "ragged_m") else mB.shape[2]) - 1
        return Schedule(la_last, lb_last, gs=gs, ext=ext)

    @cute.jit
    def producer(self, cta: Cta, sch: Schedule):
        """Warpgroup 0: its first warp issues the TMA loads of every unit's k-tiles."""
        tma_a, tma_b, mA, mB, sA, sB = cta.tma_a, cta.tma_b, cta.mA, cta.mB, cta.sA, cta.sB
        ab_pipe, a_mask, b_mask, warp_id, cc = cta.ab_pipe, cta.a_mask, cta.b_mask, cta.warp_id, cta.cc
        first, stride, la_last, lb_last = sch.first, sch.stride, sch.la_last, sch.lb_last
        cute.arch.setmaxregister_decrease(self.producer_regs)
        if warp_id == 0:
            prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
            w = first
            if const_expr(self.mode == "dense"):
                total, cl_m, cl_n, batches, k_tiles, c_ext = sch.total, sch.cl_m, sch.cl_n, sch.batches, \
                    sch.k_tiles, sch.c_ext
                tAgA, tAsA, tBgB, tBsB = sch.tAgA, sch.tAsA, sch.tBgB, sch.tBsB
                while w < total:
                    tm, tn, l, s = self.sched.work(w, cl_m, cl_n, batches, cc)
                    k0, kc = self.sched.k_range(s, k_tiles)
                    tAgA_t = tAgA[(None, tm, None, self.sched.ab_batch(l, c_ext, la_last))]
                    tBgB_t = tBgB[(None, tn, None, self.sched.ab_batch(l, c_ext, lb_last))]
                    ts = None
                    if const_expr(self.scaled):   # at the tile's first row blocks
                        ts = self.tile_scales(cta.scales, tm * (self.bm // self.a_block),
                                              tn * (self.bn // self.b_block), 0,
                                              self.sched.ab_batch(l, c_ext, la_last),
                                              self.sched.ab_batch(l, c_ext, lb_last))
                    prod = self.load(ab_pipe, prod, (tma_a, tAgA_t, tAsA, a_mask), (tma_b, tBgB_t, tBsB, b_mask),
                                     k0, kc, ts)
                    w += stride
            else:
                gs, ext = sch.gs, sch.ext
                t, s, parts, full, tail_parts = w, Int32(0), Int32(1), Int32(0), Int32(1)
                if const_expr(self.split > 1):
                    full, tail_parts = self.sched.tail_plan(gs, ext, stride)
                    t, s, parts = self.sched.tail_unit(w, full, tail_parts)
                cl, cg0, rows0, tiles0 = Int32(0), Int32(0), Int32(0), Int32(0)
                start, end, incl = self.sched.load_chunk(gs, ext, cl, cg0, rows0, tiles0)
                cl, cg0, rows0, tiles0, start, end, incl, valid, g, t0, t1, m_t, n_t = self.sched.find(
                    gs, ext, t, cl, cg0, rows0, tiles0, start, end, incl, cc)
                while valid:
                    g_a, g_b = self.sched.group_ab(mA, mB, cl, g, t0, t1, m_t, n_t, la_last, lb_last)
                    s_a, k_a = cpasync.tma_partition(tma_a, cc[1], cute.make_layout(self.cn),
                                                     cute.group_modes(sA, 0, 2), cute.group_modes(g_a, 0, 2))
                    s_b, k_b = cpasync.tma_partition(tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2),
                                                     cute.group_modes(g_b, 0, 2))
                    ts = None
                    if const_expr(self.scaled):
                        ts = self.grouped_tile_scales(cta.scales, g, t0, m_t, n_t, cutlass.min(cl, la_last),
                                                      cutlass.min(cl, lb_last))
                    k0, kc = Int32(0), self.sched.group_k_tiles(ext, g, t0, t1)
                    if const_expr(self.split > 1):
                        k0, kc = split_range(kc, s, parts)
                    prod = self.load(ab_pipe, prod, (tma_a, k_a, s_a, a_mask), (tma_b, k_b, s_b, b_mask),
                                     k0, kc, ts)
                    w += stride
                    if const_expr(self.split > 1):
                        t, s, parts = self.sched.tail_unit(w, full, tail_parts)
                    cl, cg0, rows0, tiles0, start, end, incl, valid, g, t0, t1, m_t, n_t = self.sched.find(
                        gs, ext, t if const_expr(self.split > 1) else w, cl, cg0, rows0, tiles0, start, end, incl, cc)
            # keep this CTA (its smem and barriers) alive until peers stop signalling it
            ab_pipe.producer_tail(prod)

    def grouped_tile_scales(self, sc: ScaleLoads, g, t0, m_t, n_t, la, lb):
        """A grouped tile's scale loads (sm90_scaled.tile_scales). ragged_m: A's at the tile's
        own rows (a tile starts at its group's first row), B's at its group; ragged_k: both at
        the group's first block (its k-range starts at 128 times it)."""
        if self.mode == "ragged_m":
            # the box starts at the tile's first row rounded down to 16 bytes (sm90_config.scale_origin:
            # an unaligned start along sa's contiguous mode is an illegal instruction)
            start, _ = scale_origin(t0 + m_t * self.bm)
            return self.tile_scales(sc, start, n_t * (self.bn // self.b_block), 0, la, self.sched.group(g))
        return self.tile_scales(sc, m_t * self.bm, n_t * self.bn, t0 // SCALE_K, la, lb)

    def grouped_scale_tile(self, g, t0, m_t, n_t):
        """A grouped tile's ``tile`` for sm90_scaled.read_scales: where its first row sits in each
        operand's stage box. ragged_m: A's (1-row blocks) box starts at the tile's first row
        rounded down to 16 bytes (grouped_tile_scales), B's at its first column block rounded down;
        ragged_k: both boxes (1-row blocks) start at the tile's first row."""
        if const_expr(self.mode == "ragged_m"):
            a, b = self.scale_tile(0, n_t * (self.bn // self.b_block))
            if const_expr(self.a_block == 1):
                a = scale_origin(t0 + m_t * self.bm)[1]
            return a, b
        return 0, 0

    @cute.jit
    def consumer(self, cta: Cta, sch: Schedule):
        """Warpgroups 1 and 2: WGMMA mainloops and each warpgroup's epilogue, unit by unit."""
        tiled_mma, wg_mma, sA, sB, sC = cta.tiled_mma, cta.wg_mma, cta.sA, cta.sB, cta.sC
        tidx, wg, warp_id, gmem_c = cta.tidx, cta.wg, cta.warp_id, cta.gmem_c
        first, stride, k_tiles = sch.first, sch.stride, sch.k_tiles
        cute.arch.setmaxregister_increase(self.consumer_regs)
        ctid = tidx - 128
        etid = ctid % 128      # thread index inside its warpgroup (its epilogue group)
        # WGMMA partitions per warpgroup: slice by the warpgroup's first thread
        thr_mma = tiled_mma.get_slice(0 if const_expr(self.pp) else (wg - 1) * 128)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.bm, self.bn)), Float32)
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
        # one barrier (ids 1, 2), store warp and half of the smem ring per warpgroup
        epi_bar = pipeline.NamedBarrier(barrier_id=wg, num_threads=self.epi_threads)
        store_warp = wg * 4
        buf0 = (wg - 1) * self.epi_stages
        # the warpgroup's first 64-row block of the tile (pingpong: its own whole tile)
        row_blk = 0 if const_expr(self.pp) else wg - 1
        turn_mine, turn_other, both_bar = None, None, None
        if const_expr(self.pp):
            # mainloop turn tokens (ids 3: to warpgroup 1, 4: to warpgroup 2)
            turn_mine = pipeline.NamedBarrier(barrier_id=wg + 2, num_threads=self.mma_threads)
            turn_other = pipeline.NamedBarrier(barrier_id=5 - wg, num_threads=self.mma_threads)
        else:
            # split-K hands partial tiles over between both warpgroups
            both_bar = pipeline.NamedBarrier(barrier_id=3, num_threads=self.mma_threads)

        # registers -> smem in epi_tile pieces: stmatrix for 16-bit outputs, plain stores
        # for fp32. The thread/value layout always comes from the 16-bit stmatrix atom
        # (typed Float16 on purpose: its layout is defined in 16-bit elements).
        r2s = cute.make_tiled_copy_S(
            sm90_utils.sm90_get_smem_store_op(self.c_lay, elem_ty_d=self.c_t, elem_ty_acc=Float32),
            cute.make_tiled_copy_C_atom(
                cute.make_copy_atom(warp.StMatrix8x8x16bOp(self.c_lay.is_m_major_c(), 4),
                                    cutlass.Float16), wg_mma))
        thr_r2s = r2s.get_slice(etid)
        tRS_sC = thr_r2s.partition_D(sC)
        tRS_acc = r2s.retile(acc)
        epi_coords = None   # fused bias: each fragment element's (row, column) in the tile
        if const_expr(self.fuse_bias):
            # this thread's accumulator coordinates (its own slice, not the warpgroup's
            # first thread's, which the WGMMA operand partitions take), retiled like tRS_acc
            share = cute.make_identity_tensor((self.wg_rows, self.bn))
            epi_coords = r2s.retile(wg_mma.get_slice(etid).partition_C(share))
        z_thr, z_at, z_off = None, None, None
        if const_expr(self.dact):
            # Z is read like the accumulators: this thread's slice of a tile (its own
            # index, as for epi_coords). Element i lies at a static offset (thread 0's
            # element i) from the thread's first one (z_at), so bound checks compare
            # constants with per-tile limits: per-element coordinates were hoisted out of
            # the tile loop as invariants and spilled.
            z_thr = tiled_mma.get_slice(etid if const_expr(self.pp) else ctid)
            tile_crd = cute.make_identity_tensor((self.bm, self.bn))
            z_off = r2s.retile(tiled_mma.get_slice(0).partition_C(tile_crd))
            z_at = r2s.retile(z_thr.partition_C(tile_crd))[0]
        rd_shape = cute.shape(thr_r2s.partition_S(sC))[:3]
        tRS_r32 = cute.make_rmem_tensor(rd_shape, Float32)
        tRS_rC = cute.make_rmem_tensor(rd_shape, self.c_t)
        tRS_u32 = cute.make_rmem_tensor(rd_shape, Float32) if const_expr(self.glu) else None
        n_rd = cute.size(tRS_r32)
        # subtiles per warpgroup and tile: row blocks x column blocks, N fastest
        n_epi = (self.wg_rows // 64) * (self.bn // self.epi_tile[1])
        frag = cute.size(acc)
        acc_flat = cute.make_tensor(acc.iterator, cute.make_layout(frag))
        ragged = self.ragged_edge(gmem_c)

        w = first
        step = stride
        if const_expr(self.pp):
            # warpgroup 2 takes the CTA's 2nd, 4th, ... unit: its ring position starts
            # after the first unit's k-tiles (the producer fills the ring in unit order)
            step = stride * 2
            if wg == 2:
                w = first + stride
                for _ in range(k_tiles):
                    read.advance()
                    release.advance()
        wge = WarpgroupEpilogue(sC, r2s, tRS_r32, tRS_rC, tRS_sC, n_rd, n_epi, row_blk, epi_bar, warp_id, etid,
                                store_warp, buf0, gmem_c, ragged, epi_coords, tRS_u32)
        cs = Consumer(tiled_mma, acc, tCrA, tCrB, tRS_acc, frag, acc_flat, ctid, turn_mine, turn_other, both_bar,
                      z_thr, z_at, z_off, wge, self.thread_scales(tiled_mma, acc, ctid, cta.scales))
        if const_expr(self.mode != "dense"):
            self.consume_grouped(cta, sch, cs, read, release, w)
        elif const_expr(self.cfg.defer):
            self.consume_deferred(cta, sch, cs, read, release, w, step)
        else:
            self.consume_dense(cta, sch, cs, read, release, w, step)
        if warp_id == store_warp:
            cute.arch.cp_async_bulk_wait_group(0, read=True)   # smem outlives its stores

    def ragged_edge(self, gmem_c):
        # (an unaligned C, c_aligned False: every subtile is an edge one; see store_subtile)
        """Whether C's contiguous extent is not a multiple of 16 bytes (a dense, ungated C).

        TMA stores write whole 16-byte chunks: a store clipped at such an edge would also write
        the caller's padding behind it, so subtiles crossing it are stored with predicated
        per-element stores instead (runtime check; aligned shapes never take that path).
        (Grouped outputs: their row strides are 16-byte multiples and stores must stop at group
        ends, which only the TMA clip does; gated: N / 2 % 64 == 0.)"""
        ragged = False
        if const_expr(self.mode == "dense" and not self.glu):
            c_m_extent, c_n_extent = gmem_c.shape[0], gmem_c.shape[1]
            contig = c_n_extent if const_expr(self.c_lay.is_n_major_c()) else c_m_extent
            ragged = (contig * _ITEM_OF[self.c_t.width]) % 16 != 0
        return ragged

    @cute.jit
    def consume_grouped(self, cta: Cta, sch: Schedule, cs: Consumer, read, release, w):
        """The grouped walk, one tile per step (cooperative, unsplit)."""
        tiled_mma, acc, tCrA, tCrB, tRS_acc, wge = cs.tiled_mma, cs.acc, cs.tCrA, cs.tCrB, cs.tRS_acc, cs.wge
        ab_pipe, tma_c, mC, tma_d, mD, gmem_d, bias = cta.ab_pipe, cta.tma_c, cta.mC, cta.tma_d, cta.mD, \
            cta.gmem_d, cta.bias
        gs, ext, stride, cc = sch.gs, sch.ext, sch.stride, cta.cc
        t, s, parts, full, tail_parts = w, Int32(0), Int32(1), Int32(0), Int32(1)
        if const_expr(self.split > 1):
            full, tail_parts = self.sched.tail_plan(gs, ext, stride)
            t, s, parts = self.sched.tail_unit(w, full, tail_parts)
        cl, cg0, rows0, tiles0 = Int32(0), Int32(0), Int32(0), Int32(0)
        start, end, incl = self.sched.load_chunk(gs, ext, cl, cg0, rows0, tiles0)
        cl, cg0, rows0, tiles0, start, end, incl, valid, g, t0, t1, m_t, n_t = self.sched.find(
            gs, ext, t, cl, cg0, rows0, tiles0, start, end, incl, cc)
        while valid:
            n_k = self.sched.group_k_tiles(ext, g, t0, t1)
            if const_expr(self.split > 1):
                n_k = split_range(n_k, s, parts)[1]
            if const_expr(self.scaled):
                # (empty groups and ragged_m's tail have no k-tiles: they store zeros)
                read, release = self.scaled_mainloop(tiled_mma, acc, tCrA, tCrB, cs.ts, ab_pipe, read, release,
                                                     n_k, self.grouped_scale_tile(g, t0, m_t, n_t))
            else:
                acc.fill(0.0)      # empty groups and ragged_m's tail store these zeros
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.fence()
                read = mainloop_start(tiled_mma, acc, tCrA, tCrB, ab_pipe, read, n_k, 1)
                read, release = mainloop_rest(tiled_mma, acc, tCrA, tCrB, ab_pipe, read, release, n_k, 1)
            pre, g_bias = None, None
            if const_expr(self.preact):
                pre = (tma_d, self.d_tiles(
                    self.sched.group_c(mD, cl, g, t0, t1, m_t, n_t, self.cbn),
                    self.sched.group_c(mD, cl, g, t0, t1, m_t, n_t + self.half_tiles(mD), self.cbn)), gmem_d)
            if const_expr(self.fuse_bias):
                # the bias row of the group and batch (extent 1: shared by every
                # batch); the zero tail (g == G) adds none, nor does a lead (g == 0)
                gb, groups = g, ext[3]
                if const_expr(self.sched.lead):
                    gb, groups = self.sched.group(g), ext[3] - 1   # B's groups
                g_bias = (bias[(None, cutlass.min(gb, groups - 1), cutlass.min(cl, bias.shape[2] - 1))],
                          cutlass.select_(g < ext[3], Float32(1.0), Float32(0.0)))
                if const_expr(self.sched.lead):
                    g_bias = (g_bias[0], cutlass.select_(g > 0, g_bias[1], Float32(0.0)))
            if const_expr(self.split > 1):
                stores = parts == 1
                if parts > 1:
                    stores = self.tail_fold(cta, cs, w - full, parts)
                if stores:
                    self.epilogue(wge, tma_c, self.sched.group_c(mC, cl, g, t0, t1, m_t, n_t, self.cbn), tRS_acc,
                                  m_t, n_t, cl, bias=g_bias, pre=pre)
            else:
                self.epilogue(wge, tma_c, self.sched.group_c(mC, cl, g, t0, t1, m_t, n_t, self.cbn), tRS_acc,
                              m_t, n_t, cl, bias=g_bias, pre=pre)
            w += stride
            if const_expr(self.split > 1):
                t, s, parts = self.sched.tail_unit(w, full, tail_parts)
            cl, cg0, rows0, tiles0, start, end, incl, valid, g, t0, t1, m_t, n_t = self.sched.find(
                gs, ext, t if const_expr(self.split > 1) else w, cl, cg0, rows0, tiles0, start, end, incl, cc)

    @cute.jit
    def consume_deferred(self, cta: Cta, sch: Schedule, cs: Consumer, read, release, w, step):
        """Deferred epilogue: each tile is stored under the next one's first WGMMAs, from a copy
        of its accumulators already in the output dtype."""
        tiled_mma, acc, tCrA, tCrB, wge = cs.tiled_mma, cs.acc, cs.tCrA, cs.tCrB, cs.wge
        ab_pipe, tma_c, cc = cta.ab_pipe, cta.tma_c, cta.cc
        total, cl_m, cl_n, batches, k_tiles, c_ext, gC = sch.total, sch.cl_m, sch.cl_n, sch.batches, sch.k_tiles, \
            sch.c_ext, sch.gC
        acc_c = cute.make_rmem_tensor_like(acc, self.c_t)
        tRS_accc = wge.r2s.retile(acc_c)
        p_tm, p_tn, p_l = self.sched.work(w, cl_m, cl_n, batches, cc)[:3]
        have_prev = Int32(0)
        while w < total:
            tm, tn, l, _ = self.sched.work(w, cl_m, cl_n, batches, cc)
            acc.fill(0.0)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.fence()
            read = mainloop_start(tiled_mma, acc, tCrA, tCrB, ab_pipe, read, k_tiles, self.cfg.defer)
            if have_prev != 0:
                p_lc = self.sched.c_batch(p_l, c_ext)
                self.epilogue(wge, tma_c, gC[(None, None, p_tm, p_tn, p_lc)], tRS_accc, p_tm, p_tn, p_lc, True)
            read, release = mainloop_rest(tiled_mma, acc, tCrA, tCrB, ab_pipe, read, release, k_tiles,
                                          self.cfg.defer)
            acc_c.store(acc.load().to(self.c_t))
            p_tm, p_tn, p_l = tm, tn, l
            have_prev = Int32(1)
            w += step
        # every CTA has at least one unit (the grid never exceeds them): store the last
        p_lc = self.sched.c_batch(p_l, c_ext)
        self.epilogue(wge, tma_c, gC[(None, None, p_tm, p_tn, p_lc)], tRS_accc, p_tm, p_tn, p_lc, True)

    @cute.jit
    def consume_dense(self, cta: Cta, sch: Schedule, cs: Consumer, read, release, w, step):
        """The dense raster (cooperative or pingpong, split or not), each unit's epilogue right
        after its mainloop."""
        tiled_mma, acc, tCrA, tCrB, tRS_acc, wge = cs.tiled_mma, cs.acc, cs.tCrA, cs.tCrB, cs.tRS_acc, cs.wge
        turn_mine, turn_other, z_thr, z_at, z_off = cs.turn_mine, cs.turn_other, cs.z_thr, cs.z_at, cs.z_off
        ab_pipe, tma_c, tma_d, mD, gmem_d, mZ, bias, cc, wg = cta.ab_pipe, cta.tma_c, cta.tma_d, cta.mD, \
            cta.gmem_d, cta.mZ, cta.bias, cta.cc, cta.wg
        total, cl_m, cl_n, batches, k_tiles, c_ext = sch.total, sch.cl_m, sch.cl_n, sch.batches, sch.k_tiles, sch.c_ext
        gC, gD, gZ, first, stride, r2s = sch.gC, sch.gD, sch.gZ, sch.first, sch.stride, wge.r2s
        # each unit's coordinates are worked out one unit ahead, while the previous
        # unit's first WGMMAs run: between tiles, work()'s divisions took ~0.4k cycles
        tm, tn, l, s = self.sched.work(w, cl_m, cl_n, batches, cc)
        while w < total:
            k0, kc = self.sched.k_range(s, k_tiles)

            if const_expr(self.pp):
                # mainloops take turns: the ring's barriers only tell apart adjacent
                # phases, so a warpgroup may wait on its first stage only once the
                # other one has waited on all of its unit's stages
                if wg == 2 or w != first:
                    turn_mine.arrive_and_wait()

            if const_expr(self.scaled):
                # ---- block-scaled mainloop (sm90_scaled): each k-tile promoted with its scales
                n_tm, n_tn, n_l, n_s = self.sched.work(w + step, cl_m, cl_n, batches, cc)
                # where the tile's first row sits in each operand's scale box (sm90_scaled.read_scales)
                tile = self.scale_tile(tm * (self.bm // self.a_block), tn * (self.bn // self.b_block))
                read, release = self.scaled_mainloop(tiled_mma, acc, tCrA, tCrB, cs.ts, ab_pipe, read, release,
                                                     kc, tile)
            else:
                # ---- mainloop (sm90_mainloop): one WGMMA batch in flight
                acc.fill(0.0)
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.fence()
                read = mainloop_start(tiled_mma, acc, tCrA, tCrB, ab_pipe, read, kc, 1)
                # (past the last unit these are never used)
                n_tm, n_tn, n_l, n_s = self.sched.work(w + step, cl_m, cl_n, batches, cc)
                read, release = mainloop_rest(tiled_mma, acc, tCrA, tCrB, ab_pipe, read, release, kc, 1,
                                              not self.pp)
            if const_expr(self.pp):
                # the other warpgroup's next unit may start as soon as this one's
                # last WGMMAs are issued: its own queue behind them keeps the tensor
                # cores busy while these drain
                if w + stride < total:
                    turn_other.arrive()
                release = mainloop_finish(ab_pipe, release, kc, 1)

            lc = self.sched.c_batch(l, c_ext)   # (split-K's tile counters take the linear l)
            gC_t = gC[(None, None, tm, tn, lc)]
            if const_expr(self.split == 1):
                pre, zt = None, None
                if const_expr(self.preact):
                    pre = (tma_d, self.d_tiles(gD[(None, None, tm, tn, lc)],
                                               gD[(None, None, tm, tn + self.half_tiles(mD), lc)]), gmem_d)
                if const_expr(self.dact):
                    zt = self.z_tile(r2s.retile(z_thr.partition_C(gZ[(None, None, tm, tn, lc)])), mZ,
                                     z_at, z_off, tm, tn)
                self.epilogue(wge, tma_c, gC_t, tRS_acc, tm, tn, lc, bias=bias, pre=pre, z=zt)
            else:
                self.split_k_fold(cta, sch, cs, (tm, tn, l, s), gC_t, lc)
            if const_expr(self.pp):
                for _ in range(k_tiles):            # the other warpgroup's next unit
                    read.advance()
                    release.advance()
            w += step
            tm, tn, l, s = n_tm, n_tn, n_l, n_s

    @cute.jit
    def split_k_fold(self, cta: Cta, sch: Schedule, cs: Consumer, unit, gC_t, lc):
        """Split-K: publish this unit's partial tile; the last of the S arrivals folds them in
        split order (deterministic), runs the epilogue and resets the tile's counter."""
        tm, tn, l, s = unit
        ws, tma_c, bias = cta.ws, cta.tma_c, cta.bias
        ctid, frag, acc_flat, tRS_acc, wge = cs.ctid, cs.frag, cs.acc_flat, cs.tRS_acc, cs.wge
        cl_m, cl_n, batches, c_ext, gC = sch.cl_m, sch.cl_n, sch.batches, sch.c_ext, sch.gC
        tile_id = (Int64(l) * (cl_n * self.cn) + tn) * (cl_m * self.cm) + tm
        n_tiles = Int64(cl_m * self.cm) * (cl_n * self.cn) * batches
        tile_elems = self.bm * self.bn
        if self.publish_partial(cta, cs, ws, cta.flags, s * n_tiles + tile_id, tile_id, self.split):
            cute.arch.fence_acq_rel_gpu()  # see every other split's partial
            for sp in range_constexpr(self.split):
                part = cute.make_tensor(
                    ws.iterator + ((sp * n_tiles + tile_id) * tile_elems + ctid),
                    cute.make_layout(frag, stride=self.mma_threads))
                for r in range_constexpr(frag // 16):
                    for v in range_constexpr(r * 16, r * 16 + 16):
                        if const_expr(sp == 0):
                            acc_flat[v] = part[v]
                        else:
                            acc_flat[v] = acc_flat[v] + part[v]
            gC_s, lc_s = gC_t, lc
            if const_expr(self.nb > 1):
                # split l only now: three coordinates held live across the
                # partial's publication spilled
                lc_s = self.sched.c_batch(l, c_ext)
                gC_s = gC[(None, None, tm, tn, lc_s)]
            self.epilogue(wge, tma_c, gC_s, tRS_acc, tm, tn, lc_s, bias=bias)

    @cute.jit
    def publish_partial(self, cta: Cta, cs: Consumer, ws, flags, slot, counter, arrivals):
        """Split units: write this unit's fp32 partial tile into partial slot ``slot`` of ``ws``
        (each consumer thread its fragment, the threads interleaved) and count the arrival on
        ``flags[counter]``; returns whether the unit arrived last of ``arrivals``, which then
        folds the partials (it resets the counter for the next launch)."""
        ctid, frag, acc_flat, both_bar = cs.ctid, cs.frag, cs.acc_flat, cs.both_bar
        mine = cute.make_tensor(ws.iterator + (slot * (self.bm * self.bn) + ctid),
                                cute.make_layout(frag, stride=self.mma_threads))
        # static loops in rows of 16: the DSL warns from 64 iterations up, and
        # cutlass.range(unroll_full=True) or tensor copies emit other code
        for r in range_constexpr(frag // 16):
            for v in range_constexpr(r * 16, r * 16 + 16):
                mine[v] = acc_flat[v]
        cute.arch.fence_acq_rel_gpu()      # partial visible before the count
        both_bar.arrive_and_wait()
        last = cta.st.last.get_tensor(cute.make_layout(1))
        if ctid == 0:
            old = cute.arch.atomic_add(flags.iterator + counter, Int32(1),
                                       sem="acq_rel", scope="gpu")
            is_last = old == arrivals - 1
            last[0] = Int32(is_last)
            if is_last:
                flags[counter] = Int32(0)  # ready for the next launch
        both_bar.arrive_and_wait()
        return last[0] != 0

    @cute.jit
    def tail_fold(self, cta: Cta, cs: Consumer, j, parts):
        """A grouped tail-split unit (RaggedWalk.tail_plan), ``j``-th of the tail, its tile cut
        into ``parts``: publish the partial; the last to arrive sums the tile's partials in split
        order (deterministic) into its accumulators. Returns whether this unit stores the tile."""
        frag, acc_flat = cs.frag, cs.acc_flat
        tile = j // parts
        last = self.publish_partial(cta, cs, cta.tail_ws, cta.tail_flags, j, tile, parts)
        if last:
            cute.arch.fence_acq_rel_gpu()  # see every other split's partial
            for r in range_constexpr(frag // 16):
                for v in range_constexpr(r * 16, r * 16 + 16):
                    acc_flat[v] = Float32(0.0)
            for sp in range(parts):
                part = cute.make_tensor(cta.tail_ws.iterator + ((tile * parts + sp) * (self.bm * self.bn) + cs.ctid),
                                        cute.make_layout(frag, stride=self.mma_threads))
                for r in range_constexpr(frag // 16):
                    for v in range_constexpr(r * 16, r * 16 + 16):
                        acc_flat[v] = acc_flat[v] + part[v]
        return last


def make_launcher(spec: GemmSpec | GroupedSpec, config: Config, sms: int, signature: abi.Signature):
    """The @cute.jit launcher of ``signature`` (see sm90_gemm.make_launcher, which checks the
    config first)."""
    return launcher_for(signature, Sm90Gemm(spec, config, sms).launch)
