"""The Hopper GEMM's tile schedulers (DSL parts of sm90_kernel): which output tile, batch and
k-range each CTA's warps work on.

- :class:`DenseRaster`: a persistent raster over (cluster tile, batch, k-split) units in bands
  of ``Config.group`` clusters (see sm90_gemm's notes);
- :class:`RaggedM` and :class:`RaggedK`: the grouped walks over (batch, group, tile) with group
  sizes read on the device, every warp that needs the schedule scanning them itself 32 groups
  (one per lane) at a time and keeping the current chunk's scan in registers. A spec with a
  ``lead`` (ragged_dot's group_offset) has one more size first: rows (tokens) no group takes,
  walked as group 0 with no product (ragged_m stores its zeros, ragged_k has no tile there), so
  walk group g is B's (ragged_m) or C's (ragged_k) group g - 1.

:func:`scheduler_for` picks one for a spec. Grouped views clip TMA at group ends with the
"ragged TMA" descriptor trick (:func:`ragged_tensor`, :func:`ragged_view`).
"""

from __future__ import annotations

from jax_cute.kernels.dsl import cute, cutlass, Int32, Int64
from jax_cute.kernels.gemm_spec import SCALE_K, GemmSpec, GroupedSpec
from jax_cute.kernels.sm90_config import TAIL_MIN_K_TILES, Config, is_gated, tile_k

const_expr = cutlass.const_expr
range_constexpr = cutlass.range_constexpr

_BIG = 2**30                # extent of a grouped launch's ragged mode (see sm90_gemm's notes)
_MAXI = 2**31 - 1           # extent of the two wrap-around modes beside it


def ragged_tensor(t, dim: int):
    """Rank-3 tensor -> its rank-5 ragged-TMA view along ``dim`` (see the module notes)."""
    s = t.stride[dim]
    shape = tuple(_BIG if i == dim else t.shape[i] for i in range(3)) + (_MAXI, _MAXI)
    stride = tuple(t.stride) + (Int64(2**34) - s, s)
    return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=stride))

def ragged_view(t, dim: int, start, length):
    """Rank-3 view of a rank-5 ragged TMA tensor whose index 0 is row ``start`` and whose
    rows from ``length`` on are out of bounds (zero-filled loads, dropped stores)."""
    sub = t[(None, None, None, _BIG, start + length)]
    return cute.domain_offset(tuple(_BIG - length if i == dim else None for i in range(3)), sub)


def split_range(n_k, s, parts):
    """(first k-tile, count) of split ``s`` of ``n_k`` k-tiles cut into ``parts`` contiguous ones."""
    k0 = (s * n_k) // parts
    return k0, ((s + 1) * n_k) // parts - k0


class DenseRaster:
    """Units (cluster tile, batch, k-split) of a dense GEMM in a grouped raster order; every CTA
    strides through them by the number of resident clusters."""

    mode = "dense"

    def __init__(self, config: Config, batch_modes: int):
        self.cfg = config
        self.cm, self.cn = config.cluster_m, config.cluster_n
        self.split = config.split_k
        self.nb = batch_modes

    def work(self, w, cl_m, cl_n, batches, cc):
        """Unit w -> (tile_m, tile_n, l, split) of this CTA (cc: its coord in the cluster).

        Splits are the slowest index, then batches; inside a batch the clusters go in bands
        of `group` along the raster dimension (fastest), then across the band.
        """
        per_batch = cl_m * cl_n
        z = w // per_batch
        r = w - z * per_batch
        s = z // batches
        l = z - s * batches
        g = self.cfg.group
        fast, slow = (cl_m, cl_n) if const_expr(self.cfg.raster == "m") else (cl_n, cl_m)
        band = r // (g * slow)
        rr = r - band * (g * slow)
        width = cutlass.min(fast - band * g, g)
        i_slow = rr // width
        i_fast = band * g + (rr - i_slow * width)
        if const_expr(self.cfg.raster == "m"):
            ci_m, ci_n = i_fast, i_slow
        else:
            ci_m, ci_n = i_slow, i_fast
        return ci_m * self.cm + cc[0], ci_n * self.cn + cc[1], l, s

    def batch_count(self, t):
        """Batches of C (all of its batch modes)."""
        return t.shape[2] if const_expr(self.nb == 1) else cute.size(t, mode=[2])

    def c_batch(self, l, ext):
        """C's batch coordinate of linear batch l: l itself, or with three modes l split
        colexicographically over C's batch extents ``ext`` (L0 fastest)."""
        if const_expr(self.nb == 1):
            return l
        q = l // ext[0]
        return l - q * ext[0], q % ext[1], q // ext[1]

    def ab_batch(self, l, ext, bound):
        """An input's batch coordinate of linear batch l. One mode: min(l, bound), bound its
        last batch. Three: C's coordinate, 0 in each mode where the input's extent (bound) is 1
        (a select on i < extent: holding extent - 1 as well spilled the producer's registers)."""
        if const_expr(self.nb == 1):
            return cutlass.min(l, bound)
        return tuple(cutlass.select_(i < e, i, 0) for i, e in zip(self.c_batch(l, ext), bound))

    def k_range(self, s, k_tiles):
        """Contiguous k-tiles [k0, k0 + count) of split s."""
        if const_expr(self.split == 1):
            return Int32(0), k_tiles
        return split_range(k_tiles, s, self.split)


class RaggedWalk:
    """A grouped GEMM's walk over a linear tile index (batch, group, tile), start blockIdx, step
    the grid size; the group sizes are scanned on the device (see the module notes)."""

    mode = ""

    def __init__(self, config: Config, in_dtype: str, gated: bool, lead: bool = False, k_align: int = 0):
        self.cfg = config
        self.lead = lead
        # ragged_k groups laid out at multiples of k_align (block-scaled: 128, GroupedSpec; 0: none)
        self.k_align = k_align
        self.bm, self.bn, self.bk = config.tile_m, config.tile_n, tile_k(in_dtype)
        # ragged_m on a 1 x cn cluster: a walk tile is cn n-tiles of one m-tile (one group, so
        # the cluster's CTAs run the same k-loop on a multicast A slice)
        self.cn = config.cluster_n
        self.glu = gated
        self.cbn = self.bn // 2 if gated else self.bn   # C's tile width

    @cute.jit
    def load_chunk(self, gs, ext, cl, cg0, rows0, tiles0):
        """Scan 32 groups of batch ``cl`` from group ``cg0`` on: per lane its clipped row range
        [start, end) and the global inclusive prefix of tiles."""
        M, N, K, G, L, lg_n = ext
        lane = cute.arch.lane_idx()
        R = M if const_expr(self.mode == "ragged_m") else K
        g = cg0 + lane
        sz = Int32(0)
        if cl < L:
            if g < G:
                sz = gs[(g, cutlass.min(cl, lg_n - 1))]
            if const_expr(self.mode == "ragged_m"):
                if g == G:
                    sz = R             # rows past the last group: the zero-store pseudo-group
        sz = cutlass.min(cutlass.max(sz, 0), R)
        if const_expr(self.k_align):
            # each group's k-range starts at a multiple of k_align (R is one: the sum stays below it)
            sz = (sz + (self.k_align - 1)) // self.k_align * self.k_align
        # inclusive scan of rows, saturating at R without overflow
        x = sz
        for d in range_constexpr(5):
            y = cute.arch.shuffle_sync_up(x, 1 << d)
            if lane >= (1 << d):
                x = y + cutlass.min(x, R - y)
        xe = cute.arch.shuffle_sync_up(x, 1)
        if lane == 0:
            xe = Int32(0)
        start = rows0 + cutlass.min(xe, R - rows0)
        end = rows0 + cutlass.min(x, R - rows0)
        nt = self.cluster_cols(N)
        t = Int32(0)
        if const_expr(self.mode == "ragged_m"):
            t = (end - start + self.bm - 1) // self.bm * nt
        else:
            if g < G:
                t = (M + self.bm - 1) // self.bm * nt
            if const_expr(self.lead):
                if g == 0:
                    t = Int32(0)   # the lead: no group of C
        if cl >= L:
            t = Int32(0)
        for d in range_constexpr(5):
            y = cute.arch.shuffle_sync_up(t, 1 << d)
            if lane >= (1 << d):
                t = t + y
        incl = tiles0 + t
        return start, end, incl

    def cluster_cols(self, N):
        """Walk tiles along N: C's n-tiles (N: its columns) in clusters of ``cn``."""
        return ((N + self.cbn - 1) // self.cbn + self.cn - 1) // self.cn

    @cute.jit
    def total_tiles(self, gs, ext):
        """Walk tiles of every batch and group (the whole scan, chunk by chunk)."""
        M, N, K, G, L, lg_n = ext
        E = G + 1 if const_expr(self.mode == "ragged_m") else G
        cl, cg0, rows0, tiles0 = Int32(0), Int32(0), Int32(0), Int32(0)
        while cl < L:
            _, end, incl = self.load_chunk(gs, ext, cl, cg0, rows0, tiles0)
            rows0 = cute.arch.shuffle_sync(end, 31)
            tiles0 = cute.arch.shuffle_sync(incl, 31)
            cg0 = cg0 + 32
            if cg0 >= E:
                cg0 = Int32(0)
                rows0 = Int32(0)
                cl = cl + 1
        return tiles0

    @cute.jit
    def tail_plan(self, gs, ext, grid):
        """Tail split (Config.split_k = S > 1, ragged_m): the walk's tiles fill whole rounds of
        the ``grid`` CTAs but the last; that round's tiles are each cut into up to S units along K
        (as many as the round then fills, each of at least TAIL_MIN_K_TILES k-tiles), so the
        round takes 1/S of a tile's time instead of a whole one. Returns (full: the tiles of the
        whole rounds, parts: units per tail tile)."""
        M, N, K, G, L, lg_n = ext
        total = self.total_tiles(gs, ext)
        full = total // grid * grid
        rem = total - full
        parts = Int32(1)
        if rem > 0:
            k_tiles = (K + self.bk - 1) // self.bk
            parts = cutlass.max(cutlass.min(cutlass.min(grid // rem, k_tiles // TAIL_MIN_K_TILES),
                                            self.cfg.split_k), 1)
        return full, parts

    def tail_unit(self, w, full, parts):
        """Unit ``w`` of a tail-split walk -> (walk tile, its k-split, the tile's splits)."""
        j = cutlass.max(w - full, 0)
        q = j // parts
        whole = w < full
        return (cutlass.select_(whole, w, full + q), cutlass.select_(whole, Int32(0), j - q * parts),
                cutlass.select_(whole, Int32(1), parts))

    @cute.jit
    def find(self, gs, ext, w, cl, cg0, rows0, tiles0, start, end, incl, cc):
        """Advance the walker (chunks only move forward) until tile ``w`` lies in the current
        chunk or the batches run out; returns the new state, whether ``w`` is a tile, its
        group, the group's row range [t0, t1) and this CTA's (m, n) tile index in the group
        (``cc``: its coordinate in the cluster; an n-tile past C's last is loaded and stored
        out of bounds: zeros in, nothing out)."""
        M, N, K, G, L, lg_n = ext
        E = G + 1 if const_expr(self.mode == "ragged_m") else G
        last = cute.arch.shuffle_sync(incl, 31)
        while w >= last and cl < L:
            rows0 = cute.arch.shuffle_sync(end, 31)
            tiles0 = last
            cg0 = cg0 + 32
            if cg0 >= E:
                cg0 = Int32(0)
                rows0 = Int32(0)
                cl = cl + 1
            start, end, incl = self.load_chunk(gs, ext, cl, cg0, rows0, tiles0)
            last = cute.arch.shuffle_sync(incl, 31)
        sel = cute.arch.popc(cute.arch.vote_ballot_sync(incl <= w))
        sel = cutlass.min(sel, 31)
        g = cg0 + sel
        t0 = cute.arch.shuffle_sync(start, sel)
        t1 = cute.arch.shuffle_sync(end, sel)
        excl = cute.arch.shuffle_sync(incl, sel - 1)
        if sel == 0:
            excl = tiles0
        local = w - excl
        nt = self.cluster_cols(N)
        mt = (M + self.bm - 1) // self.bm
        if const_expr(self.mode == "ragged_m"):
            mt = (t1 - t0 + self.bm - 1) // self.bm
        # raster: panels of `group` m-tiles, n-tiles walked inside a panel
        panel_h = self.cfg.group
        panel = local // (panel_h * nt)
        rem = local - panel * (panel_h * nt)
        h = cutlass.max(cutlass.min(mt - panel * panel_h, panel_h), 1)
        n_t = rem // h
        m_t = panel * panel_h + rem - n_t * h
        if const_expr(self.cn > 1):
            n_t = n_t * self.cn + cc[1]
        return cl, cg0, rows0, tiles0, start, end, incl, cl < L, g, t0, t1, m_t, n_t

    @cute.jit
    def group_k_tiles(self, ext, g, t0, t1):
        """k-tiles of a grouped tile: none for ragged_m's zero tail, none for an empty group."""
        M, N, K, G, L, lg_n = ext
        k_tiles = Int32(0)
        if const_expr(self.mode == "ragged_m"):
            if g < G:
                k_tiles = (K + self.bk - 1) // self.bk
            if const_expr(self.lead):
                if g == 0:
                    k_tiles = Int32(0)   # the lead stores zeros too
        else:
            k_tiles = (t1 - t0 + self.bk - 1) // self.bk
        return k_tiles

    @cute.jit
    def group_ab(self, mA, mB, cl, g, t0, t1, m_t, n_t, la_last, lb_last):
        """A and B k-slices of a grouped tile, (bm | bn, bk, k): ragged_m starts A at the
        tile's first row (inside its group), ragged_k clips K at the group's end."""
        la, lb = cutlass.min(cl, la_last), cutlass.min(cl, lb_last)
        if const_expr(self.mode == "ragged_m"):
            row0 = t0 + m_t * self.bm
            gA = cute.local_tile(cute.domain_offset((row0, None), mA[(None, None, la)]),
                                 (self.bm, self.bk), (0, None))
            gb = self.group(g)
            gB_g = mB[(None, None, gb)] if const_expr(self.glu) else mB[(None, None, gb, lb)]
            gB = cute.local_tile(gB_g, (self.bn, self.bk), (n_t, None))
        elif const_expr(self.k_align):
            # K-major, groups at aligned offsets and zero-filled to the next one: no clip needed
            gA = cute.local_tile(cute.domain_offset((None, t0), mA[(None, None, la)]), (self.bm, self.bk),
                                 (m_t, None))
            gB = cute.local_tile(cute.domain_offset((None, t0), mB[(None, None, lb)]), (self.bn, self.bk),
                                 (n_t, None))
        else:
            gA = cute.local_tile(ragged_view(mA, 1, t0, t1 - t0)[(None, None, la)], (self.bm, self.bk),
                                 (m_t, None))
            gB = cute.local_tile(ragged_view(mB, 1, t0, t1 - t0)[(None, None, lb)], (self.bn, self.bk),
                                 (n_t, None))
        return gA, gB

    @cute.jit
    def group_c(self, mC, cl, g, t0, t1, m_t, n_t, width: cutlass.Constexpr):
        """The output tile (``width`` columns) of a grouped tile; ragged_m's TMA stores stop
        at the group's end."""
        if const_expr(self.mode == "ragged_m"):
            row0 = t0 + m_t * self.bm
            return cute.local_tile(ragged_view(mC, 0, row0, t1 - row0)[(None, None, cl)],
                                   (self.bm, width), (0, n_t))
        return cute.local_tile(mC[(None, None, self.group(g), cl)], (self.bm, width), (m_t, n_t))

    def group(self, g):
        """B's (ragged_m) or C's (ragged_k) group of walk group g: g - 1 after a lead (the lead
        itself, which has no product, is given group 0)."""
        if const_expr(self.lead):
            return cutlass.max(g - 1, 0)
        return g


class RaggedM(RaggedWalk):
    """ragged_m: tiles start at their group's first row (a tile never mixes groups); rows past
    the last group are a pseudo-group with no K loop whose tiles store zeros."""

    mode = "ragged_m"


class RaggedK(RaggedWalk):
    """ragged_k: tiles are (group, m-tile, n-tile) with the K loop over the group's rows; empty
    groups store zeros. With ``k_align`` (block-scaled, K-major) every group starts at a multiple
    of it: sizes are rounded up to it in the scan, and the loads need no clip."""

    mode = "ragged_k"


def scheduler_for(spec: GemmSpec | GroupedSpec, config: Config) -> DenseRaster | RaggedWalk:
    """The tile scheduler of a spec: the dense raster, or the grouped walk of its mode."""
    if isinstance(spec, GroupedSpec):
        k_align = SCALE_K if spec.scaled and spec.mode == "ragged_k" else 0
        return {"ragged_m": RaggedM, "ragged_k": RaggedK}[spec.mode](config, spec.a_dtype, is_gated(spec), spec.lead,
                                                                     k_align)
    return DenseRaster(config, spec.batch_modes)
