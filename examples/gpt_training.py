"""Train a GPT-style decoder twice from the same start: as written, and through jax_cute.kernelize.

The model is plain JAX with optax: token and position embeddings, pre-norm blocks of causal
multi-head attention (``jnp.einsum``) and a GELU MLP, layers stacked under ``lax.scan`` with
``jax.checkpoint``, a tied LM head. Parameters are f32 master weights; every product runs in
bf16 and returns f32 (``preferred_element_type``), as mixed-precision training does. AdamW.
``--moe`` replaces each MLP by a mixture of experts (top-2 of 8, tokens sorted by expert, two
``lax.ragged_dot``s).

The kernelized step is ``jax.value_and_grad(jax_cute.kernelize(loss))``: the forward products
become jax_cute primitives and the gradients come from their autodiff rules, which round the
f32 cotangent once to bf16 so the gradient GEMMs run on the 16-bit kernels (XLA runs the plain
model's gradient products on the f32 cotangent). On a CPU both runs are plain XLA ops.

    python examples/gpt_training.py                 # tiny on CPU, h200 on a GPU
    python examples/gpt_training.py --size h200 --moe --steps 20
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax

import jax_cute
from training_loop import compare_line, path_taken

COMPUTE = jnp.bfloat16
F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int
    d_model: int
    heads: int
    layers: int
    seq: int
    batch: int
    moe: bool = False
    experts: int = 8
    top_k: int = 2
    lr: float = 3e-4

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def d_ff(self) -> int:  # dense MLP width; each expert is half as wide (top-2: the same FLOPs)
        return 4 * self.d_model if not self.moe else 2 * self.d_model


SIZES = {
    "tiny": Config(vocab=256, d_model=64, heads=2, layers=2, seq=32, batch=4, lr=3e-3),
    "h200": Config(vocab=32000, d_model=2048, heads=16, layers=4, seq=1024, batch=8, lr=3e-4),
}

Params = dict


# -- the model ----------------------------------------------------------------------------------

def init_params(key: jax.Array, cfg: Config) -> Params:
    d, f, n, e = cfg.d_model, cfg.d_ff, cfg.layers, cfg.experts
    ks = iter(jax.random.split(key, 8))
    normal = lambda shape, std: std * jax.random.normal(next(ks), shape, F32)  # noqa: E731
    layers = {"ln1": jnp.ones((n, d), F32), "ln2": jnp.ones((n, d), F32),
              "wqkv": normal((n, d, 3 * d), d ** -0.5),
              "wo": normal((n, cfg.heads, cfg.head_dim, d), (2 * n * d) ** -0.5)}
    if cfg.moe:
        layers |= {"router": normal((n, d, e), d ** -0.5), "w1": normal((n, e, d, f), d ** -0.5),
                   "w2": normal((n, e, f, d), (2 * n * f) ** -0.5)}
    else:
        layers |= {"w1": normal((n, d, f), d ** -0.5), "w2": normal((n, f, d), (2 * n * f) ** -0.5)}
    return {"embed": normal((cfg.vocab, d), 0.02), "pos": normal((cfg.seq, d), 0.01),
            "ln_f": jnp.ones((d,), F32), "layers": layers}


def norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    """RMS norm in f32, returned in the compute dtype."""
    x = x.astype(F32)
    return (x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale).astype(COMPUTE)


def mm(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """A bf16 product with an f32 result."""
    return jnp.einsum(spec, a.astype(COMPUTE), b.astype(COMPUTE), preferred_element_type=F32)


def attention(p: Params, x: jax.Array, cfg: Config) -> jax.Array:
    b, t, _ = x.shape
    qkv = mm("btd,de->bte", x, p["wqkv"]).astype(COMPUTE).reshape(b, t, 3, cfg.heads, cfg.head_dim)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    scores = mm("bthd,bshd->bhts", q, k) * cfg.head_dim ** -0.5
    causal = jnp.tril(jnp.ones((t, t), bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1)
    out = mm("bhts,bshd->bthd", probs, v)
    return mm("bthd,hde->bte", out, p["wo"])


def mlp(p: Params, x: jax.Array, cfg: Config) -> jax.Array:
    return mm("btf,fd->btd", jax.nn.gelu(mm("btd,df->btf", x, p["w1"])), p["w2"])


def moe(p: Params, x: jax.Array, cfg: Config) -> jax.Array:
    """Top-k routing: the token copies sorted by expert, two ragged_dots, unsorted and combined."""
    b, t, d = x.shape
    tokens = x.reshape(b * t, d).astype(COMPUTE)
    gates, experts = lax.top_k(jax.nn.softmax(mm("nd,de->ne", tokens, p["router"])), cfg.top_k)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat)
    sizes = jnp.bincount(flat, length=cfg.experts).astype(jnp.int32)
    sorted_tokens = jnp.repeat(tokens, cfg.top_k, axis=0)[order]
    h = lax.ragged_dot(sorted_tokens, p["w1"].astype(COMPUTE), sizes, preferred_element_type=F32)
    y = lax.ragged_dot(jax.nn.gelu(h).astype(COMPUTE), p["w2"].astype(COMPUTE), sizes, preferred_element_type=F32)
    y = jnp.zeros_like(y).at[order].set(y).reshape(b * t, cfg.top_k, d)
    return jnp.sum(y * gates[..., None], axis=1).reshape(b, t, d)


def logits(params: Params, h: jax.Array, cfg: Config) -> jax.Array:
    """The tied LM head: hidden states against the token embeddings."""
    return mm("btd,vd->btv", h, params["embed"])


def forward(params: Params, tokens: jax.Array, cfg: Config) -> jax.Array:
    x = params["embed"][tokens] + params["pos"][: tokens.shape[1]]  # f32 residual stream
    ffn = moe if cfg.moe else mlp

    def layer(x, p):
        def block(x):
            x = x + attention(p, norm(x, p["ln1"]), cfg)
            return x + ffn(p, norm(x, p["ln2"]), cfg)
        return jax.checkpoint(block)(x), None  # recompute the block in the backward pass

    x, _ = lax.scan(layer, x, params["layers"])
    return logits(params, norm(x, params["ln_f"]), cfg)


def loss_fn(params: Params, tokens: jax.Array, cfg: Config) -> jax.Array:
    out = forward(params, tokens[:, :-1], cfg)
    return optax.softmax_cross_entropy_with_integer_labels(out, tokens[:, 1:]).mean()


# -- training -----------------------------------------------------------------------------------

def init_train_state(key: jax.Array, cfg: Config):
    tx = optax.adamw(cfg.lr, b1=0.9, b2=0.95, weight_decay=0.1)
    params = init_params(key, cfg)
    return params, tx.init(params), tx


def make_step(cfg: Config, tx: optax.GradientTransformation, kernelized: bool, fuse_epilogues: bool = True
              ) -> Callable:
    loss = lambda params, tokens: loss_fn(params, tokens, cfg)  # noqa: E731
    if kernelized:
        loss = jax_cute.kernelize(loss, fuse_epilogues=fuse_epilogues)

    @jax.jit
    def step(params, opt_state, tokens):
        value, grads = jax.value_and_grad(loss)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step


def batches(key: jax.Array, cfg: Config, n: int = 4) -> jax.Array:
    """``n`` fixed batches of a learnable language: each sequence counts up from a random start
    by a random stride (of 8) modulo the vocabulary."""
    k1, k2 = jax.random.split(key)
    start = jax.random.randint(k1, (n, cfg.batch, 1), 0, cfg.vocab)
    stride = jax.random.randint(k2, (n, cfg.batch, 1), 1, 9)
    return ((start + stride * jnp.arange(cfg.seq + 1)) % cfg.vocab).astype(jnp.int32)


def train(step: Callable, params, opt_state, data: jax.Array, steps: int, label: str,
          verbose: bool) -> tuple[list[float], list[float]]:
    losses, times = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, data[i % len(data)])
        losses.append(float(loss))  # blocks until the step is done
        times.append((time.perf_counter() - t0) * 1e3)
        if verbose:
            print(f"[{label}] step {i:3d}  loss {losses[-1]:.5f}  {times[-1]:8.2f} ms")
    return losses, times


def main(argv: list[str] | None = None) -> dict:
    on_gpu = jax.default_backend() == "gpu"
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="h200" if on_gpu else "tiny")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float)
    p.add_argument("--moe", action="store_true", help="top-2 of 8 experts instead of the dense MLP")
    p.add_argument("--quiet", action="store_true", help="no per-step lines")
    args = p.parse_args(argv)
    cfg = dataclasses.replace(SIZES[args.size], moe=args.moe, **({"lr": args.lr} if args.lr else {}))

    params, opt_state, tx = init_train_state(jax.random.key(0), cfg)
    data = batches(jax.random.key(1), cfg)
    ffn = f"MoE FFN (top-{cfg.top_k} of {cfg.experts} experts, width {cfg.d_ff})" if cfg.moe else f"MLP width {cfg.d_ff}"
    print(f"GPT: d_model {cfg.d_model}, {cfg.heads} heads, {cfg.layers} layers, {ffn}, vocab {cfg.vocab}, "
          f"batch {cfg.batch} x {cfg.seq} tokens; bf16 products, f32 master weights, AdamW (lr {cfg.lr}), "
          f"{args.steps} steps")
    kstep, pstep = make_step(cfg, tx, kernelized=True), make_step(cfg, tx, kernelized=False)
    path = path_taken(kstep, params, opt_state, data[0])
    print(f"path: {path}")
    losses, times = train(kstep, params, opt_state, data, args.steps, "kernelized", not args.quiet)
    ref_losses, ref_times = train(pstep, params, opt_state, data, args.steps, "plain XLA", not args.quiet)
    ms, ref_ms = statistics.median(times[1:] or times), statistics.median(ref_times[1:] or ref_times)

    print(f"{'step':>4}  {'kernelized':>10}  {'plain XLA':>10}")
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        print(f"{i:4d}  {a:10.5f}  {b:10.5f}")
    rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
    print(f"max relative difference between the loss curves: {rel:.2e}")
    comparison = compare_line(("kernelized", "plain XLA"), ms, ref_ms)
    print(comparison)
    if not losses[-1] < losses[0]:
        raise SystemExit(f"loss did not go down: {losses[0]} -> {losses[-1]}")
    return {"path": path, "losses": losses, "ref_losses": ref_losses, "max_rel_diff": rel, "ms": ms,
            "ref_ms": ref_ms, "comparison": comparison}


if __name__ == "__main__":
    main()
