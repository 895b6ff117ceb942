"""A layer stack under ``lax.scan`` (each layer under ``jax.checkpoint``, as the GPT example's) for
the tests of kernelize's fp8 weights quantized before the scan (``jax_cute.fp8.scan_weights``):
CPU (tests/test_fp8.py) and GPU (tests/test_gpu_fp8.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import fp8_bound
from jax_cute.jaxprs import open_jaxpr, sub_jaxprs


def loss(p, x, sizes=None):
    """``x + gelu(x @ w1) @ w2.T + x @ shared`` per layer: w2 stored transposed, the experts by
    ``ragged_dot`` with ``sizes`` (when given), ``shared`` a weight the scan closes over."""
    shared = p["shared"].astype(jnp.bfloat16)

    def layer(x, w):
        def block(x):
            h = x.astype(jnp.bfloat16)
            w1, w2 = w["w1"].astype(jnp.bfloat16), w["w2"].astype(jnp.bfloat16)
            if sizes is None:
                h = jax.nn.gelu(jnp.dot(h, w1, preferred_element_type=jnp.float32)).astype(jnp.bfloat16)
                y = jnp.dot(h, w2.T, preferred_element_type=jnp.float32)
            else:
                h = jax.nn.gelu(jax.lax.ragged_dot(h, w1, sizes, preferred_element_type=jnp.float32))
                y = jax.lax.ragged_dot(h.astype(jnp.bfloat16), jnp.swapaxes(w2, 1, 2), sizes,
                                       preferred_element_type=jnp.float32)
            return x + y + jnp.dot(x.astype(jnp.bfloat16), shared, preferred_element_type=jnp.float32)
        return jax.checkpoint(block)(x), None

    return jnp.mean(jax.lax.scan(layer, x, {k: v for k, v in p.items() if k != "shared"})[0] ** 2)


def case(grouped: bool, layers: int, d: int, f: int, tokens: int, sizes: tuple[int, ...]):
    """(params, x, group sizes or None): f32 weights, (layers, [groups,] d, f) stacks, normal data."""
    lead = (layers, len(sizes)) if grouped else (layers,)
    data = lambda shape, seed: jnp.asarray(fp8_bound.data(shape, "normal", seed))  # noqa: E731
    p = {"w1": data((*lead, d, f), 40) * 0.05, "w2": data((*lead, d, f), 41) * 0.05, "shared": data((d, d), 42) * 0.05}
    return p, data((tokens, d), 43), jnp.asarray(sizes, jnp.int32) if grouped else None


def weight_kernel_calls(jaxpr, depth: int = 0, found=None) -> dict[int, int]:
    """The weight kernel's calls in a jaxpr, by how many scans they lie in."""
    found = {} if found is None else found
    for eqn in open_jaxpr(jaxpr)[0].eqns:
        if eqn.params.get("name") == "fp8_quantize_weight":
            found[depth] = found.get(depth, 0) + 1
        for sub in sub_jaxprs(eqn.params):
            weight_kernel_calls(sub, depth + (eqn.primitive.name == "scan"), found)
    return found
