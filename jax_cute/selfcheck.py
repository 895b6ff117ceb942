"""First-use self-checks of kernels that have never run on real hardware (opt-in arches).

A kernel of an arch in ``routing.UNVERIFIED_ARCHES`` is trusted only after it reproduced the
reference on a small random problem on the device it will run on. The verdict is kept per
binary for the process; a failed check sends that kernel's calls to the XLA fallback.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import numpy as np

from jax_cute import routing

logger = logging.getLogger("jax_cute")

_verdicts: dict[str, bool] = {}
_lock = threading.Lock()


def trusted(binary, check: Callable[[], float], tolerance: float = 2e-2) -> bool:
    """Whether ``binary`` may be used: runs ``check`` (returns a relative error) once."""
    if binary.arch not in routing.UNVERIFIED_ARCHES:
        return True
    with _lock:
        if binary.digest in _verdicts:
            return _verdicts[binary.digest]
        cc = routing.device_capability()
        if cc is None or routing.arch_for_capability(*cc) != binary.arch:
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


def gemm_check(binary, flat, workspaces, dtypes) -> Callable[[], float]:
    """A check for a dense GEMM binary: the same majors and dtypes on a small problem."""
    import jax
    import jax.numpy as jnp

    from jax_cute.launch import kernel_call, workspace_outputs

    m, n, k = 200, 136, 264

    def operand(rows: int, cols: int, rows_contiguous: bool, dtype, seed: int):
        """(logical values as the kernel sees them, physical buffer, stride) of a matrix."""
        x = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
        buf = jnp.asarray(x.T if rows_contiguous else x, dtype)
        stride = (1, rows, rows * cols) if rows_contiguous else (cols, 1, rows * cols)
        logical = np.asarray(buf, np.float32)
        return (logical.T if rows_contiguous else logical), buf, stride

    def run() -> float:
        a, a_buf, a_stride = operand(m, k, flat.a.major == "m", dtypes[0], 1)
        b, b_buf, b_stride = operand(n, k, flat.b.major == "n", dtypes[1], 2)
        c_cols = flat.c.major == "m"  # C stored (N, M)
        c_stride = (1, m, m * n) if c_cols else (n, 1, m * n)
        outputs = {"c": (jax.ShapeDtypeStruct((n, m) if c_cols else (m, n), dtypes[2]), (m, n, 1), c_stride)}
        outputs.update(workspace_outputs(binary, workspaces))
        zeroed = [w.name for w in workspaces if w.zeroed]
        f = jax.jit(lambda x, y: kernel_call(binary, {"a": (x, (m, k, 1), a_stride), "b": (y, (n, k, 1), b_stride)},
                                             outputs, zeroed=zeroed)["c"])
        c = np.asarray(f(a_buf, b_buf), np.float32)
        c = c.T if c_cols else c
        want = a @ b.T
        return float(np.abs(c - want).max() / max(np.abs(want).max(), 1e-30))

    return run
