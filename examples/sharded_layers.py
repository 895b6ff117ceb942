"""Sharded layers on jax_cute GEMMs, on a mesh of all visible devices, checked against the
same model unsharded.

- A tensor-parallel MLP under ``jax.jit``: ``x @ w1`` column-parallel (``w1`` sharded over its
  output features), ``gelu``, then ``@ w2`` row-parallel (``w2`` sharded over its input
  features). jax_cute's partitioning rules keep each weight where it is: the column-parallel
  product runs locally, the row-parallel one ends in one all-reduce.
- An expert-parallel mixture of experts under ``shard_map``: each device holds some experts and
  some tokens; a top-1 router sends every token to its expert's device (an all-to-all), each
  device runs ``jax_cute.ragged_dot`` over the tokens it received, sorted by expert, and a
  second all-to-all brings the results back.

Run on one device, or on 8 CPU devices:
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/sharded_layers.py
"""

from __future__ import annotations

import argparse
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_cute

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all")


def collectives(compiled_text: str) -> dict[str, int]:
    """How many of each collective a compiled (partitioned) HLO module holds."""
    return {c: len(re.findall(rf"\b{c}(-start)?\(", compiled_text)) for c in COLLECTIVES}


def path_taken(compiled_text: str) -> str:
    if jax.default_backend() != "gpu":
        return "reference path on CPU (no GPU found)"
    dev = jax.devices()[0].device_kind
    return f"jax_cute kernels on {dev}" if "jax_cute_launch" in compiled_text else \
        f"XLA fallback on {dev} (see the jax_cute log)"


def auto_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> jax.sharding.Mesh:
    # Auto axes: the SPMD partitioner (and our rules) decide each op's sharding.
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


# -- tensor-parallel MLP ------------------------------------------------------------------------

def mlp(params, x, mm=jax_cute.matmul):
    return mm(jax.nn.gelu(mm(x, params["w1"])), params["w2"])


def mlp_shardings(mesh) -> tuple[dict, NamedSharding]:
    """Column-parallel w1, row-parallel w2, tokens split over the data axis."""
    s = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    return {"w1": s(None, "model"), "w2": s("model", None)}, s("data", None)


# -- expert-parallel mixture of experts ---------------------------------------------------------

def route(x, router):
    """Top-1 routing: each token's expert and the gate weight it is scaled by."""
    probs = jax.nn.softmax(x @ router, axis=-1)
    expert = jnp.argmax(probs, axis=-1)
    return expert, jnp.take_along_axis(probs, expert[:, None], axis=-1)[:, 0]


def moe_reference(params, x):
    """The unsharded layer: each token through its own expert's two matrices."""
    expert, gate = route(x, params["router"])
    h = jax.nn.gelu(jnp.einsum("td,tdh->th", x, params["w1"][expert]))
    return jnp.einsum("th,thd->td", h, params["w2"][expert]) * gate[:, None]


def moe_shard(params, x, *, axis: str, shards: int, ragged_dot=jax_cute.ragged_dot):
    """One device's part of the layer (inside shard_map): its tokens ``x`` (t, D) and its
    experts ``w1`` (e, D, H), ``w2`` (e, H, D); the router is replicated."""
    t, e = x.shape[0], params["w1"].shape[0]
    expert, gate = route(x, params["router"])
    dest = expert // e  # the device holding the expert
    # Each token's slot among the tokens this device sends to ``dest`` (capacity t: no drops).
    order = jnp.argsort(dest, stable=True)
    counts = jnp.bincount(dest, length=shards)
    starts = jnp.cumsum(counts) - counts
    slot = jnp.zeros(t, jnp.int32).at[order].set(jnp.arange(t, dtype=jnp.int32) - starts[dest[order]])
    send = jnp.zeros((shards, t) + x.shape[1:], x.dtype).at[dest, slot].set(x)
    send_expert = jnp.full((shards, t), e, jnp.int32).at[dest, slot].set(expert % e)  # e: an empty slot
    recv = jax.lax.all_to_all(send, axis, 0, 0).reshape(shards * t, -1)
    recv_expert = jax.lax.all_to_all(send_expert, axis, 0, 0).reshape(-1)
    # Sort what arrived by local expert, empty slots last (past sum(group_sizes): zero rows).
    perm = jnp.argsort(recv_expert, stable=True)
    group_sizes = jnp.bincount(recv_expert, length=e + 1)[:e].astype(jnp.int32)
    h = jax.nn.gelu(ragged_dot(recv[perm], params["w1"], group_sizes))
    y = ragged_dot(h, params["w2"], group_sizes)
    back = jax.lax.all_to_all(jnp.zeros_like(y).at[perm].set(y).reshape(shards, t, -1), axis, 0, 0)
    return back[dest, slot] * gate[:, None]


def moe_sharded(mesh, ragged_dot=jax_cute.ragged_dot):
    """The layer over all devices of ``mesh`` (one axis, "expert"): experts and tokens split."""
    specs = {"router": P(), "w1": P("expert"), "w2": P("expert")}
    body = lambda params, x: moe_shard(params, x, axis="expert", shards=mesh.size,  # noqa: E731
                                       ragged_dot=ragged_dot)
    return jax.shard_map(body, mesh=mesh, in_specs=(specs, P("expert")), out_specs=P("expert"))


# -- the run ------------------------------------------------------------------------------------

def init(key, *, d: int, h: int, experts: int, dtype=jnp.float32) -> dict:
    k = jax.random.split(key, 5)
    n = lambda kk, shape, fan: (jax.random.normal(kk, shape) / math.sqrt(fan)).astype(dtype)  # noqa: E731
    return {"w1": n(k[0], (d, h), d), "w2": n(k[1], (h, d), h), "router": n(k[2], (d, experts), d),
            "e1": n(k[3], (experts, d, h), d), "e2": n(k[4], (experts, h, d), h)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=64, help="tokens per device")
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--h", type=int, default=256)
    p.add_argument("--experts-per-device", type=int, default=2)
    p.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU (the kernels' dtype), else float32")
    args = p.parse_args(argv)
    dtype = jnp.dtype(args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32"))
    n = len(jax.devices())
    model = math.gcd(n, 4)
    mesh = auto_mesh((n // model, model), ("data", "model"))
    params = init(jax.random.PRNGKey(0), d=args.d, h=args.h, experts=n * args.experts_per_device, dtype=dtype)
    x = jax.random.normal(jax.random.PRNGKey(1), (n * args.tokens, args.d), dtype)

    # Tensor parallel, under jit with sharded inputs.
    w_sh, x_sh = mlp_shardings(mesh)
    tp_params = {k: jax.device_put(params[k], w_sh[k]) for k in ("w1", "w2")}
    tp = jax.jit(mlp)
    compiled = tp.lower(tp_params, jax.device_put(x, x_sh)).compile().as_text()
    tp_out = tp(tp_params, jax.device_put(x, x_sh))
    tp_ref = mlp({k: params[k] for k in ("w1", "w2")}, x, jnp.matmul)
    tp_diff = float(jnp.max(jnp.abs(tp_out.astype(jnp.float32) - tp_ref.astype(jnp.float32))))

    # Expert parallel, under shard_map.
    emesh = auto_mesh((n,), ("expert",))
    ep_params = {"router": params["router"], "w1": params["e1"], "w2": params["e2"]}
    ep = jax.jit(moe_sharded(emesh))
    ep_compiled = ep.lower(ep_params, x).compile().as_text()
    ep_ref = moe_reference(ep_params, x)
    ep_diff = float(jnp.max(jnp.abs(ep(ep_params, x).astype(jnp.float32) - ep_ref.astype(jnp.float32))))

    path = path_taken(compiled + ep_compiled)
    out = {"devices": n, "mesh": dict(mesh.shape), "path": path, "dtype": dtype.name, "tp_max_abs_diff": tp_diff,
           "tp_collectives": collectives(compiled), "ep_max_abs_diff": ep_diff,
           "ep_collectives": collectives(ep_compiled)}
    print(f"path: {path}")
    print(f"{n} device(s), mesh {dict(mesh.shape)}, {dtype.name}")
    print(f"tensor-parallel MLP: max abs difference to the unsharded MLP {tp_diff:.3g}; "
          f"collectives {out['tp_collectives']}")
    print(f"expert-parallel MoE ({n * args.experts_per_device} experts): max abs difference to the "
          f"unsharded layer {ep_diff:.3g}; collectives {out['ep_collectives']}")
    return out


if __name__ == "__main__":
    main()
