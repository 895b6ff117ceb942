"""What a compiled kernel's cache key is made of, derived, never bumped by hand.

A key is a sha256 over the kernel's own fields (family, spec, config, arch, or a user kernel's
code and signature) and everything else that shapes the object:

- the source of every module that builds kernels: all of ``jax_cute/kernels/*.py`` (families,
  their mainloop, epilogue and scheduler parts, the ABI, the build step), read once per process;
- the versions of the DSL's distributions (its compiler and the CUDA toolchain it bundles);
- the DSL's environment settings that change objects (``kernels.dsl_env.compile_settings``).

When the kernel sources cannot be read (a sourceless install), :func:`kernel_sources_digest`
is None and nothing may be cached on disk.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
from pathlib import Path

from jax_cute.kernels import dsl_env

FORMAT = 2  # the layout of entries on disk

# Distributions whose files make the object: the DSL's Python compiler, its MLIR/NVVM/ptxas
# libraries and the CUDA 13 toolchain flavour. Not the CUDA Python bindings: they drive the
# device at run time and build nothing, and the machine that precompiles need not have the GPU
# machine's version.
TOOLCHAIN = ("nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core", "nvidia-cutlass-dsl-libs-cu13")

KERNELS_DIR = Path(__file__).resolve().parent / "kernels"


def sources_digest(directory: Path) -> str | None:
    """sha256 over the names and bytes of every ``*.py`` in ``directory``, or None when there
    are none or one cannot be read."""
    h = hashlib.sha256()
    try:
        files = sorted(directory.glob("*.py"))
        for path in files:
            data = path.read_bytes()
            h.update(f"{path.name}\0{len(data)}\0".encode())
            h.update(data)
    except OSError:
        return None
    return h.hexdigest() if files else None


@functools.lru_cache(maxsize=None)
def kernel_sources_digest() -> str | None:
    """The digest of jax_cute's kernel sources, read once per process (the objects this process
    builds come from the modules it imported, not from files edited since)."""
    return sources_digest(KERNELS_DIR)


def distribution_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


@functools.lru_cache(maxsize=None)
def toolchain_versions() -> dict[str, str]:
    return {name: distribution_version(name) for name in TOOLCHAIN}


def dsl_version() -> str:
    return toolchain_versions()["nvidia-cutlass-dsl-libs-base"]


def key_inputs(fields: dict) -> dict:
    """Everything a key is computed from: ``fields`` and what shapes every object."""
    return dict(fields, kernel_sources=kernel_sources_digest(), toolchain=toolchain_versions(),
                dsl_settings=dsl_env.compile_settings(), format=FORMAT)


def make_key(fields: dict) -> str:
    """The content key of a kernel described by ``fields`` (JSON-serialisable, stable)."""
    return hashlib.sha256(json.dumps(key_inputs(fields), sort_keys=True).encode()).hexdigest()
