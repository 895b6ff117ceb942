"""The CUDA lowering of ``jax_cute_matmul``: a flat kernel problem, a family, a config, a binary.

Returns an implementation built from :func:`jax_cute.launch.kernel_call`, or None after the
routing has logged (or, in strict mode, raised) why the reference path is taken.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable

import jax
import numpy as np

from jax_cute import config, kernels, routing, selfcheck
from jax_cute.cache import CACHE
from jax_cute.kernels.build import compile_launcher
from jax_cute.kernels.gemm_spec import GemmSpec
from jax_cute.launch import kernel_call, workspace_outputs
from jax_cute.primitives.gemm_layouts import GemmLayouts
from jax_cute.primitives.gemm_plan import FlatGemm, flatten_gemm, materialise

logger = logging.getLogger("jax_cute")

DEFAULT_SMS = {"sm_90a": 132, "sm_100a": 148}


def num_sms(arch: str) -> int:
    """SM count of the visible device when it is the target, else the arch's usual count."""
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        devices = []
    if devices and routing.device_capability() and routing.arch_for_capability(*routing.device_capability()) == arch:
        count = getattr(devices[0], "core_count", None)
        if count:
            return int(count)
    return DEFAULT_SMS.get(arch, 132)


def select_family(kind: str, op: str):
    """(arch, family module) for the current target, or None after logging the fallback."""
    arch, why = routing.target_arch()
    if arch is None:
        routing.fallback(op, why)
        return None
    refusal = routing.arch_allowed(arch)
    if refusal:
        routing.fallback(op, refusal)
        return None
    try:
        fam = kernels.family(kind, arch)
    except ImportError as e:
        routing.fallback(op, f"the {kind} kernels for {arch} cannot be imported ({e})")
        return None
    if fam is None:
        routing.fallback(op, f"no {kind} kernel family for {arch}")
        return None
    return arch, fam


def binary_for(fam, arch: str, spec, cfg):
    """The compiled kernel for (family, spec, config, arch), through the cache."""
    fields = {"family": fam.FAMILY, "version": fam.VERSION, "arch": arch, "spec": spec.key(), "config": cfg.key()}
    name = f"{fam.FAMILY}.{spec.key()}.{cfg.key()}"
    return CACHE.get(fields, lambda: compile_launcher(fam.launcher(spec, cfg), fam.signature(spec, cfg),
                                                      arch=arch, name=name))


def family_for(op: str, kind: str, spec, what: str):
    """(arch, family) whose kernels take ``spec``, or None after the fallback was logged."""
    picked = select_family(kind, op)
    if picked is None:
        return None
    arch, fam = picked
    why = fam.unsupported(spec)
    if why:
        routing.fallback(op, f"{why} ({what})")
        return None
    return arch, fam


def launch_mode(cfg):
    """``cfg`` for the current launch mode: launched on XLA's stream (``command_buffer`` off), a
    kernel that supports it takes programmatic dependent launch, so its CTAs start under the
    previous kernel's tail and wait there. Inside a CUDA graph XLA records our call as a child
    graph, where that cannot act, so recorded launches keep ``cfg`` as it is."""
    if config.command_buffer() or "pdl" not in {f.name for f in dataclasses.fields(cfg)}:
        return cfg
    return dataclasses.replace(cfg, pdl=True)


def trusted(op: str, binary, impl: Callable, reference: Callable, avals, make_int=None) -> bool:
    """False (after the fallback was logged) when an unverified kernel fails its first-use check."""
    if selfcheck.trusted(binary, selfcheck.compare(impl, reference, avals, make_int)):
        return True
    routing.fallback(op, f"{binary.name} failed its first-use check on this device")
    return False


def matmul_impl(a_aval, b_aval, *, layouts: GemmLayouts, out_dtype: str, acc_dtype: str) -> Callable | None:
    dts = [np.dtype(a_aval.dtype).name, np.dtype(b_aval.dtype).name, np.dtype(out_dtype).name]
    ext = layouts.extents()
    if 0 in ext.values():
        return None  # nothing to launch: the reference path writes the zeros
    flat = flatten_gemm(layouts, dts)
    if isinstance(flat, str):
        routing.fallback("matmul", f"{flat} ({_describe(layouts, dts)})")
        return None
    spec = GemmSpec(dts[0], dts[1], dts[2], flat.a.major, flat.b.major, flat.c.major, acc_dtype)
    picked = family_for("matmul", "gemm", spec, _describe(layouts, dts))
    if picked is None:
        return None
    arch, fam = picked
    for operand, reason in flat.copies:
        logger.warning("jax_cute.matmul: copying operand %s into a kernel layout: %s", operand, reason)
    cfg = fam.heuristic(spec, flat.m, flat.n, flat.k, flat.l, num_sms(arch))
    if config.autotune():
        from jax_cute import autotune

        cfg = autotune.tuned_gemm_config(fam, arch, spec, flat, dts, cfg)
    cfg = launch_mode(cfg)
    binary = binary_for(fam, arch, spec, cfg)
    workspaces = fam.workspace(spec, cfg, flat.m, flat.n, flat.k, flat.l)
    impl = lambda a, b: _launch(a, b, flat, binary, workspaces, layouts, dts[2])  # noqa: E731
    from jax_cute.primitives.matmul import reference

    ref = functools.partial(reference, layouts=layouts, out_dtype=out_dtype, acc_dtype=acc_dtype)
    if not trusted("matmul", binary, impl, ref, (a_aval, b_aval)):
        return None
    logger.info("jax_cute.matmul: %s on %s (M=%d N=%d K=%d L=%d)", binary.name, arch, flat.m, flat.n, flat.k, flat.l)
    return impl


def _launch(a, b, flat: FlatGemm, binary, workspaces, layouts: GemmLayouts, out_dtype: str):
    if flat.a_src is not None:
        a = materialise(a, flat.a_src, flat.a.shape[0], flat.a.shape[1], flat.a.shape[2])
    if flat.b_src is not None:
        b = materialise(b, flat.b_src, flat.b.shape[0], flat.b.shape[1], flat.b.shape[2])
    outputs = {"c": (jax.ShapeDtypeStruct(layouts.c_shape, np.dtype(out_dtype)), flat.c.shape, flat.c.stride)}
    outputs.update(workspace_outputs(binary, workspaces))
    res = kernel_call(binary, {"a": (a, flat.a.shape, flat.a.stride), "b": (b, flat.b.shape, flat.b.stride)},
                      outputs, zeroed=[w.name for w in workspaces if w.zeroed])
    return res["c"]


def _describe(layouts: GemmLayouts, dts) -> str:
    e = layouts.extents()
    return f"M={e['m']} N={e['n']} K={e['k']} L={e['l']}, dtypes {'/'.join(dts)}"
