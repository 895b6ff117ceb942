"""Finding and loading what jax_cute needs at run time.

Two native pieces meet here: our XLA FFI extension ``jax_cute._ffi`` (built with this package)
and NVIDIA's ``libcute_dsl_runtime.so`` (shipped by the nvidia-cutlass-dsl-libs-cu13 wheel, never
by us). The extension loads the DSL runtime itself, by dlopen, from the path handed over here.

Nothing in this module imports the DSL's compiler (``cutlass``): a machine that only runs
kernels compiled elsewhere may have the DSL's runtime part alone.
"""

from __future__ import annotations

import importlib.metadata
import os
import threading

import jax

TARGET_NAME = "jax_cute_launch"
# The same handler without the command-buffer trait: XLA launches it on its stream each run
# (config switch ``command_buffer``).
STREAM_TARGET_NAME = "jax_cute_launch_stream"
STATE_TYPE_NAME = "jax_cute_launch_state"

# The flavour we depend on, as its wheel lists it (RECORD paths use "/").
_RUNTIME_DISTRIBUTION = "nvidia-cutlass-dsl-libs-cu13"
_LIBRARY = "nvidia_cutlass_dsl/cu13/lib/libcute_dsl_runtime.so"
_INSTALL_HINT = ('pip install "nvidia-cutlass-dsl-libs-base==4.8.1" '
                 '"nvidia-cutlass-dsl-libs-cu13==4.8.1"')

_register_lock = threading.Lock()
_registered = False


def dsl_runtime_library() -> str:
    """The path of ``libcute_dsl_runtime.so`` as installed by nvidia-cutlass-dsl-libs-cu13.

    Found through the distribution's own file list, never by importing a package: a folder
    named ``nvidia_cutlass_dsl`` in the working directory must not decide which library is
    loaded (with RTLD_GLOBAL) into the process.
    """
    try:
        dist = importlib.metadata.distribution(_RUNTIME_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(f"jax_cute: cannot find the CuTe DSL runtime ({_RUNTIME_DISTRIBUTION} is not "
                           f"installed). Install it with: {_INSTALL_HINT}") from None
    listed = [f for f in dist.files or () if f.as_posix() == _LIBRARY]
    path = os.path.realpath(dist.locate_file(listed[0])) if listed else None
    if path is None or not os.path.isfile(path):
        raise RuntimeError(f"jax_cute: cannot find the CuTe DSL runtime: {_RUNTIME_DISTRIBUTION} "
                           f"{dist.version} {'lists no' if path is None else 'lacks its'} {_LIBRARY}. "
                           f"Reinstall it with: {_INSTALL_HINT}")
    return path


def extension():
    """The compiled extension ``jax_cute._ffi``."""
    # Imported here, not at module level: the extension may be absent (not built), and this module
    # must still import so that callers can say why.
    try:
        from jax_cute import _ffi
    except ImportError as e:
        raise ImportError(
            "jax_cute: the native extension jax_cute._ffi is not built or failed to load "
            f"({e}). Reinstall the package, e.g. `pip install -e .` from a source checkout.") from e
    return _ffi


def ensure_registered() -> None:
    """Load the DSL runtime and register the FFI targets with JAX for CUDA (idempotent,
    thread-safe).

    Registration only queues the handler when no CUDA backend is present, so this works on a
    CPU-only jaxlib too (lowering for CUDA then finds the target).
    """
    global _registered
    if _registered:
        return
    with _register_lock:
        if _registered:
            return
        ext = extension()
        ext.set_runtime_library(dsl_runtime_library())  # dlopen: no GPU needed
        # The handler keeps per-instance state (ffi::State); XLA needs its type registered
        # before the first instantiation. Names must be unique per process: done once.
        jax.ffi.register_ffi_type(STATE_TYPE_NAME, ext.state_type(), platform="CUDA")
        for name, graph in ((TARGET_NAME, True), (STREAM_TARGET_NAME, False)):
            jax.ffi.register_ffi_target(name, ext.registrations(command_buffer=graph), platform="CUDA",
                                        api_version=1)
        _registered = True


def target_name(command_buffer: bool) -> str:
    """The FFI target for graph-recordable (True) or stream-launched (False) custom calls."""
    return TARGET_NAME if command_buffer else STREAM_TARGET_NAME


def stats() -> dict[str, int]:
    """Counters of the handler in this process: modules_created, functions_loaded, launches."""
    return dict(extension().stats())
