"""Kernel or XLA: the one place that decides, for every primitive, when a call is lowered.

1. The target arch is ``config.target_arch()`` (``JAX_CUTE_TARGET_ARCH``) when set, else the
   arch of the CUDA device JAX lowers for. Lowering for CUDA on a machine with no GPU therefore
   needs the explicit arch.
2. A kernel family (``jax_cute.kernels``, contract in docs/kernel-contract.md) is picked by
   kind and arch; its ``unsupported(spec)`` may refuse the dtypes or layouts, and the flat
   problem may be refused before that (alignment, modes a kernel cannot take).
3. A refused call lowers to the primitive's reference path and logs why; in strict mode
   (``JAX_CUTE_STRICT=1``) it raises :class:`FallbackError` instead.

Every GEMM primitive asks through one entry, ``gemm``, with one request type (``GemmRequest``:
dense or grouped, plain, fused or derivative are its fields); ``user_kernel`` serves
``cute_call``. Each returns an implementation (a function of the primitive's operands that
emits our custom call, see ``custom_call.kernel_call``) or None for the reference path. What
only the device knows (its real arch, pointer alignment) is checked by the FFI handler.
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
from jax_cute import autotune, config, kernels, selfcheck
from jax_cute.activations import is_gated
from jax_cute.cache import CACHE, family_binary
from jax_cute.custom_call import kernel_call, workspace_outputs
from jax_cute.kernels import abi
from jax_cute.kernels.build import KernelBinary, compile_launcher
from jax_cute.kernels.gemm_spec import GemmSpec, GroupedSpec, algorithm_refusal, gated_output, int32_refusal
from jax_cute.launcher_code import launcher_digest
from jax_cute.layout import Layout
from jax_cute.problem.gemm_layouts import GemmLayouts
from jax_cute.problem.plan import Plan, plan, prepare
from jax_cute.problem.ragged_layouts import RAGGED_M, FlatGrouped, RaggedLayouts

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


def variant_allowed(arch: str, variant: str) -> str | None:
    """None, or why the kernel ``variant`` (a family's ``unverified(spec)``) may not be used on ``arch``."""
    if variant and arch_info.unverified(arch, variant) and not config.unverified_kernels():
        return (f"the {arch} {variant} kernel is compile-verified only (not yet run on hardware); "
                "set JAX_CUTE_UNVERIFIED_KERNELS=1 (or jax_cute.config.set(unverified_kernels=True)) to use it")
    return None


@dataclasses.dataclass(frozen=True)
class _Target:
    """The arch a call lowers for and its family of ``kind`` (looked up once per call)."""

    kind: str
    arch: str | None
    why: str                          # how the arch was chosen, or why there is none
    family: object | None = None      # the family module, where one was imported
    import_error: ImportError | None = None

    def refusal(self) -> str | None:
        """Why no family of this target may run a kernel, or None."""
        if self.arch is None:
            return self.why
        refusal = arch_allowed(self.arch)
        if refusal:
            return refusal
        if self.import_error is not None:
            return f"the {self.kind} kernels for {self.arch} cannot be imported ({self.import_error})"
        if self.family is None:
            return f"no {self.kind} kernel family for {self.arch}"
        return None


def _target(kind: str, epilogue: bool) -> _Target:
    """The target of a call of ``kind``; its family is imported only where the arch may be
    used, or where an epilogue asks what the family fuses."""
    arch, why = target_arch()
    if arch is None or (arch_allowed(arch) and not epilogue):
        return _Target(kind, arch, why)
    try:
        return _Target(kind, arch, why, kernels.family(kind, arch))
    except ImportError as e:
        return _Target(kind, arch, why, None, e)


def launch_mode(cfg):
    """``cfg`` for the current launch mode. Launched on XLA's stream (``command_buffer`` off), a
    kernel that supports it takes programmatic dependent launch, so its CTAs start under the
    previous kernel's tail and wait there. Inside a CUDA graph XLA records our call as a child
    graph, where that cannot act, so recorded launches keep ``cfg`` as it is."""
    if config.command_buffer() or "pdl" not in {f.name for f in dataclasses.fields(cfg)}:
        return cfg
    return dataclasses.replace(cfg, pdl=True)


def _sm_budget(req: GemmRequest, arch: str) -> int:
    """SMs the request's kernel may fill: the device's (its arch's usual count without one), less
    those it leaves free."""
    total = arch_info.num_sms(arch)
    if not 0 <= req.free_sms < total:
        raise ValueError(f"jax_cute.{req.op}: leaving {req.free_sms} of the {total} SMs of {arch} free leaves "
                         "none for the kernel (config ring_sms, JAX_CUTE_RING_SMS)")
    return total - req.free_sms


def _on_sms(cfg, sms: int):
    """``cfg`` with its persistent grid on ``sms`` SMs, for a family whose configs carry the count
    (``sms``); others keep ``cfg`` (their grids are sized by the kernel)."""
    if "sms" not in {f.name for f in dataclasses.fields(cfg)} or cfg.sms == sms:
        return cfg
    return dataclasses.replace(cfg, sms=sms)


def _trusted(op: str, binary: KernelBinary, impl: Callable, reference: Callable, avals, make_int=None,
             variant: str = "") -> bool:
    """False (after the fallback was logged) when an unverified kernel fails its first-use check."""
    if selfcheck.trusted(binary, selfcheck.compare(impl, reference, avals, make_int), variant=variant):
        return True
    fallback(op, f"{binary.name} failed its first-use check on this device")
    return False


def _zeroed(workspaces) -> list[str]:
    return [w.name for w in workspaces if w.zeroed]


# -- the GEMM request and its one path ------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GemmRequest:
    """One GEMM a primitive asks a kernel for, when lowered: its operands (avals, in the
    primitive's order: a, b, then the group sizes of a grouped GEMM, then a bias or Z), their
    layouts (dense ``GemmLayouts`` or grouped ``RaggedLayouts``), the output and accumulator
    dtypes, and the epilogue. Dense, grouped, fused and derivative are fields, not paths.

    ``epilogue``: the call is an epilogue primitive's, which falls back to the GEMM kernel with
    the epilogue in XLA (logged at INFO) where no fused kernel takes it, rather than to the
    reference. With it: ``bias`` (the last operand; dense: read through ``bias_layout`` at C's
    coordinates, grouped: (..., G, N)), ``activation``, ``preact`` (the pre-activation output
    too: two outputs with an activation, the one output twice without), or ``dact`` (an
    activation whose derivative at Z, the last operand read through ``z_layout``, scales the
    product). ``precision``: a dot algorithm the kernels do not compute is refused.

    ``free_sms``: SMs the kernel leaves free for work running beside it (a collective ring's
    transfers, ``primitives/collective.py``): the heuristic ranks configs on the rest, and a
    family whose configs carry the persistent grid's SM count (``sms``) caps the grid there.
    ``split_k``: the number of K splits the kernel takes, where its family splits K (the order in
    which each output element's float32 partial sums are added depends on the split and K
    alone): one shard of a partitioned product asks for the split of the whole problem
    (``whole_split``), so it adds as one device does; None: the heuristic's pick.
    ``scales``: a block-scaled fp8 product's (a_block, b_block), rows of A and of B per float32
    scale (docs/fp8.md). Its operands are a, b (then the group sizes), sa, sb (then the bias): sa
    (L, Kb, ceil(M/a_block)) and sb (L or G, Kb, ceil(N/b_block)), each contiguous along its row
    blocks, their count padded to a multiple of 4 (``gemm_spec.SCALE_ROWS``). Its layouts must
    reach the kernel as given ((L, M, K) x (L, N, K), grouped (M, K) x (G, N, K), no copies), and
    any refusal is a fallback to the reference, its epilogue included."""

    avals: tuple
    layouts: GemmLayouts | RaggedLayouts
    out_dtype: str
    acc_dtype: str
    epilogue: bool = False
    bias: bool = False
    bias_layout: Layout | None = None
    activation: str | None = None
    preact: bool = False
    dact: str | None = None
    z_layout: Layout | None = None
    precision: object = None   # lax's precision or dot algorithm, as the primitive carries it
    free_sms: int = 0
    scales: tuple[int, int] | None = None
    split_k: int | None = None   # the split-K its kernel takes, where the family splits K (see whole_split)

    @property
    def grouped(self) -> bool:
        return isinstance(self.layouts, RaggedLayouts)

    @property
    def op(self) -> str:
        return "ragged_dot" if self.grouped else "matmul"

    @property
    def dtypes(self) -> tuple[str, str, str]:
        return np.dtype(self.avals[0].dtype).name, np.dtype(self.avals[1].dtype).name, np.dtype(self.out_dtype).name

    @property
    def two_outputs(self) -> bool:
        # without an activation the pre-activation is the output itself
        return self.preact and bool(self.activation)

    @property
    def multiple_results(self) -> bool:
        return self.epilogue and not self.dact

    def describe(self, e: dict) -> str:
        """What the logs say of the call, given its extents ``e``."""
        dims = f"M={e['m']} N={e['n']} K={e['k']} L={e['l']}"
        if self.grouped:
            dims = f"{self.layouts.mode} M={e['m']} N={e['n']} K={e['k']} G={e['g']} L={e['l']}"
        what = f"{dims}, dtypes {'/'.join(self.dtypes)}"
        if self.scales:
            what += f", block scales {self.scales[0]}x128 / {self.scales[1]}x128"
        if self.dact:
            return f"{what}, {self.dact} derivative"
        if self.epilogue:
            return f"{what}, bias {'yes' if self.bias else 'no'}, activation {self.activation}"
        return what

    def refuse(self, why: str, what: str) -> None:
        """Log why no kernel runs the call as asked: a fallback to the reference (strict mode
        raises), or for an epilogue, the GEMM kernel with the epilogue in XLA."""
        if self.epilogue and not self.scales:
            logger.info("jax_cute.%s: the GEMM kernel runs with its epilogue in XLA: %s (%s)", self.op, why, what)
        else:
            fallback(self.op, f"{why} ({what})")


def gemm(request: GemmRequest, reference: Callable) -> Callable | None:
    """The kernel implementation of ``request`` (a function of the primitive's operands, one
    result or, for an epilogue with outputs, a list), or None: the caller lowers ``reference``,
    or for an epilogue, the GEMM with a float32 output and the epilogue in XLA.

    The walk: the problem model plans the flat problem (``problem.plan``); the kernel side
    says what it takes (32-bit extents, a gated output's layout, the family and its config);
    the cache gives the compiled kernel; at launch the plan readies the operands and
    ``custom_call.kernel_call`` emits the call. Refusals are reported in a fixed order: the
    request's own (bias, Z), the family's epilogues, the plan, 32-bit extents, the layout the
    epilogue needs, the family."""
    req = request
    e = req.layouts.extents()
    if 0 in e.values():
        return None  # nothing to launch: the reference path writes the zeros
    what = req.describe(e)
    planned = plan(req.layouts, [av.shape for av in req.avals[:2]], req.dtypes,
                   copies=not req.epilogue and not req.grouped and not req.scales, unaligned_c=_unaligned_c(req))
    if not isinstance(planned, str) and planned.rewrite is not None:
        rw = planned.rewrite
        logger.warning("jax_cute.matmul: %swriting the output through one copy into its layout: %s (%s)",
                       "copying operands a and b into row-major buffers and " if rw.copy_operands else "",
                       rw.why, what)
    target = _target("grouped" if req.grouped else "gemm", req.epilogue)
    why = _request_refusal(req, e)
    if why is None and req.epilogue:
        why = _epilogue_refusal(req, target.family)
    if why is None and isinstance(planned, str):
        why = planned
    if why is None:
        flat = planned.flat
        why = int32_refusal(flat.m, flat.n, flat.k, flat.l, *((flat.g, "M" if req.layouts.mode == RAGGED_M else "K")
                                                             if req.grouped else ()))
    if why is None:
        why = _plan_refusal(req, planned, e)
    if why is None and req.scales:
        why = _scaled_refusal(planned, e)
    c_out = None
    if why is None and is_gated(req.activation):
        c = planned.flat.c
        c_out = gated_output(c.shape, c.stride, c.major, planned.padded_c, planned.flat.n,
                             target.family.GATED_COLUMNS)
        why = c_out if isinstance(c_out, str) else None
    if why is not None:
        req.refuse(why, what)
        return None
    spec = _spec(req, planned)
    why = target.refusal()
    variant = ""
    if why is None:
        why = target.family.unsupported(spec)
        variant = getattr(target.family, "unverified", lambda s: "")(spec)
        why = why or variant_allowed(target.arch, variant)
        why = why and f"{why} ({what})"
    if why:
        fallback(req.op, why)
        return None
    arch, fam, flat = target.arch, target.family, planned.flat
    if not req.grouped and spec.batch_modes not in getattr(fam, "BATCH_MODES", (1,)):
        req.refuse(f"the batch modes do not coalesce into one, and the {fam.FAMILY} kernels take one", what)
        return None
    sms = _sm_budget(req, arch)
    if req.grouped:
        cfg = fam.heuristic(spec, flat.m, flat.n, flat.k, flat.g, flat.l, sms)
        workspaces = fam.workspace(spec, cfg, flat.m, flat.n, flat.k, flat.g, flat.l)
    else:
        _log_copies(planned)
        cfg = fam.heuristic(spec, flat.m, flat.n, flat.k, flat.l, sms, **_split_arg(fam, req.split_k))
        if config.autotune() and not req.epilogue and not req.scales:
            cfg = autotune.tuned_gemm_config(fam, arch, spec, flat, list(req.dtypes), cfg)
        cfg = _on_sms(cfg, sms)
        workspaces = fam.workspace(spec, cfg, flat.m, flat.n, flat.k, flat.l)
    binary = family_binary(fam, arch, spec, launch_mode(cfg))
    impl = _implementation(req, planned, binary, workspaces, c_out, e)
    sizes = _group_split(e["m"] if req.layouts.mode == RAGGED_M else e["k"]) if req.grouped else None
    if not _trusted(req.op, binary, impl, reference, req.avals, sizes, variant):
        return None
    logger.info("jax_cute.%s: %s on %s (%s)", req.op, binary.name, arch, what)
    return impl


def _split_arg(fam, split_k: int | None) -> dict:
    """The heuristic's keyword for a requested split-K, for a family whose heuristic takes one
    (it declares ``SPLITS_K``)."""
    if split_k is None or not getattr(fam, "SPLITS_K", False):
        return {}
    return {"split_k": split_k}


def whole_split(request: GemmRequest) -> int | None:
    """The split-K the heuristic picks for ``request``'s kernel, on all of the device's SMs (as
    an unsharded product runs), or None: no kernel of a family that splits K takes it, or
    autotune picks its config. Nothing is compiled or logged; a request no kernel takes is
    ``gemm``'s to report when a call makes it."""
    if request.grouped or config.autotune():
        return None
    e = request.layouts.extents()
    if 0 in e.values():
        return None
    planned = plan(request.layouts, [av.shape for av in request.avals[:2]], request.dtypes,
                   copies=not request.epilogue and not request.scales, unaligned_c=_unaligned_c(request))
    target = _target("gemm", request.epilogue)
    if isinstance(planned, str) or target.refusal() is not None:
        return None
    fam, spec = target.family, _spec(request, planned)
    if not _split_arg(fam, 1) or fam.unsupported(spec):
        return None
    flat = planned.flat
    try:
        cfg = fam.heuristic(spec, flat.m, flat.n, flat.k, flat.l, arch_info.num_sms(target.arch))
    except ValueError:
        return None
    return cfg.split_k


def _unaligned_c(req: GemmRequest) -> bool:
    """Whether the target's kernel may store this request's C where its strides are not
    multiples of 16 bytes (GemmSpec.c_aligned): a dense product with no second output laid out
    like C (pre-activation, Z) and no block scales."""
    if req.grouped or req.two_outputs or req.dact or req.scales or is_gated(req.activation):
        return False
    return ("gemm", target_arch()[0]) in kernels.UNALIGNED_C


def _request_refusal(req: GemmRequest, e: dict) -> str | None:
    """Why the kernels cannot compute the request's dot algorithm or read its extra operand (a
    dense bias, or Z) as given."""
    why = algorithm_refusal(req.precision, str(np.dtype(req.avals[0].dtype)))
    if why:
        return why
    if req.dact:
        z = req.avals[-1]
        if np.dtype(z.dtype) != np.dtype(req.out_dtype) or tuple(z.shape) != tuple(req.layouts.c_shape) \
                or not _same_layout(req.z_layout, req.layouts.c):
            return "kernels read the pre-activation laid out as the output, in its dtype"
    elif req.bias and not req.grouped and not _bias_per_column(req.avals[-1], req.bias_layout, e["n"]):
        return "kernels read a bias of shape (N,) broadcast over rows and batches"
    return None


def _epilogue_refusal(req: GemmRequest, fam) -> str | None:
    """Why the target's family ``fam`` (None: none) fuses no such epilogue (its ``EPILOGUES``;
    "dact": the activation's derivative), or None."""
    fusable = getattr(fam, "EPILOGUES", ())
    bias, act, two, dact = req.bias, req.activation, req.two_outputs, bool(req.dact)
    if fam is None or (act and act not in fusable) or (bias and "bias" not in fusable) \
            or (two and "preact" not in fusable) or (dact and "dact" not in fusable):
        return (f"{getattr(fam, 'FAMILY', 'no kernel family')} does not fuse {'bias and ' if bias else ''}"
                f"{act or 'no activation'}{' with the pre-activation output' if two else ''}"
                f"{' derivative' if dact else ''}")
    return None


def _plan_refusal(req: GemmRequest, p: Plan, e: dict) -> str | None:
    """Why the planned problem cannot take the request's epilogue, or None."""
    if not req.epilogue:
        return None
    flat = p.flat
    if req.dact:
        if p.padded_c or p.batch_modes != 1:
            return "the output needs padding or more than one batch mode"
        return None
    if not req.grouped:
        if flat.n != e["n"]:
            return "a batch mode folds into N, so output columns no longer index the bias"
        return None
    if req.layouts.mode != RAGGED_M:
        return "kernels fuse the epilogue of a ragged_m product"
    if flat.l != 1 and is_gated(req.activation):
        return "a gated activation takes one batch of groups (the paired N spends three TMA dimensions)"
    if req.bias and _bias_batches(req, flat) is None:
        return "a bias shared by some vmapped axes but not all"
    return None


def _scaled_refusal(p: Plan, e: dict) -> str | None:
    """Why the planned problem does not index the block scales as the call gives them, or None:
    the kernel reads them at the call's own rows, columns, K blocks, batches (and groups)."""
    flat = p.flat
    if any(getattr(flat, d) != e[d] for d in e) or p.batch_modes != 1 or (flat.a.major, flat.b.major) != ("k", "k"):
        return "the block-scaled kernel reads (L, M, K) x (L, N, K) operands contiguous along K as given"
    return None


def _bias_batches(req: GemmRequest, flat: FlatGrouped) -> int | None:
    """How many biases a grouped kernel reads (N, G, L or 1): one per batch, or one for all;
    None when the bias is shared by some vmapped axes but not all."""
    c_shape = tuple(req.layouts.c_shape)
    lead = tuple(req.avals[-1].shape[:-2])
    if all(x == 1 for x in lead):
        return 1
    if lead != c_shape[:-2] or math.prod(lead) != flat.l:
        return None
    return flat.l


def _spec(req: GemmRequest, p: Plan) -> GemmSpec | GroupedSpec:
    flat, dts = p.flat, req.dtypes
    fused = dict(bias=req.bias, activation=req.activation or "", preact=req.two_outputs)
    scales = dict(a_block=req.scales[0], b_block=req.scales[1]) if req.scales else {}
    if req.grouped:
        return GroupedSpec(req.layouts.mode, *dts, flat.a.major, flat.b.major, flat.c.major, req.acc_dtype,
                           lead=req.layouts.lead, **(fused if req.epilogue else {}), **scales)
    if req.dact:
        return GemmSpec(*dts, flat.a.major, flat.b.major, flat.c.major, req.acc_dtype, dact=req.dact)
    return GemmSpec(*dts, flat.a.major, flat.b.major, flat.c.major, req.acc_dtype, batch_modes=p.batch_modes,
                    **(fused if req.epilogue else {}), **scales, c_aligned=flat.c.aligned)


def _log_copies(p: Plan) -> None:
    """Log what a plan moves besides the kernel's own reads: padded buffers and copied operands."""
    for name, old, new in zip("abc", p.given, p.buffers):
        if old != new:
            logger.warning("jax_cute.matmul: padding %s from %s to %s (16-byte TMA strides)", name, old, new)
    for operand, reason in p.flat.copies:
        logger.warning("jax_cute.matmul: copying operand %s into a kernel layout: %s", operand, reason)


def _implementation(req: GemmRequest, p: Plan, binary: KernelBinary, workspaces, c_out: tuple | None,
                    e: dict) -> Callable:
    """The function of the primitive's operands that launches ``binary`` as ``p`` plans: the
    operands readied (``problem.prepare``), the extra inputs (bias, Z), the outputs (c, and the
    pre-activation d) laid out like c (a gated c as ``c_out``), padded ones sliced back."""
    flat, c_shape = p.flat, p.given[2]
    out_buffer = p.buffers[2]
    c_desc = (flat.c.shape, flat.c.stride)
    b_desc = (flat.b.shape, flat.b.stride)
    if req.grouped:
        b_desc, c_desc = flat.b4 or b_desc, flat.c4 or c_desc
    outs = {"c": (out_buffer, c_desc)}
    if c_out is not None:
        outs["c"] = (tuple(out_buffer[:-1]) + (out_buffer[-1] // 2,), c_out)
    if req.two_outputs:
        outs["d"] = (out_buffer, c_desc)
    bias_batches = _bias_batches(req, flat) if req.grouped and req.bias else 1

    def launch(a, b, *rest):
        a, b = prepare(p, a, b)
        inputs = {"a": (a, flat.a.shape, flat.a.stride), "b": (b, *b_desc)}
        if req.grouped:
            inputs["group_sizes"] = (rest[0], *flat.gs)
            rest = rest[1:]
        if req.scales:
            inputs.update(_scale_inputs(*rest[:2]))
            rest = rest[2:]
        if req.bias and req.grouped:
            # bias (..., G, N) row-major, read as (N, G, L or 1)
            inputs["bias"] = (rest[0].astype(jnp.float32), (e["n"], e["g"], bias_batches),
                              (1, e["n"], e["g"] * e["n"]))
        elif req.bias:
            inputs["bias"] = (jnp.reshape(rest[0], (-1,)).astype(jnp.float32), (e["n"],), (1,))
        elif req.dact:
            inputs["z"] = (rest[0], flat.c.shape, flat.c.stride)
        outputs = {name: (jax.ShapeDtypeStruct(shape, np.dtype(req.dtypes[2])), *desc)
                   for name, (shape, desc) in outs.items()}
        outputs.update(workspace_outputs(binary, workspaces))
        got = kernel_call(binary, inputs, outputs, zeroed=_zeroed(workspaces), used=list(outs))
        sliced = tuple(slice(0, n) for n in c_shape)
        return [got[name][sliced] if p.padded_c else got[name] for name in outs]

    def impl(a, b, *rest):
        if p.rewrite is not None:
            return p.rewrite.run(lambda x, y: launch(x, y)[0], a, b)
        got = launch(a, b, *rest)
        if not req.multiple_results:
            return got[0]
        return got * 2 if req.preact and not req.two_outputs else got

    return impl


def _scale_inputs(sa, sb) -> dict:
    """The kernel's sa and sb: (L, Kb, row blocks) arrays read as (row blocks, Kb, L) (row blocks
    padded by the caller to a multiple of SCALE_ROWS: the signature's divisibility)."""
    out = {}
    for name, s in (("sa", sa), ("sb", sb)):
        l, kb, rows = s.shape
        out[name] = (s, (rows, kb, l), (1, rows, rows * kb))
    return out


def _same_layout(x: Layout, y: Layout) -> bool:
    return all(x.mode(i).coalesce().flat_modes() == y.mode(i).coalesce().flat_modes() for i in range(3))


def _bias_per_column(bias_aval, bias_layout, n: int) -> bool:
    """Whether the bias is one (N,) row broadcast over M and every batch: what kernels read."""
    rows, cols, batch = bias_layout.modes()
    return (int(np.prod(bias_aval.shape)) == n and cols.coalesce().flat_modes() in (((n, 1),), ((1, 0),))
            and all(d == 0 for _, d in rows.flat_modes() + batch.flat_modes()))


def _group_split(extent: int) -> Callable:
    """Group sizes for a first-use check: a random split of the ragged ``extent``, some groups empty."""
    def sizes(rng, shape):
        cuts = np.sort(rng.integers(0, extent + 1, shape), axis=0)
        return np.diff(cuts, axis=0, prepend=0)
    return sizes


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
