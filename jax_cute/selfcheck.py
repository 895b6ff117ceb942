"""First-use self-checks of kernels that have never run on real hardware (opt-in arches and
variants).

A kernel of an arch in ``arch.UNVERIFIED_ARCHES``, or a variant in ``arch.UNVERIFIED_VARIANTS``
of its arch, is trusted only after it reproduced the
reference on a small random problem on the device it will run on. The verdict is kept per
binary for the process; a failed check sends that kernel's calls to the XLA fallback.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_cute import arch

logger = logging.getLogger("jax_cute")

_verdicts: dict[str, bool] = {}
_lock = threading.Lock()


def trusted(binary, check: Callable[[], float], tolerance: float = 2e-2, variant: str = "") -> bool:
    """Whether ``binary`` (of kernel ``variant``, its family's name for it) may be used: runs
    ``check`` (returns a relative error) once for an unverified one."""
    if not arch.unverified(binary.arch, variant):
        return True
    with _lock:
        if binary.digest in _verdicts:
            return _verdicts[binary.digest]
        if arch.device_arch() != binary.arch:
            # Lowered for another machine (export, precompile): nothing here can run it.
            logger.warning("jax_cute: %s is unverified and no %s device is here to check it; "
                           "it will run unchecked", binary.name, binary.arch)
            return True
        try:
            err = float(check())
            ok = bool(np.isfinite(err) and err <= tolerance)
            why = f"relative error {err:.3g}"
        except Exception as e:  # noqa: BLE001 - any failure means: do not trust it
            ok, why = False, f"{type(e).__name__}: {e}"
        if ok:
            logger.info("jax_cute: %s passed its first-use check (%s)", binary.name, why)
        else:
            logger.warning("jax_cute: %s failed its first-use check (%s); using XLA instead", binary.name, why)
        _verdicts[binary.digest] = ok
        return ok


def compare(impl: Callable, reference: Callable, avals, make_int: Callable | None = None) -> Callable[[], float]:
    """A check running ``impl`` (our kernel) and ``reference`` (plain lax) on the call's own
    shapes with fresh random data; integer inputs (group sizes) come from ``make_int``."""
    def run() -> float:
        rng = np.random.default_rng(0)
        xs = []
        for av in avals:
            if jnp.issubdtype(av.dtype, jnp.integer):
                xs.append(jnp.asarray(make_int(rng, av.shape), av.dtype))
            else:
                xs.append(jnp.asarray(rng.standard_normal(av.shape, dtype=np.float32)).astype(av.dtype))
        got = np.asarray(jax.jit(impl)(*xs), np.float32)
        want = np.asarray(jax.jit(reference)(*xs), np.float32)
        return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))

    return run
