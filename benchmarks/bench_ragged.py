"""Grouped GEMM suite: jax_cute.ragged_dot vs jax.lax.ragged_dot vs Pallas Mosaic-GPU, bf16.

Per (G, M, K, N) and group-size distribution (uniform, Dirichlet(0.3)-skewed): the forward
``lhs (M,K) x rhs (G,K,N)``, the lhs gradient and the rhs gradient (each through ``jax.vjp`` for
jax_cute and XLA; Pallas' ``ragged_dot_mgpu`` with ``transpose_rhs`` and
``transposed_ragged_dot_mgpu``), and for the forward and lhs gradient jax_cute with the grouped
walk's tail split off (*jax_cute, no tail split*). Then the MoE layer of examples/moe_training.py,
forward and forward + backward.
"""

from __future__ import annotations

import argparse
from typing import Callable, ContextManager
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import jax_cute  # noqa: E402
from common import Impl, best_of, forced_configs, measure, suite_main  # noqa: E402

SHAPES = [(8, 16384, 4096, 14336), (64, 32768, 2048, 1408), (16, 16384, 2048, 16384), (128, 16384, 4096, 1536)]
SMOKE_SHAPES = [(4, 256, 64, 128)]


def group_sizes(g: int, m: int, dist: str, seed: int = 0) -> np.ndarray:
    """Sizes summing to m: equal, or Dirichlet(0.3) (a few large groups, many tiny or empty)."""
    if dist == "uniform":
        sizes = np.full(g, m // g)
        sizes[: m - sizes.sum()] += 1
        return sizes.astype(np.int32)
    p = np.random.default_rng(seed).dirichlet([0.3] * g)
    sizes = np.floor(p * m).astype(np.int64)
    sizes[np.argmax(sizes)] += m - sizes.sum()
    return sizes.astype(np.int32)


def random_operands(g: int, m: int, k: int, n: int, gs: jax.Array) -> Callable[[int], tuple]:
    """seed -> (lhs [m,k], rhs [g,k,n], gs, cotangent [m,n]), bf16 normal values drawn on the
    device (host draws of the ~1e9 values these shapes need take minutes)."""
    def make(seed: int) -> tuple:
        k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
        return (jax.random.normal(k1, (m, k), jnp.bfloat16), jax.random.normal(k2, (g, k, n), jnp.bfloat16),
                gs, jax.random.normal(k3, (m, n), jnp.bfloat16))
    return make


def _missing(what: str, err: Exception) -> Callable:
    msg = f"{type(err).__name__}: {err}"

    def fail(*_, **__):
        raise RuntimeError(f"{what} unavailable: {msg}")

    return fail


def jax_cute_rdot():
    fn = getattr(jax_cute, "ragged_dot", None)
    if fn is None:
        return _missing("jax_cute.ragged_dot", AttributeError("not in this jax_cute"))
    return fn


def pallas_impls(kind: str, n_out: int) -> list[Impl]:
    """Pallas configs (from its own sweep ranges) for ``fwd``/``dlhs`` (ragged_dot_mgpu) or ``drhs``
    (transposed_ragged_dot_mgpu); configs whose tiles do not divide the output are skipped."""
    try:
        if kind == "drhs":
            from jax.experimental.pallas.ops.gpu.transposed_ragged_dot_mgpu import transposed_ragged_dot as f
        else:
            from jax.experimental.pallas.ops.gpu.ragged_dot_mgpu import ragged_dot as f
    except Exception as e:  # noqa: BLE001
        return [Impl("pallas", _missing("Pallas ragged kernels", e), "import")]
    out = []
    for bm, bn, bk, steps, gbn in [(128, 128, 64, 4, 1), (128, 128, 64, 4, 4), (64, 128, 64, 5, 2),
                                   (128, 64, 64, 4, 8)]:
        if n_out % (bn * (1 if kind == "drhs" else gbn)):
            continue
        kw = dict(block_m=bm, block_n=bn, block_k=bk, max_concurrent_steps=steps, grid_block_n=gbn)
        name = " ".join(f"{k}={v}" for k, v in kw.items())
        if kind == "fwd":
            fn = lambda lhs, rhs, gs, ct, kw=kw: f(lhs, rhs, group_sizes=gs, **kw)  # noqa: E731
        elif kind == "dlhs":  # dlhs = ct (M,N) x rhs[g]^T: rhs (G,K,N) is already "(G, out, contract)"
            fn = lambda lhs, rhs, gs, ct, kw=kw: f(ct, rhs, group_sizes=gs, transpose_rhs=True, **kw)  # noqa: E731
        else:  # drhs[g] = lhs_g^T ct_g, contracting the ragged token axis
            fn = lambda lhs, rhs, gs, ct, kw=kw: f(lhs, ct, group_sizes=gs, **kw)  # noqa: E731
        out.append(Impl("pallas", fn, name))
    return out


def no_tail_split() -> ContextManager[None]:
    """jax_cute with the ragged_m walk's tail split off (sm90_grouped.Config.tail_split = 1):
    the like-for-like baseline of the scheduler that splits the last, partial round of tiles."""
    from jax_cute.kernels import sm90_grouped
    return forced_configs((sm90_grouped,), lambda spec: True, tail_split=1)


def passes(rdot) -> dict[str, Callable]:
    """The three GEMMs of a ragged_dot layer, each as a function of (lhs, rhs, gs, ct)."""
    def fwd(lhs, rhs, gs, ct):
        return rdot(lhs, rhs, gs)

    def dlhs(lhs, rhs, gs, ct):
        return jax.vjp(lambda x: rdot(x, rhs, gs), lhs)[1](ct)[0]

    def drhs(lhs, rhs, gs, ct):
        return jax.vjp(lambda w: rdot(lhs, w, gs), rhs)[1](ct)[0]

    return {"fwd": fwd, "dlhs": dlhs, "drhs": drhs}


def run(args: argparse.Namespace) -> list[dict]:
    on_gpu = jax.default_backend() == "gpu"
    rounds = 2 if args.smoke else args.rounds
    ours, xla = passes(jax_cute_rdot()), passes(jax.lax.ragged_dot)
    recs: list[dict] = []
    for g, m, k, n in SMOKE_SHAPES if args.smoke else SHAPES:
        for dist in ("uniform", "dirichlet0.3"):
            mk = random_operands(g, m, k, n, jnp.asarray(group_sizes(g, m, dist)))
            for kind in ("fwd", "dlhs", "drhs"):
                rivals = pallas_impls(kind, k if kind == "dlhs" else n) if on_gpu else []
                impls = [Impl("jax_cute", ours[kind]), Impl("xla", xla[kind]), *rivals]
                if kind != "drhs" and on_gpu:   # (a function object of its own: jit caches by function)
                    impls.insert(1, Impl("jax_cute_no_tail", lambda *a, f=ours[kind]: f(*a), context=no_tail_split))
                recs += measure("ragged", "ragged", f"{kind} G={g} M={m} K={k} N={n} {dist}", impls, mk,
                                2.0 * m * k * n, rounds=rounds,
                                meta={"pass": kind, "g": g, "m": m, "k": k, "n": n, "dist": dist, "dtype": "bfloat16"})

    # The MoE layer of examples/moe_training.py: forward, and forward + backward (no update).
    import moe_training as moe

    tokens, d_model, d_ff, experts, top_k, _, _ = moe.SIZES["tiny" if args.smoke else "large"]
    params = moe.init(jax.random.key(0), d_model, d_ff, experts)
    mdt = jnp.bfloat16 if on_gpu else jnp.float32
    mkx = lambda s: (params, jax.random.normal(jax.random.key(s), (tokens, d_model), jnp.float32))  # noqa: E731
    flops = 2.0 * tokens * top_k * d_model * d_ff * 2
    layer = lambda rdot: lambda p, x: moe.moe(p, x, rdot, mdt, top_k)  # noqa: E731
    grad = lambda rdot: jax.grad(lambda p, x: jnp.mean(jnp.square(moe.moe(p, x, rdot, mdt, top_k))))  # noqa: E731
    name = f"{tokens} tok, {d_model}/{d_ff}, top-{top_k} of {experts}"
    recs += measure("ragged", "e2e", f"MoE layer fwd ({name})",
                    [Impl("jax_cute", layer(jax_cute_rdot())), Impl("xla", layer(jax.lax.ragged_dot))],
                    mkx, flops, rounds=rounds, meta={"dtype": jnp.dtype(mdt).name})
    recs += measure("ragged", "e2e", f"MoE layer fwd+bwd ({name})",
                    [Impl("jax_cute", grad(jax_cute_rdot())), Impl("xla", grad(jax.lax.ragged_dot))],
                    mkx, 3 * flops, rounds=rounds, meta={"dtype": jnp.dtype(mdt).name})
    return best_of(recs, "pallas")


if __name__ == "__main__":
    suite_main(run, __doc__.splitlines()[0])
