"""Block-scaled fp8 suite: jax_cute's scaled fp8 GEMM vs its bf16 GEMM vs XLA's fp8 dot.

DeepGEMM's shapes (its README at 327ec92): dense (M, N, K) 4096x7168x16384, 4096x4096x7168,
128x7168x16384, and grouped contiguous 4 groups x 8192 rows, N 4096, K 7168. Per case, timed
interleaved in one process:

- *jax_cute*: ``jax_cute.matmul`` (``ragged_dot`` for the grouped case) of operands quantized
  beforehand, x in 1 x 128 and w (N, K) in 128 x 128 blocks (DeepGEMM's recipe), bf16 out;
- *jax_cute_bf16*: ``jax_cute.matmul`` / ``ragged_dot`` of the same values in bf16;
- *jax_cute_serial* / *jax_cute_db*: the same call, traced with the block-scaled kernel's
  mainloop variant forced (``Config.overlap_promote`` off: each k-tile's partial sums promoted
  after its WGMMAs drain; on: double-buffered partial fragments, the next k-tile's WGMMAs
  running under the promotion), whichever the heuristic picks; *jax_cute_db_c2x2* (dense): the
  overlapped mainloop on 2x2 clusters (A multicast along N as well as B along M: 16 KB of L2
  reads per CTA and k-tile instead of 24); *jax_cute_256x128* (dense): the 256 x 128 tile on 2x1
  clusters (each warpgroup's two 64-row blocks promoted in turn through one partial fragment,
  DeepGEMM's waves; never the heuristic's pick); *jax_cute_1cta* (grouped): the heuristic's
  config on one CTA instead of its 1x2 cluster (A not multicast);
- *xla*: XLA's fp8 dot: ``lax.dot_general`` of the raw e4m3 values (no block scales), bf16 out
  (for the grouped case a batched dot over the 4 equal groups);
- *jax_cute_raw* (dense): ``jax_cute.matmul`` of the same raw e4m3 values, bf16 out: XLA's
  numerics on our unscaled fp8 kernel, the like-for-like rival of *xla* and the ceiling the
  scaled kernel's promotion is measured against.

TFLOP/s count 2 M N K. Outputs are not compared (the three compute different products).

SwiGLU (``BENCH_FP8_SWIGLU=0`` leaves it out): the gate-and-up product of a SwiGLU MLP with a
bias, N = 2 x the hidden width, dense (M, N, K) and grouped (G x rows, N, K), operands quantized
beforehand as above: *jax_cute*: ``matmul`` / ``ragged_dot(..., bias=, activation="swiglu")``
of the block-scaled operands (B's scales read per 64 paired columns, the overlapped promotion);
*jax_cute_serial*: the same with the serial promotion forced; *jax_cute_gelu*: the same fp8
operands with gelu instead (no pairing: the unscaled-epilogue ceiling); *jax_cute_bf16*: our
bf16 swiglu product of the same values; *xla_bf16*: XLA's bf16 layer as written (dot, bias,
``silu(gate) * up``); *xla*: XLA's fp8 dot of the raw e4m3 values, the bias and swiglu in XLA.

Weight gradients (``BENCH_FP8_WGRAD=0`` leaves them out): ``dw = x.T @ dy`` with both operands
in 1 x 128 blocks along the tokens (B's scales one per column and scale block), dense (M, N,
tokens) and ragged-K (G experts, M x N each, over the tokens; ``ragged_k_dot``), bf16 out:
*jax_cute* (the heuristic: the serial promotion), *jax_cute_db* (the overlapped promotion
forced: the column scales read from the stage at the promotion), *jax_cute_bf16* (the same
values in bf16), *jax_cute_raw* (dense: our unscaled fp8 kernel on the raw e4m3 values, XLA's
numerics), *xla* (dense: XLA's dot of the raw e4m3 values).

Training steps (``BENCH_FP8_TRAIN=0`` leaves them out; ``BENCH_FP8_GEMM=0`` leaves out the GEMMs): the GPT example's step (``examples/gpt_training.py``
at its ``h200`` and ``h200-wide`` sizes (d_model 2048 and 4096), dense and ``--moe``), timed interleaved: *jax_cute*:
``value_and_grad(kernelize(loss, fp8=recipe))`` (the weight products' forward and both
gradients block-scaled fp8, quantization included); *jax_cute_bf16*: the same kernelized in
bf16; *xla_bf16*: the model as written (bf16 products).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, ContextManager

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax_cute  # noqa: E402
from common import Impl, forced_configs, gpt_train_cases, measure, suite_main  # noqa: E402
from jax_cute.fp8 import quantize, quantize_grouped, ragged_k_dot  # noqa: E402
from jax_cute.kernels import sm90_gemm, sm90_grouped  # noqa: E402

DENSE = [(4096, 7168, 16384), (4096, 4096, 7168), (128, 7168, 16384)]   # (M, N, K)
GROUPED = (4, 8192, 4096, 7168)                                          # (G, rows per group, N, K)
SMOKE_DENSE = [(256, 256, 384)]
WGRAD = [(4096, 16384, 8192), (16384, 4096, 8192), (4096, 4096, 4096)]   # (M, N, tokens)
WGRAD_GROUPED = (8, 4096, 8192, 16384)                                   # (G, M, N, tokens)
SMOKE_GROUPED = (2, 128, 256, 256)
SWIGLU_DENSE = [(8192, 2 * 14336, 4096), (16384, 2 * 4096, 7168)]   # (M, 2 x hidden, K)
SWIGLU_GROUPED = (8, 2048, 2 * 14336, 4096)    # 8192 tokens top-2 over 8 experts, 4096 -> 14336
BF, E4M3 = jnp.bfloat16, jnp.float8_e4m3fn


def dense_operands(m: int, n: int, k: int, w_blocks: str = "128x128") -> Callable[[int], tuple]:
    """seed -> (xq, wq, x bf16, w bf16 (N, K)), drawn and quantized on the device (w in
    ``w_blocks``: "1x128" for a weight gradient's dy.T, one scale per column of B and block)."""
    @jax.jit
    def make(key):
        kx, kw = jax.random.split(key)
        x, w = jax.random.normal(kx, (m, k), jnp.float32), jax.random.normal(kw, (n, k), jnp.float32)
        return quantize(x, "1x128"), quantize(w, w_blocks), x.astype(BF), w.astype(BF)

    return lambda seed: make(jax.random.key(seed))


def grouped_operands(g: int, rows: int, n: int, k: int) -> Callable[[int], tuple]:
    """seed -> (xq, wq (G, K, N), x bf16, w bf16 (G, K, N), group sizes)."""
    sizes = jnp.full((g,), rows, jnp.int32)

    @jax.jit
    def make(key):
        kx, kw = jax.random.split(key)
        x, w = jax.random.normal(kx, (g * rows, k), jnp.float32), jax.random.normal(kw, (g, k, n), jnp.float32)
        return quantize(x, "1x128"), quantize(w, "128x128"), x.astype(BF), w.astype(BF), sizes

    return lambda seed: make(jax.random.key(seed))


def _scaled(xq, wq, x, w):
    return jax_cute.matmul(xq, wq, transpose_b=True)


def _bf16(xq, wq, x, w):
    return jax_cute.matmul(x, w, transpose_b=True)


def _raw_fp8(xq, wq, x, w):
    return jax_cute.matmul(xq.values, wq.values, transpose_b=True, preferred_element_type=BF)


def _xla_fp8(xq, wq, x, w):
    return jax.lax.dot_general(xq.values, wq.values, (((1,), (1,)), ((), ())), preferred_element_type=BF)


def _grouped_scaled(xq, wq, x, w, sizes):
    return jax_cute.ragged_dot(xq, wq, sizes)


def _grouped_bf16(xq, wq, x, w, sizes):
    return jax_cute.ragged_dot(x, w, sizes)


def _grouped_xla_fp8(xq, wq, x, w, sizes):
    g, k, n = wq.shape
    a = xq.values.reshape(g, -1, k)
    return jax.lax.dot_general(a, wq.values, (((2,), (1,)), ((0,), (0,))), preferred_element_type=BF).reshape(-1, n)


def _swiglu_bf16_xla(z, bias):
    g, u = jnp.split(z.astype(jnp.float32) + bias, 2, axis=-1)
    return (jax.nn.silu(g) * u).astype(BF)


def _swiglu_scaled(xq, wq, x, w, bias, act="swiglu"):
    return jax_cute.matmul(xq, wq, transpose_b=True, bias=bias, activation=act)


def _swiglu_bf16(xq, wq, x, w, bias):
    return jax_cute.matmul(x, w, transpose_b=True, bias=bias, activation="swiglu")


def _swiglu_xla(xq, wq, x, w, bias):
    return _swiglu_bf16_xla(jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=BF), bias)


def _swiglu_xla_fp8(xq, wq, x, w, bias):
    return _swiglu_bf16_xla(_xla_fp8(xq, wq, x, w), bias)


def _grouped_swiglu_scaled(xq, wq, x, w, sizes, bias, act="swiglu"):
    return jax_cute.ragged_dot(xq, wq, sizes, bias=bias, activation=act)


def _grouped_swiglu_bf16(xq, wq, x, w, sizes, bias):
    return jax_cute.ragged_dot(x, w, sizes, bias=bias, activation="swiglu")


def _grouped_swiglu_xla(xq, wq, x, w, sizes, bias):
    g, k, n = w.shape
    z = jax.lax.dot_general(x.reshape(g, -1, k), w, (((2,), (1,)), ((0,), (0,))), preferred_element_type=BF)
    return _swiglu_bf16_xla(z, bias[:, None, :]).reshape(-1, n // 2)


def _grouped_swiglu_xla_fp8(xq, wq, x, w, sizes, bias):
    g, k, n = wq.shape
    z = _grouped_xla_fp8(xq, wq, x, w, sizes).reshape(g, -1, n)
    return _swiglu_bf16_xla(z, bias[:, None, :]).reshape(-1, n // 2)


def with_bias(make: Callable[[int], tuple], shape: tuple[int, ...]) -> Callable[[int], tuple]:
    """``make``'s operands and a float32 bias of ``shape`` drawn from the same seed."""
    bias = jax.jit(lambda key: jax.random.normal(key, shape, jnp.float32))
    return lambda seed: (*make(seed), bias(jax.random.key(seed + 7919)))


def swiglu(rounds: int, smoke: bool) -> list[dict]:
    """The SwiGLU gate-and-up products (see the module notes)."""
    recs: list[dict] = []
    serial = lambda fields={"overlap_promote": False}: scaled_variant(**fields)  # noqa: E731
    dense = [Impl("jax_cute", lambda *a: _swiglu_scaled(*a)), Impl("jax_cute_serial", lambda *a: _swiglu_scaled(*a),
                                                                    context=serial),
             Impl("jax_cute_gelu", lambda *a: _swiglu_scaled(*a, act="gelu")), Impl("jax_cute_bf16", _swiglu_bf16),
             Impl("xla_bf16", _swiglu_xla), Impl("xla", _swiglu_xla_fp8)]
    for m, n, k in SMOKE_DENSE if smoke else SWIGLU_DENSE:
        recs += measure("fp8", "fp8_swiglu", f"{m}x{n}x{k}", dense, with_bias(dense_operands(m, n, k), (n,)),
                        2.0 * m * n * k, rounds=rounds, meta={"m": m, "n": n, "k": k, "dtype": "float8_e4m3fn"},
                        check=False)
    g, rows, n, k = SMOKE_GROUPED if smoke else SWIGLU_GROUPED
    grouped = [Impl("jax_cute", lambda *a: _grouped_swiglu_scaled(*a)),
               Impl("jax_cute_serial", lambda *a: _grouped_swiglu_scaled(*a), context=serial),
               Impl("jax_cute_gelu", lambda *a: _grouped_swiglu_scaled(*a, act="gelu")),
               Impl("jax_cute_bf16", _grouped_swiglu_bf16), Impl("xla_bf16", _grouped_swiglu_xla),
               Impl("xla", _grouped_swiglu_xla_fp8)]
    recs += measure("fp8", "fp8_swiglu", f"{g}x{rows}x{n}x{k}", grouped,
                    with_bias(grouped_operands(g, rows, n, k), (g, n)), 2.0 * g * rows * n * k, rounds=rounds,
                    meta={"g": g, "m": g * rows, "n": n, "k": k, "dtype": "float8_e4m3fn"}, check=False)
    return recs


def scaled_variant(**fields) -> ContextManager[None]:
    """Trace with ``fields`` replaced in the Hopper families' block-scaled configs."""
    return forced_configs((sm90_gemm, sm90_grouped), lambda spec: spec.scaled, **fields)


def _variants(fn: Callable, dense: bool) -> list[Impl]:
    """The scaled product as the heuristic picks it and with each mainloop variant forced (dense:
    also the overlapped one on 2x2 clusters, A and B both multicast)."""
    variants = {"jax_cute": None, "jax_cute_serial": {"overlap_promote": False},
                "jax_cute_db": {"overlap_promote": True}}
    if dense:
        variants["jax_cute_db_c2x2"] = {"overlap_promote": True, "cluster_m": 2, "cluster_n": 2}
        # the 256 x 128 tile (sm90_scaled.wave_mainloop; 2x1 clusters, unsplit, a ring epilogue)
        variants["jax_cute_256x128"] = {"tile_m": 256, "cluster_m": 2, "cluster_n": 1, "split_k": 1,
                                        "overlap_promote": False, "whole_c": False, "epi_n": 64}
    else:
        variants["jax_cute_1cta"] = {"cluster_n": 1}
    # a function object per variant: jit caches its traces (and their kernels) by function
    return [Impl(name, lambda *args: fn(*args), context=fields and (lambda fields=fields: scaled_variant(**fields)))
            for name, fields in variants.items()]


def ragged_k_operands(g: int, m: int, n: int, t: int) -> Callable[[int], tuple]:
    """seed -> (aq (M, T), bq (N, T) in 1 x 128 blocks restarting at each group, a, b bf16, sizes)."""
    sizes = jnp.full((g,), t // g, jnp.int32)

    @jax.jit
    def make(key):
        ka, kb = jax.random.split(key)
        a, b = jax.random.normal(ka, (m, t), jnp.float32), jax.random.normal(kb, (n, t), jnp.float32)
        return quantize_grouped(a, sizes), quantize_grouped(b, sizes), a.astype(BF), b.astype(BF), sizes

    return lambda seed: make(jax.random.key(seed))


def _ragged_k(aq, bq, a, b, sizes):
    return ragged_k_dot(aq, bq, sizes, preferred_element_type=BF)


def _ragged_k_bf16(aq, bq, a, b, sizes):
    """The same per-group products in bf16: the rhs gradient of jax_cute.ragged_dot (its ragged-K
    kernel), lhs a.T (T, M) and cotangent b.T (T, N)."""
    w = jnp.zeros((sizes.shape[0], a.shape[0], b.shape[0]), BF)
    return jax.vjp(lambda w: jax_cute.ragged_dot(a.T, w, sizes), w)[1](b.T)[0]


def weight_gradients(rounds: int, smoke: bool) -> list[dict]:
    """dw = x.T @ dy, 1 x 128 scales along the tokens on both operands: the heuristic's serial
    promotion against the overlapped one forced, our bf16 GEMM and XLA's raw fp8 dot."""
    recs: list[dict] = []
    impls = lambda fn: [Impl("jax_cute", lambda *a: fn(*a)), Impl("jax_cute_db", lambda *a: fn(*a),  # noqa: E731
                                                                  context=lambda: scaled_variant(overlap_promote=True))]
    for m, n, t in SMOKE_DENSE if smoke else WGRAD:
        recs += measure("fp8", "fp8_wgrad", f"{m}x{n}x{t}", [*impls(_scaled), Impl("jax_cute_bf16", _bf16),
                                                               Impl("jax_cute_raw", _raw_fp8), Impl("xla", _xla_fp8)],
                        dense_operands(m, n, t, "1x128"), 2.0 * m * n * t, rounds=rounds,
                        meta={"m": m, "n": n, "k": t, "dtype": "float8_e4m3fn"}, check=False)
    g, m, n, t = (2, 256, 256, 512) if smoke else WGRAD_GROUPED
    recs += measure("fp8", "fp8_wgrad_grouped", f"{g}x{m}x{n}x{t}", [*impls(_ragged_k), Impl("jax_cute_bf16", _ragged_k_bf16)],
                    ragged_k_operands(g, m, n, t), 2.0 * m * n * t, rounds=rounds,
                    meta={"g": g, "m": m, "n": n, "k": t, "dtype": "float8_e4m3fn"}, check=False)
    return recs


def train_steps(args: argparse.Namespace, rounds: int) -> list[dict]:
    """The GPT example's step, dense and MoE: fp8 and bf16 kernelized, and XLA's, interleaved."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import gpt_training as gpt

    recs: list[dict] = []
    for moe, cfg, tx, make_args, case in gpt_train_cases(gpt, args.smoke, ("h200", "h200-wide")):
        recs += measure("fp8", "fp8_train", case,
                        [Impl("jax_cute", gpt.make_step(cfg, tx, kernelized=True, fp8=True)),
                         Impl("jax_cute_bf16", gpt.make_step(cfg, tx, kernelized=True)),
                         Impl("xla_bf16", gpt.make_step(cfg, tx, kernelized=False))],
                        make_args, 0.0, rounds=rounds, check=False, meta={"dtype": "float8_e4m3fn", "moe": moe})
    return recs


def run(args: argparse.Namespace) -> list[dict]:
    rounds = 2 if args.smoke else args.rounds
    recs: list[dict] = train_steps(args, rounds) if os.environ.get("BENCH_FP8_TRAIN", "1") != "0" else []
    if os.environ.get("BENCH_FP8_WGRAD", "1") != "0":
        recs += weight_gradients(rounds, args.smoke)
    if os.environ.get("BENCH_FP8_SWIGLU", "1") != "0":
        recs += swiglu(rounds, args.smoke)
    if os.environ.get("BENCH_FP8_GEMM", "1") == "0":
        return recs
    dense = [*_variants(_scaled, True), Impl("jax_cute_bf16", _bf16), Impl("jax_cute_raw", _raw_fp8),
             Impl("xla", _xla_fp8)]
    for m, n, k in SMOKE_DENSE if args.smoke else DENSE:
        recs += measure("fp8", "fp8_gemm", f"{m}x{n}x{k}", dense, dense_operands(m, n, k), 2.0 * m * n * k,
                        rounds=rounds, meta={"m": m, "n": n, "k": k, "dtype": "float8_e4m3fn"}, check=False,
                        chain=4 if m * n * k < 2**34 else 1)
    g, rows, n, k = SMOKE_GROUPED if args.smoke else GROUPED
    grouped = [*_variants(_grouped_scaled, False), Impl("jax_cute_bf16", _grouped_bf16),
               Impl("xla", _grouped_xla_fp8)]
    recs += measure("fp8", "fp8_grouped", f"{g}x{rows}x{n}x{k}", grouped, grouped_operands(g, rows, n, k),
                    2.0 * g * rows * n * k, rounds=rounds,
                    meta={"g": g, "m": g * rows, "n": n, "k": k, "dtype": "float8_e4m3fn"}, check=False)
    return recs


if __name__ == "__main__":
    suite_main(run, __doc__.splitlines()[0])
