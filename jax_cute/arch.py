"""GPU architectures: which compute capability runs which of our kernel targets.

``sm_90a`` / ``sm_100a`` code runs only on exactly that compute capability ("a" targets are not
forward compatible): 10.3 (B300) needs its own target and 12.x (consumer Blackwell) has no
tcgen05, so neither is listed.
"""

from __future__ import annotations

import jax

_ARCH_BY_CAPABILITY = {(9, 0): "sm_90a", (10, 0): "sm_100a"}
KNOWN_ARCHES = tuple(_ARCH_BY_CAPABILITY.values())
# Kernels that have never run on real hardware: opt-in only (config.unverified_kernels()).
UNVERIFIED_ARCHES = frozenset({"sm_100a"})
# Kernel variants never run on real hardware on an arch whose other kernels have, by arch (a
# family's ``unverified(spec)`` names a spec's variant): opt-in only as well, and checked on first
# use like an unverified arch's. A new variant is listed here until its GPU tests pass.
UNVERIFIED_VARIANTS: dict[str, frozenset[str]] = {}
# Multiprocessor count of each target's usual part (H100/H200 SXM, B200), used when lowering for
# a target that is not the visible device.
DEFAULT_SMS = {"sm_90a": 132, "sm_100a": 148}


def unverified(arch: str, variant: str = "") -> bool:
    """Whether ``arch``'s kernels, or its kernel ``variant``, have never run on real hardware."""
    return arch in UNVERIFIED_ARCHES or bool(variant) and variant in UNVERIFIED_VARIANTS.get(arch, ())


def arch_for_capability(major: int, minor: int) -> str | None:
    return _ARCH_BY_CAPABILITY.get((major, minor))


def capability_of(arch: str) -> tuple[int, int]:
    """``sm_90a`` -> (9, 0); ``sm_100a`` -> (10, 0)."""
    digits = arch.removeprefix("sm_").rstrip("af")
    return int(digits[:-1]), int(digits[-1])


def _cuda_device():
    """The first CUDA device JAX sees, or None."""
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return None
    return devices[0] if devices else None


def device_capability() -> tuple[int, int] | None:
    """Compute capability of the first CUDA device JAX sees, or None without one."""
    cc = getattr(_cuda_device(), "compute_capability", None)
    if not cc:
        return None
    major, minor = (int(x) for x in str(cc).split("."))
    return major, minor


def device_arch() -> str | None:
    """Our target for the visible CUDA device, or None (no device, or one we have no kernels for)."""
    cc = device_capability()
    return arch_for_capability(*cc) if cc else None


def num_sms(arch: str) -> int:
    """SM count of the visible device when it is the target, else the arch's usual count."""
    count = getattr(_cuda_device(), "core_count", None) if device_arch() == arch else None
    if count:
        return int(count)
    return DEFAULT_SMS.get(arch, 132)
