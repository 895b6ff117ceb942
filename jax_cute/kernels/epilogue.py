"""Elementwise GEMM epilogues in the DSL: activations of float32 accumulator fragments.

Kernel families that fuse an epilogue (``EPILOGUES``; see ``gemm_spec.GemmSpec.bias`` and
``activation``) apply these to each register fragment after adding the bias and before the one
rounding to the output dtype. They match ``jax.nn``: ``gelu`` is the tanh form
(``approximate=True``), ``gelu_exact`` uses erf. ``fast`` (16-bit outputs) lets ``tanh``
and ``erf`` use their fast forms (MUFU ``tanh`` has ~2^-11 relative error, below a 16-bit output's
rounding; silu then takes the tanh form of the sigmoid); float32 outputs take the accurate forms.
``derivative``/``scaled_by_derivative`` are the activations' derivatives for a backward epilogue
(``GemmSpec.dact``), under the same conventions, matching what ``jax.grad`` of ``jax.nn`` computes.

The DSL is imported inside the functions: they run while a kernel is traced, and routing code
that only reads ``ACTIVATIONS`` must not need the compiler.
"""

from __future__ import annotations

import math

# the names to emit, from the registry: elementwise ones, and gated ones (the product's N holds
# [gate | up] halves and the output has N/2 columns)
from jax_cute.activations import KERNEL_ELEMENTWISE as ACTIVATIONS, KERNEL_GATED as GATED

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_SQRT_HALF = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


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


    if fast:
        return 0.5 * (1.0 + cute.math.tanh(0.5 * x, fastmath=True))   # one MUFU op (see activation)
    # the approximate division (see activation)
    return cute.math.div(cute.full_like(x, 1.0), 1.0 + cute.math.exp(-x), fastmath=True)


def derivative(name: str, z, fast: bool):
    """``name``'s derivative at ``z``, a float32 TensorSSA (one thread's fragment).

    gelu and silu are written with e = exp(-|.|) in (0, 1] and r = 1 / (1 + e) (MUFU ex2 and rcp,
    a few float32 ulps, no overflow): (1 + tanh(u)) / 2 = r or e r, sech^2(u) = 4 e r^2, sigmoid
    = r or e r, each without cancellation. MUFU tanh's 2^-11 error, through 1 + tanh and
    1 - tanh^2, was up to 2.5e-4 absolute in the tails, where the derivative is that small. (An
    accurate tanh or an IEEE division needs a stack frame beside a 128x256 tile's accumulators.)
    ``fast`` (16-bit outputs) takes the fast erf for gelu_exact, as ``activation`` does."""
    from jax_cute.kernels.dsl import cute

    if name == "relu":
        return cute.where(z > 0.0, cute.full_like(z, 1.0), cute.full_like(z, 0.0))
    if name == "gelu":
        # d/dz [z/2 (1 + tanh(u))] = (1 + tanh(u)) / 2 + z/2 sech^2(u) u', u = c (z + 0.044715 z^3);
        # (1 + tanh(u)) / 2 is r for u >= 0 and e r below (no cancellation in either tail)
        z2 = z * z
        u = z * (_SQRT_2_OVER_PI + (_SQRT_2_OVER_PI * 0.044715) * z2)
        e, r = _exp_ratio(2.0 * u)
        du = _SQRT_2_OVER_PI + (3.0 * _SQRT_2_OVER_PI * 0.044715) * z2
        return cute.where(u >= 0.0, r, e * r) + (2.0 * z) * (e * (r * r)) * du
    if name == "gelu_exact":
        cdf = 0.5 * (1.0 + cute.math.erf(z * _SQRT_HALF, fastmath=fast))
        return cdf + z * (_INV_SQRT_2PI * cute.math.exp(-0.5 * (z * z), fastmath=True))
    if name == "silu":
        # sigmoid(z) (1 + z (1 - sigmoid(z))), sigmoid = r above 0 and e r below, 1 - sigmoid the other
        e, r = _exp_ratio(z)
        s, rest = cute.where(z >= 0.0, r, e * r), cute.where(z >= 0.0, e * r, r)
        return s * (1.0 + z * rest)
    raise ValueError(f"no kernel epilogue for the derivative of {name!r} (kernels fuse {', '.join(ACTIVATIONS)})")


def _exp_ratio(x):
    """(e, r) = (exp(-|x|), 1 / (1 + e)) for a float32 TensorSSA ``x``."""
    from jax_cute.kernels.dsl import cute

    e = cute.math.exp(-cute.math.abs(x), fastmath=True)
    return e, cute.math.rcp(1.0 + e, approx=True, ftz=True)


def scaled_by_derivative(name: str, z, g, fast: bool):
    """``name``'s derivative at ``z`` times ``g`` (float32 TensorSSAs of one shape): the backward of
    ``act(z)`` for the cotangent ``g``. relu selects as jax.nn.relu's JVP does (``g`` where
    z > 0, else 0, even for a NaN or infinite ``g``)."""
    from jax_cute.kernels.dsl import cute

    if name == "relu":
        return cute.where(z > 0.0, g, cute.full_like(g, 0.0))
    return derivative(name, z, fast) * g


def gated(name: str, gate, up, fast: bool):
    """``name`` (a GATED activation) of paired ``gate`` and ``up`` fragments: swiglu is
    ``silu(gate) * up``."""
    if name == "swiglu":
        return activation("silu", gate, fast) * up
    raise ValueError(f"no kernel epilogue for gated activation {name!r} (kernels fuse {', '.join(GATED)})")
