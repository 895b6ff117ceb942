"""Kernel or XLA: the one place that decides, for every primitive, when a call is lowered.

1. The target arch is ``config.target_arch()`` (``JAX_CUTE_TARGET_ARCH``) when set, else the
   arch of the CUDA device JAX lowers for. Lowering for CUDA on a machine with no GPU therefore
   needs the explicit arch.
2. A kernel family (``jax_cute.kernels``, contract in docs/kernel-contract.md) is picked by
   kind and arch; its ``unsupported(spec)`` may refuse the dtypes or layouts, and the flat
   problem may be refused before that (alignment, modes a kernel cannot take).
3. A refused call lowers to the primitive's reference path and logs why; in strict mode
   (``JAX_CUTE_STRICT=1``) it raises :class:`FallbackError` instead.

Each entry point returns an implementation (a function of the primitive's operands that emits
our custom call, see ``custom_call.kernel_call``) or None for the reference path. What only the
device knows (its real arch, pointer alignment) is checked by the FFI handler.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_cute import arch as arch_info
from jax_cute.activations import is_gated
from jax_cute import autotune, config, kernels, selfcheck
from jax_cute.cache import CACHE, family_binary
from jax_cute.custom_call import kernel_call, workspace_outputs
from jax_cute.kernels import abi
from jax_cute.kernels.build import KernelBinary, compile_launcher
from jax_cute.kernels.gemm_spec import GemmSpec, GroupedSpec
from jax_cute.launcher_code import launcher_digest
from jax_cute.layout import Layout
from jax_cute.problem.gemm_layouts import GemmLayouts
from jax_cute.problem.gemm_plan import FlatGemm, FlatOperand, materialise, plan_gemm, plan_with_copies
from jax_cute.problem.ragged_layouts import RAGGED_M, FlatGrouped, RaggedLayouts, flatten_grouped

logger = logging.getLogger("jax_cute")


class FallbackError(RuntimeError):
    """Strict mode: a call would have fallen back to XLA."""

    def __init__(self, op: str, reason: str):
        super().__init__(f"jax_cute.{op}: no kernel (strict mode): {reason}")
        self.op, self.reason = op, reason


def fallback(op: str, reason: str) -> None:
    """Record that ``op`` lowers to XLA, or raise in strict mode."""
    if config.strict():
        raise FallbackError(op, reason)
    logger.warning("jax_cute.%s: falling back to XLA: %s", op, reason)


def at_trace(op: str, no_kernel: str | None = None) -> None:
    """What is checked when a call is traced, on every platform alike: the configuration is
    valid, and a call that no kernel of any arch takes (``no_kernel``: why) is a fallback, so
    strict mode raises on the CPU as it would when lowering for a GPU."""
    config.validate()
    if no_kernel:
        fallback(op, no_kernel)


def target_arch() -> tuple[str | None, str]:
    """(arch, how it was chosen); arch None when there is nothing to compile for."""
    explicit = config.target_arch()
    if explicit:
        return explicit, "explicit"
    cc = arch_info.device_capability()
    if cc is None:
        return None, "no CUDA device is visible; set JAX_CUTE_TARGET_ARCH (e.g. sm_90a) to lower for one"
    arch = arch_info.arch_for_capability(*cc)
    if arch is None:
        return None, f"compute capability {cc[0]}.{cc[1]} has no jax_cute kernels"
    return arch, f"device compute capability {cc[0]}.{cc[1]}"


def arch_allowed(arch: str) -> str | None:
    """None, or why kernels for ``arch`` may not be used."""
    if arch in arch_info.UNVERIFIED_ARCHES and not config.unverified_kernels():
        return (f"{arch} kernels are compile-verified only (never run on hardware); "
                "set JAX_CUTE_UNVERIFIED_KERNELS=1 to use them")
    return None


def _family(op: str, kind: str, spec, what: str):
    """(arch, family) whose kernels take ``spec``, or None after the fallback was logged."""
    arch, why = target_arch()
    if arch is None:
        fallback(op, why)
        return None
    refusal = arch_allowed(arch)
    if refusal:
        fallback(op, refusal)
        return None
    try:
        fam = kernels.family(kind, arch)
    except ImportError as e:
        fallback(op, f"the {kind} kernels for {arch} cannot be imported ({e})")
        return None
    if fam is None:
        fallback(op, f"no {kind} kernel family for {arch}")
        return None
    why = fam.unsupported(spec)
    if why:
        fallback(op, f"{why} ({what})")
        return None
    return arch, fam


def launch_mode(cfg):
    """``cfg`` for the current launch mode. Launched on XLA's stream (``command_buffer`` off), a
    kernel that supports it takes programmatic dependent launch, so its CTAs start under the
    previous kernel's tail and wait there. Inside a CUDA graph XLA records our call as a child
    graph, where that cannot act, so recorded launches keep ``cfg`` as it is."""
    if config.command_buffer() or "pdl" not in {f.name for f in dataclasses.fields(cfg)}:
        return cfg
    return dataclasses.replace(cfg, pdl=True)


def _trusted(op: str, binary: KernelBinary, impl: Callable, reference: Callable, avals, make_int=None) -> bool:
    """False (after the fallback was logged) when an unverified kernel fails its first-use check."""
    if selfcheck.trusted(binary, selfcheck.compare(impl, reference, avals, make_int)):
        return True
    fallback(op, f"{binary.name} failed its first-use check on this device")
    return False


# Kernels count extents and tiles in 32 bits: descriptor shapes are int32, tile counts and
# indices Int32, and rounding an extent up to whole tiles adds up to a tile, hence the margin.
MAX_EXTENT = 2**31 - 2**16
MAX_TILES = 2**31 - 1
RAGGED_EXTENT = 2**30   # a grouped launch's ragged mode (kernels/sm90_gemm.py's notes)
_SMALLEST_TILE = 64


def int32_refusal(m: int, n: int, k: int, l: int, g: int | None = None, ragged: str | None = None) -> str | None:
    """Why a problem of these extents is past the kernels' 32-bit arithmetic, or None.
    Grouped problems give ``g`` and their ragged mode (``"M"`` or ``"K"``)."""
    named = {"M": m, "N": n, "K": k, "L": l, **({} if g is None else {"G": g})}
    for name, v in named.items():
        if v > MAX_EXTENT:
            return f"{name}={v} is past the kernels' int32 extents (at most {MAX_EXTENT})"
    if ragged is not None and named[ragged] > RAGGED_EXTENT:
        return (f"{ragged}={named[ragged]} is past the grouped kernels' TMA extent for one group "
                f"({RAGGED_EXTENT} rows)")
    mt, nt = -(-m // _SMALLEST_TILE), -(-n // _SMALLEST_TILE)
    tiles = mt * nt * l if g is None else ((mt + g) * nt * l if ragged == "M" else g * mt * nt * l)
    if tiles > MAX_TILES:
        return f"{tiles} output tiles of {_SMALLEST_TILE}x{_SMALLEST_TILE} are past the kernels' int32 tile count"
    return None


def _zeroed(workspaces) -> list[str]:
    return [w.name for w in workspaces if w.zeroed]


# -- dense GEMM (jax_cute_matmul) ---------------------------------------------------------------

def gemm(a_aval, b_aval, *, layouts: GemmLayouts, out_dtype: str, acc_dtype: str, reference: Callable,
         precision=None) -> Callable | None:
    """The kernel implementation of a ``jax_cute_matmul``, or None for ``reference``.

    ``precision`` only matters where XLA computes: the kernels take 16- and 8-bit inputs, whose
    products are exact, and accumulate in float32."""
    dts = [np.dtype(a_aval.dtype).name, np.dtype(b_aval.dtype).name, np.dtype(out_dtype).name]
    ext = layouts.extents()
    what = f"M={ext['m']} N={ext['n']} K={ext['k']} L={ext['l']}, dtypes {'/'.join(dts)}"
    if 0 in ext.values():
        return None  # nothing to launch: the reference path writes the zeros
    # Unaligned strides are met by padding buffers (XLA fuses such a pad, or the output's slice,
    # into the neighbouring op where it can): cheaper than a transposing copy or the fallback.
    flat, shapes, given, rewrite = plan_with_copies(
        layouts, [tuple(a_aval.shape), tuple(b_aval.shape), tuple(layouts.c_shape)], dts)
    if rewrite is not None:
        logger.warning("jax_cute.matmul: %swriting the output through one copy into its layout: %s (%s)",
                       "copying operands a and b into row-major buffers and " if rewrite.copy_operands else "",
                       rewrite.why, what)
    if isinstance(flat, str):
        fallback("matmul", f"{flat} ({what})")
        return None
    too_large = int32_refusal(flat.m, flat.n, flat.k, flat.l)
    if too_large:
        fallback("matmul", f"{too_large} ({what})")
        return None
    spec = GemmSpec(dts[0], dts[1], dts[2], flat.a.major, flat.b.major, flat.c.major, acc_dtype,
                    batch_modes=flat.batch_modes)
    picked = _family("matmul", "gemm", spec, what)
    if picked is None:
        return None
    arch, fam = picked
    if spec.batch_modes not in getattr(fam, "BATCH_MODES", (1,)):
        fallback("matmul", f"the batch modes do not coalesce into one, and the {fam.FAMILY} kernels take "
                           f"one ({what})")
        return None
    _log_copies(flat, given, shapes)
    cfg = fam.heuristic(spec, flat.m, flat.n, flat.k, flat.l, arch_info.num_sms(arch))
    if config.autotune():
        cfg = autotune.tuned_gemm_config(fam, arch, spec, flat, dts, cfg)
    binary, launch = _gemm_launcher(fam, arch, spec, cfg, flat, shapes, given[2])

    def impl(a, b):
        if rewrite is not None:
            return rewrite.run(lambda x, y: launch(x, y)[0], a, b)
        return launch(a, b)[0]

    if not _trusted("matmul", binary, impl, reference, (a_aval, b_aval)):
        return None
    logger.info("jax_cute.matmul: %s on %s (%s)", binary.name, arch, what)
    return impl


def _log_copies(flat: FlatGemm, given, shapes) -> None:
    """Log what a plan moves besides the kernel's own reads: padded buffers and copied operands."""
    for name, old, new in zip("abc", given, shapes):
        if old != new:
            logger.warning("jax_cute.matmul: padding %s from %s to %s (16-byte TMA strides)", name, old, new)
    for operand, reason in flat.copies:
        logger.warning("jax_cute.matmul: copying operand %s into a kernel layout: %s", operand, reason)


def _pad_to(x, shape):
    return x if x.shape == tuple(shape) else jnp.pad(x, [(0, n - m) for m, n in zip(x.shape, shape)])


def _gemm_launcher(fam, arch: str, spec, cfg, flat: FlatGemm, shapes, c_shape,
                   outs: tuple[str, ...] = ("c",), glu_c: FlatOperand | None = None
                   ) -> tuple[KernelBinary, Callable]:
    """(binary, ``launch(a, b, extra=None) -> [c, ...]``): the compiled kernel for ``cfg`` launched
    on the plan's (padded, or copied) operands, with ``extra`` inputs (name -> (array, shape,
    stride)), and its outputs ``outs`` (each laid out like c) sliced back to ``c_shape`` where the
    plan padded them. ``glu_c``: c is a gated activation's output instead, laid out so (half of
    N's columns, c's buffer with its last axis halved; never padded)."""
    binary = family_binary(fam, arch, spec, launch_mode(cfg))
    workspaces = fam.workspace(spec, cfg, flat.m, flat.n, flat.k, flat.l)
    padded_c = tuple(shapes[2]) != tuple(c_shape)
    layout_of = {name: (tuple(shapes[2]), flat.c) for name in outs}
    if glu_c is not None:
        layout_of["c"] = (tuple(shapes[2][:-1]) + (shapes[2][-1] // 2,), glu_c)

    def launch(a, b, extra=None):
        a, b = _pad_to(a, shapes[0]), _pad_to(b, shapes[1])
        if flat.a_src is not None:
            a = materialise(a, flat.a_src, flat.a)
        if flat.b_src is not None:
            b = materialise(b, flat.b_src, flat.b)
        outputs = {name: (jax.ShapeDtypeStruct(shape, np.dtype(spec.c_dtype)), op.shape, op.stride)
                   for name, (shape, op) in layout_of.items()}
        outputs.update(workspace_outputs(binary, workspaces))
        inputs = {"a": (a, flat.a.shape, flat.a.stride), "b": (b, flat.b.shape, flat.b.stride), **(extra or {})}
        got = kernel_call(binary, inputs, outputs, zeroed=_zeroed(workspaces))
        return [got[name][tuple(slice(0, n) for n in c_shape)] if padded_c else got[name] for name in outs]

    return binary, launch


# -- dense GEMM with a fused epilogue (jax_cute_matmul_fused) ---------------------------------------

def _epilogue_in_xla(reason: str, what: str, op: str = "matmul") -> None:
    logger.info("jax_cute.%s: the GEMM kernel runs with its epilogue in XLA: %s (%s)", op, reason, what)


def _epilogue_what(dims: str, dts, bias: bool, activation) -> str:
    return f"{dims}, dtypes {'/'.join(dts)}, bias {'yes' if bias else 'no'}, activation {activation}"


def _epilogue_family(kind: str, bias: bool, activation: str | None, two_outputs: bool, dact: bool = False):
    """The target's ``kind`` family if it fuses this epilogue (its ``EPILOGUES``; ``dact``: the
    activation's derivative), else why not."""
    arch, _ = target_arch()
    try:
        fam = kernels.family(kind, arch) if arch else None
    except ImportError:
        fam = None
    fusable = getattr(fam, "EPILOGUES", ())
    if fam is None or (activation and activation not in fusable) or (bias and "bias" not in fusable) \
            or (two_outputs and "preact" not in fusable) or (dact and "dact" not in fusable):
        return (f"{getattr(fam, 'FAMILY', 'no kernel family')} does not fuse {'bias and ' if bias else ''}"
                f"{activation or 'no activation'}{' with the pre-activation output' if two_outputs else ''}"
                f"{' derivative' if dact else ''}")
    return fam


def _epilogue_plan(a_aval, b_aval, layouts: GemmLayouts, dts, what: str, **family):
    """(family, flat problem, buffer shapes, given shapes) of a dense GEMM with a fused epilogue, or None
    after logging why the epilogue runs in XLA: the family fuses no such epilogue
    (``_epilogue_family``'s ``family`` arguments), or no kernel layout exists."""
    fam = _epilogue_family("gemm", **family)
    if isinstance(fam, str):
        _epilogue_in_xla(fam, what)
        return None
    given = [tuple(a_aval.shape), tuple(b_aval.shape), tuple(layouts.c_shape)]
    flat, shapes = plan_gemm(layouts, given, dts)
    if isinstance(flat, str):
        _epilogue_in_xla(flat, what)
        return None
    too_large = int32_refusal(flat.m, flat.n, flat.k, flat.l)
    if too_large:
        _epilogue_in_xla(too_large, what)  # (the plain GEMM then falls back, logged)
        return None
    return fam, flat, shapes, given


def _bias_per_column(bias_aval, bias_layout, n: int) -> bool:
    """Whether the bias is one (N,) row broadcast over M and every batch: what kernels read."""
    if bias_aval is None:
        return True
    rows, cols, batch = bias_layout.modes()
    return (int(np.prod(bias_aval.shape)) == n and cols.coalesce().flat_modes() in (((n, 1),), ((1, 0),))
            and all(d == 0 for _, d in rows.flat_modes() + batch.flat_modes()))


def _gated_output(flat: FlatGemm | FlatGrouped, c_buffer, c_shape, columns: int) -> FlatOperand | str:
    """A gated activation's output as the kernel writes it (N/2 columns of an N-major C whose
    every other stride counts whole rows of N), or why the kernel cannot write it."""
    c = flat.c
    if c.major != "n" or tuple(c_buffer) != tuple(c_shape):
        return "a gated output needs an unpadded C contiguous along N"
    if c.batch_modes > 1:
        return "a gated output takes one batch mode (the paired N spends three TMA dimensions)"
    if (flat.n // 2) % columns:
        return f"kernels pair gate and up columns in blocks of {columns}: N/2 = {flat.n // 2} is not a multiple"
    if any(s % flat.n for i, (e, s) in enumerate(zip(c.shape, c.stride)) if i != 1 and e > 1):
        return "C's row strides are not whole multiples of N"
    # (an extent-1 mode's stride is never used; N/2 keeps it aligned)
    stride = tuple(1 if i == 1 else (s // 2 if s % flat.n == 0 else flat.n // 2) for i, s in enumerate(c.stride))
    return FlatOperand((c.shape[0], flat.n // 2, *c.shape[2:]), stride, "n")


def fused_gemm(a_aval, b_aval, *bias_aval, layouts: GemmLayouts, bias_layout, activation: str | None,
               preact: bool, out_dtype: str, acc_dtype: str, reference: Callable, precision=None
               ) -> Callable | None:
    """The kernel implementation of a ``jax_cute_matmul_fused`` (bias and activation in the
    kernel's epilogue), or None: the caller then runs the GEMM kernel with a float32 output and
    the epilogue in XLA (logged at INFO here, with the reason).

    A family fuses what its ``EPILOGUES`` names ("bias", activation names, and "preact": a
    differentiated forward's second output, the pre-activation). Kernels read a bias of one row
    (N,) in float32; a gated activation (swiglu) writes N/2 columns (``_gated_output``). The
    heuristic config is used (autotune times plain GEMMs only)."""
    dts = [np.dtype(a_aval.dtype).name, np.dtype(b_aval.dtype).name, np.dtype(out_dtype).name]
    ext = layouts.extents()
    what = _epilogue_what(f"M={ext['m']} N={ext['n']} K={ext['k']} L={ext['l']}", dts, bool(bias_aval), activation)
    if 0 in ext.values():
        return None
    bias = bias_aval[0] if bias_aval else None
    if not _bias_per_column(bias, bias_layout, ext["n"]):
        _epilogue_in_xla("kernels read a bias of shape (N,) broadcast over rows and batches", what)
        return None
    # without an activation the pre-activation is the output itself
    two_outputs = preact and bool(activation)
    planned = _epilogue_plan(a_aval, b_aval, layouts, dts, what, bias=bias is not None, activation=activation,
                             two_outputs=two_outputs)
    if planned is None:
        return None
    fam, flat, shapes, given = planned
    if flat.n != ext["n"]:
        _epilogue_in_xla("a batch mode folds into N, so output columns no longer index the bias", what)
        return None
    glu_c = None
    if is_gated(activation):
        glu_c = _gated_output(flat, shapes[2], layouts.c_shape, fam.GATED_COLUMNS)
        if isinstance(glu_c, str):
            _epilogue_in_xla(glu_c, what)
            return None
    spec = GemmSpec(dts[0], dts[1], dts[2], flat.a.major, flat.b.major, flat.c.major, acc_dtype,
                    batch_modes=flat.batch_modes, bias=bias is not None, activation=activation or "",
                    preact=two_outputs)
    picked = _family("matmul", "gemm", spec, what)
    if picked is None:
        return None
    arch, fam = picked
    if spec.batch_modes not in getattr(fam, "BATCH_MODES", (1,)):
        _epilogue_in_xla(f"the batch modes do not coalesce into one, and the {fam.FAMILY} kernels take one", what)
        return None
    _log_copies(flat, given, shapes)
    cfg = fam.heuristic(spec, flat.m, flat.n, flat.k, flat.l, arch_info.num_sms(arch))
    binary, launch = _gemm_launcher(fam, arch, spec, cfg, flat, shapes, layouts.c_shape,
                                    ("c", "d") if two_outputs else ("c",), glu_c)

    def impl(a, b, *bias_buf):
        extra = {"bias": (jnp.reshape(bias_buf[0], (-1,)).astype(jnp.float32), (ext["n"],), (1,))} if bias_buf else None
        outs = launch(a, b, extra)
        return outs * 2 if preact and not two_outputs else outs

    if not _trusted("matmul", binary, impl, reference, (a_aval, b_aval, *bias_aval)):
        return None
    logger.info("jax_cute.matmul: %s on %s (%s)", binary.name, arch, what)
    return impl


# -- dense GEMM times an activation's derivative (jax_cute_matmul_dact) -----------------------------

def _same_layout(x: Layout, y: Layout) -> bool:
    return all(x.mode(i).coalesce().flat_modes() == y.mode(i).coalesce().flat_modes() for i in range(3))


def dact_gemm(a_aval, b_aval, z_aval, *, layouts: GemmLayouts, z_layout: Layout, activation: str, out_dtype: str,
              acc_dtype: str, reference: Callable, precision=None) -> Callable | None:
    """The kernel implementation of a ``jax_cute_matmul_dact`` (``act'(Z) * (A·B)``, Z read by the
    epilogue), or None: the caller then runs the GEMM kernel with a float32 output and the
    multiply in XLA (logged at INFO here, with the reason).

    The kernel reads Z exactly as it writes C: Z must be a buffer of C's shape and dtype, laid
    out like C, and C must need no padding."""
    dts = [np.dtype(a_aval.dtype).name, np.dtype(b_aval.dtype).name, np.dtype(out_dtype).name]
    ext = layouts.extents()
    what = f"M={ext['m']} N={ext['n']} K={ext['k']} L={ext['l']}, dtypes {'/'.join(dts)}, {activation} derivative"
    if 0 in ext.values():
        return None
    if np.dtype(z_aval.dtype) != np.dtype(out_dtype) or tuple(z_aval.shape) != tuple(layouts.c_shape) \
            or not _same_layout(z_layout, layouts.c):
        _epilogue_in_xla("kernels read the pre-activation laid out as the output, in its dtype", what)
        return None
    planned = _epilogue_plan(a_aval, b_aval, layouts, dts, what, bias=False, activation=None, two_outputs=False,
                             dact=True)
    if planned is None:
        return None
    _, flat, shapes, given = planned
    if tuple(shapes[2]) != tuple(layouts.c_shape) or flat.batch_modes != 1:
        _epilogue_in_xla("the output needs padding or more than one batch mode", what)
        return None
    spec = GemmSpec(dts[0], dts[1], dts[2], flat.a.major, flat.b.major, flat.c.major, acc_dtype, dact=activation)
    picked = _family("matmul", "gemm", spec, what)
    if picked is None:
        return None
    arch, fam = picked
    _log_copies(flat, given, shapes)
    cfg = fam.heuristic(spec, flat.m, flat.n, flat.k, flat.l, arch_info.num_sms(arch))
    binary, launch = _gemm_launcher(fam, arch, spec, cfg, flat, shapes, layouts.c_shape)

    def impl(a, b, z):
        return launch(a, b, {"z": (z, flat.c.shape, flat.c.stride)})[0]

    if not _trusted("matmul", binary, impl, reference, (a_aval, b_aval, z_aval)):
        return None
    logger.info("jax_cute.matmul: %s on %s (%s)", binary.name, arch, what)
    return impl


# -- grouped GEMM (jax_cute_ragged_m / jax_cute_ragged_k) ----------------------------------------

def grouped(a_aval, b_aval, gs_aval, *, layouts: RaggedLayouts, out_dtype: str, acc_dtype: str,
            reference: Callable, precision=None) -> Callable | None:
    """The kernel implementation of a grouped GEMM primitive, or None for ``reference``
    (``precision`` only matters there, as for ``gemm``)."""
    dts = [np.dtype(a_aval.dtype).name, np.dtype(b_aval.dtype).name, np.dtype(out_dtype).name]
    e = layouts.extents()
    what = f"{layouts.mode} M={e['m']} N={e['n']} K={e['k']} G={e['g']} L={e['l']}, dtypes {'/'.join(dts)}"
    if 0 in e.values():
        return None  # nothing to launch: the reference writes the zeros
    flat = flatten_grouped(layouts, dts)
    if isinstance(flat, str):
        fallback("ragged_dot", f"{flat} ({what})")
        return None
    too_large = _grouped_int32_refusal(flat, layouts.mode)
    if too_large:
        fallback("ragged_dot", f"{too_large} ({what})")
        return None
    picked = _grouped_kernel(GroupedSpec(layouts.mode, *dts, flat.a.major, flat.b.major, flat.c.major, acc_dtype),
                             flat, what)
    if picked is None:
        return None
    arch, binary, workspaces = picked

    def impl(a, b, gs):
        return _launch_grouped(a, b, gs, flat, binary, workspaces, {"c": (layouts.c_shape, None)}, dts[2])[0]

    sizes = _group_split(e["m"] if layouts.mode == RAGGED_M else e["k"])
    if not _trusted("ragged_dot", binary, impl, reference, (a_aval, b_aval, gs_aval), sizes):
        return None
    logger.info("jax_cute.ragged_dot: %s on %s (%s)", binary.name, arch, what)
    return impl


def _grouped_int32_refusal(flat: FlatGrouped, mode: str) -> str | None:
    return int32_refusal(flat.m, flat.n, flat.k, flat.l, flat.g, "M" if mode == RAGGED_M else "K")


def _grouped_kernel(spec: GroupedSpec, flat: FlatGrouped, what: str):
    """(arch, binary, workspaces) of the grouped family's heuristic kernel for ``spec``, or None
    (the family refused it, logged)."""
    picked = _family("ragged_dot", "grouped", spec, what)
    if picked is None:
        return None
    arch, fam = picked
    cfg = fam.heuristic(spec, flat.m, flat.n, flat.k, flat.g, flat.l, arch_info.num_sms(arch))
    return arch, family_binary(fam, arch, spec, cfg), fam.workspace(spec, cfg, flat.m, flat.n, flat.k, flat.g, flat.l)


def _group_split(extent: int) -> Callable:
    """Group sizes for a first-use check: a random split of the ragged ``extent``, some groups empty."""
    def sizes(rng, shape):
        cuts = np.sort(rng.integers(0, extent + 1, shape), axis=0)
        return np.diff(cuts, axis=0, prepend=0)
    return sizes


def _launch_grouped(a, b, gs, flat: FlatGrouped, binary: KernelBinary, workspaces, outs, out_dtype: str,
                    extra=None) -> list:
    """The grouped kernel's outputs ``outs`` (name -> (buffer shape, FlatOperand, or None for
    c's own layout)), with ``extra`` inputs (name -> (array, shape, stride))."""
    b_desc = flat.b4 or (flat.b.shape, flat.b.stride)
    c_desc = flat.c4 or (flat.c.shape, flat.c.stride)
    outputs = {name: (jax.ShapeDtypeStruct(shape, np.dtype(out_dtype)),
                      *(c_desc if op is None else (op.shape, op.stride))) for name, (shape, op) in outs.items()}
    outputs.update(workspace_outputs(binary, workspaces))
    inputs = {"a": (a, flat.a.shape, flat.a.stride), "b": (b, *b_desc), "group_sizes": (gs, *flat.gs), **(extra or {})}
    got = kernel_call(binary, inputs, outputs, zeroed=_zeroed(workspaces))
    return [got[name] for name in outs]


def grouped_fused(a_aval, b_aval, gs_aval, *bias_aval, layouts: RaggedLayouts, activation: str | None,
                  preact: bool, out_dtype: str, acc_dtype: str, reference: Callable, precision=None
                  ) -> Callable | None:
    """The kernel implementation of a ``jax_cute_ragged_fused`` (``ragged_dot`` with a per-group
    bias (G, N) and an activation in the grouped kernel's epilogue), or None: the caller then
    runs the grouped kernel with a float32 output and the epilogue in XLA (logged here, with the
    reason)."""
    dts = [np.dtype(a_aval.dtype).name, np.dtype(b_aval.dtype).name, np.dtype(out_dtype).name]
    e = layouts.extents()
    if 0 in e.values():
        return None
    what = _epilogue_what(f"{layouts.mode} M={e['m']} N={e['n']} K={e['k']} G={e['g']} L={e['l']}", dts,
                          bool(bias_aval), activation)
    two_outputs = preact and bool(activation)
    fam = _epilogue_family("grouped", bool(bias_aval), activation, two_outputs)
    if isinstance(fam, str):
        _epilogue_in_xla(fam, what, "ragged_dot")
        return None
    flat = flatten_grouped(layouts, dts)
    if isinstance(flat, str):
        _epilogue_in_xla(flat, what, "ragged_dot")
        return None
    too_large = _grouped_int32_refusal(flat, layouts.mode)
    if too_large:
        _epilogue_in_xla(too_large, what, "ragged_dot")
        return None
    if layouts.mode != RAGGED_M:
        _epilogue_in_xla("kernels fuse the epilogue of a ragged_m product", what, "ragged_dot")
        return None
    c_shape = tuple(layouts.c_shape)
    if flat.l != 1 and is_gated(activation):
        _epilogue_in_xla("a gated activation takes one batch of groups (the paired N spends three TMA "
                         "dimensions)", what, "ragged_dot")
        return None
    bias_batches = 1   # the kernel's bias (N, G, L or 1): one per batch, or one for all
    if bias_aval:
        lead = tuple(bias_aval[0].shape[:-2])
        if any(x != 1 for x in lead):
            if lead != c_shape[:-2] or math.prod(lead) != flat.l:
                _epilogue_in_xla("a bias shared by some vmapped axes but not all", what, "ragged_dot")
                return None
            bias_batches = flat.l
    outs = {"c": (c_shape, None)}
    if is_gated(activation):
        glu_c = _gated_output(flat, c_shape, c_shape, fam.GATED_COLUMNS)
        if isinstance(glu_c, str):
            _epilogue_in_xla(glu_c, what, "ragged_dot")
            return None
        outs = {"c": (c_shape[:-1] + (c_shape[-1] // 2,), glu_c)}
    if two_outputs:
        outs["d"] = (c_shape, None)
    spec = GroupedSpec(layouts.mode, *dts, flat.a.major, flat.b.major, flat.c.major, acc_dtype,
                       bias=bool(bias_aval), activation=activation or "", preact=two_outputs)
    picked = _grouped_kernel(spec, flat, what)
    if picked is None:
        return None
    arch, binary, workspaces = picked

    def impl(a, b, gs, *bias_buf):
        # bias (..., G, N) row-major, read as (N, G, L or 1)
        extra = {"bias": (bias_buf[0].astype(jnp.float32), (e["n"], e["g"], bias_batches),
                          (1, e["n"], e["g"] * e["n"]))} if bias_buf else None
        got = _launch_grouped(a, b, gs, flat, binary, workspaces, outs, dts[2], extra)
        return got * 2 if preact and not two_outputs else got

    if not _trusted("ragged_dot", binary, impl, reference, (a_aval, b_aval, gs_aval, *bias_aval),
                    _group_split(e["m"])):
        return None
    logger.info("jax_cute.ragged_dot: %s on %s (%s)", binary.name, arch, what)
    return impl


# -- user kernels (jax_cute_call) ----------------------------------------------------------------

def user_kernel(name: str, identity: str, launcher: Callable, signature: abi.Signature,
                has_reference: bool) -> KernelBinary | None:
    """The compiled user launcher for the current target, or None (reference path, logged).

    A kernel with no reference has nowhere to fall back to: for it, no target is an error.
    """
    arch, why = target_arch()
    if arch is None:
        if not has_reference:
            raise RuntimeError(f"jax_cute.cute_call({name}): {why}")
        fallback("cute_call", f"{name}: {why}")
        return None
    # Keyed on the code the launcher compiles (its source and the kernels it calls). What cannot
    # be keyed stays in memory only, unless the user vouched for it with key= ("#key=" identity).
    code, why = launcher_digest(launcher)
    on_disk = code is not None or "#key=" in identity
    if not on_disk:
        logger.warning("jax_cute.cute_call(%s): compiled kernels are kept in memory only, not on disk: %s "
                       "(pass key='...' to cache it, changing the key whenever the kernel changes)", name, why)
    fields = {"family": "user", "identity": identity, "code": code, "arch": arch,
              "signature": abi.signature_to_json(signature)}
    return CACHE.get(fields, lambda: compile_launcher(launcher, signature, arch=arch, name=name), disk=on_disk)
