"""The activations a fused epilogue takes, as the ``jax.nn`` functions, and their derivatives.

One table for every fused primitive (``fused.py``, ``ragged_fused.py``, ``dact.py``) and for
``kernelize``'s matcher. Kernels compute the same functions in float32 on the accumulator
(``kernels/epilogue.py``); the reference and XLA paths use these.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import numpy as np

ACTIVATIONS = ("relu", "gelu", "gelu_exact", "silu", "swiglu")
# gated: the product's last axis holds [gate | up] halves and the result has half as many
GATED = ("swiglu",)


def _swiglu(z):
    half = z.shape[-1] // 2
    return jax.nn.silu(z[..., :half]) * z[..., half:]


FUNCTIONS: dict[str, Callable] = {
    "relu": jax.nn.relu,
    "gelu": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_exact": functools.partial(jax.nn.gelu, approximate=False),
    "silu": jax.nn.silu,
    "swiglu": _swiglu,
}


def apply_activation(name: str | None, z):
    """``name`` applied to ``z`` (swiglu along the last axis), as the ``jax.nn`` functions."""
    return z if name is None else FUNCTIONS[name](z)


def check_activation(op: str, activation) -> None:
    if activation is not None and activation not in FUNCTIONS:
        raise ValueError(f"jax_cute.{op}: unknown activation {activation!r} (choose one of "
                         f"{', '.join(ACTIVATIONS)}, or None)")


def epilogue_dtype(acc_dtype) -> np.dtype:
    """Dtype an epilogue computes in: the accumulator's, at least float32."""
    return np.promote_types(np.dtype(acc_dtype), np.float32)


def derivative_times(name: str, z, t, dtype):
    """``act'(z) * t`` in ``dtype`` for an elementwise activation, as ``jax.jvp`` of the ``jax.nn``
    function computes it (relu's is a select: a NaN ``t`` where ``z <= 0`` gives 0)."""
    return jax.jvp(FUNCTIONS[name], (z.astype(dtype),), (t.astype(dtype),))[1]
