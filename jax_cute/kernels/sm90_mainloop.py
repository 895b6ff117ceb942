"""The Hopper consumer mainloop that sm90_gemm and sm90_grouped share.

One consumer warpgroup's WGMMA loop over a ring of shared-memory stages that TMA fills: wait for
a stage, issue its WGMMAs into the fp32 accumulators, keep one batch of WGMMAs in flight and
hand the stage before it back to the producer. The DSL is imported on first use, so modules
that only route or load compiled kernels never import it.
"""

import functools


@functools.lru_cache(maxsize=None)
def wgmma_mainloop_parts():
    """The mainloop in two DSL functions, for callers that work between its first WGMMAs and the
    rest (sm90_gemm's deferred epilogue stores the previous tile while they run):

    - ``start(tiled_mma, acc, tCrA, tCrB, pipe, read, k_tiles, lead)`` issues the first
      ``min(k_tiles, lead)`` stages' WGMMAs without waiting on any and returns ``read``;
    - ``rest(tiled_mma, acc, tCrA, tCrB, pipe, read, release, k_tiles, lead)`` issues the others,
      keeping one batch in flight, waits for all, hands every stage back and returns
      ``(read, release)``.

    ``lead`` is a compile-time count; the stages it leaves in flight are released late by
    ``rest``, one per later stage, so at most ``lead`` + 1 stages are held at a time."""
    from jax_cute.kernels.dsl import cute, cutlass, warpgroup

    @cute.jit
    def start(tiled_mma: cute.TiledMma, acc, tCrA, tCrB, pipe, read, k_tiles, lead: cutlass.Constexpr):
        n_kb = cute.size(tCrA, mode=[2])
        for _ in range(cutlass.min(k_tiles, lead)):
            pipe.consumer_wait(read)
            for kb in cutlass.range_constexpr(n_kb):
                cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, read.index)], tCrB[(None, None, kb, read.index)], acc)
            warpgroup.commit_group()
            read.advance()
        return read

    @cute.jit
    def rest(tiled_mma: cute.TiledMma, acc, tCrA, tCrB, pipe, read, release, k_tiles, lead: cutlass.Constexpr):
        n_kb = cute.size(tCrA, mode=[2])
        issued = cutlass.min(k_tiles, lead)
        for _ in range(issued, k_tiles):
            pipe.consumer_wait(read)
            for kb in cutlass.range_constexpr(n_kb):
                cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, read.index)], tCrB[(None, None, kb, read.index)], acc)
            warpgroup.commit_group()
            warpgroup.wait_group(1)          # every earlier stage's WGMMAs are done with it
            pipe.consumer_release(release)
            release.advance()
            read.advance()
        warpgroup.wait_group(0)
        for _ in range(issued):
            pipe.consumer_release(release)
            release.advance()
        return read, release

    return start, rest


@functools.lru_cache(maxsize=None)
def wgmma_mainloop():
    """The DSL function ``run(tiled_mma, acc, tCrA, tCrB, pipe, read, release, k_tiles)``.

    It accumulates ``k_tiles`` stages of A x B into ``acc``, starting at pipeline state ``read``
    (the stage to consume next) and ``release`` (the stage to hand back next), and returns both
    states advanced past them: the DSL rebinds loop-carried values, so the caller must take the
    returned states. The caller zeroes ``acc``, sets the MMA's ACCUMULATE field and fences
    first, in its own scope (a field set inside a helper would not reach the caller's loop)."""
    from jax_cute.kernels.dsl import cute

    start, rest = wgmma_mainloop_parts()

    @cute.jit
    def run(tiled_mma: cute.TiledMma, acc, tCrA, tCrB, pipe, read, release, k_tiles):
        read = start(tiled_mma, acc, tCrA, tCrB, pipe, read, k_tiles, 1)
        return rest(tiled_mma, acc, tCrA, tCrB, pipe, read, release, k_tiles, 1)

    return run
