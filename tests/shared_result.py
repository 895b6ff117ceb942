"""Test results computed once per test run and shared by pytest-xdist's workers: the subprocess
fixtures' results, and kernels the compile tests build with their PTX.

The subprocess fixtures (8 CPU devices) take minutes; under pytest-xdist each worker that runs
one of their tests would compute them again. ``once`` lets the first worker compute a result
and the others read it, through a file and a lock in the run's directory, which ``conftest``
names in ``JAX_CUTE_TEST_SHARED`` for its workers.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pathlib
import pickle
from typing import Any, Callable


def once(key: str, compute: Callable[[], Any], *, dumps: Callable[[Any], bytes] = lambda r: json.dumps(r).encode(),
         loads: Callable[[bytes], Any] = json.loads) -> Any:
    """``compute()``, or the result a worker of this test run already computed for ``key``
    (stored as ``dumps`` writes it: JSON unless told otherwise)."""
    shared = os.environ.get("JAX_CUTE_TEST_SHARED")
    if not shared:
        return compute()
    path = pathlib.Path(shared) / f"{key}.result"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if path.exists():
            return loads(path.read_bytes())
        result = compute()
        path.write_bytes(dumps(result))
        return result


# A CPU test run compiles XLA's code without LLVM's optimisations (conftest adds this to
# XLA_FLAGS unless the run selects GPU tests): the tests check what jax_cute lowers and computes,
# not how fast XLA's CPU code runs, and XLA's CPU compiles were most of the run's time. The
# arithmetic is still IEEE (no fast-math); only which loops LLVM vectorises, and so some
# summation orders, change, as between machines.
FAST_CPU_COMPILE = "--xla_backend_optimization_level=0"


def xla_flags(*flags: str) -> str:
    """XLA_FLAGS for a test's subprocess: ``flags``, and the run's fast CPU compiles if it has them."""
    run = [FAST_CPU_COMPILE] if FAST_CPU_COMPILE in os.environ.get("XLA_FLAGS", "").split() else []
    return " ".join([*run, *flags])


_compiled: dict = {}


def compiled(family, spec, cfg, name: str):
    """``family``'s kernel for (``spec``, ``cfg``) compiled with its PTX kept: compiled once per
    test run (per process without pytest-xdist), whichever compile test asks first."""
    from jax_cute.kernels import build

    key = hashlib.sha256(f"{family.FAMILY}|{family.ARCH}|{spec!r}|{cfg!r}".encode()).hexdigest()[:32]
    if key not in _compiled:
        _compiled[key] = once(f"kernel-{key}", lambda: build.compile_launcher(
            family.launcher(spec, cfg), family.signature(spec, cfg), arch=family.ARCH, name=name, keep_ptx=True),
            dumps=pickle.dumps, loads=pickle.loads)
    return _compiled[key]
