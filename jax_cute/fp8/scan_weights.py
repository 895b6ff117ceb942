"""A scanned layer stack's weights quantized once, before the ``scan`` (``kernelize(fn, fp8=...)``).

A ``lax.scan`` over stacked layers quantizes each layer's weights in its body: a weight-kernel
launch per weight and layer, and, under ``jax.checkpoint``, one more in the backward pass's
recomputation. ``kernelize`` instead quantizes each stack once, before the scan, with one launch
(``Blockwise.q_weight_stack``); the slices enter the body as extra scanned inputs and reach the
product as ``w_quantized``. A weight the scan closes over (the same every layer) is quantized
once too. The values are the same bits: each layer's 128 x 128 blocks are its own. The quantized
stacks get no gradient; each weight's gradient is its product's, as before.

:func:`targets` finds the products this applies to: fp8-taken products in the scan's body, or in
a ``checkpoint`` inside it, whose weight operand is one of the scan's inputs (a scanned one or a
constant of the loop) seen through single-operand layout ops (casts, reshapes, transposes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax_cute.fp8.recipe import Taken, take, weight_vars
from jax_cute.jaxprs import Var, open_jaxpr, scan_counts

# single-operand ops a weight may pass through on its way to the product (applied to a whole
# stack under vmap); a wider set would need each op's batching rule to keep the values' bits
_CHAIN_OPS = frozenset({"convert_element_type", "reshape", "transpose", "squeeze", "expand_dims", "copy", "copy_p",
                        "reduce_precision"})
# bodies entered on the way to a product: kernelize binds them again through jax.checkpoint
CHECKPOINTS = frozenset({"checkpoint", "remat2"})


@dataclasses.dataclass(frozen=True)
class Target:
    """A product whose weight operand is ``chain`` applied to the scan's input ``source``."""

    product: Any      # the product's equation (in the scan's body or a checkpoint inside it)
    source: int       # the scan's input (by position among its operands)
    chain: tuple      # the layout equations from that input to the product's weight operand
    taken: Taken

    def weight(self, w):
        """One layer's input value as its product quantizes it: (K, N), or (G, K, N)."""
        for eqn in self.chain:
            w = eqn.primitive.bind(w, **eqn.params)
        return self.taken.weight(w)


def targets(scan_eqn, recipe) -> list[Target]:
    """The products inside ``scan_eqn`` whose weights can be quantized before it."""
    p = scan_eqn.params
    body, _ = open_jaxpr(p["jaxpr"])
    consts, carries = scan_counts(p)
    carry = range(consts, consts + carries)
    sources = {v: (i, ()) for i, v in enumerate(body.invars) if i not in carry}
    found: list[Target] = []
    _walk(body, sources, recipe, found)
    return found


def _walk(jaxpr, sources: dict, recipe, found: list) -> None:
    known = lambda v: isinstance(v, Var) and v in sources  # noqa: E731
    weights = weight_vars(jaxpr)
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in _CHAIN_OPS and len(eqn.invars) == 1 and known(eqn.invars[0]) and _plain(eqn):
            source, chain = sources[eqn.invars[0]]
            sources[eqn.outvars[0]] = (source, chain + (eqn,))
        elif name in CHECKPOINTS and not eqn.params.get("differentiated", False):
            inner, _ = open_jaxpr(eqn.params["jaxpr"])
            _walk(inner, {v: sources[a] for a, v in zip(eqn.invars, inner.invars) if known(a)}, recipe, found)
        else:
            taken = take(eqn, weights, recipe)
            if taken is not None:
                w = eqn.invars[0] if taken.swap else eqn.invars[1]
                if known(w):
                    found.append(Target(eqn, *sources[w], taken))


def _plain(eqn) -> bool:
    """A layout op that vmap over the stack applies as it stands: no sharding of its own (the
    per-layer one would not fit the stack) and no reshape order."""
    return eqn.params.get("sharding") is None and eqn.params.get("dimensions") is None


def holds(jaxpr, products: set[int]) -> bool:
    """Whether ``jaxpr`` (or a checkpoint inside it) holds one of ``products`` (equation ids)."""
    inner, _ = open_jaxpr(jaxpr)
    for eqn in inner.eqns:
        if id(eqn) in products:
            return True
        if eqn.primitive.name in CHECKPOINTS and holds(eqn.params["jaxpr"], products):
            return True
    return False
