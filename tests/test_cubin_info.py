"""cubin_info reads register, stack and spill sizes from a device ELF inside a host object."""

import struct

import pytest

from jax_cute.kernels import cubin_info


def make_elf(sections: list[tuple[str, bytes]], machine: int = 190) -> bytes:
    """A minimal 64-bit little-endian ELF with the given (name, payload) sections."""
    names = b"\0" + b"".join(n.encode() + b"\0" for n, _ in sections) + b".shstrtab\0"
    body, offsets, at = b"", [], 64
    for _, payload in sections + [("", names)]:
        offsets.append(at + len(body))
        body += payload
    shoff = 64 + len(body)
    head = bytearray(64)
    head[:5] = b"\x7fELF\x02"
    struct.pack_into("<H", head, 0x12, machine)
    struct.pack_into("<Q", head, 0x28, shoff)
    struct.pack_into("<HHH", head, 0x3A, 64, len(sections) + 2, len(sections) + 1)
    shdrs = bytes(64)   # the null section
    pos = 1
    for (name, payload), off in zip(sections, offsets):
        shdrs += struct.pack("<IIQQQQIIQQ", pos, 1, 0, 0, off, len(payload), 0, 0, 1, 0)
        pos += len(name) + 1
    shdrs += struct.pack("<IIQQQQIIQQ", pos, 3, 0, 0, offsets[-1], len(names), 0, 0, 1, 0)
    return bytes(head) + body + shdrs


def _attr(attr: int, value: int) -> bytes:
    return struct.pack("<BBHII", 4, attr, 8, 6, value)


def test_reads_registers_frame_and_spills_from_an_embedded_cubin():
    info = _attr(0x2F, 168) + struct.pack("<BBH", 3, 0x1B, 232) + _attr(0x11, 24) + _attr(0x12, 24)
    cubin = make_elf([(".nv.info", info), (".nv.local.kernel", bytes(48)), (".text.kernel", bytes(16))])
    host = make_elf([(".data", b"x" * 40 + cubin)], machine=62)   # x86-64 object carrying it
    assert cubin_info.resources(host) == {"registers": 168, "frame_bytes": 24, "min_stack_bytes": 24,
                                          "local_bytes": 48}


def test_a_spill_free_kernel_reads_zero():
    cubin = make_elf([(".nv.info", _attr(0x2F, 90)), (".text.kernel", bytes(16))])
    assert cubin_info.resources(cubin) == {"registers": 90, "frame_bytes": 0, "min_stack_bytes": 0,
                                           "local_bytes": 0}


def test_no_cuda_image_is_an_error():
    with pytest.raises(ValueError, match="no CUDA ELF"):
        cubin_info.resources(make_elf([(".data", b"abc")], machine=62))
