"""The one place jax_cute touches the CuTe DSL's Python API.

The DSL (nvidia-cutlass-dsl) is beta and moves between releases. Every kernel module imports
the DSL through here, so an upgrade (renamed helpers, moved pipelines or schedulers) is
mended in one file. Importing this module imports the DSL's compiler: only code that compiles
kernels may do so; loading a cached kernel never does (see ``jax_cute.cache``).
"""

from __future__ import annotations

import os

from jax_cute.kernels import dsl_env

# The DSL reads where to write kept artifacts when it is imported: a directory of this user's.
dsl_env.prepare_dump_dir()

# The DSL picks its target from CUTE_DSL_ARCH when the process starts compiling; without a GPU
# it defaults to sm_100a. Compiles name their arch (kernels/build.py).
import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.pipeline as pipeline  # noqa: E402
import cutlass.utils as utils  # noqa: E402
import cutlass.utils.hopper_helpers as sm90_utils  # noqa: E402
import cutlass.utils.blackwell_helpers as sm100_utils  # noqa: E402
from cutlass.cute.nvgpu import cpasync, tcgen05, warpgroup, warp  # noqa: E402
from cutlass.cute.runtime import make_fake_tensor, make_fake_compact_tensor  # noqa: E402
import cuda.bindings.driver as cuda_driver  # noqa: E402
import cutlass.memory as memory  # noqa: E402  (TMEM/SMEM allocators; cutlass.utils' copies are deprecated)
from cutlass.tensor_utils import LayoutEnum  # noqa: E402
from cutlass.cutlass_dsl import T  # noqa: E402
from cutlass._mlir.dialects import llvm  # noqa: E402

Int32 = cutlass.Int32
Int64 = cutlass.Int64
Float32 = cutlass.Float32
Boolean = cutlass.Boolean
Constexpr = cutlass.Constexpr

# Numpy-style dtype names (what jax and our cache keys use) to DSL numeric types.
DTYPES = {
    "bfloat16": cutlass.BFloat16,
    "float16": cutlass.Float16,
    "float32": cutlass.Float32,
    "int32": cutlass.Int32,
    "int64": cutlass.Int64,
    "uint8": cutlass.Uint8,
    "int8": cutlass.Int8,
    "float8_e4m3fn": cutlass.Float8E4M3FN,
    "float8_e5m2": cutlass.Float8E5M2,
}


def dsl_dtype(name: str):
    """The DSL numeric type for a numpy-style dtype name."""
    try:
        return DTYPES[name]
    except KeyError:
        raise TypeError(f"jax_cute: no CuTe DSL type for dtype {name!r}") from None


def sym_int32(divisibility: int = 1):
    return cute.sym_int32(divisibility=divisibility)


def sym_int64(divisibility: int = 1):
    return cute.sym_int64(divisibility=divisibility)


def fake_stream():
    return cuda_driver.CUstream(0)


def target_arch() -> str | None:
    return os.environ.get("CUTE_DSL_ARCH")


def pin(value: Float32) -> Float32:
    """``value`` through an empty volatile asm (CUTLASS's warpgroup_fence_operand): what computes
    it stays before the next volatile op (a WGMMA), which LLVM may not sink it past."""
    return Float32(llvm.inline_asm(T.f32(), [Float32(value).ir_value()], "", "=f,0", has_side_effects=True,
                                   is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


__all__ = [
    "cutlass", "cute", "pipeline", "utils", "sm90_utils", "sm100_utils", "cpasync", "tcgen05",
    "warpgroup", "warp", "make_fake_tensor", "make_fake_compact_tensor", "cuda_driver", "Int32",
    "Int64", "Float32", "Boolean", "Constexpr", "dsl_dtype", "sym_int32", "sym_int64",
    "fake_stream", "target_arch", "memory", "LayoutEnum", "pin",
]
