"""Flax and Equinox models on jax_cute: through ``jax_cute.kernelize``, and Flax layers given
``dot_general=jax_cute.dot_general``. CPU: values and gradients equal the models as written
(bf16 products, so to bf16 rounding)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cute
from test_kernelize import assert_trees_close

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
eqx = pytest.importorskip("equinox")

BF16, F32 = jnp.bfloat16, jnp.float32
X = jax.random.normal(jax.random.key(0), (2, 16, 32), F32)


def _check_model(loss, params, *args, products: int):
    """kernelize(loss) equals loss, in value and gradient, and every product became jax_cute's."""
    k = jax_cute.kernelize(loss)
    np.testing.assert_allclose(jax.jit(k)(params, *args), loss(params, *args), rtol=1e-2)
    assert_trees_close(jax.jit(jax.grad(k))(params, *args), jax.grad(loss)(params, *args))
    assert len(k.report.products) == products and not k.report.left_to_xla, str(k.report)
    return k.report


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(64, dtype=BF16, param_dtype=F32)(x))
        return nn.Dense(32, dtype=BF16, param_dtype=F32)(h)


class AttentionBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        h = nn.LayerNorm(dtype=BF16)(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=2, dtype=BF16, param_dtype=F32,
                                                   use_bias=False)(h, h, mask=mask)  # a key bias has zero gradient: noise
        return x + MLP()(nn.LayerNorm(dtype=BF16)(x))


def _mse(model):
    return lambda params, x: jnp.mean(jnp.square(model.apply(params, x).astype(F32)))


def test_flax_linen_mlp():
    model = MLP()
    report = _check_model(_mse(model), model.init(jax.random.key(1), X), X, products=2)
    # Dense's bias and nn.gelu are the first product's epilogue
    assert [p.epilogue for p in report.products] == ["bias + gelu", ""]


@pytest.mark.sweep   # (14 s: CI's second step, so the README's test line stays under 10 minutes)
def test_flax_linen_attention_block():
    model = AttentionBlock()
    # q, k, v projections, scores, weighted values, output projection, two MLP layers
    _check_model(_mse(model), model.init(jax.random.key(2), X), X, products=8)


def test_flax_linen_dense_takes_jax_cute_dot_general():
    dense = nn.Dense(16, dtype=BF16, dot_general=jax_cute.dot_general)
    params = dense.init(jax.random.key(3), X)
    want = nn.Dense(16, dtype=BF16).apply(params, X)
    np.testing.assert_array_equal(np.float32(dense.apply(params, X)), np.float32(want))
    jaxpr = jax.make_jaxpr(dense.apply)(params, X)
    assert "jax_cute_matmul" in str(jaxpr) and "dot_general" not in str(jaxpr)


def test_flax_nnx_linear_takes_jax_cute_dot_general():
    # nnx.Linear passes out_sharding= (None here) besides precision= and preferred_element_type=
    layer = nnx.Linear(32, 16, dtype=BF16, dot_general=jax_cute.dot_general, rngs=nnx.Rngs(0))
    want = nnx.Linear(32, 16, dtype=BF16, rngs=nnx.Rngs(0))(X)
    np.testing.assert_array_equal(np.float32(layer(X)), np.float32(want))


def test_flax_nnx_model_through_kernelize():
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(32, 64, dtype=BF16, rngs=rngs)
            self.down = nnx.Linear(64, 32, dtype=BF16, rngs=rngs)

        def __call__(self, x):
            return self.down(nnx.gelu(self.up(x)))

    model = Model(nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    loss = lambda state, x: jnp.mean(jnp.square(nnx.merge(graphdef, state)(x).astype(F32)))  # noqa: E731
    _check_model(loss, state, X, products=2)


@pytest.mark.sweep   # (10 s: CI's second step, so the README's test line stays under 10 minutes; the flax test stays in it)
def test_equinox_mlp():
    mlp = eqx.nn.MLP(32, 16, 64, depth=2, activation=jax.nn.gelu, key=jax.random.key(4), dtype=BF16)
    x = X[0].astype(BF16)

    def loss(model, x):
        return jnp.mean(jnp.square(jax.vmap(model)(x).astype(F32)))

    k = jax_cute.kernelize(loss)  # the model's functions (activation) pass through as they are
    np.testing.assert_allclose(eqx.filter_jit(k)(mlp, x), loss(mlp, x), rtol=1e-2)
    got = eqx.filter(eqx.filter_jit(eqx.filter_grad(k))(mlp, x), eqx.is_array)
    assert_trees_close(got, eqx.filter(eqx.filter_grad(loss)(mlp, x), eqx.is_array))
    assert len(k.report.products) == 3 and not k.report.left_to_xla
    # vmap of Linear's W @ x transposes W·Xᵀ: the product is taken as X·Wᵀ, bias and gelu fused
    assert [p.epilogue for p in k.report.products] == ["bias + gelu", "bias + gelu", ""]
    assert [p.out_shape for p in k.report.products][:2] == [(16, 64), (16, 64)]
