"""Elementwise GEMM epilogues in the DSL: activations of float32 accumulator fragments.

Kernel families that fuse an epilogue (``EPILOGUES``; see ``gemm_spec.GemmSpec.bias`` and
``activation``) apply these to each register fragment after adding the bias and before the one
rounding to the output dtype. They match ``jax.nn``: ``gelu`` is the tanh form
(``approximate=True``), ``gelu_exact`` uses erf. ``fast`` (16-bit outputs) lets ``tanh``
and ``erf`` use their fast forms (MUFU ``tanh`` has ~2^-11 relative error, below a 16-bit output's
rounding; silu then takes the tanh form of the sigmoid); float32 outputs take the accurate forms.

The DSL is imported inside the functions: they run while a kernel is traced, and routing code
that only reads ``ACTIVATIONS`` must not need the compiler.
"""

from __future__ import annotations

import math

ACTIVATIONS = ("relu", "gelu", "gelu_exact", "silu")
# gated activations: the product's N holds [gate | up] halves and the output has N/2 columns
GATED = ("swiglu",)

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_SQRT_HALF = math.sqrt(0.5)


def activation(name: str, x, fast: bool):
    """``name`` applied to ``x``, a float32 TensorSSA (one thread's fragment)."""
    from jax_cute.kernels.dsl import cute

    if name == "relu":
        return cute.math.max(x, cute.full_like(x, 0.0), propagate_nan=True)
    if name == "gelu":
        inner = x * (_SQRT_2_OVER_PI + (_SQRT_2_OVER_PI * 0.044715) * (x * x))
        t = cute.math.tanh(inner, fastmath=fast)
        return (0.5 * x) * (1.0 + t)
    if name == "gelu_exact":
        return (0.5 * x) * (1.0 + cute.math.erf(x * _SQRT_HALF, fastmath=fast))
    if name == "silu":
        if fast:
            # x * sigmoid(x) = x/2 * (1 + tanh(x/2)): one MUFU op (exp and a division left a
            # stack frame beside the 128x256 tile's accumulators)
            return (0.5 * x) * (1.0 + cute.math.tanh(0.5 * x, fastmath=True))
        # the approximate division (2 ulp): the IEEE one's slow path is a call needing a stack frame
        return cute.math.div(x, 1.0 + cute.math.exp(-x), fastmath=True)
    raise ValueError(f"no kernel epilogue for activation {name!r} (kernels fuse {', '.join(ACTIVATIONS)})")


def gated(name: str, gate, up, fast: bool):
    """``name`` (a GATED activation) of paired ``gate`` and ``up`` fragments: swiglu is
    ``silu(gate) * up``."""
    if name == "swiglu":
        return activation("silu", gate, fast) * up
    raise ValueError(f"no kernel epilogue for gated activation {name!r} (kernels fuse {', '.join(GATED)})")
