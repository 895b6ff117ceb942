"""The Blackwell GEMM kernel (families sm100_gemm and sm100_grouped): the DSL half.

sm100_gemm holds the design notes, configs and everything routing needs; this module imports the
DSL and is imported only when a kernel is built (sm100_gemm.make_launcher).
"""

from __future__ import annotations

from jax_cute.kernels import abi, dsl
from jax_cute.kernels.dsl import cute, cutlass, pipeline, tcgen05, cpasync
from jax_cute.kernels.bundle import Bundle
from jax_cute.kernels.sm100_epilogue import EpilogueRegs, Sm100Epilogue
from jax_cute.kernels.launch import launcher_for
from jax_cute.kernels.sm100_config import NUM_SMS, TMEM_COLS, THREADS, Config, ab_stages

sm100 = dsl.sm100_utils
Int32, Boolean, const_expr = cutlass.Int32, cutlass.Boolean, cutlass.const_expr


def as_mn(t):
    """((atom_m, atom_n), rest_m, rest_n, ...) -> ((atom_m, rest_m), (atom_n, rest_n), ...)."""
    s, d = t.layout.shape, t.layout.stride
    lay = cute.make_layout(((s[0][0], s[1]), (s[0][1], s[2]), *s[3:]),
                           stride=((d[0][0], d[1]), (d[0][1], d[2]), *d[3:]))
    return cute.make_tensor(t.iterator, lay)

class Sm100Cta(Bundle):
    """What every warp of the CTA sees: the kernel's arguments (see Sm100Gemm.kernel), its
    pipelines, TMEM allocator and smem tensors, and where the thread sits."""

    __slots__ = (
        "tiled_mma", "tma_a", "mA", "tma_b", "mB", "tma_c", "mC_tma", "mC", "gs", "cluster_vmnk", "epi_tile",
        "warp", "tidx", "bidz", "grid_z", "is_leader", "crd", "v_idx", "ab_pipe", "acc_pipe", "tmem", "epi_bar",
        "sA", "sB", "sC", "a_mask", "b_mask", "thr_mma", "acc_layout", "tCrA", "tCrB", "a_cta_layout",
        "b_cta_layout", "mM", "nN", "kK", "n_work", "bias", "tma_d", "mD_tma", "mD", "mZ",
    )


class Sm100Gemm(Sm100Epilogue):
    """The persistent tcgen05 Blackwell GEMM of one mode and config (see sm100_gemm's notes):
    ``host`` builds the TMA atoms and launches ``kernel``, whose TMA, MMA and epilogue warps
    each take their tiles from ``tile`` (dense, ragged_m or ragged_k). A fused epilogue (a bias
    per column, the pre-activation output, the activation or a derivative: sm100_epilogue) runs
    on each subtile's float32 accumulators after their TMEM load."""

    EPI_WARPS = 4
    MMA_WARP = 4
    TMA_WARP = 5
    BAR_EPI = 1      # named barrier ids; 0 is __syncthreads
    BAR_TMEM = 2

    def __init__(self, mode: str, cfg: Config, batch_modes: int = 1, bias: bool = False, act: str = "",
                 preact: bool = False, dact: str = ""):
        self.mode = mode
        self.fuse_bias = bias
        self.act = act
        self.preact = preact
        self.dact = dact
        self.nb = batch_modes
        self.cfg = cfg
        self.v = 2 if cfg.two_cta else 1
        self.cta_m = cfg.tile_m // self.v
        self.bk = 64
        self.acc_stages = 2
        self.c_stages = 2

    @property
    def c_t(self):
        """C's DSL element type (what ActivationEpilogue rounds to)."""
        return self.c_dtype

    def launch(self, a, b, c, stream, group_sizes=None, bias=None, d=None, z=None) -> None:
        """The launcher's body (kernels/launch.py), its arguments named as the ABI signature
        names them (sm100_gemm.signature, GroupedSpec.signature)."""
        self.host(a, b, c, group_sizes, stream, (bias, d, z))

    # ---- host side: traced once per compile --------------------------------------------
    def host(self, a, b, c, gs, stream, fused):
        """``fused``: the fused epilogue's float32 bias ((N,), grouped (N, G, L or 1)),
        pre-activation output D and pre-activation input Z (each laid out like C), each None
        when unused."""
        cfg = self.cfg
        bias, d, z = fused
        if const_expr(self.nb > 1):
            # (rows, cols, L0, L1, L2) -> (rows, cols, (L0, L1, L2)): tiles and TMA views see
            # one (nested) batch mode; the TMA tensor maps still span all five dimensions
            a, b, c = cute.group_modes(a, 2, 5), cute.group_modes(b, 2, 5), cute.group_modes(c, 2, 5)
            if const_expr(self.preact):
                d = cute.group_modes(d, 2, 5)
        self.ab_dtype = a.element_type
        self.c_dtype = c.element_type
        self.acc_dtype = cutlass.Float32
        a_major = dsl.LayoutEnum.from_tensor(a).mma_major_mode()
        b_major = dsl.LayoutEnum.from_tensor(b).mma_major_mode()
        self.c_layout = dsl.LayoutEnum.from_tensor(c)
        cta_group = tcgen05.CtaGroup.TWO if cfg.two_cta else tcgen05.CtaGroup.ONE
        tiled_mma = sm100.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, a_major, b_major, self.acc_dtype, cta_group, (cfg.tile_m, cfg.tile_n))
        self.mma_tiler = (cfg.tile_m, cfg.tile_n, self.bk)
        self.cta_tile = (self.cta_m, cfg.tile_n, self.bk)
        cluster_vmnk = cute.tiled_divide(cute.make_layout((cfg.cluster_m, cfg.cluster_n, 1)),
                                         (tiled_mma.thr_id.shape,))
        self.mcast_a = cute.size(cluster_vmnk.shape[2])   # CTAs that share one A tile
        self.mcast_b = cute.size(cluster_vmnk.shape[1])   # CTAs that share one B tile

        epi_tile = sm100.compute_epilogue_tile_shape(self.cta_tile, cfg.two_cta, self.c_layout, self.c_dtype)
        c_smem = sm100.make_smem_layout_epi(self.c_dtype, self.c_layout, epi_tile, self.c_stages)
        self.ab_stages = ab_stages(cfg, self.ab_dtype.width // 8, cute.size_in_bytes(self.c_dtype, c_smem))
        a_smem = sm100.make_smem_layout_a(tiled_mma, self.mma_tiler, self.ab_dtype, self.ab_stages)
        b_smem = sm100.make_smem_layout_b(tiled_mma, self.mma_tiler, self.ab_dtype, self.ab_stages)

        acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
        self.tmem_cols = dsl.memory.get_num_tmem_alloc_cols(tiled_mma.make_fragment_C(
            cute.append(acc_shape, self.acc_stages)))
        assert self.tmem_cols <= TMEM_COLS, self.tmem_cols

        a_one = cute.slice_(a_smem, (None, None, None, 0))
        b_one = cute.slice_(b_smem, (None, None, None, 0))
        tma_a, tA = cute.nvgpu.make_tiled_tma_atom_A(
            sm100.cluster_shape_to_tma_atom_A((cfg.cluster_m, cfg.cluster_n, 1), tiled_mma.thr_id),
            a, a_one, self.mma_tiler, tiled_mma, cluster_vmnk.shape)
        tma_b, tB = cute.nvgpu.make_tiled_tma_atom_B(
            sm100.cluster_shape_to_tma_atom_B((cfg.cluster_m, cfg.cluster_n, 1), tiled_mma.thr_id),
            b, b_one, self.mma_tiler, tiled_mma, cluster_vmnk.shape)
        # the leader CTA's barrier expects the bytes landing in both CTAs of a pair
        self.tx_bytes = (cute.size_in_bytes(self.ab_dtype, a_one) + cute.size_in_bytes(self.ab_dtype, b_one)) * self.v
        tma_c, tC = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), c, cute.select(c_smem, mode=[0, 1]), epi_tile)
        tma_d, tD = None, None
        if const_expr(self.preact):   # D: C's dtype and layout, so C's staging ring serves it
            tma_d, tD = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), d, cute.select(c_smem, mode=[0, 1]), epi_tile)

        n_work = self.num_work(c, gs)
        # more clusters than fit on a smaller part just wait for a slot: still correct
        max_clusters = max(1, NUM_SMS // (cfg.cluster_m * cfg.cluster_n))
        # never launch an empty grid (M, N or L may be 0): idle clusters just exit
        grid_z = cutlass.max(cutlass.min(n_work, Int32(max_clusters)), Int32(1))
        # D itself only for ragged_m's row-predicated stores (elsewhere D goes by TMA)
        mD = d if const_expr(self.mode == "ragged_m") else None
        self.kernel((tiled_mma, cluster_vmnk), tma_a, tA, tma_b, tB, tma_c, tC, c, gs,
                    (a_smem, b_smem, c_smem), epi_tile, (bias, tma_d, tD, mD, z)).launch(
            grid=(cfg.cluster_m, cfg.cluster_n, grid_z), block=[THREADS, 1, 1],
            cluster=(cfg.cluster_m, cfg.cluster_n, 1), stream=stream)

    # ---- work decomposition: one item = one cluster tile --------------------------------
    def num_work(self, c, gs):
        R, C = self.cfg.cluster_m * self.cta_m, self.cfg.cluster_n * self.cfg.tile_n
        m, n = c.shape[0], c.shape[1]
        tiles_n = (n + C - 1) // C
        if const_expr(self.mode == "dense"):
            return ((m + R - 1) // R) * tiles_n * (c.shape[2] if const_expr(self.nb == 1)
                                                   else cute.size(c, mode=[2]))
        if const_expr(self.mode == "ragged_m"):
            # sum over the groups and the zero tail of ceil(rows / R) <= ceil(M / R) + G + 1
            return ((m + R - 1) // R + gs.shape[0] + 1) * tiles_n * c.shape[2]
        return ((m + R - 1) // R) * tiles_n * gs.shape[0] * c.shape[3]

    def c_batch(self, l, mC):
        """C's batch coordinate of linear batch l: l itself, or with three modes l split
        colexicographically over C's batch extents (L0 fastest)."""
        if const_expr(self.nb == 1):
            return l
        ext = mC.shape[2]
        q = l // ext[0]
        return l - q * ext[0], q % ext[1], q // ext[1]

    def ab_batch(self, l, mC, t):
        """Input ``t``'s batch coordinate of linear batch l: C's, clamped per mode to t's
        extent (extent 1: broadcast, index 0)."""
        if const_expr(self.nb == 1):
            return cutlass.min(l, t.shape[2] - 1)
        return tuple(cutlass.min(i, e - 1) for i, e in zip(self.c_batch(l, mC), t.shape[2]))

    @cute.jit
    def tile(self, w: Int32, mM: Int32, nN: Int32, kK: Int32, gs):
        """Work item w -> (valid, do_mma, row0, col0, l, g, k0, k_len, row_end).

        row0/col0: first row/column of the cluster tile; [k0, k0 + k_len) the k range summed;
        rows >= row_end must not be written. valid=False: an unused ragged_m slot (skip);
        do_mma=False: the tile is written as zeros (empty k range or rows past the groups).
        Every role evaluates this identically, so all agree on which pipelines run.
        """
        R, C = self.cfg.cluster_m * self.cta_m, self.cfg.cluster_n * self.cfg.tile_n
        tiles_m = (mM + R - 1) // R
        tiles_n = (nN + C - 1) // C
        valid = Boolean(True)
        g = Int32(0)
        k0 = Int32(0)
        k_len = kK
        row_end = mM
        row0 = Int32(0)
        col0 = Int32(0)
        l = Int32(0)
        if const_expr(self.mode == "dense"):
            row0 = (w % tiles_m) * R
            rest = w // tiles_m
            col0 = (rest % tiles_n) * C
            l = rest // tiles_n
        elif const_expr(self.mode == "ragged_m"):
            ngroups = gs.shape[0]
            slots = tiles_m + ngroups + 1
            slot = w % slots
            rest = w // slots
            col0 = (rest % tiles_n) * C
            l = rest // tiles_n
            lg = cutlass.min(l, gs.shape[1] - 1)
            # walk the groups (then the tail past the last group) to find the slot's group
            valid = Boolean(False)
            start = Int32(0)
            seen = Int32(0)
            for j in cutlass.range(ngroups + 1, unroll=1):
                size = mM - start
                if j < ngroups:
                    size = cutlass.min(cutlass.max(gs[j, lg], Int32(0)), mM - start)
                nt = (size + R - 1) // R
                if (slot >= seen) & (slot < seen + nt):   # slot ranges are disjoint
                    valid = Boolean(True)
                    g = j
                    row0 = start + (slot - seen) * R
                    row_end = start + size
                seen = seen + nt
                start = start + size
        else:  # ragged_k: (m-tile, n-tile, group, batch)
            ngroups = gs.shape[0]
            row0 = (w % tiles_m) * R
            rest = w // tiles_m
            col0 = (rest % tiles_n) * C
            rest = rest // tiles_n
            g = rest % ngroups
            l = rest // ngroups
            lg = cutlass.min(l, gs.shape[1] - 1)
            for j in cutlass.range(g, unroll=1):
                k0 = k0 + cutlass.min(cutlass.max(gs[j, lg], Int32(0)), kK - k0)
            k_len = cutlass.min(cutlass.max(gs[g, lg], Int32(0)), kK - k0)
        do_mma = valid & (k_len > 0)
        if const_expr(self.mode == "ragged_m"):
            do_mma = do_mma & (g < gs.shape[0])
        return valid, do_mma, row0, col0, l, g, k0, k_len, row_end

    # ---- the kernel -----------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mma, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
               tma_c: cute.CopyAtom, mC_tma: cute.Tensor, mC: cute.Tensor, gs, smem_layouts, epi_tile: cute.Tile,
               fused):
        """One persistent CTA: barriers, smem and TMEM, then the TMA warp, the MMA warp and the
        epilogue warps each run their role. ``mma``: (the tiled MMA, the cluster's (v, m, n, k)
        layout); ``smem_layouts``: A's, B's and C's staged smem layouts; ``fused``: the fused
        epilogue's bias, D's TMA atom and TMA tensor, D, and Z (each None when unused)."""
        tiled_mma, cluster_vmnk = mma
        bias, tma_d, mD_tma, mD, mZ = fused
        a_smem, b_smem, c_smem = smem_layouts
        cfg = self.cfg
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp == self.TMA_WARP:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            cpasync.prefetch_descriptor(tma_c)
            if const_expr(self.preact):
                cpasync.prefetch_descriptor(tma_d)

        bidx, bidy, bidz = cute.arch.block_idx()
        _, _, grid_z = cute.arch.grid_dim()
        v_idx = bidx % self.v
        is_leader = v_idx == 0
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        crd = cluster_vmnk.get_flat_coord(rank)   # (v, m', n', 0) inside the cluster

        @cute.struct
        class Storage:
            ab_bar: cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2]
            acc_bar: cute.struct.MemRange[cutlass.Int64, self.acc_stages * 2]
            tmem_dealloc_bar: cutlass.Int64
            tmem_addr: cutlass.Int32

        smem = dsl.memory.SmemAllocator()
        st = smem.allocate(Storage)

        # smem ring A/B: TMA -> UMMA. Each stage is released by every MMA that read it
        # (one per CTA of the multicast row and column).
        ab_pipe = pipeline.PipelineTmaUmma.create(
            barrier_storage=st.ab_bar.data_ptr(), num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mcast_a + self.mcast_b - 1),
            tx_count=self.tx_bytes, cta_layout_vmnk=cluster_vmnk, defer_sync=True)
        # TMEM accumulator stages: UMMA commit -> epilogue; released by the 4 epilogue warps
        # of both CTAs of a pair (they read their halves of the same MMA tile).
        acc_pipe = pipeline.PipelineUmmaAsync.create(
            barrier_storage=st.acc_bar.data_ptr(), num_stages=self.acc_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.EPI_WARPS * self.v),
            cta_layout_vmnk=cluster_vmnk, defer_sync=True)
        tmem = dsl.memory.TmemAllocator(
            st.tmem_addr.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=self.BAR_TMEM, num_threads=32 * (self.EPI_WARPS + 1)),
            allocator_warp_id=0, is_two_cta=cfg.two_cta,
            two_cta_tmem_dealloc_mbar_ptr=st.tmem_dealloc_bar.ptr)
        epi_bar = pipeline.NamedBarrier(barrier_id=self.BAR_EPI, num_threads=32 * self.EPI_WARPS)
        # barrier inits must be visible cluster-wide before any peer arrives on them
        pipeline.pipeline_init_arrive(cluster_shape_mn=cluster_vmnk, is_relaxed=True)

        sA = smem.allocate_tensor(element_type=self.ab_dtype, layout=a_smem.outer, byte_alignment=128,
                                  swizzle=a_smem.inner)
        sB = smem.allocate_tensor(element_type=self.ab_dtype, layout=b_smem.outer, byte_alignment=128,
                                  swizzle=b_smem.inner)
        sC = smem.allocate_tensor(element_type=self.c_dtype, layout=c_smem.outer, byte_alignment=128,
                                  swizzle=c_smem.inner)
        a_mask = None
        b_mask = None
        if const_expr(self.mcast_a > 1 or self.mcast_b > 1 or cfg.two_cta):
            a_mask = cpasync.create_tma_multicast_mask(cluster_vmnk, crd, mcast_mode=2)
            b_mask = cpasync.create_tma_multicast_mask(cluster_vmnk, crd, mcast_mode=1)

        thr_mma = tiled_mma.get_slice(v_idx)
        # (MMA, MMA_M, MMA_N, STAGE) accumulator layout; its TMEM address comes from tmem.alloc
        acc_layout = tiled_mma.make_fragment_C(
            cute.append(tiled_mma.partition_shape_C(self.mma_tiler[:2]), self.acc_stages)).layout
        tCrA = tiled_mma.make_fragment_A(sA)
        tCrB = tiled_mma.make_fragment_B(sB)
        a_cta_layout = cute.make_layout(cute.slice_(cluster_vmnk, (0, 0, None, 0)).shape)
        b_cta_layout = cute.make_layout(cute.slice_(cluster_vmnk, (0, None, 0, 0)).shape)

        mM = mC.shape[0]
        nN = mC.shape[1]
        kK = mA.shape[1]
        n_work = self.num_work(mC, gs)
        pipeline.pipeline_init_wait(cluster_shape_mn=cluster_vmnk)
        cta = Sm100Cta(tiled_mma, tma_a, mA, tma_b, mB, tma_c, mC_tma, mC, gs, cluster_vmnk, epi_tile, warp, tidx,
                       bidz, grid_z, is_leader, crd, v_idx, ab_pipe, acc_pipe, tmem, epi_bar, sA, sB, sC, a_mask,
                       b_mask, thr_mma, acc_layout, tCrA, tCrB, a_cta_layout, b_cta_layout, mM, nN, kK, n_work,
                       bias=bias, tma_d=tma_d, mD_tma=mD_tma, mD=mD, mZ=mZ)

        if warp == self.TMA_WARP:
            self.tma_warp(cta)
        if warp == self.MMA_WARP:
            self.mma_warp(cta)
        if warp < self.MMA_WARP:
            self.epilogue_warps(cta)

    @cute.jit
    def tma_warp(self, cta: Sm100Cta):
        """Warp 5: TMA loads of every tile's A and B k-tiles into the smem ring."""
        cfg = self.cfg
        tma_a, mA, tma_b, mB, mC, gs = cta.tma_a, cta.mA, cta.tma_b, cta.mB, cta.mC, cta.gs
        bidz, grid_z, crd, ab_pipe, sA, sB = cta.bidz, cta.grid_z, cta.crd, cta.ab_pipe, cta.sA, cta.sB
        a_mask, b_mask, thr_mma, a_cta_layout = cta.a_mask, cta.b_mask, cta.thr_mma, cta.a_cta_layout
        b_cta_layout, mM = cta.b_cta_layout, cta.mM
        nN, kK, n_work = cta.nN, cta.kK, cta.n_work
        prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stages)
        w = bidz
        while w < n_work:
            valid, do_mma, row0, col0, l, g, k0, k_len, row_end = self.tile(w, mM, nN, kK, gs)
            if do_mma:
                mma_row = row0 + crd[1] * cfg.tile_m
                col = col0 + crd[2] * cfg.tile_n
                la = self.ab_batch(l, mC, mA)   # L extent 1 = broadcast
                gA = cute.local_tile(cute.domain_offset((mma_row, k0), mA[None, None, la]),
                                     (cfg.tile_m, self.bk), (0, None))
                if const_expr(self.mode == "ragged_m"):
                    lb = cutlass.min(l, mB.shape[3] - 1)
                    mB2 = mB[None, None, g, lb]
                else:
                    lb = self.ab_batch(l, mC, mB)
                    mB2 = mB[None, None, lb]
                gB = cute.local_tile(cute.domain_offset((col, k0), mB2), (cfg.tile_n, self.bk), (0, None))
                tAsA, tAgA = cpasync.tma_partition(tma_a, crd[2], a_cta_layout, cute.group_modes(sA, 0, 3),
                                                   cute.group_modes(thr_mma.partition_A(gA), 0, 3))
                tBsB, tBgB = cpasync.tma_partition(tma_b, crd[1], b_cta_layout, cute.group_modes(sB, 0, 3),
                                                   cute.group_modes(thr_mma.partition_B(gB), 0, 3))
                k_tiles = (k_len + self.bk - 1) // self.bk
                for kt in cutlass.range(k_tiles, unroll=1):
                    ab_pipe.producer_acquire(prod)
                    bar = ab_pipe.producer_get_barrier(prod)
                    cute.copy(tma_a, tAgA[(None, kt)], tAsA[(None, prod.index)], tma_bar_ptr=bar, mcast_mask=a_mask)
                    cute.copy(tma_b, tBgB[(None, kt)], tBsB[(None, prod.index)], tma_bar_ptr=bar, mcast_mask=b_mask)
                    ab_pipe.producer_commit(prod)
                    prod.advance()
            w += grid_z
        # do not exit while peers may still release (arrive on) our empty barriers
        ab_pipe.producer_tail(prod)

    @cute.jit
    def mma_warp(self, cta: Sm100Cta):
        """Warp 4: the pair leader's tcgen05 MMAs into the double-buffered TMEM accumulator."""
        tiled_mma, gs, bidz, grid_z = cta.tiled_mma, cta.gs, cta.bidz, cta.grid_z
        is_leader, ab_pipe = cta.is_leader, cta.ab_pipe
        acc_pipe, tmem, sA, sB = cta.acc_pipe, cta.tmem, cta.sA, cta.sB
        thr_mma, acc_layout = cta.thr_mma, cta.acc_layout
        tCrA, tCrB, mM, nN, kK, n_work = cta.tCrA, cta.tCrB, cta.mM, cta.nN, cta.kK, cta.n_work
        tmem.wait_for_alloc()
        tAcc_all = cute.make_tensor(tmem.retrieve_ptr(self.acc_dtype), acc_layout)
        cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages)
        accp = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.acc_stages)
        n_kblocks = cute.size(tCrA, mode=[2])
        w = bidz
        while w < n_work:
            valid, do_mma, row0, col0, l, g, k0, k_len, row_end = self.tile(w, mM, nN, kK, gs)
            # only the pair's leader issues MMAs (cta_group::2 reads both CTAs' smem)
            if do_mma & is_leader:
                acc_pipe.producer_acquire(accp)
                tAcc = tAcc_all[(None, None, None, accp.index)]
                tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
                k_tiles = (k_len + self.bk - 1) // self.bk
                for kt in cutlass.range(k_tiles, unroll=1):
                    ab_pipe.consumer_wait(cons)
                    if const_expr(self.mode == "ragged_k"):
                        # the last k-tile of a group overlaps the next group: zero it
                        self.zero_k_tail(thr_mma, sA, sB, cons.index, k_len - kt * self.bk)
                    for kb in cutlass.range_constexpr(n_kblocks):
                        cute.gemm(tiled_mma, tAcc, tCrA[(None, None, kb, cons.index)],
                                  tCrB[(None, None, kb, cons.index)], tAcc)
                        tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                    ab_pipe.consumer_release(cons)   # tcgen05.commit -> empty barrier(s)
                    cons.advance()
                acc_pipe.producer_commit(accp)       # tcgen05.commit -> acc full (both CTAs)
            if do_mma:
                accp.advance()
            w += grid_z
        acc_pipe.producer_tail(accp)

    @cute.jit
    def epilogue_warps(self, cta: Sm100Cta):
        """Warps 0-3: allocate TMEM, then per tile TMEM -> registers -> smem -> TMA store (or
        row-predicated global stores), and free TMEM at the end."""
        cfg = self.cfg
        tma_c, mC_tma, mC, gs, epi_tile = cta.tma_c, cta.mC_tma, cta.mC, cta.gs, cta.epi_tile
        tidx, bidz, grid_z, crd = cta.tidx, cta.bidz, cta.grid_z, cta.crd
        v_idx, acc_pipe = cta.v_idx, cta.acc_pipe
        tmem, epi_bar, sC, acc_layout, mM, nN = cta.tmem, cta.epi_bar, cta.sC, cta.acc_layout, cta.mM, cta.nN
        kK, n_work = cta.kK, cta.n_work
        tmem.allocate(self.tmem_cols)
        # one allocation per CTA for the kernel's life: let a co-resident CTA allocate
        tmem.relinquish_alloc_permit()
        tmem.wait_for_alloc()
        tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
        tAcc_all = as_mn(cute.make_tensor(tmem_ptr, acc_layout))   # (cta_m, tile_n, STAGE)
        accc = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.acc_stages)
        c_pipe = pipeline.PipelineTmaStore.create(
            num_stages=self.c_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * self.EPI_WARPS))

        t2r_atom = sm100.get_tmem_load_op(self.cta_tile, self.c_layout, self.c_dtype, self.acc_dtype,
                                          epi_tile, cfg.two_cta)
        tAcc_epi = cute.flat_divide(tAcc_all, epi_tile)       # (EM, EN, nM, nN, STAGE)
        t2r = tcgen05.make_tmem_copy(t2r_atom, tAcc_epi[(None, None, 0, 0, 0)])
        thr_t2r = t2r.get_slice(tidx)
        tTR_tAcc = cute.group_modes(thr_t2r.partition_S(tAcc_epi), 3, 5)   # (T2R, M, N, SUB, STAGE)
        frag = thr_t2r.partition_D(cute.flat_divide(cute.make_identity_tensor((self.cta_m, cfg.tile_n)),
                                                    epi_tile))
        tTR_rAcc = cute.make_rmem_tensor(frag[(None, None, None, 0, 0)].shape, self.acc_dtype)
        tTR_rC = cute.make_rmem_tensor(frag[(None, None, None, 0, 0)].shape, self.c_dtype)
        r2s = cute.make_tiled_copy_D(
            sm100.get_smem_store_op(self.c_layout, self.c_dtype, self.acc_dtype, t2r), t2r)
        thr_r2s = r2s.get_slice(tidx)
        tRS_sC = thr_r2s.partition_D(sC)
        tRS_rC = r2s.retile(tTR_rC)
        n_sub = cute.size(tTR_tAcc, mode=[3])
        # each fragment element's (row, column) in the CTA tile, subtiles grouped like tTR_tAcc's
        coords = cute.group_modes(frag, 3, 5) if const_expr(self.reads_coords) else None
        tTR_rZ = cute.make_rmem_tensor(tTR_rC.shape, self.c_dtype) if const_expr(self.dact) else None

        ep = EpilogueRegs(t2r, tTR_tAcc, tTR_rAcc, thr_t2r, tTR_rC, r2s, tRS_rC, tRS_sC, n_sub, epi_tile, sC, tma_c,
                          mC_tma, mC, c_pipe, epi_bar, tidx, coords, cta.bias, cta.tma_d, cta.mD_tma, cta.mD, cta.mZ,
                          tTR_rZ, mM, nN, gs)
        stored = Int32(0)   # subtiles stored so far: picks the smem staging buffer
        w = bidz
        while w < n_work:
            valid, do_mma, row0, col0, l, g, k0, k_len, row_end = self.tile(w, mM, nN, kK, gs)
            if valid:
                cta_row = row0 + (crd[1] * self.v + v_idx) * self.cta_m
                col = col0 + crd[2] * cfg.tile_n
                if do_mma:
                    acc_pipe.consumer_wait(accc)
                lc = self.c_batch(l, mC)
                if const_expr(self.mode == "ragged_m"):
                    # TMA store clips only at M: a tile that crosses into the next group
                    # is stored row-predicated from registers instead
                    if (row_end < mM) & (cta_row + self.cta_m > row_end):
                        self.store_predicated(ep, accc.index, do_mma, cta_row, col, lc, g, row_end, nN)
                    else:
                        stored = self.store_tma(ep, accc.index, do_mma, cta_row, col, lc, g, stored)
                else:
                    stored = self.store_tma(ep, accc.index, do_mma, cta_row, col, lc, g, stored)
                if do_mma:
                    # TMEM reads done (values already in smem/gmem): hand the stage back
                    cute.arch.fence_view_async_tmem_load()
                    with cute.arch.elect_one():
                        acc_pipe.consumer_release(accc)
                    accc.advance()
            w += grid_z
        c_pipe.producer_tail()
        # every epilogue warp has finished its tcgen05.ld before warp 0 frees TMEM
        epi_bar.arrive_and_wait()
        tmem.free(tmem_ptr)

    @cute.jit
    def load_acc(self, t2r, tTR_tAcc, tTR_rAcc, s: cutlass.Constexpr, acc_idx, do_mma):
        """One epilogue subtile of the accumulator into registers (zeros for a zero tile)."""
        if do_mma:
            cute.copy(t2r, tTR_tAcc[(None, None, None, s, acc_idx)], tTR_rAcc)
        else:
            tTR_rAcc.fill(0.0)

    @cute.jit
    def store_tma(self, ep: EpilogueRegs, acc_idx, do_mma, cta_row, col, l, g, stored):
        """Registers -> smem (c_stages ring) -> TMA store, each subtile's pre-activation output D
        first where there is one; returns the count of subtiles stored."""
        if const_expr(self.mode == "ragged_k"):
            mC2 = ep.mC_tma[None, None, g, l]
        else:
            mC2 = ep.mC_tma[None, None, l]
        bSG_sC, bSG_gC = self.tile_partition(ep, ep.tma_c, mC2, cta_row, col)
        bSG_gD = None
        if const_expr(self.preact):
            bSG_gD = self.tile_partition(ep, ep.tma_d, ep.mD_tma[None, None, l], cta_row, col)[1]
        return self.walk_subtiles(
            ep, acc_idx, do_mma, (cta_row, col, l), g,
            lambda s, stored: self.store_subtile(ep, ep.tma_d, bSG_sC, bSG_gD, s, stored),
            lambda s, stored: self.store_subtile(ep, ep.tma_c, bSG_sC, bSG_gC, s, stored), stored)

    def walk_subtiles(self, ep: EpilogueRegs, acc_idx, do_mma, at: tuple, g, store_d, store_c, state):
        """The epilogue's pass over the tile at ``at`` = (cta_row, col, l), either store path's:
        each subtile from TMEM to registers, its bias and activation where fused, the
        pre-activation output D stored first where there is one (``store_d``), then C
        (``store_c``). The stores take and return ``state`` (the TMA path's count of subtiles
        stored). Plain Python, traced inline: the loop is static."""
        col, l = at[1], at[2]
        bias = self.tile_bias(ep, g, l) if self.fuse_bias else None
        for s in range(ep.n_sub):
            self.load_acc(ep.t2r, ep.tTR_tAcc, ep.tTR_rAcc, s, acc_idx, do_mma)
            if self.fused:
                self.pre_activation(ep, s, col, bias)
                if self.preact:
                    state = store_d(s, state)
                self.post_activation(ep, s, at)
            state = store_c(s, state)
        return state

    def tile_partition(self, ep: EpilogueRegs, tma, mX, cta_row, col) -> tuple:
        """The TMA partitions of the smem ring and of the CTA tile at (cta_row, col) of ``mX`` (C
        or D of one batch), the latter's epilogue subtiles in one mode."""
        gX = cute.local_tile(cute.domain_offset((cta_row, col), mX), (self.cta_m, self.cfg.tile_n), (0, 0))
        bSG_sX, bSG_gX = cpasync.tma_partition(
            tma, 0, cute.make_layout(1), cute.group_modes(ep.sC, 0, 2),
            cute.group_modes(cute.flat_divide(gX, ep.epi_tile), 0, 2))
        return bSG_sX, cute.group_modes(bSG_gX, 1, cute.rank(bSG_gX))

    @cute.jit
    def store_subtile(self, ep: EpilogueRegs, tma, bSG_sC, bSG_g, s: cutlass.Constexpr, stored):
        """``ep.tTR_rAcc`` rounded to C's dtype -> ring slot ``stored % c_stages`` -> TMA store
        to subtile ``s`` of ``bSG_g`` (see tile_partition); returns ``stored + 1``."""
        r2s, tRS_rC, epi_bar, c_pipe = ep.r2s, ep.tRS_rC, ep.epi_bar, ep.c_pipe
        tRS_rC.store(r2s.retile(ep.tTR_rAcc).load().to(self.c_dtype))
        buf = stored % self.c_stages
        cute.copy(r2s, tRS_rC, ep.tRS_sC[(None, None, None, buf)])
        # generic-proxy smem writes -> visible to the TMA engine (async proxy)
        cute.arch.fence_proxy("async.shared", space="cta")
        epi_bar.arrive_and_wait()
        if ep.tidx == 0:   # one thread issues, commits and waits on the bulk group
            cute.copy(tma, bSG_sC[(None, buf)], bSG_g[(None, s)])
            c_pipe.producer_commit()
            c_pipe.producer_acquire()   # the buffer written next is free again
        epi_bar.arrive_and_wait()
        return stored + 1

    @cute.jit
    def store_predicated(self, ep: EpilogueRegs, acc_idx, do_mma, cta_row, col, l, g, row_end, nN):
        """TMEM -> registers -> global with a per-element (row < row_end, col < N) guard, each
        subtile's pre-activation output D first where there is one."""
        off = (cta_row, col)
        tTR_gC = self.rows_partition(ep, ep.mC[None, None, l], off)
        cC = cute.local_tile(cute.domain_offset(off, cute.make_identity_tensor((ep.mC.shape[0], nN))),
                             (self.cta_m, self.cfg.tile_n), (0, 0))
        tTR_cC = cute.group_modes(ep.thr_t2r.partition_D(cute.flat_divide(cC, ep.epi_tile)), 3, 5)
        tTR_gD = self.rows_partition(ep, ep.mD[None, None, l], off) if const_expr(self.preact) else None
        self.walk_subtiles(ep, acc_idx, do_mma, (cta_row, col, l), g,
                           lambda s, _: self.store_guarded(ep, tTR_gD, tTR_cC, s, row_end, nN),
                           lambda s, _: self.store_guarded(ep, tTR_gC, tTR_cC, s, row_end, nN), None)

    def rows_partition(self, ep: EpilogueRegs, mX, off: tuple):
        """This thread's elements of the CTA tile at ``off`` of ``mX`` (C or D of one batch),
        partitioned like the TMEM load, subtiles in one mode."""
        gX = cute.local_tile(cute.domain_offset(off, mX), (self.cta_m, self.cfg.tile_n), (0, 0))
        return cute.group_modes(ep.thr_t2r.partition_D(cute.flat_divide(gX, ep.epi_tile)), 3, 5)

    @cute.jit
    def store_guarded(self, ep: EpilogueRegs, tTR_gX, tTR_cX, s: cutlass.Constexpr, row_end, nN):
        """``ep.tTR_rAcc`` rounded to C's dtype -> subtile ``s`` of ``tTR_gX`` (rows_partition),
        each element where its coordinates (``tTR_cX``) are inside (row_end, N)."""
        tTR_rC = ep.tTR_rC
        tTR_rC.store(ep.tTR_rAcc.load().to(self.c_dtype))
        gs_ = tTR_gX[(None, None, None, s)]
        cs_ = tTR_cX[(None, None, None, s)]
        for i in cutlass.range_constexpr(cute.size(tTR_rC)):
            rc = cs_[i]
            if (rc[0] < row_end) & (rc[1] < nN):
                gs_[i] = tTR_rC[i]

    @cute.jit
    def zero_k_tail(self, thr_mma, sA, sB, stage, valid_k):
        """Zero k columns >= valid_k of one A/B smem stage (generic stores, then a proxy
        fence so the UMMA's async-proxy reads see them)."""
        if valid_k < self.bk:
            lane = cute.arch.lane_idx()
            for op in cutlass.range_constexpr(2):
                s = sA[(None, None, None, stage)] if op == 0 else sB[(None, None, None, stage)]
                ext = self.cfg.tile_m if op == 0 else self.cfg.tile_n
                idt = cute.make_identity_tensor((ext, self.bk))
                crd = thr_mma.partition_A(idt) if op == 0 else thr_mma.partition_B(idt)
                # same shape and the same colexicographic order as the smem view
                assert cute.size(s) == cute.size(crd) and s.shape[1:] == crd.shape[1:], (s.shape, crd.shape)
                for i in cutlass.range(lane, cute.size(s), 32, unroll=1):
                    if crd[i][1] >= valid_k:
                        s[i] = self.ab_dtype(0)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_warp()


def make_launcher(mode: str, config: Config, batch_modes: int, signature: abi.Signature, bias: bool = False,
                  activation: str = "", preact: bool = False, dact: str = ""):
    """The @cute.jit launcher of ``signature`` for ``mode`` ("dense", "ragged_m", "ragged_k"),
    with a fused epilogue (see GemmSpec's and GroupedSpec's bias, activation, preact and dact)."""
    return launcher_for(signature, Sm100Gemm(mode, config, batch_modes, bias, activation, preact, dact).launch)
