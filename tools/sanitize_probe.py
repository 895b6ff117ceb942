"""A small representative workload for compute-sanitizer (memcheck, racecheck).

Run as: XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer --tool memcheck python tools/sanitize_probe.py
With the platform allocator every XLA buffer is its own allocation, so a kernel writing past
its output is caught instead of landing in a neighbour inside XLA's memory pool.
"""

import jax
import jax.numpy as jnp
import numpy as np

import jax_cute

jax_cute.config.set(strict=True, nan_fill=True)
rng = np.random.default_rng(0)


def r(*shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


checks = {
    "matmul odd": (jax_cute.matmul, (r(264, 136), r(136, 72))),
    "matmul transposed": (lambda a, b: jax_cute.matmul(a, b, transpose_a=True, transpose_b=True),
                          (r(136, 264), r(72, 136))),
    "matmul batched bcast": (jax_cute.matmul, (r(3, 200, 136), r(136, 264))),
    "matmul split-k": (jax_cute.matmul, (r(128, 8192), r(8192, 128))),
    # the heuristic's two picks for 2x1-cluster 256-wide tiles, each with a partial last tile
    # along M and N: pingpong where K is at most 16 k-tiles, the cooperative 128x256 tile beyond
    "matmul pingpong": (jax_cute.matmul, (r(2048, 1000), r(1000, 1032))),
    "matmul cooperative 128x256": (jax_cute.matmul, (r(2048, 1100), r(1100, 1032))),
    "matmul grad": (jax.grad(lambda a, b: jax_cute.matmul(a, b).astype(jnp.float32).sum(), (0, 1)),
                    (r(264, 136), r(136, 72))),
    "ragged fwd+grads": (jax.grad(lambda x, w: jax_cute.ragged_dot(x, w, jnp.asarray([100, 0, 37, 120], jnp.int32))
                                  .astype(jnp.float32).sum(), (0, 1)), (r(264, 136), r(4, 136, 72))),
}
for name, (f, args) in checks.items():
    out = jax.jit(f)(*args)
    jax.block_until_ready(out)
    print("ran", name, flush=True)
print("SANITIZE PROBE DONE")
