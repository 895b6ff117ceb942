"""Finding ``act(product + bias)`` in a jaxpr, so ``kernelize`` can fuse it into the GEMM.

A product's result is fused with what follows it when, in program order of the jaxpr:

- an optional ``transpose`` that the product's caller can absorb by swapping its operands
  (``vmap`` of ``W @ x``, as Equinox's ``Linear`` is written, transposes ``W·Xᵀ``);
- an optional ``add`` of the product and a *bias* (any array broadcasting to the product's shape,
  e.g. Flax's ``(1, N)`` reshape of its bias); a bias made by ``broadcast_in_dim`` is read from
  the array it broadcasts, so the kernel reads one row instead of a materialized matrix;
- an *activation*: equations that are exactly what ``jax.nn.relu``, ``jax.nn.gelu`` (both forms)
  or ``jax.nn.silu`` trace to for that shape and dtype in this JAX version (matched equation by
  equation against the function's own trace, so a hand-written look-alike is left alone);
- an optional ``convert_element_type`` to a 16-bit or 32-bit float, which becomes the fused
  product's output dtype (one rounding instead of two);

and no value inside the group is used outside it (each is computed once, in the epilogue). A
product without an activation is left as it is: XLA already fuses a lone bias into the next pass.
Where such a group's result is an operand of the next product and nothing else (an MLP's two
layers), ``find_chains`` pairs them: that product's backward GEMM then applies the
activation's derivative in its epilogue (``primitives/dact.py``).
A grouped product (``lax.ragged_dot``) takes the activation and the cast, not a bias (its bias
is per group, which a model writes as a gather this matcher does not follow).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from typing import Any, Callable

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np

from jax_cute.activations import REGISTRY, names

Literal = jex.core.Literal

# jax_cute's elementwise activation names and the jax.nn functions whose traces are matched
ACTIVATION_FUNCTIONS: dict[str, Callable] = {k: REGISTRY[k].function for k in names(matched=True)}
_OUTPUT_DTYPES = {np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)}


@dataclasses.dataclass(frozen=True)
class Epilogue:
    """A product's fusable tail: the equations it replaces and what the fused call needs."""

    activation: str
    bias: Any                 # the bias's jaxpr var (or Literal), or None
    bias_source: Any          # the smaller array ``bias`` broadcasts (via broadcast_in_dim), or None
    bias_shape: tuple[int, ...] | None   # the shape to read ``bias_source`` as (numpy-broadcastable)
    out: Any                  # the var the fused call's result is bound to
    out_dtype: np.dtype
    eqns: frozenset[int]      # indices of the replaced equations (the product's excluded)
    swap: bool = False        # a transpose of the product is in the group: swap the operands

    @property
    def last(self) -> int:
        """Index of the last replaced equation: where the fused call is evaluated."""
        return max(self.eqns)

    def describe(self) -> str:
        return ("bias + " if self.bias is not None else "") + self.activation


def _uses(jaxpr) -> dict:
    """var -> indices of the equations reading it (jaxpr outputs count as index -1)."""
    uses: dict = defaultdict(list)
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, Literal):
                uses[v].append(i)
    for v in jaxpr.outvars:
        if not isinstance(v, Literal):
            uses[v].append(-1)
    return uses


def _same_value(x, y) -> bool:
    if isinstance(x, (jex.core.Jaxpr, jex.core.ClosedJaxpr)) or isinstance(y, (jex.core.Jaxpr, jex.core.ClosedJaxpr)):
        return str(x) == str(y)
    if callable(x) or callable(y) or hasattr(x, "f"):
        # a custom_jvp's rule is a fresh wrapped function per trace: jax.nn.relu's is known by
        # its primal body (a jit named relu around max(x, 0)), compared as the call_jaxpr
        return True
    if isinstance(x, tuple) and isinstance(y, tuple):
        return len(x) == len(y) and all(_same_value(a, b) for a, b in zip(x, y))
    try:
        return bool(x == y) if not isinstance(x, np.ndarray) else np.array_equal(x, y)
    except Exception:  # noqa: BLE001 - values of unknown types compare by their text
        return str(x) == str(y)


def _same_params(p: dict, q: dict) -> bool:
    return p.keys() == q.keys() and all(_same_value(p[k], q[k]) for k in p)


_CONSTANT_WRAPPERS = frozenset({"pvary", "convert_element_type"})


def _constants(jaxpr) -> dict:
    """var -> its scalar value, for vars made from a literal by ``pvary`` and ``convert_element_type``
    alone: inside ``shard_map`` a constant of ``jax.nn.gelu`` is traced that way (made to vary
    over the manual axes, then given its dtype), where outside it is a literal operand."""
    consts: dict = {}
    for e in jaxpr.eqns:
        if e.primitive.name in _CONSTANT_WRAPPERS and len(e.invars) == 1 and len(e.outvars) == 1:
            x = e.invars[0]
            value = np.asarray(x.val) if isinstance(x, Literal) else consts.get(x)
            if value is not None and value.ndim == 0:
                consts[e.outvars[0]] = value.astype(np.dtype(e.outvars[0].aval.dtype))
    return consts


def _same_literal(x, y, consts: dict) -> bool:
    """Whether ``y`` (a literal, or a var of ``consts``) is the reference's literal ``x``."""
    value = np.asarray(y.val) if isinstance(y, Literal) else consts.get(y)
    return (isinstance(x, Literal) and value is not None and np.dtype(x.aval.dtype) == value.dtype
            and np.array_equal(np.asarray(x.val), value))


@functools.lru_cache(maxsize=256)
def _reference(name: str, shape: tuple[int, ...], dtype: str):
    """The jaxpr ``jax.nn``'s function traces to on (shape, dtype), or None if it captures constants."""
    closed = jax.make_jaxpr(ACTIVATION_FUNCTIONS[name])(jax.ShapeDtypeStruct(shape, np.dtype(dtype)))
    inner = getattr(closed, "jaxpr", closed)
    return None if inner.constvars or len(inner.outvars) != 1 or not inner.eqns else inner


def _match(ref, start, jaxpr, uses, taken: set, consts: dict) -> tuple[Any, list[int]] | None:
    """Map the reference's equations onto ``jaxpr``'s, starting from ``start`` (the reference's
    input); ``consts`` are ``_constants(jaxpr)``. Returns (the var the reference's output maps
    to, the matched equation indices)."""
    env = {ref.invars[0]: start}
    matched: list[int] = []
    for r in ref.eqns:
        ins = [v if isinstance(v, Literal) else env.get(v) for v in r.invars]
        if any(x is None for x in ins):
            return None
        anchor = next((x for x in ins if not isinstance(x, Literal)), None)
        if anchor is None:
            return None
        found = None
        for i in uses.get(anchor, ()):
            if i < 0 or i in taken or i in matched:
                continue
            e = jaxpr.eqns[i]
            if (e.primitive is r.primitive and len(e.invars) == len(ins) and len(e.outvars) == len(r.outvars)
                    and all(_same_literal(x, y, consts) if isinstance(x, Literal) else x is y
                            for x, y in zip(ins, e.invars))
                    and _same_params(e.params, r.params)):
                found = i
                break
        if found is None:
            return None
        matched.append(found)
        env.update(zip(r.outvars, jaxpr.eqns[found].outvars))
    out = env.get(ref.outvars[0])
    return None if out is None else (out, matched)


def _only_used_by(var, allowed: set[int], uses) -> bool:
    return all(i in allowed for i in uses.get(var, ()))


def find_epilogues(jaxpr, products: dict[int, Any], unbiased: frozenset[int] = frozenset(),
                   swappable: Callable[[int, tuple[int, ...]], bool] = lambda p, perm: False) -> dict[int, Epilogue]:
    """For each product equation index in ``products`` (index -> its output var), the fusable
    tail after it, where there is one (see the module docstring); products in ``unbiased``
    (grouped ones, whose bias is per group) take an activation only. A ``transpose`` right after
    product ``p`` joins the group where ``swappable(p, permutation)`` says the product can be
    written with its operands swapped instead (``Epilogue.swap``: what ``vmap`` of ``W @ x``
    produces)."""
    uses = _uses(jaxpr)
    consts = _constants(jaxpr)
    producer = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    found: dict[int, Epilogue] = {}
    taken: set[int] = set()
    for p, out in products.items():
        if not jnp.issubdtype(out.aval.dtype, jnp.floating):
            continue
        group: list[int] = []
        cur, bias, swap = out, None, False
        nxt = uses.get(cur, [])
        if len(nxt) == 1 and nxt[0] >= 0 and jaxpr.eqns[nxt[0]].primitive.name == "transpose" \
                and swappable(p, tuple(jaxpr.eqns[nxt[0]].params["permutation"])):
            group.append(nxt[0])
            cur, swap = jaxpr.eqns[nxt[0]].outvars[0], True
        shape_now = tuple(cur.aval.shape)
        add = uses.get(cur, [])
        if p not in unbiased and len(add) == 1 and add[0] >= 0 and jaxpr.eqns[add[0]].primitive.name == "add":
            e = jaxpr.eqns[add[0]]
            other = e.invars[1] if e.invars[0] is cur else e.invars[0]
            shape = tuple(getattr(other.aval, "shape", ()))
            if (e.invars[0] is not e.invars[1] and tuple(e.outvars[0].aval.shape) == shape_now
                    and len(shape) <= len(shape_now) and jnp.issubdtype(other.aval.dtype, jnp.floating)
                    and all(x in (1, y) for x, y in zip(shape[::-1], shape_now[::-1]))):
                group.append(add[0])
                bias, cur = other, e.outvars[0]
        if not any(i >= 0 for i in uses.get(cur, ())):
            continue   # nothing reads it: no activation to match (and no reference traced for its shape)
        # the longest match wins: an activation whose trace begins with another's (relu2 = the
        # square of relu) is not taken for the shorter one
        best = None
        for name in ACTIVATION_FUNCTIONS:
            ref = _reference(name, shape_now, np.dtype(cur.aval.dtype).name)
            hit = None if ref is None else _match(ref, cur, jaxpr, uses, taken | set(group), consts)
            if hit is not None and (best is None or len(hit[1]) > len(best[1][1])):
                best = (name, hit)
        if best is None:
            continue
        act, (y, eqns) = best
        group += eqns
        inside = set(group)
        internal = [out] + [v for i in group for v in jaxpr.eqns[i].outvars if v is not y]
        if not all(_only_used_by(v, inside, uses) for v in internal):
            continue
        out_dtype = np.dtype(y.aval.dtype)
        conv = uses.get(y, [])
        if len(conv) == 1 and conv[0] >= 0:
            e = jaxpr.eqns[conv[0]]
            if e.primitive.name == "convert_element_type" and np.dtype(e.params["new_dtype"]) in _OUTPUT_DTYPES \
                    and not e.params.get("weak_type", False):
                group.append(conv[0])
                y, out_dtype = e.outvars[0], np.dtype(e.params["new_dtype"])
        source, source_shape = None, None
        if bias is not None and not isinstance(bias, Literal) and bias in producer:
            b = jaxpr.eqns[producer[bias]]
            dims = tuple(b.params.get("broadcast_dimensions", ())) if b.primitive.name == "broadcast_in_dim" else None
            if dims is not None and list(dims) == sorted(dims) and not isinstance(b.invars[0], Literal):
                src_shape = tuple(b.invars[0].aval.shape)
                full = tuple(b.outvars[0].aval.shape)
                shape = [1] * len(full)
                for d, n in zip(dims, src_shape):
                    shape[d] = n
                if all(shape[d] in (1, full[d]) for d in range(len(full))):
                    source, source_shape = b.invars[0], tuple(shape)
        taken |= set(group)
        found[p] = Epilogue(act, bias, source, source_shape, y, out_dtype, frozenset(group), swap)
    return found


def find_chains(jaxpr, fused: dict[int, Epilogue], consumers: set[int]) -> dict[int, tuple[int, int]]:
    """Products whose operand is the activated result of a fused product before them, so that
    the backward GEMM of that operand can apply the activation's derivative in its epilogue:
    {consumer product index: (fused product index, operand position 0 or 1)}. ``fused`` is
    ``find_epilogues``' result, ``consumers`` the products that may take a chained operand. The
    result must be 16-bit (a kernel operand as it is) and read by that one product only, once."""
    uses = _uses(jaxpr)
    chains: dict[int, tuple[int, int]] = {}
    for p, ep in fused.items():
        if jaxpr.eqns[p].primitive.name != "dot_general" or np.dtype(ep.out_dtype).itemsize != 2:
            continue
        readers = uses.get(ep.out, [])
        if len(readers) != 1 or readers[0] not in consumers or readers[0] in chains:
            continue
        q = readers[0]
        pos = [i for i, v in enumerate(jaxpr.eqns[q].invars) if v is ep.out]
        if len(pos) == 1 and pos[0] < 2:
            chains[q] = (p, pos[0])
    return chains
