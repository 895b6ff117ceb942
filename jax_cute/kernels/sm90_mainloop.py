"""The Hopper consumer mainloop that sm90_gemm and sm90_grouped share.

One consumer warpgroup's WGMMA loop over a ring of shared-memory stages that TMA fills: wait for
a stage, issue its WGMMAs into the fp32 accumulators, keep one batch of WGMMAs in flight and
hand the stage before it back to the producer. Imports the DSL: only kernel builds import it.

The mainloop in three DSL functions, for callers that work between its first WGMMAs and the
rest (sm90_gemm's deferred epilogue stores the previous tile while they run):

- ``mainloop_start(tiled_mma, acc, tCrA, tCrB, pipe, read, k_tiles, lead)`` issues the first
  ``min(k_tiles, lead)`` stages' WGMMAs without waiting on any and returns ``read``;
- ``mainloop_rest(tiled_mma, acc, tCrA, tCrB, pipe, read, release, k_tiles, lead)`` issues the others,
  keeping one batch in flight, waits for all, hands every stage back and returns
  ``(read, release)``;
- ``mainloop_finish(pipe, release, k_tiles, lead)``: the wait and the last releases, which ``mainloop_rest``
  leaves to its caller with ``drain=False``, so that the caller can act between the last
  issue and the drain (pingpong hands the tensor cores to the other warpgroup there).

``lead`` is a compile-time count. ``mainloop_rest`` hands the stages ``mainloop_start`` left in flight back
together, as soon as its first batch is issued and every earlier batch is done, so from
then on a warpgroup holds two stages, as the plain mainloop does. (Releasing them one per
later stage instead held ``lead`` + 1 stages for the whole mainloop: the producer then ran
a single stage ahead, and on an H200 the consumers of a ``lead`` = 2 kernel spent a quarter
of their samples waiting for TMA data, against under a tenth with ``lead`` = 1.)
"""

from __future__ import annotations

from jax_cute.kernels.dsl import cute, cutlass, warpgroup


@cute.jit
def _batch(tiled_mma: cute.TiledMma, acc, tCrA, tCrB, pipe, read):
    """Wait for stage `read`, issue its WGMMAs into `acc` and commit them as one group."""
    pipe.consumer_wait(read)
    for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
        cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, read.index)], tCrB[(None, None, kb, read.index)], acc)
    warpgroup.commit_group()


@cute.jit
def mainloop_start(tiled_mma: cute.TiledMma, acc, tCrA, tCrB, pipe, read, k_tiles, lead: cutlass.Constexpr):
    for _ in range(cutlass.min(k_tiles, lead)):
        _batch(tiled_mma, acc, tCrA, tCrB, pipe, read)
        read.advance()
    return read


@cute.jit
def mainloop_rest(tiled_mma: cute.TiledMma, acc, tCrA, tCrB, pipe, read, release, k_tiles, lead: cutlass.Constexpr,
                  drain: cutlass.Constexpr = True):
    issued = cutlass.min(k_tiles, lead)
    first = 0
    if cutlass.const_expr(lead > 1):
        # the first batch after `start` (0 or 1 of them): once it is issued and one batch is
        # left in flight, all `lead` batches before it are done with their stages
        first = cutlass.min(k_tiles - issued, 1)
        for _f in range(first):
            _batch(tiled_mma, acc, tCrA, tCrB, pipe, read)
            warpgroup.wait_group(1)
            for _r in cutlass.range_constexpr(lead):
                pipe.consumer_release(release)
                release.advance()
            read.advance()
    for _ in range(issued + first, k_tiles):
        _batch(tiled_mma, acc, tCrA, tCrB, pipe, read)
        warpgroup.wait_group(1)          # every earlier stage's WGMMAs are done with it
        pipe.consumer_release(release)
        release.advance()
        read.advance()
    if cutlass.const_expr(drain):
        release = mainloop_finish(pipe, release, k_tiles, lead)
    return read, release


@cute.jit
def mainloop_finish(pipe, release, k_tiles, lead: cutlass.Constexpr):
    """Wait for every WGMMA issued and hand back the stages they still read."""
    warpgroup.wait_group(0)
    # still held: the last stage, or (no batch after `start`) all that `start` issued
    issued = cutlass.min(k_tiles, lead)
    held = issued
    if cutlass.const_expr(lead > 1):
        first = cutlass.min(k_tiles - issued, 1)
        held = issued + first - lead * first
    for _ in range(held):
        pipe.consumer_release(release)
        release.advance()
    return release
