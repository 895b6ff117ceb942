"""``jax_cute.cute_call``: run a user's ``@cute.jit`` launcher from JAX, inside ``jax.jit``.

The launcher's signature is ``(stream, *inputs, *outputs)``. Each tensor reaches it with static
shape and strides: row-major by default, or a permutation of the array's axes (``(1, 0)`` hands
a row-major matrix to the kernel as its transpose, without a copy). It is compiled once per
(launcher identity, shapes, dtypes, layouts, arch), where the identity is its qualified name
and a hash of its source, or a key the user gives; never a Python object id.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import logging
import math
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import dispatch as jax_dispatch  # no public API marks a primitive as needing devices
from jax.extend import core
from jax.interpreters import ad, batching, mlir

from jax_cute import dispatch
from jax_cute.custom_call import kernel_call
from jax_cute.kernels import abi
from jax_cute.primitives import call_sharding, sharding
from jax_cute.primitives.rules import eager

logger = logging.getLogger("jax_cute")

cute_call_p = core.Primitive("jax_cute_call")
cute_call_p.multiple_results = True


@dataclasses.dataclass(frozen=True, eq=False)
class UserKernel:
    """A launcher and its stable identity. Equality and hashing use the identity (and how the
    call lowers when partitioned) only."""

    launcher: Callable
    identity: str
    reference: Callable | None = None
    partitioned_reference: bool = False

    def __eq__(self, other):
        return (isinstance(other, UserKernel) and other.identity == self.identity
                and other.partitioned_reference == self.partitioned_reference)

    def __hash__(self):
        return hash((self.identity, self.partitioned_reference))


def _identity(launcher: Callable, key: str | None) -> str:
    fn = inspect.unwrap(launcher)
    qual = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    if key is not None:
        return f"{qual}#key={key}"
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        raise ValueError(f"jax_cute.cute_call: cannot read the source of {qual} to key its compile "
                         "cache; pass key='...' (change it whenever the kernel changes)") from None
    return f"{qual}#src={hashlib.sha256(src.encode()).hexdigest()[:24]}"


def _perm_layout(shape: Sequence[int], perm: Sequence[int] | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, stride) the kernel sees for an array of ``shape`` viewed through ``perm``."""
    # an extent-1 axis keeps its compact stride (not row_major's normalised 0): an offset along it
    # then stays a multiple of the inner extents, so the DSL can still prove 16-byte alignment of
    # a slice taken there (with stride 1 a (1, K, N) operand's accesses compiled to single bytes)
    stride = tuple(max(1, math.prod(shape[i + 1:])) for i in range(len(shape)))
    if perm is None:
        return tuple(shape), tuple(stride)
    return tuple(shape[p] for p in perm), tuple(stride[p] for p in perm)


def _signature(in_avals, out_avals, in_layouts, out_layouts) -> abi.Signature:
    args: list[abi.Arg] = [abi.StreamArg()]
    for prefix, avals, lays in (("in", in_avals, in_layouts), ("out", out_avals, out_layouts)):
        for i, (av, perm) in enumerate(zip(avals, lays)):
            shape, stride = _perm_layout(av.shape, perm)
            args.append(abi.TensorArg(f"{prefix}{i}", np.dtype(av.dtype).name, shape, stride, align=16))
    return tuple(args)


def _abstract_eval(*avals, out_avals, **_):
    return sharding.varying_as(out_avals, avals)   # (inside shard_map: varying as the operands)


cute_call_p.def_abstract_eval(_abstract_eval)


cute_call_p.def_impl(functools.partial(eager, cute_call_p))


def _reference_lowering(ctx, *args, kernel: UserKernel, name, **_):
    if kernel.reference is None:
        raise NotImplementedError(
            f"jax_cute.cute_call({name}): this kernel runs only on CUDA GPUs; pass reference=fn "
            "(plain jax.numpy with the same inputs and outputs) to run it elsewhere")
    def ref(*xs):
        outs = kernel.reference(*xs)
        # One output may come back bare; list() would walk a traced array element by element.
        return list(outs) if isinstance(outs, (tuple, list)) else [outs]

    return mlir.lower_fun(ref, multiple_results=True)(ctx, *args)


def _cuda_lowering(ctx, *args, kernel: UserKernel, out_avals, in_layouts, out_layouts, name, aliases=(), **_):
    if kernel.partitioned_reference and not sharding.one_shard(ctx.module_context.axis_context):
        # (no partitioning rule: the kernel would run on operands gathered onto every device)
        logger.info("jax_cute.cute_call(%s): partitioned over several devices, lowered to its reference", name)
        return _reference_lowering(ctx, *args, kernel=kernel, name=name)
    sig = _signature(ctx.avals_in, out_avals, in_layouts, out_layouts)
    binary = dispatch.user_kernel(name, kernel.identity, kernel.launcher, sig, kernel.reference is not None)
    if binary is None:
        return _reference_lowering(ctx, *args, kernel=kernel, name=name)

    def impl(*xs):
        inputs = {f"in{i}": (x, *_perm_layout(x.shape, p)) for i, (x, p) in enumerate(zip(xs, in_layouts))}
        outputs = {f"out{i}": (jax.ShapeDtypeStruct(av.shape, av.dtype), *_perm_layout(av.shape, p))
                   for i, (av, p) in enumerate(zip(out_avals, out_layouts))}
        res = kernel_call(binary, inputs, outputs, aliases={f"in{i}": f"out{o}" for i, o in aliases})
        return [res[f"out{i}"] for i in range(len(out_avals))]

    return mlir.lower_fun(impl, multiple_results=True)(ctx, *args)


def _bind_local(xs, out_avals, params):
    """One shard's call (``call_sharding``): the kernel on the local blocks."""
    return cute_call_p.bind(*xs, **{**params, "out_avals": tuple(out_avals), "rule": None})


def _partitionable(lower: Callable) -> Callable:
    """``lower``, or where the call has a sharding rule and is lowered as part of a computation
    partitioned over several devices, the rule's custom_partitioning of it (each shard then lowers
    ``lower`` on its blocks)."""
    def lowering(ctx, *args, rule=None, **params):
        if rule is None or sharding.one_shard(ctx.module_context.axis_context):
            return lower(ctx, *args, **params)
        fn = call_sharding.partitioned(rule, params, _bind_local)
        return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)
    return lowering


# custom_partitioning needs the device assignment while lowering
jax_dispatch.prim_requires_devices_during_lowering.add(cute_call_p)
mlir.register_lowering(cute_call_p, _partitionable(_reference_lowering))
mlir.register_lowering(cute_call_p, _partitionable(_cuda_lowering), platform="cuda")


def _no_jvp(primals, tangents, **params):
    raise NotImplementedError(
        f"jax_cute.cute_call({params['name']}) has no derivative: wrap the call in jax.custom_vjp "
        "(or jax.custom_jvp) and give its backward pass, e.g. as another cute_call")


ad.primitive_jvps[cute_call_p] = _no_jvp


def _batch_rule(args, dims, *, kernel, out_avals, in_layouts, out_layouts, name, batch_mode=False, aliases=(),
                rule=None):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    args = [jnp.moveaxis(a, d, 0) if d is not None else a for a, d in zip(args, dims)]
    if batch_mode:
        # The user declared the launcher takes a leading batch mode on every tensor.
        args = [a if d is not None else jnp.broadcast_to(a, (size, *a.shape)) for a, d in zip(args, dims)]
        outs = tuple(jax.core.ShapedArray((size, *av.shape), av.dtype) for av in out_avals)
        lift = lambda p: None if p is None else (0, *(q + 1 for q in p))  # noqa: E731
        res = cute_call_p.bind(*args, kernel=kernel, out_avals=outs, in_layouts=tuple(map(lift, in_layouts)),
                               out_layouts=tuple(map(lift, out_layouts)), name=name, batch_mode=True,
                               aliases=aliases, rule=None if rule is None else rule.batched())
        return res, [0] * len(res)
    batched = [a for a, d in zip(args, dims) if d is not None]

    def one(xs):
        it = iter(xs)
        full = [next(it) if d is not None else a for a, d in zip(args, dims)]
        return cute_call_p.bind(*full, kernel=kernel, out_avals=out_avals, in_layouts=in_layouts,
                                out_layouts=out_layouts, name=name, batch_mode=False, aliases=aliases, rule=rule)

    res = jax.lax.map(one, batched)
    return list(res), [0] * len(res)


batching.primitive_batchers[cute_call_p] = _batch_rule


def cute_call(launcher: Callable, *, out_shape: Any, in_layouts: Sequence[Sequence[int] | None] | None = None,
              out_layouts: Sequence[Sequence[int] | None] | None = None, key: str | None = None,
              reference: Callable | None = None, batch_mode: bool = False, name: str | None = None,
              input_output_aliases: dict[int, int] | None = None, partitioned_reference: bool = False,
              sharding_rule: str | None = None, replicated_factors: Sequence[str] = (),
              factor_sizes: Mapping[str, int] | None = None) -> Callable:
    """Wrap ``launcher(stream, *inputs, *outputs)`` as a JAX function of the inputs.

    ``out_shape``: a ``jax.ShapeDtypeStruct`` or a sequence of them. ``in_layouts`` /
    ``out_layouts``: per tensor, None (row-major) or a permutation of its axes. ``key``:
    overrides the source hash as the launcher's identity. ``reference``: a jax.numpy function
    used where no GPU kernel can run (CPU, or no target arch). ``batch_mode``: under vmap, the
    launcher accepts every tensor with a leading batch axis (else vmap loops over the batch).
    ``input_output_aliases``: {input index: output index}, as in ``jax.ffi.ffi_call``: that
    output is written into the input's buffer (same shape and dtype), so a kernel that updates
    its input in place (a loop carry, a buffer nothing else reads after) needs no new buffer
    and no copy; XLA copies the input first where it is still needed. The launcher gets both
    tensors over the same memory: each element must be read before it is written.
    ``partitioned_reference``: where the call is lowered as part of a computation partitioned over
    several devices (``jit`` of sharded operands; not inside ``shard_map``, where each shard runs
    the kernel), lower ``reference`` instead, which XLA partitions: the kernel has no
    partitioning rule, so XLA would gather its operands onto every device and run it on the
    whole. For kernels whose outputs follow their inputs' sharding (elementwise or blockwise).
    On Explicit mesh axes its results are typed as the reference's are.
    ``sharding_rule``: instead, the kernel's own partitioning rule, so that under such a ``jit``
    each shard runs the kernel on its blocks: each tensor axis named by a factor, in Shardy's
    einsum-like notation (``"m n, n -> m n"``; ``"m (kb kk) -> m kb"`` for an axis of several
    factors, slowest first, with ``factor_sizes={"kk": 128}``). A factor named in an output may
    be sharded, with no communication, unless listed in ``replicated_factors`` (the kernel needs
    it whole, such as a row it reduces): the promise is that the kernel computes each output
    block along it from the same block of every input. Other factors stay whole (operands
    sharded along them are gathered first).
    The call has no derivative: wrap it in ``jax.custom_vjp``.
    """
    if partitioned_reference and reference is None:
        raise ValueError("jax_cute.cute_call: partitioned_reference=True needs a reference")
    if partitioned_reference and sharding_rule is not None:
        raise ValueError("jax_cute.cute_call: give sharding_rule (the kernel runs per shard) or "
                         "partitioned_reference (the reference runs partitioned), not both")
    if sharding_rule is None and (replicated_factors or factor_sizes):
        raise ValueError("jax_cute.cute_call: replicated_factors and factor_sizes belong to a sharding_rule")
    single = isinstance(out_shape, jax.ShapeDtypeStruct)
    outs = [out_shape] if single else list(out_shape)
    fn = inspect.unwrap(launcher)
    label = name or getattr(fn, "__qualname__", "kernel")
    kernel = UserKernel(launcher, _identity(launcher, key), reference, partitioned_reference)
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    out_avals = tuple(jax.core.ShapedArray(tuple(o.shape), np.dtype(o.dtype)) for o in outs)
    rule = None if sharding_rule is None else call_sharding.parse(
        sharding_rule, max(len(params) - 1 - len(outs), 0), len(outs), replicated_factors, factor_sizes, label)

    def call(*inputs):
        dispatch.at_trace("cute_call")
        if len(params) != 1 + len(inputs) + len(outs):
            raise TypeError(f"jax_cute.cute_call({label}): the launcher takes {len(params)} arguments "
                            f"(stream, inputs, outputs) but was given 1 stream + {len(inputs)} inputs + "
                            f"{len(outs)} outputs")
        arrays = []
        for p, x in zip(params[1:], inputs):
            x = jnp.asarray(x)
            if x.dtype.name not in _DSL_DTYPES:
                raise TypeError(f"jax_cute.cute_call({label}): argument {p.name!r} has dtype {x.dtype}, "
                                f"which CuTe DSL kernels cannot take (supported: {', '.join(_DSL_DTYPES)})")
            arrays.append(x)
        ins = _check_layouts(label, "in_layouts", in_layouts, [a.shape for a in arrays], [p.name for p in params[1:]])
        ous = _check_layouts(label, "out_layouts", out_layouts, [o.shape for o in outs],
                             [p.name for p in params[1 + len(inputs):]])
        aliases = _check_aliases(label, input_output_aliases, arrays, out_avals)
        if rule is not None:
            call_sharding.factor_sizes(rule, [a.shape for a in arrays] + [o.shape for o in out_avals], label)
            for i, o in aliases:
                if rule.tensors[i] != rule.tensors[rule.inputs + o]:
                    raise ValueError(f"jax_cute.cute_call({label}): sharding_rule gives aliased input {i} and "
                                     f"output {o} different factors; they share one buffer")
        res = cute_call_p.bind(*arrays, kernel=kernel, out_avals=_typed_outs(kernel, arrays, out_avals, label),
                               in_layouts=ins, out_layouts=ous, name=label, batch_mode=batch_mode, aliases=aliases,
                               rule=rule)
        return res[0] if single else tuple(res)

    return call


def _typed_outs(kernel: UserKernel, arrays, out_avals: tuple, label: str) -> tuple:
    """The result types: ``out_avals``, or for a call partitioned as its reference (and so
    lowered where it is partitioned) whose operands are sharded in their types (Explicit mesh
    axes), the types of the reference's results, sharded as its jax.numpy ops shard them."""
    meshes = {jax.typeof(a).sharding.mesh for a in arrays}
    if not kernel.partitioned_reference or not any(sharding.explicit_axes(m) for m in meshes):
        return out_avals
    ref = jax.eval_shape(lambda *xs: kernel.reference(*xs), *arrays)
    ref = list(ref) if isinstance(ref, (tuple, list)) else [ref]
    if [(tuple(r.shape), np.dtype(r.dtype)) for r in ref] != [(tuple(o.shape), np.dtype(o.dtype)) for o in out_avals]:
        raise ValueError(f"jax_cute.cute_call({label}): the reference returns "
                         f"{[(tuple(r.shape), np.dtype(r.dtype).name) for r in ref]}, not out_shape's "
                         f"{[(tuple(o.shape), np.dtype(o.dtype).name) for o in out_avals]}")
    return tuple(o.update(sharding=r.sharding) for o, r in zip(out_avals, ref))


_DSL_DTYPES = ("bfloat16", "float16", "float32", "int32", "int64", "uint8", "int8", "float8_e4m3fn", "float8_e5m2")


def _check_layouts(label, what, layouts, shapes, names) -> tuple:
    if layouts is None:
        return (None,) * len(shapes)
    if len(layouts) != len(shapes):
        raise ValueError(f"jax_cute.cute_call({label}): {what} has {len(layouts)} entries for {len(shapes)} tensors")
    out = []
    for lay, shape, nm in zip(layouts, shapes, names):
        if lay is not None and sorted(lay) != list(range(len(shape))):
            raise ValueError(f"jax_cute.cute_call({label}): {what} for {nm!r} must be a permutation of "
                             f"{len(shape)} axes, got {lay}")
        out.append(None if lay is None else tuple(int(i) for i in lay))
    return tuple(out)


def _check_aliases(label, aliases, arrays, out_avals) -> tuple[tuple[int, int], ...]:
    """``input_output_aliases`` as sorted (input, output) pairs, each pair of one shape and dtype."""
    if not aliases:
        return ()
    pairs = sorted((int(i), int(o)) for i, o in dict(aliases).items())
    outs = [o for _, o in pairs]
    if len(set(outs)) != len(outs):
        raise ValueError(f"jax_cute.cute_call({label}): input_output_aliases maps two inputs to one output: {aliases}")
    for i, o in pairs:
        if not (0 <= i < len(arrays) and 0 <= o < len(out_avals)):
            raise ValueError(f"jax_cute.cute_call({label}): input_output_aliases {{{i}: {o}}} is out of range "
                             f"({len(arrays)} inputs, {len(out_avals)} outputs)")
        x, av = arrays[i], out_avals[o]
        if tuple(x.shape) != tuple(av.shape) or np.dtype(x.dtype) != np.dtype(av.dtype):
            raise ValueError(f"jax_cute.cute_call({label}): input {i} ({x.dtype}{list(x.shape)}) cannot hold "
                             f"output {o} ({av.dtype}{list(av.shape)}): an aliased pair needs one shape and dtype")
    return tuple(pairs)
