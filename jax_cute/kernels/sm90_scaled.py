"""The block-scaled fp8 mainloop of the Hopper GEMM (GemmSpec.a_block / b_block; docs/fp8.md):
a mixin of sm90_kernel.Sm90Gemm. Imports the DSL: only kernel builds import it.

One k-tile is one 128-K scale block (tile_k is 128 for 8-bit inputs). Per k-tile a consumer
warpgroup issues its WGMMAs into a fresh fp32 fragment ``part`` (the first with ACCUMULATE off),
waits for them, hands the stage back to the producer and promotes:
``acc += part * sa[row] * sb[column]`` in registers, DeepGEMM's two-level accumulation. The
epilogue then reads ``acc`` as for an unscaled product. Two mainloops (Config.overlap_promote):

- serial: one fragment; each k-tile's WGMMAs drain (``wait_group(0)``) before its promotion, so
  the tensor cores idle during it unless the other warpgroup's WGMMAs run;
- overlapped: two fragments (64 + 2 x 64 fp32 registers a thread for a 128 x 128 tile), the
  k-loop unrolled by two: a k-tile's WGMMAs are issued into one fragment before the other
  fragment's finished k-tile is promoted, so they run under the promotion (one
  ``wait_group(1)`` and one ``wait_group(0)`` per two k-tiles: see overlapped_mainloop).

Each thread reads the scales of the rows and columns its fragment holds. Thread t's element i
sits at (its first element's coordinates) + (thread 0's element i's coordinates): the second
part is static, so which scale each element takes is decided when the kernel is traced, and a
thread loads only the distinct rows and column blocks it holds (128 x 128 tile, 1 x 128 A
scales and 128 x 128 B scales: two row scales and one column scale per k-tile). The loads come
from global memory (L1/L2-resident: a k-tile's scales are a few hundred bytes per tile) under
WGMMAs: a k-tile ahead where a thread holds few of them (_AHEAD: two buffers), else those of
the k-tile about to be promoted, just before its wait (B scales per column, bn = 1: 32 column
scales a thread, which held twice spilled registers).
"""

from __future__ import annotations

from jax_cute.kernels.bundle import Bundle
from jax_cute.kernels.dsl import cute, cutlass, warpgroup, Float32
from jax_cute.kernels.gemm_spec import SCALE_K

const_expr = cutlass.const_expr
range_constexpr = cutlass.range_constexpr

_AHEAD = 8   # most scales per thread loaded a k-tile ahead (two sets live at once)


class ThreadScales(Bundle):
    """One consumer thread's view of the block scales, built once per kernel."""

    __slots__ = (
        "sa",  # A's scales (ceil(M/a_block), Kb, L)
        "sb",  # B's scales (ceil(N/b_block), Kb, L)
        "parts",  # fp32 partial-product fragments laid out like the accumulators (overlap: two)
        "at",  # (row, column) of the thread's first fragment element in the tile
        "rows",  # static: the distinct row keys (a_block 1: row offsets; 128: block offsets)
        "cols",  # static: the distinct column keys, likewise
        "row_of",  # static: each fragment element's index into rows
        "col_of",  # static: each fragment element's index into cols
        "bufs",  # scale buffers, rows then columns: two where a thread holds few (_AHEAD), else one
    )

    @property
    def ahead(self) -> bool:
        """Whether a k-tile's scales are loaded a k-tile before its promotion (two buffers)."""
        return len(self.bufs) == 2


def _keys(offsets: list[int], block: int) -> tuple[list[int], list[int]]:
    """The distinct keys of static tile offsets (the offset itself, or its 128-block) and each
    offset's index among them. With 128-blocks an element's block in the tile is its offset's:
    the thread's part of a coordinate and the offset modulo 128 occupy different bits of the
    WGMMA layout's coordinates inside a 128 block, so their sum stays below 128."""
    keys = [o if block == 1 else o // SCALE_K for o in offsets]
    distinct = sorted(set(keys))
    return distinct, [distinct.index(k) for k in keys]


class ScaledMainloop:
    """The mainloop of a block-scaled product and the per-thread scale state it reads."""

    def thread_scales(self, tiled_mma: cute.TiledMma, acc, ctid, scales) -> ThreadScales | None:
        """Thread ``ctid``'s (index among the consumers) scale state, or None when unscaled.
        ``scales``: the kernel's (sa, sb)."""
        if const_expr(not self.scaled):
            return None
        crd = cute.make_identity_tensor((self.bm, self.bn))
        at = tiled_mma.get_slice(ctid).partition_C(crd)[0]
        off = tiled_mma.get_slice(0).partition_C(crd)
        n = cute.size(acc)
        rows, row_of = _keys([int(off[i][0]) for i in range(n)], self.a_block)
        cols, col_of = _keys([int(off[i][1]) for i in range(n)], self.b_block)
        parts = tuple(cute.make_rmem_tensor(acc.layout, Float32) for _ in range(2 if self.cfg.overlap_promote else 1))
        count = len(rows) + len(cols)
        bufs = tuple(cute.make_rmem_tensor(count, Float32) for _ in range(2 if count <= _AHEAD else 1))
        return ThreadScales(scales[0], scales[1], parts, at, rows, cols, row_of, col_of, bufs)

    @cute.jit
    def load_scales(self, ts: ThreadScales, dst, kt, m0, tn, la, lb):
        """k-tile ``kt``'s scales into ``dst`` for the tile whose first row is ``m0`` (a multiple
        of 128 with 128-row A blocks) in column ``tn``; rows and columns past the product's edge
        read its last scale (their results are never stored). ``la``, ``lb``: A's and B's batch
        coordinates (grouped: B's is the tile's group)."""
        sa, sb, at = ts.sa, ts.sb, ts.at
        for j in range_constexpr(len(ts.rows)):
            if const_expr(self.a_block == 1):
                r = m0 + at[0] + ts.rows[j]
            else:
                r = m0 // SCALE_K + ts.rows[j]
            dst[j] = sa[(cutlass.min(r, sa.shape[0] - 1), kt, la)]
        for j in range_constexpr(len(ts.cols)):
            if const_expr(self.b_block == 1):
                c = tn * self.bn + at[1] + ts.cols[j]
            else:
                c = tn * (self.bn // SCALE_K) + ts.cols[j]
            dst[len(ts.rows) + j] = sb[(cutlass.min(c, sb.shape[0] - 1), kt, lb)]

    @cute.jit
    def promote(self, ts: ThreadScales, acc, part, cur):
        """``acc += part * sa[row] * sb[column]`` with the scales in ``cur``, element by element
        (in rows of 16: the DSL warns about longer static loops)."""
        nr = len(ts.rows)
        n = cute.size(acc)
        for r in range_constexpr(n // 16):
            for i in range_constexpr(r * 16, r * 16 + 16):
                s = cur[ts.row_of[i]] * cur[nr + ts.col_of[i]]
                acc[i] = cute.math.fma(part[i], s, acc[i])

    @cute.jit
    def issue_part(self, tiled_mma: cute.TiledMma, part, tCrA, tCrB, pipe, read):
        """Wait for stage ``read`` and issue its WGMMAs into ``part`` (the first with ACCUMULATE
        off) as one group. Returns ``tiled_mma``, whose ACCUMULATE field this sets: callers rebind
        it, so that the DSL carries the new value through their loops."""
        pipe.consumer_wait(read)
        warpgroup.fence()      # the promotion read ``part``: order it before the WGMMAs write it
        for kb in range_constexpr(cute.size(tCrA, mode=[2])):
            tiled_mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
            cute.gemm(tiled_mma, part, tCrA[(None, None, kb, read.index)], tCrB[(None, None, kb, read.index)], part)
        warpgroup.commit_group()
        return tiled_mma

    @cute.jit
    def scaled_mainloop(self, tiled_mma: cute.TiledMma, acc, tCrA, tCrB, ts: ThreadScales, pipe, read, release,
                        k0, kc, tile):
        """k-tiles [k0, k0 + kc) of tile ``tile`` = (first row, n-tile, la, lb) (see load_scales)
        into ``acc`` (zeroed here), each WGMMA'd into a partial fragment and promoted with its
        scales; returns (read, release)."""
        acc.fill(0.0)
        if const_expr(self.cfg.overlap_promote):
            read, release = self.overlapped_mainloop(tiled_mma, acc, tCrA, tCrB, ts, pipe, read, release, k0, kc,
                                                     tile)
        else:
            read, release = self.serial_mainloop(tiled_mma, acc, tCrA, tCrB, ts, pipe, read, release, k0, kc, tile)
        return read, release

    @cute.jit
    def serial_mainloop(self, tiled_mma: cute.TiledMma, acc, tCrA, tCrB, ts: ThreadScales, pipe, read, release,
                        k0, kc, tile):
        """One fragment: each k-tile's WGMMAs are waited for, then promoted (the tensor cores
        idle meanwhile unless the other warpgroup's WGMMAs run)."""
        m0, tn, la, lb = tile
        part = ts.parts[0]
        cur = ts.bufs[0]
        k_last = ts.sa.shape[1] - 1
        if const_expr(ts.ahead):
            self.load_scales(ts, ts.bufs[1], k0, m0, tn, la, lb)
        for kt in range(kc):
            if const_expr(ts.ahead):
                for j in range_constexpr(cute.size(cur)):
                    cur[j] = ts.bufs[1][j]
            tiled_mma = self.issue_part(tiled_mma, part, tCrA, tCrB, pipe, read)
            if const_expr(ts.ahead):
                self.load_scales(ts, ts.bufs[1], cutlass.min(k0 + kt + 1, k_last), m0, tn, la, lb)
            else:
                self.load_scales(ts, cur, k0 + kt, m0, tn, la, lb)
            warpgroup.wait_group(0)
            pipe.consumer_release(release)
            release.advance()
            read.advance()
            self.promote(ts, acc, part, cur)
        return read, release

    @cute.jit
    def overlapped_mainloop(self, tiled_mma: cute.TiledMma, acc, tCrA, tCrB, ts: ThreadScales, pipe, read,
                            release, k0, kc, tile):
        """Two fragments, the k-loop unrolled by two (register tensors are static): a k-tile's
        WGMMAs are issued into one fragment before the other's finished k-tile is promoted, so the
        tensor cores run under the promotion. Per pair of k-tiles (kt + 1 into p1, kt + 2 into p0;
        kt is in p0, done): issue p1, promote p0, issue p0, wait for p1 (``wait_group(1)``),
        promote p1, wait for p0 (``wait_group(0)``). No WGMMA is in flight where the loop starts
        over: ptxas relates a ``wait_group(1)`` to the group issued before it only within one
        iteration, and otherwise serializes every WGMMA of the kernel. With two scale buffers
        (``ts.ahead``) a k-tile's scales load as its WGMMAs are issued; with one, just before its
        promotion."""
        p0, p1 = ts.parts
        for _ in range(cutlass.min(kc, 1)):        # the first k-tile, waited for: p0 is done
            tiled_mma = self.issue_part(tiled_mma, p0, tCrA, tCrB, pipe, read)
            read.advance()
            self.scales_at_issue(ts, 0, k0, tile)
            release = self.retire(pipe, release, 0)
        pairs = cutlass.max(kc - 1, 0) // 2
        for i in range(pairs):
            kt = k0 + 2 * i
            tiled_mma = self.issue_part(tiled_mma, p1, tCrA, tCrB, pipe, read)
            read.advance()
            self.scales_at_issue(ts, 1, kt + 1, tile)
            self.promote_part(ts, acc, 0, kt, tile)
            tiled_mma = self.issue_part(tiled_mma, p0, tCrA, tCrB, pipe, read)
            read.advance()
            self.scales_at_issue(ts, 0, kt + 2, tile)
            release = self.retire(pipe, release, 1)
            self.promote_part(ts, acc, 1, kt + 1, tile)
            release = self.retire(pipe, release, 0)
        # p0 holds k-tile kt, done; one more (odd = 1) goes into p1
        kt = k0 + 2 * pairs
        odd = cutlass.min(cutlass.max(kc - 1, 0) - 2 * pairs, 1)
        for _ in range(odd):
            tiled_mma = self.issue_part(tiled_mma, p1, tCrA, tCrB, pipe, read)
            read.advance()
            self.scales_at_issue(ts, 1, kt + 1, tile)
            self.promote_part(ts, acc, 0, kt, tile)
            release = self.retire(pipe, release, 0)
            self.promote_part(ts, acc, 1, kt + 1, tile)
        for _ in range(cutlass.min(kc, 1) - odd):
            self.promote_part(ts, acc, 0, kt, tile)
        return read, release

    @cute.jit
    def retire(self, pipe, release, in_flight: cutlass.Constexpr):
        """Wait until at most ``in_flight`` WGMMA groups run and hand the oldest held stage back
        to the producer; returns ``release``."""
        warpgroup.wait_group(in_flight)
        pipe.consumer_release(release)
        release.advance()
        return release

    @cute.jit
    def scales_at_issue(self, ts: ThreadScales, p: cutlass.Constexpr, kt, tile):
        """With two buffers, k-tile ``kt``'s scales into fragment ``p``'s, as its WGMMAs are issued."""
        if const_expr(ts.ahead):
            self.load_scales(ts, ts.bufs[p], kt, *tile)

    @cute.jit
    def promote_part(self, ts: ThreadScales, acc, p: cutlass.Constexpr, kt, tile):
        """Promote fragment ``p``, holding k-tile ``kt``'s finished partial sums, with its scales
        (with one buffer, loaded here)."""
        buf = ts.bufs[p] if const_expr(ts.ahead) else ts.bufs[0]
        if const_expr(not ts.ahead):
            self.load_scales(ts, buf, kt, *tile)
        self.promote(ts, acc, ts.parts[p], buf)
