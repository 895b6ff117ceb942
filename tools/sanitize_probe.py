"""A small representative workload for compute-sanitizer (memcheck, racecheck).

Run as: XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer --tool memcheck python tools/sanitize_probe.py
With the platform allocator every XLA buffer is its own allocation, so a kernel writing past
its output is caught instead of landing in a neighbour inside XLA's memory pool.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_cute

jax_cute.config.set(strict=True, nan_fill=True)
rng = np.random.default_rng(0)


def r(*shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


def direct(cfg_kwargs: dict, m: int, n: int, k: int):
    """A config the heuristic does not pick (autotune may), compiled here and launched directly
    on jnp.matmul's layouts: A (m, k) and B (k, n) row-major, C (m, n) row-major."""
    from jax_cute.custom_call import kernel_call, workspace_outputs
    from jax_cute.kernels import build, sm90_gemm
    from jax_cute.kernels.gemm_spec import GemmSpec

    spec, cfg = GemmSpec("bfloat16", "bfloat16", "bfloat16", "k", "n", "n"), sm90_gemm.Config(**cfg_kwargs)
    binary = build.compile_launcher(sm90_gemm.launcher(spec, cfg), sm90_gemm.signature(spec, cfg), arch="sm_90a",
                                    name="sanitize_" + cfg.key().replace(".", "_"))
    ws = sm90_gemm.workspace(spec, cfg, m, n, k, 1)
    outs = {"c": (jax.ShapeDtypeStruct((m, n), jnp.bfloat16), (m, n, 1), (n, 1, m * n)), **workspace_outputs(binary, ws)}
    zeroed = [w.name for w in ws if w.zeroed]

    def f(a, b):
        return kernel_call(binary, {"a": (a, (m, k, 1), (k, 1, m * k)), "b": (b, (n, k, 1), (1, n, n * k))},
                           outs, zeroed=zeroed)["c"]

    return jax.jit(f), (r(m, k), r(k, n))


def pingpong(tile_m: int, tile_n: int, m: int, n: int, k: int):
    """A pingpong config, with more tiles than SMs so both consumer warpgroups take turns."""
    return direct({"tile_m": tile_m, "tile_n": tile_n, "pingpong": True}, m, n, k)


def stream_chain():
    """Three dependent products launched on the stream (command_buffer off) with PDL kernels:
    each may start while the one before drains, and must wait before touching memory."""
    f = jax.jit(lambda a, b, c, d: jax_cute.matmul(jax_cute.matmul(jax_cute.matmul(a, b), c), d))
    args = (r(1000, 776), r(776, 1032), r(1032, 2056), r(2056, 136))
    with jax_cute.config.override(command_buffer=False, nan_fill=False):  # kernels back to back
        jax.block_until_ready(f(*args))   # lowered here, in stream mode
    return f, args


def fp8_operands(which: str, sizes):
    """wgrad_operands' kernels on 973 tokens x 192 columns: uniform or group blocks."""
    from jax_cute.fp8 import wgrad_operands
    from jax_cute.fp8.quantize import group_blocks

    t = 973
    if sizes is None:
        start, length = wgrad_operands.uniform_blocks(t)
    else:
        _, start, length, _ = group_blocks(jnp.asarray(sizes, jnp.int32), t)
    if which == "quantize":
        return jax.jit(wgrad_operands.quantize_tokens), (r(t, 192), start, length)
    return jax.jit(wgrad_operands.aligned_transpose), (r(t, 192).astype(jnp.float8_e4m3fn), start, length)


def fp8_rows_and_tokens(sizes):
    """The one-pass quantizers of a linear layer's input on 973 tokens x 384 columns: uniform
    128-token blocks (bf16) or the groups ``sizes`` (float32), which end before the last token."""
    from jax_cute.fp8 import wgrad_operands

    x = r(973, 384)
    if sizes is None:
        return jax.jit(wgrad_operands.quantize_rows_and_tokens), (x,)
    return jax.jit(wgrad_operands.quantize_rows_and_group_tokens), (x.astype(jnp.float32), jnp.asarray(sizes, jnp.int32))


def fp8_weight():
    """The weight quantizer on a stack of two 384 x 256 weights: both layouts and the scales."""
    from jax_cute.fp8 import weight_operands

    return jax.jit(weight_operands.quantize_weight), (r(2, 384, 256).astype(jnp.float32),)


# A callable entry is built when its turn comes: the directly compiled configs only where asked
# for, so a filtered run compiles nothing it does not launch.
checks = {
    "matmul odd": (jax_cute.matmul, (r(264, 136), r(136, 72))),
    "matmul transposed": (lambda a, b: jax_cute.matmul(a, b, transpose_a=True, transpose_b=True),
                          (r(136, 264), r(72, 136))),
    "matmul batched bcast": (jax_cute.matmul, (r(3, 200, 136), r(136, 264))),
    "matmul split-k": (jax_cute.matmul, (r(128, 8192), r(8192, 128))),
    # the heuristic's cooperative tiles (2x1 cluster, whole-share epilogue) with a partial last
    # tile along M and N, short and longer K: one tile per CTA, then 5 tiles per CTA (128x128)
    "matmul cooperative short K": (jax_cute.matmul, (r(2048, 1000), r(1000, 1032))),
    "matmul cooperative 128x256": (jax_cute.matmul, (r(2048, 1104), r(1104, 1032))),
    "matmul whole share 5 tiles": (jax_cute.matmul, (r(4000, 1000), r(1000, 2056))),
    # 11 tiles per CTA, K = 128 / 192: the next tile's mainloop is shorter than the stores it
    # must wait for before refilling the ring
    "matmul whole share short K": (jax_cute.matmul, (r(10000, 128), r(128, 2056))),
    "matmul whole share 3 k-tiles": (jax_cute.matmul, (r(10000, 192), r(192, 2056))),
    # deferred epilogue (autotune candidate), 11 tiles per CTA: K = 128 leaves no k-tile after
    # the 2 deferred ones, K = 192 one, after which their stages are handed back together
    "deferred short K": lambda: direct({"defer": 2}, 10000, 2056, 128),
    "deferred 3 k-tiles": lambda: direct({"defer": 2}, 10000, 2056, 192),
    # pingpong tiles (autotune candidates), partial tiles along M and N, ~2 tiles per CTA
    "pingpong 128x160": lambda: pingpong(128, 160, 4000, 1000, 1000),
    "pingpong 64x256": lambda: pingpong(64, 256, 4000, 1000, 1000),
    # 256x128 cooperative tiles (autotune candidates): two 64-row blocks per warpgroup, partial
    # tiles along M and N, a 2-deep ring of 64x64 subtiles or the whole share
    "256x128 ring": lambda: direct({"tile_m": 256, "tile_n": 128, "epi_n": 64}, 1000, 1032, 776),
    "256x128 whole share": lambda: direct({"tile_m": 256, "tile_n": 128, "epi_n": 64, "whole_c": True}, 4000, 1000, 1000),
    # fp8: the heuristic's pingpong 128x128 (x (M, K) times w (N, K) transposed)
    "fp8 pingpong": (lambda x, w: jax_cute.matmul(x, w, transpose_b=True, preferred_element_type=jnp.bfloat16),
                     (r(2000, 256).astype(jnp.float8_e4m3fn), r(1400, 256).astype(jnp.float8_e4m3fn))),
    "fused bias gelu": (lambda x, w, b: jax_cute.matmul(x, w, bias=b, activation="gelu"),
                        (r(1000, 776), r(776, 1032), jnp.asarray(rng.standard_normal(1032), jnp.float32))),
    # a differentiated forward: the kernel also writes the pre-activation (ring epilogue, twice
    # the subtiles; an unaligned N takes the predicated edge stores for both outputs)
    "fused preact grad": (jax.grad(lambda x, w, b: jax_cute.matmul(x, w, bias=b, activation="gelu")
                                   .astype(jnp.float32).sum(), (0, 1, 2)),
                          (r(1000, 776), r(776, 1030), jnp.asarray(rng.standard_normal(1030), jnp.float32))),
    # without a bias: the whole share, both passes through the same slots, ~2 tiles per CTA
    "fused preact whole share": (jax.grad(lambda x, w: jax_cute.matmul(x, w, activation="silu")
                                          .astype(jnp.float32).sum(), (0, 1)), (r(4000, 1000), r(1000, 2056))),
    # swiglu: B's N paired (gate and up halves in one tile), C half as wide; under grad also D
    "fused swiglu grad": (jax.grad(lambda x, w, b: jax_cute.matmul(x, w, bias=b, activation="swiglu")
                                   .astype(jnp.float32).sum(), (0, 1, 2)),
                          (r(1000, 776), r(776, 2816), jnp.asarray(rng.standard_normal(2816), jnp.float32))),
    # the grouped kernel's epilogue: bias row per group, the zero tail, swiglu, and under grad D
    "ragged swiglu grad": (jax.grad(lambda x, w, b: jax_cute.ragged_dot(
        x, w, jnp.asarray([300, 0, 1, 500], jnp.int32), bias=b, activation="swiglu").astype(jnp.float32).sum(),
        (0, 1, 2)), (r(1000, 264), r(4, 264, 2816), r(4, 2816))),
    # without a bias: the whole share, the second (gated) pass refilling half the slots
    "ragged swiglu grad whole share": (jax.grad(lambda x, w: jax_cute.ragged_dot(
        x, w, jnp.asarray([300, 0, 1, 500], jnp.int32), activation="swiglu").astype(jnp.float32).sum(),
        (0, 1)), (r(1000, 264), r(4, 264, 2816))),
    "ragged bias gelu": (lambda x, w, b: jax_cute.ragged_dot(x, w, jnp.asarray([100, 0, 37, 120], jnp.int32),
                                                             bias=b, activation="gelu"),
                         (r(300, 136), r(4, 136, 392), r(4, 392))),
    # vmap: a batch of groups per launch, group sizes per batch, a bias row per (group, batch)
    "ragged vmap bias gelu": (lambda x, w, b: jax.vmap(lambda x, g, b: jax_cute.ragged_dot(
        x, w, g, bias=b, activation="gelu"))(x, jnp.asarray([[100, 0, 37, 120], [0, 300, 0, 0]], jnp.int32), b),
        (r(2, 300, 136), r(4, 136, 392), r(2, 4, 392))),
    "ragged vmap bias gelu grad": (jax.grad(lambda x, w, b: jax.vmap(lambda x, g, b: jax_cute.ragged_dot(
        x, w, g, bias=b, activation="gelu"))(x, jnp.asarray([[100, 0, 37, 120], [0, 300, 0, 0]], jnp.int32), b)
        .astype(jnp.float32).sum(), (0, 1, 2)), (r(2, 300, 136), r(4, 136, 392), r(2, 4, 392))),
    # kernelize's chain: the backward GEMM dout @ w2.T reads the pre-activation in its epilogue
    # (odd rows, a cooperative and a pingpong pick)
    "kernelized mlp dact grad": (jax.grad(lambda x, w1, w2: jax_cute.kernelize(
        lambda x, w1, w2: jax.nn.gelu(x @ w1) @ w2)(x, w1, w2).astype(jnp.float32).sum(), (0, 1, 2)),
        (r(1000, 136), r(136, 392), r(392, 136))),
    "kernelized mlp dact grad large": (jax.grad(lambda x, w1, w2: jax_cute.kernelize(
        lambda x, w1, w2: jax.nn.silu(x @ w1) @ w2)(x, w1, w2).astype(jnp.float32).sum(), (0, 1, 2)),
        (r(2056, 512), r(512, 2048), r(2048, 512))),
    # the fp8 quantizers and the weight gradient's operand kernels (SIMT; the block-scaled GEMMs crash
    # the sanitizer itself): a partial last block of 77 tokens, group blocks with an empty group, a
    # block of one token and tokens past the last group
    "fp8 token quantizer uniform": lambda: fp8_operands("quantize", None),
    "fp8 token quantizer groups": lambda: fp8_operands("quantize", [0, 300, 1, 500]),
    "fp8 aligned transpose groups": lambda: fp8_operands("transpose", [0, 300, 1, 500]),
    "fp8 rows and tokens quantizer": lambda: fp8_rows_and_tokens(None),
    "fp8 rows and group tokens quantizer": lambda: fp8_rows_and_tokens([0, 300, 1, 500]),
    "fp8 weight quantizer": fp8_weight,
    # rows of 1031 elements (not a multiple of 16 bytes): every subtile stored per element
    "matmul unaligned C": (jax_cute.matmul, (r(1000, 776), r(776, 1031))),
    "fused bias gelu unaligned C": (lambda x, w, b: jax_cute.matmul(x, w, bias=b, activation="gelu"),
                                    (r(1000, 776), r(776, 1031), jnp.asarray(rng.standard_normal(1031), jnp.float32))),
    "matmul stream pdl chain": stream_chain,
    "matmul grad": (jax.grad(lambda a, b: jax_cute.matmul(a, b).astype(jnp.float32).sum(), (0, 1)),
                    (r(264, 136), r(136, 72))),
    "ragged fwd+grads": (jax.grad(lambda x, w: jax_cute.ragged_dot(x, w, jnp.asarray([100, 0, 37, 120], jnp.int32))
                                  .astype(jnp.float32).sum(), (0, 1)), (r(264, 136), r(4, 136, 72))),
}
# python tools/sanitize_probe.py [WORD ...]: only the checks whose names hold one of the words
wanted = sys.argv[1:]
for name, check in checks.items():
    if wanted and not any(w in name for w in wanted):
        continue
    f, args = check() if callable(check) else check
    out = (f if hasattr(f, "lower") else jax.jit(f))(*args)   # a jitted check keeps its lowering
    jax.block_until_ready(out)
    print("ran", name, flush=True)
print("SANITIZE PROBE DONE")
