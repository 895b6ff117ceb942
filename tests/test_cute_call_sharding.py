"""``cute_call(sharding_rule=...)``: a user's kernel partitioned per shard under ``jit``.

The rule's parsing, factor extents and plan here; its partitioning on 4 CPU host devices in a
subprocess (Shardy, and GSPMD in the sweep), where each shard lowers the call's reference on its
blocks as a GPU shard lowers the kernel: the tests check the blocks each shard saw, the shardings
and collectives XLA chose and every element against the unsharded computation.
"""

from __future__ import annotations

import json
import pathlib
import sys

import cutlass.cute as cute
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cute
import shared_result
from jax_cute.primitives import call_sharding

ROOT = pathlib.Path(__file__).resolve().parents[1]
BLOCK = 128


@cute.jit
def one_in_two_out(stream, x: cute.Tensor, v: cute.Tensor, s: cute.Tensor):
    """(never compiled here: the CPU runs the references)"""


@cute.jit
def one_in_one_out(stream, x: cute.Tensor, y: cute.Tensor):
    """(never compiled here)"""


def scaled_rows(x):
    """Per row, 1 x 128 blocks scaled by their amax: values (M, K) and scales (M, K / 128)."""
    m, k = x.shape
    s = jnp.max(jnp.abs(x.reshape(m, k // BLOCK, BLOCK)), axis=-1)
    return x / jnp.repeat(s, BLOCK, axis=1), s


def row_normalised(x):
    return x / jnp.sum(jnp.abs(x), axis=-1, keepdims=True)


def block_call(m: int, k: int, seen: list | None = None):
    def ref(x):
        if seen is not None:
            seen.append(tuple(x.shape))
        return scaled_rows(x)
    return jax_cute.cute_call(one_in_two_out, out_shape=(jax.ShapeDtypeStruct((m, k), jnp.float32),
                                                         jax.ShapeDtypeStruct((m, k // BLOCK), jnp.float32)),
                              reference=ref, name="scaled_rows", sharding_rule="m (kb kk) -> m (kb kk), m kb",
                              factor_sizes={"kk": BLOCK})


def norm_call(shape, seen: list | None = None, rule: str = "m n -> m n", **kw):
    def ref(x):
        if seen is not None:
            seen.append(tuple(x.shape))
        return (row_normalised(x),)
    return jax_cute.cute_call(one_in_one_out, out_shape=jax.ShapeDtypeStruct(shape, jnp.float32), reference=ref,
                              name="row_norm", sharding_rule=rule, replicated_factors=("n",), **kw)


# -- the rule ----------------------------------------------------------------------------------

def test_parse_names_each_axis_by_its_factors():
    rule = call_sharding.parse("m (kb kk), s -> m (kb kk), m kb", 2, 2, factor_sizes={"kk": 128})
    assert rule.tensors == ((("m",), ("kb", "kk")), (("s",),), (("m",), ("kb", "kk")), (("m",), ("kb",)))
    # output factors may shard; kk is not its axis's slowest; s is read whole
    assert rule.shardable == {"m", "kb"}
    sizes = call_sharding.factor_sizes(rule, [(8, 512), (1,), (8, 512), (8, 4)])
    assert sizes == {"kk": 128, "m": 8, "kb": 4, "s": 1}
    sdy = call_sharding.sdy_rule(rule, sizes)
    assert set(sdy.need_replication_factors) == {"kk", "s"}
    assert rule.batched().tensors[0] == (("vmap0",), ("m",), ("kb", "kk"))


def test_replicated_factors_stay_whole():
    rule = call_sharding.parse("m n -> m n", 1, 1, replicated=("n",))
    assert rule.shardable == {"m"}
    mesh = {"d": 2, "t": 2}
    assert call_sharding.plan(rule, {"m": 8, "n": 6}, mesh, [(("d",), ("t",)), None]) == {"m": ("d",)}
    # an extent that does not split evenly stays whole; one mesh axis serves one factor
    rule = call_sharding.parse("a b -> a b", 1, 1)
    assert call_sharding.plan(rule, {"a": 6, "b": 8}, {"d": 4, "t": 2}, [(("d",), ("t",)), None]) == {"b": ("t",)}
    assert call_sharding.plan(rule, {"a": 8, "b": 8}, {"d": 4}, [(("d",), ("d",)), None]) == {"a": ("d",)}


@pytest.mark.parametrize("rule, match", [
    ("m n", "one '->'"),
    ("m n -> m n, m", "names 1 inputs and 2 outputs"),
    ("m m -> m m", "names a factor twice"),
    ("m (n -> m n", "not a factor name"),
    ("m 1n -> m n", "not a factor name"),
])
def test_malformed_rules_are_clear_errors(rule, match):
    with pytest.raises(ValueError, match=match):
        jax_cute.cute_call(one_in_one_out, out_shape=jax.ShapeDtypeStruct((4, 4), jnp.float32), sharding_rule=rule)


def test_rule_and_shapes_must_agree_when_traced():
    x = jnp.ones((8, 256), jnp.float32)
    with pytest.raises(ValueError, match="gives tensor 0 1 axes"):
        norm_call((8, 256), rule="m -> m n")(x)
    with pytest.raises(ValueError, match=r"axis \('n',\) of tensor 1 has extent 128"):
        jax_cute.cute_call(one_in_one_out, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                           reference=lambda x: x[:, :128], sharding_rule="m n -> m n")(x)
    with pytest.raises(ValueError, match="not a multiple of 128"):
        block_call(8, 200)(jnp.ones((8, 200), jnp.float32))
    with pytest.raises(ValueError, match="replicated or factor_sizes name"):
        norm_call((8, 256), rule="m k -> m k")
    with pytest.raises(ValueError, match="not both"):
        jax_cute.cute_call(one_in_one_out, out_shape=jax.ShapeDtypeStruct((4,), jnp.float32), reference=lambda x: x,
                           sharding_rule="n -> n", partitioned_reference=True)
    with pytest.raises(ValueError, match="belong to a sharding_rule"):
        jax_cute.cute_call(one_in_one_out, out_shape=jax.ShapeDtypeStruct((4,), jnp.float32), replicated_factors=("n",))
    with pytest.raises(ValueError, match="aliased input 0 and output 0 different factors"):
        jax_cute.cute_call(one_in_one_out, out_shape=jax.ShapeDtypeStruct((8, 8), jnp.float32), reference=lambda x: x.T,
                           sharding_rule="a b -> b a", input_output_aliases={0: 0})(jnp.ones((8, 8), jnp.float32))


def test_one_device_runs_the_call_unpartitioned():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 256)), jnp.float32)
    seen: list = []
    v, s = jax.jit(block_call(8, 256, seen))(x)
    rv, rs = scaled_rows(x)
    np.testing.assert_array_equal(v, rv)
    np.testing.assert_array_equal(s, rs)
    assert seen == [(8, 256)]
    xb = jnp.stack([x, 2 * x])
    vb, sb = jax.jit(jax.vmap(block_call(8, 256)))(xb)
    np.testing.assert_array_equal(sb[1], 2 * rs)


# -- partitioned: 4 host devices (subprocess) ----------------------------------------------------

DEVICES = 4


def _script(shardy: bool) -> shared_result.Script:
    return shared_result.Script(f"test_cute_call_sharding-{'shardy' if shardy else 'gspmd'}", [sys.executable, __file__],
                                env=shared_result.host_devices_env(DEVICES, shardy), cwd=ROOT, timeout=600)


SUBPROCESS_FIXTURES = {"results": _script}


@pytest.fixture(scope="module", params=[pytest.param(True, id="shardy"),
                                        pytest.param(False, id="gspmd", marks=pytest.mark.sweep)])
def results(request):
    return _script(request.param).result()


def _spec(s) -> list:
    return [list(p) if isinstance(p, tuple) else p for p in s.spec]


def _worker() -> dict:
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    assert len(jax.devices()) == DEVICES
    mesh = jax.make_mesh((2, 2), ("d", "t"), axis_types=(AxisType.Auto,) * 2)
    rng = np.random.default_rng(1)
    m, k = 96, 1024  # (96 rows over 4 devices: 24 each, not a multiple of 8)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    out: dict = {}

    def run(name, fn, spec, seen, ref, x=x):
        seen.clear()
        xs = jax.device_put(x, NamedSharding(mesh, spec))
        jf = jax.jit(fn)
        got = jf(xs)
        got = got if isinstance(got, tuple) else (got,)
        hlo = jf.lower(xs).compile().as_text()
        out[name] = {"local": [list(s) for s in set(seen)], "specs": [_spec(g.sharding) for g in got],
                     "diff": max(float(jnp.abs(g - r).max()) for g, r in zip(got, ref)),
                     "all_gather": hlo.count("all-gather"), "all_reduce": hlo.count("all-reduce")}

    seen: list = []
    blocks = scaled_rows(x)
    for name, spec in [("rows_and_blocks", P("d", "t")), ("blocks", P(None, ("d", "t"))),
                       ("rows", P(("d", "t"), None)), ("replicated", P())]:
        run(name, block_call(m, k, seen), spec, seen, blocks)
    # 3 blocks of 128 columns do not split over 2 devices: K is gathered, the rows stay split
    x3 = x[:, :3 * BLOCK]
    run("part_blocks", block_call(m, 3 * BLOCK, seen), P("d", "t"), seen, scaled_rows(x3), x=x3)
    run("norm", norm_call((m, k), seen), P("d", "t"), seen, (row_normalised(x),))
    # vmap with batch_mode: the batch axis is one more factor
    xb = jnp.stack([x, -x])
    seenb: list = []
    fb = jax.vmap(jax_cute.cute_call(one_in_one_out, out_shape=jax.ShapeDtypeStruct((m, k), jnp.float32),
                                     reference=lambda t: (seenb.append(tuple(t.shape)) or row_normalised(t),),
                                     name="row_norm_b", sharding_rule="m n -> m n", replicated_factors=("n",),
                                     batch_mode=True))
    xbs = jax.device_put(xb, NamedSharding(mesh, P("d", "t", None)))
    yb = jax.jit(fb)(xbs)
    out["vmap"] = {"local": [list(s) for s in set(seenb)], "spec": _spec(yb.sharding),
                   "diff": float(jnp.abs(yb - row_normalised(xb)).max())}
    # inside shard_map every shard calls it on its own block: no partitioning rule is asked
    seen.clear()
    sm = jax.shard_map(norm_call((m // 2, k), seen), mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    ys = jax.jit(sm)(jax.device_put(x, NamedSharding(mesh, P("d"))))
    out["shard_map"] = {"local": [list(s) for s in set(seen)],
                        "diff": float(jnp.abs(ys - row_normalised(x)).max())}
    return out


def test_blocks_of_a_sharded_factor_run_locally(results):
    case = results["rows_and_blocks"]
    assert case["local"] == [[48, 512]]  # each shard: its rows, its 128-column blocks
    assert case["specs"] == [["d", "t"], ["d", "t"]]  # the scales shard with their blocks
    assert case["diff"] == 0 and case["all_gather"] == 0 and case["all_reduce"] == 0


@pytest.mark.parametrize("name, local, spec", [("blocks", [96, 256], [None, ["d", "t"]]),
                                               ("rows", [24, 1024], [["d", "t"]]),
                                               ("replicated", [96, 1024], [])])
def test_each_operand_sharding_keeps_its_blocks(results, name, local, spec):
    case = results[name]
    assert case["local"] == [local] and case["diff"] == 0 and case["all_gather"] == 0
    assert case["specs"][0] == spec


def test_a_factor_that_does_not_split_evenly_is_gathered(results):
    case = results["part_blocks"]
    assert case["local"] == [[48, 384]] and case["diff"] == 0 and case["all_gather"] >= 1


def test_a_replicated_factor_is_gathered_first(results):
    case = results["norm"]
    assert case["local"] == [[48, 1024]]  # whole rows, still split over d
    assert case["all_gather"] >= 1 and case["diff"] <= 1e-6
    assert case["specs"][0][0] == "d"


def test_vmap_batch_axis_is_a_shardable_factor(results):
    case = results["vmap"]
    assert case["local"] == [[1, 48, 1024]] and case["spec"][:2] == ["d", "t"] and case["diff"] <= 1e-6


def test_shard_map_calls_it_per_shard(results):
    case = results["shard_map"]
    assert case["local"] == [[48, 1024]] and case["diff"] <= 1e-6


if __name__ == "__main__":
    print(json.dumps(_worker()))
