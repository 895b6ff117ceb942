"""``jax_cute.kernelize``: run an existing JAX function's matrix products on jax_cute.

The function is traced to a jaxpr, which is then evaluated equation by equation with the
caller's tracers (a jaxpr interpreter, like ``jax.core.eval_jaxpr``):

- ``dot_general`` (so ``@``, ``jnp.matmul``, ``jnp.dot``, ``jnp.einsum`` and Flax/Equinox
  layers) becomes ``jax_cute.dot_general`` with the same dimension numbers, precision and
  ``preferred_element_type``; where ``jax.nn.relu``/``gelu``/``silu`` follows it (after an
  optional bias add, before an optional cast), the product and that epilogue become one fused
  call (``epilogue_match``);
- ``ragged_dot_general`` becomes ``jax_cute.ragged_dot`` for ``lax.ragged_dot``'s dimension
  numbers, and a grouped GEMM over the same buffers for the two forms ``lax.ragged_dot``'s own
  gradient produces; an activation after ``lax.ragged_dot`` is fused into the grouped kernel
  the same way (without a bias);
- the bodies of ``jit``, ``scan``, ``while``, ``cond``, ``checkpoint``/``remat`` and calls are
  rewritten the same way and the higher-order primitive is bound again with them, so the
  result still composes with ``jit``, ``grad``, ``vmap``, ``scan`` and ``jax.export``;
- of ``custom_jvp``/``custom_vjp`` functions only the primal body is rewritten: the user's
  JVP, forward and backward rules run as written. Under ``grad(kernelize(f))`` JAX calls those
  rules, not the primal body; ``kernelize(grad(f))`` sees the rules already applied.

Everything else is bound as written. A product stays XLA's when no kernel could take it:
operands that are not both bf16/fp16 (or both of one fp8 type), a result that is not
bf16/fp16/f32, integer products (XLA's integer dot is exact; jax_cute has no integer kernel),
a dot algorithm, other ragged dimension numbers, and products
inside primitives kernelize does not enter (e.g. Pallas kernels). A ``shard_map`` is entered:
its body is rewritten per shard and bound again with the same mesh and specs, so expert- and
tensor-parallel code written with collectives runs on the kernels too. Each decision
is recorded in a :class:`KernelizeReport`; in strict mode (``jax_cute.config.strict()``) a product
left to XLA raises :class:`jax_cute.FallbackError` when the function is traced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import source_info_util
from jax.extend import linear_util as lu
from jax.interpreters import partial_eval as pe

from jax_cute import config
from jax_cute.dispatch import FallbackError, target_arch
from jax_cute.epilogue_match import Epilogue, find_chains, find_epilogues
from jax_cute.fp8 import recipe as fp8_recipe
from jax_cute.fp8 import scan_weights
from jax_cute.fp8.quantize import weight_pair
from jax_cute.jaxprs import UNIFIED_JAXPR as _UNIFIED_JAXPR
from jax_cute.jaxprs import ClosedJaxpr, Literal
from jax_cute.jaxprs import is_jaxpr as _is_jaxpr
from jax_cute.jaxprs import open_jaxpr as _open
from jax_cute.jaxprs import scan_counts
from jax_cute.jaxprs import sub_jaxprs as _sub_jaxprs
from jax_cute.kernels.gemm_spec import algorithm_refusal
from jax_cute.primitives.dot_dtypes import acc_dtype
from jax_cute.primitives.dot_general import chained_dot_general
from jax_cute.primitives.grouped import PRIMITIVES as _GROUPED
from jax_cute.primitives.ragged_dot import ragged_dot
from jax_cute.primitives.sharding import constrain
from jax_cute.problem.ragged_layouts import cotangent, ragged_dot_layouts

logger = logging.getLogger("jax_cute")


# Higher-order primitives whose bodies are rewritten (names across JAX 0.10-0.12).
ENTERED = frozenset({"jit", "pjit", "closed_call", "core_call", "call", "eval_jaxpr", "remat2", "checkpoint",
                     "scan", "while", "cond", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})

_FP8 = {np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)}
_KERNEL_INPUTS = {np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float8_e4m3fn),
                  np.dtype(jnp.float8_e5m2)}
_KERNEL_OUTPUTS = {np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)}
_RAGGED_DOT = ((((1,), (1,)), ((), ())), (0,), (0,))      # lax.ragged_dot: lhs [M,K], rhs [G,K,N]
_RAGGED_DOT_DLHS = ((((1,), (2,)), ((), ())), (0,), (0,))  # its lhs gradient: dC [M,N], rhs [G,K,N]
_RAGGED_DOT_DRHS = ((((0,), (0,)), ((), ())), (0,), ())    # its rhs gradient: lhs [M,K], dC [M,N]


# -- the report -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Product:
    """One matrix product kernelize met, and what became of it."""

    primitive: str                        # "dot_general" or "ragged_dot_general"
    shapes: tuple[tuple[int, ...], ...]   # operand shapes (lhs, rhs[, group_sizes])
    dtypes: tuple[str, ...]               # operand dtypes, same order
    out_shape: tuple[int, ...]
    out_dtype: str
    kernelized: bool                      # True: now a jax_cute primitive
    reason: str | None = None             # why it stayed XLA's
    where: str = ""                       # enclosing primitives, outermost first ("scan/remat2")
    epilogue: str = ""                    # what was fused into its epilogue ("bias + gelu")
    chained: str = ""                     # an operand that is the activated product before it ("lhs gelu")
    fp8: bool = False                     # run block-scaled fp8 (kernelize's fp8 recipe)

    def describe(self) -> str:
        ops = " x ".join(f"{d}{list(s)}" for s, d in zip(self.shapes, self.dtypes))
        head = f"{'jax_cute' if self.kernelized else 'XLA':<8} {self.primitive} {ops} -> {self.out_dtype}{list(self.out_shape)}"
        head += f" with {self.epilogue} fused" if self.epilogue else ""
        head += " in block-scaled fp8" if self.fp8 else ""
        if self.chained:
            operand, act = self.chained.split()
            head += f", its {operand}'s {act} derivative in its backward GEMM"
        tail = f"  [in {self.where}]" if self.where else ""
        return head + tail + ("" if self.kernelized else f": {self.reason}")


@dataclasses.dataclass
class KernelizeReport:
    """Every product of one trace of a kernelized function, in program order."""

    products: list[Product] = dataclasses.field(default_factory=list)
    # Why the jax_cute products run their reference path (plain lax ops), not kernels: there
    # is no target to compile for (no CUDA device and no JAX_CUTE_TARGET_ARCH); else "".
    reference_path: str = ""

    @property
    def kernelized(self) -> list[Product]:
        return [p for p in self.products if p.kernelized]

    @property
    def left_to_xla(self) -> list[Product]:
        return [p for p in self.products if not p.kernelized]

    def __str__(self) -> str:
        where = f"as jax_cute primitives on their reference path ({self.reference_path})" if self.reference_path \
            else "on jax_cute"
        lines = [f"kernelize: {len(self.products)} products, {len(self.kernelized)} {where}, "
                 f"{len(self.left_to_xla)} left to XLA"]
        return "\n".join(lines + ["  " + p.describe() for p in self.products])


# -- deciding a product -----------------------------------------------------------------------

def _dtype_refusal(lhs, rhs, out) -> str | None:
    """Why no kernel takes operands of avals ``lhs``/``rhs`` and result ``out``, or None."""
    a, b, c = np.dtype(lhs.dtype), np.dtype(rhs.dtype), np.dtype(out.dtype)
    if jnp.issubdtype(a, jnp.integer) or jnp.issubdtype(b, jnp.integer) or a == bool or b == bool:
        return f"integer product ({a.name} x {b.name}): XLA's exact integer dot is kept (no jax_cute integer kernel)"
    if a != b and not {a, b} <= _FP8:
        return f"operand dtypes differ ({a.name} x {b.name}); the kernels take one input dtype (or fp8 x fp8)"
    if a not in _KERNEL_INPUTS:
        return f"{a.name} operands: the kernels take bfloat16, float16 or float8 inputs"
    if c not in _KERNEL_OUTPUTS:
        return f"{c.name} result: the kernels write bfloat16, float16 or float32"
    if getattr(out, "weak_type", False):
        return "weakly typed result"
    return None


def _normal(dims) -> tuple:
    """Dimension numbers as nested tuples of ints (jaxprs hold lists or tuples)."""
    if isinstance(dims, (tuple, list)):
        return tuple(_normal(d) for d in dims)
    return int(dims)


def _ragged_form(rd) -> tuple | None:
    """Which of the supported forms the ``RaggedDotDimensionNumbers`` ``rd`` is, or None."""
    form = (_normal(rd.dot_dimension_numbers), _normal(rd.lhs_ragged_dimensions), _normal(rd.rhs_group_dimensions))
    return form if form in (_RAGGED_DOT, _RAGGED_DOT_DLHS, _RAGGED_DOT_DRHS) else None


# -- rewriting products ------------------------------------------------------------------------

def _dot(lhs, rhs, *, dimension_numbers, precision=None, preferred_element_type=None, bias=None, activation=None,
         preact=False, act_operand=None, out_sharding=None, **_):
    out = chained_dot_general(lhs, rhs, dimension_numbers, precision=precision,
                              preferred_element_type=preferred_element_type, bias=bias, activation=activation,
                              preact=preact, act_operand=act_operand)
    return _as_asked(out, out_sharding)   # (a fused call reshards after its epilogue: _typed_as)


def _as_asked(out, out_sharding):
    """A product's result resharded to its ``out_sharding`` where one was given (as lax's)."""
    return out if out_sharding is None else constrain(out, out_sharding)


def _typed_as(out, eqn, var):
    """A fused product's result ``out`` resharded to ``var``'s type (its epilogue's result) where
    the product asked for an ``out_sharding``, which lax's products take on Explicit mesh axes
    only: there every value's type carries its sharding."""
    return out if eqn.params.get("out_sharding") is None else jax.sharding.reshard(out, var.aval.sharding)


def _ragged(lhs, rhs, group_sizes, *, ragged_dot_dimension_numbers, preferred_element_type=None, out_aval,
            out_sharding=None, **_):
    """A ragged_dot_general of one of the three supported forms as jax_cute grouped GEMMs, its
    result resharded to ``out_sharding`` where one is given (as lax's).

    The gradient forms are the transposes jax_cute.ragged_dot's own autodiff binds: the same
    primitives over the same buffers with permuted modes (``ragged_layouts.cotangent``)."""
    return _as_asked(_grouped_forms(lhs, rhs, group_sizes, ragged_dot_dimension_numbers, preferred_element_type,
                                    out_aval), out_sharding)


def _grouped_forms(lhs, rhs, group_sizes, ragged_dot_dimension_numbers, preferred_element_type, out_aval):
    form = _ragged_form(ragged_dot_dimension_numbers)
    if form == _RAGGED_DOT:
        return ragged_dot(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)
    if form == _RAGGED_DOT_DLHS:   # lhs = dC [M,N], rhs = B [G,K,N] -> dA [M,K]
        (m, n), (g, k, _) = lhs.shape, rhs.shape
        cot, bufs = cotangent(ragged_dot_layouts(m, k, g, n), "a", (m, k)), {"c": lhs, "b": rhs}
    else:                          # lhs = A [M,K], rhs = dC [M,N] -> dB [G,K,N]
        (m, k), (_, n), g = lhs.shape, rhs.shape, group_sizes.shape[0]
        cot, bufs = cotangent(ragged_dot_layouts(m, k, g, n), "b", (g, k, n)), {"a": lhs, "c": rhs}
    assert not cot.extra and cot.layouts.c_shape == tuple(out_aval.shape), (cot, out_aval)
    acc = acc_dtype(*(np.dtype(lhs.dtype),) * 3)
    return _GROUPED[cot.layouts.mode].bind(
        bufs[cot.operands[0]], bufs[cot.operands[1]], group_sizes.astype(jnp.int32), layouts=cot.layouts,
        out_dtype=np.dtype(out_aval.dtype).name, acc_dtype=np.dtype(acc).name)


def _swapped(dims) -> tuple:
    """dot_general's dimension numbers with the operands swapped."""
    (lc, rc), (lb, rb) = _normal(dims)
    return (rc, lc), (rb, lb)


def _swappable(jaxpr, p: int, perm: tuple[int, ...]) -> bool:
    """Whether ``transpose(dot_general(l, r), perm)`` is ``dot_general(r, l)``: ``perm`` keeps the
    batch axes first and swaps the lhs free axes with the rhs free ones."""
    eqn = jaxpr.eqns[p]
    if eqn.primitive.name != "dot_general":
        return False
    (lc, rc), (lb, _) = _normal(eqn.params["dimension_numbers"])
    nb = len(lb)
    nl = eqn.invars[0].aval.ndim - nb - len(lc)
    nr = eqn.invars[1].aval.ndim - nb - len(rc)
    return tuple(perm) == tuple(range(nb)) + tuple(range(nb + nl, nb + nl + nr)) + tuple(range(nb, nb + nl))


def _refusal(eqn) -> str | None:
    """Why the product ``eqn`` stays XLA's, or None to rewrite it."""
    p, avals = eqn.params, [v.aval for v in eqn.invars]
    why = algorithm_refusal(p.get("precision"), np.dtype(avals[0].dtype).name) \
        or _dtype_refusal(avals[0], avals[1], eqn.outvars[0].aval)
    if why is not None or eqn.primitive.name == "dot_general":
        return why
    # ragged_dot_general
    if p.get("group_offset") is not None:
        return "group_offset (a sharded ragged_dot) is not supported"
    if _ragged_form(p["ragged_dot_dimension_numbers"]) is None:
        return (f"ragged dimension numbers {p['ragged_dot_dimension_numbers']} are not lax.ragged_dot's "
                "or its gradients'")
    if not jnp.issubdtype(avals[2].dtype, jnp.integer):
        return f"group sizes of dtype {avals[2].dtype}"
    return None


def _bias_shape(ep: Epilogue) -> tuple[int, ...] | None:
    """The shape an epilogue's bias broadcasts from (None: no bias)."""
    if ep.bias is None:
        return None
    return tuple(ep.bias_shape) if ep.bias_source is not None else tuple(getattr(ep.bias.aval, "shape", ()))


def _chained(chain) -> str:
    """The report's words for a chained operand: "lhs gelu"."""
    return "" if chain is None else f"{'lhs' if chain[0] == 'a' else 'rhs'} {chain[1]}"


# -- the interpreter --------------------------------------------------------------------------

class _Keep(Exception):
    """A body could not be rewritten faithfully; the equation is bound as written."""


def _avals_match(a: Sequence, b: Sequence) -> bool:
    key = lambda x: (tuple(x.shape), np.dtype(x.dtype), getattr(x, "weak_type", False))  # noqa: E731
    return len(a) == len(b) and all(key(x) == key(y) for x, y in zip(a, b))


@contextlib.contextmanager
def _context(eqn):
    """The equation's own source location, name stack and context (e.g. its mesh) while it is bound."""
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
        yield


class _Interpreter:
    def __init__(self, fuse: bool, fp8: fp8_recipe.Blockwise | None = None) -> None:
        self.products: list[Product] = []
        self.where: list[str] = []
        self.fuse = fuse
        self.fp8 = fp8
        # fp8 products whose weights a scan around them quantized already (``scan_weights``):
        # id(equation) -> the weight kernel's outputs for this layer, values of the current trace
        self.given: dict[int, tuple] = {}

    # bookkeeping
    def _record(self, eqn, kernelized: bool, reason: str | None = None, epilogue: Epilogue | None = None,
                chained: str = "", fp8: bool = False) -> None:
        avals, out = [v.aval for v in eqn.invars], (epilogue.out if epilogue else eqn.outvars[0]).aval
        product = Product(eqn.primitive.name, tuple(tuple(a.shape) for a in avals),
                          tuple(np.dtype(a.dtype).name for a in avals), tuple(out.shape), np.dtype(out.dtype).name,
                          kernelized, reason, "/".join(self.where), epilogue.describe() if epilogue else "", chained,
                          fp8)
        if not kernelized:
            if config.strict():
                raise FallbackError("kernelize", product.describe())
            logger.info("jax_cute.kernelize: leaving to XLA: %s", product.describe())
        self.products.append(product)

    def _record_untouched(self, jaxpr, reason: str) -> None:
        """Record every product inside a body that is bound as written."""
        inner, _ = _open(jaxpr)
        for eqn in inner.eqns:
            if eqn.primitive.name in ("dot_general", "ragged_dot_general"):
                self._record(eqn, False, reason)
            for sub in _sub_jaxprs(eqn.params):
                self._record_untouched(sub, reason)

    # evaluation
    def eval(self, jaxpr, consts: Sequence, args: Sequence) -> list:
        env: dict = {}
        read = lambda v: v.val if isinstance(v, Literal) else env[v]  # noqa: E731
        for var, val in zip(jaxpr.constvars, consts, strict=True):
            env[var] = val
        for var, val in zip(jaxpr.invars, args, strict=True):
            env[var] = val
        taken = self._fp8_products(jaxpr)
        fused = self._epilogues(jaxpr, taken)
        # an fp8 product's backward is its custom_vjp's: no derivative epilogue is chained from it
        # (nor from one with an out_sharding: its pre-activation would need that type too)
        chains = self._chains(jaxpr, {p: ep for p, ep in fused.items()
                                      if p not in taken and jaxpr.eqns[p].params.get("out_sharding") is None}, taken)
        feeds = {p for p, _ in chains.values()}
        preacts: dict = {}   # a chained fused product's result var -> its pre-activation
        skipped = {i for p, ep in fused.items() for i in (p, *ep.eqns)}
        at_last = {ep.last: p for p, ep in fused.items()}
        for i, eqn in enumerate(jaxpr.eqns):
            if i in skipped and i not in at_last:
                continue
            q = at_last.get(i, i)   # the product equation bound here
            chain = None   # its operand that is a chained product's activated result: (which, act, z)
            if q in chains:
                p, pos = chains[q]
                pos = 1 - pos if q in fused and fused[q].swap else pos
                chain = ("ab"[pos], fused[p].activation, preacts[fused[p].out])
            if i in at_last:  # the product and its epilogue, as one fused call
                eqn, ep = jaxpr.eqns[q], fused[q]
                bias = None if ep.bias is None else (
                    jnp.reshape(read(ep.bias_source), ep.bias_shape) if ep.bias_source is not None else read(ep.bias))
                with _context(eqn):
                    self._record(eqn, True, epilogue=ep, chained=_chained(chain), fp8=q in taken)
                    ins = [read(v) for v in eqn.invars]
                    if q in taken:   # the fp8 product with its epilogue (never chained: no act_operand)
                        out = taken[q](*ins, bias=bias, activation=ep.activation, out_dtype=ep.out_dtype,
                                       transposed=ep.swap, w_quantized=self._given(eqn))
                    elif eqn.primitive.name == "ragged_dot_general":
                        out = ragged_dot(*ins[:2], ins[2].astype(jnp.int32), preferred_element_type=ep.out_dtype,
                                         activation=ep.activation)
                    else:
                        params = {**eqn.params, "preferred_element_type": ep.out_dtype, "out_sharding": None}
                        if ep.swap:
                            ins, params["dimension_numbers"] = ins[::-1], _swapped(eqn.params["dimension_numbers"])
                        out = _dot(*ins, **params, bias=bias, activation=ep.activation, preact=q in feeds,
                                   act_operand=chain)
                        if q in feeds:
                            out, preacts[ep.out] = out
                    env[ep.out] = _typed_as(out, eqn, ep.out)
                continue
            invals = [read(v) for v in eqn.invars]
            if i in taken:   # the fp8 recipe's product (custom_vjp: its gradients in fp8 too)
                with _context(eqn):
                    self._record(eqn, True, fp8=True)
                    env[eqn.outvars[0]] = _as_asked(taken[i](*invals, w_quantized=self._given(eqn)),
                                                    eqn.params.get("out_sharding"))
                continue
            if chain is not None:   # a plain product with a chained operand
                with _context(eqn):
                    self._record(eqn, True, chained=_chained(chain))
                    env[eqn.outvars[0]] = _dot(*invals, **eqn.params, act_operand=chain)
                continue
            with _context(eqn):
                outs = self._eqn(eqn, invals)
            outs = outs if eqn.primitive.multiple_results else [outs]
            for var, val in zip(eqn.outvars, outs, strict=True):
                env[var] = val
        return [read(v) for v in jaxpr.outvars]

    def _fp8_products(self, jaxpr) -> dict:
        """The products of ``jaxpr`` (by equation index) the fp8 recipe takes, with their rule."""
        if self.fp8 is None:
            return {}
        weights = fp8_recipe.weight_vars(jaxpr)
        rules = {i: fp8_recipe.take(e, weights, self.fp8) for i, e in enumerate(jaxpr.eqns)}
        return {i: r for i, r in rules.items() if r is not None}

    def _epilogues(self, jaxpr, taken: dict) -> dict[int, Epilogue]:
        """The products of ``jaxpr`` (by equation index) to fuse with the epilogue after them;
        of the fp8-taken products (``taken``), those whose epilogue their rule fuses."""
        if not self.fuse:
            return {}
        products, grouped = {}, set()
        for i, e in enumerate(jaxpr.eqns):
            if e.primitive.name not in ("dot_general", "ragged_dot_general") or (
                    i not in taken and _refusal(e) is not None):
                continue
            if e.primitive.name == "ragged_dot_general":
                if _ragged_form(e.params["ragged_dot_dimension_numbers"]) != _RAGGED_DOT:
                    continue  # the gradient forms have no epilogue of their own
                grouped.add(i)
            products[i] = e.outvars[0]
        if not products:
            return {}
        found = find_epilogues(jaxpr, products, frozenset(grouped), functools.partial(_swappable, jaxpr))
        return {p: ep for p, ep in found.items() if p not in taken or taken[p].fuses(ep.swap, _bias_shape(ep))}

    def _chains(self, jaxpr, fused: dict[int, Epilogue], skip=frozenset()) -> dict[int, tuple[int, int]]:
        """Products taking a fused product's activated result as an operand (``find_chains``)."""
        if not fused:
            return {}
        consumers = {i for i, e in enumerate(jaxpr.eqns)
                     if e.primitive.name == "dot_general" and _refusal(e) is None and i not in skip}
        return find_chains(jaxpr, fused, consumers)

    def _eqn(self, eqn, invals: list):
        name = eqn.primitive.name
        if name in ("dot_general", "ragged_dot_general"):
            why = _refusal(eqn)
            self._record(eqn, why is None, why)
            if why is None:
                rule = _dot if name == "dot_general" else functools.partial(_ragged, out_aval=eqn.outvars[0].aval)
                return rule(*invals, **eqn.params)
        elif _sub_jaxprs(eqn.params):
            return self._higher_order(eqn, invals)
        return eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))

    def _given(self, eqn) -> tuple | None:
        """The product's weight operands where a scan quantized its weight (``scan_weights``)."""
        raw = self.given.get(id(eqn))
        return None if raw is None else weight_pair(*raw)

    def _higher_order(self, eqn, invals: list):
        name, params = eqn.primitive.name, eqn.params
        if name == "shard_map":
            return self._shard_map(eqn, invals)
        if name == "scan" and self.fp8 is not None:
            hoisted = self._quantize_before(eqn, invals)
            if hoisted:
                return self._scan(eqn, invals, hoisted)
        if name in scan_weights.CHECKPOINTS and scan_weights.holds(params["jaxpr"], set(self.given)):
            return self._checkpoint(eqn, invals)
        if name not in ENTERED:
            for sub in _sub_jaxprs(params):
                self._record_untouched(sub, f"inside {name}, which kernelize does not enter")
            return eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
        start = len(self.products)
        self.where.append(name)
        try:
            new = {k: (tuple(self._rewrite(s) if _is_jaxpr(s) else s for s in v) if isinstance(v, tuple)
                       else self._rewrite(v) if _is_jaxpr(v) else v) for k, v in params.items()}
        except _Keep as e:
            del self.products[start:]
            for sub in _sub_jaxprs(params):
                self._record_untouched(sub, f"inside {name}: {e}")
            new = params
        finally:
            self.where.pop()
        return eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(new))

    def _quantize_before(self, eqn, invals: list) -> list[tuple[scan_weights.Target, tuple, bool]]:
        """The weights of the products in scan ``eqn`` that can be quantized before it, quantized:
        (target, the weight kernel's outputs, whether they are stacked along the scan)."""
        scanned_from = sum(scan_counts(eqn.params))
        hoisted = []
        for t in scan_weights.targets(eqn, self.fp8):
            w, stacked = invals[t.source], t.source >= scanned_from
            w = jax.lax.stop_gradient(jax.vmap(t.weight)(w) if stacked else t.weight(w))
            raw = self.fp8.q_weight_stack(w)
            if raw is not None:
                hoisted.append((t, raw, stacked))
        return hoisted

    def _scan(self, eqn, invals: list, hoisted: list):
        """Scan ``eqn`` bound again through ``lax.scan`` over its rewritten body, which also scans
        the quantized weight stacks (a loop constant's quantization is closed over)."""
        p = eqn.params
        nc, ncar = scan_counts(p)
        consts, init, xs = invals[:nc], invals[nc:nc + ncar], invals[nc + ncar:]
        inner, body_consts = _open(p["jaxpr"])
        stacks = [(t, raw) for t, raw, stacked in hoisted if stacked]
        fixed = [(t, raw) for t, raw, stacked in hoisted if not stacked]

        def body(carry, x):
            xs_i, raws = x
            for t, raw in [*zip([t for t, _ in stacks], raws), *fixed]:
                self.given[id(t.product)] = raw
            outs = self.eval(inner, body_consts, [*consts, *carry, *xs_i])
            return outs[:ncar], outs[ncar:]

        self.where.append("scan")
        try:
            carry, ys = jax.lax.scan(body, list(init), (list(xs), [raw for _, raw in stacks]), length=p["length"],
                                     reverse=p["reverse"], unroll=p["unroll"])
        finally:
            self.where.pop()
            for t, _, _ in hoisted:
                self.given.pop(id(t.product), None)
        return [*carry, *ys]

    def _checkpoint(self, eqn, invals: list):
        """A checkpoint holding products whose quantized weights the scan around it passes in:
        bound again through ``jax.checkpoint``, which takes those (closed-over) values as inputs."""
        p = eqn.params
        inner, consts = _open(p["jaxpr"])
        self.where.append(eqn.primitive.name)
        try:
            body = lambda *args: self.eval(inner, consts, args)  # noqa: E731
            return jax.checkpoint(body, prevent_cse=p["prevent_cse"], policy=p["policy"])(*invals)
        finally:
            self.where.pop()

    def _shard_map(self, eqn, invals: list):
        """A shard_map bound again through ``jax.shard_map`` over the rewritten body: JAX then
        traces the body per shard (manual axes, varying types, hoisted constants) as it did."""
        params = eqn.params
        inner, consts = _open(params["jaxpr"])
        if consts or inner.constvars:  # shard_map's body takes its constants as arguments
            self._record_untouched(params["jaxpr"], "inside shard_map: a body with bound constants")
            return eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
        kwargs = _shard_map_kwargs(params)
        self.where.append("shard_map")
        try:
            body = lambda *args: tuple(self.eval(inner, [], args))  # noqa: E731
            return list(jax.shard_map(body, mesh=params["mesh"], in_specs=tuple(params["in_specs"]),
                                      out_specs=tuple(params["out_specs"]), **kwargs)(*invals))
        finally:
            self.where.pop()

    def _rewrite(self, j):
        """``j`` with its products rewritten: the interpreter traced over ``j``'s input types."""
        inner, consts = _open(j)
        if not _UNIFIED_JAXPR and not isinstance(j, ClosedJaxpr) and inner.constvars:
            raise _Keep("a body with unbound constants")
        fun = lu.wrap_init(lambda *args: self.eval(inner, consts, args), debug_info=inner.debug_info)
        new, out_avals, new_consts = pe.trace_to_jaxpr_dynamic(fun, [v.aval for v in inner.invars])[:3]
        if not _avals_match(out_avals, [v.aval for v in inner.outvars]):
            raise _Keep("rewriting would change its result types")
        if new_consts and not consts:
            raise _Keep("rewriting would add constants to its body")
        if new_consts or (not _UNIFIED_JAXPR and isinstance(j, ClosedJaxpr)):
            return ClosedJaxpr(new, list(new_consts))
        return new


def _shard_map_kwargs(params) -> dict:
    """``jax.shard_map``'s keyword arguments that reproduce a shard_map equation's ``params``
    (JAX 0.10 names them check_rep/auto, later check_vma/newly_manual_axes)."""
    mesh = params["mesh"]
    if "newly_manual_axes" in params:
        manual = frozenset(params["newly_manual_axes"])
    elif "manual_axes" in params:
        manual = frozenset(params["manual_axes"])
    else:
        manual = frozenset(mesh.axis_names) - frozenset(params.get("auto", ()))
    check = params.get("check_vma", params.get("check_rep", True))
    kwargs = {"check_vma": check}
    if manual != frozenset(mesh.axis_names):
        kwargs["axis_names"] = set(manual)
    return kwargs


# -- the public function ----------------------------------------------------------------------

def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def kernelize(fn: Callable, *, report: bool = False, fuse_epilogues: bool = True, fp8=None) -> Callable:
    """``fn`` with its matrix products run as jax_cute primitives (see the module docstring).

    The returned function takes ``fn``'s arguments. Array leaves of the arguments are traced;
    other leaves (Python numbers, strings, functions in an Equinox module, ...) are passed to
    ``fn`` as they are, so ``fn`` sees exactly what it was given. Each call traces ``fn`` once
    more (under ``jax.jit`` that happens once per compilation) and stores what became of every
    product in the returned function's ``report`` attribute (a :class:`KernelizeReport`; None
    before the first call). With ``report=True`` that summary is also logged on the
    ``jax_cute`` logger at WARNING level each time the function is traced.

    Use ``jax.grad(kernelize(f))`` (or kernelize a whole training step): the gradients then come
    from jax_cute's own autodiff rules and are jax_cute GEMMs too.

    With ``fuse_epilogues`` (the default), a product followed by ``jax.nn.relu``, ``gelu`` (either
    form) or ``silu``, optionally with a bias added before and a cast to a 16- or 32-bit float
    after, becomes one fused call (``jax_cute.dot_general(..., bias=, activation=)``): the
    activation runs in float32 on the accumulator and is rounded once (``epilogue_match`` says
    exactly what is matched). Under ``grad(kernelize(f))`` the backward pass then takes the
    activation's derivative from the saved pre-activation, rounded to the output dtype.

    ``fp8="blockwise"`` (or a :class:`jax_cute.fp8.Blockwise` recipe) runs the products that have a
    weight operand in block-scaled fp8, forward and both gradients (DeepSeek-V3's recipe, see
    ``jax_cute.fp8.recipe`` for exactly which products; attention's batched products stay 16-bit):
    put it inside ``grad``. Their epilogue (a bias per output column, an elementwise activation)
    is fused as ``jax_cute.fp8.linear``'s: the bias in the kernel, the activation in XLA on the
    pre-activation, its derivative formed once in the backward pass (no derivative epilogue is
    chained into the next product's GEMM). Layers stacked under ``lax.scan`` have their weights
    quantized once, before the scan (``jax_cute.fp8.scan_weights``).
    """
    recipe = fp8_recipe.resolve(fp8)

    @functools.wraps(fn)
    def kernelized(*args, **kwargs):
        leaves, treedef = jax.tree.flatten((args, kwargs))
        dynamic = [_is_array(x) for x in leaves]

        def flat_fn(*arrays):
            it = iter(arrays)
            a, k = jax.tree.unflatten(treedef, [next(it) if d else x for x, d in zip(leaves, dynamic)])
            return fn(*a, **k)

        config.validate()
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*(x for x, d in zip(leaves, dynamic) if d))
        interp = _Interpreter(fuse_epilogues, recipe)
        inner, consts = _open(closed)
        outs = interp.eval(inner, consts, [x for x, d in zip(leaves, dynamic) if d])
        arch, why = target_arch()
        kernelized.report = KernelizeReport(interp.products, "" if arch else why)
        if report:
            logger.warning("jax_cute.%s", kernelized.report)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    kernelized.report = None
    return kernelized
