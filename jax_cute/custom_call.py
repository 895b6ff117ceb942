"""The custom call that launches a compiled kernel on XLA's stream.

:func:`kernel_call` is the one way a :class:`~jax_cute.kernels.build.KernelBinary` reaches
XLA: it packs the descriptors (see ``kernels/abi.py``), embeds the object in the call's
attributes so the lowered module is self-contained (it survives ``jax.export``), and, in debug
mode, hands the kernel NaN-filled output buffers so unwritten elements show.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_cute import config, runtime
from jax_cute.arch import capability_of
from jax_cute.kernels import abi
from jax_cute.kernels.build import KernelBinary

Layout = tuple[Sequence[int], Sequence[int]]  # (shape, stride) in elements over a buffer


def _fill_value(dtype) -> object:
    return jnp.nan if jnp.issubdtype(dtype, jnp.floating) else -1


def kernel_call(binary: KernelBinary, inputs: Mapping[str, tuple[jax.Array, Sequence[int], Sequence[int]]],
                outputs: Mapping[str, tuple[jax.ShapeDtypeStruct, Sequence[int], Sequence[int]]],
                scalars: Mapping[str, object] | None = None, *,
                zeroed: Sequence[str] = (), aliases: Mapping[str, str] | None = None, nan_fill: bool | None = None,
                command_buffer: bool | None = None, used: Sequence[str] | None = None) -> dict[str, jax.Array]:
    """Launch ``binary`` on XLA's stream; returns the outputs by name.

    ``inputs`` maps a tensor argument's name to (physical array, logical shape, logical
    stride); ``outputs`` maps a name to (physical ShapeDtypeStruct, shape, stride). Outputs
    named in ``zeroed`` start as zeros (workspaces a kernel accumulates into); ``aliases`` maps an
    input's name to the output written into its buffer (it starts as that input); with
    ``nan_fill`` (default: ``config.nan_fill()``) every other output starts as NaN (or -1 for
    integers). ``command_buffer`` (default: ``config.command_buffer()``) picks the FFI target
    XLA may record into a CUDA graph, or the one it launches on its stream every run. ``used``
    names the outputs the caller reads (default: all; not its workspaces): when there are several
    and no output is aliased, they pass through an optimization barrier.
    """
    runtime.ensure_registered()
    in_names, out_names = list(inputs), list(outputs)
    layouts = {n: (tuple(v[1]), tuple(v[2])) for n, v in {**inputs, **outputs}.items()}
    nan_fill = config.nan_fill() if nan_fill is None else nan_fill
    aliases = dict(aliases or {})
    held = set(aliases.values())  # outputs that start as an input
    prefilled = [n for n in out_names if (n in zeroed or nan_fill) and n not in held]
    # A prefilled output is passed in as an extra input that XLA aliases to the output.
    buffers = in_names + out_names
    physical = {n: (v[0].shape, np.dtype(v[0].dtype)) for n, v in {**inputs, **outputs}.items()}
    types = {n: abi.BufferType(len(shape), dtype.name, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
             for n, (shape, dtype) in physical.items()}
    packed = abi.pack_args(binary.signature, buffers, layouts, dict(scalars or {}), types)
    major, minor = capability_of(binary.arch)
    attrs = dict(name=binary.name, key=binary.digest, symbol=binary.symbol,
                 object=np.frombuffer(binary.obj, np.uint8), arch_major=np.int64(major),
                 arch_minor=np.int64(minor), **packed.attributes())
    out_types = [outputs[n][0] for n in out_names]
    args = [inputs[n][0] for n in in_names]
    operand_aliases = {in_names.index(i): out_names.index(o) for i, o in aliases.items()}
    for n in prefilled:
        sds = outputs[n][0]
        fill = 0 if n in zeroed else _fill_value(sds.dtype)
        operand_aliases[len(args)] = out_names.index(n)
        args.append(jnp.full(sds.shape, fill, sds.dtype))
    if prefilled:
        # The aliased fill buffers are extra operands the handler must skip: they sit after
        # the real inputs, so shift output indices past them.
        shift = len(prefilled)
        kinds = packed.kinds.copy()
        kinds[kinds >= len(in_names)] += shift
        attrs["arg_kinds"] = kinds
    graph = config.command_buffer() if command_buffer is None else command_buffer
    call = jax.ffi.ffi_call(runtime.target_name(graph), out_types, input_output_aliases=operand_aliases or None)
    got = dict(zip(out_names, call(*args, **attrs)))
    used = out_names if used is None else list(used)
    if len(used) > 1 and not operand_aliases:
        # XLA's dynamic-slice fusion (jaxlib 0.11) writes an output that a scan stacks straight
        # into the stacked buffer by cloning the call into a fusion; when another output has a
        # further user it keeps the original call for that user, and the kernel runs twice.
        # Behind a barrier the outputs have one user, so the call is never cloned. Not with
        # aliased outputs (NaN-filled, zeroed or the caller's): in a scan XLA then gave wrong results.
        got.update(zip(used, jax.lax.optimization_barrier([got[n] for n in used])))
    return got


def workspace_outputs(binary: KernelBinary, workspaces) -> dict:
    """Output entries for a kernel's workspaces, typed as its signature declares them (1-D)."""
    args = {a.name: a for a in binary.signature if isinstance(a, abi.TensorArg)}
    out = {}
    for w in workspaces:
        dtype = np.dtype(args[w.name].dtype)
        n = -(-w.nbytes // dtype.itemsize)
        out[w.name] = (jax.ShapeDtypeStruct((n,), dtype), (n,), (1,))
    return out
