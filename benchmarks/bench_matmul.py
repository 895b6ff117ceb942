"""GEMM suite: jax_cute.matmul vs XLA (jnp.matmul) vs Pallas Mosaic-GPU Hopper matmul, bf16.

Also: small products timed inside one lax.fori_loop (no host dispatch between them), the two largest shapes in
sustained 1 s windows, fp8 (e4m3) products against XLA's, vmap of 8 independent problems (both
operands batched) against one flat problem of the same total size, and the MLP block training
step (forward + backward) on jax_cute vs jnp.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Callable

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import jax_cute  # noqa: E402
from common import Impl, best_of, measure, suite_main  # noqa: E402

SHAPES = [(8192, 8192, 8192), (4096, 4096, 4096), (2048, 2048, 2048), (4096, 14336, 4096),
          (4096, 4096, 14336), (16384, 2048, 2048), (512, 8192, 8192)]  # (M, N, K)
SMOKE_SHAPES = [(128, 256, 64), (256, 128, 128)]
# Each GEMM call of the table is timed as CHAIN independent products in one jit (see
# common.measure): 2048^3 takes ~30 us, less than the host needs to dispatch one jitted call.
CHAIN = 8
# Small products, also timed as LOOP dependent products inside one lax.fori_loop (one jitted call),
# so neither the host's dispatch nor the gaps between calls are in the figure.
LOOP_SHAPES = [(1024, 1024, 1024), (2048, 2048, 2048)]
LOOP = 64
# Sustained load: 1 s windows back to back, where the board sits at its power cap (the regime of a
# training loop; docs/performance.md).
SUSTAINED_SHAPES = [(8192, 8192, 8192), (4096, 14336, 4096)]


def pallas_impls() -> list[Impl]:
    """Hopper matmul configs from Pallas' own tuning sweep (the best one is reported)."""
    try:
        from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
    except Exception as e:  # noqa: BLE001 - a missing rival is recorded, not fatal
        msg = f"{type(e).__name__}: {e}"

        def missing(a, b):
            raise RuntimeError(f"Pallas hopper_matmul_mgpu unavailable: {msg}")

        return [Impl("pallas", missing, "import")]
    D = hm.MatmulDimension
    out = []
    # (tile_m, tile_n) are per consumer warpgroup; wg_dimension=M stacks the two warpgroups along M
    # (a 256x128 CTA tile: the fastest on 8192^3 on an H200, 2026-11-24)
    for tm, tn, minor, width, wg in [(128, 128, D.M, 4, D.N), (128, 128, D.M, 8, D.M),
                                     (128, 128, D.N, 16, D.N), (128, 128, D.N, 8, D.M)]:
        cfg = hm.TuningConfig(tile_m=tm, tile_n=tn, tile_k=64, max_concurrent_steps=4, epi_tile_n=64,
                              epi_tile_m=64, grid_minor_dim=minor, grid_tile_width=width, wg_dimension=wg)
        name = f"tm{tm} tn{tn} tk64 s4 minor={minor.name} w{width} wg={wg.name}"
        out.append(Impl("pallas", functools.partial(lambda a, b, c: hm.matmul(a, b, None, c), c=cfg), name))
    return out


FP8_SHAPES = [(8192, 8192, 8192), (4096, 14336, 4096), (16384, 2048, 2048), (2048, 2048, 2048)]


def normal_operands(m: int, n: int, k: int, dt) -> Callable[[int], tuple]:
    """``make_args`` for measure(): fresh standard-normal a (M, K) and b (K, N) per seed."""
    return lambda s: tuple(jax.random.normal(key, sh, dt)
                           for key, sh in zip(jax.random.split(jax.random.key(s)), [(m, k), (k, n)]))


def in_loop(fn: Callable, iters: int = LOOP) -> Callable:
    """``fn(a, b)`` run ``iters`` times in one ``lax.fori_loop``. Each product writes one element
    back into ``a``, so no iteration can be hoisted out of the loop or skipped; that one-element
    in-place update is the same for every implementation."""
    def run(a, b):
        def body(_, a):
            return a.at[0, 0].set(fn(a, b)[0, 0].astype(a.dtype))
        return jax.lax.fori_loop(0, iters, body, a)
    return run


def _fp8_ours(x, w):
    return jax_cute.matmul(x, w, transpose_b=True, preferred_element_type=jnp.bfloat16)


def _fp8_xla(x, w):
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def jnp_matmul_bf16_grads(a, b, preferred_element_type=None):
    """jnp.matmul with jax_cute's documented mixed-precision rule: the f32 cotangent is rounded
    once to the input dtype, so the gradient GEMMs run in bf16 (plain jnp would run them on the
    f32 cotangent): the like-for-like XLA baseline for the training step."""
    return jnp.matmul(a, b, preferred_element_type=preferred_element_type)


def _bf16_fwd(a, b, preferred_element_type):
    return jnp.matmul(a, b, preferred_element_type=preferred_element_type), (a, b)


def _bf16_bwd(preferred_element_type, res, ct):
    a, b = res
    ct = ct.astype(a.dtype)
    return jnp.matmul(ct, b.T), jnp.matmul(a.T, ct)


jnp_matmul_bf16_grads.defvjp(_bf16_fwd, _bf16_bwd)


def run(args: argparse.Namespace) -> list[dict]:
    on_gpu = jax.default_backend() == "gpu"
    dt = jnp.bfloat16
    rounds = 2 if args.smoke else args.rounds
    chain = 2 if args.smoke else CHAIN
    recs: list[dict] = []
    rivals = pallas_impls() if on_gpu else []  # Mosaic GPU cannot run on a CPU
    dense = [Impl("jax_cute", jax_cute.matmul), Impl("xla", jnp.matmul), *rivals]
    for m, n, k in SMOKE_SHAPES if args.smoke else SHAPES:
        recs += measure("matmul", "gemm", f"{m}x{n}x{k}", dense, normal_operands(m, n, k, dt), 2.0 * m * n * k,
                        rounds=rounds, meta={"m": m, "n": n, "k": k, "dtype": "bfloat16"}, chain=chain)

    # small products without the host's dispatch: LOOP of them in one fori_loop per call
    for m, n, k in SMOKE_SHAPES[:1] if args.smoke else LOOP_SHAPES:
        iters = 4 if args.smoke else LOOP
        looped = [Impl(im.name, in_loop(im.fn, iters), im.config) for im in dense]
        recs += measure("matmul", "gemm_loop", f"{m}x{n}x{k}", looped, normal_operands(m, n, k, dt),
                        2.0 * m * n * k * iters, rounds=rounds,
                        meta={"m": m, "n": n, "k": k, "dtype": "bfloat16", "loop": iters}, check=False)

    # sustained load: each timed window about 1 s (the suite's other windows are about 50 ms)
    for m, n, k in SMOKE_SHAPES[:1] if args.smoke else SUSTAINED_SHAPES:
        recs += measure("matmul", "gemm_sustained", f"{m}x{n}x{k}", dense, normal_operands(m, n, k, dt),
                        2.0 * m * n * k, rounds=2 if args.smoke else 3, chain=chain, target_s=0.01 if args.smoke else 1.0,
                        meta={"m": m, "n": n, "k": k, "dtype": "bfloat16"})

    # fp8 (e4m3) inputs, x (M, K) times w (N, K) transposed, bf16 out: the only fp8 layout our
    # Hopper kernel takes (both operands K-major); XLA gets the same dot_general.
    for m, n, k in SMOKE_SHAPES if args.smoke else FP8_SHAPES:
        mk8 = lambda s, m=m, n=n, k=k: tuple(  # noqa: E731
            jax.random.normal(key, sh, jnp.float32).astype(jnp.float8_e4m3fn)
            for key, sh in zip(jax.random.split(jax.random.key(s)), [(m, k), (n, k)]))
        recs += measure("matmul", "gemm", f"fp8 e4m3 {m}x{n}x{k}",
                        [Impl("jax_cute", _fp8_ours), Impl("xla", _fp8_xla)], mk8, 2.0 * m * n * k,
                        rounds=rounds, meta={"m": m, "n": n, "k": k, "dtype": "float8_e4m3fn"}, chain=chain)

    # vmap: 8 problems, both operands batched, vs one flat problem with the same FLOPs.
    b, m, n, k = (2, 64, 128, 64) if args.smoke else (8, 2048, 1536, 1024)
    mkb = lambda s: (jax.random.normal(jax.random.key(s), (b, m, k), dt),  # noqa: E731
                     jax.random.normal(jax.random.key(s + 10_000), (b, k, n), dt))
    recs += measure("matmul", "gemm", f"vmap {b}x({m}x{n}x{k})",
                    [Impl("jax_cute", jax.vmap(jax_cute.matmul)), Impl("xla", jax.vmap(jnp.matmul))],
                    mkb, 2.0 * b * m * n * k, rounds=rounds, meta={"batch": b, "m": m, "n": n, "k": k},
                    chain=chain)
    mkf = lambda s: (jax.random.normal(jax.random.key(s), (b * m, k), dt),  # noqa: E731
                     jax.random.normal(jax.random.key(s + 10_000), (k, n), dt))
    recs += measure("matmul", "gemm", f"flat {b * m}x{n}x{k}",
                    [Impl("jax_cute", jax_cute.matmul), Impl("xla", jnp.matmul)],
                    mkf, 2.0 * b * m * n * k, rounds=rounds, meta={"m": b * m, "n": n, "k": k}, chain=chain)

    # The README's MLP training step (forward + backward + SGD update), jax_cute vs jnp.
    import mlp_training as mlp

    size = "tiny" if args.smoke else "large"
    batch, d_model, d_ff, _, lr = mlp.SIZES[size]
    params = mlp.init(jax.random.key(0), d_model, d_ff)
    x, y = mlp.data(jax.random.key(1), batch, d_model, n_batches=1)
    step_dt = jnp.bfloat16 if on_gpu else jnp.float32
    mks = lambda s: (params, jax.random.normal(jax.random.key(s), x[0].shape, jnp.float32), y[0])  # noqa: E731
    recs += measure("matmul", "e2e", f"MLP train step {batch}x{d_model}x{d_ff}",
                    [Impl("jax_cute", mlp.make_step(jax_cute.matmul, step_dt, lr)),
                     Impl("xla", mlp.make_step(jnp.matmul, step_dt, lr)),
                     # the jnp step's loss through kernelize: its gelu becomes the first GEMM's epilogue
                     Impl("jax_cute_kernelize", mlp.make_step(jnp.matmul, step_dt, lr, transform=jax_cute.kernelize)),
                     Impl("xla_bf16_grads", mlp.make_step(
                         lambda a, b, preferred_element_type=None: jnp_matmul_bf16_grads(a, b, preferred_element_type),
                         step_dt, lr))],
                    # an 8 ms step in 50 ms windows spread 7.3-9.7 ms over 7 rounds: longer, more rounds
                    mks, 6 * 2.0 * batch * d_model * d_ff, rounds=rounds if args.smoke else max(rounds, 11),
                    target_s=0.05 if args.smoke else 0.25, check=False, meta={"dtype": jnp.dtype(step_dt).name})
    return best_of(recs, "pallas")


if __name__ == "__main__":
    suite_main(run, __doc__.splitlines()[0])
