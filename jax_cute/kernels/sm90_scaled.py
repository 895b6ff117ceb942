"""The block-scaled fp8 mainloop of the Hopper GEMM (GemmSpec.a_block / b_block; docs/fp8.md):
a mixin of sm90_kernel.Sm90Gemm. Imports the DSL: only kernel builds import it.

One k-tile is one 128-K scale block (tile_k is 128 for 8-bit inputs). The producer loads each
k-tile's scales of both operands with TMA beside its A and B tiles, on the same stage barrier (its
transaction bytes count them), into per-stage shared-memory buffers, each CTA its own (no
multicast), so consumers read them from shared memory once the stage is full. A box must start
16-byte aligned along the scales' contiguous mode (else an illegal instruction on sm_90), so
boxes start at a multiple of 4 rows (sm90_config.scale_origin) and consumers read from their
row's offset in the box:

- 1-row blocks (A's 1 x 128 activation scales; B's per-column scales in the weight gradient):
  a box of the tile's rows at (the tile's first row, k-tile, batch); ragged_m's tiles start at
  any group row, so A's box starts at that row rounded down to 4 and holds 132 rows;
- 128-row blocks (the weights' 128 x 128 scales; A's with 128 x 128 blocks): the 128-row (or
  128-column) tile holds one block, so a k-tile has one scale for the whole tile, in a 4-block
  (16-byte) box from the tile's block rounded down to 4. A gated product's B scales per 64
  paired columns (gemm_spec.PAIRED_BLOCK) are two a tile (its gate and up halves), blocks 2 t
  and 2 t + 1 of tile t, in the same 4-block box. (Read by each thread from global memory
  instead, where the scale's latency was not hidden, the product ran 3-13% slower on an H200.)

Per k-tile a consumer warpgroup waits for the stage, issues its WGMMAs into a fresh fp32 fragment
``part`` (the first with ACCUMULATE off), reads the scales its thread needs from the stage into
registers (the stage may be handed back before the promotion), waits for the WGMMAs and promotes: ``acc += part * sa[row] * sb[column]`` in registers, DeepGEMM's two-level
accumulation. The epilogue then reads ``acc`` as for an unscaled product. Two mainloops (Config.overlap_promote):

- serial: one fragment; each k-tile's WGMMAs drain (``wait_group(0)``) before its promotion, so
  the tensor cores idle during it unless the other warpgroup's WGMMAs run;
- overlapped: two fragments and two scale buffers (64 + 2 x 64 fp32 registers a thread for a
  128 x 128 tile), the k-loop unrolled by PROMOTE_UNROLL: a k-tile's WGMMAs are issued into one
  fragment before the other fragment's finished k-tile is promoted, so they run under the
  promotion (a ``wait_group(1)`` a k-tile, and a ``wait_group(0)`` that drains the tensor cores
  once per unrolled run: see overlapped_mainloop).

Each thread reads the scales of the rows and columns its fragment holds. Thread t's element i
sits at (its first element's coordinates) + (thread 0's element i's coordinates): the second
part is static, so which scale each element takes is decided when the kernel is traced, and a
thread reads only the distinct rows and column blocks it holds (1 x 128 A scales and 128 x 128
B scales: two row scales and one column scale per k-tile, two with 64 paired columns; B
scales per column: 32).
"""

from __future__ import annotations

from jax_cute.kernels.bundle import Bundle
from jax_cute.kernels.dsl import cute, cutlass, cpasync, warpgroup, Float32, pin
from jax_cute.kernels.sm90_config import ITEM, SCALE_BOX_ALIGN, scale_box, scale_origin, scale_pitch

const_expr = cutlass.const_expr
range_constexpr = cutlass.range_constexpr

# k-tiles per iteration of the overlapped mainloop's main loop. Each iteration ends with its last
# WGMMAs drained (see overlapped_mainloop), so a longer one drains less often: on an H200
# (2026-11-29, one process, results bit for bit equal) 4 ran 10% faster than 2 on
# 4096x7168x16384 and 4096x4096x7168, 8% on 128x7168x16384, 4% on 8192x8192x2048, the same on
# 8192x2048x2048 and grouped; 8 ran 1-3% slower than 4.
PROMOTE_UNROLL = 4


class ScaleLoads(Bundle):
    """The CTA's block scales, per operand: its TMA atom, its TMA tensor over (row blocks, Kb, L)
    and its shared-memory buffers (box, 1, stage)."""

    __slots__ = ("tma_a", "m_a", "s_a", "tma_b", "m_b", "s_b")


class TileScales(Bundle):
    """One tile's scale loads: each operand's TMA atom and partitions, (box, k-tile) and
    (box, stage)."""

    __slots__ = ("tma_a", "g_a", "s_a", "tma_b", "g_b", "s_b")


class ThreadScales(Bundle):
    """One consumer thread's view of the block scales, built once per kernel."""

    __slots__ = (
        "s_a",  # A's scales: the stages' (box, 1, stage) in shared memory
        "s_b",  # B's scales, likewise
        "parts",  # fp32 partial-product fragments laid out like the accumulators (overlap: two)
        "at",  # (row, column) of the thread's first fragment element in the tile
        "rows",  # static: the distinct row keys (a_block 1: row offsets; 128: block offsets)
        "cols",  # static: the distinct column keys, likewise
        "row_of",  # static: each fragment element's index into rows
        "col_of",  # static: each fragment element's index into cols
        "bufs",  # each fragment's scales in registers, rows then columns
    )


def _keys(offsets: list[int], block: int) -> tuple[list[int], list[int]]:
    """The distinct keys of static tile offsets (the offset itself, or its block: 128, or 64
    paired columns) and each offset's index among them. With blocks an element's block in the
    tile is its offset's: the thread's part of a coordinate (below 8 along N, 64 along M) and the
    offset modulo the block occupy different bits of the WGMMA layout's coordinates inside a
    block, so their sum stays below the block."""
    keys = [o if block == 1 else o // block for o in offsets]
    distinct = sorted(set(keys))
    return distinct, [distinct.index(k) for k in keys]


class ScaledMainloop:
    """The block scales' loads and the mainloop of a block-scaled product."""

    def late_columns(self) -> bool:
        """Whether B's column scales are read from the stage at the promotion, not at the issue:
        the overlapped promotion with per-column B scales (the weight gradient), whose 32 column
        scales a thread and k-tile, held in registers for both fragments, would spill. The stage
        is then handed back after its k-tile's promotion, not before."""
        return self.cfg.overlap_promote and self.b_block == 1

    def waves(self) -> int:
        """64-row blocks of a consumer warpgroup's share promoted one at a time through one
        partial fragment (2 for 256-row tiles: wave_mainloop; 1: the share at once)."""
        return self.wg_rows // 64

    # ---------------------------------------------------------------- loads (host and producer)
    def scale_layouts(self):
        """A's and B's scale buffers in shared memory: (box, 1, stage), stages SCALE_ALIGN apart."""
        return [cute.make_layout((scale_box(rows, block, slack), 1, self.ab_stages),
                                 stride=(1, scale_box(rows, block, slack), scale_pitch(rows, block, slack)))
                for rows, block, slack in ((self.bm, self.a_block, self.a_slack), (self.bn, self.b_block, 0))]

    def scale_tx_bytes(self) -> int:
        """Bytes one stage's scale boxes write into the CTA's shared memory."""
        return ITEM["float32"] * (scale_box(self.bm, self.a_block, self.a_slack) + scale_box(self.bn, self.b_block))

    def scale_atoms(self, sa: cute.Tensor, sb: cute.Tensor):
        """Per operand (TMA atom, TMA tensor) of the scales (row blocks, Kb, L), boxes of (box, 1)."""
        out = ()
        for t, lay in zip((sa, sb), self.scale_layouts()):
            s = cute.slice_(lay, (None, None, 0))
            atom, tensor = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), t, s, cute.shape(s))
            out += (atom, tensor)
        return out

    def tile_scales(self, sc: ScaleLoads, r_a, r_b, k_off, l_a, l_b) -> TileScales:
        """The scale loads of a tile whose first row blocks are ``r_a`` (A) and ``r_b`` (B) (a
        1-row-block operand's box start, already aligned; a 128-row-block operand's block, whose
        box starts at it rounded down to SCALE_BOX_ALIGN), its k-tile 0 at scale block ``k_off``,
        in batches ``l_a`` and ``l_b`` (grouped over M: B's is the tile's group). Past the edge
        TMA fills zeros."""
        parts = []
        for tma, m, s, r, l, block in ((sc.tma_a, sc.m_a, sc.s_a, r_a, l_a, self.a_block),
                                       (sc.tma_b, sc.m_b, sc.s_b, r_b, l_b, self.b_block)):
            if const_expr(block != 1):
                r = scale_origin(r)[0]
            g = cute.local_tile(cute.domain_offset((r, k_off), m[(None, None, l)]), cute.shape(s)[:2], (0, None))
            s_t, g_t = cpasync.tma_partition(tma, 0, cute.make_layout(1), cute.group_modes(s, 0, 2),
                                             cute.group_modes(g, 0, 2))
            parts += [tma, g_t, s_t]
        return TileScales(*parts)

    def load_scales(self, ts: TileScales, kt, stage, bar):
        """TMA loads of k-tile ``kt``'s scales into ``stage``, on its barrier ``bar``."""
        cute.copy(ts.tma_a, ts.g_a[(None, kt)], ts.s_a[(None, stage)], tma_bar_ptr=bar)
        cute.copy(ts.tma_b, ts.g_b[(None, kt)], ts.s_b[(None, stage)], tma_bar_ptr=bar)

    # -------------------------------------------------------------------------- consumers
    def thread_scales(self, tiled_mma: cute.TiledMma, acc, ctid, sc: ScaleLoads | None) -> ThreadScales | None:
        """Thread ``ctid``'s (index among the consumers) scale state, or None when unscaled."""
        if const_expr(not self.scaled):
            return None
        crd = cute.make_identity_tensor((self.bm, self.bn))
        at = tiled_mma.get_slice(ctid).partition_C(crd)[0]
        off = tiled_mma.get_slice(0).partition_C(crd)
        n = cute.size(acc)
        rows, row_of = _keys([int(off[i][0]) for i in range(n)], self.a_block)
        cols, col_of = _keys([int(off[i][1]) for i in range(n)], self.b_block)
        # with 128-row blocks the tile holds one block (128-row and 128-column tiles); with 64
        # paired columns two, which its 4-block box holds from either even offset (scale_tile)
        tile_blocks = 1 if self.b_block == 1 else self.bn // self.b_block
        assert (self.a_block == 1 or rows == [0]) and (self.b_block == 1 or cols == list(range(tile_blocks))) \
            and SCALE_BOX_ALIGN % tile_blocks == 0, (rows, cols)
        count = 2 if self.cfg.overlap_promote else 1
        # waves (256-row tiles): one 64-row block's fragment, reused by each block in turn
        part = acc.layout if const_expr(self.waves() == 1) else cute.make_layout((cute.shape(acc)[0], 1, 1))
        parts = tuple(cute.make_rmem_tensor(part, Float32) for _ in range(count))
        held = len(rows) + (0 if self.late_columns() else len(cols))
        bufs = tuple(cute.make_rmem_tensor(held, Float32) for _ in range(count))
        return ThreadScales(sc.s_a, sc.s_b, parts, at, rows, cols, row_of, col_of, bufs)

    def scale_tile(self, r_a, r_b):
        """``tile`` for read_scales: per operand, where the tile's first row sits in its stage box.
        A 128-row-block operand's is its block ``r_a`` (``r_b``) modulo SCALE_BOX_ALIGN (its box
        starts at the block rounded down: tile_scales); a 1-row-block operand's is 0 (its box
        starts at the tile's first row; ragged_m's A: see Sm90Gemm.grouped_scale_tile)."""
        return tuple(0 if const_expr(block == 1) else scale_origin(r)[1]
                     for r, block in ((r_a, self.a_block), (r_b, self.b_block)))

    @cute.jit
    def read_scales(self, ts: ThreadScales, dst, stage, tile):
        """The thread's scales of the k-tile in ``stage`` into ``dst``, its rows' then its
        columns' (none with late_columns): with 1-row blocks its own rows' (columns'), with
        128-row blocks the tile's one block's (64 paired columns: the tile's two, gate and up),
        each operand's at its ``tile`` entry (scale_tile) in its box."""
        for j in range_constexpr(len(ts.rows)):
            row = tile[0] + ts.at[0] + ts.rows[j] if const_expr(self.a_block == 1) else tile[0]
            dst[j] = ts.s_a[(row, 0, stage)]
        if const_expr(not self.late_columns()):
            for j in range_constexpr(len(ts.cols)):
                dst[len(ts.rows) + j] = self.column_scale(ts, j, stage, tile)

    def column_scale(self, ts: ThreadScales, j: int, stage, tile):
        """B's scale of the thread's column key ``j`` for the k-tile in ``stage``."""
        col = tile[1] + ts.at[1] + ts.cols[j] if const_expr(self.b_block == 1) else tile[1] + ts.cols[j]
        return ts.s_b[(col, 0, stage)]

    @cute.jit
    def promote(self, ts: ThreadScales, acc, part, cur, wave: cutlass.Constexpr = 0, stage=None, tile=None):
        """``acc += part * sa[row] * sb[column]`` with the scales in ``cur``, element by element
        (in rows of 16: the DSL warns about longer static loops); with waves ``part`` holds the
        warpgroup's 64-row block ``wave``, the accumulators' elements from ``wave * size(part)``.
        With late_columns the column scales come from ``stage`` (at ``tile``: read_scales), each
        read once, where its first element needs it."""
        nr = len(ts.rows)
        n = cute.size(part)
        late = [None] * len(ts.cols)
        for r in range_constexpr(n // 16):
            for i in range_constexpr(r * 16, r * 16 + 16):
                j = wave * n + i
                c = ts.col_of[j]
                if const_expr(self.late_columns()):
                    if const_expr(late[c] is None):
                        late[c] = self.column_scale(ts, c, stage, tile)
                    s = cur[ts.row_of[j]] * late[c]
                else:
                    s = cur[ts.row_of[j]] * cur[nr + c]
                acc[j] = cute.math.fma(part[i], s, acc[j])
                if const_expr(self.late_columns()):
                    # in program order: unpinned, the column scales' loads were hoisted and the
                    # mainloop spilled (a 296-byte frame, 7 reloads in the k-loop; pinned 200, none)
                    acc[j] = pin(acc[j])

    @cute.jit
    def issue_part(self, tiled_mma: cute.TiledMma, ts: ThreadScales, p: cutlass.Constexpr, tCrA, tCrB, pipe, read,
                   tile):
        """Wait for stage ``read`` (a k-tile and its scales), issue its WGMMAs into fragment
        ``p`` (the first with ACCUMULATE off) as one group and read its scales into buffer ``p``
        while they run (see read_scales for ``tile``). Returns ``tiled_mma``, whose ACCUMULATE
        field this sets: callers rebind it, so that the DSL carries the new value through their
        loops."""
        pipe.consumer_wait(read)
        tiled_mma = self.issue_wgmmas(tiled_mma, ts.parts[p], tCrA, tCrB, read.index)
        self.read_scales(ts, ts.bufs[p], read.index, tile)
        return tiled_mma

    @cute.jit
    def issue_wgmmas(self, tiled_mma: cute.TiledMma, part, tCrA, tCrB, index, wave: cutlass.Constexpr = None):
        """Issue stage ``index``'s WGMMAs into ``part`` (the first with ACCUMULATE off) as one
        group: the warpgroup's whole share, or (waves) only its 64-row block ``wave``. Returns
        ``tiled_mma`` (see issue_part)."""
        warpgroup.fence()      # the promotion read ``part``: order it before the WGMMAs write it
        for kb in range_constexpr(cute.size(tCrA, mode=[2])):
            tiled_mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
            if const_expr(wave is None):
                cute.gemm(tiled_mma, part, tCrA[(None, None, kb, index)], tCrB[(None, None, kb, index)], part)
            else:   # (V, 1) x (V, 1) => (V, 1, 1): one WGMMA, A's row block ``wave``
                a, b = tCrA[(None, wave, kb, index)], tCrB[(None, 0, kb, index)]
                cute.gemm(tiled_mma, part, cute.make_tensor(a.iterator, cute.append(a.layout, cute.make_layout(1))),
                          cute.make_tensor(b.iterator, cute.append(b.layout, cute.make_layout(1))), part)
        warpgroup.commit_group()
        return tiled_mma

    @cute.jit
    def scaled_mainloop(self, tiled_mma: cute.TiledMma, acc, tCrA, tCrB, ts: ThreadScales, pipe, read, release,
                        kc, tile):
        """The tile's ``kc`` k-tiles (one scale block each) into ``acc`` (zeroed here), each
        WGMMA'd into a partial fragment and promoted with its scales (``tile``: see read_scales);
        returns (read, release)."""
        acc.fill(0.0)
        if const_expr(self.waves() > 1):
            read, release = self.wave_mainloop(tiled_mma, acc, tCrA, tCrB, ts, pipe, read, release, kc, tile)
        elif const_expr(self.cfg.overlap_promote):
            read, release = self.overlapped_mainloop(tiled_mma, acc, tCrA, tCrB, ts, pipe, read, release, kc, tile)
        else:
            read, release = self.serial_mainloop(tiled_mma, acc, tCrA, tCrB, ts, pipe, read, release, kc, tile)
        return read, release

    @cute.jit
    def serial_mainloop(self, tiled_mma: cute.TiledMma, acc, tCrA, tCrB, ts: ThreadScales, pipe, read, release,
                        kc, tile):
        """One fragment: each k-tile's WGMMAs are waited for, then promoted (the tensor cores
        idle meanwhile unless the other warpgroup's WGMMAs run). Making the two warpgroups issue
        each k-tile's WGMMAs in turn (two named barriers), so that one's promotion would run
        under the other's WGMMAs, ran 3-8% slower on an H200 (2026-12-02, the weight gradient's
        1 x 128 scales on both operands, dense and ragged-K, bits equal). So did issuing each
        k-tile as two 64-column halves into two half fragments, the first promoted while the
        second's WGMMAs run (A read from shared memory twice): 7-12% slower on the dense weight
        gradient (H200, 2026-12-05, 4096x16384x8192, 16384x4096x8192, 4096^3; chained across
        pairs of k-tiles, so that only every fourth half's promotion was exposed, 7-13%). Strict
        turns, each warpgroup issuing only once the other's k-tile had finished (or had one WGMMA
        left), so that no two promotions coincide, ran 0.70-0.73x (0.87-0.91x) as fast dense,
        0.82x (0.87x) ragged-K and 0.69-0.70x (0.76-0.78x) with the forward's 128 x 128 B blocks
        (H100, 2026-12-06, one process, bits equal): likely one warpgroup's WGMMAs alone leave
        the tensor cores about half idle, so both warpgroups' must be in flight together."""
        # unrolled by 2: on an H200 (2026-11-30, bits unchanged) 1-5% faster dense and 3-8%
        # ragged-K (the MoE weight gradient) than the rolled loop; by 4 no better than by 2.
        # Rolled with 128 x 128 A blocks: unrolled, their fp32-output kernels spill 48-56 bytes.
        unroll = 2 if const_expr(self.a_block == 1) else 0
        for _ in cutlass.range(kc, unroll=unroll):
            tiled_mma = self.issue_part(tiled_mma, ts, 0, tCrA, tCrB, pipe, read, tile)
            read.advance()
            release = self.retire(pipe, release, 0)
            self.promote(ts, acc, ts.parts[0], ts.bufs[0])
        return read, release

    @cute.jit
    def wave_mainloop(self, tiled_mma: cute.TiledMma, acc, tCrA, tCrB, ts: ThreadScales, pipe, read, release,
                      kc, tile):
        """256-row tiles (DeepGEMM's WAVE_BLOCK_M): the warpgroup's two 64-row blocks take turns
        in one partial fragment, a second would not fit beside 128 accumulators. Per k-tile,
        block by block: issue its WGMMAs, wait for them, promote them into its accumulators. The
        scales are read under the first block's WGMMAs; the stage goes back once the last
        block's are done."""
        part, cur = ts.parts[0], ts.bufs[0]
        for _ in range(kc):
            pipe.consumer_wait(read)
            for w in range_constexpr(self.waves()):
                tiled_mma = self.issue_wgmmas(tiled_mma, part, tCrA, tCrB, read.index, w)
                if const_expr(w == 0):
                    self.read_scales(ts, cur, read.index, tile)
                if const_expr(w == self.waves() - 1):
                    release = self.retire(pipe, release, 0)
                else:
                    warpgroup.wait_group(0)
                self.promote(ts, acc, part, cur, w)
                if const_expr(w < self.waves() - 1):
                    # LLVM would sink this promotion below the next block's WGMMAs, which write
                    # ``part``: a copy of it (64 registers) then spills, and ptxas serializes
                    self.pin_block(acc, cute.size(part), w)
            read.advance()
        return read, release

    @cute.jit
    def pin_block(self, acc, n: cutlass.Constexpr, wave: cutlass.Constexpr):
        """Pin the promoted accumulators of 64-row block ``wave`` (``n`` a block) in program order
        (in rows of 16, as promote)."""
        for r in range_constexpr(wave * n // 16, (wave + 1) * n // 16):
            for i in range_constexpr(r * 16, r * 16 + 16):
                acc[i] = pin(acc[i])

    @cute.jit
    def overlapped_mainloop(self, tiled_mma: cute.TiledMma, acc, tCrA, tCrB, ts: ThreadScales, pipe, read,
                            release, kc, tile):
        """Two fragments, the k-loop unrolled (register tensors are static): a k-tile's WGMMAs are
        issued into one fragment before the other's finished k-tile is promoted, so the tensor
        cores run under the promotion. Per run of PROMOTE_UNROLL k-tiles (then pairs, then an odd
        one; kt is in p0, done): issue p1 (kt + 1), promote p0, issue p0 (kt + 2), wait for p1
        (``wait_group(1)``), promote p1, issue p1 (kt + 3), wait for p0, promote p0, ... and at
        the run's end wait for its last k-tile (``wait_group(0)``), in p0. No WGMMA is in flight
        where the loop starts over: ptxas relates a ``wait_group(1)`` to the group issued before it
        only within one iteration, and otherwise serializes every WGMMA of the kernel. A stage
        goes back to the producer before its promotion: its scales were read into registers at
        issue (with late_columns, after its promotion, which reads its column scales there)."""
        for _ in range(cutlass.min(kc, 1)):        # the first k-tile, waited for: p0 is done
            tiled_mma = self.issue_part(tiled_mma, ts, 0, tCrA, tCrB, pipe, read, tile)
            read.advance()
            release = self.retire(pipe, release, 0)
        runs = cutlass.max(kc - 1, 0) // PROMOTE_UNROLL
        for _ in range(runs):
            tiled_mma, read, release = self.overlapped_run(tiled_mma, acc, tCrA, tCrB, ts, pipe, read, release,
                                                           tile, PROMOTE_UNROLL)
        kc = kc - runs * PROMOTE_UNROLL
        pairs = cutlass.max(kc - 1, 0) // 2
        for _ in range(pairs):
            tiled_mma, read, release = self.overlapped_run(tiled_mma, acc, tCrA, tCrB, ts, pipe, read, release,
                                                           tile, 2)
        # p0 holds a finished k-tile; one more (odd = 1) goes into p1
        odd = cutlass.min(cutlass.max(kc - 1, 0) - 2 * pairs, 1)
        for _ in range(odd):
            tiled_mma = self.issue_part(tiled_mma, ts, 1, tCrA, tCrB, pipe, read, tile)
            read.advance()
            release = self.promote_part(ts, acc, 0, pipe, release, tile)
            release = self.retire(pipe, release, 0)
            release = self.promote_part(ts, acc, 1, pipe, release, tile)
        for _ in range(cutlass.min(kc, 1) - odd):
            release = self.promote_part(ts, acc, 0, pipe, release, tile)
        return read, release

    @cute.jit
    def overlapped_run(self, tiled_mma: cute.TiledMma, acc, tCrA, tCrB, ts: ThreadScales, pipe, read, release,
                       tile, n: cutlass.Constexpr):
        """``n`` (even) k-tiles after the one p0 holds finished: each issued into the fragment the
        previous one is not in, the previous one promoted under it, the last drained at the end,
        so p0 holds a finished k-tile again (with late_columns its stage still held). Returns
        (tiled_mma, read, release)."""
        for j in range_constexpr(n):
            tiled_mma = self.issue_part(tiled_mma, ts, (j + 1) % 2, tCrA, tCrB, pipe, read, tile)
            read.advance()
            if const_expr(j > 0):
                release = self.retire(pipe, release, 1)
            release = self.promote_part(ts, acc, j % 2, pipe, release, tile)
        release = self.retire(pipe, release, 0)
        return tiled_mma, read, release

    @cute.jit
    def retire(self, pipe, release, in_flight: cutlass.Constexpr):
        """Wait until at most ``in_flight`` WGMMA groups run and hand the oldest held stage back
        to the producer (with late_columns, promote_part does, after reading its column scales);
        returns ``release``."""
        warpgroup.wait_group(in_flight)
        if const_expr(not self.late_columns()):
            release = self.hand_back(pipe, release)
        return release

    @cute.jit
    def hand_back(self, pipe, release):
        """The oldest held stage back to the producer; returns ``release``."""
        pipe.consumer_release(release)
        release.advance()
        return release

    @cute.jit
    def promote_part(self, ts: ThreadScales, acc, p: cutlass.Constexpr, pipe, release, tile):
        """Promote fragment ``p``, holding a finished k-tile's partial sums, with its scales; with
        late_columns that k-tile's stage is the oldest held (``release``): its column scales are
        read there, then it goes back to the producer. Returns ``release``."""
        if const_expr(self.late_columns()):
            self.promote(ts, acc, ts.parts[p], ts.bufs[p], stage=release.index, tile=tile)
            release = self.hand_back(pipe, release)
        else:
            self.promote(ts, acc, ts.parts[p], ts.bufs[p])
        return release
