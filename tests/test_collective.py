"""Collective matmul (``primitives/collective.py``): the rings the partitioning rules pick with
``collective_matmul`` on, their values and gradients, and the ordinary plan with it off.

The ring choice is unit-tested in-process. The multi-device checks need 8 CPU devices, which
must be set before JAX starts: as tests/test_sharding.py, this file runs itself in a subprocess
(once per partitioner) that computes every case on rings of 2, 4 and 8 devices and prints the
results as JSON, and the tests assert on them. The README's test line checks the rings of 4
devices; those of 2 and 8 (sweeps, CI's second step) come from a second run,
``python tests/test_collective.py rings``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import sys

import pytest
import shared_result  # tests/ is on sys.path: under pytest, and run as a script

from test_sharding import spec_json  # tests/ is on sys.path: under pytest, and run as a script

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEVICES = 8
RINGS = (2, 4, DEVICES)
LINE_RING = 4   # the test line's ring; the others are sweeps
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
TOL = 1e-4  # float32: max abs difference over every element, relative to the largest reference value


# -- choosing a ring (in-process) ------------------------------------------------------------------

def _choose(a_shape, b_shape, specs, result, *, transpose_a=False, transpose_b=False, mesh=None, mode="bidirectional"):
    from jax_cute.primitives.collective import choose
    from jax_cute.problem.gemm_layouts import matmul_layouts
    from jax_cute.primitives.sharding import problem

    layouts, _ = matmul_layouts(a_shape, b_shape, transpose_a, transpose_b)
    return choose(problem(layouts, [a_shape, b_shape]), mesh or {"x": 4}, specs, result, mode)


def test_sequence_parallel_activation_times_column_parallel_weight_gathers_the_activation():
    ring = _choose((32, 16), (16, 64), [(("x",), ()), ((), ("x",))], None)
    assert ring.kind == "gather" and ring.operand == "a" and ring.axes == ("x",)
    assert [tuple(s) for s in ring.specs] == [("x", None), (None, "x")]  # the weight stays where it is
    assert tuple(ring.result_spec) == (None, "x") and ring.directions == (2, 1) and ring.reduce == ()
    # a requested result with rows over x: the weight's chunks travel instead
    ring = _choose((32, 16), (16, 64), [(("x",), ()), ((), ("x",))], (("x",), ()))
    assert ring.operand == "b" and tuple(ring.result_spec) == ("x", None)
    assert _choose((32, 16), (16, 64), [(("x",), ()), ((), ("x",))], None, mode="unidirectional").directions == (3, 0)


def test_row_parallel_product_scatters_only_when_the_result_is_asked_for_sharded():
    specs = [((), ("x",)), (("x",), ())]
    assert _choose((32, 64), (64, 16), specs, None) is None  # GSPMD inferring: the ordinary plan
    assert _choose((32, 64), (64, 16), specs, ((), ())) is None  # replicated: one all-reduce
    ring = _choose((32, 64), (64, 16), specs, (("x",), ()))
    assert ring.kind == "scatter" and ring.operand == "a" and tuple(ring.result_spec) == ("x", None)
    assert [tuple(s) for s in ring.specs] == [(None, "x"), ("x", None)]
    assert _choose((32, 64), (64, 16), specs, ((), ("x",))).operand == "b"  # columns scattered: B sliced


def test_weight_gradient_of_a_sequence_parallel_product_gathers_along_k():
    # dW = x^T @ dh: x (tokens over x, d), dh (tokens, h over x)
    ring = _choose((32, 16), (32, 64), [(("x",), ()), ((), ("x",))], None, transpose_a=True)
    assert ring.kind == "gather_k" and ring.operand == "a" and tuple(ring.result_spec) == (None, "x")


def test_axes_outside_the_ring_keep_the_ordinary_plan():
    mesh = {"data": 2, "model": 4}
    ring = _choose((64, 16), (16, 64), [(("data", "model"), ()), ((), ("model",))], None, mesh=mesh)
    assert ring.axes == ("model",) and ring.size == 4 and tuple(ring.result_spec) == ("data", "model")
    # dW with tokens over (data, model): the ring over model, then a psum over data
    ring = _choose((64, 16), (64, 64), [(("data", "model"), ()), (("data",), ("model",))], None, mesh=mesh,
                   transpose_a=True)
    assert ring.kind == "gather_k" and ring.reduce == ("data",)


@pytest.mark.parametrize("specs,result", [
    ([(("x",), ()), ((), ())], None),  # data parallel: nothing to gather
    ([(("x",), ()), ((), ("y",))], None),  # different mesh axes: both stay local
    ([((), ("x",)), (("x",), ())], (("y",), ())),  # result over another axis
])
def test_no_ring_where_no_collective_sits_on_one_axis(specs, result):
    assert _choose((32, 16), (16, 64), specs, result, mesh={"x": 2, "y": 2}) is None


def test_config_switch_values(monkeypatch):
    from jax_cute import config
    from jax_cute.primitives import collective

    monkeypatch.delenv("JAX_CUTE_COLLECTIVE_MATMUL", raising=False)
    monkeypatch.delenv("JAX_CUTE_RING_SMS", raising=False)
    assert config.collective_matmul() is None and collective.planner() is None  # off by default
    for raw, want in (("1", "bidirectional"), ("on", "bidirectional"), ("Unidirectional", "unidirectional"),
                      ("0", None)):
        monkeypatch.setenv("JAX_CUTE_COLLECTIVE_MATMUL", raw)
        assert config.collective_matmul() == want, raw
    monkeypatch.setenv("JAX_CUTE_COLLECTIVE_MATMUL", "ring")
    with pytest.raises(ValueError, match="JAX_CUTE_COLLECTIVE_MATMUL must be a boolean or one of"):
        config.collective_matmul()
    monkeypatch.setenv("JAX_CUTE_COLLECTIVE_MATMUL", "1")
    with config.override(collective_matmul=False):  # Python wins over the environment
        assert config.collective_matmul() is None
    with config.override(collective_matmul="unidirectional"):
        assert collective.planner() == collective.Planner("unidirectional", config.RING_SMS_DEFAULT)
    with pytest.raises(ValueError, match="jax_cute.config"):
        config.set(collective_matmul="sideways")


def test_planner_carries_the_ring_sms_switch_into_its_rings(monkeypatch):
    from jax_cute import config
    from jax_cute.primitives import collective
    from jax_cute.primitives.sharding import problem
    from jax_cute.problem.gemm_layouts import matmul_layouts

    monkeypatch.delenv("JAX_CUTE_RING_SMS", raising=False)
    layouts, _ = matmul_layouts((32, 16), (16, 64), False, False)
    p = problem(layouts, [(32, 16), (16, 64)])
    with config.override(collective_matmul=True):
        assert collective.planner() == collective.Planner("bidirectional", config.RING_SMS_DEFAULT)
        with config.override(ring_sms=8):
            ring = collective.planner()(p, {"x": 4}, [(("x",), ()), ((), ("x",))], None)
    assert ring.kind == "gather" and ring.free_sms == 8


def _chunk_budgets(a_shape, b_shape, specs, result, n: int, mode: str, transpose_a: bool = False) -> list[int]:
    """The ``free_sms`` each chunk GEMM of the ring's per-shard body asks for, in program order (the
    body traced under a vmap whose axis stands for the ring's mesh axis)."""
    import jax
    import jax.numpy as jnp

    from jax_cute.primitives import collective, gemm, sharding
    from jax_cute.problem.gemm_layouts import matmul_layouts

    ring = dataclasses.replace(_choose(a_shape, b_shape, specs, result, transpose_a=transpose_a,
                                       mesh={"x": n}, mode=mode), free_sms=16)
    layouts, _ = matmul_layouts(a_shape, b_shape, transpose_a, False)
    params = {"layouts": layouts, "out_dtype": "float32", "acc_dtype": "float32"}
    asked: list[int] = []

    def local(avals, params, free_sms=0):
        asked.append(free_sms)
        return functools.partial(gemm.reference, **params)

    body = collective._body(ring, sharding._Call(tuple(sorted(params.items())), local), {"x": n})
    shards = [jnp.zeros((n, *(d // n if axes else d for d, axes in zip(shape, spec))), jnp.float32)
              for shape, spec in zip((a_shape, b_shape), ring.specs)]
    jax.make_jaxpr(jax.vmap(body, axis_name="x", axis_size=n))(*shards)
    return asked


@pytest.mark.parametrize("n,mode,want", [(2, "bidirectional", [16, 0]), (4, "bidirectional", [16, 16, 16, 0]),
                                         (4, "unidirectional", [16, 16, 16, 0])])
def test_gather_chunk_gemms_leave_sms_free_until_the_last_chunk_arrives(n, mode, want):
    assert _chunk_budgets((8 * n, 16), (16, 8 * n), [(("x",), ()), ((), ("x",))], None, n, mode) == want
    # along K (a weight gradient x^T @ dh): the same steps
    assert _chunk_budgets((8 * n, 16), (8 * n, 8 * n), [(("x",), ()), ((), ("x",))], None, n, mode,
                          transpose_a=True) == want


@pytest.mark.parametrize("n,mode,want", [(2, "bidirectional", [0, 16]), (4, "bidirectional", [0, 16, 16, 16]),
                                         (4, "unidirectional", [0, 16, 16, 16])])
def test_scatter_chunk_gemms_leave_sms_free_after_the_first_sum_is_sent(n, mode, want):
    assert _chunk_budgets((8 * n, 8 * n), (8 * n, 16), [((), ("x",)), (("x",), ())], (("x",), ()), n, mode) == want


# -- multi-device checks (subprocess) -----------------------------------------------------------

def _script(shardy: bool, rings: bool = False) -> shared_result.Script:
    """This file's run for a partitioner: every case but the other rings', or (``rings``) those."""
    env = shared_result.host_devices_env(DEVICES, shardy)
    env.pop("JAX_CUTE_COLLECTIVE_MATMUL", None)
    return shared_result.Script(f"test_collective-{'shardy' if shardy else 'gspmd'}" + ("-rings" if rings else ""),
                                [sys.executable, __file__, *(["rings"] if rings else [])], env=env, cwd=ROOT, timeout=900)


def _ring_script(param: tuple[bool, int]) -> shared_result.Script:
    shardy, n = param
    return _script(shardy, rings=n != LINE_RING)


# each fixture's script, for its parameter (conftest starts them before the first test)
SUBPROCESS_FIXTURES = {"results": _script, "ring": _ring_script}


@pytest.fixture(scope="module", params=[pytest.param(True, id="shardy"),   # GSPMD: CI's second step (sweep)
                                        pytest.param(False, id="gspmd", marks=pytest.mark.sweep)])
def results(request):
    return _script(request.param).result()


@pytest.fixture(scope="module", params=[
    pytest.param((shardy, n), id=f"{'shardy' if shardy else 'gspmd'}-{n}",
                 marks=() if shardy and n == LINE_RING else pytest.mark.sweep) for shardy in (True, False) for n in RINGS])
def ring(request) -> tuple[int, dict]:
    """(n, the cases on a ring of n devices) for a partitioner."""
    n = request.param[1]
    return n, _ring_script(request.param).result()[f"ring{n}"]


def _close(case: dict, tol: float = TOL) -> None:
    assert case["diff"] <= tol * case["scale"], case
    if "grad_diffs" in case:
        for i, (d, s) in enumerate(zip(case["grad_diffs"], case["grad_scales"])):
            assert d <= tol * s, (i, case)


def _none_but_permutes(counts: dict) -> None:
    assert counts["collective-permute"] >= 1, counts
    assert counts["all-gather"] == counts["reduce-scatter"] == counts["all-to-all"] == 0, counts


def test_all_gather_gemm_runs_as_a_ring(ring):
    n, cases = ring
    on, off = cases["gather"], cases["gather_off"]
    _close(on)
    _close(off)
    assert on["fwd"] == {**dict.fromkeys(COLLECTIVES, 0), "collective-permute": n - 1}
    assert on["out_spec"] == [None, "x"]
    assert off["fwd"]["all-gather"] >= 1 and off["fwd"]["collective-permute"] == 0  # the old plan
    _none_but_permutes(on["grad"])
    weight = cases["gather_weight"]
    _close(weight)
    assert weight["fwd"] == on["fwd"] and weight["out_spec"] == ["x"]


def test_gemm_reduce_scatter_runs_as_a_ring(ring):
    n, cases = ring
    on, off = cases["scatter"], cases["scatter_off"]
    _close(on)
    _close(off)
    assert on["fwd"] == {**dict.fromkeys(COLLECTIVES, 0), "collective-permute": n - 1}
    assert on["out_spec"] == ["x"]
    assert off["fwd"] == {**dict.fromkeys(COLLECTIVES, 0), "reduce-scatter": 1}


def test_tensor_parallel_mlp_gradients_take_the_rings_both_ways(ring):
    n, cases = ring
    """Column- then row-parallel MLP, sequence-parallel in and out: the backward's products (dh:
    all-gather GEMM, dx: GEMM reduce-scatter, dW1 and dW2: gathered along K) are rings too."""
    on, off = cases["mlp"], cases["mlp_off"]
    _close(on)
    _close(off)
    _none_but_permutes(on["fwd"])
    _none_but_permutes(on["grad"])
    assert on["grad"]["all-reduce"] <= 1  # the scalar loss's sum, nothing else
    # six rings of n - 1 steps (two forward, four backward); XLA may merge the identical transfers of
    # x's chunks (for h and dW1) and of dy's (for dh and dW2)
    assert on["grad"]["collective-permute"] >= 4 * (n - 1)
    assert off["grad"]["all-gather"] >= 1 and off["grad"]["collective-permute"] == 0  # the weights gathered


def test_unidirectional_ring_and_transposed_operands(ring):
    n, cases = ring
    _close(cases["mlp_unidirectional"])
    assert cases["mlp_unidirectional"]["fwd"]["collective-permute"] == 2 * (n - 1)
    case = cases["transposed"]  # x^T stored (K, M), w stored (N, K)
    _close(case)
    _none_but_permutes(case["fwd"])
    _none_but_permutes(case["grad"])


def test_einsum_with_tokens_in_the_middle_axis(results):
    for name, spec in (("einsum_up", [None, None, "x"]), ("einsum_down", [None, "x"])):
        case = results[name]
        _close(case)
        assert case["out_spec"] == spec, name
        _none_but_permutes(case["fwd"])
        _none_but_permutes(case["grad"])


def test_bf16_mlp_within_rounding_of_the_float32_product(results):
    case = results["bf16"]
    _close(case, tol=3e-2)
    _none_but_permutes(case["grad"])
    # the ring sums what XLA's collectives would: it agrees with the ordinary plan to bf16 rounding
    assert case["vs_off"] <= 2e-2 * case["scale"] and max(case["grad_vs_off"]) <= 3e-2


def test_fused_epilogue_keeps_the_ring(results):
    """With collective_matmul on, a product with a fused activation runs the plain GEMM's rules
    (its ring, then the epilogue) rather than the fused call's own partitioning."""
    case = results["bf16_fused"]
    _close(case, tol=3e-2)
    _none_but_permutes(case["fwd"])
    _none_but_permutes(case["grad"])


def test_data_and_model_axes_ring_over_model_only(results):
    case = results["data_model"]
    _close(case)
    _none_but_permutes(case["fwd"])
    _none_but_permutes(case["grad"])
    assert case["fwd"]["all-reduce"] == 0
    assert case["out_spec"] == [["data", "model"]]


# -- several GPUs (pytest -m multigpu): the rings with our kernels -------------------------------------

@pytest.mark.multigpu
def test_rings_on_all_gpus_run_our_kernels_and_match_the_unsharded_mlp():
    """bf16 column- then row-parallel MLP, sequence-parallel, on a ring of every visible GPU, in
    strict mode (a chunk GEMM falling back to XLA raises): values and gradients against the
    float32 MLP on one device, our kernels and collective-permutes (no all-gather, no
    reduce-scatter) in the compiled forward and backward."""
    import re

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_cute

    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if len(gpus) < 2:
        pytest.skip("needs two GPUs")
    n = len(gpus)
    mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=gpus)
    rng = np.random.default_rng(45)
    tokens, d, h = 256 * n, 512, 512 * n
    plain = [rng.standard_normal(s).astype(np.float32) * scale for s, scale in
             (((tokens, d), 1.0), ((d, h), d ** -0.5), ((h, d), h ** -0.5))]
    specs = [("x", None), (None, "x"), ("x", None)]
    args = [jax.device_put(jnp.asarray(a, jnp.bfloat16), NamedSharding(mesh, P(*sp))) for a, sp in zip(plain, specs)]
    out = NamedSharding(mesh, P("x", None))
    mlp = lambda x, w1, w2, mm=jax_cute.matmul: mm(jax.nn.gelu(mm(x, w1)), w2)  # noqa: E731
    sq = lambda y: jnp.sum(y.astype(jnp.float32) ** 2)  # noqa: E731
    loss = lambda f: lambda *a: sq(f(*a))  # noqa: E731
    sharded_loss = lambda f: lambda *a: sq(jax.lax.with_sharding_constraint(f(*a), out))  # noqa: E731
    nums = (0, 1, 2)
    with jax.default_matmul_precision("float32"):
        wide = [jnp.asarray(a) for a in plain]
        ref = functools.partial(mlp, mm=jnp.matmul)
        want, want_grads = ref(*wide), jax.grad(loss(ref), nums)(*wide)
    with jax_cute.config.override(collective_matmul=True, strict=True):
        fwd, bwd = jax.jit(functools.partial(mlp), out_shardings=out), jax.jit(jax.grad(sharded_loss(mlp), nums))
        got, grads = fwd(*args), bwd(*args)
        texts = [f.lower(*args).compile().as_text() for f in (fwd, bwd)]
    rel = lambda a, b: float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - b)) / jnp.max(jnp.abs(b)))  # noqa: E731
    assert rel(got, want) <= 3e-2
    for i, (g, w) in enumerate(zip(grads, want_grads)):
        assert rel(g, w) <= 3e-2, f"gradient {i}: {rel(g, w)}"
    for t in texts:
        assert "jax_cute_launch" in t
        assert re.search(r"collective-permute(-start)?\(", t)
        assert not re.search(r"\b(all-gather|reduce-scatter)(-start)?\(", t)


# -- the worker -----------------------------------------------------------------------------------

def _worker(part: str = "") -> dict:
    """Every case but the rings other than LINE_RING's, or (``part`` "rings") those."""
    import re

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_cute

    assert len(jax.devices()) == DEVICES
    rng = np.random.default_rng(45)
    rnd = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    mx = lambda x: float(np.max(np.abs(np.asarray(x, np.float32))))  # noqa: E731 - on the host: no compile per shape

    def colls(text: str) -> dict:
        return {c: len(re.findall(rf"\b{c}(-start)?\(", text)) for c in COLLECTIVES}

    def case(mesh, mode, f, ref, args, specs, out=None, grad=True, dtype=jnp.float32) -> dict:
        """``f`` on ``args`` sharded by ``specs`` (result constrained to ``out``) with the switch at
        ``mode``, against ``ref`` on the float32 arrays unsharded: values, gradients of a sum of
        squares, and the collectives of the compiled forward and backward."""
        put = [jax.device_put(a.astype(dtype), NamedSharding(mesh, P(*s))) for a, s in zip(args, specs)]
        out_sh = NamedSharding(mesh, P(*out)) if out is not None else None
        constrain = (lambda y: jax.lax.with_sharding_constraint(y, out_sh)) if out_sh else (lambda y: y)  # noqa: E731
        loss = lambda g, c=lambda y: y: lambda *a: jnp.sum(c(g(*a)).astype(jnp.float32) ** 2)  # noqa: E731
        nums = tuple(range(len(args)))
        f = functools.partial(f)  # a new function: jit's caches must not hand back another mode's lowering
        with jax_cute.config.override(collective_matmul=mode):
            fwd = jax.jit(f, out_shardings=out_sh)
            got = fwd(*put)
            res = {"fwd": colls(fwd.lower(*put).compile().as_text()), "out_spec": spec_json(got.sharding.spec)}
            if grad:
                gf = jax.jit(jax.grad(loss(f, constrain), nums))
                grads = gf(*put)
                res["grad"] = colls(gf.lower(*put).compile().as_text())
        with jax.default_matmul_precision("float32"):
            want = ref(*args)
            want_grads = jax.grad(loss(ref), nums)(*args) if grad else ()
        res.update(diff=mx(got.astype(jnp.float32) - want), scale=mx(want), got=got)
        if grad:
            res.update(grad_diffs=[mx(g.astype(jnp.float32) - w) for g, w in zip(grads, want_grads)],
                       grad_scales=[mx(w) for w in want_grads], grads=grads)
        return res

    def public(res: dict) -> dict:
        return {k: v for k, v in res.items() if k not in ("got", "grads")}

    mm = jax_cute.matmul
    mlp = lambda x, w1, w2, mm=mm: mm(jax.nn.gelu(mm(x, w1)), w2)  # noqa: E731
    ref_mm = jnp.matmul
    ref_mlp = functools.partial(mlp, mm=jnp.matmul)
    if part not in ("", "rings"):
        raise ValueError(f"no part {part!r}")
    r: dict = {}
    for n in RINGS:
        mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n])
        m, k, h, d = 7 * n, 13, 5 * n, 3 * n  # odd per-shard extents; d: a row-parallel output
        # (every ring's operands drawn in one order, whichever rings this run computes)
        x, w1, w2, scattered = rnd(m, k), rnd(k, h), rnd(h, d), {"": rnd(m, h), "_off": rnd(m, h)}
        if (n == LINE_RING) == (part == "rings"):
            continue
        cases = r[f"ring{n}"] = {}
        for mode, suffix in (("bidirectional", ""), (False, "_off")):
            cases["gather" + suffix] = public(case(mesh, mode, mm, ref_mm, (x, w1), [("x", None), (None, "x")],
                                                   out=(None, "x")))
            cases["scatter" + suffix] = public(case(mesh, mode, mm, ref_mm, (scattered[suffix], w2),
                                                    [(None, "x"), ("x", None)], out=("x", None), grad=False))
            cases["mlp" + suffix] = public(case(mesh, mode, mlp, ref_mlp, (x, w1, w2),
                                                [("x", None), (None, "x"), ("x", None)], out=("x", None)))
        # the result asked for with rows over x: the weight's chunks travel round the ring
        cases["gather_weight"] = public(case(mesh, "bidirectional", mm, ref_mm, (x, w1), [("x", None), (None, "x")],
                                             out=("x", None)))
        cases["mlp_unidirectional"] = public(case(mesh, "unidirectional", mlp, ref_mlp, (x, w1, w2),
                                                  [("x", None), (None, "x"), ("x", None)], out=("x", None)))
        # x stored transposed (K, M), w as (N, K): the chunks are columns of x's buffer
        tmm = lambda xt, w: mm(xt, w, transpose_a=True, transpose_b=True)  # noqa: E731
        cases["transposed"] = public(case(mesh, "bidirectional", tmm, lambda xt, w: xt.T @ w.T, (x.T, w1.T),
                                          [(None, "x"), ("x", None)]))
    if part == "rings":
        return r

    mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
    # (batch, tokens, features) activations, tokens sequence-parallel: the ring's factor is the
    # result's middle axis (chunks written into, or sliced from, axis 1)
    up = lambda x, w, ein=jax_cute.einsum: ein("btd,dh->bth", x, w)  # noqa: E731
    down = lambda h, w, ein=jax_cute.einsum: ein("bth,hd->btd", h, w)  # noqa: E731
    r["einsum_up"] = public(case(mesh, "bidirectional", up, functools.partial(up, ein=jnp.einsum),
                                 (rnd(3, 20, 13), rnd(13, 12)), [(None, "x", None), (None, "x")],
                                 out=(None, None, "x")))
    r["einsum_down"] = public(case(mesh, "bidirectional", down, functools.partial(down, ein=jnp.einsum),
                                   (rnd(3, 20, 12), rnd(12, 13)), [(None, None, "x"), ("x", None)],
                                   out=(None, "x", None)))
    args, specs = (rnd(64, 48), rnd(48, 96) / 7, rnd(96, 48) / 10), [("x", None), (None, "x"), ("x", None)]
    on = case(mesh, "bidirectional", mlp, ref_mlp, args, specs, out=("x", None), dtype=jnp.bfloat16)
    off = case(mesh, False, mlp, ref_mlp, args, specs, out=("x", None), dtype=jnp.bfloat16)
    rel = lambda a, b: mx(a.astype(jnp.float32) - b.astype(jnp.float32)) / mx(b)  # noqa: E731
    r["bf16"] = {**public(on), "vs_off": mx(on["got"].astype(jnp.float32) - off["got"].astype(jnp.float32)),
                 "grad_vs_off": [rel(a, b) for a, b in zip(on["grads"], off["grads"])]}
    # gelu fused into the first product: with the switch on its GEMM takes the ring as a plain one
    fused_mlp = lambda x, w1, w2: mm(mm(x, w1, activation="gelu"), w2)  # noqa: E731
    r["bf16_fused"] = public(case(mesh, "bidirectional", fused_mlp, ref_mlp, args, specs, out=("x", None),
                                  dtype=jnp.bfloat16))

    # Tokens over (data, model). Shardy may keep the hidden activation's rows sharded (and gather
    # the weights) on such a mesh; the constraint asks for Megatron's layout, rows over data only.
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    tokens = ("data", "model")
    hidden = NamedSharding(mesh, P("data", "model"))
    wsc = jax.lax.with_sharding_constraint
    mlp2 = lambda x, w1, w2, mm=mm: mm(wsc(jax.nn.gelu(mm(x, w1)), hidden), w2)  # noqa: E731
    r["data_model"] = public(case(mesh, "bidirectional", mlp2, ref_mlp, (rnd(56, 13), rnd(13, 20), rnd(20, 12)),
                                  [(tokens, None), (None, "model"), ("model", None)], out=(tokens, None)))
    return r


if __name__ == "__main__":
    print(json.dumps(_worker(*sys.argv[1:])))
