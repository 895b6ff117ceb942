"""A custom CuTe DSL kernel inside JAX with ``jax_cute.cute_call``: ``out = a * alpha + b``.

Shows: a ``@cute.jit`` launcher ``(stream, *inputs, *outputs)`` with its ``@cute.kernel``,
predicated tails (any size, not only multiples of the block), ``jax.jit``, ``jax.vmap`` (loop
mode), a gradient through ``jax.custom_vjp``, an in-place update (``input_output_aliases``) in a
``lax.fori_loop``, and a ``reference=`` so the same code runs on a CPU. Without a GPU it also lowers the kernel for sm_90a to show it compiles.

    python examples/custom_kernel.py
"""

from __future__ import annotations

import argparse

import cutlass
import cutlass.cute as cute
import jax
import jax.numpy as jnp

import jax_cute

_THREADS = 128  # threads per block; each thread moves one 16-byte vector per operand


@cute.kernel
def _axpby_kernel(gA: cute.Tensor, gB: cute.Tensor, gC: cute.Tensor, cC: cute.Tensor, alpha: cute.Tensor,
                  n: cute.Shape, thr_layout: cute.Layout, val_layout: cute.Layout):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    blk = (None, bidx)  # this block's tile of the zipped (tile, rest) view
    copy_in = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), gA.element_type)
    copy_out = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), gC.element_type)
    thr_in = cute.make_tiled_copy_tv(copy_in, thr_layout, val_layout).get_slice(tidx)
    thr_out = cute.make_tiled_copy_tv(copy_out, thr_layout, val_layout).get_slice(tidx)
    tA, tB = thr_in.partition_S(gA[blk]), thr_in.partition_S(gB[blk])
    tC, tCrd = thr_out.partition_D(gC[blk]), thr_out.partition_S(cC[blk])
    # The last tile runs past n: predicate every element on its coordinate, no padding needed.
    pred = cute.make_rmem_tensor(tCrd.shape, cutlass.Boolean)
    for i in range(cute.size(pred)):
        pred[i] = cute.elem_less(tCrd[i], n)
    fA, fB, fC = cute.make_fragment_like(tA), cute.make_fragment_like(tB), cute.make_fragment_like(tC)
    cute.copy(copy_in, tA, fA, pred=pred)
    cute.copy(copy_in, tB, fB, pred=pred)
    # Compute in f32 whatever the storage type (bf16 inputs keep f32 accuracy in the FMA).
    s = alpha[0]
    res = fA.load().to(cutlass.Float32) * s + fB.load().to(cutlass.Float32)
    fC.store(res.to(gC.element_type))
    cute.copy(copy_out, fC, tC, pred=pred)


@cute.jit
def axpby_launcher(stream, a: cute.Tensor, b: cute.Tensor, alpha: cute.Tensor, out: cute.Tensor):
    """cute_call signature: (stream, inputs a, b, alpha, output out); all 1-D, alpha of size 1."""
    vec = 128 // a.element_type.width  # elements per 16-byte access
    thr_layout = cute.make_layout(_THREADS)
    val_layout = cute.make_layout(vec)
    tiler, tv_layout = cute.make_layout_tv(thr_layout, val_layout)
    gA, gB, gC = (cute.zipped_divide(t, tiler) for t in (a, b, out))  # (tile, rest)
    cC = cute.zipped_divide(cute.make_identity_tensor(out.shape), tiler=tiler)
    _axpby_kernel(gA, gB, gC, cC, alpha, out.shape, thr_layout, val_layout).launch(
        grid=[cute.size(gC, mode=[1]), 1, 1], block=[cute.size(tv_layout, mode=[0]), 1, 1], stream=stream)


def _axpby_math(a, b, alpha):
    return (a.astype(jnp.float32) * alpha[0] + b.astype(jnp.float32)).astype(a.dtype)


def _axpby_reference(a, b, alpha):
    return (_axpby_math(a, b, alpha),)  # a reference returns the tuple of outputs


def axpby_raw(a: jax.Array, b: jax.Array, alpha: jax.Array, *, in_place: bool = False) -> jax.Array:
    """``a * alpha + b`` on the CuTe kernel (any shape; a, b same dtype; alpha a f32 scalar).

    ``in_place``: the result is written into a's buffer (each thread reads its elements of a
    before writing them), which saves a buffer and, in a loop whose carry is a, a copy per
    iteration; XLA copies a first where the caller still needs it."""
    shape = a.shape
    flat = lambda x: x.reshape(-1)  # noqa: E731 - a free view for row-major buffers
    call = jax_cute.cute_call(axpby_launcher, out_shape=jax.ShapeDtypeStruct((a.size,), a.dtype),
                              reference=_axpby_reference, name="axpby",
                              input_output_aliases={0: 0} if in_place else None,
                              # under a jit partitioned over devices, each runs the kernel on its
                              # slice of a, b and out; alpha (factor s) is read whole
                              sharding_rule="n, n, s -> n")
    return call(flat(a), flat(b), jnp.reshape(alpha, (1,)).astype(jnp.float32)).reshape(shape)


# cute_call has no derivative of its own: custom_vjp says what the backward pass is. Here the
# backward pass is itself element-wise, so it reuses the same kernel (alpha = scale of a).
@jax.custom_vjp
def axpby(a: jax.Array, b: jax.Array, alpha: jax.Array) -> jax.Array:
    return axpby_raw(a, b, alpha)


def _axpby_fwd(a, b, alpha):
    return axpby_raw(a, b, alpha), (a, jnp.asarray(alpha, jnp.float32))  # alpha may be a Python float


def _axpby_bwd(res, g):
    a, alpha = res
    ga = axpby_raw(g, jnp.zeros_like(g), alpha)  # d/da = alpha * g, on the kernel again
    galpha = jnp.sum(g.astype(jnp.float32) * a.astype(jnp.float32)).astype(alpha.dtype).reshape(alpha.shape)
    return ga, g, galpha


axpby.defvjp(_axpby_fwd, _axpby_bwd)


def lowers_to_kernel(fn, *args, arch: str = "sm_90a") -> bool:
    """Lower ``fn`` for CUDA ``arch`` (no GPU needed) and report whether our custom call is in it."""
    with jax_cute.config.override(target_arch=arch, strict=True):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return "jax_cute_launch" in text


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1_000_003, help="elements (deliberately not a multiple of the block)")
    p.add_argument("--batch", type=int, default=4, help="vmap batch")
    p.add_argument("--no-compile-check", action="store_true", help="skip lowering for sm_90a on a CPU")
    args = p.parse_args(argv)

    on_gpu = jax.default_backend() == "gpu"
    x = jnp.ones((1000,), jnp.float32)
    if not on_gpu:
        path = "reference path on CPU (no GPU found)"
    elif "jax_cute_launch" in jax.jit(axpby).lower(x, x, jnp.float32(1.0)).as_text():
        path = f"jax_cute kernel (cute_call) on {jax.devices()[0].device_kind}"
    else:
        path = f"reference path on {jax.devices()[0].device_kind} (see the jax_cute log)"
    print(f"path: {path}")
    ka, kb = jax.random.split(jax.random.key(0))
    results: dict = {"path": path}
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)):
        a = jax.random.normal(ka, (args.n,), dtype)
        b = jax.random.normal(kb, (args.n,), dtype)
        alpha = jnp.float32(1.5)
        out = jax.jit(axpby)(a, b, alpha)
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - _axpby_math(a, b, alpha[None]).astype(jnp.float32))))
        print(f"jit  {jnp.dtype(dtype).name:8s} n={args.n}: max |out - ref| = {err:.2e}")
        assert err <= tol, err
        results[f"err_{jnp.dtype(dtype).name}"] = err

    # vmap: cute_call loops over the batch (lax.map) unless the launcher declares batch_mode.
    a = jax.random.normal(ka, (args.batch, 4099), jnp.float32)
    b = jax.random.normal(kb, (args.batch, 4099), jnp.float32)
    alphas = jnp.arange(1, args.batch + 1, dtype=jnp.float32)
    out = jax.jit(jax.vmap(axpby))(a, b, alphas)
    verr = float(jnp.max(jnp.abs(out - (a * alphas[:, None] + b))))
    print(f"vmap over {args.batch} problems (loop mode): max err = {verr:.2e}")
    assert verr <= 1e-5, verr
    results["vmap_err"] = verr

    # In place: the loop carry is updated in its own buffer (no new buffer, no copy per step);
    # a itself is left as it was (XLA copies it into the loop first).
    loop = jax.jit(lambda a, b: jax.lax.fori_loop(
        0, 10, lambda i, x: axpby_raw(x, b, jnp.float32(0.5), in_place=True), a))
    want = a[0]
    for _ in range(10):
        want = want * 0.5 + b[0]
    lerr = float(jnp.max(jnp.abs(loop(a[0], b[0]) - want)))
    print(f"in place in a fori_loop, 10 steps: max err = {lerr:.2e}")
    assert lerr <= 1e-5, lerr
    results["in_place_err"] = lerr

    # grad through custom_vjp: d/dalpha sum(a*alpha + b) = sum(a); d/da = alpha.
    ga, gb, galpha = jax.jit(jax.grad(lambda a, b, s: jnp.sum(axpby(a, b, s)), argnums=(0, 1, 2)))(
        a[0], b[0], jnp.float32(2.0))
    gerr = max(float(jnp.max(jnp.abs(ga - 2.0))), float(jnp.max(jnp.abs(gb - 1.0))),
               abs(float(galpha) - float(jnp.sum(a[0]))) / max(1.0, abs(float(jnp.sum(a[0])))))
    print(f"grad via custom_vjp: max err = {gerr:.2e}")
    assert gerr <= 1e-5, gerr
    results["grad_err"] = gerr

    if not on_gpu and not args.no_compile_check:
        x = jnp.ones((1000,), jnp.bfloat16)
        ok = lowers_to_kernel(axpby, x, x, jnp.float32(1.0))
        print(f"lowered for sm_90a without a GPU: module contains jax_cute_launch: {ok}")
        assert ok
        results["sm90a_lowered"] = ok
    return results


if __name__ == "__main__":
    main()
