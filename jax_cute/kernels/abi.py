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
    """What the FFI handler needs to build ``void* args[]`` (see csrc/jax_cute_ffi.cc)."""

    kinds: np.ndarray    # per argument: -1 stream, -2 scalar, k >= 0 buffer k (inputs then outputs)
    offsets: np.ndarray  # len(kinds) + 1 offsets into ``words``
    words: np.ndarray    # concatenated descriptor templates (int64)
    align: np.ndarray    # per argument: byte alignment the buffer pointer must have (0: none)

    def attributes(self) -> dict[str, np.ndarray]:
        return {"arg_kinds": self.kinds, "arg_offsets": self.offsets, "arg_words": self.words, "arg_align": self.align}


def pack_args(signature: Signature, buffers: Sequence[str], layouts: dict[str, tuple[Sequence[int], Sequence[int]]],
              scalars: dict[str, object] | None = None) -> PackedArgs:
    """Pack a signature for launch.

    ``buffers`` names the custom call's buffers in order (inputs, then outputs); ``layouts`` maps
    each tensor argument's name to the concrete (shape, stride) it has at this call site.
    """
    scalars = scalars or {}
    kinds, offsets, chunks, align = [], [0], [], []
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
        chunks.append(words)
        offsets.append(offsets[-1] + len(words))
    return PackedArgs(np.asarray(kinds, np.int64), np.asarray(offsets, np.int64),
                      np.concatenate(chunks) if chunks else np.zeros(0, np.int64), np.asarray(align, np.int64))


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
