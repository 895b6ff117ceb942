"""The kernel cache: stable keys, disk entries, corruption, versions, concurrency, precompile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from jax_cute import cache as cache_mod
from jax_cute import config
from jax_cute.kernels import abi
from jax_cute.kernels.build import KernelBinary
from concurrently import run_concurrently

SIG = (abi.TensorArg("x", "float32", (abi.DYN,), (1,)), abi.StreamArg())


def fake_binary(tag: str = "x") -> KernelBinary:
    return KernelBinary(name=f"fake.{tag}", symbol="jc_fake", arch="sm_90a", signature=SIG,
                        obj=b"\x7fELF" + tag.encode() * 100)


@pytest.fixture
def fresh(tmp_path):
    with config.override(cache_dir=str(tmp_path), disk_cache=True):
        yield cache_mod.KernelCache(), tmp_path


def test_keys_are_content_keys():
    a = cache_mod.make_key({"family": "f", "config": "c", "arch": "sm_90a"})
    b = cache_mod.make_key({"arch": "sm_90a", "config": "c", "family": "f"})
    assert a == b and len(a) == 64
    assert a != cache_mod.make_key({"family": "f", "config": "d", "arch": "sm_90a"})


def test_memory_then_disk_then_build(fresh):
    c, _ = fresh
    builds = []
    fields = {"family": "f", "n": 1}
    first = c.get(fields, lambda: builds.append(1) or fake_binary())
    again = c.get(fields, lambda: builds.append(1) or fake_binary())
    assert first is again and builds == [1] and c.stats.memory_hits == 1
    other = cache_mod.KernelCache()  # a new process, as far as memory goes
    loaded = other.get(fields, lambda: pytest.fail("should come from disk"))
    assert loaded.obj == first.obj and loaded.signature == SIG and other.stats.disk_hits == 1


def _entry(tmp_path, fields):
    key = cache_mod.make_key(fields)
    return tmp_path / key[:2] / f"{key}.o", tmp_path / key[:2] / f"{key}.json"


def test_corrupt_entry_is_ignored_and_rebuilt(fresh, caplog):
    c, tmp = fresh
    fields = {"family": "f", "n": 2}
    c.get(fields, fake_binary)
    obj, _ = _entry(tmp, fields)
    obj.write_bytes(b"garbage")
    other = cache_mod.KernelCache()
    rebuilt = other.get(fields, lambda: fake_binary("y"))
    assert rebuilt.name == "fake.y" and other.stats.rejected == 1 and other.stats.compiles == 1
    assert any("checksum" in r.getMessage() for r in caplog.records)
    assert cache_mod.KernelCache().get(fields, lambda: pytest.fail("rebuilt entry not stored")).name == "fake.y"


def test_entry_from_another_version_is_ignored(fresh, caplog):
    c, tmp = fresh
    fields = {"family": "f", "n": 3}
    c.get(fields, fake_binary)
    _, meta_path = _entry(tmp, fields)
    meta = json.loads(meta_path.read_text())
    meta["dsl"] = "0.0.1"
    meta_path.write_text(json.dumps(meta))
    other = cache_mod.KernelCache()
    other.get(fields, lambda: fake_binary("z"))
    assert other.stats.rejected == 1 and other.stats.compiles == 1
    assert any("written by DSL 0.0.1" in r.getMessage() for r in caplog.records)


def test_concurrent_first_calls_build_once(fresh):
    c, _ = fresh
    calls = []

    def slow_build():
        calls.append(threading.get_ident())
        time.sleep(0.2)
        return fake_binary()

    results = []
    run_concurrently(lambda: results.append(c.get({"family": "f", "n": 4}, slow_build)), [()] * 8)
    assert len(calls) == 1 and len({id(r) for r in results}) == 1 and len(results) == 8


def test_disk_cache_switch(tmp_path):
    with config.override(cache_dir=str(tmp_path), disk_cache=False):
        cache_mod.KernelCache().get({"family": "f"}, fake_binary)
    assert not list(tmp_path.glob("*/*"))


def test_precompile_then_lower_in_a_fresh_process_without_the_dsl_compiler(tmp_path):
    """The CLI fills the cache for sm_90a; a new process lowers from it without importing cutlass."""
    env = dict(os.environ, JAX_CUTE_CACHE_DIR=str(tmp_path), JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-m", "jax_cute", "cache", "precompile", "--arch", "sm_90a",
                    "--matmul", "256x128,128x64:grad"], env=env, check=True, capture_output=True)
    listing = subprocess.run([sys.executable, "-m", "jax_cute", "cache", "list"], env=env, check=True,
                             capture_output=True, text=True).stdout
    assert "3 entries" in listing and "sm90_gemm" in listing
    probe = (
        "import sys, time, jax, jax.numpy as jnp, jax_cute\n"
        "from jax_cute.cache import CACHE\n"
        "jax_cute.config.set(target_arch='sm_90a', strict=True)\n"
        "a = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16); b = jax.ShapeDtypeStruct((128, 64), jnp.bfloat16)\n"
        "t = time.perf_counter()\n"
        "txt = jax.jit(jax_cute.matmul).trace(a, b).lower(lowering_platforms=('cuda',)).as_text()\n"
        "print(time.perf_counter() - t, 'cutlass' in sys.modules, CACHE.stats.compiles, CACHE.stats.disk_hits,\n"
        "      'jax_cute_launch' in txt)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], env=env, check=True, capture_output=True, text=True)
    seconds, dsl_imported, compiles, disk_hits, launched = out.stdout.split()
    assert dsl_imported == "False" and compiles == "0" and disk_hits == "1" and launched == "True"
    cleared = subprocess.run([sys.executable, "-m", "jax_cute", "cache", "clear"], env=env, check=True,
                             capture_output=True, text=True).stdout
    assert "removed 3 entries" in cleared
