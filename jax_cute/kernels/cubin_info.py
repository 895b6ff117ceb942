"""Resource use of a compiled kernel, read from the device ELF (cubin) inside a built object.

The DSL's exported object is a host ELF that carries the kernel's cubin as data. A cubin's
``.nv.info`` section lists, per kernel, attributes such as its register count and stack frame
size, and a kernel that spills registers gets a ``.nv.local.<kernel>`` section. Tests use this
to pin that a configuration compiles without spills (a spilling GEMM runs, but slowly).
"""

from __future__ import annotations

import struct

_EM_CUDA = 190
_ATTR = {0x2F: "registers", 0x11: "frame_bytes", 0x12: "min_stack_bytes"}   # EIATTR_* ids
_FMT_SVAL = 4   # attribute with a length-prefixed payload (symbol index, value)
_FMT_HVAL = 3   # attribute with a 16-bit inline value


def sections(blob: bytes, base: int = 0) -> list[tuple[str, int, int]]:
    """(name, offset, size) of every section of the 64-bit little-endian ELF image starting at
    ``base`` in ``blob``; offsets are the image's own (add ``base`` to index ``blob``)."""
    shoff, = struct.unpack_from("<Q", blob, base + 0x28)
    entsize, count, names_idx = struct.unpack_from("<HHH", blob, base + 0x3A)
    raw = [struct.unpack_from("<IIQQQQIIQQ", blob, base + shoff + i * entsize) for i in range(count)]
    names_off = base + raw[names_idx][4]

    def name(off: int) -> str:
        start = names_off + off
        return blob[start:blob.index(b"\0", start)].decode("ascii", "replace")

    return [(name(s[0]), s[4], s[5]) for s in raw]


def cubin_offsets(obj: bytes) -> list[int]:
    """Where the CUDA ELF images embedded in ``obj`` start (0 when ``obj`` is one)."""
    found, at = [], 0
    while (at := obj.find(b"\x7fELF", at)) >= 0:
        if at + 0x40 <= len(obj):
            machine, = struct.unpack_from("<H", obj, at + 0x12)
            if machine == _EM_CUDA and obj[at + 4] == 2:   # 64-bit
                found.append(at)
        at += 4
    return found


def resources(obj: bytes) -> dict[str, int]:
    """Registers, stack frame and spill (local memory) bytes of the kernel in ``obj``; the
    largest value over its kernels where it holds several. Raises ValueError without a cubin."""
    bases = cubin_offsets(obj)
    if not bases:
        raise ValueError("no CUDA ELF image in this object")
    out = {"registers": 0, "frame_bytes": 0, "min_stack_bytes": 0, "local_bytes": 0}
    for base in bases:   # read in place: each image's sections at its offset in obj
        for name, off, size in sections(obj, base):
            if name.startswith(".nv.local."):
                out["local_bytes"] = max(out["local_bytes"], size)
            if name != ".nv.info":
                continue
            pos, end = base + off, base + off + size
            while pos < end:
                fmt, attr = obj[pos], obj[pos + 1]
                if fmt == _FMT_SVAL:
                    length, = struct.unpack_from("<H", obj, pos + 2)
                    if attr in _ATTR and length >= 8:
                        _, value = struct.unpack_from("<II", obj, pos + 4)
                        out[_ATTR[attr]] = max(out[_ATTR[attr]], value)
                    pos += 4 + length
                else:
                    pos += 4 if fmt == _FMT_HVAL else 2
    return out
