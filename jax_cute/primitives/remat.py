"""Checkpoint policies see our GEMMs as the products they compute.

JAX's policies recognise a product by its primitive: ``jax.checkpoint_policies.dots_saveable``
saves what ``lax.dot_general_p`` computes, ``dots_with_no_batch_dims_saveable`` what it computes
with no batch dimensions. Under ``jax.checkpoint`` a jax_cute GEMM (or the XLA dot ``kernelize``
replaced) would otherwise be recomputed in the backward pass where JAX saves the dot. Each GEMM
primitive registers here the lax call it stands for (``LaxView``: the primitive, operand shapes
and params as ``lax.dot_general`` or ``lax.ragged_dot_general`` would take them, read off the
layouts), and its partial-evaluation rule asks the policy about that call as well as about the
primitive itself: a policy that saves either saves the product.

An ``Offloadable`` answer (``offload_dot_with_no_batch_dims``) recomputes the product instead,
with a log line: offloading takes a host copy this rule does not stage.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Sequence

import numpy as np
from jax import lax
from jax._src import core as jax_core  # the effect types checkpoint looks past; not exported
from jax._src.interpreters.partial_eval import ensure_enum  # a policy's answer as an enum; not exported
from jax._src.lax.lax import ragged_dot_general_p  # jax.lax does not export it
from jax.ad_checkpoint import Offloadable, Recompute, Saveable
from jax.core import ShapedArray
from jax.extend import core
from jax.interpreters import partial_eval as pe

from jax_cute.problem.gemm_layouts import GemmLayouts, refine
from jax_cute.problem.ragged_layouts import RAGGED_M, RaggedLayouts

log = logging.getLogger("jax_cute")

# Effects JAX's own partial evaluation does not count (an axis name, an internal ref): an
# equation that has only these is saved or recomputed as the policy says.
_NOT_REALLY_EFFECTS = (jax_core.NamedAxisEffect, jax_core.InternalMutableArrayEffect)


@dataclasses.dataclass(frozen=True)
class LaxView:
    """A product as lax states it: ``prim.bind(*avals, **params)`` computes what ours does."""
    prim: core.Primitive
    avals: tuple
    params: dict


# (input avals, params) -> the lax call the primitive stands for
View = Callable[[Sequence[Any], dict], LaxView]


def dense_view(lhs_dtype, rhs_dtype, layouts: GemmLayouts, out_dtype, precision=None) -> LaxView:
    """``lax.dot_general`` of (batch, M, K) by (batch, K, N): an L sub-mode both operands step
    through is a batch dimension; one only A (or B) steps through is part of M (N), as
    ``jnp.matmul`` states a broadcast operand's product (no batch dimension)."""
    ext = layouts.extents()
    batch, m, n = 1, ext["m"], ext["n"]
    for (size, da), (_, db) in zip(*(lay.flat_modes() for lay in refine([layouts.a.mode(2), layouts.b.mode(2)]))):
        if da and db:
            batch *= size
        elif db:
            n *= size
        else:
            m *= size
    return dot_view(lhs_dtype, rhs_dtype, batch, m, n, ext["k"], out_dtype, precision)


def dot_view(lhs_dtype, rhs_dtype, batch: int, m: int, n: int, k: int, out_dtype, precision=None) -> LaxView:
    """``lax.dot_general`` of (batch, M, K) by (batch, K, N), no batch dimension where batch is 1."""
    lead = (batch,) if batch > 1 else ()
    lhs = ShapedArray((*lead, m, k), np.dtype(lhs_dtype))
    rhs = ShapedArray((*lead, k, n), np.dtype(rhs_dtype))
    b = len(lead)
    dims = (((b + 1,), (b,)), (tuple(range(b)), tuple(range(b))))
    return LaxView(lax.dot_general_p, (lhs, rhs), dict(dimension_numbers=dims, precision=precision,
                                                       preferred_element_type=np.dtype(out_dtype), out_sharding=None))


def ragged_view(lhs_dtype, rhs_dtype, mode: str, m: int, n: int, k: int, g: int, batch: int, out_dtype,
                precision=None) -> LaxView:
    """``lax.ragged_dot_general``: rows of (batch, M, K) in groups against (batch, G, K, N)
    (``ragged_m``), or K in groups of (batch, M, K) by (batch, K, N), one (M, N) per group
    (``ragged_k``)."""
    lead = (batch,) if batch > 1 else ()
    b = len(lead)
    bdims = (tuple(range(b)), tuple(range(b)))
    lhs = ShapedArray((*lead, m, k), np.dtype(lhs_dtype))
    sizes = ShapedArray((*lead, g), np.dtype("int32"))
    if mode == RAGGED_M:
        rhs = ShapedArray((*lead, g, k, n), np.dtype(rhs_dtype))
        dn = lax.RaggedDotDimensionNumbers((((b + 1,), (b + 1,)), bdims), [b], [b])
    else:
        rhs = ShapedArray((*lead, k, n), np.dtype(rhs_dtype))
        dn = lax.RaggedDotDimensionNumbers((((b + 1,), (b,)), bdims), [b + 1], [])
    return LaxView(ragged_dot_general_p, (lhs, rhs, sizes),
                   dict(ragged_dot_dimension_numbers=dn, precision=precision,
                        preferred_element_type=np.dtype(out_dtype), group_offset=None,
                        out_sharding=None))


def layouts_view(avals: Sequence[Any], params: dict) -> LaxView:
    """The view of a primitive whose params hold ``layouts``, A and B its first two operands."""
    g = params["layouts"]
    a, b = avals[0].dtype, avals[1].dtype
    if isinstance(g, GemmLayouts):
        return dense_view(a, b, g, params["out_dtype"], params.get("precision"))
    assert isinstance(g, RaggedLayouts), g
    e = g.extents()
    return ragged_view(a, b, g.mode, e["m"], e["n"], e["k"], e["g"], e["l"], params["out_dtype"],
                       params.get("precision"))


def _policy(saveable: Callable, eqn, view: View):
    """The policy's answer for ``eqn``: saved if it saves the primitive or the lax call."""
    avals = [x.aval for x in eqn.invars]
    own = ensure_enum(saveable(eqn.primitive, *avals, **eqn.params))
    if own is not Recompute:
        return own
    lax_call = view(avals, eqn.params)
    return ensure_enum(saveable(lax_call.prim, *lax_call.avals, **lax_call.params))


def _rule(view: View, saveable: Callable, unks_in: Sequence[bool], inst_in: Sequence[bool], eqn):
    """``jax.checkpoint``'s partial evaluation of one GEMM, as JAX's default for a primitive, with
    the policy asked through ``_policy``. Returns (known eqn, staged eqn, unknown outputs,
    instantiated outputs, residuals)."""
    outs = len(eqn.outvars)
    needed = [x for x, inst in zip(eqn.invars, inst_in) if isinstance(x, core.Var) and not inst]
    if any(unks_in):   # depends on the differentiated inputs: runs in the backward pass
        return None, eqn, [True] * outs, [True] * outs, needed
    effects = any(not isinstance(e, _NOT_REALLY_EFFECTS) for e in eqn.effects)
    policy = Saveable if effects else _policy(saveable, eqn, view)
    if isinstance(policy, Offloadable):
        log.info("jax_cute: %s under jax.checkpoint: the policy offloads it (%s -> %s); it is recomputed "
                 "instead", eqn.primitive.name, policy.src, policy.dst)
        policy = Recompute
    if policy is Saveable:   # computed once, its outputs residuals where the backward reads them
        return eqn, None, [False] * outs, [False] * outs, []
    return eqn, eqn, [False] * outs, [True] * outs, needed


def register(prim: core.Primitive, view: View = layouts_view) -> None:
    """Let checkpoint policies see ``prim`` as the lax product ``view`` states."""
    pe.partial_eval_jaxpr_custom_rules[prim] = lambda *args: _rule(view, *args)
