"""Train a transformer MLP block on jax_cute.matmul: jit + grad + plain SGD.

The block is ``y = x + gelu(x @ W1) @ W2``, fitted to a fixed random "teacher" block of the same
shape (synthetic regression). On a GPU the parameters are bf16 for the matmuls with an f32
master copy; on a CPU everything is f32 and jax_cute runs its reference path (plain lax ops).
The same step is then timed with ``jnp.matmul`` in place of ``jax_cute.matmul``.

    python examples/mlp_training.py                 # small on CPU, large on GPU
    python examples/mlp_training.py --size large    # batch 8192, d_model 4096, d_ff 14336
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

import jax_cute
from training_loop import parse_args, path_taken, train_and_compare

SIZES = {  # (batch, d_model, d_ff, steps, lr)
    "tiny": (64, 32, 128, 20, 1.0),  # lr 1.0 was stable from d_model 32 to 1024 (scanned on CPU)
    "small": (512, 256, 1024, 30, 1.0),
    "large": (8192, 4096, 14336, 20, 1.0),
}

Params = dict[str, jax.Array]


def init(key: jax.Array, d_model: int, d_ff: int) -> Params:
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (d_model, d_ff), jnp.float32) / d_model ** 0.5,
            "w2": jax.random.normal(k2, (d_ff, d_model), jnp.float32) / d_ff ** 0.5}


def block(params: Params, x: jax.Array, mm: Callable, dtype) -> jax.Array:
    """x + gelu(x W1) W2, matmuls in ``dtype`` accumulating in f32 (the master copy stays f32)."""
    h = mm(x.astype(dtype), params["w1"].astype(dtype), preferred_element_type=jnp.float32)
    h = jax.nn.gelu(h).astype(dtype)
    return x + mm(h, params["w2"].astype(dtype), preferred_element_type=jnp.float32)


def make_step(mm: Callable, dtype, lr: float, transform: Callable | None = None) -> Callable:
    """The jitted SGD step; ``transform`` (e.g. ``jax_cute.kernelize``) wraps the loss before
    it is differentiated."""
    def loss_fn(params, x, y):
        return jnp.mean(jnp.square(block(params, x, mm, dtype) - y))

    loss = transform(loss_fn) if transform is not None else loss_fn

    @jax.jit
    def step(params, x, y):
        loss_value, grads = jax.value_and_grad(loss)(params, x, y)
        return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss_value  # plain SGD on f32 masters

    return step


def data(key: jax.Array, batch: int, d_model: int, n_batches: int = 4) -> tuple[jax.Array, jax.Array]:
    """A few fixed batches of x and the teacher's y = teacher(x) (teacher output scaled to ~unit)."""
    kt, kx = jax.random.split(key)
    teacher = init(kt, d_model, 4 * d_model)
    x = jax.random.normal(kx, (n_batches, batch, d_model), jnp.float32)
    y = jax.vmap(lambda xb: block(teacher, xb, jnp.matmul, jnp.float32))(x)
    return x, y


def main(argv: list[str] | None = None) -> dict:
    on_gpu = jax.default_backend() == "gpu"
    args = parse_args(__doc__, SIZES, "jnp.matmul", argv)
    batch, d_model, d_ff, steps, lr = SIZES[args.size]
    steps, lr = args.steps or steps, args.lr or lr
    dtype = jnp.bfloat16 if on_gpu else jnp.float32

    params = init(jax.random.key(0), d_model, d_ff)
    x, y = data(jax.random.key(1), batch, d_model)
    step = make_step(jax_cute.matmul, dtype, lr)
    print(f"MLP block: batch {batch}, d_model {d_model}, d_ff {d_ff}, {jnp.dtype(dtype).name} matmuls, "
          f"{steps} SGD steps (lr {lr})")
    path = path_taken(step, params, x[0], y[0])
    print(f"path: {path}")
    ref_step = None if args.no_compare else make_step(jnp.matmul, dtype, lr)
    out = train_and_compare(step, ref_step, params, x, y, steps, names=("jax_cute.matmul", "jnp.matmul"),
                            labels=("jax_cute", "jnp"), flops=6 * 2 * batch * d_model * d_ff,  # 2 GEMMs fwd, 4 bwd
                            gemms="GEMMs", verbose=not args.quiet)
    return {"path": path, **out}


if __name__ == "__main__":
    main()
