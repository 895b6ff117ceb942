"""The kernel cache: derived keys, disk entries, trust, corruption, concurrency, precompile."""

from __future__ import annotations

import ast

import errno
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jax_cute import __main__ as cli
from jax_cute import cache as cache_mod
from jax_cute import cache_key, config
from jax_cute.kernels import abi, dsl_env
from jax_cute.kernels.build import KernelBinary
from concurrently import run_at_once, run_concurrently

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


def test_entry_written_for_another_key_is_ignored(fresh, caplog):
    """An entry copied or renamed to another key's place is not served for it."""
    c, tmp = fresh
    c.get({"family": "f", "n": 3}, fake_binary)
    obj, meta = _entry(tmp, {"family": "f", "n": 3})
    obj2, meta2 = _entry(tmp, {"family": "f", "n": 33})
    obj2.parent.mkdir(exist_ok=True)
    obj2.write_bytes(obj.read_bytes())
    meta2.write_bytes(meta.read_bytes())
    other = cache_mod.KernelCache()
    assert other.get({"family": "f", "n": 33}, lambda: fake_binary("z")).name == "fake.z"
    assert other.stats.rejected == 1 and other.stats.compiles == 1
    assert any("expected format" in r.getMessage() for r in caplog.records)


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


@pytest.mark.sweep   # (38 s: CI's second step, so the README's test line stays under 10 minutes)
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


# -- keys are derived from what builds the object -------------------------------------------------

def test_a_change_to_any_kernel_source_changes_every_key(tmp_path, monkeypatch):
    """No version to bump: editing a kernel module (here its mainloop) gives new keys."""
    copy = tmp_path / "kernels"
    shutil.copytree(cache_key.KERNELS_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    fields = {"family": "sm90_gemm", "arch": "sm_90a", "spec": "s", "config": "c"}
    original = cache_mod.make_key(fields)
    monkeypatch.setattr(cache_key, "KERNELS_DIR", copy)
    cache_key.kernel_sources_digest.cache_clear()
    try:
        before = cache_mod.make_key(fields)
        assert before == original  # the same sources elsewhere: the same key
        mainloop = copy / "sm90_mainloop.py"
        mainloop.write_text(mainloop.read_text() + "\n# a change\n")
        cache_key.kernel_sources_digest.cache_clear()
        assert cache_mod.make_key(fields) != before
    finally:
        cache_key.kernel_sources_digest.cache_clear()


def test_every_kernel_module_is_keyed():
    keyed = {p.name for p in cache_key.KERNELS_DIR.glob("*.py")}
    assert {"sm90_gemm.py", "sm90_mainloop.py", "sm90_grouped.py", "epilogue.py", "abi.py", "build.py",
            "gemm_spec.py", "dsl.py", "sm100_gemm.py"} <= keyed


def test_jax_cute_defines_kernels_only_in_keyed_modules():
    """A DSL kernel of jax_cute's own (a ``cute_call`` launcher too) lives in kernels/, whose
    sources key every entry: ``cute_call`` keys a launcher by the user code it reaches and takes
    jax_cute's modules as keyed by that digest, so a kernel defined elsewhere in the package could
    change while its cached object did not."""
    package = cache_key.KERNELS_DIR.parent

    def kernels_in(path):
        return [node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)
                and any(ast.unparse(d).split("(")[0] in ("cute.kernel", "cute.jit") for d in node.decorator_list)]

    assert kernels_in(cache_key.KERNELS_DIR / "fp8_operands.py")   # (the check sees a kernel)
    outside = {str(p.relative_to(package)): names for p in package.rglob("*.py")
               if p.parent != cache_key.KERNELS_DIR and (names := kernels_in(p))}
    assert not outside, outside


@pytest.mark.parametrize("var,value", [("CUTE_DSL_LINEINFO", "1"), ("CUTE_DSL_ENABLE_ASSERTIONS", "1"),
                                       ("CUTE_DSL_COMPILER_OPT", "remarks{ptx}"), ("CUTE_DSL_SOME_NEW_SWITCH", "1")])
def test_dsl_settings_that_change_objects_change_the_key(monkeypatch, var, value):
    fields = {"family": "f"}
    monkeypatch.delenv(var, raising=False)
    before = cache_mod.make_key(fields)
    monkeypatch.setenv(var, value)
    assert cache_mod.make_key(fields) != before


@pytest.mark.parametrize("var", ["CUTE_DSL_DUMP_DIR", "CUTE_DSL_LOG_LEVEL", "CUTE_DSL_ARCH", "CUTE_DSL_KEEP"])
def test_dsl_settings_without_effect_on_objects_keep_the_key(monkeypatch, var):
    """(CUTE_DSL_ARCH: every compile names its arch, which is keyed; a precompiling process
    sets the variable, the GPU machine that loads the entry does not.)"""
    fields = {"family": "f"}
    monkeypatch.delenv(var, raising=False)
    before = cache_mod.make_key(fields)
    monkeypatch.setenv(var, "ptx")
    assert cache_mod.make_key(fields) == before


def test_entries_record_what_their_key_was_made_of(fresh):
    c, tmp = fresh
    c.get({"family": "f", "n": 40}, fake_binary)
    _, meta = _entry(tmp, {"family": "f", "n": 40})
    inputs = json.loads(meta.read_text())["inputs"]
    assert inputs["family"] == "f" and inputs["kernel_sources"] == cache_key.kernel_sources_digest()
    assert inputs["toolchain"]["nvidia-cutlass-dsl-libs-base"] == cache_mod.dsl_version() != "absent"


# -- a cache that only reads on a hit, and only trusts what is the user's -------------------------

def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_mode, p.stat().st_mtime_ns, p.stat().st_size)
            for p in root.rglob("*")}


def test_a_hit_never_writes(fresh, monkeypatch, caplog):
    """On a read-only mount (writes fail with EROFS) a valid entry still loads, silently, and
    nothing in the directory changes (modes included: a shared cache stays shared)."""
    c, tmp = fresh
    c.get({"family": "f", "n": 41}, fake_binary)
    for p in tmp.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    before = _snapshot(tmp)

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(cache_mod, "atomic_write", read_only)
    monkeypatch.setattr(cache_mod, "_private_dirs", read_only)
    other = cache_mod.KernelCache()
    assert other.get({"family": "f", "n": 41}, lambda: pytest.fail("should come from disk")).name == "fake.x"
    assert other.stats.disk_hits == 1 and not caplog.records
    assert _snapshot(tmp) == before
    # a miss on a read-only cache compiles, and says it could not store
    assert other.get({"family": "f", "n": 42}, fake_binary).name == "fake.x"
    assert any("could not write" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("how", ["group-writable", "world-writable", "someone else's"])
def test_a_directory_others_may_write_to_is_not_used(tmp_path, caplog, how):
    root = tmp_path / "shared"
    root.mkdir()
    if how == "someone else's":
        os.chown(root, 4242, -1) if os.geteuid() == 0 else pytest.skip("needs root to hand a directory away")
    else:
        root.chmod(0o770 if how == "group-writable" else 0o777)
    with config.override(cache_dir=str(root), disk_cache=True):
        c = cache_mod.KernelCache()
        c.get({"family": "f", "n": 43}, fake_binary)
        c2 = cache_mod.KernelCache()
        c2.get({"family": "f", "n": 43}, fake_binary)
    assert c2.stats.compiles == 1 and c2.stats.disk_hits == 0 and not list(root.iterdir())
    assert any("not using" in r.getMessage() and str(root) in r.getMessage() for r in caplog.records)


def test_an_entry_others_may_write_to_is_rebuilt(fresh, caplog):
    c, tmp = fresh
    c.get({"family": "f", "n": 44}, fake_binary)
    obj, _ = _entry(tmp, {"family": "f", "n": 44})
    obj.chmod(0o666)
    other = cache_mod.KernelCache()
    other.get({"family": "f", "n": 44}, fake_binary)
    assert other.stats.rejected == 1 and other.stats.compiles == 1
    assert any("only they may write" in r.getMessage() for r in caplog.records)


def test_new_directories_are_private(fresh):
    c, tmp = fresh
    root = tmp / "new" / "cache"
    with config.override(cache_dir=str(root)):
        cache_mod.KernelCache().get({"family": "f", "n": 45}, fake_binary)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) & 0o077 == 0 for p in root.rglob("*"))


def test_tilde_is_the_home_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("JAX_CUTE_CACHE_DIR", "~/kernels")
    assert config.cache_dir() == tmp_path / "kernels"
    with config.override(cache_dir="~/other"):
        assert config.cache_dir() == tmp_path / "other"


@pytest.mark.parametrize("meta", ["[]", "5", '"text"', '{"name": 5}', "{}", "not json",
                                  '{"format": 2, "key": "KEY", "name": "n", "symbol": "s", "arch": "sm_90a", '
                                  '"sha256": "SHA", "signature": "{\\"kind\\": 1}"}'])
def test_wrong_shaped_entries_are_rebuilt_and_listed(fresh, caplog, capsys, meta):
    c, tmp = fresh
    fields = {"family": "f", "n": 46}
    c.get(fields, fake_binary)
    obj, meta_path = _entry(tmp, fields)
    key = meta_path.stem
    meta_path.write_text(meta.replace("KEY", key).replace("SHA", fake_binary().digest))
    other = cache_mod.KernelCache()
    assert other.get(fields, lambda: fake_binary("y")).name == "fake.y"
    assert other.stats.rejected == 1
    meta_path.write_text(meta.replace("KEY", key).replace("SHA", fake_binary().digest))
    with config.override(cache_dir=str(tmp)):
        assert cli._list() == 0
    assert "(1 entries)" in capsys.readouterr().out


def test_clear_removes_only_our_entries(fresh):
    c, tmp = fresh
    c.get({"family": "f", "n": 47}, fake_binary)
    c.get({"family": "f", "n": 48}, fake_binary)
    theirs = [tmp / "build" / "main.o", tmp / "myproject" / "package.json", tmp / "ab" / "notes.json",
              tmp / "ab" / ("cd" * 32 + ".json"), tmp / "README.o"]
    for p in theirs:
        p.parent.mkdir(exist_ok=True)
        p.write_text("theirs")
    with config.override(cache_dir=str(tmp)):
        assert cache_mod.KernelCache().clear_disk() == 2
    assert all(p.exists() for p in theirs)
    assert sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file()) == sorted(
        str(p.relative_to(tmp)) for p in theirs)


_MISS_AT_ONCE = r"""
import sys, time
from pathlib import Path
from jax_cute import cache, config
from jax_cute.kernels import abi
from jax_cute.kernels.build import KernelBinary

root, me, ready, n = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
(ready / me).touch()
while len(list(ready.iterdir())) < n:  # every process is past its imports: miss together
    time.sleep(0.01)
sig = (abi.TensorArg("x", "float32", (abi.DYN,), (1,)), abi.StreamArg())
build = lambda: (time.sleep(1.0), KernelBinary("fake.x", "jc_fake", "sm_90a", sig, b"\x7fELF" + b"x" * 100))[1]
with config.override(cache_dir=root, disk_cache=True):
    c = cache.KernelCache()
    c.get({"family": "f", "n": 49}, build)
print("COMPILES", c.stats.compiles)
"""


def test_processes_sharing_a_directory_compile_a_missing_kernel_once(tmp_path):
    outs = run_at_once(_MISS_AT_ONCE, tmp_path, 3, str(tmp_path / "c"))
    assert sorted(out.split()[-1] for out in outs) == ["0", "0", "1"]


# -- the DSL's environment ---------------------------------------------------------------------------

def test_importing_jax_cute_leaves_tmpdir_alone_and_a_file_there_breaks_nothing(tmp_path):
    """A file where the DSL dump directory would go (a shared /tmp) breaks neither the import
    nor a compile's setup, and the import itself creates nothing there."""
    (tmp_path / "jax_cute_dsl_dump").write_text("someone else's")
    env = dict(os.environ, TMPDIR=str(tmp_path), JAX_PLATFORMS="cpu")
    env.pop("CUTE_DSL_DUMP_DIR", None)
    probe = ("import os, jax_cute\n"
             "print(sorted(os.listdir(os.environ['TMPDIR'])))\n"
             "from jax_cute.kernels import dsl_env\n"
             "d = dsl_env.prepare_dump_dir(); st = os.stat(d)\n"
             "print(os.path.dirname(d) == os.environ['TMPDIR'], oct(st.st_mode & 0o777), "
             "d == os.environ['CUTE_DSL_DUMP_DIR'])\n")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    listing, made = out.stdout.strip().splitlines()[-2:]
    assert listing == "['jax_cute_dsl_dump']" and made == "True 0o700 True"
    assert sorted(os.listdir(tmp_path)) == ["jax_cute_dsl_dump"]  # its own directory went with it


def test_each_compiling_process_keeps_its_artifacts_apart(tmp_path):
    """Processes compiling at once (test workers, precompiles) never share a dump directory,
    even when one inherits another's environment; a directory the user names is used as is."""
    first = dsl_env.prepare_dump_dir()
    probe = "from jax_cute.kernels import dsl_env; print(dsl_env.prepare_dump_dir())"
    child = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0 and child.stdout.strip() not in ("", first), child.stderr[-2000:]
    env = {k: v for k, v in os.environ.items() if k != "JAX_CUTE_DSL_DUMP_DIR_OF"}
    env["CUTE_DSL_DUMP_DIR"] = str(tmp_path / "mine")
    named = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, env=env)
    assert named.stdout.strip() == str(tmp_path / "mine") and (tmp_path / "mine").is_dir()


def test_dsl_settings_exclude_only_known_harmless_ones():
    env = {"CUTE_DSL_LINEINFO": "1", "CUTE_DSL_DUMP_DIR": "/x", "CUTE_DSL_ARCH": "sm_90a", "PATH": "/bin",
           "CUTE_DSL_ENABLE_ASSERTIONS": "1", "CUTE_DSL_FUTURE": "x"}
    assert dsl_env.compile_settings(env) == {"CUTE_DSL_ENABLE_ASSERTIONS": "1", "CUTE_DSL_FUTURE": "x",
                                             "CUTE_DSL_LINEINFO": "1"}
