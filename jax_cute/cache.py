"""One compile cache for every jax_cute kernel: in memory, and on disk across processes.

Keys are content keys (``cache_key``): a sha256 over the kernel's fields (family, spec,
config, arch, or a user kernel's code), the sources of jax_cute's kernel modules, the DSL's
versions and the DSL settings that change objects. Never object ids, generated names or a
hand-bumped version, so equal keys give the same object in any process, and a change to any
kernel source gives new keys. Loading an entry needs neither the DSL's compiler nor a trace.

On disk an entry is ``<dir>/<key[:2]>/<key>.o`` (the object) and ``<key>.json`` (its metadata
and checksum), each written atomically (temporary file + rename); ``<key>.lock`` makes
processes that miss the same key at once compile it once. A hit only reads, so a cache on a
read-only or shared mount works. Entries are code this process will run: the directory is
used only if it belongs to this user (or root) and no group or other user may write to it,
and so must each entry; otherwise the disk cache is off, with a warning. A malformed entry
is logged, ignored and rebuilt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import re
import stat
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from jax_cute import config
from jax_cute.cache_key import FORMAT, dsl_version, kernel_sources_digest, key_inputs, make_key
from jax_cute.kernels import abi
from jax_cute.kernels.build import KernelBinary, compile_launcher

logger = logging.getLogger("jax_cute")

__all__ = ["CACHE", "KernelCache", "Stats", "atomic_write", "dsl_version", "family_binary", "make_key", "object_pass",
           "untrusted_reason"]

# Our names, and only these, are ours to read, list and delete.
_SUBDIR = re.compile(r"[0-9a-f]{2}")
_ENTRY_FILE = re.compile(r"(?P<key>[0-9a-f]{64})\.(?:o|json|lock)(?:[0-9a-z_]+\.tmp)?")


def _trusted_stat(st: os.stat_result) -> bool:
    """Owned by this user or root, and writable by neither group nor others."""
    return st.st_uid in (os.geteuid(), 0) and not st.st_mode & 0o022


def untrusted_reason(root: Path) -> str | None:
    """Why the cache directory ``root`` must not be used, or None. A directory that does not
    exist yet is fine: it is created private to this user."""
    try:
        st = os.stat(root)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot inspect it ({e})"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid not in (os.geteuid(), 0):
        return f"it belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}) or root"
    if st.st_mode & 0o022:
        return f"others may write to it (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _read_trusted(path: Path) -> bytes:
    """The bytes of ``path``, a regular file (not a link) that passes ``_trusted_stat``."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or not _trusted_stat(st):
            raise ValueError(f"{path.name} is not a regular file of this user's that only they may write "
                             f"(uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})")
        return f.read()


def _binary_from_meta(meta: object, key: str, obj: bytes) -> KernelBinary:
    """The entry's binary, or ValueError naming what is wrong with its metadata."""
    if not isinstance(meta, dict):
        raise ValueError(f"metadata is a JSON {type(meta).__name__}, not an object")
    if meta.get("format") != FORMAT or meta.get("key") != key:
        raise ValueError(f"written in format {meta.get('format')!r} for key {str(meta.get('key'))[:16]}, "
                         f"expected format {FORMAT} for this key")
    for field in ("name", "symbol", "arch", "signature", "sha256"):
        if not isinstance(meta.get(field), str):
            raise ValueError(f"metadata field {field!r} is {meta.get(field)!r}, not a string")
    if hashlib.sha256(obj).hexdigest() != meta["sha256"]:
        raise ValueError("object checksum mismatch")
    try:
        signature = abi.signature_from_json(meta["signature"])
    except (ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
        raise ValueError(f"malformed signature ({type(e).__name__}: {e})") from None
    return KernelBinary(name=meta["name"], symbol=meta["symbol"], arch=meta["arch"], signature=signature, obj=obj)


@dataclasses.dataclass
class Stats:
    memory_hits: int = 0
    disk_hits: int = 0
    compiles: int = 0
    rejected: int = 0


class KernelCache:
    def __init__(self) -> None:
        self._memory: dict[str, KernelBinary] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._warned: set[str] = set()
        self.stats = Stats()

    # -- disk ---------------------------------------------------------------------------------
    @staticmethod
    def directory() -> Path:
        return config.cache_dir()

    def _warn_once(self, what: str, message: str, *args) -> None:
        with self._guard:
            if what in self._warned:
                return
            self._warned.add(what)
        logger.warning(message, *args)

    def _disk_root(self) -> Path | None:
        """The directory to read and write entries in, or None (disk cache off, or unusable:
        warned once)."""
        if not config.disk_cache():
            return None
        if kernel_sources_digest() is None:
            self._warn_once("sources", "jax_cute cache: the kernel sources cannot be read, so kernels "
                            "cannot be keyed on them; the disk cache is off")
            return None
        root = self.directory()
        why = untrusted_reason(root)
        if why:
            self._warn_once(str(root), "jax_cute cache: not using %s: %s. Cached kernels are code this "
                            "process runs; the disk cache is off (set JAX_CUTE_CACHE_DIR to a directory "
                            "of your own)", root, why)
            return None
        return root

    @staticmethod
    def _paths(root: Path, key: str) -> tuple[Path, Path]:
        d = root / key[:2]
        return d / f"{key}.o", d / f"{key}.json"

    def _load(self, root: Path, key: str) -> KernelBinary | None:
        """The entry for ``key``, or None (absent, or rejected with a warning). Never writes."""
        obj_path, meta_path = self._paths(root, key)
        if not meta_path.exists():
            return None
        try:
            if not _trusted_stat(os.stat(meta_path.parent)):
                raise ValueError(f"{meta_path.parent} may be written by others or is not this user's")
            meta = json.loads(_read_trusted(meta_path))
            binary = _binary_from_meta(meta, key, _read_trusted(obj_path))
        except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            self.stats.rejected += 1
            logger.warning("jax_cute cache: ignoring entry %s (%s); rebuilding", key[:16], e)
            return None
        return binary

    def _store(self, root: Path, key: str, fields: dict, binary: KernelBinary) -> None:
        obj_path, meta_path = self._paths(root, key)
        meta = {"key": key, "format": FORMAT, "name": binary.name, "symbol": binary.symbol,
                "arch": binary.arch, "signature": abi.signature_to_json(binary.signature),
                "sha256": binary.digest, "created": time.time(), "inputs": key_inputs(fields)}
        try:
            _private_dirs(obj_path.parent)
            atomic_write(obj_path, binary.obj)
            atomic_write(meta_path, json.dumps(meta, sort_keys=True).encode())  # last: marks it whole
        except OSError as e:
            logger.warning("jax_cute cache: could not write %s (%s)", obj_path, e)

    @contextlib.contextmanager
    def _build_lock(self, root: Path, key: str) -> Iterator[None]:
        """Hold ``<key>.lock`` (an fcntl lock) while building, so that processes missing the
        same key at once compile it once; without one (a read-only cache), build anyway."""
        lock_path = root / key[:2] / f"{key}.lock"
        try:
            _private_dirs(lock_path.parent)
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError:
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    # -- lookup -------------------------------------------------------------------------------
    def get(self, fields: dict, build: Callable[[], KernelBinary], *, disk: bool = True) -> KernelBinary:
        """The binary for ``fields``: from memory, else disk, else ``build()`` (once per key,
        however many threads, or processes sharing the cache directory, ask at the same time).
        ``disk=False`` keeps it in memory only (what cannot be keyed on its code)."""
        key = make_key(fields)
        hit = self._memory.get(key)
        if hit is not None:
            self.stats.memory_hits += 1
            return hit
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            hit = self._memory.get(key)
            if hit is not None:
                self.stats.memory_hits += 1
                return hit
            binary = self._from_disk_or_build(key, fields, build, disk)
            self._memory[key] = binary
            return binary

    def _from_disk_or_build(self, key: str, fields: dict, build: Callable[[], KernelBinary],
                            disk: bool) -> KernelBinary:
        root = self._disk_root() if disk else None
        binary = self._load(root, key) if root else None
        if binary is None and root is not None and not self._paths(root, key)[1].exists():
            # A miss: take the entry's lock (a hit never does, and never writes), then look again,
            # since another process may have built it meanwhile.
            with self._build_lock(root, key):
                binary = self._load(root, key)
                if binary is None:
                    return self._build(build, root, key, fields)
        elif binary is None:
            return self._build(build, root, key, fields)
        self.stats.disk_hits += 1
        return binary

    def _build(self, build: Callable[[], KernelBinary], root: Path | None, key: str, fields: dict) -> KernelBinary:
        binary = build()
        self.stats.compiles += 1
        if root is not None:
            self._store(root, key, fields, binary)
        return binary

    def clear_memory(self) -> None:
        with self._guard:
            self._memory.clear()

    def _our_files(self) -> Iterator[tuple[Path, re.Match]]:
        """Every file under the directory named as this cache names its files."""
        root = self.directory()
        if not root.is_dir():
            return
        for sub in sorted(root.iterdir()):
            if not (_SUBDIR.fullmatch(sub.name) and sub.is_dir() and not sub.is_symlink()):
                continue
            for path in sorted(sub.iterdir()):
                m = _ENTRY_FILE.fullmatch(path.name)
                if m and m["key"].startswith(sub.name) and not path.is_dir():
                    yield path, m

    def entries(self) -> Iterator[dict]:
        """One row per entry on disk (for ``python -m jax_cute cache list``): key, name, arch,
        bytes, created; an entry that cannot be read has ``problem`` instead of name and arch."""
        for meta_path, m in self._our_files():
            if not meta_path.name.endswith(".json"):
                continue
            obj = meta_path.with_suffix(".o")
            row = {"key": m["key"], "bytes": obj.stat().st_size if obj.exists() else 0}
            try:
                meta = json.loads(meta_path.read_bytes())
                if not isinstance(meta, dict):
                    raise ValueError(f"metadata is a JSON {type(meta).__name__}")
                row.update(name=str(meta.get("name", "?")), arch=str(meta.get("arch", "?")))
                created = meta.get("created")
                row["created"] = created if isinstance(created, (int, float)) else None
            except (OSError, ValueError) as e:
                row["problem"] = str(e)
            yield row

    def clear_disk(self) -> int:
        """Delete this cache's entries (files it named, nothing else); the number of entries."""
        n = 0
        subdirs = set()
        for path, _ in list(self._our_files()):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                n += path.name.endswith(".json")
            subdirs.add(path.parent)
        for sub in subdirs:
            with contextlib.suppress(OSError):
                sub.rmdir()  # only if now empty
        return n


def _private_dirs(path: Path) -> None:
    """Create ``path`` and its missing parents, each readable and writable by this user only."""
    missing = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for p in reversed(missing):
        with contextlib.suppress(FileExistsError):  # (another process made it meanwhile)
            p.mkdir(mode=0o700)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all (a temporary file renamed over it)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


CACHE = KernelCache()


def family_binary(fam, arch: str, spec, cfg) -> KernelBinary:
    """The compiled kernel of a family module for (spec, config, arch), through the cache."""
    fields = {"family": fam.FAMILY, "arch": arch, "spec": spec.key(), "config": cfg.key()}
    name = f"{fam.FAMILY}.{spec.key()}.{cfg.key()}"
    return CACHE.get(fields, lambda: compile_launcher(fam.launcher(spec, cfg), fam.signature(spec, cfg),
                                                      arch=arch, name=name, finish=object_pass(fam, spec, cfg)))


def object_pass(fam, spec, cfg) -> Callable[[bytes], bytes] | None:
    """The family's pass over its compiled object for (spec, config) (its ``finish_object``),
    or None: families without one, and specs it leaves alone, keep the DSL's object."""
    finish = getattr(fam, "finish_object", None)
    return finish(spec, cfg) if finish is not None else None
