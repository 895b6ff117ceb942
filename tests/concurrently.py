"""Run test code from several threads at once."""

from __future__ import annotations

import threading
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
