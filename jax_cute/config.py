"""User-facing switches, each readable from the environment and settable from Python.

| switch                | environment variable              | meaning                                        |
|-----------------------|-----------------------------------|------------------------------------------------|
| target_arch           | JAX_CUTE_TARGET_ARCH (e.g. sm_90a)| lower for this arch instead of the device's    |
| strict                | JAX_CUTE_STRICT=1                 | a fallback to XLA raises instead of logging    |
| nan_fill              | JAX_CUTE_NAN_FILL=1               | fill our outputs with NaN before each launch   |
| unverified_kernels    | JAX_CUTE_UNVERIFIED_KERNELS=1     | allow kernels never run on hardware (sm_100a)  |
| cache_dir             | JAX_CUTE_CACHE_DIR                | where compiled kernels are kept on disk        |
| disk_cache            | JAX_CUTE_DISK_CACHE=0             | turn the disk cache off                        |
| autotune              | JAX_CUTE_AUTOTUNE=1               | time candidate configs on the GPU, keep best   |
| command_buffer        | JAX_CUTE_COMMAND_BUFFER=0         | launch on XLA's stream, outside CUDA graphs,   |
|                       |                                   | with programmatic dependent launch (Hopper)    |
| collective_matmul     | JAX_CUTE_COLLECTIVE_MATMUL=1      | tensor-parallel products overlap their all-    |
|                       | (or unidirectional)               | gather / reduce-scatter in a ring of GEMMs     |
|                       |                                   | (docs/sharding.md); off by default             |
| ring_sms              | JAX_CUTE_RING_SMS (default 16)    | SMs a ring's GEMMs leave free for its NCCL     |
|                       |                                   | transfers (Hopper kernels; 0: use them all)    |
| float32_partial_sums  | JAX_CUTE_FLOAT32_PARTIAL_SUMS=1   | a K-sharded 16-bit product sums its per-device |
|                       |                                   | partial products in float32 and rounds once,   |
|                       |                                   | as one device does (twice the bytes), and a    |
|                       |                                   | shard of an unsplit contraction splits K as    |
|                       |                                   | one device's GEMM; off by default: sums in the |
|                       |                                   | output dtype, as XLA does                      |

Python settings win over the environment; ``None`` means "ask the environment". Values are
checked when set from Python, and every switch in the environment is checked whenever any is
read and when a jax_cute function is traced (:func:`validate`), on every platform: a typo is an
error, never a silently ignored switch. ``~`` in ``JAX_CUTE_CACHE_DIR`` is the home directory.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

from jax_cute.arch import KNOWN_ARCHES

_overrides: dict[str, object] = {}

_ENV = {
    "target_arch": "JAX_CUTE_TARGET_ARCH",
    "strict": "JAX_CUTE_STRICT",
    "nan_fill": "JAX_CUTE_NAN_FILL",
    "unverified_kernels": "JAX_CUTE_UNVERIFIED_KERNELS",
    "cache_dir": "JAX_CUTE_CACHE_DIR",
    "disk_cache": "JAX_CUTE_DISK_CACHE",
    "autotune": "JAX_CUTE_AUTOTUNE",
    "command_buffer": "JAX_CUTE_COMMAND_BUFFER",
    "collective_matmul": "JAX_CUTE_COLLECTIVE_MATMUL",
    "ring_sms": "JAX_CUTE_RING_SMS",
    "float32_partial_sums": "JAX_CUTE_FLOAT32_PARTIAL_SUMS",
}
_BOOL_DEFAULTS = {"strict": False, "nan_fill": False, "unverified_kernels": False, "disk_cache": True,
                  "autotune": False, "command_buffer": True, "float32_partial_sums": False}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _parse_bool(name: str, value: object, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    text = str(value).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ValueError(f"jax_cute.config: {where} must be a boolean (1/0, true/false, yes/no, on/off), "
                     f"got {value!r}")


def _check_arch(value: object, where: str) -> str:
    if value not in KNOWN_ARCHES:
        raise ValueError(f"jax_cute.config: {where}={value!r} has no jax_cute kernels "
                         f"(known: {', '.join(KNOWN_ARCHES)})")
    return str(value)


_checked_environment: tuple | None = None


def validate() -> None:
    """Check every switch set in the environment; ValueError naming the first bad one. Cheap
    when the environment has not changed since the last check."""
    global _checked_environment
    seen = tuple(os.environ.get(var) for var in _ENV.values())
    if seen == _checked_environment:
        return
    for name, var in _ENV.items():
        raw = os.environ.get(var)
        if not raw:
            continue
        if name == "target_arch":
            _check_arch(raw, var)
        elif name == "ring_sms":
            _check_count(raw, var)
        elif name in _BOOL_DEFAULTS:
            _parse_bool(name, raw, var)
    _checked_environment = seen


def _flag(name: str) -> bool:
    validate()
    if _overrides.get(name) is not None:
        return bool(_overrides[name])
    raw = os.environ.get(_ENV[name])
    if raw is None or raw == "":
        return _BOOL_DEFAULTS[name]
    return _parse_bool(name, raw, _ENV[name])


def target_arch() -> str | None:
    """The explicitly requested arch (``sm_90a`` or ``sm_100a``), or None to use the device's."""
    validate()
    if _overrides.get("target_arch"):
        return str(_overrides["target_arch"])
    raw = os.environ.get(_ENV["target_arch"])
    return _check_arch(raw, _ENV["target_arch"]) if raw else None


def strict() -> bool:
    return _flag("strict")


def nan_fill() -> bool:
    return _flag("nan_fill")


def unverified_kernels() -> bool:
    return _flag("unverified_kernels")


def autotune() -> bool:
    return _flag("autotune")


def command_buffer() -> bool:
    """Whether XLA may record our custom calls into its command buffers (CUDA graphs).

    Off, each call is launched on XLA's stream on every run: no re-capture when buffer
    addresses change, and dense Hopper GEMMs launch with programmatic dependent launch, so a
    kernel's start overlaps the previous kernel's tail. Read when a call is lowered.
    """
    return _flag("command_buffer")


def float32_partial_sums() -> bool:
    """Whether a product whose contraction is sharded (a data-parallel weight gradient, a
    row-parallel product) with a 16-bit result sums the devices' partial products in float32
    and rounds the sum once, as the unsharded GEMM rounds its float32 accumulator: the sharded
    result then differs from one device's only by the order of float32 additions. Off (the
    default, as XLA partitions its own 16-bit products), each device rounds its partial product
    and the sum runs in the 16-bit dtype: half the bytes, which on 4 H100s kept the data-parallel
    GPT step at 0.914 of one GPU's tokens/s per GPU, against 0.890 with float32 sums.
    On, a shard of a partitioned product whose contraction is whole (a batch-, M- or N-sharded
    product) also splits K as the unsharded GEMM would (the kernel heuristic would pick its
    split by the shard's smaller M and batch), so each of its elements is the same float32 sum
    in the same order as on one device. Read when a call is lowered."""
    return _flag("float32_partial_sums")


def disk_cache() -> bool:
    return _flag("disk_cache")


def cache_dir() -> Path:
    """Where kernels are cached: the switch (``~`` expanded), else this user's cache directory
    (``$XDG_CACHE_HOME/jax_cute``, default ``~/.cache/jax_cute``)."""
    validate()
    value = _overrides.get("cache_dir") or os.environ.get(_ENV["cache_dir"])
    if value:
        return Path(os.path.expanduser(str(value)))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(os.path.expanduser(base)) / "jax_cute"


# collective_matmul: off, or the ring's direction ("1"/true means bidirectional).
RINGS = ("bidirectional", "unidirectional")


def _check_ring(value: object, where: str) -> str | None:
    if isinstance(value, str) and value.strip().lower() in RINGS:
        return value.strip().lower()
    try:
        return RINGS[0] if _parse_bool("collective_matmul", value, where) else None
    except ValueError:
        raise ValueError(f"jax_cute.config: {where} must be a boolean or one of {', '.join(RINGS)}, "
                         f"got {value!r}") from None


def collective_matmul() -> str | None:
    """The ring tensor-parallel products run in (``primitives/collective.py``): "bidirectional",
    "unidirectional", or None (off: XLA's all-gather / reduce-scatter around one local GEMM).
    Read when a call is lowered."""
    if _overrides.get("collective_matmul") is not None:
        return _overrides["collective_matmul"] or None  # type: ignore[return-value]
    raw = os.environ.get(_ENV["collective_matmul"])
    return _check_ring(raw, _ENV["collective_matmul"]) if raw else None


# ring_sms: a ring's GEMMs run on the device's SMs less these, so NCCL's send/receive kernels
# (one CTA per channel) find SMs free while a chunk's GEMM runs instead of waiting for its
# persistent grid to end (docs/sharding.md)
RING_SMS_DEFAULT = 16


def _check_count(value: object, where: str) -> int:
    text = str(value).strip()
    if isinstance(value, bool) or not text.isdigit():
        raise ValueError(f"jax_cute.config: {where} must be a whole number of SMs (0 or more), got {value!r}")
    return int(text)


def ring_sms() -> int:
    """SMs the GEMMs of a collective-matmul ring leave free while its transfers are in flight
    (dispatch: ``GemmRequest.free_sms``). Read when a call is lowered."""
    validate()
    if _overrides.get("ring_sms") is not None:
        return int(_overrides["ring_sms"])  # type: ignore[arg-type]
    raw = os.environ.get(_ENV["ring_sms"])
    return _check_count(raw, _ENV["ring_sms"]) if raw else RING_SMS_DEFAULT


def _validated(name: str, value: object) -> object:
    if name not in _ENV:
        raise ValueError(f"jax_cute.config: unknown switch {name!r}; known: {', '.join(sorted(_ENV))}")
    if value is None:
        return None
    if name == "target_arch":
        return _check_arch(value, "target_arch")
    if name == "cache_dir":
        if not isinstance(value, (str, os.PathLike)) or not str(value):
            raise ValueError(f"jax_cute.config: cache_dir must be a path, got {value!r}")
        return str(value)
    if name == "collective_matmul":
        return _check_ring(value, name) or ""  # "": off from Python (None hands it to the environment)
    if name == "ring_sms":
        return _check_count(value, name)
    return _parse_bool(name, value, name)


def set(**values: object) -> None:  # noqa: A001 - mirrors jax.config.update in spirit
    """Set switches from Python, e.g. ``jax_cute.config.set(target_arch="sm_90a", strict=True)``;
    ``None`` hands a switch back to the environment."""
    checked = {name: _validated(name, value) for name, value in values.items()}
    _overrides.update(checked)


@contextlib.contextmanager
def override(**values: object) -> Iterator[None]:
    """Temporarily set switches (tests, or a block lowered for another arch)."""
    saved = {k: _overrides.get(k) for k in values}
    set(**values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                _overrides.pop(k, None)
            else:
                _overrides[k] = v
