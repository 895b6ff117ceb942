"""Jaxpr helpers that hold across JAX 0.10-0.12, for the interpreters that walk a traced program
(``kernelize`` and the fp8 recipe's scan analysis)."""

from __future__ import annotations

from typing import Any

import jax.extend as jex

Jaxpr, ClosedJaxpr, Literal, Var = jex.core.Jaxpr, jex.core.ClosedJaxpr, jex.core.Literal, jex.core.Var
# JAX 0.12 folded ClosedJaxpr into Jaxpr (a Jaxpr carries its consts); 0.10 has both types.
UNIFIED_JAXPR = ClosedJaxpr is Jaxpr


def open_jaxpr(j) -> tuple[Any, list]:
    """(jaxpr whose constvars take ``consts``, consts) of a jaxpr-valued parameter."""
    if UNIFIED_JAXPR:  # JAX 0.12: a Jaxpr carries its consts
        return j, list(j.consts)
    if isinstance(j, ClosedJaxpr):
        return j.jaxpr, list(j.consts)
    return j, []


def is_jaxpr(v) -> bool:
    return isinstance(v, (Jaxpr, ClosedJaxpr))


def sub_jaxprs(params) -> list:
    """The jaxprs among an equation's parameters (a tuple of them counts each)."""
    return [s for v in params.values() for s in (v if isinstance(v, tuple) else (v,)) if is_jaxpr(s)]


def scan_counts(params) -> tuple[int, int]:
    """A scan equation's (constants, carries): the leading operands of its body, in that order,
    before the scanned ones (JAX 0.12 describes its operands as a tree, ``ft_in``)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(list(consts)), len(list(carry))
