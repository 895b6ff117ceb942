"""Whole training steps on a mesh of 8 CPU devices: the GPT example (examples/gpt_training.py)
kernelized and trained data parallel, fully sharded, tensor parallel, on a 2-D data x model
mesh, and with an expert-parallel MoE (a ``shard_map`` that kernelize enters), each against the
same model unsharded: the loss of two AdamW steps, the gradients, the collectives the
partitioned step holds, and no XLA dot left in its lowering for sm_90a.

The devices must be set before JAX starts, so this file runs itself in a subprocess
(``python tests/test_training_sharded.py``) that prints every case as JSON.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEVICES = 8
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
# name: (mesh axes, fully sharded weights, MoE)
CASES = {
    "data_parallel": ({"data": 8}, False, False),
    "fully_sharded": ({"data": 8}, True, False),
    "tensor_parallel": ({"model": 8}, False, False),
    "data_x_model": ({"data": 2, "model": 4}, False, False),
    "moe_expert_parallel": ({"data": 8}, False, True),
    "moe_data_x_model": ({"data": 2, "model": 4}, True, True),
}


# -- the worker (its own process, 8 CPU devices) ------------------------------------------------

def _collectives(text: str) -> dict[str, int]:
    return {c: len(re.findall(rf"\b{c}(-start)?\(", text)) for c in COLLECTIVES}


def _max_rel(a, b) -> float:
    import jax
    import jax.numpy as jnp

    diffs = jax.tree.map(lambda x, y: float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-30)), a, b)
    return max(jax.tree.leaves(diffs))


def _worker() -> dict:
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, str(ROOT / "examples"))
    import gpt_training as gpt
    import jax_cute

    out: dict = {"jax": jax.__version__, "devices": len(jax.devices())}

    # The snippet of a first data-parallel step: dW's contraction is batch x tokens, batch sharded.
    mesh = gpt.make_mesh({"data": 2})
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    x = jax.device_put(jax.random.normal(jax.random.key(0), (4, 64, 256), jnp.bfloat16), sharded)
    w = jax.random.normal(jax.random.key(1), (256, 512), jnp.bfloat16)
    g = jax.grad(lambda x, w: jnp.sum(jax_cute.matmul(x, w).astype(jnp.float32) ** 2), (0, 1))
    ref = jax.grad(lambda x, w: jnp.sum(jnp.matmul(x, w).astype(jnp.float32) ** 2), (0, 1))
    got, want = jax.jit(g)(x, w), jax.jit(ref)(x, w)
    out["snippet"] = {"rel": _max_rel(jax.tree.map(lambda a: a.astype(jnp.float32), got),
                                      jax.tree.map(lambda a: a.astype(jnp.float32), want)),
                      "dx_spec": [a for a in got[0].sharding.spec]}

    @functools.lru_cache(maxsize=None)
    def unsharded(moe: bool):
        cfg = gpt.Config(vocab=128, d_model=64, heads=8, layers=2, seq=16, batch=8, moe=moe, lr=3e-3)
        params, opt_state, tx = gpt.init_train_state(jax.random.key(0), cfg)
        data = list(gpt.batches(jax.random.key(1), cfg, n=2))
        losses, _ = gpt.train(gpt.make_step(cfg, tx, kernelized=True), params, opt_state, data, 2, "", False)
        grads = jax.jit(jax.grad(jax_cute.kernelize(lambda p, t: gpt.loss_fn(p, t, cfg))))(params, data[0])
        return cfg, params, opt_state, tx, data, losses, grads

    for name, (axes, fsdp, moe) in CASES.items():
        cfg, params, opt_state, tx, data, want_losses, want_grads = unsharded(moe)
        mesh = gpt.make_mesh(axes)
        sparams, sopt, shardings = gpt.shard_train_state(params, opt_state, tx, cfg, mesh, fsdp)
        sdata = [gpt.place(d, shardings[2]) for d in data]
        step = gpt.make_step(cfg, tx, kernelized=True, mesh=mesh, shardings=shardings)
        step = step.lower(sparams, sopt, sdata[0]).compile()
        losses, _ = gpt.train(step, sparams, sopt, sdata, 2, "", False)
        loss = jax_cute.kernelize(lambda p, t: gpt.loss_fn(p, t, cfg, mesh))
        grad_fn = jax.jit(jax.grad(loss), in_shardings=shardings[::2], out_shardings=shardings[0])
        grads = grad_fn(sparams, sdata[0])
        with jax_cute.config.override(target_arch="sm_90a"):
            cuda = jax.jit(jax.value_and_grad(loss)).trace(sparams, sdata[0]).lower(
                lowering_platforms=("cuda",)).as_text()
        out[name] = {
            "losses": losses, "want_losses": want_losses, "grad_rel": _max_rel(grads, want_grads),
            "grad_specs_kept": all(g.sharding.is_equivalent_to(s, g.ndim) for g, s in
                                   zip(jax.tree.leaves(grads), jax.tree.leaves(shardings[0]))),
            "step": _collectives(step.as_text()),
            "cuda_dots": len(re.findall(r"stablehlo\.dot_general", cuda)),
            "cuda_products": cuda.count("CustomSPMDPartitioning") + cuda.count("@jax_cute_launch"),
            "report": [p.kernelized for p in loss.report.products],
        }
    return out


# -- the tests ------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _results() -> dict:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def results() -> dict:
    return _results()


def test_data_parallel_weight_gradient_lowers_and_matches(results):
    """The gradient of a batch-sharded product: dW contracts over batch x tokens, the batch sharded."""
    case = results["snippet"]
    assert case["rel"] <= 2e-2, case
    assert case["dx_spec"][0] == "data"


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_training_step_matches_the_unsharded_model(results, name):
    case = results[name]
    for got, want in zip(case["losses"], case["want_losses"]):
        assert abs(got - want) <= 1e-4 * abs(want), case
    # each shard's part of a weight gradient is rounded to bf16 before the sum over shards
    assert case["grad_rel"] <= 2e-2, case
    assert case["grad_specs_kept"], case
    assert all(case["report"]) and case["report"], case  # every product on jax_cute
    assert case["cuda_dots"] == 0 and case["cuda_products"] >= 10, case


def test_two_processes_through_jax_distributed_train_like_one(tmp_path):
    """The example's multi-process path (one process per device, as across hosts): two CPU
    processes joined by jax.distributed train to the losses of one process with two devices."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["examples/gpt_training.py", "--mesh", "data=2", "--steps", "3", "--quiet", "--no-compare", "--batch", "8"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, *argv, "--distributed", f"127.0.0.1:{port},2,{i}",
                               "--json", str(tmp_path / f"p{i}.json")], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    one = subprocess.run([sys.executable, *argv, "--json", str(tmp_path / "one.json")], cwd=ROOT, text=True,
                         env={**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}, capture_output=True,
                         timeout=600)
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    assert one.returncode == 0, one.stderr[-3000:]
    two, single = (json.loads((tmp_path / f).read_text()) for f in ("p0.json", "one.json"))
    assert not (tmp_path / "p1.json").exists()  # only the first process reports
    assert two["processes"] == 2 and two["devices"] == 2 and single["processes"] == 1
    for a, b in zip(two["losses"], single["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b), (two["losses"], single["losses"])


def test_collectives_of_each_parallelism(results):
    dp, fsdp, tp = results["data_parallel"]["step"], results["fully_sharded"]["step"], results["tensor_parallel"]["step"]
    assert dp["all-gather"] == 0 and dp["all-to-all"] == 0 and dp["all-reduce"] >= 1, dp  # gradients summed
    assert fsdp["all-gather"] >= 1, fsdp  # each layer's weights gathered where they are used
    assert tp["all-reduce"] >= 2 and tp["all-to-all"] == 0, tp  # row-parallel attention and MLP outputs
    for name in ("moe_expert_parallel", "moe_data_x_model"):
        assert results[name]["step"]["all-to-all"] >= 6, results[name]  # 3 forward, 3 backward


if __name__ == "__main__":
    print(json.dumps(_worker()))
