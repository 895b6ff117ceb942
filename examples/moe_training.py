"""Train a mixture-of-experts layer on jax_cute.ragged_dot: router, top-2 of 8 experts, SGD.

Tokens are routed to their top-k experts, sorted by expert so each expert's tokens are one
contiguous group, pushed through the experts' MLPs as two grouped GEMMs (``ragged_dot``),
unsorted and combined with the router weights. The layer is fitted to a fixed random "teacher"
MoE (synthetic regression); the same step is then timed on ``jax.lax.ragged_dot``.

    python examples/moe_training.py                 # small on CPU, large on GPU
    python examples/moe_training.py --size large    # 16384 tokens, 4096 hidden, 14336 intermediate
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

import jax_cute
from training_loop import parse_args, path_taken, train_and_compare

SIZES = {  # (tokens, d_model, d_ff, experts, top_k, steps, lr)
    "tiny": (128, 32, 64, 8, 2, 20, 1.0),
    "small": (1024, 128, 256, 8, 2, 30, 1.0),
    "large": (16384, 4096, 14336, 8, 2, 10, 1.0),
}

Params = dict[str, jax.Array]


def init(key: jax.Array, d_model: int, d_ff: int, experts: int) -> Params:
    kr, k1, k2 = jax.random.split(key, 3)
    return {"router": jax.random.normal(kr, (d_model, experts), jnp.float32) / d_model ** 0.5,
            "w1": jax.random.normal(k1, (experts, d_model, d_ff), jnp.float32) / d_model ** 0.5,
            "w2": jax.random.normal(k2, (experts, d_ff, d_model), jnp.float32) / d_ff ** 0.5}


def moe(params: Params, x: jax.Array, rdot: Callable, dtype, top_k: int) -> jax.Array:
    """x + sum_k weight_k * expert_k(x) over each token's top-k experts."""
    tokens, experts = x.shape[0], params["router"].shape[1]
    probs = jax.nn.softmax(x @ params["router"], axis=-1)
    weights, expert_ids = jax.lax.top_k(probs, top_k)                     # (T, k)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    flat_ids = expert_ids.reshape(-1)                                     # (T*k,) assignment -> expert
    order = jnp.argsort(flat_ids, stable=True)                            # group assignments by expert
    group_sizes = jnp.bincount(flat_ids, length=experts).astype(jnp.int32)
    xs = jnp.repeat(x, top_k, axis=0)[order].astype(dtype)               # (T*k, D) sorted by expert
    h = rdot(xs, params["w1"].astype(dtype), group_sizes, preferred_element_type=jnp.float32)
    h = jax.nn.gelu(h).astype(dtype)
    ys = rdot(h, params["w2"].astype(dtype), group_sizes, preferred_element_type=jnp.float32)
    y = jnp.zeros_like(ys).at[order].set(ys).reshape(tokens, top_k, -1)  # unsort
    return x + jnp.einsum("tkd,tk->td", y, weights)


def make_step(rdot: Callable, dtype, top_k: int, lr: float) -> Callable:
    def loss_fn(params, x, y):
        return jnp.mean(jnp.square(moe(params, x, rdot, dtype, top_k) - y))

    @jax.jit
    def step(params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss  # plain SGD on f32 masters

    return step


def main(argv: list[str] | None = None) -> dict:
    on_gpu = jax.default_backend() == "gpu"
    args = parse_args(__doc__, SIZES, "jax.lax.ragged_dot", argv)
    tokens, d_model, d_ff, experts, top_k, steps, lr = SIZES[args.size]
    steps, lr = args.steps or steps, args.lr or lr
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    rdot, rname = jax_cute.ragged_dot, "jax_cute.ragged_dot"

    params = init(jax.random.key(0), d_model, d_ff, experts)
    teacher = init(jax.random.key(1), d_model, d_ff, experts)
    x = jax.random.normal(jax.random.key(2), (4, tokens, d_model), jnp.float32)
    # lax.map, not vmap: jax.lax.ragged_dot has no batching rule for this case.
    # The teacher is an argument, not a closure: closed-over arrays become constants in the program.
    y = jax.jit(lambda t, xs: jax.lax.map(lambda xb: moe(t, xb, jax.lax.ragged_dot, jnp.float32, top_k), xs))(teacher, x)
    step = make_step(rdot, dtype, top_k, lr)
    print(f"MoE layer: {tokens} tokens, d_model {d_model}, d_ff {d_ff}, top-{top_k} of {experts} experts, "
          f"{jnp.dtype(dtype).name} grouped GEMMs on {rname}, {steps} SGD steps (lr {lr})")
    path = path_taken(step, params, x[0], y[0])
    print(f"path: {path}")
    ref_step = None if args.no_compare else make_step(jax.lax.ragged_dot, dtype, top_k, lr)
    out = train_and_compare(step, ref_step, params, x, y, steps, names=(rname, "jax.lax.ragged_dot"),
                            labels=("moe", "lax"),
                            flops=6 * 2 * tokens * top_k * d_model * d_ff,  # 2 grouped GEMMs fwd, 4 bwd
                            gemms="grouped GEMMs", verbose=not args.quiet)
    return {"path": path, **out}


if __name__ == "__main__":
    main()
