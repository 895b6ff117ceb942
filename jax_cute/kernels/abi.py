"""The calling convention between a compiled CuTe DSL launcher and our XLA FFI handler.

A compiled launcher takes one ``void*`` per Python-level argument, in signature order, then
``&ret`` (an int32 CUDA error code). A tensor argument points at a C struct
``{void* data; int32 dynamic_shapes[d]; int64 dynamic_strides[s];}`` that holds only the modes
left dynamic at compile time; a stream is passed as ``&stream``; a scalar as ``&value``.

A :data:`Signature` describes those arguments once. The same signature builds the fake
arguments the DSL compiles against (:func:`fake_args`) and the descriptor words the handler
sends at launch (:func:`pack_args`), so the two can never disagree. This module does not
import the DSL: lowering a cached kernel only packs descriptors.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import Sequence, Union

import numpy as np


@dataclasses.dataclass(frozen=True)
class Dyn:
    """A mode extent or stride known only at launch, with its compile-time divisibility."""

    div: int = 1


DYN = Dyn(1)
Extent = Union[int, Dyn]


@dataclasses.dataclass(frozen=True)
class TensorArg:
    """A global-memory tensor argument bound to one XLA buffer.

    ``name`` names the buffer it binds to (an operand role such as ``"a"`` or ``"out0"``).
    ``shape`` and ``stride`` are in elements; a :class:`Dyn` entry becomes a run-time field of
    the descriptor (shapes int32, strides int64). ``align`` is the byte alignment the kernel
    assumes for the base pointer; the handler checks it before every launch.
    """

    name: str
    dtype: str
    shape: tuple[Extent, ...]
    stride: tuple[Extent, ...]
    align: int = 16

    def __post_init__(self):
        if len(self.shape) != len(self.stride):
            raise ValueError(f"{self.name}: shape {self.shape} and stride {self.stride} differ in rank")


@dataclasses.dataclass(frozen=True)
class StreamArg:
    """The CUDA stream XLA hands the handler."""

    name: str = "stream"


@dataclasses.dataclass(frozen=True)
class ScalarArg:
    """A scalar fixed at lowering time (its value travels in the descriptor words)."""

    name: str
    dtype: str  # "int32", "int64" or "float32"


Arg = Union[TensorArg, StreamArg, ScalarArg]
Signature = tuple[Arg, ...]

_SCALAR_FORMATS = {"int32": "<i", "int64": "<q", "float32": "<f"}

# XLA FFI's DataType codes (xla/ffi/api/c_api.h), which the handler compares a buffer's with.
FFI_DTYPES = {"bool": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "uint8": 6, "uint16": 7, "uint32": 8,
              "uint64": 9, "float16": 10, "float32": 11, "float64": 12, "complex64": 15, "bfloat16": 16,
              "complex128": 18, "float8_e5m2": 19, "float8_e4m3fn": 20}
ITEMSIZES = {"bool": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint8": 1, "uint16": 2, "uint32": 4,
             "uint64": 8, "float16": 2, "float32": 4, "float64": 8, "complex64": 8, "bfloat16": 2,
             "complex128": 16, "float8_e5m2": 1, "float8_e4m3fn": 1}


@dataclasses.dataclass(frozen=True)
class BufferType:
    """What an XLA buffer is: its rank, dtype name and size in bytes."""

    rank: int
    dtype: str
    nbytes: int


def reach(shape: Sequence[int], stride: Sequence[int]) -> int:
    """Elements of a buffer a (shape, stride) layout reaches: one past its largest offset."""
    if any(int(e) == 0 for e in shape):
        return 0
    return 1 + sum((int(e) - 1) * abs(int(d)) for e, d in zip(shape, stride))


def tensor_descriptor(arg: TensorArg, shape: Sequence[int], stride: Sequence[int]) -> np.ndarray:
    """The descriptor struct of ``arg`` for one concrete (shape, stride), as int64 words.

    Word 0 is the data pointer, left zero for the handler to fill in. Static modes must match
    the values compiled in; dynamic ones must honour their divisibility (else the kernel's
    assumptions would silently break on the device).
    """
    if len(shape) != len(arg.shape) or len(stride) != len(arg.stride):
        raise ValueError(f"{arg.name}: rank {len(shape)} does not match the kernel's rank {len(arg.shape)}")
    dyn_shapes: list[int] = []
    dyn_strides: list[int] = []
    for what, want, have, out in (("shape", arg.shape, shape, dyn_shapes), ("stride", arg.stride, stride, dyn_strides)):
        for mode, (w, h) in enumerate(zip(want, have)):
            h = int(h)
            if isinstance(w, Dyn):
                if h % w.div:
                    raise ValueError(f"{arg.name}: {what}[{mode}] = {h} is not a multiple of {w.div}")
                out.append(h)
            elif w != h:
                raise ValueError(f"{arg.name}: {what}[{mode}] = {h}, but the kernel was compiled for {w}")
    for s in dyn_shapes:
        if not 0 <= s < 2**31:
            raise ValueError(f"{arg.name}: extent {s} does not fit the kernel's int32 shapes")
    raw = struct.pack("<Q", 0) + struct.pack(f"<{len(dyn_shapes)}i", *dyn_shapes)
    if dyn_strides:
        raw += b"\0" * (-len(raw) % 8) + struct.pack(f"<{len(dyn_strides)}q", *dyn_strides)
    raw += b"\0" * (-len(raw) % 8)
    return np.frombuffer(raw, dtype=np.int64).copy()


def scalar_words(arg: ScalarArg, value) -> np.ndarray:
    raw = struct.pack(_SCALAR_FORMATS[arg.dtype], value)
    return np.frombuffer(raw + b"\0" * (-len(raw) % 8), dtype=np.int64).copy()


@dataclasses.dataclass(frozen=True)
class PackedArgs:
    """What the FFI handler needs to build ``void* args[]`` (see csrc/jax_cute_ffi.cc), and to
    check each buffer it binds against what the kernel was compiled for."""

    kinds: np.ndarray    # per argument: -1 stream, -2 scalar, k >= 0 buffer k (inputs then outputs)
    offsets: np.ndarray  # len(kinds) + 1 offsets into ``words``
    words: np.ndarray    # concatenated descriptor templates (int64)
    align: np.ndarray    # per argument: byte alignment the buffer pointer must have (0: none)
    dtypes: np.ndarray   # per argument: the buffer's FFI DataType code (0: not a buffer)
    ranks: np.ndarray    # per argument: the buffer's rank (-1: not a buffer)
    nbytes: np.ndarray   # per argument: bytes of the buffer the descriptor reaches (0: none)
    names: str           # the arguments' names, comma-separated (for the handler's errors)

    def attributes(self) -> dict[str, object]:
        return {"arg_kinds": self.kinds, "arg_offsets": self.offsets, "arg_words": self.words, "arg_align": self.align,
                "arg_dtypes": self.dtypes, "arg_ranks": self.ranks, "arg_bytes": self.nbytes, "arg_names": self.names}


def pack_args(signature: Signature, buffers: Sequence[str], layouts: dict[str, tuple[Sequence[int], Sequence[int]]],
              scalars: dict[str, object] | None = None, buffer_types: dict[str, BufferType] | None = None
              ) -> PackedArgs:
    """Pack a signature for launch.

    ``buffers`` names the custom call's buffers in order (inputs, then outputs); ``layouts`` maps
    each tensor argument's name to the concrete (shape, stride) it has at this call site;
    ``buffer_types`` gives each buffer's rank, dtype and size (default: a buffer laid out as its
    layout, of the argument's dtype). A buffer of another dtype, or smaller than its layout
    reaches, is a ValueError here; the handler checks the same at every launch.
    """
    scalars = scalars or {}
    buffer_types = buffer_types or {}
    kinds, offsets, chunks, align, dtypes, ranks, nbytes = [], [0], [], [], [], [], []
    for arg in signature:
        if isinstance(arg, StreamArg):
            kinds.append(-1)
            words = np.zeros(1, np.int64)
            align.append(0)
        elif isinstance(arg, ScalarArg):
            kinds.append(-2)
            words = scalar_words(arg, scalars[arg.name])
            align.append(0)
        else:
            if arg.name not in buffers:
                raise ValueError(f"kernel argument {arg.name!r} is bound to no buffer of {list(buffers)}")
            kinds.append(buffers.index(arg.name))
            shape, stride = layouts[arg.name]
            words = tensor_descriptor(arg, shape, stride)
            align.append(arg.align)
            need = reach(shape, stride) * ITEMSIZES[arg.dtype]
            have = buffer_types.get(arg.name) or BufferType(len(shape), arg.dtype, need)
            if have.dtype != arg.dtype:
                raise ValueError(f"kernel argument {arg.name!r} takes {arg.dtype}, but its buffer is {have.dtype}")
            if have.nbytes < need:
                raise ValueError(f"kernel argument {arg.name!r}: its layout {tuple(shape)}:{tuple(stride)} reaches "
                                 f"{need} bytes, past its buffer's {have.nbytes}")
            dtypes.append(FFI_DTYPES[arg.dtype])
            ranks.append(have.rank)
            nbytes.append(need)
        if not isinstance(arg, TensorArg):
            dtypes.append(0)
            ranks.append(-1)
            nbytes.append(0)
        chunks.append(words)
        offsets.append(offsets[-1] + len(words))
    i64 = lambda xs: np.asarray(xs, np.int64)  # noqa: E731
    return PackedArgs(i64(kinds), i64(offsets), np.concatenate(chunks) if chunks else np.zeros(0, np.int64),
                      i64(align), i64(dtypes), i64(ranks), i64(nbytes), ",".join(a.name for a in signature))


def fake_args(signature: Signature) -> list:
    """The DSL's fake arguments to compile a launcher for ``signature`` (imports the DSL)."""
    from jax_cute.kernels import dsl

    def extent(e: Extent, width: int):
        if isinstance(e, Dyn):
            return dsl.sym_int32(e.div) if width == 32 else dsl.sym_int64(e.div)
        return e

    out = []
    for arg in signature:
        if isinstance(arg, StreamArg):
            out.append(dsl.fake_stream())
        elif isinstance(arg, ScalarArg):
            out.append({"int32": dsl.Int32, "int64": dsl.Int64, "float32": dsl.Float32}[arg.dtype](0))
        else:
            out.append(dsl.make_fake_tensor(
                dsl.dsl_dtype(arg.dtype),
                tuple(extent(e, 32) for e in arg.shape),
                tuple(extent(e, 64) for e in arg.stride),
                assumed_align=arg.align,
            ))
    return out


# --- (de)serialisation, for the disk cache ---------------------------------------------------

def _enc_extent(e: Extent):
    return {"dyn": e.div} if isinstance(e, Dyn) else e


def _dec_extent(e) -> Extent:
    return Dyn(e["dyn"]) if isinstance(e, dict) else int(e)


def signature_to_json(signature: Signature) -> str:
    items = []
    for a in signature:
        if isinstance(a, TensorArg):
            items.append({"kind": "tensor", "name": a.name, "dtype": a.dtype, "align": a.align,
                          "shape": [_enc_extent(e) for e in a.shape], "stride": [_enc_extent(e) for e in a.stride]})
        elif isinstance(a, StreamArg):
            items.append({"kind": "stream", "name": a.name})
        else:
            items.append({"kind": "scalar", "name": a.name, "dtype": a.dtype})
    return json.dumps(items, sort_keys=True)


def signature_from_json(text: str) -> Signature:
    out: list[Arg] = []
    for d in json.loads(text):
        if d["kind"] == "tensor":
            out.append(TensorArg(d["name"], d["dtype"], tuple(_dec_extent(e) for e in d["shape"]),
                                 tuple(_dec_extent(e) for e in d["stride"]), d["align"]))
        elif d["kind"] == "stream":
            out.append(StreamArg(d["name"]))
        else:
            out.append(ScalarArg(d["name"], d["dtype"]))
    return tuple(out)
