"""Our CuTe DSL kernels, one module per family (see docs/kernel-contract.md).

Families are imported lazily: importing one imports the DSL's compiler, which lowering a
cached kernel must not need.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# (kind, arch) -> family module
_FAMILIES = {
    ("gemm", "sm_90a"): "jax_cute.kernels.sm90_gemm",
    ("grouped", "sm_90a"): "jax_cute.kernels.sm90_grouped",
    ("gemm", "sm_100a"): "jax_cute.kernels.sm100_gemm",
    ("grouped", "sm_100a"): "jax_cute.kernels.sm100_grouped",
}


# (kind, arch) of the families whose kernels store an output whose strides are not multiples of
# 16 bytes without TMA (GemmSpec.c_aligned False): its buffer is then not padded and sliced
UNALIGNED_C = frozenset({("gemm", "sm_90a")})


def family(kind: str, arch: str) -> ModuleType | None:
    """The family module for (kind, arch), or None when we have none."""
    name = _FAMILIES.get((kind, arch))
    return importlib.import_module(name) if name else None

