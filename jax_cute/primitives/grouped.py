"""The grouped GEMM primitives ``jax_cute_ragged_m`` / ``jax_cute_ragged_k``: ``matmul``'s rules
for a product whose groups are consecutive ranges of a ragged mode, sizes read on the device.

One place for each rule, as in ``gemm.py``:
- abstract evaluation: the output buffer's shape and dtype;
- reference lowering (CPU, and the fallback everywhere): reads the buffers through the layouts,
  clips the group sizes as documented, and contracts masked rows with ``dot_general``
  (``ragged_reference.py``);
- CUDA lowering: the grouped kernel ``jax_cute.dispatch.gemm`` picks (else the reference);
- batching: ``rules.batch_rule``, a vmapped axis an L sub-mode of every operand (stride 0
  where unbatched, group sizes included), no data moved;
- autodiff: linear in a and b (group sizes get no tangent); each transpose is one of the two
  primitives over the same buffers with permuted modes (``ragged_layouts.cotangent``).

``ragged_dot.py`` binds them (``jax_cute.ragged_dot``), ``ragged_fused.py`` wraps ``ragged_m``
with an epilogue.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad, mlir

from jax_cute.dispatch import GemmRequest
from jax_cute.primitives import sharding
from jax_cute.primitives.dot_dtypes import cotangent_dtype, cotangent_result
from jax_cute.primitives.ragged_reference import reference
from jax_cute.primitives.rules import batch_rule, gemm_primitive, kernel_local
from jax_cute.problem.ragged_layouts import RAGGED_K, RAGGED_M, RaggedLayouts, cotangent


def _abstract_eval(a, b, gs, *, layouts: RaggedLayouts, out_dtype, acc_dtype, precision=None):
    for name, x in (("a", a), ("b", b), ("gs", gs)):
        if int(np.prod(x.shape)) < layouts.layout(name).cosize():
            raise ValueError(f"jax_cute_{layouts.mode}: layout {name}={layouts.layout(name)} reaches past "
                             f"its buffer {x.shape}")
    if gs.dtype != np.dtype("int32"):
        raise TypeError(f"jax_cute_{layouts.mode}: group sizes must be int32, got {gs.dtype}")
    return sharding.result_aval(f"jax_cute_{layouts.mode}", layouts, (a, b, gs), np.dtype(out_dtype))


def _request(avals: tuple, params: dict) -> GemmRequest:
    return GemmRequest(avals, params["layouts"], params["out_dtype"], params["acc_dtype"],
                       precision=params.get("precision"))


# -- autodiff ---------------------------------------------------------------------------------

def _jvp(prim, primals, tangents, **params):
    a, b, gs = primals
    da, db, _ = tangents  # group sizes are integers: no tangent
    out = prim.bind(a, b, gs, **params)
    terms = [prim.bind(da, b, gs, **params)] if type(da) is not ad.Zero else []
    if type(db) is not ad.Zero:
        terms.append(prim.bind(a, db, gs, **params))
    if not terms:
        return out, ad.Zero(jax.typeof(out).to_tangent_aval())
    return out, terms[0] if len(terms) == 1 else terms[0] + terms[1]


def _transpose(ct, a, b, gs, *, layouts: RaggedLayouts, out_dtype, acc_dtype, precision=None):
    if ad.is_undefined_primal(gs):
        raise ValueError("jax_cute ragged_dot: group sizes are not differentiable")
    wrt = "a" if ad.is_undefined_primal(a) else "b"
    aval = (a if wrt == "a" else b).aval
    if type(ct) is ad.Zero:
        return [ad.Zero(aval), None, None] if wrt == "a" else [None, ad.Zero(aval), None]
    ct_dtype, ct = ct.dtype, cotangent_dtype(ct, aval.dtype)
    cot = cotangent(layouts, wrt, aval.shape)
    bufs = {"a": a, "b": b, "c": ct}
    # Broadcast batches summed afterwards are accumulated in acc_dtype and rounded once.
    dt = np.dtype(acc_dtype if cot.extra else aval.dtype).name
    res = PRIMITIVES[cot.layouts.mode].bind(bufs[cot.operands[0]], bufs[cot.operands[1]], gs,
                                            layouts=cot.layouts, out_dtype=dt, acc_dtype=acc_dtype,
                                            precision=precision)
    if cot.extra:
        res = jnp.sum(res, axis=tuple(range(cot.extra)))
    res = cotangent_result(res, aval, ct_dtype)
    return [res, None, None] if wrt == "a" else [None, res, None]


ragged_m_p = gemm_primitive("jax_cute_ragged_m", _abstract_eval, partitioned=True)
ragged_k_p = gemm_primitive("jax_cute_ragged_k", _abstract_eval, partitioned=True)
PRIMITIVES = {RAGGED_M: ragged_m_p, RAGGED_K: ragged_k_p}

for _p in PRIMITIVES.values():
    mlir.register_lowering(_p, sharding.lowering(_p, sharding.reference_local(reference)))
    mlir.register_lowering(_p, sharding.lowering(_p, kernel_local(_request, reference)), platform="cuda")
    batch_rule(_p)
    ad.primitive_jvps[_p] = functools.partial(_jvp, _p)
    ad.primitive_transposes[_p] = _transpose
