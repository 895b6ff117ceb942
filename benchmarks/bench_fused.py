"""Fused epilogues suite: bias and activation in the GEMM's epilogue against the same layers
written unfused (jax_cute GEMMs, then jnp ops) and against XLA, bf16.

A GELU MLP block (8192 tokens, 4096 -> 14336 -> 4096, bias) forward, and forward + backward
(also with jax.checkpoint around the fused layer: the backward recomputes the pre-activation
instead of reading the saved one, and the XLA layer as written through ``jax_cute.kernelize``,
which fuses its first bias and gelu, and gelu's derivative into the backward GEMM after it); a
SwiGLU MLP block (8192 tokens, 4096 -> 2 x 14336 -> 4096, no bias) forward + backward; a SwiGLU MoE layer (8 experts, top-2, 4096 -> 14336 -> 4096)
forward + backward, fused (ragged_dot(..., activation="swiglu")) against unfused. Each record
carries ``epilogue_bytes``: the bytes the implementation's GEMM epilogues and elementwise
passes write between the GEMMs, computed from the shapes (``traffic``), so the report shows
what fusion saves next to what it costs.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax_cute  # noqa: E402
from common import Impl, measure, suite_main  # noqa: E402

DT = jnp.bfloat16


def normal(seed: int, shapes, scales) -> tuple:
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return tuple((s * jax.random.normal(k, sh, jnp.float32)).astype(DT) for k, sh, s in zip(keys, shapes, scales))


# -- the layers ---------------------------------------------------------------------------------

def mlp_fused(x, w1, b1, w2, b2):
    h = jax_cute.matmul(x, w1, bias=b1, activation="gelu")
    return jax_cute.matmul(h, w2, bias=b2)


def mlp_fused_remat(x, w1, b1, w2, b2):
    h = jax.checkpoint(lambda x, w, b: jax_cute.matmul(x, w, bias=b, activation="gelu"))(x, w1, b1)
    return jax_cute.matmul(h, w2, bias=b2)


def mlp_unfused(x, w1, b1, w2, b2):
    h = jax.nn.gelu(jax_cute.matmul(x, w1) + b1)
    return jax_cute.matmul(h, w2) + b2


def mlp_xla(x, w1, b1, w2, b2):
    return jax.nn.gelu(x @ w1 + b1) @ w2 + b2


# the XLA layer as written, through kernelize: its bias and gelu become the first GEMM's epilogue,
# and gelu's derivative the epilogue of the backward GEMM of the second
mlp_kernelized = jax_cute.kernelize(mlp_xla)


def swiglu_fused(x, w1, w2):
    return jax_cute.matmul(jax_cute.matmul(x, w1, activation="swiglu"), w2)


def _swiglu(z):
    f = z.shape[-1] // 2
    return (jax.nn.silu(z[:, :f].astype(jnp.float32)) * z[:, f:]).astype(DT)


def swiglu_unfused(x, w1, w2):
    return jax_cute.matmul(_swiglu(jax_cute.matmul(x, w1)), w2)


def swiglu_xla(x, w1, w2):
    return _swiglu(x @ w1) @ w2


def _grads(layer, params: tuple[int, ...] | None = None):
    """Gradients of ``layer``'s arguments ``params`` (default all) for a random output cotangent,
    the last argument (a constant one, the gradient of a plain sum, would let XLA turn the
    second layer's gradient GEMMs into reductions)."""
    def grads(*args):
        p, ct = list(args[:-1]), args[-1]
        keep = tuple(range(len(p))) if params is None else params

        def f(*q):
            given = dict(zip(keep, q))
            return layer(*[given.get(i, x) for i, x in enumerate(p)])
        return jax.vjp(f, *(p[i] for i in keep))[1](ct)
    return grads


def moe(fused: bool, top_k: int = 2):
    """Router (top-k of the experts), tokens sorted by expert, two grouped GEMMs with SwiGLU."""
    def layer(x, wr, w_in, w_out):
        e = w_in.shape[0]
        probs = jax.nn.softmax((x @ wr).astype(jnp.float32))
        weights, experts = jax.lax.top_k(probs, top_k)
        flat = experts.reshape(-1)
        order = jnp.argsort(flat)
        tokens = order // top_k
        sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
        xs = x[tokens]
        if fused:
            h = jax_cute.ragged_dot(xs, w_in, sizes, activation="swiglu")
        else:
            h = _swiglu(jax_cute.ragged_dot(xs, w_in, sizes))
        y = jax_cute.ragged_dot(h, w_out, sizes) * weights.reshape(-1)[order][:, None].astype(DT)
        return jnp.zeros_like(x).at[tokens].add(y)
    return layer


# -- traffic --------------------------------------------------------------------------------------

def traffic(kind: str, m: int, f: int, d: int, train: bool) -> dict[str, int]:
    """Bytes the forward's epilogues and elementwise passes write, per implementation, from the
    shapes (M x F activation; its pre-activation z is M x 2F for swiglu), all bf16 unless said:

    - unfused (and XLA): the GEMM writes z, an XLA pass writes y = act(z + bias); a forward
      also adds the second layer's bias in one more M x D pass (a training step's gradients
      never need the block's output, so there it is never computed);
    - fused forward: the kernel writes y only (and adds the second layer's bias itself);
    - fused forward + backward: the kernel writes y and the residual z, as unfused does: fusion
      saves the pass reading z back;
    - remat: the fused forward, then the backward's recomputation writes y and z again;
    - kernelize (the XLA layer through ``jax_cute.kernelize``): the first GEMM fused as above;
      the second layer's bias stays an XLA pass (no activation follows it).
    """
    z = m * f * (2 if kind == "swiglu" else 1)
    y = m * f
    bias2 = 2 * m * d if kind == "gelu" and not train else 0
    unfused = 2 * z + 2 * y + bias2
    inference = 2 * y
    training = 2 * z + 2 * y
    return {"jax_cute": training if train else inference, "jax_cute_unfused": unfused, "xla": unfused,
            "jax_cute_remat": inference + training, "jax_cute_kernelize": training if train else inference + bias2}


def run(args: argparse.Namespace) -> list[dict]:
    rounds = 2 if args.smoke else args.rounds
    recs: list[dict] = []
    m, d, f = (256, 128, 384) if args.smoke else (8192, 4096, 14336)
    shapes = [(m, d), (d, f), (f,), (f, d), (d,)]
    mk = lambda s: normal(s, shapes, (1.0, d ** -0.5, 0.1, f ** -0.5, 0.1))  # noqa: E731
    mk_train = lambda s: normal(s, shapes + [(m, d)], (1.0, d ** -0.5, 0.1, f ** -0.5, 0.1, 1.0))  # noqa: E731
    for train in (False, True):
        impls = [("jax_cute", mlp_fused), ("jax_cute_unfused", mlp_unfused), ("xla", mlp_xla),
                 ("jax_cute_kernelize", mlp_kernelized)]
        if train:
            impls.insert(1, ("jax_cute_remat", mlp_fused_remat))
        written = traffic("gelu", m, f, d, train)
        what = "forward + backward" if train else "forward"
        recs += measure("fused", "e2e", f"GELU MLP block {what} {m}x{d}->{f}->{d}, bias",
                        [Impl(n, _grads(fn) if train else fn) for n, fn in impls], mk_train if train else mk,
                        (6.0 if train else 2.0) * 2 * m * d * f, rounds=rounds,
                        meta={"dtype": "bfloat16", "epilogue_bytes": {n: written[n] for n, _ in impls}})

        if train:
            # a training loop runs at the board's power cap: the same step in 1 s windows
            recs += measure("fused", "e2e", f"GELU MLP block {what} {m}x{d}->{f}->{d}, bias, 1 s windows",
                            [Impl(n, _grads(fn)) for n, fn in impls if n != "jax_cute_remat"], mk_train,
                            6.0 * 2 * m * d * f, rounds=min(rounds, 3), target_s=0.05 if args.smoke else 1.0,
                            meta={"dtype": "bfloat16"})

    # SwiGLU MLP (Llama-style, no bias): w1 holds [gate | up]
    sshapes = [(m, d), (d, 2 * f), (f, d), (m, d)]
    mks = lambda s: normal(s, sshapes, (1.0, d ** -0.5, f ** -0.5, 1.0))  # noqa: E731
    simpls = [("jax_cute", swiglu_fused), ("jax_cute_unfused", swiglu_unfused), ("xla", swiglu_xla)]
    written = traffic("swiglu", m, f, d, True)
    recs += measure("fused", "e2e", f"SwiGLU MLP block forward + backward {m}x{d}->2x{f}->{d}",
                    [Impl(n, _grads(fn)) for n, fn in simpls], mks, 6.0 * 3 * m * d * f, rounds=rounds,
                    meta={"dtype": "bfloat16", "epilogue_bytes": {n: written[n] for n, _ in simpls}})

    t, e = (256, 4) if args.smoke else (8192, 8)
    rows = 2 * t
    mshapes = [(t, d), (d, e), (e, d, 2 * f), (e, f, d), (t, d)]
    mkm = lambda s: normal(s, mshapes, (1.0, 0.1, d ** -0.5, f ** -0.5, 1.0))  # noqa: E731
    grads = lambda layer: _grads(layer, (0, 2, 3))  # noqa: E731  (x, w_in, w_out; not the router)
    written = traffic("swiglu", rows, f, d, True)
    recs += measure("fused", "e2e", f"SwiGLU MoE layer forward + backward {t} tokens, {e} experts top-2, "
                    f"{d}->{f}->{d}",
                    [Impl("jax_cute", grads(moe(True))), Impl("jax_cute_unfused", grads(moe(False)))], mkm,
                    3 * 2 * 2.0 * rows * d * f + 3 * 2.0 * rows * f * d, rounds=rounds,
                    meta={"dtype": "bfloat16", "epilogue_bytes": {n: written[n] for n in ("jax_cute", "jax_cute_unfused")}})
    for r in recs:
        if r.get("epilogue_bytes"):
            print(f"  [{r['case']}] {r['impl']}: {r['epilogue_bytes'][r['impl']] / 2**20:.0f} MiB written by epilogues")
    return recs


if __name__ == "__main__":
    suite_main(run, __doc__.splitlines()[0])
