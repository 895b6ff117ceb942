"""Sharding: the partitioning rules of the GEMM primitives, shard_map, and ``out_sharding``.

The layout mapping is unit-tested here. The multi-device checks need 8 CPU devices, which
must be set before JAX starts, while the rest of the suite runs on one: this file runs itself
in a subprocess (``python tests/test_sharding.py``, once per partitioner) that computes every
case and prints the results as JSON, and the tests assert on them.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import shared_result  # tests/ is on sys.path: under pytest, and run as a script

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEVICES = 8
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all")


# -- localize: layouts of local buffers (in-process) ---------------------------------------------

def test_localize_row_major_operand_sharded_on_either_axis():
    from jax_cute.layout import Layout, make_layout
    from jax_cute.primitives.sharding import localize

    a = make_layout(Layout((8,), (16,)), Layout((16,), (1,)), Layout((1,), (0,)))  # (M, K) row-major
    rows = localize(a, (8, 16), (2, 16))
    assert rows == make_layout(Layout((2,), (16,)), Layout((16,), (1,)), Layout((1,), (0,)))
    cols = localize(a, (8, 16), (8, 4))  # a sharded axis divides the strides of slower ones
    assert cols == make_layout(Layout((8,), (4,)), Layout((4,), (1,)), Layout((1,), (0,)))


def test_localize_transposed_and_batched_operands():
    from jax_cute.layout import Layout, make_layout
    from jax_cute.primitives.sharding import localize

    # transpose_a: the buffer holds (K, M); M is the fast axis
    at = make_layout(Layout((8,), (1,)), Layout((16,), (8,)), Layout((1,), (0,)))
    assert localize(at, (16, 8), (4, 8)) == make_layout(Layout((8,), (1,)), Layout((4,), (8,)), Layout((1,), (0,)))
    # vmap over axis 0 of (3*2, 4, 8): L sub-mode (6):(32); a broadcast operand's L has stride 0
    # and only the caller knows its shard count
    m, k = Layout((4,), (8,)), Layout((8,), (1,))
    lv = make_layout(m, k, Layout((6,), (32,)))
    assert localize(lv, (6, 4, 8), (3, 4, 8)) == make_layout(m, k, Layout((3,), (32,)))
    bn, bk = Layout((8,), (1,)), Layout((4,), (8,))
    bc = make_layout(bn, bk, Layout((6,), (0,)))
    assert localize(bc, (4, 8), (4, 8), divisors=(1, 1, 2)) == make_layout(bn, bk, Layout((3,), (0,)))


def test_localize_axis_split_into_sub_modes():
    from jax_cute.layout import Layout
    from jax_cute.primitives.sharding import localize

    split = Layout(((2, 4),), ((1, 2),))  # one axis of 8 as two sub-modes; the slow one has 4
    assert localize(split, (8,), (4,)) == Layout(((2, 2),), ((1, 2),))
    assert localize(split, (8,), (2,)) == Layout(((2, 1),), ((1, 0),))
    assert localize(split, (8,), (1,)) is None  # 8 shards do not divide the slow sub-mode's 4
    assert localize(Layout((4,), (1,)), (8,), (4,)) is None  # no sub-mode reaches the axis's end
    assert localize(Layout(((4, 2),), ((2, 1),)), (8,), (4,)) == Layout(((2, 2),), ((2, 1),))


def test_factors_of_a_gemm_and_the_shardy_rule():
    from jax_cute.problem.gemm_layouts import matmul_layouts
    from jax_cute.primitives.sharding import problem, sharding_rule

    layouts, _ = matmul_layouts((16, 32), (32, 64), False, False)
    p = problem(layouts, [(16, 32), (32, 64)])
    assert [o.axes for o in p.operands] == [(("m0",), ("k0",)), (("k0",), ("n0",)), (("m0",), ("n0",))]
    assert p.shardable == {"m0", "n0", "k0"}
    rule = sharding_rule(p)
    assert rule.reduction_factors == ("k0",) and rule.need_replication_factors == ()


def test_an_epilogue_operand_shards_with_c_and_a_gated_result_keeps_n_whole():
    """A bias read at C's coordinates holds C's N factor on its one axis (its M is a broadcast);
    swiglu's result (N/2 columns) maps its last axis to a factor of its own, replicated, and N
    is replicated too."""
    from jax_cute.primitives.fused import broadcast_bias_layout
    from jax_cute.primitives.sharding import problem, sharding_rule
    from jax_cute.problem.gemm_layouts import matmul_layouts

    layouts, _ = matmul_layouts((16, 32), (32, 64), False, False)
    bias = {"bias": ("mnl", broadcast_bias_layout("matmul", (64,), (16, 64), layouts))}
    p = problem(layouts, [(16, 32), (32, 64), (64,)], bias)
    assert [o.axes for o in p.operands] == [(("m0",), ("k0",)), (("k0",), ("n0",)), (("n0",),), (("m0",), ("n0",))]
    assert p.shardable == {"m0", "n0", "k0"}
    gated = problem(layouts, [(16, 32), (32, 64), (64,)], bias, whole="n")
    assert gated.shardable == {"m0", "k0"}
    rule = sharding_rule(gated, [(16, 32)])
    assert tuple(map(tuple, rule.result_mappings)) == (("m0", "own_0_1"),)
    assert set(rule.need_replication_factors) == {"n0", "own_0_1"} and rule.reduction_factors == ("k0",)


def test_an_axis_split_across_modes_that_cannot_follow_a_sharding_is_replicated():
    """A's rows read as M = (4, 2):(2K, K) (row 2*i0 + i1), the output's rows row-major: the slow
    part of A's axis is M's fast sub-mode, so no block sharding of A's rows is a block of C's."""
    from jax_cute.layout import Layout, make_layout
    from jax_cute.problem.gemm_layouts import GemmLayouts
    from jax_cute.primitives.sharding import plan, problem, sharding_rule

    k, n = 4, 6
    a = make_layout(Layout((4, 2), (2 * k, k)), Layout((k,), (1,)), Layout((1,), (0,)))
    b = make_layout(Layout((n,), (1,)), Layout((k,), (n,)), Layout((1,), (0,)))
    c = make_layout(Layout((8,), (n,)), Layout((n,), (1,)), Layout((1,), (0,)))
    p = problem(GemmLayouts(a, b, c, (8, n)), [(8, k), (k, n)])
    assert p.operand("a").axes[0] == ("m0", "m1") and p.operand("c").axes[0] == ("m1", "m0")
    assert p.shardable == {"n0", "k0"}
    assert set(sharding_rule(p).need_replication_factors) == {"m0", "m1"}
    pl = plan(p, {"x": 2}, [(("x",), ()), ((), ())])
    assert tuple(pl.spec(p.operand("a"))) == tuple(pl.spec(p.operand("c"))) == (None, None)


def test_ragged_rows_shard_by_their_slowest_factor_and_groups_stay_replicated():
    from jax_cute.problem.ragged_layouts import ragged_dot_layouts
    from jax_cute.primitives.sharding import problem, sharding_rule

    p = problem(ragged_dot_layouts(64, 32, 8, 16), [(64, 32), (8, 32, 16), (8,)])
    assert p.ragged == "m0" and "g0" not in p.shardable
    rule = sharding_rule(p)
    assert "g0" in rule.need_replication_factors and rule.reduction_factors == ("k0",)


def test_sharded_layers_example_on_one_device(capsys):
    sys.path.insert(0, str(ROOT / "examples"))
    import sharded_layers

    out = sharded_layers.main(["--tokens", "16", "--d", "32", "--h", "64"])
    assert out["tp_max_abs_diff"] < 1e-4 and out["ep_max_abs_diff"] < 1e-4
    printed = capsys.readouterr().out
    if out["devices"] == 1 and "CPU" in out["path"]:
        assert "path: reference path on CPU (no GPU found)" in printed


# -- multi-device checks (subprocess) ---------------------------------------------------------

def _script(key: str, devices: int, *argv: str, shardy: bool = True) -> shared_result.Script:
    env = shared_result.host_devices_env(devices, shardy)
    return shared_result.Script(key, [sys.executable, __file__, *argv], env=env, cwd=ROOT, timeout=900)


def _partitioner(shardy: bool) -> shared_result.Script:
    return _script(f"test_sharding-{'shardy' if shardy else 'gspmd'}", DEVICES, shardy=shardy)


def _types(devices: int) -> shared_result.Script:
    return _script(f"test_sharding-types-{devices}", devices, "types")


# each fixture's script, for its parameter (conftest starts them before the first test)
SUBPROCESS_FIXTURES = {"results": _partitioner, "typed": _types}


@pytest.fixture(scope="module", params=[pytest.param(True, id="shardy"),   # GSPMD: CI's second step (sweep)
                                        pytest.param(False, id="gspmd", marks=pytest.mark.sweep)])
def results(request):
    return _partitioner(request.param).result()


def _close(case: dict, tol: float = 1e-4):
    assert case["diff"] <= tol * max(1.0, case["scale"]), case


def test_data_parallel_rows_run_locally(results):
    case = results["data_parallel"]
    _close(case)
    assert case["fwd"] == dict.fromkeys(COLLECTIVES, 0)
    assert case["grad_diffs"] and max(case["grad_diffs"]) <= 1e-4 * case["grad_scale"]
    assert case["grad"]["all-gather"] == 0 and case["grad"]["all-reduce"] >= 1  # dW sums over rows


def test_column_parallel_weight_is_never_gathered(results):
    case = results["column_parallel"]
    _close(case)
    assert case["out_spec"] == ["data", "model"]
    assert case["fwd"] == dict.fromkeys(COLLECTIVES, 0)
    assert case["grad"]["all-gather"] == 0
    assert max(case["grad_diffs"]) <= 1e-4 * case["grad_scale"]


def test_row_parallel_product_has_one_reduction_and_no_gather(results):
    case = results["row_parallel"]
    _close(case)
    assert case["fwd"]["all-gather"] == 0
    assert case["fwd"]["all-reduce"] + case["fwd"]["reduce-scatter"] == 1
    scattered = results["row_parallel_scatter"]
    _close(scattered)
    assert scattered["out_spec"] in (["model"], ["model", None])
    assert scattered["fwd"] == {**dict.fromkeys(COLLECTIVES, 0), "reduce-scatter": 1}


def test_tensor_parallel_mlp_forward_and_gradients(results):
    case = results["mlp"]
    _close(case)
    assert max(case["grad_diffs"]) <= 1e-4 * case["grad_scale"]
    assert case["fwd"] == {**dict.fromkeys(COLLECTIVES, 0), "all-reduce": 1}
    assert case["grad"]["all-gather"] == 0


def test_fused_epilogue_runs_on_each_shards_blocks(results):
    """matmul with a bias and gelu: rows, columns (the bias with them) and K sharded; each shard runs
    the fused call on its blocks (on CUDA its kernel), a sharded K sums float32 partial products
    before the epilogue; forward and gradients within bf16's rounding of an f32 reference."""
    for name in ("dp", "column", "row", "column_swiglu"):
        case = results[f"fused_{name}"]
        _close(case, 1e-2)
        assert max(case["grad_diffs"]) <= 2e-2 * case["grad_scale"], (name, case)
        assert case["grad"]["all-gather"] == 0 or name == "column_swiglu", (name, case)
    assert results["fused_dp"]["fwd"] == dict.fromkeys(COLLECTIVES, 0)
    assert results["fused_column"]["fwd"] == dict.fromkeys(COLLECTIVES, 0)
    assert results["fused_column"]["out_spec"] == ["data", "model"]
    assert results["fused_row"]["fwd"] == {**dict.fromkeys(COLLECTIVES, 0), "all-reduce": 1}
    # swiglu pairs column j with j + N/2: N stays whole (the weight is gathered), rows stay sharded
    assert results["fused_column_swiglu"]["out_spec"] == ["data"]


def test_kernelized_tensor_parallel_mlp_keeps_its_fusions(results):
    """An unchanged MLP, kernelized, on a column- then row-parallel mesh: the fused first product
    and the backward's derivative-epilogue GEMM partition like the plain GEMM (one all-reduce
    forward, no gather)."""
    case = results["kernelized_mlp"]
    assert case["prims"] == ["jax_cute_matmul_fused", "jax_cute_matmul_dact"]
    _close(case, 2e-2)
    assert max(case["grad_diffs"]) <= 3e-2 * case["grad_scale"]
    assert case["fwd"] == {**dict.fromkeys(COLLECTIVES, 0), "all-reduce": 1}
    assert case["grad"]["all-gather"] == 0


def test_vmap_and_batched_einsum_keep_their_shardings(results):
    for name in ("vmap", "einsum_batch_heads", "dot_general_batch"):
        case = results[name]
        _close(case)
        assert case["fwd"] == dict.fromkeys(COLLECTIVES, 0), name


def test_ragged_dot_tokens_sharded(results):
    case = results["ragged_tokens"]
    _close(case)
    assert case["fwd"] == dict.fromkeys(COLLECTIVES, 0)  # each shard takes its groups from the global sizes
    assert max(case["grad_diffs"]) <= 1e-4 * case["grad_scale"]
    assert case["grad"]["all-gather"] == 0  # dW: one all-reduce over the rows
    _close(results["ragged_contracting"])
    assert results["ragged_contracting"]["fwd"]["all-reduce"] == 1


def test_fused_ragged_dot_tokens_sharded(results):
    """ragged_dot's bias and swiglu on sharded tokens: each shard runs its rows (the grouped GEMM
    partitions itself, the epilogue is elementwise), forward and gradients exact."""
    case = results["ragged_fused_tokens"]
    _close(case)
    assert case["fwd"] == dict.fromkeys(COLLECTIVES, 0)
    assert max(case["grad_diffs"]) <= 1e-4 * case["grad_scale"]


def test_fused_ragged_dot_columns_and_contraction_sharded(results):
    """ragged_dot's bias and gelu with the weight's columns sharded (the bias with them: no
    communication forward) and with K sharded (float32 partial products summed once, then the
    epilogue); within bf16's rounding of an f32 reference."""
    cols, k = results["ragged_fused_columns"], results["ragged_fused_contracting"]
    for case in (cols, k):
        _close(case, 1e-2)
        assert max(case["grad_diffs"]) <= 2e-2 * case["grad_scale"], case
        assert case["grad"]["all-gather"] == 0, case
    assert cols["fwd"] == dict.fromkeys(COLLECTIVES, 0) and cols["out_spec"] == ["data", "model"]
    assert k["fwd"] == {**dict.fromkeys(COLLECTIVES, 0), "all-reduce": 1}


def test_ragged_dot_experts_sharded_under_jit_are_gathered(results):
    """Documented: groups (experts) stay replicated under jit; the result is still exact."""
    case = results["ragged_experts_jit"]
    _close(case)
    assert max(case["grad_diffs"]) <= 1e-4 * case["grad_scale"]
    assert case["fwd"]["all-gather"] >= 1


def test_expert_parallel_moe_under_shard_map(results):
    case = results["moe_expert_parallel"]
    _close(case)
    assert max(case["grad_diffs"]) <= 1e-4 * case["grad_scale"]
    assert case["fwd"]["all-to-all"] >= 2 and case["fwd"]["all-gather"] == 0
    assert case["grad"]["all-gather"] == 0


def test_shard_map_with_vmap_and_grad_inside(results):
    """With shard_map's default check_vma: matmul and ragged_dot forward and gradients."""
    case = results["shard_map_vmap_grad"]
    _close(case)
    assert max(case["grad_diffs"]) <= 1e-4 * case["grad_scale"]
    _close(results["shard_map_ragged_vmap_grad"])  # its value holds the gradients taken inside


def test_out_sharding(results):
    for name in ("matmul", "dot_general", "einsum", "ragged_dot", "matmul_pspec"):
        case = results["out_sharding"][name]
        assert case["diff"] <= 1e-4 * max(1.0, case["scale"]), name
        assert case["spec"] == case["want"], (name, case)


def test_operand_sharded_over_a_sub_axis_is_read_as_replicated(results):
    case = results["sub_axis"]
    _close(case)
    assert max(case["grad_diffs"]) <= 1e-4 * case["grad_scale"], case
    assert case["log"], case
    assert case["out_spec"][0] == "data", case   # x's rows, which it can read, stay sharded


def test_layout_that_cannot_follow_a_sharding_runs_replicated(results):
    case = results["unlocalizable"]
    _close(case)
    assert case["fwd"]["all-gather"] >= 1


# -- sharding in types: Explicit and Auto meshes of 1, 2 and 8 devices (subprocess) ----------------

# (meshes of 1 and 2 devices: sweeps, CI's second step; the test line's mesh is 2 x 4)
@pytest.fixture(scope="module", params=[pytest.param(n, id=f"{n}dev", marks=() if n == DEVICES else pytest.mark.sweep)
                                        for n in (1, 2, DEVICES)])
def typed(request):
    return _types(request.param).result()


@pytest.mark.parametrize("mode", ["explicit", "auto"])
def test_products_on_typed_meshes_match_jax(typed, mode):
    """matmul, dot_general, einsum, ragged_dot, and matmul and ragged_dot with a fused bias and
    gelu: values and gradients equal jnp/lax's (bf16's rounding for the fused calls); on
    Explicit axes each result (and gradient) has the sharding type jnp/lax give theirs, and a
    bias gradient sums each shard's rows before summing across shards (no gather of the
    cotangent)."""
    if "skip" in typed:
        pytest.skip(typed["skip"])
    for name, case in typed[mode].items():
        _close(case, case["tol"])
        assert max(case["grad_diffs"]) <= case["tol"] * case["grad_scale"], name
        if mode == "explicit":
            assert case["spec"] == case["want"], (name, case)
            assert case["grad_specs"] == case["arg_specs"], (name, case)
    assert typed[mode]["matmul_bias_gelu"]["grad_gathers"] == typed[mode]["ragged_bias_gelu"]["grad_gathers"] == 0


def test_contraction_sharded_in_both_operands(typed):
    """As lax: on Explicit axes it needs out_sharding (lax's error without), and the result then
    has that sharding; on Auto axes the partitioner reduces."""
    if "skip" in typed:
        pytest.skip(typed["skip"])
    explicit, auto = typed["contracting"]["explicit"], typed["contracting"]["auto"]
    assert explicit["error"] and explicit["error"] == explicit["lax_error"]
    assert explicit["out_sharding_spec"] == ["x"], explicit
    assert auto["error"] is None
    _close(explicit)
    _close(auto)


# -- one GPU (pytest -m gpu): the kernels under the partitioning rules ------------------------------

GPU_TOL = 3e-2  # bf16 products and cotangents against the float32 unsharded computation


def _gpu_mesh(shape: tuple[int, ...], names: tuple[str, ...], axis_type: str = "Auto"):
    import jax

    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("no GPU")
    return jax.make_mesh(shape, names, axis_types=(getattr(jax.sharding.AxisType, axis_type),) * len(names),
                         devices=[gpu])


def _example():
    sys.path.insert(0, str(ROOT / "examples"))
    import sharded_layers

    return sharded_layers


def _check_on_gpu(f, ref, plain: tuple, sharded: tuple, mesh=None, tol: float = GPU_TOL) -> None:
    """``f`` on the ``sharded`` bf16 operands (under ``mesh`` when given: its axes are typed)
    against ``ref`` on the ``plain`` ones in float32: values, gradients of a sum of squares, and
    our kernels in the compiled forward and backward computations."""
    import contextlib

    import jax
    import jax.numpy as jnp
    import numpy as np

    nums = tuple(range(len(plain)))
    loss = lambda g: lambda *a: jnp.sum(g(*a).astype(jnp.float32) ** 2)  # noqa: E731
    rel = lambda a, b: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)) / jnp.max(jnp.abs(b)))  # noqa: E731
    wide = [jnp.asarray(np.asarray(x, np.float32)) for x in plain]
    with jax.default_matmul_precision("float32"):
        want, want_grads = jax.jit(ref)(*wide), jax.jit(jax.grad(loss(ref), nums))(*wide)
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        got, grads = jax.jit(f)(*sharded), jax.jit(jax.grad(loss(f), nums))(*sharded)
        texts = [jax.jit(fn).lower(*sharded).compile().as_text() for fn in (f, jax.grad(loss(f), nums))]
    assert rel(got, want) <= tol
    for i, (g, w) in enumerate(zip(grads, want_grads)):
        assert rel(g, w) <= tol, f"gradient {i}: {rel(g, w)}"
    assert all("jax_cute_launch" in t for t in texts), "a computation ran without jax_cute's kernels"


def _gpu_operands():
    import jax
    import jax.numpy as jnp

    k = jax.random.split(jax.random.PRNGKey(0), 4)
    x = jax.random.normal(k[0], (256, 512), jnp.bfloat16)
    w1 = (jax.random.normal(k[1], (512, 1024)) / 512 ** 0.5).astype(jnp.bfloat16)
    w2 = (jax.random.normal(k[2], (1024, 512)) / 1024 ** 0.5).astype(jnp.bfloat16)
    we = (jax.random.normal(k[3], (4, 512, 256)) / 512 ** 0.5).astype(jnp.bfloat16)
    return x, w1, w2, we


@pytest.mark.gpu
def test_gpu_data_and_tensor_parallel_on_one_device():
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_cute

    ex = _example()
    mesh = _gpu_mesh((1, 1), ("data", "model"))
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))  # noqa: E731
    x, w1, w2, _ = _gpu_operands()
    _check_on_gpu(jax_cute.matmul, jnp.matmul, (x, w1), (put(x, "data", None), put(w1)))
    mlp = lambda a, b, c: ex.mlp({"w1": b, "w2": c}, a)  # noqa: E731
    mlp_ref = lambda a, b, c: ex.mlp({"w1": b, "w2": c}, a, jnp.matmul)  # noqa: E731
    _check_on_gpu(mlp, mlp_ref, (x, w1, w2), (put(x, "data", None), put(w1, None, "model"), put(w2, "model", None)))


@pytest.mark.gpu
def test_gpu_explicit_mesh_axes_on_one_device():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_cute

    mesh = _gpu_mesh((1, 1), ("data", "model"), "Explicit")
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))  # noqa: E731
    x, w1, _, we = _gpu_operands()
    _check_on_gpu(jax_cute.matmul, jnp.matmul, (x, w1), (put(x, "data", None), put(w1, None, "model")), mesh)
    gs = np.array([64, 0, 100, 92], np.int32)
    _check_on_gpu(lambda a, b: jax_cute.ragged_dot(a, b, gs), lambda a, b: jax.lax.ragged_dot(a, b, gs),
                  (x, we), (put(x, "data", None), put(we)), mesh)


@pytest.mark.gpu
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_gpu_fused_epilogues_on_one_device(axis_type):
    """An MLP with a bias, kernelized, column- then row-parallel (Auto axes) or data-parallel
    (Explicit axes, where a contraction sharded on both sides would need an out_sharding): the
    fused first product and the backward's derivative-epilogue GEMM run their kernels, with
    results typed as the mesh gives them."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_cute

    mesh = _gpu_mesh((1, 1), ("data", "model"), axis_type)
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))  # noqa: E731
    x, w1, w2, _ = _gpu_operands()
    b1 = jax.random.normal(jax.random.PRNGKey(5), (w1.shape[1],), jnp.bfloat16)
    mlp = lambda a, w, b, v: jax.nn.gelu(a @ w + b) @ v  # noqa: E731
    f = jax_cute.kernelize(mlp)
    if axis_type == "Auto":
        args = (put(x, "data", None), put(w1, None, "model"), put(b1, "model"), put(w2, "model", None))
    else:
        args = (put(x, "data", None), put(w1), put(b1), put(w2))
    grad = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2), (0, 1, 2, 3))
    with jax.set_mesh(mesh):
        prims = str(jax.make_jaxpr(grad)(*args))
    assert "jax_cute_matmul_fused" in prims and "jax_cute_matmul_dact" in prims
    with jax_cute.config.override(strict=True):
        _check_on_gpu(f, mlp, (x, w1, b1, w2), args, mesh if axis_type == "Explicit" else None)


@pytest.mark.gpu
def test_gpu_expert_parallel_on_one_device():
    import jax
    import jax.numpy as jnp

    ex = _example()
    mesh = _gpu_mesh((1,), ("expert",))
    p = ex.init(jax.random.PRNGKey(1), d=256, h=512, experts=2, dtype=jnp.bfloat16)
    # The sign of feature 0 picks the expert with a wide margin: bf16 and float32 route alike.
    x = jax.random.normal(jax.random.PRNGKey(2), (256, 256))
    x = x.at[:, 0].set(jnp.where(x[:, 0] >= 0, 1.0, -1.0) * (1 + jnp.abs(x[:, 0]))).astype(jnp.bfloat16)
    router = jnp.zeros((256, 2), jnp.float32).at[0].set(jnp.array([8.0, -8.0]))
    moe = ex.moe_sharded(mesh)
    f = lambda xx, a, b: moe({"router": router.astype(jnp.bfloat16), "w1": a, "w2": b}, xx)  # noqa: E731
    ref = lambda xx, a, b: ex.moe_reference({"router": router, "w1": a, "w2": b}, xx)  # noqa: E731
    _check_on_gpu(f, ref, (x, p["e1"], p["e2"]), (x, p["e1"], p["e2"]), tol=5e-2)


@pytest.mark.gpu
def test_gpu_sharded_layers_example_runs_the_kernels():
    _gpu_mesh((1,), ("x",))  # skips without a GPU
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "sharded_layers.py")],
                          env={**os.environ, "JAX_CUTE_STRICT": "1"}, cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "path: jax_cute kernels on" in proc.stdout, proc.stdout


# -- the worker -----------------------------------------------------------------------------------

def spec_json(spec) -> list:
    """A PartitionSpec as JSON, trailing unsharded axes dropped (JAX versions print them apart)."""
    parts = [list(x) if isinstance(x, tuple) else x for x in spec]
    while parts and parts[-1] is None:
        parts.pop()
    return parts


def _worker() -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_cute

    sys.path.insert(0, str(ROOT / "examples"))
    import sharded_layers as ex

    from jax_cute.layout import Layout, make_layout
    from jax_cute.problem.gemm_layouts import GemmLayouts
    from jax_cute.primitives.gemm import matmul_p

    assert len(jax.devices()) == DEVICES
    mesh = ex.auto_mesh((2, 4), ("data", "model"))
    rng = np.random.default_rng(0)
    rnd = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))  # noqa: E731
    mx = lambda x: float(np.max(np.abs(np.asarray(x))))  # noqa: E731 - on the host: no compile per shape

    def colls(f, *args) -> dict:
        return ex.collectives(jax.jit(f).lower(*args).compile().as_text())

    def case(f, ref, args, grad_of=None, **extra) -> dict:
        out, want = jax.jit(f)(*args), ref(*args)
        res = {"diff": mx(out - want), "scale": mx(want), "fwd": colls(f, *args),
               "out_spec": spec_json(out.sharding.spec), **extra}
        if grad_of is not None:
            loss = lambda g: lambda *a: jnp.sum(g(*a) ** 2)  # noqa: E731
            nums = tuple(range(grad_of))
            gf, gr = jax.grad(loss(f), nums), jax.grad(loss(ref), nums)
            got, exp = jax.jit(gf)(*args), gr(*args)
            res.update(grad_diffs=[mx(a - b) for a, b in zip(got, exp)], grad_scale=max(mx(b) for b in exp),
                       grad=colls(gf, *args))
        return res

    r: dict = {}
    x, w, w2 = rnd(32, 64), rnd(64, 128), rnd(128, 64)
    mm = lambda a, b: jax_cute.matmul(a, b)  # noqa: E731
    r["data_parallel"] = case(mm, jnp.matmul, (put(x, "data", None), put(w)), grad_of=2)
    r["column_parallel"] = case(mm, jnp.matmul, (put(x, "data", None), put(w, None, "model")), grad_of=2)
    r["row_parallel"] = case(mm, jnp.matmul, (put(x, "data", "model"), put(w, "model", None)), grad_of=2)
    scat = jax.jit(mm, out_shardings=NamedSharding(mesh, P("model", None)))
    args = (put(x, None, "model"), put(w, "model", None))
    r["row_parallel_scatter"] = {"diff": mx(scat(*args) - x @ w), "scale": mx(x @ w),
                                 "out_spec": spec_json(scat(*args).sharding.spec),
                                 "fwd": ex.collectives(scat.lower(*args).compile().as_text())}
    params = {"w1": put(w, None, "model"), "w2": put(w2, "model", None)}
    mlp = lambda xx, w1, w2_: ex.mlp({"w1": w1, "w2": w2_}, xx)  # noqa: E731
    mlp_ref = lambda xx, w1, w2_: ex.mlp({"w1": w1, "w2": w2_}, xx, jnp.matmul)  # noqa: E731
    r["mlp"] = case(mlp, mlp_ref, (put(x, "data", None), params["w1"], params["w2"]), grad_of=3)
    # fused epilogues (16-bit operands: what the fused primitive takes): the bias shards with C's blocks
    from jax_cute.activations import apply_activation
    xh, wh, bh, w2h = (a.astype(jnp.bfloat16) for a in (x, w, rnd(128), w2))

    def fused(act):
        return lambda a, b, c: jax_cute.matmul(a, b, bias=c, activation=act)

    def fused_ref(act):
        def f(a, b, c):
            z = a.astype(jnp.float32) @ b.astype(jnp.float32) + c.astype(jnp.float32)
            y = jax.nn.silu(z[:, :64]) * z[:, 64:] if act == "swiglu" else apply_activation(act, z)
            return y.astype(jnp.bfloat16)
        return f

    for name, act, args in (("dp", "gelu", (put(xh, "data", None), put(wh), put(bh))),
                            ("column", "gelu", (put(xh, "data", None), put(wh, None, "model"), put(bh, "model"))),
                            ("row", "gelu", (put(xh, "data", "model"), put(wh, "model", None), put(bh))),
                            ("column_swiglu", "swiglu", (put(xh, "data", None), put(wh, None, "model"),
                                                         put(bh, "model")))):
        r[f"fused_{name}"] = case(fused(act), fused_ref(act), args, grad_of=3)

    def mlp_bias(xx, w1, b1, w2_):  # kernelize fuses gelu into the first product, its derivative into dz's GEMM
        return jax.nn.gelu(xx @ w1 + b1) @ w2_

    kmlp = jax_cute.kernelize(mlp_bias)
    margs = (put(xh, "data", None), put(wh, None, "model"), put(bh, "model"), put(w2h, "model", None))
    r["kernelized_mlp"] = case(kmlp, lambda *a: mlp_bias(*(t.astype(jnp.float32) for t in a)), margs, grad_of=4)
    prims = str(jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(kmlp(*a).astype(jnp.float32) ** 2), (0, 1, 2, 3)))(*margs))
    r["kernelized_mlp"]["prims"] = [n for n in ("jax_cute_matmul_fused", "jax_cute_matmul_dact") if n in prims]

    xb = rnd(4, 32, 64)
    r["vmap"] = case(jax.vmap(mm, in_axes=(0, None)), jax.vmap(jnp.matmul, in_axes=(0, None)),
                     (put(xb, "data", None, None), put(w, None, "model")))
    q, kk = rnd(2, 16, 4, 8), rnd(2, 16, 4, 8)
    r["einsum_batch_heads"] = case(lambda a, b: jax_cute.einsum("bthd,bshd->bhts", a, b),
                                   lambda a, b: jnp.einsum("bthd,bshd->bhts", a, b),
                                   (put(q, "data", None, "model", None), put(kk, "data", None, "model", None)))
    dn = (((2,), (1,)), ((0,), (0,)))
    r["dot_general_batch"] = case(lambda a, b: jax_cute.dot_general(a, b, dn),
                                  lambda a, b: jax.lax.dot_general(a, b, dn),
                                  (put(rnd(4, 16, 32), "data", "model", None), put(rnd(4, 32, 8), "data", None, None)))

    gs = jnp.asarray([3, 10, 0, 7, 20, 5, 9, 6], jnp.int32)  # 60 of 64 rows, groups across shards
    xr, wr = rnd(64, 32), rnd(8, 32, 16)
    rd = lambda a, b, g: jax_cute.ragged_dot(a, b, g)  # noqa: E731
    r["ragged_tokens"] = case(rd, jax.lax.ragged_dot, (put(xr, "model", None), put(wr), put(gs)), grad_of=2)
    r["ragged_contracting"] = case(rd, jax.lax.ragged_dot,
                                   (put(xr, None, "model"), put(wr, None, "model", None), put(gs)))

    def rd_swiglu_ref(a, b, g, c):   # bias row of each row's group (none past the last), then swiglu
        rows = jnp.concatenate([c, jnp.zeros_like(c[:1])])
        z = jax.lax.ragged_dot(a, b, g) + rows[jnp.searchsorted(jnp.cumsum(g), jnp.arange(a.shape[0]), side="right")]
        return jax.nn.silu(z[:, :8]) * z[:, 8:]

    rd_swiglu = lambda a, b, g, c: jax_cute.ragged_dot(a, b, g, bias=c, activation="swiglu")  # noqa: E731
    r["ragged_fused_tokens"] = case(rd_swiglu, rd_swiglu_ref, (put(xr, "model", None), put(wr), put(gs), put(rnd(8, 16))),
                                    grad_of=2)
    rd_gelu = lambda a, b, g, c: jax_cute.ragged_dot(a, b, g, bias=c, activation="gelu")  # noqa: E731

    def rd_gelu_ref(a, b, g, c):
        a, b, c = (t.astype(jnp.float32) for t in (a, b, c))
        rows = jnp.concatenate([c, jnp.zeros_like(c[:1])])
        z = jax.lax.ragged_dot(a, b, g) + rows[jnp.searchsorted(jnp.cumsum(g), jnp.arange(a.shape[0]), side="right")]
        return apply_activation("gelu", z).astype(jnp.bfloat16)

    xrh, wrh, crh = xr.astype(jnp.bfloat16), wr.astype(jnp.bfloat16), rnd(8, 16).astype(jnp.bfloat16)
    r["ragged_fused_columns"] = case(rd_gelu, rd_gelu_ref, (put(xrh, "data", None), put(wrh, None, None, "model"),
                                                            put(gs), put(crh, None, "model")), grad_of=2)
    r["ragged_fused_contracting"] = case(rd_gelu, rd_gelu_ref, (put(xrh, None, "model"), put(wrh, None, "model", None),
                                                                put(gs), put(crh)), grad_of=2)
    r["ragged_experts_jit"] = case(rd, jax.lax.ragged_dot, (put(xr), put(wr, "model", None, None), put(gs, "model")),
                                   grad_of=2)

    emesh = ex.auto_mesh((DEVICES,), ("expert",))
    p = ex.init(jax.random.PRNGKey(0), d=32, h=64, experts=2 * DEVICES)
    router, e1, e2 = p["router"], p["e1"], p["e2"]
    moe = ex.moe_sharded(emesh)
    r["moe_expert_parallel"] = case(lambda xx, a, b: moe({"router": router, "w1": a, "w2": b}, xx),
                                    lambda xx, a, b: ex.moe_reference({"router": router, "w1": a, "w2": b}, xx),
                                    (rnd(DEVICES * 16, 32), e1, e2), grad_of=3)

    def body(a, b):  # per shard: a vmapped product and a gradient
        f = lambda a, b: jnp.sum(jax.vmap(jax_cute.matmul, in_axes=(0, None))(a, b) ** 2)  # noqa: E731
        return jax.grad(f, argnums=1)(a, b)[None]

    def body_ref(a, b):
        f = lambda a, b: jnp.sum(jax.vmap(jnp.matmul, in_axes=(0, None))(a, b) ** 2)  # noqa: E731
        return jax.grad(f, argnums=1)(a, b)[None]

    # shard_map's default check_vma: results vary over their operands' manual axes
    sm = lambda fn: jax.shard_map(fn, mesh=emesh, in_specs=(P("expert"), P()), out_specs=P("expert"))  # noqa: E731
    r["shard_map_vmap_grad"] = case(lambda a, b: jnp.sum(sm(body)(a, b) ** 2, axis=0),
                                    lambda a, b: jnp.sum(sm(body_ref)(a, b) ** 2, axis=0),
                                    (rnd(DEVICES * 2, 8, 16), rnd(16, 8)), grad_of=2)

    def ragged_body(batched):
        def body(a, b, g):  # per shard: a batch of ragged_dots, its value and gradients
            f = lambda a, b: batched(a, b, g)  # noqa: E731
            ga, gb = jax.grad(lambda a, b: jnp.sum(f(a, b) ** 2), argnums=(0, 1))(a, b)
            return jnp.concatenate([f(a, b).ravel(), ga.ravel(), gb.ravel()])
        return jax.shard_map(body, mesh=emesh, in_specs=(P("expert"), P(), P()), out_specs=P("expert"))

    # (lax.ragged_dot cannot transpose its own vmap in JAX 0.10, nor its transposes: the reference
    # loops, and the gradients are those taken inside the body)
    loop = lambda a, b, g: jnp.stack([jax.lax.ragged_dot(x_, b, g) for x_ in a])  # noqa: E731
    r["shard_map_ragged_vmap_grad"] = case(ragged_body(jax.vmap(rd, in_axes=(0, None, None))), ragged_body(loop),
                                           (rnd(DEVICES * 2, 16, 8), rnd(4, 8, 6), jnp.asarray([5, 0, 7, 4], jnp.int32)))

    want = NamedSharding(mesh, P("data", "model"))
    outs = {
        "matmul": (lambda a, b: jax_cute.matmul(a, b, out_sharding=want), lambda a, b: a @ b, (x, w)),
        "dot_general": (lambda a, b: jax_cute.dot_general(a, b, (((1,), (0,)), ((), ())), out_sharding=want),
                        lambda a, b: a @ b, (x, w)),
        "einsum": (lambda a, b: jax_cute.einsum("ik,kj->ij", a, b, out_sharding=want), lambda a, b: a @ b, (x, w)),
        "ragged_dot": (lambda a, b, g: jax_cute.ragged_dot(a, b, g, out_sharding=want), jax.lax.ragged_dot,
                       (xr, wr, gs)),
    }
    r["out_sharding"] = {}
    for name, (f, ref, args) in outs.items():
        out = jax.jit(f)(*args)
        r["out_sharding"][name] = {"diff": mx(out - ref(*args)), "scale": mx(ref(*args)),
                                   "spec": spec_json(out.sharding.spec), "want": spec_json(want.spec)}
    with (jax.set_mesh(mesh) if hasattr(jax, "set_mesh") else jax.sharding.use_mesh(mesh)):
        out = jax.jit(lambda a, b: jax_cute.matmul(a, b, out_sharding=P("data", "model")))(x, w)
    r["out_sharding"]["matmul_pspec"] = {"diff": mx(out - x @ w), "scale": mx(x @ w), "spec": spec_json(out.sharding.spec),
                                         "want": spec_json(want.spec)}

    # A's rows read as (4, 2):(2K, K): its row axis cannot follow C's row sharding.
    k, n = 4, 6
    lay = GemmLayouts(make_layout(Layout((4, 2), (2 * k, k)), Layout((k,), (1,)), Layout((1,), (0,))),
                      make_layout(Layout((n,), (1,)), Layout((k,), (n,)), Layout((1,), (0,))),
                      make_layout(Layout((8,), (n,)), Layout((n,), (1,)), Layout((1,), (0,))), (8, n))
    prim = lambda a, b: matmul_p.bind(a, b, layouts=lay, out_dtype="float32", acc_dtype="float32")  # noqa: E731
    perm = np.array([2 * (i % 4) + i // 4 for i in range(8)])  # row i of C is row perm[i] of A
    r["unlocalizable"] = case(prim, lambda a, b: a[perm] @ b, (put(rnd(8, k), "model", None), put(rnd(k, n))))

    # a reshape splits w's N (128 over 4 shards) into (2, 64): Shardy shards the 2 over half of
    # model (a sub-axis), which no PartitionSpec expresses: read as replicated, with a log line
    import logging
    seen: list[str] = []
    keep = type("Keep", (logging.Handler,), {"emit": lambda self, rec: seen.append(rec.getMessage())})()
    logging.getLogger("jax_cute").addHandler(keep)
    split = lambda a, b: jax_cute.dot_general(a, b.reshape(64, 2, 64), (((1,), (0,)), ((), ())))  # noqa: E731
    # (the reference slices instead: JAX 0.10's eager reshape of the sharded w fails under GSPMD)
    ref = lambda a, b: jnp.stack([a @ b[:, :64], a @ b[:, 64:]], axis=1)  # noqa: E731
    r["sub_axis"] = case(split, ref, (put(x, "data", None), put(w, None, "model")), grad_of=2)
    logging.getLogger("jax_cute").removeHandler(keep)
    r["sub_axis"]["log"] = [m for m in seen if "splits a mesh axis" in m]
    return r


def _typed_worker() -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import jax_cute

    if not hasattr(jax, "set_mesh"):
        return {"skip": f"JAX {jax.__version__} has no jax.set_mesh (sharding in types)"}
    n = len(jax.devices())
    shape = {1: (1, 1), 2: (2, 1)}.get(n, (2, n // 2))
    rng = np.random.default_rng(0)
    rnd = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    mx = lambda x: float(np.max(np.abs(np.asarray(x, np.float32))))  # noqa: E731
    loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)  # noqa: E731
    gs = np.array([3, 10, 0, 7, 20, 5, 9, 6], np.int32)  # 60 of 64 rows, groups across shards
    dn = (((2,), (1,)), ((0,), (0,)))
    eq = "bthd,bshd->bhts"
    cases = {  # name: (ours, reference, ((operand, spec), ...), the result's sharding where lax infers none)
        "matmul": (jax_cute.matmul, jnp.matmul, ((rnd(32, 64), ("x", None)), (rnd(64, 16), (None, "y"))), None),
        "dot_general": (lambda a, b: jax_cute.dot_general(a, b, dn), lambda a, b: jax.lax.dot_general(a, b, dn),
                        ((rnd(4, 16, 32), ("x", None, None)), (rnd(4, 32, 8), ("x", None, "y"))), None),
        "einsum": (lambda a, b: jax_cute.einsum(eq, a, b), lambda a, b: jnp.einsum(eq, a, b),
                   ((rnd(2, 16, 4, 8), ("x", None, "y", None)), (rnd(2, 16, 4, 8), ("x", None, "y", None))), None),
        # lax.ragged_dot infers no sharding on Explicit axes (it asks for out_sharding)
        "ragged_dot": (lambda a, b: jax_cute.ragged_dot(a, b, gs), lambda a, b: jax.lax.ragged_dot(a, b, gs),
                       ((rnd(64, 32), ("x", None)), (rnd(8, 32, 16), (None, None, "y"))), ["x", "y"]),
        # the fused primitive takes 16-bit operands; its reference rounds the f32 epilogue once
        "matmul_bias_gelu": (lambda a, b, c: jax_cute.matmul(a, b, bias=c, activation="gelu"),
                             lambda a, b, c: jax.nn.gelu(a.astype(jnp.float32) @ b.astype(jnp.float32)
                                                         + c.astype(jnp.float32)).astype(jnp.bfloat16),
                             tuple((rnd(*s_).astype(jnp.bfloat16), spec) for s_, spec in
                                   (((32, 64), ("x", None)), ((64, 16), (None, "y")), ((16,), ("y",)))), None),
        # a bias row per group: N sharded with the weight, tokens over x
        "ragged_bias_gelu": (lambda a, b, c: jax_cute.ragged_dot(a, b, gs, bias=c, activation="gelu"),
                             lambda a, b, c: jax.nn.gelu(
                                 jax.lax.ragged_dot(a.astype(jnp.float32), b.astype(jnp.float32), gs)
                                 + jnp.concatenate([c, jnp.zeros_like(c[:1])]).astype(jnp.float32)[
                                     np.searchsorted(np.cumsum(gs), np.arange(64), side="right")]).astype(jnp.bfloat16),
                             tuple((rnd(*s_).astype(jnp.bfloat16), spec) for s_, spec in
                                   (((64, 32), ("x", None)), ((8, 32, 16), (None, None, "y")), ((8, 16), (None, "y")))),
                             ["x", "y"]),
    }
    out: dict = {}
    for mode, axis_type in (("explicit", AxisType.Explicit), ("auto", AxisType.Auto)):
        mesh = jax.make_mesh(shape, ("x", "y"), axis_types=(axis_type,) * 2)
        res = out[mode] = {}
        for name, (f, ref, operands, want) in cases.items():
            arrays = [a for a, _ in operands]
            nums = tuple(range(len(arrays)))
            want_out, want_grads = ref(*arrays), jax.grad(loss(ref), nums)(*arrays)  # unsharded
            with jax.set_mesh(mesh):
                args = [jax.device_put(a, NamedSharding(mesh, P(*spec))) for a, spec in operands]
                got = jax.jit(f)(*args)
                grads = jax.jit(jax.grad(loss(f), nums))(*args)
                gathers = jax.jit(jax.grad(loss(f), nums)).lower(*args).compile().as_text().count("all-gather")
                if want is None and mode == "explicit":
                    want = spec_json(jax.jit(ref)(*args).sharding.spec)
            res[name] = {"diff": mx(got - want_out), "scale": mx(want_out), "spec": spec_json(got.sharding.spec),
                         "want": want, "grad_diffs": [mx(a - b) for a, b in zip(grads, want_grads)],
                         "grad_scale": max(mx(b) for b in want_grads),
                         "grad_specs": [spec_json(g.sharding.spec) for g in grads],
                         "arg_specs": [spec_json(a.sharding.spec) for a in args], "grad_gathers": gathers,
                         "tol": 2e-2 if got.dtype == jnp.bfloat16 else 1e-4}

    out["contracting"] = {}
    x, w = rnd(32, 64), rnd(64, 16)
    for mode, axis_type in (("explicit", AxisType.Explicit), ("auto", AxisType.Auto)):
        mesh = jax.make_mesh(shape, ("x", "y"), axis_types=(axis_type,) * 2)
        case = out["contracting"][mode] = {"error": None, "lax_error": None}
        with jax.set_mesh(mesh):
            args = (jax.device_put(x, NamedSharding(mesh, P(None, "y"))), jax.device_put(w, NamedSharding(mesh, P("y"))))
            for key, f in (("error", jax_cute.matmul), ("lax_error", jnp.matmul)):
                try:
                    jax.jit(f)(*args)
                except Exception as e:  # noqa: BLE001 - compared with lax's
                    case[key] = f"{type(e).__name__}: {str(e).split(' Got ')[0]}"
            got = jax.jit(lambda a, b: jax_cute.matmul(a, b, out_sharding=P("x")))(*args)
        case.update(diff=mx(got - x @ w), scale=mx(x @ w), out_sharding_spec=spec_json(got.sharding.spec))
    return out


if __name__ == "__main__":
    print(json.dumps(_typed_worker() if sys.argv[1:] == ["types"] else _worker()))
