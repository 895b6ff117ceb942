"""Test results computed once per test run and shared by pytest-xdist's workers: the subprocess
fixtures' results, and kernels the compile tests build with their PTX, through files and locks
in the run's directory, which ``conftest`` names in ``JAX_CUTE_TEST_SHARED``.

A subprocess fixture (8 CPU devices, up to a minute) is a ``Script``. conftest starts every
script the run's tests read as the first test starts, one after another in one background
process (``start``), and runs the tests that read them last. The scripts then run beside the
other tests, and no pytest-xdist worker waits, idle, for a result that another is computing
(or that it computes itself while the other runs tests that need it).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pathlib
import pickle
import subprocess
import sys
import time
from typing import Any, Callable, Sequence


def once(key: str, compute: Callable[[], Any], *, dumps: Callable[[Any], bytes] = lambda r: json.dumps(r).encode(),
         loads: Callable[[bytes], Any] = json.loads) -> Any:
    """``compute()``, or the result a worker of this test run already computed for ``key``
    (stored as ``dumps`` writes it: JSON unless told otherwise)."""
    shared = os.environ.get("JAX_CUTE_TEST_SHARED")
    if not shared:
        return compute()
    path = pathlib.Path(shared) / f"{key}.result"
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if path.exists():
            return loads(path.read_bytes())
        result = compute()
        path.write_bytes(dumps(result))
        return result


# A CPU test run compiles XLA's code without LLVM's optimisations (conftest adds this to
# XLA_FLAGS unless the run selects GPU tests): the tests check what jax_cute lowers and computes,
# not how fast XLA's CPU code runs, and XLA's CPU compiles are much of the run's time. The
# arithmetic is still IEEE (no fast-math); which loops LLVM vectorises and which products it
# contracts into FMAs change, and with them some float32 roundings, as between machines.
# Subprocesses inherit it (xla_flags).
FAST_CPU_COMPILE = "--xla_backend_optimization_level=0"


def xla_flags(*flags: str) -> str:
    """XLA_FLAGS for a test's subprocess: ``flags``, and the run's fast CPU compiles if it has them."""
    run = [FAST_CPU_COMPILE] if FAST_CPU_COMPILE in os.environ.get("XLA_FLAGS", "").split() else []
    return " ".join([*run, *flags])


def host_devices_env(devices: int, shardy: bool | None = None) -> dict:
    """The environment of a test's subprocess on ``devices`` CPU host devices; ``shardy``: which
    partitioner (None: JAX's default)."""
    env = {**os.environ, "XLA_FLAGS": xla_flags(f"--xla_force_host_platform_device_count={devices}"),
           "JAX_PLATFORMS": "cpu"}
    if shardy is not None:
        env["JAX_USE_SHARDY_PARTITIONER"] = "1" if shardy else "0"
    return env


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


# -- subprocess fixtures ---------------------------------------------------------------------------

class Script:
    """A test module's subprocess: ``argv`` run in ``cwd`` with ``env``; its result is the JSON
    on the last line of its stdout. ``key`` names it in the run's directory."""

    def __init__(self, key: str, argv: Sequence[str], *, env: dict, cwd, timeout: float):
        self.key, self.argv, self.env, self.cwd, self.timeout = key, [str(a) for a in argv], env, str(cwd), timeout

    def result(self) -> dict:
        """The script's result: started now if conftest did not start it, then waited for. An
        assertion with the end of its stderr if it failed."""
        if self.key not in _results:
            shared = os.environ.get("JAX_CUTE_TEST_SHARED")
            if not shared:  # (outside conftest's runs: here and now)
                proc = subprocess.run(self.argv, env=self.env, cwd=self.cwd, capture_output=True, text=True,
                                      timeout=self.timeout)
                assert proc.returncode == 0, proc.stderr[-4000:]
                _results[self.key] = json.loads(proc.stdout.strip().splitlines()[-1])
            else:
                root = pathlib.Path(shared)
                start([self])
                rc = _wait(root, self.key)
                out, err = ((root / f"{self.key}.{s}").read_text() for s in ("out", "err"))
                assert rc == "0", f"{self.key}: exit status {rc}\n{err[-4000:]}"
                _results[self.key] = json.loads(out.strip().splitlines()[-1])
        return _results[self.key]


_results: dict[str, dict] = {}
_runners: dict[int, subprocess.Popen] = {}  # the runners this process started


def start(scripts: Sequence[Script]) -> None:
    """Run those of ``scripts`` that no process of this test run has started, one after another,
    in one background process; each leaves ``<key>.out``, ``.err`` and last ``.rc`` (its exit
    status, or ``timeout``) in the run's directory."""
    root = pathlib.Path(os.environ["JAX_CUTE_TEST_SHARED"])
    root.mkdir(mode=0o700, parents=True, exist_ok=True)  # (the jobs hold the scripts' environments)
    with open(root / "start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        new = [s for s in scripts if not (root / f"{s.key}.queued").exists()]
        if not new:
            return
        jobs = root / f"jobs-{os.getpid()}-{time.monotonic_ns()}.json"
        jobs.write_text(json.dumps([{"key": s.key, "argv": s.argv, "env": s.env, "cwd": s.cwd,
                                     "timeout": s.timeout} for s in new]))
        # the runner ends with pytest's main process (pytest-xdist's controller, this worker's parent)
        pytest_pid = os.getppid() if os.environ.get("PYTEST_XDIST_WORKER") else os.getpid()
        with open(root / "runners.log", "a") as log:
            runner = subprocess.Popen([sys.executable, __file__, str(jobs), str(pytest_pid)], cwd=root,
                                      stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        _runners[runner.pid] = runner
        for s in new:
            (root / f"{s.key}.queued").write_text(str(runner.pid))


def _wait(root: pathlib.Path, key: str) -> str:
    """``key``'s exit status, once its runner wrote it (an assertion if the runner is gone first)."""
    rc, pid = root / f"{key}.rc", int((root / f"{key}.queued").read_text())
    while not rc.exists():
        if not _alive(pid) and not rc.exists():
            raise AssertionError(f"{key}: its runner (pid {pid}) ended without running it")
        time.sleep(0.2)
    return rc.read_text()


def _alive(pid: int) -> bool:
    if pid in _runners:  # (a child that ended stays a zombie until it is waited for)
        return _runners[pid].poll() is None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _run_jobs(jobs: pathlib.Path, pytest_pid: int) -> None:
    """Run the jobs that ``start`` wrote; stop (the running script too) if pytest ends first: an
    interrupted run, or one that failed fast."""
    root = jobs.parent
    for job in json.loads(jobs.read_text()):
        with open(root / f"{job['key']}.out", "w") as out, open(root / f"{job['key']}.err", "w") as err:
            proc = subprocess.Popen(job["argv"], env=job["env"], cwd=job["cwd"], stdout=out, stderr=err,
                                    stdin=subprocess.DEVNULL)
            deadline = time.monotonic() + job["timeout"]
            while proc.poll() is None:
                if not _alive(pytest_pid):
                    proc.kill()
                    return
                if time.monotonic() > deadline:
                    proc.kill()
                    proc.wait()
                    rc = "timeout"
                    break
                time.sleep(0.5)
            else:
                rc = str(proc.returncode)
        tmp = root / f"{job['key']}.rc.tmp"
        tmp.write_text(rc)
        tmp.rename(root / f"{job['key']}.rc")  # last: the others read .out and .err once it exists


if __name__ == "__main__":  # the runner (``start``)
    _run_jobs(pathlib.Path(sys.argv[1]), int(sys.argv[2]))
