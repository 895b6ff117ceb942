"""A tiny CuTe DSL kernel the FFI tests launch: ``y = 2x + 1`` over a 1-D f32 tensor.

Imported lazily by the tests (collection must not need the DSL compiler). The DSL reads the
kernel's source again and resolves its names in this module's globals, so they live here.
"""

from __future__ import annotations

from jax_cute.kernels import abi, build, dsl

cute, cutlass = dsl.cute, dsl.cutlass

BLOCK = 128
SIGNATURE = (abi.TensorArg("x", "float32", (abi.DYN,), (1,), align=16),
             abi.TensorArg("y", "float32", (abi.DYN,), (1,), align=16), abi.StreamArg())


@cute.kernel
def affine_kernel(x: cute.Tensor, y: cute.Tensor, n: cutlass.Int32):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = bidx * BLOCK + tidx
    if i < n:
        y[i] = x[i] * 2.0 + 1.0


@cute.jit
def launcher(x: cute.Tensor, y: cute.Tensor, stream: dsl.cuda_driver.CUstream):
    n = cute.size(x, mode=[0])
    affine_kernel(x, y, n).launch(grid=((n + BLOCK - 1) // BLOCK, 1, 1), block=(BLOCK, 1, 1), stream=stream)


def compile_affine(name: str, arch: str = "sm_90a") -> build.KernelBinary:
    """The launcher compiled for ``arch`` under ``name`` (a unique name gives a unique key)."""
    return build.compile_launcher(launcher, SIGNATURE, arch=arch, name=name)
