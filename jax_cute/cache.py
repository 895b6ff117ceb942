"""One compile cache for every jax_cute kernel: in memory, and on disk across processes.

Keys are content keys: a sha256 over the kernel family and its version, configuration, dtypes,
the static part of the layouts, the target arch, and the DSL and jax_cute versions. Never
object ids, generated names or the environment, so equal keys give the same object in any
process. Loading an entry needs neither the DSL's compiler nor a trace of the kernel.

On disk an entry is ``<dir>/<key[:2]>/<key>.o`` (the object) and ``<key>.json`` (its metadata,
checksum and versions), each written atomically (temporary file + rename). A corrupt entry, or
one written by another DSL or jax_cute version, is logged, ignored and rebuilt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from jax_cute import config
from jax_cute.kernels import abi
from jax_cute.kernels.build import KernelBinary, compile_launcher
from jax_cute.version import __version__

logger = logging.getLogger("jax_cute")

FORMAT = 1


DSL_DISTRIBUTION = "nvidia-cutlass-dsl-libs-base"  # the DSL's compiler and Python files


def dsl_version() -> str:
    try:
        return importlib.metadata.version(DSL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def jax_cute_version() -> str:
    return __version__


def make_key(fields: dict) -> str:
    """The content key of a kernel described by ``fields`` (JSON-serialisable, stable)."""
    full = dict(fields, dsl=dsl_version(), jax_cute=jax_cute_version(), format=FORMAT)
    return hashlib.sha256(json.dumps(full, sort_keys=True).encode()).hexdigest()


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
        self.stats = Stats()

    # -- disk ---------------------------------------------------------------------------------
    @staticmethod
    def directory() -> Path:
        return config.cache_dir()

    def _paths(self, key: str) -> tuple[Path, Path]:
        d = self.directory() / key[:2]
        return d / f"{key}.o", d / f"{key}.json"

    def _load(self, key: str) -> KernelBinary | None:
        obj_path, meta_path = self._paths(key)
        if not meta_path.exists():
            return None
        try:
            meta = json.loads(meta_path.read_text())
            obj = obj_path.read_bytes()
            if meta.get("dsl") != dsl_version() or meta.get("jax_cute") != jax_cute_version():
                raise ValueError(f"written by DSL {meta.get('dsl')} / jax_cute {meta.get('jax_cute')}, "
                                 f"running DSL {dsl_version()} / jax_cute {jax_cute_version()}")
            if hashlib.sha256(obj).hexdigest() != meta["sha256"]:
                raise ValueError("object checksum mismatch")
            binary = KernelBinary(name=meta["name"], symbol=meta["symbol"], arch=meta["arch"],
                                  signature=abi.signature_from_json(meta["signature"]), obj=obj)
        except (OSError, ValueError, KeyError, TypeError) as e:
            self.stats.rejected += 1
            logger.warning("jax_cute cache: ignoring entry %s (%s); rebuilding", key[:16], e)
            return None
        meta["hits"] = int(meta.get("hits", 0)) + 1
        meta["last_used"] = time.time()
        _atomic_write(meta_path, json.dumps(meta, sort_keys=True).encode())
        return binary

    def _store(self, key: str, fields: dict, binary: KernelBinary) -> None:
        obj_path, meta_path = self._paths(key)
        meta = {"fields": fields, "name": binary.name, "symbol": binary.symbol, "arch": binary.arch,
                "signature": abi.signature_to_json(binary.signature), "sha256": binary.digest,
                "dsl": dsl_version(), "jax_cute": jax_cute_version(), "created": time.time(), "hits": 0}
        try:
            obj_path.parent.mkdir(parents=True, exist_ok=True)
            _atomic_write(obj_path, binary.obj)
            _atomic_write(meta_path, json.dumps(meta, sort_keys=True).encode())  # last: marks it whole
        except OSError as e:
            logger.warning("jax_cute cache: could not write %s (%s)", obj_path, e)

    # -- lookup -------------------------------------------------------------------------------
    def get(self, fields: dict, build: Callable[[], KernelBinary]) -> KernelBinary:
        """The binary for ``fields``: from memory, else disk, else ``build()`` (once per key,
        however many threads ask at the same time)."""
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
            binary = self._load(key) if config.disk_cache() else None
            if binary is not None:
                self.stats.disk_hits += 1
            else:
                binary = build()
                self.stats.compiles += 1
                if config.disk_cache():
                    self._store(key, fields, binary)
            self._memory[key] = binary
            return binary

    def clear_memory(self) -> None:
        with self._guard:
            self._memory.clear()

    def entries(self) -> Iterator[dict]:
        """Metadata of every entry on disk (for ``python -m jax_cute cache list``)."""
        root = self.directory()
        if not root.exists():
            return
        for meta_path in sorted(root.glob("*/*.json")):
            try:
                meta = json.loads(meta_path.read_text())
            except (OSError, ValueError):
                continue
            obj = meta_path.with_suffix(".o")
            meta["key"] = meta_path.stem
            meta["bytes"] = obj.stat().st_size if obj.exists() else 0
            yield meta

    def clear_disk(self) -> int:
        n = 0
        root = self.directory()
        if root.exists():
            for p in root.glob("*/*"):
                if p.suffix in (".o", ".json"):
                    p.unlink(missing_ok=True)
                    n += p.suffix == ".json"
        return n


def _atomic_write(path: Path, data: bytes) -> None:
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
    fields = {"family": fam.FAMILY, "version": fam.VERSION, "arch": arch, "spec": spec.key(), "config": cfg.key()}
    name = f"{fam.FAMILY}.{spec.key()}.{cfg.key()}"
    return CACHE.get(fields, lambda: compile_launcher(fam.launcher(spec, cfg), fam.signature(spec, cfg),
                                                      arch=arch, name=name))
