"""Elementwise GEMM epilogues in the DSL: activations of float32 accumulator fragments.

Kernel families that fuse an epilogue (``EPILOGUES``; see ``gemm_spec.GemmSpec.bias`` and
``activation``) apply these to each register fragment after adding the bias and before the one
rounding to the output dtype. They match ``jax.nn``: ``gelu`` is the tanh form
(``approximate=True``), ``gelu_exact`` uses erf. ``fast`` (16-bit outputs) lets ``tanh``
and ``erf`` use their fast forms (MUFU ``tanh`` has ~2^-11 relative error, below a 16-bit output's
rounding; silu then takes the tanh form of the sigmoid); float32 outputs take the accurate forms.
``derivative``/``scaled_by_derivative`` are the activations' derivatives for a backward epilogue
(``GemmSpec.dact``), under the same conventions, matching what ``jax.grad`` of ``jax.nn`` computes.

The DSL side is a table keyed by activation name: one small function per activation
(``_ACTIVATION``), per derivative (``_DERIVATIVE``) and per gated activation (``_GATED``). A new
activation adds its entries there (and its name to the registry); the kernels look names up
through :func:`activation`, :func:`derivative`, :func:`scaled_by_derivative` and :func:`gated`,
and a kernel class's epilogue through the :class:`ActivationEpilogue` mixin (and a bias per output
column through :class:`ColumnBiasEpilogue`, for epilogues that know each fragment element's tile
coordinates, and an activation's derivative through :class:`DerivativeEpilogue`).

The DSL is imported when a function runs (while a kernel is traced), never when this module
is: routing code that only reads ``ACTIVATIONS`` must not need the compiler.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any, Callable

# the names to emit, from the registry: elementwise ones, and gated ones (the product's N holds
# [gate | up] halves and the output has N/2 columns)
from jax_cute.activations import KERNEL_ELEMENTWISE as ACTIVATIONS, KERNEL_GATED as GATED

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_SQRT_HALF = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)

Fragment = Any   # a float32 TensorSSA: one thread's fragment


def _cute() -> ModuleType:
    """The DSL's ``cute`` module (imported on first use: see the module notes)."""
    from jax_cute.kernels.dsl import cute

    return cute


def _cutlass() -> ModuleType:
    """The DSL's ``cutlass`` module (imported on first use, as ``_cute``)."""
    from jax_cute.kernels.dsl import cutlass

    return cutlass


# --- activations ---------------------------------------------------------------------------------

def _relu(x: Fragment, fast: bool) -> Fragment:
    cute = _cute()
    return cute.math.max(x, cute.full_like(x, 0.0), propagate_nan=True)


def _gelu(x: Fragment, fast: bool) -> Fragment:
    inner = x * (_SQRT_2_OVER_PI + (_SQRT_2_OVER_PI * 0.044715) * (x * x))
    t = _cute().math.tanh(inner, fastmath=fast)
    return (0.5 * x) * (1.0 + t)


def _gelu_exact(x: Fragment, fast: bool) -> Fragment:
    return (0.5 * x) * (1.0 + _cute().math.erf(x * _SQRT_HALF, fastmath=fast))


def _silu(x: Fragment, fast: bool) -> Fragment:
    cute = _cute()
    if fast:
        # x * sigmoid(x) = x/2 * (1 + tanh(x/2)): one MUFU op (exp and a division left a
        # stack frame beside the 128x256 tile's accumulators)
        return (0.5 * x) * (1.0 + cute.math.tanh(0.5 * x, fastmath=True))
    # the approximate division (2 ulp): the IEEE one's slow path is a call needing a stack frame
    return cute.math.div(x, 1.0 + cute.math.exp(-x), fastmath=True)


def _relu2(x: Fragment, fast: bool) -> Fragment:
    r = _relu(x, fast)
    return r * r


_ACTIVATION: dict[str, Callable[[Fragment, bool], Fragment]] = {
    "relu": _relu,
    "relu2": _relu2,
    "gelu": _gelu,
    "gelu_exact": _gelu_exact,
    "silu": _silu,
}


# --- derivatives ---------------------------------------------------------------------------------
# gelu and silu are written with e = exp(-|.|) in (0, 1] and r = 1 / (1 + e) (MUFU ex2 and rcp,
# a few float32 ulps, no overflow): (1 + tanh(u)) / 2 = r or e r, sech^2(u) = 4 e r^2, sigmoid
# = r or e r, each without cancellation. MUFU tanh's 2^-11 error, through 1 + tanh and
# 1 - tanh^2, was up to 2.5e-4 absolute in the tails, where the derivative is that small. (An
# accurate tanh or an IEEE division needs a stack frame beside a 128x256 tile's accumulators.)

def _exp_ratio(x: Fragment) -> tuple[Fragment, Fragment]:
    """(e, r) = (exp(-|x|), 1 / (1 + e)) for a float32 TensorSSA ``x``."""
    cute = _cute()
    e = cute.math.exp(-cute.math.abs(x), fastmath=True)
    return e, cute.math.rcp(1.0 + e, approx=True, ftz=True)


def _relu_derivative(z: Fragment, fast: bool) -> Fragment:
    cute = _cute()
    return cute.where(z > 0.0, cute.full_like(z, 1.0), cute.full_like(z, 0.0))


def _gelu_derivative(z: Fragment, fast: bool) -> Fragment:
    # d/dz [z/2 (1 + tanh(u))] = (1 + tanh(u)) / 2 + z/2 sech^2(u) u', u = c (z + 0.044715 z^3);
    # (1 + tanh(u)) / 2 is r for u >= 0 and e r below (no cancellation in either tail)
    z2 = z * z
    u = z * (_SQRT_2_OVER_PI + (_SQRT_2_OVER_PI * 0.044715) * z2)
    e, r = _exp_ratio(2.0 * u)
    du = _SQRT_2_OVER_PI + (3.0 * _SQRT_2_OVER_PI * 0.044715) * z2
    return _cute().where(u >= 0.0, r, e * r) + (2.0 * z) * (e * (r * r)) * du


def _gelu_exact_derivative(z: Fragment, fast: bool) -> Fragment:
    cute = _cute()
    cdf = 0.5 * (1.0 + cute.math.erf(z * _SQRT_HALF, fastmath=fast))
    return cdf + z * (_INV_SQRT_2PI * cute.math.exp(-0.5 * (z * z), fastmath=True))


def _silu_derivative(z: Fragment, fast: bool) -> Fragment:
    # sigmoid(z) (1 + z (1 - sigmoid(z))), sigmoid = r above 0 and e r below, 1 - sigmoid the other
    cute = _cute()
    e, r = _exp_ratio(z)
    s, rest = cute.where(z >= 0.0, r, e * r), cute.where(z >= 0.0, e * r, r)
    return s * (1.0 + z * rest)


def _relu2_derivative(z: Fragment, fast: bool) -> Fragment:
    return 2.0 * _relu(z, fast)


_DERIVATIVE: dict[str, Callable[[Fragment, bool], Fragment]] = {
    "relu": _relu_derivative,
    "relu2": _relu2_derivative,
    "gelu": _gelu_derivative,
    "gelu_exact": _gelu_exact_derivative,
    "silu": _silu_derivative,
}


def _relu_scaled(z: Fragment, g: Fragment, fast: bool) -> Fragment:
    """relu selects as jax.nn.relu's JVP does (``g`` where z > 0, else 0, even for a NaN or
    infinite ``g``)."""
    cute = _cute()
    return cute.where(z > 0.0, g, cute.full_like(g, 0.0))


# the backward of act(z) for a cotangent g where it is not derivative(z) * g
def _relu2_scaled(z: Fragment, g: Fragment, fast: bool) -> Fragment:
    """2 relu(z) times g selected as relu's JVP selects it (0 where z <= 0, even for a NaN or
    infinite g; NaN where z is)."""
    return _relu2_derivative(z, fast) * _relu_scaled(z, g, fast)


_SCALED_DERIVATIVE: dict[str, Callable[[Fragment, Fragment, bool], Fragment]] = {
    "relu": _relu_scaled,
    "relu2": _relu2_scaled,
}


# --- gated activations ---------------------------------------------------------------------------

def _swiglu(gate: Fragment, up: Fragment, fast: bool) -> Fragment:
    return _silu(gate, fast) * up


_GATED: dict[str, Callable[[Fragment, Fragment, bool], Fragment]] = {
    "swiglu": _swiglu,
}


# --- what kernels call -----------------------------------------------------------------------------

def activation(name: str, x: Fragment, fast: bool) -> Fragment:
    """``name`` applied to ``x``, a float32 TensorSSA (one thread's fragment)."""
    try:
        fn = _ACTIVATION[name]
    except KeyError:
        raise ValueError(f"no kernel epilogue for activation {name!r} (kernels fuse {', '.join(ACTIVATIONS)})") from None
    return fn(x, fast)


def derivative(name: str, z: Fragment, fast: bool) -> Fragment:
    """``name``'s derivative at ``z``, a float32 TensorSSA (one thread's fragment). ``fast``
    (16-bit outputs) takes the fast erf for gelu_exact, as ``activation`` does."""
    try:
        fn = _DERIVATIVE[name]
    except KeyError:
        raise ValueError(f"no kernel epilogue for the derivative of {name!r} "
                         f"(kernels fuse {', '.join(ACTIVATIONS)})") from None
    return fn(z, fast)


def scaled_by_derivative(name: str, z: Fragment, g: Fragment, fast: bool) -> Fragment:
    """``name``'s derivative at ``z`` times ``g`` (float32 TensorSSAs of one shape): the backward of
    ``act(z)`` for the cotangent ``g``."""
    if name in _SCALED_DERIVATIVE:
        return _SCALED_DERIVATIVE[name](z, g, fast)
    return derivative(name, z, fast) * g


def gated(name: str, gate: Fragment, up: Fragment, fast: bool) -> Fragment:
    """``name`` (a GATED activation) of paired ``gate`` and ``up`` fragments: swiglu is
    ``silu(gate) * up``."""
    try:
        fn = _GATED[name]
    except KeyError:
        raise ValueError(f"no kernel epilogue for gated activation {name!r} (kernels fuse {', '.join(GATED)})") from None
    return fn(gate, up, fast)


def table_names() -> dict[str, tuple[str, ...]]:
    """The names each DSL table holds (checked against ACTIVATIONS and GATED by the tests)."""
    return {"activation": tuple(_ACTIVATION), "derivative": tuple(_DERIVATIVE), "gated": tuple(_GATED)}


# --- arch-neutral epilogue pieces ------------------------------------------------------------------

class ActivationEpilogue:
    """Mixin of a kernel class whose epilogue applies ``self.act`` (an ACTIVATIONS name, or ""
    for none) to a register fragment of float32 values, before the rounding to the output
    dtype ``self.c_t``: the same on every arch (a Hopper or Blackwell epilogue mixes it in)."""

    act: str
    c_t: Any

    def activate(self, frag: Any) -> None:
        """``frag`` (a float32 register tensor) replaced by its activation, in place."""
        if self.act:
            frag.store(activation(self.act, frag.load(), fast=self.c_t.width == 16))


class ColumnBiasEpilogue:
    """Mixin of a kernel class whose epilogue adds a float32 bias per output column
    (``self.fuse_bias``) to a register fragment of float32 values, given each element's tile
    coordinates: the Blackwell epilogue's (the Hopper one pairs gated columns and reads a group's
    bias row: sm90_epilogue.BiasEpilogue)."""

    fuse_bias: bool

    def add_column_bias(self, frag: Any, coords: Any, bias: Any, col0: Any, n_cols: Any, scale: Any = None) -> None:
        """``bias[col0 + column]`` (times ``scale``, where given) added to each element of ``frag``
        (a float32 register tensor; its element i lies at tile coordinates ``coords[i]``), in
        place. Columns past ``n_cols`` read the last bias: they are never stored."""
        if self.fuse_bias:
            cutlass = _cutlass()
            for i in range(_cute().size(frag)):
                b = bias[cutlass.min(col0 + coords[i][1], n_cols - 1)]
                frag[i] = frag[i] + (b if scale is None else b * scale)


class DerivativeEpilogue:
    """Mixin of a kernel class whose epilogue scales a float32 register fragment by the derivative
    of ``self.dact`` (an ACTIVATIONS name) at the pre-activation Z read at the same elements, before
    the rounding to ``self.c_t`` (a dact epilogue; the Hopper one reads Z in chunks, see
    sm90_epilogue.DActEpilogue)."""

    dact: str
    c_t: Any

    def scale_by_derivative(self, frag: Any, z: Any) -> None:
        """``frag`` times act'(``z``) in place (``z``: a register tensor of Z's values, ordered like
        ``frag``)."""
        frag.store(scaled_by_derivative(self.dact, z.load().to(_cutlass().Float32), frag.load(),
                                        fast=self.c_t.width == 16))
