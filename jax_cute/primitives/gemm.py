"""The ``jax_cute_matmul`` primitive: a GEMM whose operands are read through layouts.

The public functions that bind it (``matmul``, ``dot_general``, ``einsum``) live in
``matmul.py`` and ``dot_general.py``; the fused and derivative epilogues (``fused.py``,
``dact.py``) bind it too, so it sits below them all.

One place for each rule, as in ``jax/_src/lax``:
- abstract evaluation: the output buffer's shape and dtype;
- reference lowering (CPU, and the fallback everywhere): reads the buffers *through the
  layouts* with reshape/transpose/broadcast and contracts with ``dot_general``;
- CUDA lowering: the kernel ``jax_cute.dispatch.gemm`` picks for the ``GemmRequest`` (else the reference);
- batching: ``rules.batch_rule``, a vmapped axis an L sub-mode (stride 0 on an unbatched
  operand), no data moved;
- autodiff: bilinear; each cotangent is another ``jax_cute_matmul`` over the same buffers with
  permuted modes (``gemm_layouts.cotangent_a``/``cotangent_b``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad, mlir

from jax_cute.dispatch import GemmRequest
from jax_cute import layout as L
from jax_cute.primitives import collective, sharding
from jax_cute.primitives.dot_dtypes import converted, cotangent_dtype, cotangent_result
from jax_cute.primitives.rules import batch_rule, gemm_primitive, kernel_local
from jax_cute.problem.gemm_layouts import (GemmLayouts, cotangent_a, cotangent_a_partials, cotangent_b,
                                           cotangent_b_partials)
from jax_cute.problem.gemm_plan import flatten_gemm


def _abstract_eval(a, b, *, layouts: GemmLayouts, out_dtype, acc_dtype, precision=None):
    if int(np.prod(a.shape)) < layouts.a.cosize() or int(np.prod(b.shape)) < layouts.b.cosize():
        raise ValueError(f"jax_cute_matmul: layouts {layouts.a} / {layouts.b} reach past buffers "
                         f"{a.shape} / {b.shape}")
    return sharding.result_aval("jax_cute_matmul", layouts, (a, b), np.dtype(out_dtype))


matmul_p = gemm_primitive("jax_cute_matmul", _abstract_eval, partitioned=True)


def reference(a, b, *, layouts: GemmLayouts, out_dtype, acc_dtype, precision=None):
    """The GEMM in plain lax ops, reading and writing through the layouts."""
    av = L.read(a, layouts.a)  # (M, K, L)
    bv = L.read(b, layouts.b)  # (N, K, L)
    acc = np.dtype(acc_dtype)
    # Widening first is exact (products of 16-bit floats are exact in f32) and every backend's
    # dot supports it; XLA:CPU has no bf16 x bf16 -> f32 batched dot.
    av, bv = av.astype(acc), bv.astype(acc)
    cv = jax.lax.dot_general(av, bv, (((1,), (1,)), ((2,), (2,))), precision=precision,
                             preferred_element_type=acc)  # (L, M, N)
    cv = jnp.transpose(cv, (1, 2, 0)).astype(out_dtype)
    return L.write(cv, layouts.c, layouts.c_shape)


# Both lowerings go through the partitioning rules (primitives/sharding.py); ``avals`` and
# ``params`` are then those of one shard.
mlir.register_lowering(matmul_p, sharding.lowering(matmul_p, sharding.reference_local(reference), collective.planner))


def _request(avals: tuple, params: dict) -> GemmRequest:
    return GemmRequest(avals, params["layouts"], params["out_dtype"], params["acc_dtype"],
                       precision=params.get("precision"))


mlir.register_lowering(matmul_p, sharding.lowering(matmul_p, kernel_local(_request, reference), collective.planner),
                       platform="cuda")


batch_rule(matmul_p)


# -- autodiff ---------------------------------------------------------------------------------

def gradient_dtype(operand_dtype: np.dtype) -> np.dtype:
    """Dtype the gradient GEMMs of an operand run in: the operand's own for 16-bit floats;
    bfloat16 for 8-bit floats, whose 2-3 mantissa bits would ruin a cotangent (fp8 -> bf16 is
    exact, so only the cotangent is rounded, as for 16-bit inputs)."""
    if operand_dtype.itemsize == 1 and jnp.issubdtype(operand_dtype, jnp.floating):
        return np.dtype(jnp.bfloat16)
    return operand_dtype


def _kernel_needs_copies(g: GemmLayouts, dtypes) -> bool:
    flat = flatten_gemm(g, dtypes)
    return isinstance(flat, str) or bool(flat.copies)


def _cotangent_rule(which: str):
    """Transpose rule for operand ``which``: another matmul over the cotangent and the other
    operand, its layouts from ``gemm_layouts.cotangent_a``/``cotangent_b``.

    A batch the operand was broadcast over is summed by joining the reduction K. Where that
    batch does not continue K in memory, a kernel would need copies; for 16-bit operands the
    sum is then taken over per-batch f32 partial products instead (one more reduction, no
    copy), rounded once to the operand dtype.
    """
    layouts_for = cotangent_a if which == "a" else cotangent_b
    partials_for = cotangent_a_partials if which == "a" else cotangent_b_partials

    def rule(ct, a, b, *, layouts: GemmLayouts, out_dtype, acc_dtype, precision=None):
        undefined, other = (a, b) if which == "a" else (b, a)
        if type(ct) is ad.Zero:
            return ad.Zero(undefined.aval)
        shape, dtype = undefined.aval.shape, np.dtype(undefined.aval.dtype)
        gdt = gradient_dtype(dtype)
        ct_dtype, ct = ct.dtype, cotangent_dtype(ct, gdt)
        if gdt != dtype:
            other = converted(other, gdt)  # both operands share the fp8 dtype; bf16 holds it exactly
        folded = layouts_for(layouts, shape)
        dts = [gdt.name, np.dtype(other.dtype).name, gdt.name]
        if gdt.itemsize == 2 and _kernel_needs_copies(folded, dts):
            partial = partials_for(layouts, shape)
            if partial is not None and not _kernel_needs_copies(partial[0], dts[:2] + ["float32"]):
                g, lead = partial
                out = matmul_p.bind(ct, other, layouts=g, out_dtype="float32", acc_dtype=acc_dtype,
                                    precision=precision)
                return cotangent_result(jnp.sum(out, axis=tuple(range(lead))), undefined.aval, ct_dtype)
        out = matmul_p.bind(ct, other, layouts=folded, out_dtype=gdt.name, acc_dtype=acc_dtype, precision=precision)
        # a conversion only where the gradient GEMM ran in bf16 for fp8
        return cotangent_result(out, undefined.aval, ct_dtype)

    return rule


_transpose_a, _transpose_b = _cotangent_rule("a"), _cotangent_rule("b")
ad.defbilinear(matmul_p, _transpose_a, _transpose_b)
