"""Compiling a CuTe DSL launcher into an object our FFI handler can load.

The result is a :class:`KernelBinary`: the relocatable object ``dump_to_object`` gives (host
launcher plus cubin for one arch), the symbol prefix to look its function up by, and the
:data:`~jax_cute.kernels.abi.Signature` it was compiled against.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import re
import threading
from typing import Callable

from jax_cute import runtime
from jax_cute.kernels import abi, dsl_env

_runtime_lock = threading.Lock()
_runtime_loaded = False


@dataclasses.dataclass(frozen=True)
class KernelBinary:
    name: str               # human-readable, for logs and FFI errors
    symbol: str             # function prefix inside ``obj``
    arch: str               # e.g. "sm_90a"
    signature: abi.Signature
    obj: bytes              # ELF object from ``dump_to_object``
    ptx: str | None = None  # kept when asked for (compile-only checks)

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.obj).hexdigest()


class KernelCompileError(RuntimeError):
    """The DSL failed to compile a kernel; the message carries the DSL's own."""


def load_runtime_globally() -> None:
    """Load the DSL runtime with RTLD_GLOBAL before compiling.

    With it loaded globally one process can export objects for several archs (chosen by the
    ``--gpu-arch`` option); without it, exporting an object for an arch other than the
    process's ``CUTE_DSL_ARCH`` fails to resolve symbols.
    """
    global _runtime_loaded
    with _runtime_lock:
        if not _runtime_loaded:
            ctypes.CDLL(runtime.dsl_runtime_library(), mode=ctypes.RTLD_GLOBAL)
            _runtime_loaded = True


def symbol_for(name: str) -> str:
    """A C identifier derived from a kernel's name (stable: it is part of the object)."""
    return "jc_" + re.sub(r"[^0-9A-Za-z_]", "_", name)[:80]


def compile_launcher(launcher: Callable, signature: abi.Signature, *, arch: str, name: str,
                     keep_ptx: bool = False, finish: Callable[[bytes], bytes] | None = None) -> KernelBinary:
    """Compile ``launcher`` (a ``@cute.jit`` function) for ``arch`` against ``signature``;
    ``finish`` rewrites the object, keeping its size (a family's pass over its machine code,
    which the family's kernel sources, part of every cache key, name)."""
    load_runtime_globally()
    # Imported here, not at the top: it imports the DSL's compiler, which loading a cached
    # kernel must not need (a GPU machine may have the DSL's runtime only).
    from jax_cute.kernels import dsl

    options = f"--gpu-arch {arch}" + (" --keep-ptx" if keep_ptx else "")
    symbol = symbol_for(name)
    try:
        with dsl_env.program_name_only():  # the DSL parses sys.argv on every compile
            compiled = dsl.cute.compile(launcher, *abi.fake_args(signature), options=options)
            obj = compiled.dump_to_object(symbol)
        if finish is not None:
            obj = finish(bytes(obj))
    except Exception as e:  # the DSL raises many types; keep its message whole
        raise KernelCompileError(f"jax_cute: compiling kernel {name} for {arch} failed:\n{e}") from e
    ptx = None
    if keep_ptx:
        ptx = getattr(compiled.artifacts, "PTX", None)
        if ptx and len(ptx) < 4096 and os.path.isfile(ptx):  # some DSL builds hand back the dump's path
            with open(ptx) as f:
                ptx = f.read()
    return KernelBinary(name=name, symbol=symbol, arch=arch, signature=signature, obj=bytes(obj), ptx=ptx)
