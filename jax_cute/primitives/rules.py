"""What every GEMM primitive shares: one factory, and one batching rule.

As ``jax/_src/lax``'s ``standard_primitive`` bundles a primitive's rules, ``gemm_primitive``
makes each of ours (``jax_cute_matmul``, the grouped pair, the fused and derivative epilogues):
its abstract evaluation, its eager implementation (a one-op jit, as JAX's own primitives run
outside jit), the product checkpoint policies see (``remat.py``) and the device assignment its
lowering needs (the partitioned lowering and the fused ones lower through
``custom_partitioning``). As lax's one ``_dot_batch_rule`` serves ``dot_general`` and
``ragged_dot``, ``batch_rule`` serves them all: a vmapped axis becomes an
L sub-mode of every operand the ``layouts`` parameter reads (stride 0 where unbatched), the
layouts re-targeted at the batched buffers by composition, no data moved. A primitive with
operands the layouts do not cover (a bias, a pre-activation Z) rewrites them in a hook.
``kernel_local`` and ``epilogue_local`` are their CUDA per-shard computations: the
``GemmRequest`` a call makes of ``dispatch.gemm``, its kernel where one is picked, else the
primitive's other path.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
from jax._src import dispatch as jax_dispatch  # no public API marks a primitive as needing devices
from jax.extend import core
from jax.interpreters import batching

from jax_cute.dispatch import GemmRequest, gemm, whole_split
from jax_cute.primitives import remat, sharding
from jax_cute.problem.gemm_layouts import GemmLayouts, batched_gemm
from jax_cute.problem.ragged_layouts import RaggedLayouts, batched


def gemm_primitive(name: str, abstract_eval: Callable, *, partitioned: bool = False,
                   multiple_results: bool = False) -> core.Primitive:
    """A GEMM primitive with its abstract evaluation and eager implementation; binding matches
    the operands' manual axes. ``partitioned``: its lowering goes through ``sharding.lowering``
    (``sharding.Primitive``)."""
    prim = sharding.Primitive(name) if partitioned else sharding.VaryingPrimitive(name)
    prim.multiple_results = multiple_results
    prim.def_abstract_eval(abstract_eval)
    prim.def_impl(functools.partial(eager, prim))
    # custom_partitioning needs the device assignment while lowering, which jit passes only to
    # computations holding a primitive that asks for it (the fused ones hold the GEMM's lowering)
    jax_dispatch.prim_requires_devices_during_lowering.add(prim)
    remat.register(prim)   # checkpoint policies that save dots save it
    return prim


def eager(prim: core.Primitive, *args, **params):
    """Outside jit, ``prim`` runs as a one-op jitted computation (like jax's own primitives)."""
    return jax.jit(functools.partial(prim.bind, **params))(*args)


def batch_size(args, dims) -> int:
    return next(x.shape[d] for x, d in zip(args, dims) if d is not None)


def batched_layouts(layouts: GemmLayouts | RaggedLayouts, shapes: Sequence[Sequence[int]],
                    dims: Sequence[int | None], size: int) -> GemmLayouts | RaggedLayouts:
    """``layouts`` over the operands of ``shapes`` batched at ``dims`` (a, b, and for a grouped
    GEMM the group sizes)."""
    if isinstance(layouts, GemmLayouts):
        return batched_gemm(layouts, shapes[0], shapes[1], dims[0], dims[1], size)
    return batched(layouts, shapes[:3], dims[:3], size)


# (args, dims, size, params) -> (args, dims, params): the operands past the layouts' own, batched
Hook = Callable[[list, list, int, dict], tuple[list, list, dict]]
# (args, dims, params) -> the (args, dims) the layouts read, in the layouts' operand order
Read = Callable[[list, list, dict], tuple[list, list]]


def batch_rule(prim: core.Primitive, hook: Hook | None = None, read: Read | None = None) -> None:
    """Register the batching rule of ``prim``, whose params hold ``layouts``. ``hook`` batches the
    operands the layouts do not read; ``read`` orders the operands as the layouts do (default:
    the call's order)."""
    def rule(args, dims, **params):
        size = batch_size(args, dims)
        args, dims = list(args), list(dims)
        if hook is not None:
            args, dims, params = hook(args, dims, size, dict(params))
        xs, ds = read(args, dims, params) if read is not None else (args, dims)
        params["layouts"] = batched_layouts(params["layouts"], [x.shape for x in xs], ds, size)
        out = prim.bind(*args, **params)
        return out, ([0] * len(out) if prim.multiple_results else 0)

    batching.primitive_batchers[prim] = rule


# (input avals, params) -> what the call asks of dispatch
Request = Callable[[tuple, dict], GemmRequest]


def kernel_local(request: Request, reference: Callable) -> sharding.Local:
    """The per-shard computation of a partitioned GEMM primitive (``sharding.lowering``): the
    kernel ``dispatch.gemm`` picks for ``request(avals, params)`` (leaving ``free_sms`` SMs free),
    else ``reference``. ``whole``: (avals, params) of the unsharded problem, whose split-K the
    kernel then takes (``dispatch.whole_split``), so that it adds as one device does."""
    def local(avals, params, free_sms: int = 0, whole: tuple | None = None) -> Callable:
        ref = functools.partial(reference, **params)
        split = None if whole is None else whole_split(request(tuple(whole[0]), whole[1]))
        req = dataclasses.replace(request(tuple(avals), params), free_sms=free_sms, split_k=split)
        return gemm(req, ref) or ref
    return local


def as_list(fn: Callable) -> Callable:
    """``fn`` returning its results as a list (a single array becomes a list of one)."""
    def listed(*args):
        out = fn(*args)
        return list(out) if isinstance(out, (list, tuple)) else [out]
    return listed


def epilogue_local(request: Request, reference: Callable, composed: Callable) -> Callable:
    """The one-shard computation of an epilogue primitive on CUDA (``epilogue_sharding.Local``):
    the kernel ``dispatch.gemm`` picks for ``request(avals, params)`` (checked against
    ``reference``), else ``composed``; its results as a list. ``whole``: as ``kernel_local``'s."""
    def local(avals, params, whole: tuple | None = None) -> Callable:
        req = request(tuple(avals), params)
        if whole is not None:
            req = dataclasses.replace(req, split_k=whole_split(request(tuple(whole[0]), whole[1])))
        return as_list(gemm(req, functools.partial(reference, **params)) or functools.partial(composed, **params))
    return local


def composed_local(composed: Callable) -> Callable:
    """The one-shard computation of an epilogue primitive off CUDA: ``composed``, as a list."""
    return lambda avals, params, whole=None: as_list(functools.partial(composed, **params))
