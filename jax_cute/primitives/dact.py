"""An activation's derivative inside the backward GEMM of the product that consumes it.

In ``out = act(z) · W`` (an MLP's two layers, ``z`` the first one's pre-activation) the backward
pass computes ``dz = act'(z) ⊙ (dout · Wᵀ)``. Unfused, the GEMM writes ``dout · Wᵀ`` and XLA
reads it back with ``z`` to multiply; here that GEMM multiplies in its epilogue and writes
``dz`` once. Two linear primitives carry it:

- ``jax_cute_matmul_dact_operand`` (``operand_p``): ``(act'(Z) ⊙ X) · W`` (or ``W · (act'(Z) ⊙ X)``),
  ``Z`` laid out as ``X``. It is the tangent term a chained product's JVP emits for its
  activated operand (``fused.py``: a ``jax_cute_matmul_fused`` whose operand is ``act(z)`` of
  the call before it, as ``kernelize`` chains them). Evaluated only by forward-mode autodiff:
  an XLA multiply, then the GEMM.
- ``jax_cute_matmul_dact`` (``dact_p``): ``act'(Z) ⊙ (A · B)``, ``Z`` read through a layout of
  its own at C's (M, N, L) coordinates, in float32 on the accumulator and rounded once. It is
  ``operand_p``'s transpose with respect to ``X``: on CUDA the GEMM kernel's epilogue reads
  ``Z`` (``dispatch.gemm``); elsewhere the GEMM with a float32 output, then the multiply
  in XLA. Partitioned (``epilogue_sharding.py``), Z shards with the C blocks it is read at.

Both are linear in the GEMM's operands; their JVP in ``Z`` is that of the XLA form. Batching
composes layouts as ``jax_cute_matmul``'s does, ``Z`` kept aligned with what it is read as. Each
transposes into the other where the GEMM's transpose is a plain permutation of modes, and
otherwise into the GEMM's own transpose and an XLA multiply. The derivative is ``jax.jvp`` of
the ``jax.nn`` activation (``activations.derivative_times``), as XLA computes it unfused. The
GEMM primitive is ``gemm.matmul_p``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad, mlir

from jax_cute.dispatch import GemmRequest
from jax_cute import layout as L
from jax_cute.activations import derivative_times, epilogue_dtype
from jax_cute.layout import Layout
from jax_cute.primitives.gemm import matmul_p
from jax_cute.primitives import epilogue_sharding
from jax_cute.primitives.rules import batch_rule, composed_local, epilogue_local, gemm_primitive
from jax_cute.primitives.sharding import result_aval
from jax_cute.problem.gemm_layouts import GemmLayouts, batched_layout, cotangent_a, cotangent_b

def _z_in_c(z, z_layout: Layout, layouts: GemmLayouts, dtype):
    """Z as a buffer shaped like C (broadcast where its layout has stride 0)."""
    return L.write(L.read(z, z_layout).astype(dtype), layouts.c, layouts.c_shape)


def _zero_like(aval):
    return ad.Zero(aval.to_tangent_aval() if hasattr(aval, "to_tangent_aval") else aval)


# -- dact_p: act'(Z) ⊙ (A · B) --------------------------------------------------------------------

def _dact_abstract_eval(a, b, z, *, layouts: GemmLayouts, z_layout: Layout, activation, out_dtype,
                        acc_dtype, precision=None):
    del activation, acc_dtype, precision
    for name, x, lay in (("a", a, layouts.a), ("b", b, layouts.b), ("z", z, z_layout)):
        if int(np.prod(x.shape)) < lay.cosize():
            raise ValueError(f"jax_cute_matmul_dact: layout {lay} of {name} reaches past its buffer {x.shape}")
    return result_aval("jax_cute_matmul_dact", layouts, (a, b, z), np.dtype(out_dtype), {"z": ("mnl", z_layout)})


dact_p = gemm_primitive("jax_cute_matmul_dact", _dact_abstract_eval)


def dact_finish(acc, z, *, layouts: GemmLayouts, z_layout: Layout, activation, out_dtype, acc_dtype,
                precision=None) -> list:
    """The multiply in XLA on the GEMM's float32 (epilogue dtype) result ``acc``."""
    del precision
    epi = epilogue_dtype(acc_dtype)
    return [derivative_times(activation, _z_in_c(z, z_layout, layouts, epi), acc, epi).astype(out_dtype)]


def dact_composed(a, b, z, *, layouts: GemmLayouts, acc_dtype, precision=None, **params):
    """The GEMM primitive with a float32 (epilogue dtype) output, then the multiply in XLA."""
    acc = matmul_p.bind(a, b, layouts=layouts, out_dtype=epilogue_dtype(acc_dtype).name, acc_dtype=acc_dtype,
                        precision=precision)
    return dact_finish(acc, z, layouts=layouts, acc_dtype=acc_dtype, **params)[0]


def _request(avals: tuple, params: dict) -> GemmRequest:
    return GemmRequest(avals, params["layouts"], params["out_dtype"], params["acc_dtype"], epilogue=True,
                       dact=params["activation"], z_layout=params["z_layout"],
                       precision=params.get("precision"))


# Both lowerings go through the partitioning rules (primitives/epilogue_sharding.py); on CUDA
# each shard runs the GEMM kernel with the derivative in its epilogue where dispatch picks one,
# otherwise ``dact_composed``.
_Z = epilogue_sharding.layout_param("z", "z_layout")
mlir.register_lowering(dact_p, epilogue_sharding.lowering(composed_local(dact_composed), dact_finish, dact_composed, _Z,
                                                          matmul_p))
mlir.register_lowering(dact_p, epilogue_sharding.lowering(epilogue_local(_request, dact_composed, dact_composed),
                                                          dact_finish, dact_composed, _Z, matmul_p), platform="cuda")


def align_batch(x, dim: int | None, size: int, target: int):
    """``x`` (batched at ``dim``, or unbatched: None) with its batch axis at ``target``."""
    if dim is None:
        return jnp.broadcast_to(jnp.expand_dims(x, target), x.shape[:target] + (size,) + x.shape[target:])
    return jnp.moveaxis(x, dim, target)


def _batch_z_layout(args: list, dims: list, size: int, params: dict) -> tuple[list, list, dict]:
    params["z_layout"] = batched_layout(params["z_layout"], args[2].shape, dims[2], size, 2)
    return args, dims, params


batch_rule(dact_p, _batch_z_layout)


def _bilinear_jvp(prim, composed):
    """The JVP rule of ``prim(a, b, z)``, bilinear in (a, b) and smooth in z: the primitive again
    for each operand's tangent, and in z the JVP of its XLA form ``composed``."""
    def jvp(primals, tangents, **params):
        a, b, z = primals
        da, db, dz = tangents
        out = prim.bind(a, b, z, **params)
        terms = []
        if type(da) is not ad.Zero:
            terms.append(prim.bind(da, b, z, **params))
        if type(db) is not ad.Zero:
            terms.append(prim.bind(a, db, z, **params))
        if type(dz) is not ad.Zero:
            terms.append(jax.jvp(lambda z: composed(a, b, z, **params), (z,), (dz,))[1])
        if not terms:
            return out, _zero_like(jax.typeof(out))
        return out, functools.reduce(jnp.add, terms)
    return jvp


ad.primitive_jvps[dact_p] = _bilinear_jvp(dact_p, dact_composed)


def _dact_transpose(ct, a, b, z, *, layouts: GemmLayouts, z_layout: Layout, activation, out_dtype,
                    acc_dtype, precision=None):
    """The cotangent scaled by act'(Z) in XLA, then the GEMM's own transpose (a
    second-order derivative's path: the backward pass never transposes this primitive)."""
    if ad.is_undefined_primal(z):
        raise NotImplementedError("jax_cute_matmul_dact is not linear in Z")
    if type(ct) is ad.Zero:
        return [None if not ad.is_undefined_primal(x) else ad.Zero(x.aval) for x in (a, b)] + [None]
    epi = epilogue_dtype(acc_dtype)
    s = derivative_times(activation, _z_in_c(z, z_layout, layouts, epi), ct, epi).astype(ct.dtype)
    cts = ad.get_primitive_transpose(matmul_p)(s, a, b, layouts=layouts, out_dtype=out_dtype, acc_dtype=acc_dtype,
                                           precision=precision)
    return list(cts) + [None]


ad.primitive_transposes[dact_p] = _dact_transpose


# -- operand_p: (act'(Z) ⊙ X) · W, or W · (act'(Z) ⊙ X) --------------------------------------------

def _operands(x, w, which: str) -> tuple:
    return (x, w) if which == "a" else (w, x)


def _operand_abstract_eval(x, w, z, *, which, layouts: GemmLayouts, activation, out_dtype, acc_dtype,
                           precision=None):
    del activation
    if tuple(z.shape) != tuple(x.shape):
        raise ValueError(f"jax_cute_matmul_dact_operand: Z {z.shape} is not shaped like its operand {x.shape}")
    return matmul_p.abstract_eval(*_operands(x, w, which), layouts=layouts, out_dtype=out_dtype, acc_dtype=acc_dtype,
                              precision=precision)[0]


operand_p = gemm_primitive("jax_cute_matmul_dact_operand", _operand_abstract_eval)


def _scaled_operand(x, z, activation: str, acc_dtype):
    return derivative_times(activation, z, x, epilogue_dtype(acc_dtype)).astype(x.dtype)


def operand_composed(x, w, z, *, which, layouts: GemmLayouts, activation, out_dtype, acc_dtype,
                     precision=None):
    """act'(Z) ⊙ X in XLA (rounded to X's dtype), then the GEMM primitive."""
    s = _scaled_operand(x, z, activation, acc_dtype)
    return matmul_p.bind(*_operands(s, w, which), layouts=layouts, out_dtype=out_dtype, acc_dtype=acc_dtype,
                         precision=precision)


mlir.register_lowering(operand_p, mlir.lower_fun(operand_composed, multiple_results=False))


def _batch_z(args: list, dims: list, size: int, params: dict) -> tuple[list, list, dict]:
    """Z is read through X's layout: give it X's batch axis."""
    (x, w, z), (dx, dw, dz) = args, dims
    if dz != dx:
        if dx is None:
            x, dx = align_batch(x, None, size, 0), 0
        z = align_batch(z, dz, size, dx)
    return [x, w, z], [dx, dw, dx], params


def _layout_operands(args: list, dims: list, params: dict) -> tuple[list, list]:
    return list(_operands(args[0], args[1], params["which"])), list(_operands(dims[0], dims[1], params["which"]))


batch_rule(operand_p, _batch_z, _layout_operands)


ad.primitive_jvps[operand_p] = _bilinear_jvp(operand_p, operand_composed)


def _plain_permutation(layouts: GemmLayouts, which: str) -> bool:
    """Whether the operand ``which`` is read once per batch (no L sub-mode of stride 0): its
    gradient GEMM is then the product's modes permuted, with nothing to sum over a broadcast."""
    lay = layouts.a if which == "a" else layouts.b
    return not any(d == 0 and s > 1 for s, d in lay.mode(2).flat_modes())


def _operand_transpose(ct, x, w, z, *, which, layouts: GemmLayouts, activation, out_dtype, acc_dtype,
                       precision=None):
    """With respect to X: ``act'(Z) ⊙ (ct · Wᵀ)`` as one ``jax_cute_matmul_dact`` (the derivative
    in the gradient GEMM's epilogue, Z read exactly as that GEMM writes X's buffer) where X is a
    16-bit float read once per batch; otherwise the GEMM's own transpose, then the multiply.
    With respect to W: the GEMM's transpose over the scaled X."""
    if ad.is_undefined_primal(z):
        raise NotImplementedError("jax_cute_matmul_dact_operand is not linear in Z")
    gemm_params = dict(layouts=layouts, out_dtype=out_dtype, acc_dtype=acc_dtype, precision=precision)
    if type(ct) is ad.Zero:
        return [ad.Zero(v.aval) if ad.is_undefined_primal(v) else None for v in (x, w)] + [None]
    transpose = ad.get_primitive_transpose(matmul_p)
    if ad.is_undefined_primal(w):
        s = _scaled_operand(x, z, activation, acc_dtype)
        cts = transpose(ct, *_operands(s, w, which), **gemm_params)
        return [None, cts[1 if which == "a" else 0], None]
    dtype = np.dtype(x.aval.dtype)
    if dtype.itemsize == 2 and jnp.issubdtype(dtype, jnp.floating) and _plain_permutation(layouts, which):
        folded = (cotangent_a if which == "a" else cotangent_b)(layouts, x.aval.shape)
        # (Z has X's buffer and layout, which the gradient GEMM writes through folded.c)
        return [dact_p.bind(ct.astype(dtype), w, z, layouts=folded, z_layout=folded.c,
                            activation=activation, out_dtype=dtype.name, acc_dtype=acc_dtype,
                            precision=precision), None, None]
    cts = transpose(ct, *_operands(x, w, which), **gemm_params)
    raw = cts[0 if which == "a" else 1]
    return [_scaled_operand(raw, z, activation, acc_dtype), None, None]


ad.primitive_transposes[operand_p] = _operand_transpose
