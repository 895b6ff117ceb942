"""An activation's derivative in the backward GEMM (``primitives/dact.py``), on the CPU.

The two linear primitives against jnp on random data (odd sizes, every elementwise activation),
under jit, vmap and every order of autodiff; kernelize's chains (an activated product feeding
the next product) against the unchained computation, with the backward's structure pinned: the
derivative is one ``jax_cute_matmul_dact``, the activation's XLA derivative is gone, and outside
autodiff the chain costs nothing (dead-code elimination drops the pre-activation output).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.interpreters import partial_eval as pe
from jax.test_util import check_grads

import jax_cute
from jax_cute.activations import REGISTRY
from jax_cute.primitives.dact import dact_p, operand_p
from jax_cute.primitives.dot_general import chained_dot_general, contraction_layouts

ACTS = ("relu", "gelu", "gelu_exact", "silu", "relu2")
DN = (((1,), (0,)), ((), ()))
F32, BF16 = jnp.float32, jnp.bfloat16


def _data(*shapes, scale=0.5, seed=0, dtype=F32):
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    return [(scale * jax.random.normal(k, s)).astype(dtype) for k, s in zip(keys, shapes)]


def _close(got, want, tol=2e-5):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


def _deriv(act, z):
    return jax.vmap(jax.grad(lambda v: REGISTRY[act].function(v)))(z.reshape(-1)).reshape(z.shape)


def _layouts(m, k, n):
    layouts, _ = contraction_layouts((m, k), (k, n), ((1,), (0,)), ((), ()))
    return layouts


def _dact(a, b, z, act, out_dtype=F32):
    lay = _layouts(a.shape[0], a.shape[1], b.shape[1])
    return dact_p.bind(a, b, z, layouts=lay, z_layout=lay.c, activation=act,
                       out_dtype=np.dtype(out_dtype).name, acc_dtype="float32", precision=None)


def _operand(x, w, z, act):
    return operand_p.bind(x, w, z, which="a", layouts=_layouts(x.shape[0], x.shape[1], w.shape[1]),
                          activation=act, out_dtype="float32", acc_dtype="float32", precision=None)


# -- the primitives ----------------------------------------------------------------------------

@pytest.mark.parametrize("act", ACTS)
def test_dact_values_and_vmap(act):
    a, b, z = _data((13, 7), (7, 11), (13, 11))
    _close(jax.jit(functools.partial(_dact, act=act))(a, b, z), _deriv(act, z) * (a @ b))
    # vmapped over A and Z (B shared), and over Z alone (A and B shared: Z read per batch)
    a3, z3 = _data((3, 13, 7), (3, 13, 11), seed=1)
    got = jax.vmap(functools.partial(_dact, act=act), in_axes=(0, None, 0))(a3, b, z3)
    _close(got, jnp.stack([_deriv(act, z3[i]) * (a3[i] @ b) for i in range(3)]))
    got = jax.vmap(functools.partial(_dact, act=act), in_axes=(None, None, 0))(a, b, z3)
    _close(got, jnp.stack([_deriv(act, z3[i]) * (a @ b) for i in range(3)]))


@pytest.mark.parametrize("act", ACTS)
def test_operand_values_and_vmap(act):
    x, w, z = _data((13, 7), (7, 11), (13, 7))
    _close(jax.jit(functools.partial(_operand, act=act))(x, w, z), (_deriv(act, z) * x) @ w)
    x3, z3 = _data((3, 13, 7), (3, 13, 7), seed=2)
    # Z batched where X is not: X is broadcast to Z's batch
    for axes in ((0, None, 0), (None, None, 0), (0, None, None)):
        got = jax.vmap(functools.partial(_operand, act=act), in_axes=axes)(
            x3 if axes[0] == 0 else x, w, z3 if axes[2] == 0 else z)
        want = [(_deriv(act, z3[i] if axes[2] == 0 else z) * (x3[i] if axes[0] == 0 else x)) @ w for i in range(3)]
        _close(got, jnp.stack(want))


@pytest.mark.sweep   # (16 s each: CI's second step, so the README's test line stays under 10 minutes)
@pytest.mark.parametrize("act", ["gelu", "silu", "gelu_exact"])
def test_primitives_grads(act):
    """Linear in the GEMM operands, smooth in Z: first and second order, both modes (relu's
    derivative is a step, so it is checked by the chain tests instead)."""
    a, b, z = _data((5, 4), (4, 6), (5, 6), seed=3)
    # jitted: check_grads evaluates each derivative many times, op by op when eager
    check_grads(jax.jit(functools.partial(_dact, act=act)), (a, b, z), order=2, modes=("fwd", "rev"),
                atol=1e-2, rtol=1e-2)
    x, w, zx = _data((5, 4), (4, 6), (5, 4), seed=4)
    check_grads(jax.jit(functools.partial(_operand, act=act)), (x, w, zx), order=2, modes=("fwd", "rev"),
                atol=1e-2, rtol=1e-2)


def test_operand_transposes_into_dact():
    """The transpose of the chained term with respect to its 16-bit operand is one GEMM with
    the derivative in its epilogue; an f32 operand (no kernel) takes the GEMM's own transpose
    and an XLA multiply; both give act'(Z) * (ct @ W^T)."""
    for dtype, prim in ((BF16, "jax_cute_matmul_dact"), (F32, "jax_cute_matmul")):
        x, w, z, ct = _data((9, 5), (5, 6), (9, 5), (9, 6), seed=5, dtype=dtype)
        f = lambda x: _operand(x, w, z, "gelu")  # noqa: E731
        t = jax.linear_transpose(f, x)
        names = [e.primitive.name for e in jax.make_jaxpr(t)(ct.astype(F32)).eqns]
        assert prim in names and ("jax_cute_matmul_dact" in names) == (dtype == BF16)
        got = t(ct.astype(F32))[0]
        want = _deriv("gelu", z.astype(F32)) * (ct.astype(F32) @ w.astype(F32).T)
        _close(got, want, 2e-2 if dtype == BF16 else 2e-5)


# -- chains, as kernelize makes them -------------------------------------------------------------

def _mlp(x, w1, b1, w2, b2, act, dtype=BF16):
    h = jnp.einsum("btd,df->btf", x.astype(dtype), w1.astype(dtype), preferred_element_type=F32) + b1
    h = REGISTRY[act].function(h).astype(dtype)
    return x + jnp.einsum("btf,fd->btd", h, w2.astype(dtype), preferred_element_type=F32) + b2


def _mlp_args(seed=0):
    return _data((2, 9, 12), (12, 20), (20,), (20, 12), (12,), seed=seed)


# (gelu; the other activations, relu's step too, differ only in their function: sweeps)
@pytest.mark.parametrize("act", [a if a == "gelu" else pytest.param(a, marks=pytest.mark.sweep) for a in ACTS])
def test_kernelize_chains_an_mlp(act):
    args = _mlp_args()
    loss = lambda *a: jnp.sum(jnp.sin(_mlp(*a, act=act)))  # noqa: E731
    k = jax_cute.kernelize(loss)
    grads = jax.jit(jax.grad(k, argnums=range(5)))(*args)
    assert "its lhs's " + act + " derivative in its backward GEMM" in str(k.report)
    # (after dead-code elimination, which jit runs: the activated operand's own tangent is unread)
    jaxpr = jax.make_jaxpr(jax.grad(k, argnums=range(5)))(*args).jaxpr
    names = [e.primitive.name for e in pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))[0].eqns]
    assert names.count("jax_cute_matmul_dact") == 1 and "tanh" not in names and "erf" not in names
    # against the same model in XLA: bf16 products, so bf16 rounding (the chain rounds dZ once)
    want = jax.grad(loss, argnums=range(5))(*args)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=3e-2, atol=3e-2 * float(jnp.max(jnp.abs(w))))
    _close(jax.jit(k)(*args), loss(*args), 1e-2)


def test_chain_outside_autodiff_costs_nothing():
    """Dead-code elimination (jit runs it before lowering) drops the chain's extra operand and
    the pre-activation output, so a forward pass lowers the two plain fused calls."""
    args = _mlp_args()
    jaxpr = jax.make_jaxpr(jax_cute.kernelize(functools.partial(_mlp, act="gelu")))(*args).jaxpr
    fused = [e for e in jaxpr.eqns if e.primitive.name == "jax_cute_matmul_fused"]
    assert fused[0].params["preact"] and fused[1].params["act_operand"] == ("a", "gelu")
    dced, _ = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
    fused = [e for e in dced.eqns if e.primitive.name == "jax_cute_matmul_fused"]
    assert [(e.params["preact"], e.params["act_operand"], len(e.outvars)) for e in fused] == [(False, None, 1)] * 2
    assert len(fused[1].invars) == 2   # (y, w2): Z is gone (a lone bias stays an XLA add)


@pytest.mark.sweep   # (12 s: CI's second step, so the README's test line stays under 10 minutes)
def test_chain_under_vmap_jvp_and_second_order():
    """Chains compose: vmap of the gradient, forward mode, and a Hessian-vector product equal
    the unchained model's (the chain's operands in f32 here, so no kernel rounding differs)."""
    args = _mlp_args(seed=1)
    f = lambda *a: _mlp(*a, act="gelu", dtype=F32)  # noqa: E731
    x, w1, b1, w2, b2 = args

    def chained(x, w1, b1, w2, b2):
        y, z = chained_dot_general(x.reshape(-1, 12), w1, DN, bias=b1, activation="gelu", preact=True)
        out = chained_dot_general(y, w2, DN, bias=b2, act_operand=("a", "gelu", z))
        return x + out.reshape(x.shape)

    loss = lambda g: lambda *a: jnp.sum(jnp.sin(g(*a)))  # noqa: E731
    _close(jax.jit(chained)(*args), f(*args), 1e-5)
    per_row = jax.vmap(jax.grad(loss(chained), argnums=1), in_axes=(0, None, None, None, None))
    _close(per_row(x[:, None], w1, b1, w2, b2), jax.vmap(jax.grad(loss(f), argnums=1),
                                                         in_axes=(0, None, None, None, None))(x[:, None], w1, b1, w2, b2), 1e-4)
    tangents = _mlp_args(seed=2)
    _close(jax.jvp(chained, args, tangents)[1], jax.jvp(f, args, tangents)[1], 1e-4)
    hvp = lambda g: jax.jvp(jax.grad(loss(g), argnums=1), args, tangents)[1]  # noqa: E731
    _close(hvp(chained), hvp(f), 1e-4)
    check_grads(jax.jit(loss(chained)), args, order=2, modes=("rev",), atol=1e-2, rtol=1e-2)


def test_chains_only_what_it_may():
    """A result read twice, an f32 result, a gated activation and a product with fusion
    switched off are not chained."""
    x, w1, w2 = _data((16, 8), (8, 24), (24, 8), dtype=BF16)

    def twice(x, w1, w2):
        h = jax.nn.gelu(x @ w1)
        return h @ w2 + jnp.sum(h)

    def wide(x, w1, w2):   # the activation in f32, read by an f32 product
        h = jax.nn.gelu(jnp.matmul(x, w1, preferred_element_type=F32))
        return h @ w2.astype(F32)

    def plain(x, w1, w2):
        return jax.nn.gelu(x @ w1) @ w2

    for fn, kw in ((twice, {}), (wide, {}), (plain, {"fuse_epilogues": False})):
        k = jax_cute.kernelize(fn, **kw)
        names = [e.primitive.name for e in jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(k(*a).astype(F32))))(x, w1, w2).eqns]
        assert "jax_cute_matmul_dact" not in names, fn.__name__
