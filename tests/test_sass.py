"""The promotion FFMAs' yield pass (kernels/sass.py) on synthetic cubins (compiled kernels:
test_sm90_scaled_compile)."""

from __future__ import annotations

import struct

from jax_cute.kernels import sass
from test_cubin_info import make_elf  # tests/ is on sys.path under pytest

_REUSE_A = 1 << 58
_NO_YIELD = 1 << 45


def _ffma(dst: int, a: int, b: int, c: int, reuse: bool, pred: int = 7, no_yield: bool = True) -> bytes:
    lo = 0x223 | pred << 12 | dst << 16 | a << 24 | b << 32
    hi = c | 0xFC2 << 40 | (_NO_YIELD if no_yield else 0) | (_REUSE_A if reuse else 0)   # stall 1, no barriers
    return struct.pack("<QQ", lo, hi)


def _other(k: int = 0) -> bytes:
    return struct.pack("<QQ", 0x7B19 | k << 16, 0xFE2 << 40)   # an opcode that is not FFMA


def _cubin(text: bytes, name: str = ".text.kernel") -> bytes:
    return make_elf([(name, text)])


def _words(blob: bytes, start: int, count: int) -> list[tuple[int, int]]:
    return [struct.unpack_from("<QQ", blob, start + 16 * i) for i in range(count)]


def test_a_promotion_run_lets_its_ffmas_that_reuse_no_operand_yield():
    # alternating marks, as ptxas leaves the serial promotion: every other instruction holds the
    # scheduler; every fifth reuses an operand (and so must keep it)
    run = [_ffma(100 + i, 7, 20 + i, 100 + i, reuse=i % 5 == 4, no_yield=i % 2 == 0 or i % 5 == 4)
           for i in range(32)]
    text = _other() + b"".join(run) + _other(1)
    cubin = _cubin(text)
    # embedded in a host object, as dump_to_object stores it
    obj = b"\x7fELF host object header" + bytes(40) + cubin + b"trailer"
    (start, size), = sass.code_sections(obj)
    assert size == len(text)
    new = sass.yield_in_promotion(obj)
    assert len(new) == len(obj) and new[:start] == obj[:start] and new[start + size:] == obj[start + size:]
    before, after = _words(obj, start, 34), _words(new, start, 34)
    assert before[0] == after[0] and before[-1] == after[-1]
    edited = [i for i in range(32) if before[i + 1] != after[i + 1]]
    assert edited == [i for i in range(32) if i % 2 == 0 and i % 5 != 4]
    assert len(sass.promotion_edits(obj)) == len(edited) and sass.promotion_edits(new) == []
    for i in edited:
        (lo0, hi0), (lo1, hi1) = before[i + 1], after[i + 1]
        assert lo1 == lo0                                  # opcode and operands untouched
        assert hi1 ^ hi0 == _NO_YIELD                       # only the yield bit


def test_short_runs_predicated_ffmas_and_other_code_are_left_alone():
    short = b"".join(_ffma(10 + i, 7, 20 + i, 10 + i, reuse=False) for i in range(sass.MIN_RUN - 1))
    predicated = b"".join(_ffma(40 + i, 7, 20 + i, 40 + i, reuse=False, pred=0) for i in range(20))
    text = short + _other() + predicated
    cubin = _cubin(text)
    assert sass.promotion_edits(cubin) == []
    assert sass.yield_in_promotion(cubin) == cubin


def test_only_code_sections_are_read():
    run = b"".join(_ffma(100 + i, 7, 20 + i, 100 + i, reuse=True) for i in range(20))
    assert sass.promotion_edits(_cubin(run, ".nv.constant0.kernel")) == []
    assert len(sass.promotion_edits(_cubin(run))) == 0     # each reuses an operand: kept
    run = b"".join(_ffma(100 + i, 7, 20 + i, 100 + i, reuse=False) for i in range(20))
    assert len(sass.promotion_edits(_cubin(run))) == 20
    assert sass.code_sections(b"no elf here") == []
    assert sass.code_sections(b"\x7fELF\x01\x01 a 32-bit or truncated header") == []
