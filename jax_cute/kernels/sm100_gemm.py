"""Blackwell (sm_100a) dense GEMM: tcgen05 UMMA with the accumulator in tensor memory.

One persistent, warp-specialised kernel per config (192 threads per CTA):

* warp 5 (TMA): loads A/B k-tiles into a ring of smem stages, multicast across the cluster;
* warp 4 (MMA): the leader CTA of each MMA (both CTAs' smem for ``cta_group::2``) issues
  ``tcgen05.mma`` into a double-buffered TMEM accumulator and frees smem stages with
  ``tcgen05.commit``; a final commit per tile tells the epilogue the accumulator is ready;
* warps 0-3 (epilogue): allocate TMEM, then per tile ``tcgen05.ld`` -> registers -> smem ->
  TMA store, release the TMEM stage, and finally free TMEM.

Fused epilogue (``EPILOGUES``; dense GemmSpec.bias / activation): after a subtile's ``tcgen05.ld``
each float32 accumulator adds the bias of its output column (float32, read from global memory;
the column from an identity tensor partitioned like the TMEM load) and the activation
(kernels/epilogue.py, the same table as the Hopper kernel's) runs on the fragment, before the one
rounding to C's dtype. The pre-activation output (GemmSpec.preact) stores each subtile twice
through the same smem ring: A·B + bias rounded to D's dtype, then its activation to C's. A dact
epilogue (GemmSpec.dact, one batch mode) reads Z from global memory at the accumulators'
coordinates (clamped at C's edge: those elements are never stored) and scales the product by the
activation's derivative there. The grouped family's ragged_m products fuse the same epilogues but
the derivative, with the bias row of the tile's group. Gated activations are not fused here
(``unsupported`` says so, and dispatch keeps those epilogues in XLA).

The kernel class (sm100_kernel, imported only when a launcher is built) also serves the grouped
family (``sm100_grouped``): the three problem kinds differ only in how a linear tile index maps
to rows, columns, k-range and output bounds (see ``Sm100Gemm.tile``). This module holds what
routing needs and imports no DSL. Compile-verified only: never run on hardware.
"""


import math

from jax_cute.kernels import abi
from jax_cute.kernels import epilogue as fused_epilogue
from jax_cute.kernels.gemm_spec import GroupedSpec, Workspace
from jax_cute.kernels.sm100_config import NUM_SMS, Config

FAMILY = "sm100_gemm"
ARCH = "sm_100a"
BATCH_MODES = (1, 3)    # dense GemmSpec.batch_modes taken (grouped specs: one)
# fused epilogues of dense specs: C = act(A·B + bias[n]) in float32 before the one rounding;
# "preact": GemmSpec.preact, the pre-activation output too; "dact": GemmSpec.dact, an
# activation's derivative at an input z scaling the product
EPILOGUES = ("bias", *fused_epilogue.ACTIVATIONS, "preact", "dact")

_IN_DTYPES = ("bfloat16", "float16")
_OUT_DTYPES = ("bfloat16", "float16", "float32")


def unsupported(spec) -> str | None:
    if spec.a_dtype != spec.b_dtype or spec.a_dtype not in _IN_DTYPES:
        return f"sm100: inputs must both be one of {_IN_DTYPES}, got {spec.a_dtype}/{spec.b_dtype}"
    if spec.c_dtype not in _OUT_DTYPES:
        return f"sm100: output dtype {spec.c_dtype} not in {_OUT_DTYPES}"
    if spec.acc_dtype != "float32":
        return "sm100: only float32 accumulation"
    if not getattr(spec, "c_aligned", True):
        return "sm100: C's strides must be multiples of 16 bytes (TMA stores)"
    return _epilogue_refusal(spec)


def _epilogue_refusal(spec) -> str | None:
    """Why the kernel does not fuse ``spec``'s epilogue, or None (see EPILOGUES)."""
    if spec.activation in fused_epilogue.GATED:
        return f"sm100: no gated epilogue ({spec.activation})"
    if spec.activation and spec.activation not in fused_epilogue.ACTIVATIONS:
        return f"sm100: no fused epilogue for activation {spec.activation!r} ({', '.join(fused_epilogue.ACTIVATIONS)})"
    if isinstance(spec, GroupedSpec):   # (no dact: its GEMMs are the ragged_k gradients)
        return None
    if spec.dact and spec.dact not in fused_epilogue.ACTIVATIONS:
        return (f"sm100: no fused epilogue for the derivative of {spec.dact!r} "
                f"({', '.join(fused_epilogue.ACTIVATIONS)})")
    if spec.dact and spec.batch_modes != 1:
        return "sm100: an activation's derivative (dact) takes one batch mode"
    return None


_CANDIDATES = (
    Config(128, 64),
    Config(128, 128),
    Config(128, 256, cluster_m=2),
    Config(256, 128, cluster_m=2, two_cta=True),
    Config(256, 256, cluster_m=2, two_cta=True),
    Config(256, 256, cluster_m=2, cluster_n=2, two_cta=True),
)


def candidate_configs(spec) -> list[Config]:
    return [] if unsupported(spec) else list(_CANDIDATES)


def heuristic(spec, m, n, k, l, num_sms: int = NUM_SMS) -> Config:
    """Largest tile that still gives every SM work; 2-CTA 256-row tiles for big problems."""
    def ctas(c):
        return math.ceil(m / (c.tile_m)) * math.ceil(n / c.tile_n) * l * (2 if c.two_cta else 1)
    for c in reversed(_CANDIDATES):
        if ctas(c) >= num_sms or c is _CANDIDATES[0]:
            if c.cluster_n > 1 and n < 4 * c.tile_n:
                continue
            return c
    return _CANDIDATES[0]


def signature(spec, config) -> abi.Signature:
    """(a, b, c[, bias][, d], stream); bias is float32 (N,), d the pre-activation output (laid out
    like c). dact: (a, b, c, z, stream), z the pre-activation input (laid out like c)."""
    if spec.dact:
        return spec.signature((spec.dact_arg(),))
    return spec.signature(((spec.bias_arg(),) if spec.bias else ()) + ((spec.preact_arg(),) if spec.preact else ()))


def workspace(spec, config, m, n, k, l) -> list[Workspace]:
    return []


def launcher(spec, config):
    if why := unsupported(spec):
        raise ValueError(why)
    return make_launcher(spec, config)


def make_launcher(spec, config: Config):
    """The @cute.jit launcher of the kernel with the scheduler ``spec`` asks for: the dense tile
    walk for a GemmSpec (one or three batch modes), ragged_m / ragged_k for a GroupedSpec."""
    # imported here: the kernel module imports the DSL's compiler, which routing must not need
    from jax_cute.kernels import sm100_kernel

    grouped = isinstance(spec, GroupedSpec)
    if grouped:
        return sm100_kernel.make_launcher(spec.mode, config, 1, spec.signature(), spec.bias, spec.activation,
                                          spec.preact)
    return sm100_kernel.make_launcher("dense", config, spec.batch_modes, signature(spec, config), spec.bias,
                                      spec.activation, spec.preact, spec.dact)
