"""Run test code from several threads, or several processes, at once."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable, Iterable


def run_concurrently(target: Callable, args_list: Iterable[tuple]) -> None:
    """One thread per argument tuple, all started before any is joined; the first exception a
    thread raised is raised here (a thread's own exception would otherwise only be printed)."""
    errors: list[BaseException] = []

    def guarded(*args):
        try:
            target(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=tuple(a)) for a in args_list]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def run_at_once(script: str, tmp_path: Path, n: int, *args: str) -> list[str]:
    """stdout of ``n`` Python processes running ``script``, whose argv is ``*args``, then its
    index, a barrier folder (each touches a file there and waits for all ``n``) and ``n``."""
    ready = tmp_path / "ready"
    ready.mkdir()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, "-c", script, *args, str(i), str(ready), str(n)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(n)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    return [out for out, _ in outs]
