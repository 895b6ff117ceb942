"""jax_cute: CuTe DSL GEMM kernels for JAX that compose with jit, vmap, grad and export.

Public API:
- :func:`matmul` — ``jnp.matmul`` semantics with ``transpose_a``/``transpose_b``;
- :func:`ragged_dot` — a drop-in for ``jax.lax.ragged_dot`` (grouped GEMM for MoE);
- :func:`cute_call` — run your own ``@cute.jit`` launcher inside ``jax.jit``;
- :mod:`config` — switches (target arch, strict mode, NaN fill, cache, unverified kernels);
- :mod:`layout` — the CuTe-style layouts the primitives carry.
"""

__version__ = "0.1.0"

from jax_cute import config, layout  # noqa: E402
from jax_cute.primitives.cute_call import cute_call  # noqa: E402
from jax_cute.primitives.matmul import matmul  # noqa: E402
from jax_cute.primitives.ragged_dot import ragged_dot  # noqa: E402
from jax_cute.routing import FallbackError  # noqa: E402
from jax_cute.runtime import ensure_registered as register_ffi  # noqa: E402

try:  # Register our FFI target now, so deserialised (jax.export) modules that use it can run.
    register_ffi()
except (ImportError, RuntimeError) as _e:  # not built / no DSL runtime: lowering will say so
    import logging as _logging

    _logging.getLogger("jax_cute").debug("jax_cute: FFI target not registered at import: %s", _e)


def export_disabled_checks() -> list:
    """The safety checks ``jax.export`` must skip for functions that use jax_cute.

    Our custom call has no cross-version compatibility guarantee from JAX (it is ours, not
    XLA's); the exported module embeds each kernel's object, so it runs wherever the same
    jax_cute FFI handler is installed.
    """
    from jax import export

    from jax_cute.runtime import TARGET_NAME

    return [export.DisabledSafetyCheck.custom_call(TARGET_NAME)]

__all__ = ["matmul", "ragged_dot", "cute_call", "config", "layout", "FallbackError", "export_disabled_checks", "register_ffi", "__version__"]
