"""Checkpoint policies treat our GEMMs as the lax products they replace (primitives/remat.py):
under ``jax.checkpoint(policy=dots_saveable)`` a kernelized model saves its products, as the
plain model saves its dots, instead of recomputing them in the backward pass."""

from __future__ import annotations

import functools
import logging
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cute
from jax_cute.jaxprs import open_jaxpr, sub_jaxprs

LAX_PRODUCTS = {"dot_general", "ragged_dot_general"}
POLICIES = ["dots_saveable", "dots_with_no_batch_dims_saveable", "nothing_saveable", "everything_saveable"]


def products(jaxpr, counts: Counter | None = None) -> Counter:
    """How many products (lax's or ours) each program in ``jaxpr`` runs, all nesting levels."""
    counts = Counter() if counts is None else counts
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in LAX_PRODUCTS or (name.startswith("jax_cute_") and name != "jax_cute_call"):
            counts["products"] += 1
        for sub in sub_jaxprs(eqn.params):
            products(open_jaxpr(sub)[0], counts)
    return counts


def mlp(x, w1, w2):
    return jnp.sum(jnp.tanh(jax.nn.gelu(x @ w1) @ w2).astype(jnp.float32))


def broadcast(x, w1, w2):   # (B, M, K) @ (K, N): no batch dimension, as jnp.matmul states it
    return jnp.sum(jnp.sin(jnp.matmul(jnp.matmul(x, w1), w2)).astype(jnp.float32))


def batched(x, w1, w2):     # a batch dimension on both operands
    h = jnp.einsum("bmk,bkn->bmn", x, jnp.broadcast_to(w1, (x.shape[0], *w1.shape)) * 1.5)
    return jnp.sum(jnp.sin(jnp.einsum("bmn,bnk->bmk", jnp.sin(h), jnp.broadcast_to(w2, (x.shape[0], *w2.shape)) + 1)))


def moe(x, w1, w2):
    sizes = jnp.array([5, 0, 9, 2], jnp.int32)
    e1, e2 = jnp.stack([w1] * 4) * jnp.arange(1, 5, dtype=w1.dtype)[:, None, None], jnp.stack([w2] * 4)
    h = jax.nn.silu(jax.lax.ragged_dot(x, e1, sizes))
    return jnp.sum(jnp.sin(jax.lax.ragged_dot(h, e2, sizes)).astype(jnp.float32))


MODELS = {"mlp": (mlp, (16, 24)), "broadcast": (broadcast, (3, 16, 24)), "batched": (batched, (3, 16, 24)),
          "moe": (moe, (16, 24))}


def args(shape, key=0):
    ks = jax.random.split(jax.random.key(key), 3)
    k = shape[-1]
    return (jax.random.normal(ks[0], shape, jnp.float32).astype(jnp.bfloat16),
            (jax.random.normal(ks[1], (k, 40), jnp.float32) / 5).astype(jnp.bfloat16),
            (jax.random.normal(ks[2], (40, k), jnp.float32) / 6).astype(jnp.bfloat16))


def grad_products(fn, policy, xs) -> int:
    f = jax.checkpoint(fn, policy=getattr(jax.checkpoint_policies, policy) if isinstance(policy, str) else policy)
    return products(jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(*xs).jaxpr)["products"]


def saves_ragged_dots(prim, *_, **__) -> bool:
    return prim.name == "ragged_dot_general"


@pytest.mark.parametrize("policy", POLICIES + [saves_ragged_dots])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_kernelized_model_recomputes_what_the_plain_one_does(model, policy):
    fn, shape = MODELS[model]
    xs = args(shape)
    plain = grad_products(fn, policy, xs)
    assert grad_products(jax_cute.kernelize(fn), policy, xs) == plain
    # the policy changes something: saving is fewer products (JAX's dot policies save no ragged dot)
    if policy == ("dots_saveable" if model != "moe" else saves_ragged_dots):
        assert plain < grad_products(fn, "nothing_saveable", xs)


@pytest.mark.parametrize("policy", ["dots_saveable", "dots_with_no_batch_dims_saveable", "nothing_saveable"])
def test_direct_calls_are_saved_as_dots(policy):
    """``jax_cute.matmul`` itself, with and without a batch dimension, as ``jnp.matmul``."""
    xs = args((3, 16, 24))

    def two(mm, x, w1, w2):
        return jnp.sum(jnp.sin(mm(jnp.sin(mm(x, w1)), w2)).astype(jnp.float32))

    def batched_two(mm, x, w1, w2):   # both operands batched: only dots_saveable keeps it
        b = x.shape[0]
        return two(mm, x, jnp.broadcast_to(w1, (b, *w1.shape)) * 2, jnp.broadcast_to(w2, (b, *w2.shape)) * 2)

    for fn in (two, batched_two):
        want = grad_products(functools.partial(fn, jnp.matmul), policy, xs)
        assert grad_products(functools.partial(fn, jax_cute.matmul), policy, xs) == want, fn.__name__


def test_gradients_under_a_policy_are_those_without_checkpoint():
    """Saving the products changes no value: the gradients are those of the model without
    ``jax.checkpoint`` (the kernelized numerics), and close to the plain model's in float32."""
    x, w1, w2 = args((16, 24), key=3)
    pol = jax.checkpoint_policies.dots_saveable
    step = lambda f: jax.jit(jax.grad(f, argnums=(0, 1, 2)))  # noqa: E731
    got = step(jax.checkpoint(jax_cute.kernelize(mlp), policy=pol))(x, w1, w2)
    same = step(jax_cute.kernelize(mlp))(x, w1, w2)
    f32 = step(mlp)(*(v.astype(jnp.float32) for v in (x, w1, w2)))
    for g, s, r in zip(got, same, f32):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(s, np.float32))
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r), rtol=0.1, atol=0.05)


def test_offloading_policy_recomputes_with_a_log_line(caplog):
    xs = args((16, 24))
    pol = jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    with caplog.at_level(logging.INFO, logger="jax_cute"):
        n = grad_products(jax_cute.kernelize(mlp), pol, xs)
    assert n == grad_products(jax_cute.kernelize(mlp), "nothing_saveable", xs)
    assert "offloads it" in caplog.text and "recomputed" in caplog.text


def test_fp8_products_are_saved_as_dots():
    """The block-scaled GEMMs (kernelize's fp8 recipe) count as dots too."""
    ks = jax.random.split(jax.random.key(5), 2)
    x = jax.random.normal(ks[0], (128, 256), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(ks[1], (256, 256), jnp.float32) / 16).astype(jnp.bfloat16)

    def f(x, w):
        return jnp.sum(jnp.sin(jnp.sin(x @ w) @ w).astype(jnp.float32))

    fp8 = jax_cute.kernelize(f, fp8="blockwise")
    saved = grad_products(lambda x, w, _: fp8(x, w), "dots_saveable", (x, w, w))
    recomputed = grad_products(lambda x, w, _: fp8(x, w), "nothing_saveable", (x, w, w))
    assert saved < recomputed


def test_only_real_effects_force_a_save():
    """As in JAX's own rule, an axis-name effect (a GEMM inside ``shard_map``) leaves the choice to
    the policy; any other effect saves the product."""
    from jax._src import core as jax_core
    from jax._src.debugging import DebugEffect
    from jax.interpreters import partial_eval as pe

    x = jnp.ones((16, 24), jnp.bfloat16)
    eqn = next(e for e in jax.make_jaxpr(jax_cute.matmul)(x, x.T).eqns if e.primitive.name.startswith("jax_cute"))
    rule = pe.partial_eval_jaxpr_custom_rules[eqn.primitive]
    recompute = jax.checkpoint_policies.nothing_saveable
    for effects, staged in (({jax_core.NamedAxisEffect("i")}, True), ({DebugEffect()}, False), (set(), True)):
        known, again, *_ = rule(recompute, [False, False], [True, True], eqn.replace(effects=effects))
        assert known is not None and (again is not None) == staged, effects
