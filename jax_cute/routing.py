"""Which kernel (or the XLA fallback) a call lowers to: decided at lowering time, here only.

1. The target arch is ``config.target_arch()`` (``JAX_CUTE_TARGET_ARCH``) when set, else the
   compute capability of the CUDA device JAX lowers for. Lowering for CUDA on a machine with no
   GPU therefore needs the explicit arch.
2. A family module (see docs/kernel-contract.md) is picked by arch; its ``unsupported(spec)``
   may refuse the dtype/layout, and the primitive may refuse the shapes (alignment, rank).
3. A refused case lowers to the primitive's reference path and logs why; in strict mode
   (``JAX_CUTE_STRICT=1``) it raises :class:`FallbackError` instead.

What only the device knows (its real arch, pointer alignment) is checked by the FFI handler.
"""

from __future__ import annotations

import logging

from jax_cute import config

logger = logging.getLogger("jax_cute")

# compute capability -> the DSL target our kernels are compiled for. sm_90a/sm_100a code runs
# only on exactly that capability ("a" targets are not forward compatible): 10.3 (B300) needs
# its own target and 12.x (consumer Blackwell) has no tcgen05, so neither is listed.
_ARCH_BY_CAPABILITY = {(9, 0): "sm_90a", (10, 0): "sm_100a"}
KNOWN_ARCHES = ("sm_90a", "sm_100a")
# Kernels that have never run on real hardware: opt-in only (config.unverified_kernels()).
UNVERIFIED_ARCHES = frozenset({"sm_100a"})


class FallbackError(RuntimeError):
    """Strict mode: a call would have fallen back to XLA."""


def arch_for_capability(major: int, minor: int) -> str | None:
    return _ARCH_BY_CAPABILITY.get((major, minor))


def capability_of(arch: str) -> tuple[int, int]:
    """``sm_90a`` -> (9, 0); ``sm_100a`` -> (10, 0)."""
    digits = arch.removeprefix("sm_").rstrip("af")
    return int(digits[:-1]), int(digits[-1])


def device_capability() -> tuple[int, int] | None:
    """Compute capability of the first CUDA device JAX sees, or None without one."""
    import jax

    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return None
    if not devices:
        return None
    cc = getattr(devices[0], "compute_capability", None)
    if not cc:
        return None
    major, minor = (int(x) for x in str(cc).split("."))
    return major, minor


def target_arch() -> tuple[str | None, str]:
    """(arch, how it was chosen); arch None when there is nothing to compile for."""
    explicit = config.target_arch()
    if explicit:
        if explicit not in KNOWN_ARCHES:
            return None, f"JAX_CUTE_TARGET_ARCH={explicit} has no jax_cute kernels (known: {', '.join(KNOWN_ARCHES)})"
        return explicit, "explicit"
    cc = device_capability()
    if cc is None:
        return None, "no CUDA device is visible; set JAX_CUTE_TARGET_ARCH (e.g. sm_90a) to lower for one"
    arch = arch_for_capability(*cc)
    if arch is None:
        return None, f"compute capability {cc[0]}.{cc[1]} has no jax_cute kernels"
    return arch, f"device compute capability {cc[0]}.{cc[1]}"


def arch_allowed(arch: str) -> str | None:
    """None, or why kernels for ``arch`` may not be used."""
    if arch in UNVERIFIED_ARCHES and not config.unverified_kernels():
        return (f"{arch} kernels are compile-verified only (never run on hardware); "
                "set JAX_CUTE_UNVERIFIED_KERNELS=1 to use them")
    return None


def fallback(op: str, reason: str) -> None:
    """Record that ``op`` lowers to XLA, or raise in strict mode."""
    message = f"jax_cute.{op}: falling back to XLA: {reason}"
    if config.strict():
        raise FallbackError(message + " (JAX_CUTE_STRICT is set)")
    logger.warning(message)

