"""Finding and loading what jax_cute needs at run time.

Two native pieces meet here: our XLA FFI extension ``jax_cute._ffi`` (built with this package)
and NVIDIA's ``libcute_dsl_runtime.so`` (shipped by the nvidia-cutlass-dsl wheel, never by
us). The extension loads the DSL runtime itself, by dlopen, from the path handed over here.

Nothing in this module imports the DSL's compiler (``cutlass``): a machine that only runs
kernels compiled elsewhere may have the DSL's runtime part alone.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading

from jax_cute import config

TARGET_NAME = "jax_cute_launch"
# The same handler without the command-buffer trait: XLA launches it on its stream each run
# (config switch ``command_buffer``).
STREAM_TARGET_NAME = "jax_cute_launch_stream"
# The graph handlers without their record stage, where TARGET_NAME has it: what lowering picks
# when config.record_launches is off (XLA then stream-captures the call as a child graph).
CAPTURE_TARGET_NAME = "jax_cute_launch_capture"
STATE_TYPE_NAME = "jax_cute_launch_state"
# Compiled once, never run: instantiating it hands our extension XLA's FFI API (see
# _register_recording).
PROBE_TARGET_NAME = "jax_cute_ffi_probe"

# Flavours of the DSL runtime, most preferred first (the wheel's cu13 extra is what we pin).
_FLAVOURS = ("cu13", "cu12")
_LIBRARY = "libcute_dsl_runtime.so"

_register_lock = threading.Lock()
_registered = False
_records = False

logger = logging.getLogger("jax_cute")


def dsl_runtime_library() -> str:
    """The path of ``libcute_dsl_runtime.so`` in the installed nvidia-cutlass-dsl."""
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    tried = []
    for flavour in _FLAVOURS:
        for root in roots:
            path = os.path.join(root, flavour, "lib", _LIBRARY)
            if os.path.isfile(path):
                return path
            tried.append(path)
    where = ", ".join(tried) if tried else "no 'nvidia_cutlass_dsl' package on sys.path"
    raise RuntimeError(
        f"jax_cute: cannot find {_LIBRARY} of the CuTe DSL runtime ({where}). "
        'Install it with: pip install "nvidia-cutlass-dsl[cu13]==4.8.1"')


def extension():
    """The compiled extension ``jax_cute._ffi``."""
    try:
        from jax_cute import _ffi
    except ImportError as e:
        raise ImportError(
            "jax_cute: the native extension jax_cute._ffi is not built or failed to load "
            f"({e}). Reinstall the package, e.g. `pip install -e .` from a source checkout.") from e
    return _ffi


def ensure_registered() -> None:
    """Register the ``jax_cute_launch`` FFI targets with JAX for CUDA (idempotent, thread-safe).

    Registration only queues the handler when no CUDA backend is present, so this works on a
    CPU-only jaxlib too (lowering for CUDA then finds the target).
    """
    global _registered
    if _registered:
        return
    with _register_lock:
        if _registered:
            return
        import jax

        ext = extension()
        ext.set_runtime_library(dsl_runtime_library())
        # The handler keeps per-instance state (ffi::State); XLA needs its type registered
        # before the first instantiation. Names must be unique per process: done once.
        jax.ffi.register_ffi_type(STATE_TYPE_NAME, ext.state_type(), platform="CUDA")
        jax.ffi.register_ffi_target(STREAM_TARGET_NAME, ext.registrations(command_buffer=False),
                                    platform="CUDA", api_version=1)
        global _records
        _records = _register_recording(jax, ext)
        jax.ffi.register_ffi_target(CAPTURE_TARGET_NAME if _records else TARGET_NAME,
                                    ext.registrations(command_buffer=True), platform="CUDA", api_version=1)
        _registered = True


def _register_recording(jax, ext) -> bool:
    """Register the graph target with its FFI record stage, so that XLA takes our kernel node
    into its CUDA graphs (with a programmatic edge for PDL builds) instead of stream-capturing
    our call as a child graph. True on success.

    jaxlib 0.11's Python registration passes only the instantiate/prepare/initialize/execute
    stages, so we register through XLA's own FFI API. Our extension gets that API from XLA: it
    is handed to every handler, and compiling a call to the probe target instantiates one.
    That needs a CUDA backend; without one (a CPU-only machine lowering for CUDA) we register
    the plain way, and XLA records our calls by stream capture.
    """
    if not hasattr(ext, "register_recording_target"):
        return False
    try:
        device = jax.devices("cuda")[0]
    except RuntimeError:
        return False
    try:
        import jax.numpy as jnp

        jax.ffi.register_ffi_target(PROBE_TARGET_NAME, ext.probe_registrations(), platform="CUDA",
                                    api_version=1)
        probe = jax.ffi.ffi_call(PROBE_TARGET_NAME, jax.ShapeDtypeStruct((), jnp.int32))
        with jax.default_device(device):
            jax.jit(probe).lower().compile()
        ext.register_recording_target(TARGET_NAME, "CUDA")
        return True
    except Exception as e:  # noqa: BLE001 - any failure leaves the stream-capture path, which works
        logger.warning("jax_cute: recording kernel nodes into XLA's graphs is unavailable (%s); "
                       "XLA will stream-capture our calls instead", e)
        return False


def target_name(command_buffer: bool) -> str:
    """The FFI target for graph-recordable (True) or stream-launched (False) custom calls; a
    graph-recordable call goes to the stream-capture target when recording is registered but
    switched off (``config.record_launches``)."""
    if not command_buffer:
        return STREAM_TARGET_NAME
    return CAPTURE_TARGET_NAME if _records and not config.record_launches() else TARGET_NAME


def records_launches() -> bool:
    """Whether our graph handler hands XLA its kernel node when XLA records a CUDA graph (the
    FFI record stage: jaxlib 0.11+, a CUDA backend in this process, ``config.record_launches``
    on, read at lowering). Otherwise XLA records our calls by stream capture as child graphs.
    Registers the handlers first if that has not happened yet."""
    try:
        ensure_registered()
    except (ImportError, RuntimeError):
        return False
    return _records and config.record_launches()


def stats() -> dict[str, int]:
    """Counters of the handler in this process: modules_created, functions_loaded, launches
    (launchers we ran on a stream), recorded (kernel nodes handed to XLA's graphs, updates
    included), record_skips (updates XLA asked for with unchanged buffers, skipped) and
    record_fallbacks (recordings left to XLA's stream capture)."""
    return dict(extension().stats())
