"""``jax_cute.ragged_dot`` and its primitives ``jax_cute_ragged_m`` / ``jax_cute_ragged_k``.

The same rules as ``matmul.py``, one place each:
- abstract evaluation: the output buffer's shape and dtype;
- reference lowering (CPU, and the fallback everywhere): reads the buffers through the layouts,
  clips the group sizes as documented, and contracts masked rows with ``dot_general``;
- CUDA lowering: the grouped kernel family through ``jax_cute.routing`` (else the reference);
- batching: a vmapped axis becomes an L sub-mode of every operand (stride 0 where unbatched,
  group sizes included), layouts re-targeted by composition, no data moved;
- autodiff: linear in a and b (group sizes get no tangent); each transpose is one of the two
  primitives over the same buffers with permuted modes (``ragged_layouts.cotangent``).
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core
from jax.interpreters import ad, batching, mlir

from jax_cute import layout as L
from jax_cute import routing
from jax_cute.primitives.matmul import _acc_dtype, _cotangent_dtype
from jax_cute.primitives.ragged_layouts import (RAGGED_K, RAGGED_M, FlatGrouped, RaggedLayouts, batched, cotangent,
                                                flatten_grouped, ragged_dot_layouts)

logger = logging.getLogger("jax_cute")

ragged_m_p = core.Primitive("jax_cute_ragged_m")
ragged_k_p = core.Primitive("jax_cute_ragged_k")
PRIMITIVES = {RAGGED_M: ragged_m_p, RAGGED_K: ragged_k_p}


def _abstract_eval(a, b, gs, *, layouts: RaggedLayouts, out_dtype, acc_dtype):
    for name, x in (("a", a), ("b", b), ("gs", gs)):
        if int(np.prod(x.shape)) < layouts.layout(name).cosize():
            raise ValueError(f"jax_cute_{layouts.mode}: layout {name}={layouts.layout(name)} reaches past "
                             f"its buffer {x.shape}")
    if gs.dtype != np.dtype("int32"):
        raise TypeError(f"jax_cute_{layouts.mode}: group sizes must be int32, got {gs.dtype}")
    return jax.core.ShapedArray(layouts.c_shape, np.dtype(out_dtype))


def _eager(prim, *args, **params):
    # Outside jit, run the primitive as a one-op jitted computation (like jax's own primitives).
    return jax.jit(functools.partial(prim.bind, **params))(*args)


def group_ends(sizes, extent: int):
    """Documented bad-size rules: negative sizes count as 0 and group ends are clipped at
    ``extent``. A saturating scan (``x + min(y, R - x)``) cannot overflow int32."""
    s = jnp.clip(sizes, 0, extent)
    return jax.lax.associative_scan(lambda x, y: x + jnp.minimum(y, extent - x), s, axis=0)


def clipped_sizes(ends):
    return jnp.diff(ends, axis=0, prepend=jnp.zeros_like(ends[:1]))


def reference(a, b, gs, *, layouts: RaggedLayouts, out_dtype, acc_dtype):
    """The grouped GEMM in plain lax ops (masks, as lax.ragged_dot's own decomposition),
    reading and writing through the layouts."""
    av, bv, sv = L.read(a, layouts.a), L.read(b, layouts.b), L.read(gs, layouts.gs)
    acc = np.dtype(acc_dtype)
    ends = group_ends(sv, layouts.ragged_extent())  # (G, L)
    starts = ends - clipped_sizes(ends)
    # mask[g, r, l]: ragged index r (row m, or reduction index k) lies in group g of batch l
    r = jnp.arange(av.shape[0 if layouts.mode == RAGGED_M else 1], dtype=jnp.int32)[None, :, None]
    mask = (starts[:, None, :] <= r) & (r < ends[:, None, :])
    if layouts.mode == RAGGED_M:
        am = jnp.where(mask[:, :, None, :], av[None], 0)  # (G, M, K, L)
        cv = jax.lax.dot_general(am, bv, (((0, 2), (2, 1)), ((3,), (3,))), preferred_element_type=acc)  # (L, M, N)
        cv = jnp.transpose(cv, (1, 2, 0))
    else:
        am = jnp.where(mask[:, None, :, :], av[None], 0)  # (G, M, K, L)
        cv = jax.lax.dot_general(am, bv, (((2,), (1,)), ((3,), (2,))), preferred_element_type=acc)  # (L, G, M, N)
        cv = jnp.transpose(cv, (2, 3, 1, 0))
    return L.write(cv.astype(out_dtype), layouts.c, layouts.c_shape)


def _cuda_lowering(ctx, a, b, gs, **params):
    impl = grouped_impl(*ctx.avals_in, **params)
    return mlir.lower_fun(impl or functools.partial(reference, **params), multiple_results=False)(ctx, a, b, gs)


# -- batching ---------------------------------------------------------------------------------

def _batch_rule(prim, args, dims, *, layouts: RaggedLayouts, out_dtype, acc_dtype):
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    new = batched(layouts, [x.shape for x in args], dims, size)
    return prim.bind(*args, layouts=new, out_dtype=out_dtype, acc_dtype=acc_dtype), 0


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


def _transpose(ct, a, b, gs, *, layouts: RaggedLayouts, out_dtype, acc_dtype):
    if ad.is_undefined_primal(gs):
        raise ValueError("jax_cute ragged_dot: group sizes are not differentiable")
    wrt = "a" if ad.is_undefined_primal(a) else "b"
    aval = (a if wrt == "a" else b).aval
    if type(ct) is ad.Zero:
        return [ad.Zero(aval), None, None] if wrt == "a" else [None, ad.Zero(aval), None]
    ct = _cotangent_dtype(ct, aval.dtype)
    cot = cotangent(layouts, wrt, aval.shape)
    bufs = {"a": a, "b": b, "c": ct}
    # Broadcast batches summed afterwards are accumulated in acc_dtype and rounded once.
    dt = np.dtype(acc_dtype if cot.extra else aval.dtype).name
    res = PRIMITIVES[cot.layouts.mode].bind(bufs[cot.operands[0]], bufs[cot.operands[1]], gs,
                                            layouts=cot.layouts, out_dtype=dt, acc_dtype=acc_dtype)
    if cot.extra:
        res = jnp.sum(res, axis=tuple(range(cot.extra))).astype(aval.dtype)
    return [res, None, None] if wrt == "a" else [None, res, None]


for _p in PRIMITIVES.values():
    _p.def_abstract_eval(_abstract_eval)
    _p.def_impl(functools.partial(_eager, _p))
    mlir.register_lowering(_p, mlir.lower_fun(reference, multiple_results=False))
    mlir.register_lowering(_p, _cuda_lowering, platform="cuda")
    batching.primitive_batchers[_p] = functools.partial(_batch_rule, _p)
    ad.primitive_jvps[_p] = functools.partial(_jvp, _p)
    ad.primitive_transposes[_p] = _transpose


# -- CUDA lowering: the grouped kernel family ---------------------------------------------------

def grouped_impl(a_aval, b_aval, gs_aval, *, layouts: RaggedLayouts, out_dtype: str,
                 acc_dtype: str) -> Callable | None:
    """An implementation built from ``kernel_call``, or None (the reference) after routing logged
    (or, in strict mode, raised) why."""
    from jax_cute.kernels.gemm_spec import GroupedSpec
    from jax_cute.primitives.gemm_route import binary_for, family_for, num_sms, trusted

    dts = [np.dtype(a_aval.dtype).name, np.dtype(b_aval.dtype).name, np.dtype(out_dtype).name]
    e = layouts.extents()
    what = f"{layouts.mode} M={e['m']} N={e['n']} K={e['k']} G={e['g']} L={e['l']}, dtypes {'/'.join(dts)}"
    if 0 in e.values():
        return None  # nothing to launch: the reference writes the zeros
    if any(d not in ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2") for d in dts):
        routing.fallback("ragged_dot", f"no grouped kernel for these dtypes ({what})")
        return None
    flat = flatten_grouped(layouts, dts)
    if isinstance(flat, str):
        routing.fallback("ragged_dot", f"{flat} ({what})")
        return None
    spec = GroupedSpec(layouts.mode, *dts, flat.a.major, flat.b.major, flat.c.major, acc_dtype)
    picked = family_for("ragged_dot", "grouped", spec, what)
    if picked is None:
        return None
    arch, fam = picked
    cfg = fam.heuristic(spec, flat.m, flat.n, flat.k, flat.g, flat.l, num_sms(arch))
    binary = binary_for(fam, arch, spec, cfg)
    workspaces = fam.workspace(spec, cfg, flat.m, flat.n, flat.k, flat.g, flat.l)
    impl = lambda a, b, gs: _launch(a, b, gs, flat, binary, workspaces, layouts, dts[2])  # noqa: E731
    ragged = e["m"] if layouts.mode == "ragged_m" else e["k"]

    def sizes(rng, shape):  # a random split of the ragged extent, some groups empty
        cuts = np.sort(rng.integers(0, ragged + 1, shape), axis=0)
        return np.diff(cuts, axis=0, prepend=0)

    ref = functools.partial(reference, layouts=layouts, out_dtype=out_dtype, acc_dtype=acc_dtype)
    if not trusted("ragged_dot", binary, impl, ref, (a_aval, b_aval, gs_aval), sizes):
        return None
    logger.info("jax_cute.ragged_dot: %s on %s (%s)", binary.name, arch, what)
    return impl


def _launch(a, b, gs, flat: FlatGrouped, binary, workspaces, layouts: RaggedLayouts, out_dtype: str):
    from jax_cute.launch import kernel_call, workspace_outputs

    b_desc = flat.b4 or (flat.b.shape, flat.b.stride)
    c_desc = flat.c4 or (flat.c.shape, flat.c.stride)
    outputs = {"c": (jax.ShapeDtypeStruct(layouts.c_shape, np.dtype(out_dtype)), *c_desc)}
    outputs.update(workspace_outputs(binary, workspaces))
    inputs = {"a": (a, flat.a.shape, flat.a.stride), "b": (b, *b_desc), "group_sizes": (gs, *flat.gs)}
    return kernel_call(binary, inputs, outputs, zeroed=[w.name for w in workspaces if w.zeroed])["c"]


# -- public API -------------------------------------------------------------------------------

def ragged_dot(lhs, rhs, group_sizes, *, precision=None, preferred_element_type=None, group_offset=None):
    """A drop-in for ``jax.lax.ragged_dot``: ``out[m] = lhs[m] @ rhs[g]`` for the rows m of group g.

    ``lhs`` is [M, K], ``rhs`` [G, K, N], ``group_sizes`` [G] integer (used as int32); the result is
    [M, N]. Groups are consecutive row ranges; rows past ``sum(group_sizes)`` are zero. Sizes are
    read on the device, so bad values are defined rather than checked: negative sizes count as
    zero and group ends are clipped at M (nothing is ever read or written out of bounds).
    ``precision`` is accepted and ignored (kernels accumulate in float32, or the input dtype
    when wider). With ``preferred_element_type=float32`` on 16-bit inputs the result is float32
    and its cotangent is rounded once to the input dtype for the gradient GEMMs.
    The cotangent of ``group_sizes`` is float0. ``group_offset`` is not supported.
    """
    del precision  # documented: accepted and ignored, as the kernels fix their own accumulation
    if group_offset is not None:
        raise NotImplementedError("jax_cute.ragged_dot: group_offset is not supported (sharded ragged_dot); "
                                  "use jax.lax.ragged_dot for it")
    lhs, rhs, group_sizes = jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes)
    desc = f"lhs {lhs.shape}:{lhs.dtype}, rhs {rhs.shape}:{rhs.dtype}, group_sizes {group_sizes.shape}:{group_sizes.dtype}"
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.ndim != 1:
        raise ValueError(f"jax_cute.ragged_dot: expected lhs [M,K], rhs [G,K,N], group_sizes [G]; got {desc}")
    for x in (lhs, rhs):
        if not (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)):
            raise TypeError(f"jax_cute.ragged_dot: unsupported operand dtype {x.dtype} ({desc})")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"jax_cute.ragged_dot: group_sizes must be integers (int32 is used); got {desc}")
    (m, k), (g, k2, n) = lhs.shape, rhs.shape
    if k != k2:
        raise ValueError(f"jax_cute.ragged_dot: contracting dimensions differ (lhs K={k}, rhs K={k2}); got {desc}")
    if group_sizes.shape[0] != g:
        raise ValueError(f"jax_cute.ragged_dot: group_sizes has {group_sizes.shape[0]} entries for {g} groups "
                         f"of rhs; got {desc}")
    dtype = jnp.result_type(lhs, rhs)
    lhs, rhs = lhs.astype(dtype), rhs.astype(dtype)
    out_dtype = np.dtype(preferred_element_type) if preferred_element_type is not None else np.dtype(dtype)
    acc = _acc_dtype(np.dtype(dtype))
    if jnp.issubdtype(out_dtype, jnp.floating) and not jnp.issubdtype(acc, jnp.floating):
        acc = np.dtype("float32")
    return ragged_m_p.bind(lhs, rhs, group_sizes.astype(jnp.int32), layouts=ragged_dot_layouts(m, k, g, n),
                           out_dtype=out_dtype.name, acc_dtype=acc.name)
