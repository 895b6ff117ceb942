"""The CuTe DSL's process environment, as far as compiling depends on it.

- The ``CUTE_DSL_*`` settings that change the objects the DSL builds (line info, assertions,
  compiler options, ...) are part of every cache key (:func:`compile_settings`). Every such
  variable counts except those listed in ``_NO_EFFECT_ON_OBJECTS``, so a setting a later DSL
  release adds is keyed until shown harmless.
- The DSL parses ``sys.argv`` on every compile (its ``-diagnostic`` option, through argparse):
  compiles run with ``sys.argv`` holding the program name only (:func:`program_name_only`).
- The DSL writes kept artifacts (PTX, cubin) to ``CUTE_DSL_DUMP_DIR``, read once when it is
  imported: :func:`prepare_dump_dir` points it at a private directory of this process's first.

Nothing here imports the DSL, and importing this module changes nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import sys
import tempfile
import threading
from typing import Iterator

PREFIX = "CUTE_DSL_"

# Settings that never change the compiled object: where files go, logging, caching of the
# DSL's own JIT, diagnostics. CUTE_DSL_ARCH is left out because every compile names its arch
# (``--gpu-arch``), and that arch is in the key itself.
_NO_EFFECT_ON_OBJECTS = frozenset({
    "ARCH", "DUMP_DIR", "CACHE_DIR", "NO_CACHE", "DISABLE_FILE_CACHING", "JIT_CACHE_MAX_ELEMS",
    "LOG_TO_CONSOLE", "LOG_TO_FILE", "LOG_LEVEL", "LOG_AUTOTUNE", "PRINT_IR", "PRINT_AFTER_PREPROCESSOR",
    "SHOW_STACKTRACE", "FILTER_STACKTRACE", "WARNINGS_IGNORE", "ENABLE_OPTIMIZATION_WARNINGS",
    "JIT_TIME_PROFILING", "KEEP", "KEEP_IR", "KEEP_PTX", "KEEP_CUBIN", "KEEP_SASS",
})


def compile_settings(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The ``CUTE_DSL_*`` variables set in ``environ`` (default: the process's) that may change
    a compiled object, by name."""
    env = os.environ if environ is None else environ
    return {name: value for name, value in sorted(env.items())
            if name.startswith(PREFIX) and name[len(PREFIX):] not in _NO_EFFECT_ON_OBJECTS}


_argv_lock = threading.Lock()
_argv_depth = 0
_argv_saved: list[str] = []


@contextlib.contextmanager
def program_name_only() -> Iterator[None]:
    """``sys.argv`` reduced to the program name while in scope (thread-safe: the first of
    overlapping compiles saves it, the last restores it). A user's own flags (``--h 4096``)
    would otherwise reach the DSL's argument parser, which may print its usage and exit."""
    global _argv_depth, _argv_saved
    with _argv_lock:
        if _argv_depth == 0:
            _argv_saved = list(sys.argv)
            sys.argv[:] = _argv_saved[:1] or ["python"]
        _argv_depth += 1
    try:
        yield
    finally:
        with _argv_lock:
            _argv_depth -= 1
            if _argv_depth == 0:
                sys.argv[:] = _argv_saved


def prepare_dump_dir() -> str:
    """Set ``CUTE_DSL_DUMP_DIR`` (unless the user did) to a fresh directory of this process's own,
    removed when it exits, and return it. Called before the DSL is imported. Never a fixed path
    in the shared temporary directory: a file or someone else's directory there must not break
    compiling, and processes compiling at once must not read each other's kept PTX."""
    global _dump_dir
    chosen = os.environ.get(PREFIX + "DUMP_DIR")
    inherited = os.environ.get(_OWNER) not in (None, str(os.getpid()))  # a jax_cute parent's own
    if chosen and not inherited and chosen != _dump_dir:
        with contextlib.suppress(OSError):
            os.makedirs(chosen, exist_ok=True)  # kept PTX comes back empty without it
        return chosen
    if _dump_dir is None or not os.path.isdir(_dump_dir):
        _dump_dir = tempfile.mkdtemp(prefix="jax_cute_dsl_dump-")
        atexit.register(shutil.rmtree, _dump_dir, ignore_errors=True)
    os.environ[PREFIX + "DUMP_DIR"] = _dump_dir
    os.environ[_OWNER] = str(os.getpid())
    return _dump_dir


_OWNER = "JAX_CUTE_DSL_DUMP_DIR_OF"  # the process whose own CUTE_DSL_DUMP_DIR is set


_dump_dir: str | None = None
