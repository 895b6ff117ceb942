"""Hopper (sm_90a) grouped GEMM for mixture-of-experts, group sizes read on the device.

Two modes of :class:`~jax_cute.kernels.gemm_spec.GroupedSpec`:

* ``ragged_m`` (forward, lhs gradient): rows of A are split into groups; group g multiplies by
  B[:, :, g]. Tiles start at the first row of their group (not at multiples of the tile), so a
  tile never mixes groups; it may *read* rows of the next group but its store is clipped at the
  group end. Rows past the last group are a pseudo-group "G" with no K loop: its tiles store 0.
* ``ragged_k`` (rhs gradient): K (tokens) is split into groups; every (g, m-tile, n-tile) is a
  tile whose K loop runs over that group's rows only; empty groups store 0.

Group boundaries never need tile alignment because of the "ragged TMA" descriptor trick (also
used by Triton and quack): the ragged mode is given extent 2**30 and two extra modes whose
strides (2**34 - s, s) cancel modulo 2**64, so a tile at (offset, length) is addressed at
coordinate 2**30 - length in the ragged mode. TMA's own bounds check then zero-fills loads and
drops stores past the group end, with one descriptor built on the host for the whole launch.
The trick needs the ragged mode to have a 16-byte-multiple stride, so ragged_k needs MN-major
A and B, and ragged_m an N-major C (what ragged_dot and its gradients use).

Scheduling is persistent: one CTA per SM walks a linear tile index (start blockIdx.x, step
gridDim.x) over all (batch, group, tile). Every warp that needs the schedule (the TMA warp and
each MMA warp) maps its index to a tile itself with a warp-wide prefix scan over 32 groups at a
time, keeping the scan of the current 32-group chunk in registers, so nothing is precomputed,
no workspace is needed and replays with new sizes are exact (CUDA-graph safe). Uniform tile
work keeps SMs balanced even for skewed sizes in ragged_m; in ragged_k the round-robin spreads
each CTA's tiles over all groups.

Warp roles: warpgroup 0 is the producer (warp 0 issues TMA, registers lowered with setmaxnreg),
warpgroups 1-2 cooperate on one 128 x tile_n tile with WGMMA (fp32 accumulators), then stage
the converted tile through shared memory and store it with TMA.
"""


import dataclasses

from jax_cute.kernels import abi
from jax_cute.kernels.gemm_spec import GroupedSpec, Workspace

FAMILY = "sm90_grouped"
VERSION = 3
ARCH = "sm_90a"

_IN_DTYPES = ("bfloat16", "float16")
_OUT_DTYPES = ("bfloat16", "float16", "float32")
_BIG = 2**30          # extent of a ragged mode (see module docstring)
_MAXI = 2**31 - 1     # extent of the two extra wrap-around modes


@dataclasses.dataclass(frozen=True)
class Config:
    tile_n: int = 256     # tile_m is always 128 (two consumer warpgroups of 64 rows)
    raster: int = 8       # ragged_m: m-tiles per raster panel (L2 reuse of B)
    sms: int = 132        # persistent grid size

    def key(self) -> str:
        return f"n{self.tile_n}.r{self.raster}.sm{self.sms}"


TILE_M = 128
TILE_K = 64


def unsupported(spec) -> str | None:
    if not isinstance(spec, GroupedSpec) or spec.mode not in ("ragged_m", "ragged_k"):
        return "sm90_grouped runs GroupedSpec ragged_m / ragged_k only"
    if spec.a_dtype not in _IN_DTYPES or spec.b_dtype != spec.a_dtype:
        return f"inputs must both be bf16 or both fp16, got {spec.a_dtype}/{spec.b_dtype}"
    if spec.c_dtype not in _OUT_DTYPES:
        return f"output dtype {spec.c_dtype} not supported"
    if spec.acc_dtype != "float32":
        return "accumulation must be float32"
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


def candidate_configs(spec) -> list[Config]:
    return [Config(tile_n=256), Config(tile_n=128)]


def heuristic(spec, m, n, k, g, l, num_sms: int = 132) -> Config:
    # 128x256 is the most efficient tile; 128x128 where 256-wide tiles would pad N by 128
    # columns or more (N % 256 in (0, 128]: the last 256-wide tile is at least half empty)
    # or, for ragged_k, where there are too few tiles to fill the SMs.
    # Measured on an H200 (2026-11-21, rotated timing, the suite's group sizes): at N=1408 the
    # ragged_m forward on 128x128 beat 128x256 by 1-6% on uniform and 4-10% on Dirichlet(0.3)
    # group sizes in two runs; the ragged_k rhs gradient at N=1408, also on 128x128 since,
    # held its speed in the suite (605 vs 603 TFLOP/s uniform). Multiples of 256 keep 128x256.
    tile_n = 128 if n <= 128 or 0 < n % 256 <= 128 else 256
    if spec.mode == "ragged_k" and -(-m // TILE_M) * -(-n // 256) * g * l < 2 * num_sms:
        tile_n = 128
    return Config(tile_n=tile_n, sms=num_sms)


def signature(spec, config) -> abi.Signature:
    return spec.signature()


def workspace(spec, config, m, n, k, g, l) -> list[Workspace]:
    return []


def launcher(spec, config):
    why = unsupported(spec)
    if why:
        raise ValueError(f"{FAMILY}: {why}")
    return _build(spec, config)


# ---------------------------------------------------------------------------------------------
# The kernel (imports the DSL; only reached when compiling)


def _build(spec: GroupedSpec, cfg: Config):
    from jax_cute.kernels import dsl
    from jax_cute.kernels.dsl import cute, cutlass, pipeline, sm90_utils, cpasync, warpgroup
    from jax_cute.kernels.dsl import memory, LayoutEnum
    from jax_cute.kernels.sm90_mainloop import wgmma_mainloop
    Int32, Int64 = dsl.Int32, dsl.Int64
    wgmma = wgmma_mainloop()

    ragged_m = spec.mode == "ragged_m"
    BM, BN, BK = TILE_M, cfg.tile_n, TILE_K
    RASTER = cfg.raster
    c_dt = dsl.dsl_dtype(spec.c_dtype)
    ab_dt = dsl.dsl_dtype(spec.a_dtype)
    EPI_STAGES = 4 if c_dt.width == 16 else 2
    NUM_THREADS = 384            # 1 producer + 2 consumer warpgroups
    MMA_THREADS = 256
    epi_tile = (BM, 32)          # epilogue sub-tile staged through shared memory

    def ragged(t, dim):
        """Rank-3 tensor -> rank-5 ragged-TMA view along ``dim`` (see module docstring)."""
        s = t.stride[dim]
        shape = tuple(_BIG if i == dim else t.shape[i] for i in range(3)) + (_MAXI, _MAXI)
        stride = tuple(t.stride) + (Int64(2**34) - s, s)
        return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=stride))

    def ragged_view(t, dim, start, length):
        """Rank-3 view of a ragged TMA tensor whose index 0 is row ``start`` and whose rows
        >= ``length`` are out of bounds (zero-filled loads, dropped stores)."""
        sub = t[(None, None, None, _BIG, start + length)]
        off = tuple(_BIG - length if i == dim else None for i in range(3))
        return cute.domain_offset(off, sub)

    class GroupedGemm:
        @cute.jit
        def __call__(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, gs: cute.Tensor, stream):
            a_layout = LayoutEnum.from_tensor(a)
            b_layout = LayoutEnum.from_tensor(b)
            c_layout = LayoutEnum.from_tensor(c)
            tiled_mma = sm90_utils.make_trivial_tiled_mma(
                ab_dt, ab_dt, a_layout.sm90_mma_major_mode(), b_layout.sm90_mma_major_mode(),
                cutlass.Float32, (2, 1, 1), tiler_mn=(64, BN))
            tile_mnk = (BM, BN, BK)
            # Shared memory: as many A/B stages as fit beside the epilogue buffers.
            ab_bytes = (BM * BK + BN * BK) * ab_dt.width // 8
            epi_bytes = BM * 32 * c_dt.width // 8 * EPI_STAGES
            smem_cap = memory.get_smem_capacity_in_bytes("sm_90")
            self.stages = (smem_cap - 2048 - epi_bytes) // ab_bytes
            a_sl = sm90_utils.make_smem_layout_a(a_layout, tile_mnk, ab_dt, self.stages)
            b_sl = sm90_utils.make_smem_layout_b(b_layout, tile_mnk, ab_dt, self.stages)
            c_sl = sm90_utils.make_smem_layout_epi(c_dt, c_layout, epi_tile, EPI_STAGES)
            self.c_layout = c_layout

            load = cpasync.CopyBulkTensorTileG2SOp()
            a_src = a if ragged_m else ragged(a, 1)
            b_src = b if ragged_m else ragged(b, 1)
            c_dst = ragged(c, 0) if ragged_m else c
            tma_a, mA = cpasync.make_tiled_tma_atom(load, a_src, cute.slice_(a_sl, (None, None, 0)), (BM, BK))
            tma_b, mB = cpasync.make_tiled_tma_atom(load, b_src, cute.slice_(b_sl, (None, None, 0)), (BN, BK))
            tma_c, mC = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), c_dst, cute.slice_(c_sl, (None, None, 0)), epi_tile)

            M, K = a.shape[0], a.shape[1]
            N = b.shape[0]
            G = gs.shape[0]
            if cutlass.const_expr(ragged_m):
                L, la_n, lb_n = c.shape[2], a.shape[2], b.shape[3]
            else:
                L, la_n, lb_n = c.shape[3], a.shape[2], b.shape[2]
            lg_n = gs.shape[1]

            @cute.struct
            class Storage:
                bars: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
                sA: cute.struct.Align[cute.struct.MemRange[ab_dt, cute.cosize(a_sl)], 1024]
                sB: cute.struct.Align[cute.struct.MemRange[ab_dt, cute.cosize(b_sl)], 1024]
                sC: cute.struct.Align[cute.struct.MemRange[c_dt, cute.cosize(c_sl)], 1024]

            self.storage = Storage
            self.kernel(tma_a, mA, tma_b, mB, tma_c, mC, gs, tiled_mma, a_sl, b_sl, c_sl,
                        M, N, K, G, L, la_n, lb_n, lg_n).launch(
                grid=(cfg.sms, 1, 1), block=(NUM_THREADS, 1, 1), min_blocks_per_mp=1, stream=stream)

        # -- device-side schedule ---------------------------------------------------------------
        @cute.jit
        def load_chunk(self, gs, cl, cg0, rows0, tiles0, M, N, K, G, L, lg_n):
            """Scan 32 entries (groups) of batch ``cl`` starting at ``cg0``: per lane its clipped
            row range [start, end) and the global inclusive prefix of tiles."""
            lane = cute.arch.lane_idx()
            R = M if cutlass.const_expr(ragged_m) else K
            g = cg0 + lane
            sz = Int32(0)
            if cl < L:
                if g < G:
                    sz = gs[(g, min(cl, lg_n - 1))]
                if cutlass.const_expr(ragged_m):
                    if g == G:
                        sz = R             # rows past the last group: the zero-store pseudo-group
            sz = min(max(sz, 0), R)
            # inclusive scan of rows, saturating at R without overflow
            x = sz
            for d in cutlass.range_constexpr(5):
                y = cute.arch.shuffle_sync_up(x, 1 << d)
                if lane >= (1 << d):
                    x = y + min(x, R - y)
            xe = cute.arch.shuffle_sync_up(x, 1)
            if lane == 0:
                xe = Int32(0)
            start = rows0 + min(xe, R - rows0)
            end = rows0 + min(x, R - rows0)
            nt = (N + BN - 1) // BN
            t = Int32(0)
            if cutlass.const_expr(ragged_m):
                t = (end - start + BM - 1) // BM * nt
            else:
                if g < G:
                    t = (M + BM - 1) // BM * nt
            if cl >= L:
                t = Int32(0)
            for d in cutlass.range_constexpr(5):
                y = cute.arch.shuffle_sync_up(t, 1 << d)
                if lane >= (1 << d):
                    t = t + y
            incl = tiles0 + t
            return start, end, incl

        @cute.jit
        def find(self, gs, w, cl, cg0, rows0, tiles0, start, end, incl, M, N, K, G, L, lg_n):
            """Advance the walker (chunks only move forward) until tile ``w`` lies in the
            current chunk or the batches run out; returns the new state and the tile."""
            E = G + 1 if cutlass.const_expr(ragged_m) else G
            last = cute.arch.shuffle_sync(incl, 31)
            while w >= last and cl < L:
                rows0 = cute.arch.shuffle_sync(end, 31)
                tiles0 = last
                cg0 = cg0 + 32
                if cg0 >= E:
                    cg0 = Int32(0)
                    rows0 = Int32(0)
                    cl = cl + 1
                start, end, incl = self.load_chunk(gs, cl, cg0, rows0, tiles0, M, N, K, G, L, lg_n)
                last = cute.arch.shuffle_sync(incl, 31)
            sel = cute.arch.popc(cute.arch.vote_ballot_sync(incl <= w))
            sel = min(sel, 31)
            g = cg0 + sel
            t_start = cute.arch.shuffle_sync(start, sel)
            t_end = cute.arch.shuffle_sync(end, sel)
            t_excl = cute.arch.shuffle_sync(incl, sel - 1)
            if sel == 0:
                t_excl = tiles0
            local = w - t_excl
            nt = (N + BN - 1) // BN
            mt = (M + BM - 1) // BM
            if cutlass.const_expr(ragged_m):
                mt = (t_end - t_start + BM - 1) // BM
            # raster: panels of RASTER m-tiles, n-tiles walked inside a panel
            panel = local // (RASTER * nt)
            rem = local - panel * (RASTER * nt)
            h = min(mt - panel * RASTER, RASTER)
            h = max(h, 1)
            n_t = rem // h
            m_t = panel * RASTER + rem - n_t * h
            valid = cl < L
            return cl, cg0, rows0, tiles0, start, end, incl, valid, g, t_start, t_end, m_t, n_t

        # -- the kernel -------------------------------------------------------------------------
        @cute.kernel
        def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
                   tma_c: cute.CopyAtom, mC: cute.Tensor, gs: cute.Tensor, tiled_mma: cute.TiledMma,
                   a_sl: cute.ComposedLayout, b_sl: cute.ComposedLayout, c_sl: cute.ComposedLayout,
                   M: Int32, N: Int32, K: Int32, G: Int32, L: Int32, la_n: Int32, lb_n: Int32,
                   lg_n: Int32):
            tidx, _, _ = cute.arch.thread_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            wg = cute.arch.make_warp_uniform(tidx // 128)
            bid, _, _ = cute.arch.block_idx()
            nblk, _, _ = cute.arch.grid_dim()
            if warp == 0:
                cpasync.prefetch_descriptor(tma_a)
                cpasync.prefetch_descriptor(tma_b)
                cpasync.prefetch_descriptor(tma_c)

            smem = memory.SmemAllocator()
            st = smem.allocate(self.storage)
            a_s = cute.slice_(a_sl, (None, None, 0))
            b_s = cute.slice_(b_sl, (None, None, 0))
            tx = cute.size_in_bytes(ab_dt, a_s) + cute.size_in_bytes(ab_dt, b_s)
            mainloop = pipeline.PipelineTmaAsync.create(
                barrier_storage=st.bars.data_ptr(), num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, MMA_THREADS // 32),
                tx_count=tx, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)), defer_sync=True)
            pipeline.pipeline_init_arrive()
            sA = st.sA.get_tensor(a_sl.outer, swizzle=a_sl.inner)
            sB = st.sB.get_tensor(b_sl.outer, swizzle=b_sl.inner)
            sC = st.sC.get_tensor(c_sl.outer, swizzle=c_sl.inner)
            pipeline.pipeline_init_wait()

            # walker state, identical in every warp that runs it
            cl = Int32(0)
            cg0 = Int32(0)
            rows0 = Int32(0)
            tiles0 = Int32(0)

            if wg == 0:
                cute.arch.setmaxregister_decrease(40)
            if warp == 0:
                start, end, incl = self.load_chunk(gs, cl, cg0, rows0, tiles0, M, N, K, G, L, lg_n)
                w = Int32(bid)
                cl, cg0, rows0, tiles0, start, end, incl, valid, g, t0, t1, m_t, n_t = self.find(
                    gs, w, cl, cg0, rows0, tiles0, start, end, incl, M, N, K, G, L, lg_n)
                prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                while valid:
                    la = min(cl, la_n - 1)
                    lb = min(cl, lb_n - 1)
                    k_tiles = Int32(0)
                    if cutlass.const_expr(ragged_m):
                        row0 = t0 + m_t * BM
                        gA = cute.local_tile(cute.domain_offset((row0, None), mA[(None, None, la)]),
                                             (BM, BK), (0, None))
                        gB = cute.local_tile(mB[(None, None, g, lb)], (BN, BK), (n_t, None))
                        if g < G:
                            k_tiles = (K + BK - 1) // BK
                    else:
                        gA = cute.local_tile(ragged_view(mA, 1, t0, t1 - t0)[(None, None, la)],
                                             (BM, BK), (m_t, None))
                        gB = cute.local_tile(ragged_view(mB, 1, t0, t1 - t0)[(None, None, lb)],
                                             (BN, BK), (n_t, None))
                        k_tiles = (t1 - t0 + BK - 1) // BK
                    tAsA, tAgA = cpasync.tma_partition(tma_a, 0, cute.make_layout(1),
                                                       cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
                    tBsB, tBgB = cpasync.tma_partition(tma_b, 0, cute.make_layout(1),
                                                       cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
                    for kt in range(k_tiles):
                        mainloop.producer_acquire(prod)
                        bar = mainloop.producer_get_barrier(prod)
                        cute.copy(tma_a, tAgA[(None, kt)], tAsA[(None, prod.index)], tma_bar_ptr=bar)
                        cute.copy(tma_b, tBgB[(None, kt)], tBsB[(None, prod.index)], tma_bar_ptr=bar)
                        mainloop.producer_commit(prod)
                        prod.advance()
                    w = w + nblk
                    cl, cg0, rows0, tiles0, start, end, incl, valid, g, t0, t1, m_t, n_t = self.find(
                        gs, w, cl, cg0, rows0, tiles0, start, end, incl, M, N, K, G, L, lg_n)
                mainloop.producer_tail(prod)

            if wg > 0:
                cute.arch.setmaxregister_increase(232)
                mtid = tidx - 128
                thr_mma = tiled_mma.get_slice(cute.make_layout(2, stride=128)(wg - 1))
                tCsA = thr_mma.partition_A(sA)
                tCsB = thr_mma.partition_B(sB)
                tCrA = tiled_mma.make_fragment_A(tCsA)
                tCrB = tiled_mma.make_fragment_B(tCsB)
                acc_shape = thr_mma.partition_shape_C((BM, BN))
                acc = cute.make_rmem_tensor(acc_shape, cutlass.Float32)

                # epilogue: registers -> smem (stmatrix for 16-bit) -> TMA store
                r2s_atom = sm90_utils.sm90_get_smem_store_op(self.c_layout, elem_ty_d=c_dt,
                                                             elem_ty_acc=cutlass.Float32)
                c_atom = cute.make_copy_atom(
                    cute.nvgpu.warp.StMatrix8x8x16bOp(self.c_layout.is_m_major_c(), 4), c_dt)
                r2s = cute.make_tiled_copy_S(r2s_atom, cute.make_tiled_copy_C_atom(c_atom, tiled_mma))
                thr_r2s = r2s.get_slice(mtid)
                tRS_sC = thr_r2s.partition_D(sC)
                tRS_acc = r2s.retile(acc)
                rD_shape = cute.shape(thr_r2s.partition_S(sC))[:3]
                rD = cute.make_rmem_tensor(rD_shape, cutlass.Float32)
                rD_out = cute.make_rmem_tensor(rD_shape, c_dt)
                n_rd = cute.size(rD)
                epi_bar = pipeline.NamedBarrier(barrier_id=1, num_threads=MMA_THREADS)
                store_pipe = pipeline.PipelineTmaStore.create(
                    num_stages=EPI_STAGES,
                    producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, MMA_THREADS))
                epi_count = Int32(0)

                cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
                rel = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)

                start, end, incl = self.load_chunk(gs, cl, cg0, rows0, tiles0, M, N, K, G, L, lg_n)
                w = Int32(bid)
                cl, cg0, rows0, tiles0, start, end, incl, valid, g, t0, t1, m_t, n_t = self.find(
                    gs, w, cl, cg0, rows0, tiles0, start, end, incl, M, N, K, G, L, lg_n)
                while valid:
                    k_tiles = Int32(0)
                    if cutlass.const_expr(ragged_m):
                        if g < G:
                            k_tiles = (K + BK - 1) // BK
                    else:
                        k_tiles = (t1 - t0 + BK - 1) // BK
                    # one WGMMA batch in flight (sm90_mainloop)
                    acc.fill(0.0)
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                    warpgroup.fence()
                    cons, rel = wgmma(tiled_mma, acc, tCrA, tCrB, mainloop, cons, rel, k_tiles)

                    # destination tile; TMA clips it at the group end (ragged_m) / M, N edges
                    if cutlass.const_expr(ragged_m):
                        row0 = t0 + m_t * BM
                        gC = cute.local_tile(ragged_view(mC, 0, row0, t1 - row0)[(None, None, cl)],
                                             (BM, BN), (0, n_t))
                    else:
                        gC = cute.local_tile(mC[(None, None, g, cl)], (BM, BN), (m_t, n_t))
                    gC_epi = cute.zipped_divide(gC, epi_tile)
                    bSG_sC, bSG_gC = cpasync.tma_partition(tma_c, 0, cute.make_layout(1),
                                                           cute.group_modes(sC, 0, 2), gC_epi)
                    n_epi = cute.size(gC_epi, mode=[1])
                    epi_shape = gC_epi.shape[1]
                    epi_layout = cute.make_layout(epi_shape, stride=(epi_shape[1], 1))
                    for e in cutlass.range_constexpr(n_epi):
                        for v in cutlass.range_constexpr(n_rd):
                            rD[v] = tRS_acc[e * n_rd + v]
                        rD_out.store(rD.load().to(c_dt))
                        buf = (epi_count + e) % EPI_STAGES
                        cute.copy(r2s, rD_out, tRS_sC[(None, None, None, buf)])
                        cute.arch.fence_proxy("async.shared", space="cta")
                        epi_bar.arrive_and_wait()
                        if warp == 4:
                            cute.copy(tma_c, bSG_sC[(None, buf)], bSG_gC[(None, epi_layout.get_hier_coord(e))])
                            store_pipe.producer_commit()
                            store_pipe.producer_acquire()
                        epi_bar.arrive_and_wait()
                    epi_count = (epi_count + n_epi) % EPI_STAGES

                    w = w + nblk
                    cl, cg0, rows0, tiles0, start, end, incl, valid, g, t0, t1, m_t, n_t = self.find(
                        gs, w, cl, cg0, rows0, tiles0, start, end, incl, M, N, K, G, L, lg_n)
                if warp == 4:
                    store_pipe.producer_tail()

    return GroupedGemm()
