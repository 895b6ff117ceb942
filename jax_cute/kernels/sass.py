"""Scheduling hints in compiled Hopper machine code: the yield flags of the serial block-scaled
mainloop's promotion FFMAs.

The block-scaled kernels (sm90_scaled) promote each k-tile's partial sums with runs of 30-60
``FFMA acc, partial, scale, acc``. In the serial mainloop (the weight gradient's per-column B
scales) ptxas marks about half of a run's instructions not to yield, so one consumer warp holds
its scheduler while the other warpgroup waits to issue its next WGMMAs or to release a stage.
Letting every FFMA of such a run that reuses no operand yield ran the weight gradient's GEMM
2.4-3.4% faster (H200, 2026-12-03, 4096x16384x8192, 16384x4096x8192 and 4096^3, bf16 out, one
process, interleaved, bits equal; 2.1-3.0% in two earlier runs); marking them all not to yield
ran it 4-6% slower. The same pass ran the grouped
weight gradient (ragged-K, same mainloop, 8 groups) 1-2% slower. DeepGEMM edits the same bits
on its kernels (its ``interleave_ffma`` pass: reuse flags cleared and yields allowed on about
half a run), but on our overlapped mainloop every such edit was slower, by 1.5-7% (same runs).
So only the dense weight gradient takes the pass (sm90_gemm.finish_object).

The pass works on the object ``dump_to_object`` gives, in place (sizes unchanged): it finds the
CUDA ELFs (cubins) embedded in it, decodes the 128-bit instructions of their code sections and
edits only a control bit, never an instruction's operation or operands, so results are bit for
bit the same. An instruction that reuses an operand never yields: the reuse cache belongs to
the warp that issues next.

Encoding (sm_90, 16 bytes an instruction, little-endian 64-bit words lo, hi): bits 0-11 of lo
the opcode (0x223: FFMA with four register operands), bits 12-15 its predicate (7: always);
in hi, bit 45 clear lets the warp yield after it, and bits 58-61 are the operand-reuse flags.
"""

from __future__ import annotations

import dataclasses
import struct

from jax_cute.kernels import cubin_info

_FFMA_RRR = 0x223
_NO_YIELD = 1 << 45      # set: the warp keeps issuing after this instruction
_REUSE = 0xF << 58
MIN_RUN = 16             # a run of at least this many FFMAs is a promotion


@dataclasses.dataclass(frozen=True)
class Edit:
    offset: int          # of the instruction's hi word in the object
    after: int           # its new value


def code_sections(obj: bytes) -> list[tuple[int, int]]:
    """(offset in ``obj``, size) of each code section of every cubin embedded in ``obj`` (or of
    ``obj`` itself, when it is a cubin)."""
    return [(at + off, size) for at in cubin_info.cubin_offsets(obj)
            for name, off, size in cubin_info.sections(obj, at) if name.startswith(".text.") and size % 16 == 0]


def promotion_edits(obj: bytes) -> list[Edit]:
    """The yield edits of every promotion run in ``obj``: in each run of MIN_RUN or more
    unpredicated FFMAs, each instruction that reuses no operand and does not yield is let yield."""
    edits: list[Edit] = []
    for start, size in code_sections(obj):
        run: list[tuple[int, int]] = []                  # (offset of hi, hi)
        for pos in range(start, start + size + 16, 16):
            if pos < start + size:
                lo, hi = struct.unpack_from("<QQ", obj, pos)
                if lo & 0xFFF == _FFMA_RRR and (lo >> 12) & 0xF == 7:
                    run.append((pos + 8, hi))
                    continue
            if len(run) >= MIN_RUN:
                edits += [Edit(off, hi & ~_NO_YIELD) for off, hi in run
                          if hi & _NO_YIELD and not hi & _REUSE]
            run = []
    return edits


def yield_in_promotion(obj: bytes) -> bytes:
    """``obj`` with promotion_edits applied."""
    buf = bytearray(obj)
    for e in promotion_edits(obj):
        struct.pack_into("<Q", buf, e.offset, e.after)
    return bytes(buf)
