"""Test-suite policy.

- GPU tests carry ``@pytest.mark.gpu``; the default run deselects them (pyproject addopts) and
  ``pytest -m gpu`` selects them. Under ``-m gpu`` a skipped test counts as a failure: a GPU
  run that silently skipped its checks proves nothing.
- A ``-m gpu`` run writes its outcomes to ``$JAX_CUTE_GPU_RESULTS`` (default
  ``gpu-test-results.json``) with the commit, device and date, to be committed with the code.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess

import pytest
import shared_result  # tests/ is on sys.path

from jax_cute.kernels.dsl_env import prepare_dump_dir

# The DSL writes kept PTX into the working directory unless told otherwise, and reads where when
# it is first imported (some test modules import it before jax_cute does).
prepare_dump_dir()

try:  # JAX traces and compiles per example: no per-example deadline, fewer examples on 2 cores.
    from hypothesis import settings

    settings.register_profile("jax_cute", deadline=None, max_examples=40)
    settings.load_profile("jax_cute")
except ImportError:
    pass

_outcomes: list[dict] = []


@pytest.fixture(autouse=True, scope="session")
def _private_kernel_cache(tmp_path_factory):
    """Tests compile into a cache of their own, never the user's (unless one is named). Under
    pytest-xdist the workers share one (the run's directory, above each worker's own): the
    cache's per-key lock makes a kernel compile once per test run, whichever worker needs it."""
    run = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        run = run.parent
    # and the subprocess fixtures' results (tests/shared_result.py)
    os.environ.setdefault("JAX_CUTE_TEST_SHARED", str(run / "shared_results"))
    if "JAX_CUTE_CACHE_DIR" not in os.environ:
        if os.environ.get("PYTEST_XDIST_WORKER"):
            path = run / "jax_cute_cache"
            os.makedirs(path, mode=0o700, exist_ok=True)
        else:
            path = tmp_path_factory.mktemp("jax_cute_cache")
        os.environ["JAX_CUTE_CACHE_DIR"] = str(path)
    yield


def _scripts(item) -> list:
    """The subprocess fixtures (shared_result.Script) that ``item`` reads: those of the fixtures
    its module names in SUBPROCESS_FIXTURES, for the item's parameter of each."""
    fixtures = getattr(getattr(item, "module", None), "SUBPROCESS_FIXTURES", {})
    params = item.callspec.params if hasattr(item, "callspec") else {}
    return [script(params.get(name)) for name, script in fixtures.items() if name in getattr(item, "fixturenames", ())]


@pytest.fixture(autouse=True, scope="session")
def _start_subprocess_fixtures(_private_kernel_cache, request):
    """Start every subprocess fixture the run's tests read, in the background, before the first
    test (shared_result.start; under pytest-xdist whichever worker comes first starts them)."""
    scripts = {}
    for item in request.session.items:
        for script in _scripts(item):
            scripts.setdefault(script.key, script)
    if scripts:
        shared_result.start(list(scripts.values()))
    yield


@pytest.hookimpl(trylast=True)  # after -m and -k deselected theirs
def pytest_collection_modifyitems(config, items):
    """The tests that read a subprocess fixture run last, each fixture's together: by then the
    background run that the first test started has their results."""
    order: dict[str, int] = {}
    last = {}
    for item in items:
        keys = [s.key for s in _scripts(item)]
        if keys:
            last[item] = min(order.setdefault(k, len(order)) for k in keys)
    items[:] = [i for i in items if i not in last] + sorted(last, key=last.get)


def _gpu_run(config) -> bool:
    return "gpu" in (config.getoption("-m") or "") and "not gpu" not in (config.getoption("-m") or "")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """A run without GPU tests compiles XLA's CPU code unoptimised (shared_result.FAST_CPU_COMPILE
    says why), unless XLA_FLAGS sets an optimisation level. Before any test module starts a JAX
    backend, which reads XLA_FLAGS once; pytest-xdist's workers inherit it."""
    flags = os.environ.get("XLA_FLAGS", "")
    if not _gpu_run(config) and "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {shared_result.FAST_CPU_COMPILE}".strip()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not _gpu_run(item.config):
        return
    if report.skipped and item.get_closest_marker("gpu") is not None:
        report.outcome = "failed"
        report.longrepr = f"GPU test skipped under -m gpu (counts as a failure): {report.longrepr}"


def pytest_runtest_logreport(report):
    # Called where reports are collected: the one process, or pytest-xdist's controller.
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _outcomes.append({"test": report.nodeid, "outcome": report.outcome, "seconds": round(report.duration, 3)})


def pytest_sessionfinish(session, exitstatus):
    if not _gpu_run(session.config) or not _outcomes or hasattr(session.config, "workerinput"):
        return  # (an xdist worker: its controller writes the file)
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=session.config.rootpath).stdout.strip()
    except OSError:
        commit = ""
    try:
        import jax

        device = str(jax.devices()[0].device_kind)
        jax_version = jax.__version__
    except Exception as e:  # noqa: BLE001 - record what was there
        device, jax_version = f"unknown ({e})", ""
    record = {
        "commit": os.environ.get("JAX_CUTE_COMMIT") or commit,
        "device": device,
        "jax": jax_version,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "passed": sum(o["outcome"] == "passed" for o in _outcomes),
        "failed": sum(o["outcome"] == "failed" for o in _outcomes),
        "tests": _outcomes,
    }
    path = os.environ.get("JAX_CUTE_GPU_RESULTS", "gpu-test-results.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
