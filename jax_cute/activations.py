"""The activation registry: every activation jax_cute knows, and what each layer may do with it.

One table for the primitives (``primitives/fused.py``, ``ragged_fused.py``, ``dact.py``),
``kernelize``'s matcher (``epilogue_match.py``), dispatch and the kernels' epilogue
(``kernels/epilogue.py`` reads the names it must emit). Each entry says:

- ``function``: the ``jax.nn`` form the reference and XLA paths compute (a gated one takes the
  product's last axis as ``[gate | up]`` halves);
- ``gated``: the result has half the product's N columns;
- ``kernel``: the kernels' epilogue computes it in float32 on the accumulator (an emitter of
  that name in ``kernels/epilogue.py``); ``kernel_derivative``: it also computes its derivative
  (``GemmSpec.dact``), the backward of a chained product;
- ``matched``: ``kernelize`` finds the function's own trace in a jaxpr and fuses it.

An elementwise activation's derivative is ``jax.jvp`` of its function (``derivative_times``), as
XLA computes it unfused; a gated one has none here (its backward is XLA's). A new activation is
one entry here and, for kernels, one emitter in ``kernels/epilogue.py``. This module imports
nothing of jax_cute, so every layer can read it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Activation:
    name: str
    function: Callable
    gated: bool = False
    kernel: bool = True
    kernel_derivative: bool = True
    matched: bool = True


def _relu2(z):
    """Squared ReLU (So et al., Primer): relu(z)**2."""
    return jax.numpy.square(jax.nn.relu(z))


def _swiglu(z):
    half = z.shape[-1] // 2
    return jax.nn.silu(z[..., :half]) * z[..., half:]


REGISTRY: dict[str, Activation] = {a.name: a for a in (
    Activation("relu", jax.nn.relu),
    Activation("gelu", functools.partial(jax.nn.gelu, approximate=True)),
    Activation("gelu_exact", functools.partial(jax.nn.gelu, approximate=False)),
    Activation("silu", jax.nn.silu),
    Activation("relu2", _relu2),
    # gated: not matched in a jaxpr (a model writes it as a slice, silu and a product)
    Activation("swiglu", _swiglu, gated=True, kernel_derivative=False, matched=False),
)}


def names(*, gated: bool | None = None, kernel: bool | None = None, kernel_derivative: bool | None = None,
          matched: bool | None = None) -> tuple[str, ...]:
    """The registered names, in registry order, with the given properties (None: either)."""
    want = {"gated": gated, "kernel": kernel, "kernel_derivative": kernel_derivative, "matched": matched}
    return tuple(a.name for a in REGISTRY.values()
                 if all(v is None or getattr(a, k) == v for k, v in want.items()))


ACTIVATIONS = names()
# what the kernels' epilogue emits: elementwise activations (and their derivatives), gated ones
KERNEL_ELEMENTWISE = names(gated=False, kernel=True)
KERNEL_GATED = names(gated=True, kernel=True)
KERNEL_DERIVATIVES = names(kernel_derivative=True)


def is_gated(name: str | None) -> bool:
    """Whether ``name`` pairs the product's N columns as ``[gate | up]`` (None: no activation)."""
    return name is not None and name in REGISTRY and REGISTRY[name].gated


def elementwise(name: str | None) -> bool:
    """Whether ``name`` is a registered activation applied element by element."""
    return name is not None and name in REGISTRY and not REGISTRY[name].gated


def output_columns(name: str | None, n: int) -> int:
    """The result's N for a product of ``n`` columns under activation ``name``."""
    return n // 2 if is_gated(name) else n


def check_activation(op: str, activation) -> None:
    if activation is not None and activation not in REGISTRY:
        raise ValueError(f"jax_cute.{op}: unknown activation {activation!r} (choose one of "
                         f"{', '.join(ACTIVATIONS)}, or None)")


def check_gated_columns(op: str, activation, n: int) -> None:
    """ValueError for a gated activation over an odd N (it takes [gate | up] halves)."""
    if is_gated(activation) and n % 2:
        raise ValueError(f"jax_cute.{op}: {activation} needs an even N (b's N holds [gate | up] halves), got N={n}")


def apply_activation(name: str | None, z):
    """``name`` applied to ``z`` (a gated one along the last axis), as the ``jax.nn`` functions."""
    return z if name is None else REGISTRY[name].function(z)


def epilogue_dtype(acc_dtype) -> np.dtype:
    """Dtype an epilogue computes in: the accumulator's, at least float32."""
    return np.promote_types(np.dtype(acc_dtype), np.float32)


def derivative_times(name: str, z, t, dtype):
    """``act'(z) * t`` in ``dtype`` for an elementwise activation, as ``jax.jvp`` of the ``jax.nn``
    function computes it (relu's is a select: a NaN ``t`` where ``z <= 0`` gives 0)."""
    return jax.jvp(REGISTRY[name].function, (z.astype(dtype),), (t.astype(dtype),))[1]
