"""What ``jax_cute.kernelize(fn, fp8="blockwise")`` runs in fp8, and how.

A product is taken when it has a *weight operand*:

- a ``dot_general`` with no batch dimensions whose second operand (``x @ w``, ``einsum("btd,df->btf",
  x, w)``, Flax's Dense) is a weight: a value that reaches the product from an input of
  the function, or of the ``scan``/``checkpoint``/``jit`` body it lies in, through casts and
  layout ops only (so stacked layer weights sliced by ``scan`` count), not a value computed
  from activations; both operands 16-bit floats. It becomes :func:`linear` over the
  operands flattened to (M, K) @ (K, N) (several contracting dimensions are one K). A weight
  as the first operand with a computed second one (``w @ x``, Equinox's Linear under ``vmap``)
  is taken too, as the product with the operands swapped and its result transposed back. Where
  both operands reach from inputs, the second is the weight.
- a ``lax.ragged_dot`` (tokens (M, K) against experts (G, K, N)) whose experts are a weight in
  the same sense: :func:`grouped_linear`.

Left in 16 bit (on jax_cute's bf16 path as before): products with batch dimensions, such as
attention's score (``q @ k.T``) and value (``p @ v``) products; products of two computed values;
products a recipe's ``exclude`` names (e.g. an LM head or a router, which DeepSeek-V3 keeps in
bf16); fp8 or 32-bit operands; ragged_dot's gradient forms (these come from ``kernelize(grad(f))``;
put ``kernelize`` inside ``grad`` so that the fp8 ``custom_vjp`` supplies the gradients).

A taken product's epilogue (``epilogue_match``: a bias, an elementwise activation, a cast) is
fused into :func:`linear` / :func:`grouped_linear` (``bias=``, ``activation=``) where the bias is
one value per output column of ``x @ w`` (the weight's free axes); else the product is taken
without it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax.extend as jex
import jax.numpy as jnp
import numpy as np

from jax_cute.fp8.linear import Blockwise, grouped_linear, linear

_SIXTEEN_BIT = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
# ops a weight passes through unchanged in substance (casts, layout, sharding annotations)
_LAYOUT_OPS = frozenset({"convert_element_type", "reshape", "transpose", "squeeze", "expand_dims",
                         "broadcast_in_dim", "copy", "copy_p", "sharding_constraint", "reshard", "mesh_cast",
                         "pvary", "pcast", "slice", "dynamic_slice", "reduce_precision", "optimization_barrier"})
_RAGGED_DOT = ((((1,), (1,)), ((), ())), (0,), (0,))


def resolve(fp8) -> Blockwise | None:
    """``kernelize``'s ``fp8`` argument as a recipe: None, "blockwise" or a :class:`Blockwise`."""
    if fp8 is None or isinstance(fp8, Blockwise):
        return fp8
    if isinstance(fp8, str) and fp8.lower() == "blockwise":
        return Blockwise()
    raise ValueError(f"jax_cute.kernelize: fp8 must be None, 'blockwise' or a jax_cute.fp8.Blockwise recipe, "
                     f"got {fp8!r}")


def weight_vars(jaxpr) -> set:
    """The variables of ``jaxpr`` that are its inputs (or constants) seen through layout ops."""
    weights = set(jaxpr.invars) | set(jaxpr.constvars)
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _LAYOUT_OPS and eqn.invars:
            src = eqn.invars[0]
            if isinstance(src, jex.core.Var) and src in weights:
                weights.update(eqn.outvars)
    return weights


def _normal(d):
    return tuple(_normal(x) for x in d) if isinstance(d, (tuple, list)) else int(d)


@dataclasses.dataclass(frozen=True)
class Taken:
    """An fp8-taken product. Called with the product's operands it computes the product; with
    ``bias``/``activation``/``out_dtype`` its fused epilogue ``act(product + bias)``, and with
    ``transposed`` the product's free axes swapped (an epilogue that absorbed a transpose)."""

    run: Callable
    swap: bool = False           # the weight is the first operand: computed as x @ w, transposed back
    x_free: int | None = None    # how many free axes x has in x @ w (None: a grouped product, no bias)
    w_free: int = 0              # and w
    # the weight operand as the layer quantizes it, (K, N) or (G, K, N): what ``w_quantized=``
    # (``Blockwise.q_weight_stack``'s slice, ``weight_pair``) stands for
    weight: Callable = lambda w: w

    def __call__(self, *operands, **epilogue):
        return self.run(*operands, **epilogue)

    def fuses(self, transposed: bool, bias_shape: tuple[int, ...] | None) -> bool:
        """Whether an epilogue whose bias has ``bias_shape`` (numpy-broadcast against the result,
        None: no bias) fuses: the bias must vary along the weight's free axes of ``x @ w`` only."""
        if self.x_free is None:
            # grouped: an activation only (a bias of kernelize's would vary along the groups' rows)
            return bias_shape is None and not transposed
        if bias_shape is None:
            return True
        if self.swap != transposed:
            return False
        over_x = len(bias_shape) - self.w_free  # the bias's (right-aligned) axes over x's free axes
        return all(d == 1 for d in bias_shape[:max(over_x, 0)])


def take(eqn, weights: set, recipe: Blockwise) -> Taken | None:
    """The fp8 computation replacing product ``eqn`` (a function of its operands), or None."""
    name = eqn.primitive.name
    if name not in ("dot_general", "ragged_dot_general") or len(eqn.invars) < 2:
        return None
    lhs, rhs = eqn.invars[0], eqn.invars[1]
    is_weight = lambda v: isinstance(v, jex.core.Var) and v in weights  # noqa: E731
    swap = name == "dot_general" and not is_weight(rhs) and is_weight(lhs)
    if not (is_weight(rhs) or swap):
        return None
    la, ra, out = lhs.aval, rhs.aval, eqn.outvars[0].aval
    if np.dtype(la.dtype) not in _SIXTEEN_BIT or np.dtype(ra.dtype) not in _SIXTEEN_BIT:
        return None
    if np.dtype(out.dtype) not in (*_SIXTEEN_BIT, np.dtype(jnp.float32)):
        return None
    if recipe.exclude is not None and recipe.exclude(la, ra, out):
        return None
    product_dtype = np.dtype(out.dtype)
    if name == "ragged_dot_general":
        rd = eqn.params["ragged_dot_dimension_numbers"]
        form = (_normal(rd.dot_dimension_numbers), _normal(rd.lhs_ragged_dimensions), _normal(rd.rhs_group_dimensions))
        if form != _RAGGED_DOT or eqn.params.get("group_offset") is not None:
            return None

        def grouped(x, w, sizes, bias=None, activation=None, out_dtype=product_dtype, transposed=False,
                    w_quantized=None):
            assert bias is None and not transposed, "fuses() admits neither for a grouped product"
            return grouped_linear(x, w, sizes, activation=activation, out_dtype=out_dtype, recipe=recipe,
                                  w_quantized=w_quantized)

        return Taken(grouped)
    (lc, rc), (lb, rb) = _normal(eqn.params["dimension_numbers"])
    if lb or rb or not lc:
        return None
    if swap:  # w @ x = (x @ w)ᵀ: the product of the swapped operands, its free axes swapped back
        (lc, rc), (la, ra) = (rc, lc), (ra, la)
    lf = tuple(i for i in range(la.ndim) if i not in lc)
    rf = tuple(i for i in range(ra.ndim) if i not in rc)
    k = math.prod(la.shape[i] for i in lc)

    def weight(w):  # w to (K, w free...), K the contracting dims in x's order
        wk = jnp.transpose(w, rc + rf)
        return wk.reshape(k, *wk.shape[len(rc):])

    def run(lhs, rhs, bias=None, activation=None, out_dtype=product_dtype, transposed=False, w_quantized=None):
        x, w = (rhs, lhs) if swap else (lhs, rhs)
        xk = jnp.transpose(x, lf + lc)   # (x free..., K)
        if bias is not None:  # fuses() checked it is 1 along x's free axes: keep the weight's part
            bias = jnp.asarray(bias)
            bias = jnp.reshape(bias, (1,) * (len(lf) + len(rf) - bias.ndim) + bias.shape)[(0,) * len(lf)]
        y = linear(xk.reshape(*xk.shape[:len(lf)], k), weight(w), bias=bias, activation=activation,
                   out_dtype=out_dtype, recipe=recipe, w_quantized=w_quantized)
        if swap != transposed:  # the caller wants (w free..., x free...)
            y = jnp.transpose(y, tuple(range(len(lf), y.ndim)) + tuple(range(len(lf))))
        return y

    return Taken(run, swap, len(lf), len(rf), lambda w: weight(w).reshape(k, -1))
