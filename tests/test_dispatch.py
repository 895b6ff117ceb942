"""Kernel dispatch by compute capability, the Blackwell opt-in and its first-use check.

The device's compute capability is faked: no Blackwell GPU exists here, and these rules must
hold before one does.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re

import jax
import jax.numpy as jnp
import pytest

import jax_cute
from jax_cute import arch, autotune, config, dispatch, selfcheck
from jax_cute.kernels import sm90_gemm, sm90_grouped
from jax_cute.kernels.gemm_spec import GemmSpec
from concurrently import run_at_once

ARGS = [jax.ShapeDtypeStruct((256, 128), jnp.bfloat16), jax.ShapeDtypeStruct((128, 64), jnp.bfloat16)]


def lower() -> str:
    f = lambda a, b: jax_cute.matmul(a, b)  # noqa: E731 - a new function: no cached lowering
    return jax.jit(f).trace(*ARGS).lower(lowering_platforms=("cuda",)).as_text()


@pytest.fixture
def device(monkeypatch):
    def fake(major: int, minor: int):
        monkeypatch.setattr(arch, "device_capability", lambda: (major, minor))
        selfcheck._verdicts.clear()
    yield fake
    selfcheck._verdicts.clear()


@pytest.mark.parametrize("cc,target", [((9, 0), "sm_90a"), ((10, 0), "sm_100a"), ((10, 3), None),
                                       ((12, 0), None), ((8, 0), None), ((9, 1), None)])
def test_arch_for_capability(cc, target):
    assert arch.arch_for_capability(*cc) == target


def test_explicit_arch_wins_and_unknown_arch_is_refused(device):
    device(8, 0)
    with config.override(target_arch="sm_90a"):
        assert dispatch.target_arch() == ("sm_90a", "explicit")
    with pytest.raises(ValueError, match="sm_80.*known: sm_90a, sm_100a"):
        config.set(target_arch="sm_80")


def test_hopper_device_gets_the_hopper_kernel(device):
    device(9, 0)
    text = lower()
    assert "@jax_cute_launch" in text and "arch_major = 9" in text


@pytest.mark.parametrize("cc", [(10, 3), (12, 0), (8, 9)])
def test_other_devices_fall_back(device, cc, caplog):
    device(*cc)
    with caplog.at_level(logging.WARNING, logger="jax_cute"):
        assert "@jax_cute_launch" not in lower()
    assert any(f"{cc[0]}.{cc[1]} has no jax_cute kernels" in r.getMessage() for r in caplog.records)


def test_blackwell_is_opt_in(device, caplog):
    device(10, 0)
    with caplog.at_level(logging.WARNING, logger="jax_cute"):
        assert "@jax_cute_launch" not in lower()
    assert any("JAX_CUTE_UNVERIFIED_KERNELS=1" in r.getMessage() for r in caplog.records)
    with config.override(strict=True), pytest.raises(jax_cute.FallbackError, match="compile-verified only"):
        lower()


def test_opted_in_blackwell_kernel_that_fails_its_check_falls_back(device, monkeypatch, caplog):
    device(10, 0)
    monkeypatch.setattr(selfcheck, "compare", lambda *a, **k: (lambda: 0.5))
    with config.override(unverified_kernels=True), caplog.at_level(logging.WARNING, logger="jax_cute"):
        assert "@jax_cute_launch" not in lower()
    assert any("failed its first-use check" in r.getMessage() for r in caplog.records)


def test_opted_in_blackwell_kernel_that_passes_is_used_and_checked_once(device, monkeypatch):
    device(10, 0)
    runs = []
    monkeypatch.setattr(selfcheck, "compare", lambda *a, **k: (lambda: runs.append(1) or 1e-3))
    with config.override(unverified_kernels=True):
        text = lower()
        lower()
    assert "@jax_cute_launch" in text and "arch_major = 10" in text
    assert runs == [1]


def test_blackwell_lowered_for_export_without_a_device_is_unchecked(device, caplog):
    device(9, 0)  # a Hopper machine lowering for sm_100a: nothing here can run the check
    with config.override(target_arch="sm_100a", unverified_kernels=True), \
            caplog.at_level(logging.WARNING, logger="jax_cute"):
        assert "arch_major = 10" in lower()
    assert any("will run unchecked" in r.getMessage() for r in caplog.records)


def test_autotune_reuses_a_remembered_winner(tmp_path, device):
    """A winner in autotune.json is used as it is (timing needs a GPU; reuse does not)."""
    device(8, 0)  # no matching GPU: nothing is timed, the table alone decides
    spec = GemmSpec("bfloat16", "bfloat16", "bfloat16", "k", "n", "n")
    default = sm90_gemm.heuristic(spec, 256, 64, 128, 1)
    choice = next(c for c in sm90_gemm.candidate_configs(spec) if c.key() != default.key() and c.split_k == 1)
    key = autotune.problem_key(sm90_gemm, "sm_90a", spec, (256, 64, 128, 1))
    (tmp_path / "autotune.json").write_text(json.dumps({key: {"config": choice.key()}}))
    with config.override(target_arch="sm_90a", autotune=True, cache_dir=str(tmp_path)):
        text = lower()
    assert choice.key() in text
    with config.override(target_arch="sm_90a", autotune=False, cache_dir=str(tmp_path)):
        assert choice.key() not in lower()  # the heuristic's own choice


@pytest.mark.parametrize("table", ['[1, 2]', '"x"', "{not json", '{"KEY": 5}', '{"KEY": {"config": 7}}',
                                   '{"KEY": {"seconds": 1}}', '{"KEY": ["c"]}'])
def test_a_wrong_shaped_autotune_table_is_ignored_with_a_warning(tmp_path, device, caplog, table):
    device(8, 0)  # nothing to time on: the heuristic's config
    spec = GemmSpec("bfloat16", "bfloat16", "bfloat16", "k", "n", "n")
    key = autotune.problem_key(sm90_gemm, "sm_90a", spec, (256, 64, 128, 1))
    (tmp_path / "autotune.json").write_text(table.replace("KEY", key))
    with config.override(target_arch="sm_90a", autotune=True, cache_dir=str(tmp_path)), \
            caplog.at_level(logging.WARNING, logger="jax_cute"):
        assert "@jax_cute_launch" in lower()
    assert any("jax_cute autotune: ignoring" in r.getMessage() for r in caplog.records)


_RECORD_AT_ONCE = r"""
import sys, time
from pathlib import Path
from jax_cute import autotune, config

root, me, ready, n = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
(ready / str(me)).touch()
while len(list(ready.iterdir())) < n:  # every process is past its imports: write together
    time.sleep(0.01)
with config.override(cache_dir=root):
    for i in range(100 * me, 100 * me + 15):
        autotune._record(f"problem{i}", {"config": f"c{i}"})
"""


@pytest.mark.sweep   # (7 s: CI's second step, so the README's test line stays under 10 minutes)
def test_autotune_records_from_several_processes_keep_every_winner(tmp_path):
    """Writes are read-update-replace under a lock: concurrent processes lose nothing, and the
    table is always whole JSON."""
    run_at_once(_RECORD_AT_ONCE, tmp_path, 4, str(tmp_path))
    table = json.loads((tmp_path / "autotune.json").read_text())
    assert len(table) == 60 and table["problem314"] == {"config": "c314"}


def test_autotune_samples_every_candidate_each_round_in_varying_order():
    """Autotune's timing loop: every candidate sampled once per round; each round starts with
    another candidate, and the rest follow in an order that varies (no fixed neighbour)."""
    calls: list[str] = []

    def fn(name):
        def call(x):
            calls.append(name)
            return x
        return call

    names = list("abcd")
    out = autotune._time_interleaved({n: fn(n) for n in names}, (jnp.zeros(()),), window=0.0, rounds=8)
    assert set(out) == set(names) and all(v >= 0 for v in out.values())
    # after the warm-up calls (one per candidate), each round is: one untimed call, then each
    # candidate's samples (3 calls each with window 0)
    rounds = calls[len(names):]
    per_round = 1 + 3 * len(names)
    assert len(rounds) == 8 * per_round
    orders = [[rounds[i * per_round + 1 + 3 * j] for j in range(len(names))] for i in range(8)]
    for r, order in enumerate(orders):
        assert order[0] == names[r % len(names)] and sorted(order) == names
    assert len({o[o.index("b") - 1] for o in orders if o[0] != "b"}) > 1


def test_launch_mode_adds_pdl_only_off_graphs_and_only_where_a_config_has_it():
    dense = sm90_gemm.Config()
    assert dispatch.launch_mode(dense) == dense
    with config.override(command_buffer=False):
        assert dispatch.launch_mode(dense) == sm90_gemm.Config(pdl=True)
        grouped = sm90_grouped.Config()
        assert dispatch.launch_mode(grouped) == grouped


@pytest.mark.parametrize("switch,value", [("target_arch", "sm_89"), ("strict", "maybe"), ("nan_fill", 2),
                                          ("cache_dir", 3), ("no_such_switch", True)])
def test_config_refuses_bad_values_when_set(switch, value):
    with pytest.raises(ValueError, match="jax_cute.config"):
        config.set(**{switch: value})


def test_config_refuses_bad_environment_values_when_read(monkeypatch):
    monkeypatch.setenv("JAX_CUTE_STRICT", "maybe")
    with pytest.raises(ValueError, match="JAX_CUTE_STRICT must be a boolean"):
        config.strict()
    monkeypatch.setenv("JAX_CUTE_TARGET_ARCH", "sm_89")
    with pytest.raises(ValueError, match="JAX_CUTE_TARGET_ARCH='sm_89' has no jax_cute kernels"):
        config.target_arch()
    monkeypatch.setenv("JAX_CUTE_STRICT", "off")
    with pytest.raises(ValueError, match="JAX_CUTE_TARGET_ARCH='sm_89'"):
        config.strict()  # reading any switch checks them all
    monkeypatch.delenv("JAX_CUTE_TARGET_ARCH")
    assert config.strict() is False


@pytest.mark.parametrize("var,value,says", [("JAX_CUTE_STRICT", "maybe", "must be a boolean"),
                                            ("JAX_CUTE_DISK_CACHE", "2", "must be a boolean"),
                                            ("JAX_CUTE_TARGET_ARCH", "sm_80", "has no jax_cute kernels")])
def test_bad_environment_values_fail_the_first_call_on_cpu(monkeypatch, var, value, says):
    """Checked when a function is traced, whichever platform it will run on, not only when
    lowering for a GPU."""
    monkeypatch.setenv(var, value)
    x = jnp.ones((8, 8), jnp.bfloat16)
    for call in (lambda: jax_cute.matmul(x, x), lambda: jax.jit(jax_cute.matmul)(x, x),
                 lambda: jax_cute.ragged_dot(x, x[None], jnp.array([8])),
                 lambda: jax_cute.kernelize(lambda a: a @ a)(x)):
        with pytest.raises(ValueError, match=f"{var}.*{says}"):
            call()


def test_free_sms_budget_the_heuristic_the_grid_and_the_cache_key(device, monkeypatch):
    """A request that leaves SMs free (a ring's chunk GEMM) is ranked on the rest and launches its
    persistent grid there: the config carries the count, so the cache keeps it apart; a request
    that leaves none keeps the config (and key) of every other call."""
    from types import SimpleNamespace

    from jax_cute.problem.gemm_layouts import matmul_layouts

    device(9, 0)
    ranked_on, built = [], []
    heuristic = sm90_gemm.heuristic
    monkeypatch.setattr(sm90_gemm, "heuristic", lambda *a: ranked_on.append(a[-1]) or heuristic(*a))
    monkeypatch.setattr(dispatch, "family_binary", lambda fam, arch, spec, cfg: built.append(cfg)
                        or SimpleNamespace(name=cfg.key(), arch=arch))
    shape = (4096, 4096)
    layouts, _ = matmul_layouts(shape, shape, False, False)
    avals = (jax.core.ShapedArray(shape, jnp.bfloat16),) * 2
    request = dispatch.GemmRequest(avals, layouts, "bfloat16", "float32")
    for free in (0, 16):
        assert dispatch.gemm(dataclasses.replace(request, free_sms=free), lambda a, b: a @ b) is not None
    assert ranked_on == [132, 116]
    whole, budgeted = built
    assert whole.sms == 132 and ".sm" not in whole.key()
    assert budgeted == dataclasses.replace(whole, sms=116) and budgeted.key() == whole.key() + ".sm116"
    with pytest.raises(ValueError, match="leaves none for the kernel"):
        dispatch.gemm(dataclasses.replace(request, free_sms=132), lambda a, b: a @ b)


def test_ring_sms_switch_values(monkeypatch):
    monkeypatch.delenv("JAX_CUTE_RING_SMS", raising=False)
    assert config.ring_sms() == config.RING_SMS_DEFAULT
    monkeypatch.setenv("JAX_CUTE_RING_SMS", "8")
    assert config.ring_sms() == 8
    with config.override(ring_sms=0):   # Python wins over the environment
        assert config.ring_sms() == 0
    for bad in ("-1", "half", "1.5"):
        monkeypatch.setenv("JAX_CUTE_RING_SMS", bad)
        with pytest.raises(ValueError, match="JAX_CUTE_RING_SMS must be a whole number of SMs"):
            config.strict()   # reading any switch checks them all
    for bad in (-4, True, "x"):
        with pytest.raises(ValueError, match="ring_sms must be a whole number"):
            config.set(ring_sms=bad)


def test_kernel_local_hands_the_free_sms_to_its_request(monkeypatch):
    """A partitioned GEMM's per-shard computation asks dispatch with the SMs its caller leaves
    free: a ring's chunk GEMM passes them, every other call leaves none."""
    from jax_cute.primitives import rules

    asked = []
    monkeypatch.setattr(rules, "gemm", lambda req, ref: asked.append(req.free_sms))
    request = lambda avals, params: dispatch.GemmRequest(avals, None, "bfloat16", "float32")  # noqa: E731
    local = rules.kernel_local(request, lambda a, b: a @ b)
    local((), {})
    local((), {}, free_sms=16)
    assert asked == [0, 16]


def test_a_requested_split_k_ranks_only_configs_of_that_split():
    """The split-K sets the order of each element's float32 additions (with K alone), so a shard
    of a partitioned product asks for the split of the whole problem (dispatch.whole_split):
    the heuristic then ranks the configs of that split only."""
    spec = GemmSpec("bfloat16", "bfloat16", "float32", "m", "k", "n", batch_modes=3)
    small, whole = (64, 256, 256, 16), (64, 256, 256, 64)   # attention's probs @ v on 4 shards, on one device
    assert sm90_gemm.heuristic(spec, *whole).split_k == 1 and sm90_gemm.heuristic(spec, *small).split_k == 4
    assert sm90_gemm.heuristic(spec, *small, split_k=1).split_k == 1
    assert sm90_gemm.heuristic(spec, *small, split_k=2).split_k == 2
    # a split no candidate has (a fused pre-activation takes unsplit tiles only): the heuristic's own
    fused = GemmSpec("bfloat16", "bfloat16", "bfloat16", "k", "n", "n", activation="gelu", preact=True)
    assert sm90_gemm.heuristic(fused, 512, 512, 2048, 1, split_k=4).split_k == 1


def test_several_outputs_pass_through_one_barrier_and_workspaces_stay_out(device):
    """A kernel's outputs pass through an optimization barrier when the caller reads more than
    one (the fused gelu GEMM's output and pre-activation): XLA's dynamic-slice fusion (jaxlib
    0.11) would otherwise clone such a call whose outputs a scan stacks and run it twice
    (tests/test_gpu_remat.py counts the launches). Calls with one read output (and split-K
    workspaces beside it) keep none, so that fusion may still write them in place, and so do
    calls with aliased outputs (on the GPU such a call behind a barrier in a scan gave wrong
    results)."""
    device(9, 0)

    def mlp(x, w1, w2):
        h = jax.nn.gelu(jnp.matmul(x, w1, preferred_element_type=jnp.float32)).astype(jnp.bfloat16)
        return jnp.matmul(h, w2, preferred_element_type=jnp.float32)

    grad = jax.grad(lambda *a: jnp.sum(jax_cute.kernelize(mlp)(*a) ** 2), argnums=(0, 1, 2))
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((256, 128), (128, 512), (512, 128))]
    text = jax.jit(grad).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = dict(re.findall(r"(%\d+)(?::(\d+))? = stablehlo.custom_call @jax_cute_launch", text))
    barriers = re.findall(r"= stablehlo.optimization_barrier ([^:]+) :", text)
    assert len(calls) == 6 and any(n and int(n) > 2 for n in calls.values()), calls  # split-K workspaces
    assert len(barriers) == 1, barriers
    operands = [o.strip() for o in barriers[0].split(",")]
    assert operands == ["%0#0", "%0#1"] and calls["%0"] == "2", (operands, calls)
    with config.override(nan_fill=True):   # every output aliased to a NaN-filled input: no barrier
        text = jax.jit(lambda *a: grad(*a)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "@jax_cute_launch" in text and "optimization_barrier" not in text
