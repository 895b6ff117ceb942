"""A test result computed once per test run and shared by pytest-xdist's workers.

The subprocess fixtures (8 CPU devices) take minutes; under pytest-xdist each worker that runs
one of their tests would compute them again. ``once`` lets the first worker compute a result
and the others read it, through a file and a lock in the run's directory, which ``conftest``
names in ``JAX_CUTE_TEST_SHARED`` for its workers.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
from typing import Callable


def once(key: str, compute: Callable[[], dict]) -> dict:
    """``compute()``, or the result a worker of this test run already computed for ``key``."""
    shared = os.environ.get("JAX_CUTE_TEST_SHARED")
    if not shared:
        return compute()
    path = pathlib.Path(shared) / f"{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if path.exists():
            return json.loads(path.read_text())
        result = compute()
        path.write_text(json.dumps(result))
        return result
