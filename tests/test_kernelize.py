"""``jax_cute.kernelize`` on CPU: the rewritten function equals the original (values and
gradients) under every order of jit, grad, vmap, checkpoint, scan and export; the report and
strict mode say what stayed XLA's; lowered for sm_90a, the products are jax_cute's kernels.

On CPU jax_cute's primitives lower to their reference (plain lax ops), so a kernelized function
computes the same bf16 products in a different order: values agree to bf16 rounding.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_cute
from jax_cute.kernelize import KernelizeReport

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

BF16 = jnp.bfloat16
PRODUCTS = ("dot_general", "ragged_dot_general")
JAX_CUTE = ("jax_cute_matmul", "jax_cute_ragged_m", "jax_cute_ragged_k")


def _count(jaxpr, names) -> int:
    """Equations named in ``names`` in ``jaxpr`` and all its sub-jaxprs."""
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    n = 0
    for eqn in inner.eqns:
        n += eqn.primitive.name in names
        for v in eqn.params.values():
            for s in v if isinstance(v, tuple) else (v,):
                if isinstance(s, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
                    n += _count(s, names)
    return n


def assert_trees_close(a, b, rtol: float = 2e-2) -> None:
    """Leaf-wise agreement to ``rtol`` of the leaf's scale (bf16 products: ~3 digits)."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        assert x.shape == y.shape
        scale = max(float(np.max(np.abs(x))), 1e-3)
        np.testing.assert_allclose(x, y, rtol=0, atol=rtol * scale)


def _normal(key: int, shape, dtype=BF16, scale: float = 1.0):
    return (scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)).astype(dtype)


# -- one function with every higher-order primitive kernelize enters ---------------------------

@jax.custom_vjp
def _custom_matmul(x, w):
    return x @ w


_custom_matmul.defvjp(lambda x, w: (x @ w, (x, w)), lambda r, g: (g @ r[1].T, r[0].T @ g))


_BIAS = np.linspace(-0.5, 0.5, 16).astype(jnp.bfloat16)


def _everything(x, w):
    def layer(c, wi):
        return jax.checkpoint(lambda c: jnp.tanh(c @ wi))(c), jnp.sum(c.astype(jnp.float32))

    x, _ = lax.scan(layer, x, jnp.stack([w, w]))
    x = lax.cond(jnp.sum(x.astype(jnp.float32)) > 0, lambda x: jnp.tanh(x @ w), lambda x: x, x)
    x = lax.fori_loop(0, 2, lambda i, c: jnp.tanh(jnp.einsum("bk,kn->bn", c, w)), x)  # a scan
    x = jax.jit(lambda x: jnp.dot(x, w) + _BIAS)(x)  # a body with a constant
    x = _custom_matmul(jax.nn.relu(x), w)
    return jnp.sum(jnp.square(x.astype(jnp.float32)))


X, W = _normal(0, (8, 16)), _normal(1, (16, 16), scale=0.25)


def test_every_product_becomes_jax_cute_and_values_match():
    f = jax_cute.kernelize(_everything)
    assert f.report is None
    np.testing.assert_allclose(f(X, W), _everything(X, W), rtol=2e-2)
    assert isinstance(f.report, KernelizeReport)
    assert [p.where for p in f.report.products] == ["scan/remat2", "cond", "scan", "jit", "custom_vjp_call"]
    assert not f.report.left_to_xla
    jaxpr = jax.make_jaxpr(f)(X, W)
    assert _count(jaxpr, PRODUCTS) == 0 and _count(jaxpr, JAX_CUTE) == 5


# (the jitted orders: sweeps, CI's second step)
@pytest.mark.parametrize("order", ["grad(kernelize)", "kernelize(grad)", *(pytest.param(o, marks=pytest.mark.sweep) for o in (
    "jit(grad(kernelize))", "jit(kernelize(grad))", "grad(jit(kernelize))"))])
def test_gradients_match_in_any_order(order):
    grad = functools.partial(jax.grad, argnums=(0, 1))
    k = jax_cute.kernelize
    f = {"grad(kernelize)": lambda: grad(k(_everything)),
         "kernelize(grad)": lambda: k(grad(_everything)),
         "jit(grad(kernelize))": lambda: jax.jit(grad(k(_everything))),
         "jit(kernelize(grad))": lambda: jax.jit(k(grad(_everything))),
         "grad(jit(kernelize))": lambda: grad(jax.jit(k(_everything)))}[order]()
    assert_trees_close(f(X, W), grad(_everything)(X, W))
    if order.startswith("kernelize") or order.startswith("jit(kernelize"):
        jaxpr = jax.make_jaxpr(f)(X, W)
        assert _count(jaxpr, PRODUCTS) == 0  # the backward products are rewritten too


def test_vmap_either_side():
    xs = jnp.stack([X, -X, 2 * X])
    want = jax.vmap(_everything, (0, None))(xs, W)
    np.testing.assert_allclose(jax.vmap(jax_cute.kernelize(_everything), (0, None))(xs, W), want, rtol=2e-2)
    np.testing.assert_allclose(jax_cute.kernelize(jax.vmap(_everything, (0, None)))(xs, W), want, rtol=2e-2)


def test_while_loop_body():
    def f(x, w):
        return lax.while_loop(lambda c: c[1] < 3, lambda c: (jnp.tanh(c[0] @ w), c[1] + 1), (x, 0))[0]

    k = jax_cute.kernelize(f)
    assert_trees_close(jax.jit(k)(X, W), f(X, W))
    assert [p.where for p in k.report.products] == ["while"] and not k.report.left_to_xla


def test_kernelize_inside_a_scan_body_closing_over_tracers():
    def f(x, ws):
        def layer(c, w):
            return jax_cute.kernelize(lambda c: jnp.tanh(c @ w))(c), None  # closes over the scanned w
        return lax.scan(layer, x, ws)[0]

    ws = jnp.stack([W, W.T, W])
    assert_trees_close(jax.jit(f)(X, ws), lax.scan(lambda c, w: (jnp.tanh(c @ w), None), X, ws)[0])
    assert _count(jax.make_jaxpr(f)(X, ws), JAX_CUTE) == 1


def test_pytrees_kwargs_and_static_leaves():
    def f(params, x, *, act, scale):
        return {"y": act(x @ params["w"]) * scale, "n": jnp.sum(x.astype(jnp.float32))}

    params = {"w": W}
    got = jax.jit(jax_cute.kernelize(f), static_argnames="act")(params, X, act=jnp.tanh, scale=2.0)
    want = f(params, X, act=jnp.tanh, scale=2.0)
    assert set(got) == {"y", "n"}
    assert_trees_close(got, want)


# -- fused epilogues ----------------------------------------------------------------------------

def _layers(x, w, b):
    """One product per activation kernelize fuses, with the biases and casts models write."""
    h = jnp.dot(x, w, preferred_element_type=jnp.float32) + b             # bias (N,): a broadcast_in_dim
    h1 = jax.nn.gelu(h).astype(BF16)                                        # tanh gelu, cast fused
    h2 = jax.nn.gelu(x @ w + jnp.reshape(b.astype(BF16), (1, -1)), approximate=False)  # Flax's (1, N) bias
    h3 = jax.nn.silu(jnp.einsum("bk,kn->bn", x, w))
    h4 = jax.nn.relu(x @ w)
    return h1, h2, h3, h4


def test_activations_after_a_product_are_fused():
    x, w, b = _normal(0, (8, 16)), _normal(1, (16, 24), scale=0.25), _normal(2, (24,), jnp.float32)
    k = jax_cute.kernelize(_layers)
    got, want = jax.jit(k)(x, w, b), _layers(x, w, b)
    assert_trees_close(got, want)
    assert [g.dtype for g in got] == [w_.dtype for w_ in want]
    assert [p.epilogue for p in k.report.products] == ["bias + gelu", "bias + gelu_exact", "silu", "relu"]
    assert k.report.products[0].out_dtype == "bfloat16"  # the cast after gelu is the fused output dtype
    jaxpr = str(jax.make_jaxpr(k)(x, w, b))
    assert jaxpr.count("jax_cute_matmul_fused") == 4 and "tanh" not in jaxpr and "erf" not in jaxpr
    # the (N,) bias is read from the array the model broadcast, not from the broadcast matrix
    assert "bias_layout=((8,), (24,), (1,)):((0,), (1,), (0,))" in jaxpr.replace("\n", " ")
    loss = lambda f: lambda x, w, b: sum(jnp.sum(jnp.square(h.astype(jnp.float32))) for h in f(x, w, b))  # noqa
    assert_trees_close(jax.grad(loss(k), argnums=(0, 1, 2))(x, w, b), jax.grad(loss(_layers), argnums=(0, 1, 2))(x, w, b))


def test_epilogues_used_elsewhere_or_hand_written_stay_unfused():
    x, w = _normal(0, (8, 16)), _normal(1, (16, 24), scale=0.25)

    def f(x, w):
        z = x @ w
        h = x @ w
        return jax.nn.gelu(z), z, 0.5 * h * (1 + jnp.tanh(0.79788456 * (h + 0.044715 * h ** 3)))

    k = jax_cute.kernelize(f)
    assert_trees_close(k(x, w), f(x, w))
    assert [p.epilogue for p in k.report.products] == ["", ""]  # z is also an output; h's gelu is hand-written
    plain = jax_cute.kernelize(_layers, fuse_epilogues=False)
    b = _normal(2, (24,), jnp.float32)
    assert "jax_cute_matmul_fused" not in str(jax.make_jaxpr(plain)(x, w, b))


def test_a_transposed_product_is_fused_with_its_operands_swapped():
    x, w, b = _normal(0, (8, 16)), _normal(1, (24, 16), scale=0.25), _normal(2, (24,))

    def f(x, w, b):  # vmap of w @ x + b (Equinox's Linear) is transpose(w·xᵀ) + b
        return jax.nn.silu(jax.vmap(lambda v: w @ v + b)(x))

    def g(x, w, b):  # a transpose that moves the batch axis is not an operand swap: unfused
        return jax.nn.silu(jnp.einsum("bik,bjk->bij", x.reshape(2, 4, 16), w.reshape(2, 12, 16))
                           .transpose(1, 0, 2) + b[:12])

    for fn, fused in ((f, "bias + silu"), (g, "")):
        k = jax_cute.kernelize(fn)
        assert_trees_close(jax.jit(k)(x, w, b), fn(x, w, b))
        assert [p.epilogue for p in k.report.products] == [fused]
    loss = lambda f: lambda *a: jnp.sum(jnp.square(f(*a).astype(jnp.float32)))  # noqa: E731
    assert_trees_close(jax.grad(loss(jax_cute.kernelize(f)), argnums=(0, 1, 2))(x, w, b),
                       jax.grad(loss(f), argnums=(0, 1, 2))(x, w, b))


def test_fused_epilogue_lowers_to_one_kernel_for_sm90a():
    x, w, b = (jax.ShapeDtypeStruct(s, d) for s, d in (((256, 128), BF16), ((128, 256), BF16), ((256,), BF16)))
    f = jax_cute.kernelize(lambda x, w, b: jax.nn.gelu(x @ w + b))
    with jax_cute.config.override(target_arch="sm_90a"):
        text = jax.jit(f).trace(x, w, b).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @jax_cute_launch") == 1 and "tanh" not in text


# -- models ------------------------------------------------------------------------------------

def _scan_model(params, x):
    """A pre-norm MLP stack, layers under lax.scan, each rematerialised (f32 masters, bf16 math)."""
    def layer(h, p):
        def block(h):
            z = h / jnp.sqrt(jnp.mean(jnp.square(h), -1, keepdims=True) + 1e-6)
            u = jax.nn.gelu(jnp.matmul(z.astype(BF16), p["w1"].astype(BF16), preferred_element_type=jnp.float32))
            return h + jnp.matmul(u.astype(BF16), p["w2"].astype(BF16), preferred_element_type=jnp.float32)
        return jax.checkpoint(block)(h), None

    h, _ = lax.scan(layer, x, params)
    return jnp.mean(jnp.square(h))


def test_scan_over_layers_with_checkpoint():
    d, layers = 32, 3
    params = {"w1": _normal(2, (layers, d, 4 * d), jnp.float32, d ** -0.5),
              "w2": _normal(3, (layers, 4 * d, d), jnp.float32, (4 * d) ** -0.5)}
    x = _normal(4, (16, d), jnp.float32)
    k = jax_cute.kernelize(_scan_model)
    np.testing.assert_allclose(jax.jit(k)(params, x), _scan_model(params, x), rtol=1e-2)
    assert_trees_close(jax.jit(jax.grad(k))(params, x), jax.grad(_scan_model)(params, x))
    assert [p.where for p in k.report.products] == ["scan/remat2"] * 2
    assert all(p.dtypes == ("bfloat16", "bfloat16") for p in k.report.products)
    # gelu and the cast after it are the first product's epilogue: it writes bf16 directly
    assert [(p.out_dtype, p.epilogue) for p in k.report.products] == [("bfloat16", "gelu"), ("float32", "")]


def _moe(params, x, top_k: int = 2):
    """Top-k routing over experts; tokens sorted by expert run through two lax.ragged_dots."""
    logits = x.astype(jnp.float32) @ params["router"]                      # f32 router: left to XLA
    weights, experts = lax.top_k(jax.nn.softmax(logits), top_k)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat)
    tokens = jnp.repeat(x, top_k, axis=0)[order]
    sizes = jnp.bincount(flat, length=params["w1"].shape[0]).astype(jnp.int32)
    h = jax.nn.gelu(lax.ragged_dot(tokens, params["w1"], sizes, preferred_element_type=jnp.float32))
    y = lax.ragged_dot(h.astype(BF16), params["w2"], sizes, preferred_element_type=jnp.float32)
    y = jnp.zeros_like(y).at[order].set(y).reshape(x.shape[0], top_k, -1)
    return jnp.sum(y * weights[..., None], axis=1)


def _moe_params(d: int = 32, f: int = 64, e: int = 4):
    return {"router": _normal(5, (d, e), jnp.float32), "w1": _normal(6, (e, d, f), BF16, d ** -0.5),
            "w2": _normal(7, (e, f, d), BF16, f ** -0.5)}


def test_moe_with_ragged_dot_values_and_gradients():
    params, x = _moe_params(), _normal(8, (24, 32))
    loss = lambda p, x: jnp.mean(jnp.square(_moe(p, x)))  # noqa: E731
    k = jax_cute.kernelize(loss)
    np.testing.assert_allclose(jax.jit(k)(params, x), loss(params, x), rtol=2e-2)
    kinds = [(p.primitive, p.kernelized) for p in k.report.products]
    assert kinds == [("dot_general", False), ("ragged_dot_general", True), ("ragged_dot_general", True)]
    # the gelu after the first grouped product, and the cast after it, are its epilogue
    assert [p.epilogue for p in k.report.products] == ["", "gelu", ""]
    assert "jax_cute_ragged_fused" in str(jax.make_jaxpr(k)(params, x))
    want = jax.grad(loss, argnums=(0, 1))(params, x)
    assert_trees_close(jax.jit(jax.grad(k, argnums=(0, 1)))(params, x), want)
    # kernelize(grad): the gradient's products take the f32 cotangent and a bf16 operand, which
    # no kernel takes as they are (rounding the cotangent would change the math): left to XLA.
    kg = jax_cute.kernelize(jax.grad(loss, argnums=(0, 1)))
    assert_trees_close(jax.jit(kg)(params, x), want)
    backward = [p for p in kg.report.products if p.primitive == "ragged_dot_general"][2:]
    assert len(backward) == 4 and all("dtypes differ" in p.reason for p in backward)


def test_ragged_dot_gradient_forms_become_grouped_gemms():
    """lax.ragged_dot's gradient binds ragged_dot_general with two other dimension numbers (the
    rhs contracted on its last axis; the lhs ragged along the contraction): both are rewritten."""
    x, w, sizes = _normal(9, (40, 32)), _normal(10, (3, 32, 64), scale=0.2), jnp.array([16, 0, 20], jnp.int32)
    loss = lambda x, w: jnp.sum(jnp.square(lax.ragged_dot(x, w, sizes).astype(jnp.float32)))  # noqa: E731
    grad = jax.grad(loss, argnums=(0, 1))
    k = jax_cute.kernelize(grad)
    assert_trees_close(jax.jit(k)(x, w), grad(x, w))
    assert [p.kernelized for p in k.report.products] == [True] * 3
    jaxpr = jax.make_jaxpr(k)(x, w)
    assert _count(jaxpr, ("ragged_dot_general",)) == 0
    assert _count(jaxpr, ("jax_cute_ragged_m",)) == 2 and _count(jaxpr, ("jax_cute_ragged_k",)) == 1
    # their own gradients (second order) come from jax_cute's autodiff rules; lax has none for
    # a ragged contraction, so compare with the same product written densely
    groups = jnp.repeat(jnp.arange(4), jnp.append(sizes, 4), total_repeat_length=40)  # tail rows: none
    dense = lambda x, w: jnp.einsum("mk,mg,gkn->mn", x, jax.nn.one_hot(groups, 3, dtype=x.dtype), w)  # noqa: E731
    dense_loss = lambda x, w: jnp.sum(jnp.square(dense(x, w).astype(jnp.float32)))  # noqa: E731
    second = lambda g: jax.grad(lambda x, w: jnp.sum(g(x, w)[1].astype(jnp.float32)))  # noqa: E731
    assert_trees_close(second(k)(x, w), second(jax.grad(dense_loss, argnums=(0, 1)))(x, w))


# -- what stays XLA's, the report, strict mode --------------------------------------------------

def test_products_no_kernel_takes_stay_xla_with_a_reason():
    a32, ai = X.astype(jnp.float32), X.astype(jnp.int8)
    rd = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((1,), (1,)), ((), ())),
                                       lhs_ragged_dimensions=(1,), rhs_group_dimensions=())

    def f(x, w):
        return (x @ w,                                                          # kernelized
                a32 @ w.astype(jnp.float32),                                    # f32 operands
                lax.dot(ai, ai.T, preferred_element_type=jnp.int32),            # integers
                lax.dot_general(x, w.astype(jnp.float32), (((1,), (0,)), ((), ()))),  # mixed dtypes
                lax.dot(x, w, precision=lax.DotAlgorithmPreset.F32_F32_F32),  # an algorithm kernels lack
                lax.ragged_dot_general(x, x, jnp.array([4, 12], jnp.int32), rd))  # ragged contraction

    k = jax_cute.kernelize(f)
    for got, want in zip(k(X, W), f(X, W)):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=1e-2)
    kept = [(p.kernelized, p.reason) for p in k.report.products]
    assert kept[0] == (True, None)
    for (done, why), words in zip(kept[1:], ["float32 operands", "integer product", "dtypes differ",
                                             "dot algorithm", "ragged dimension numbers"]):
        assert not done and words in why
    text = str(k.report)
    assert text.startswith("kernelize: 6 products, 1 as jax_cute primitives on their reference path (no CUDA "
                           "device is visible"), text
    assert text.splitlines()[0].endswith(", 5 left to XLA")
    assert "jax_cute dot_general bfloat16[8, 16] x bfloat16[16, 16] -> bfloat16[8, 16]" in text


@pytest.mark.parametrize("preset", ["DEFAULT", "BF16_BF16_F32"])
def test_dot_algorithms_the_kernels_compute_are_kernelized(preset):
    f = lambda x, w: lax.dot(x, w, precision=getattr(lax.DotAlgorithmPreset, preset))  # noqa: E731
    k = jax_cute.kernelize(f)
    np.testing.assert_allclose(np.float32(k(X, W)), np.float32(f(X, W)), rtol=2e-2, atol=1e-2)
    assert [p.kernelized for p in k.report.products] == [True]


@pytest.mark.parametrize("mlp", [False, True], ids=["layer", "mlp"])
def test_out_sharding_is_kept(mlp):
    """A product with an explicit out_sharding (lax takes one on Explicit mesh axes only) runs on
    jax_cute fused with its epilogue (bias and gelu), the fused result resharded to the
    epilogue's type, gradients too; it feeds no chain (the next product takes the activated
    result as an operand)."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    b = jnp.asarray(np.random.default_rng(3).standard_normal(W.shape[1]), jnp.bfloat16)
    layer = lambda x, w, b: jax.nn.gelu(jnp.matmul(x, w, out_sharding=P("x", None)) + b)  # noqa: E731
    f = (lambda x, w, b: jnp.matmul(layer(x, w, b), w.T, out_sharding=P("x", None))) if mlp else layer  # noqa: E731
    loss = lambda g: lambda x, w, b: jnp.sum(jnp.square(g(x, w, b).astype(jnp.float32)))  # noqa: E731
    with jax.set_mesh(mesh):
        k = jax_cute.kernelize(f)
        got, want = jax.jit(k)(X, W, b), f(X, W, b)
        np.testing.assert_allclose(np.float32(got), np.float32(want), rtol=2e-2, atol=2e-2)
        assert jax.typeof(got).sharding.spec == jax.typeof(want).sharding.spec
        assert_trees_close(jax.jit(jax.grad(loss(k), (0, 1, 2)))(X, W, b), jax.grad(loss(f), (0, 1, 2))(X, W, b))
    assert [(p.kernelized, p.epilogue, p.chained) for p in k.report.products] == (
        [(True, "bias + gelu", ""), (True, "", "")] if mlp else [(True, "bias + gelu", "")]), k.report.products


@pytest.mark.parametrize("check_vma", [True, False])
def test_shard_map_body_is_rewritten(check_vma):
    """kernelize enters a shard_map (here over one device, with a collective in its body): the
    products inside run on jax_cute, values and gradients equal the original's."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    body = lambda x, w: lax.psum(jnp.tanh(x @ w) @ w.T, "x")  # noqa: E731
    f = jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P(), check_vma=check_vma)
    k = jax_cute.kernelize(f)
    assert_trees_close(jax.jit(k)(X, W), f(X, W))
    assert [(p.kernelized, p.where) for p in k.report.products] == [(True, "shard_map")] * 2
    loss = lambda g: lambda x, w: jnp.sum(jnp.square(g(x, w).astype(jnp.float32)))  # noqa: E731
    assert_trees_close(jax.jit(jax.grad(loss(k), (0, 1)))(X, W), jax.grad(loss(f), (0, 1))(X, W))
    assert _count(jax.make_jaxpr(k)(X, W), JAX_CUTE) == 2


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("grouped", [False, True], ids=["dense", "ragged"])
def test_activation_is_fused_inside_shard_map(grouped, check_vma):
    """Inside shard_map gelu's constants are traced as pvary'd literals; the epilogue is still
    fused, as outside, so a shard_map body computes what the unsharded function does (the
    fused epilogue rounds its pre-activation as the unfused one does not), gradients included."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    sizes = jnp.array([3, 5], jnp.int32)
    w2 = jnp.stack([W, W.T]) if grouped else W

    def body(x, w):
        h = (lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32) if grouped
             else jnp.matmul(x, w, preferred_element_type=jnp.float32))
        return jax.nn.gelu(h).astype(jnp.bfloat16)

    plain = jax_cute.kernelize(body)
    sharded = jax_cute.kernelize(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"),
                                               check_vma=check_vma))
    loss = lambda g: lambda x, w: jnp.sum(jnp.square(g(x, w).astype(jnp.float32)))  # noqa: E731
    for f in (lambda g: g, lambda g: jax.grad(loss(g), (0, 1))):
        got, want = jax.jit(f(sharded))(X, w2), jax.jit(f(plain))(X, w2)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.float32(a), np.float32(b))
    (p,) = sharded.report.products
    assert (p.epilogue, p.where) == ("gelu", "shard_map")


def test_report_logged_when_asked(caplog):
    k = jax_cute.kernelize(lambda x, w: x @ w, report=True)
    with caplog.at_level("WARNING", logger="jax_cute"):
        k(X, W)
    assert "kernelize: 1 products, 1 as jax_cute primitives on their reference path" in caplog.text
    with jax_cute.config.override(target_arch="sm_90a"), caplog.at_level("WARNING", logger="jax_cute"):
        k(X, W)  # lowered for a GPU target, the products run the kernels
    assert "kernelize: 1 products, 1 on jax_cute, 0 left to XLA" in caplog.text


def test_strict_mode_treats_a_product_alike_through_kernelize_and_matmul():
    """On the CPU as on a GPU: a product no kernel takes raises in strict mode when traced,
    whether kernelize or jax_cute.matmul meets it."""
    a32 = X.astype(jnp.float32)
    with jax_cute.config.override(strict=True):
        for call in (lambda: jax_cute.kernelize(lambda a: a @ a.T)(a32), lambda: jax_cute.matmul(a32, a32.T),
                     lambda: jax.jit(lambda a: jax_cute.dot_general(a, a, (((1,), (1,)), ((), ()))))(a32),
                     lambda: jax_cute.ragged_dot(a32, a32.T[None], jnp.array([8]))):
            with pytest.raises(jax_cute.FallbackError, match="float32"):
                call()
        jax_cute.matmul(X, W)  # a kernel takes it: nothing raised on the CPU


def test_strict_mode_raises_on_a_product_left_to_xla():
    f = jax_cute.kernelize(lambda x, w: (x @ w).astype(jnp.float32) @ w.astype(jnp.float32))
    with jax_cute.config.override(strict=True):
        with pytest.raises(jax_cute.FallbackError, match="float32 operands"):
            f(X, W)
        jax_cute.kernelize(_everything)(X, W)  # everything kernelized: nothing raised


# -- export and CUDA lowering -------------------------------------------------------------------

def test_export_runs_on_cpu():
    exp = jax.export.export(jax.jit(jax_cute.kernelize(jax.grad(_everything))), platforms=["cpu"])(X, W)
    assert_trees_close(exp.call(X, W), jax.grad(_everything)(X, W))


def _cuda_text(f, *args) -> str:
    with jax_cute.config.override(target_arch="sm_90a"):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_export_for_cuda():
    pytest.importorskip("cutlass")
    x, w = _normal(0, (128, 64)), _normal(1, (64, 128))
    f = jax_cute.kernelize(lambda x, w: jnp.sum(jnp.tanh(x @ w).astype(jnp.float32)))
    with jax_cute.config.override(target_arch="sm_90a"):
        exp = jax.export.export(jax.jit(jax.grad(f)), platforms=["cuda"],
                                disabled_checks=jax_cute.export_disabled_checks())(x, w)
    text = exp.mlir_module()
    assert "jax_cute_launch" in text and "dot_general" not in text


GPT_SIZE = dict(vocab=256, d_model=128, heads=2, layers=1, seq=64, batch=2)  # head_dim 64


def _gpt_step(moe: bool):
    import gpt_training

    cfg = gpt_training.Config(**GPT_SIZE, moe=moe, experts=4)
    params, opt_state, tx = gpt_training.init_train_state(jax.random.key(0), cfg)
    tokens = jax.random.randint(jax.random.key(1), (cfg.batch, cfg.seq + 1), 0, cfg.vocab)
    return gpt_training, cfg, (params, opt_state, tokens), tx


def test_gpt_step_every_product_becomes_jax_cute():
    gpt, cfg, args, tx = _gpt_step(moe=False)
    plain = jax.make_jaxpr(gpt.make_step(cfg, tx, kernelized=False))(*args)
    kern = jax.make_jaxpr(gpt.make_step(cfg, tx, kernelized=True))(*args)
    assert _count(kern, PRODUCTS) == 0
    # the MLP's gelu is fused into its first product (jax_cute_matmul_fused, a GEMM too), and its
    # derivative into the backward GEMM of the second (jax_cute_matmul_dact, a GEMM too)
    gemms = ("jax_cute_matmul", "jax_cute_matmul_fused", "jax_cute_matmul_dact")
    assert _count(kern, gemms) >= _count(plain, ("dot_general",)) > 10
    assert _count(kern, ("jax_cute_matmul_fused",)) >= 1 and _count(kern, ("jax_cute_matmul_dact",)) >= 1


def test_gpt_mlp_lowers_for_sm90a_without_an_xla_dot():
    pytest.importorskip("cutlass")
    gpt, cfg, (params, _, tokens), _ = _gpt_step(moe=False)
    layer = jax.tree.map(lambda p: p[0], params["layers"])
    x = _normal(3, (cfg.batch, cfg.seq, cfg.d_model), jnp.float32)
    loss = jax_cute.kernelize(lambda p, x: jnp.sum(gpt.mlp(p, x, cfg)))
    text = _cuda_text(jax.grad(loss, argnums=(0, 1)), layer, x)
    assert "jax_cute_launch" in text and "dot_general" not in text
    head = jax_cute.kernelize(lambda e, x: jnp.sum(gpt.logits({"embed": e}, x, cfg)))  # the LM head
    text = _cuda_text(jax.grad(head, argnums=(0, 1)), params["embed"], x)
    assert "jax_cute_launch" in text and "dot_general" not in text


def test_gpt_step_lowers_for_sm90a_without_an_xla_dot():
    """Every product of the kernelized GPT step, attention's two-batch-mode einsums and their
    gradients included, lowers to our kernels: no XLA dot is left."""
    pytest.importorskip("cutlass")
    gpt, cfg, args, tx = _gpt_step(moe=False)
    text = _cuda_text(gpt.make_step(cfg, tx, kernelized=True), *args)
    assert "jax_cute_launch" in text
    assert "dot_general" not in text
