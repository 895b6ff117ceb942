"""jax_cute: CuTe DSL GEMM kernels for JAX that compose with jit, vmap, grad and export.

Public API:
- :func:`matmul` — ``jnp.matmul`` semantics with ``transpose_a``/``transpose_b``;
- :func:`dot_general`, :func:`einsum` — ``lax.dot_general`` and ``jnp.einsum`` (each product of two operands one GEMM);
- :func:`ragged_dot` — ``jax.lax.ragged_dot`` semantics (grouped GEMM for MoE);
- :func:`cute_call` — run your own ``@cute.jit`` launcher inside ``jax.jit``;
- :func:`quantize`, :class:`BlockScaled`, :mod:`fp8` — block-scaled fp8 operands and training (docs/fp8.md);
- :mod:`config` — switches (target arch, strict mode, NaN fill, cache, unverified kernels);
- :mod:`layout` — the CuTe-style layouts the primitives carry.
"""

import logging

from jax import export

from jax_cute import config, fp8, layout
from jax_cute.dispatch import FallbackError
from jax_cute.fp8 import BlockScaled, dequantize, quantize
from jax_cute.kernelize import kernelize
from jax_cute.primitives.cute_call import cute_call
from jax_cute.primitives.dot_general import dot_general, einsum
from jax_cute.primitives.matmul import matmul
from jax_cute.primitives.ragged_dot import ragged_dot
from jax_cute.runtime import TARGET_NAME, STREAM_TARGET_NAME
from jax_cute.runtime import ensure_registered as register_ffi
from jax_cute.version import __version__

try:  # Register our FFI targets now, so deserialised (jax.export) modules that use them can run.
    register_ffi()
except (ImportError, RuntimeError) as _e:  # not built / no DSL runtime: lowering will say so
    logging.getLogger("jax_cute").debug("jax_cute: FFI target not registered at import: %s", _e)


def export_disabled_checks() -> list:
    """The safety checks ``jax.export`` must skip for functions that use jax_cute.

    Our custom calls have no cross-version compatibility guarantee from JAX (they are ours, not
    XLA's); the exported module embeds each kernel's object, so it runs wherever the same
    jax_cute FFI handler is installed.
    """
    return [export.DisabledSafetyCheck.custom_call(name) for name in (TARGET_NAME, STREAM_TARGET_NAME)]


__all__ = ["matmul", "dot_general", "einsum", "ragged_dot", "kernelize", "cute_call", "config", "layout", "FallbackError", "export_disabled_checks",
           "register_ffi", "__version__", "fp8", "quantize", "dequantize", "BlockScaled"]
