"""``cute_call``'s partitioning rule: a user's kernel run per shard under a partitioned ``jit``.

The user states, in Shardy's einsum-like notation, which *factor* each tensor axis is
(``"m n, n -> m n"``; a parenthesised group is one axis of several factors, slowest first,
``"m (kb kk) -> m kb"`` with ``factor_sizes={"kk": 128}``). A factor named in an output, and
not listed as ``replicated``, may be sharded: each shard runs the kernel on its blocks of every
tensor along that factor, with no communication. That is the user's promise: the kernel
computes an output block along such a factor from the same block of each input. Factors named
only by inputs (the kernel reads them whole), the listed ones, and all but the slowest factor
of a grouped axis stay whole; where an operand is sharded along one of those, the partitioner
gathers it first. A factor whose extent does not split evenly over its mesh axes stays whole too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Callable, Mapping, Sequence

import jax
from jax.experimental.custom_partitioning import ArrayMapping, CompoundFactor, SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jax_cute.primitives import sharding

Axis = tuple[str, ...]  # an axis's factors, slowest first
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*$")


@dataclasses.dataclass(frozen=True)
class CallRule:
    """A parsed rule: every tensor's axes (inputs, then outputs), the factors kept whole and
    the extents of factors that share an axis."""

    tensors: tuple[tuple[Axis, ...], ...]
    inputs: int
    replicated: tuple[str, ...] = ()
    factor_sizes: tuple[tuple[str, int], ...] = ()

    @property
    def shardable(self) -> frozenset[str]:
        outs = {ax[0] for t in self.tensors[self.inputs:] for ax in t if ax}
        slowest_only = {f for t in self.tensors for ax in t for f in ax[1:]}
        return frozenset(outs - slowest_only - set(self.replicated))

    def factors(self) -> list[str]:
        seen: dict[str, None] = {}
        for t in self.tensors:
            for ax in t:
                seen.update(dict.fromkeys(ax))
        return list(seen)

    def batched(self) -> CallRule:
        """The rule of the call with a leading batch axis on every tensor (``batch_mode``)."""
        used = set(self.factors())
        name = next(f"vmap{i}" for i in range(len(used) + 1) if f"vmap{i}" not in used)
        return dataclasses.replace(self, tensors=tuple(((name,), *t) for t in self.tensors))


def parse(rule: str, n_inputs: int, n_outputs: int, replicated: Sequence[str] = (),
          factor_sizes: Mapping[str, int] | None = None, label: str = "kernel") -> CallRule:
    """``rule`` as a CallRule, checked against the call's tensor counts (ValueError)."""
    where = f"jax_cute.cute_call({label}): sharding_rule {rule!r}"
    if rule.count("->") != 1:
        raise ValueError(f"{where} must have one '->' between the inputs and the outputs")
    sides = [s.split(",") for s in rule.split("->")]
    if (len(sides[0]), len(sides[1])) != (n_inputs, n_outputs) and not (n_inputs == 0 and sides[0] == [""]):
        raise ValueError(f"{where} names {len(sides[0])} inputs and {len(sides[1])} outputs; the call has "
                         f"{n_inputs} and {n_outputs}")
    tensors = []
    for text in sides[0] + sides[1]:
        axes: list[Axis] = []
        for group in re.findall(r"\([^()]*\)|[^\s()]+|[()]", text):
            names = tuple(group[1:-1].split()) if group.startswith("(") else (group,)
            if not names or not all(_NAME.match(n) for n in names):
                raise ValueError(f"{where}: {group!r} is not a factor name or a parenthesised group of them")
            axes.append(names)
        tensors.append(tuple(axes))
    out = CallRule(tuple(tensors), n_inputs, tuple(replicated), tuple(sorted((factor_sizes or {}).items())))
    for t in tensors:
        named = [f for ax in t for f in ax]
        if len(set(named)) != len(named):
            raise ValueError(f"{where}: a tensor names a factor twice")
    unknown = (set(out.replicated) | dict(out.factor_sizes).keys()) - set(out.factors())
    if unknown:
        raise ValueError(f"{where}: replicated or factor_sizes name {sorted(unknown)}, which the rule does not")
    return out


def factor_sizes(rule: CallRule, shapes: Sequence[Sequence[int]], label: str = "kernel") -> dict[str, int]:
    """Each factor's extent, from the tensors' shapes and the given sizes of grouped factors;
    ValueError where they disagree (checked when the call is traced)."""
    where = f"jax_cute.cute_call({label}): sharding_rule"
    sizes = dict(rule.factor_sizes)
    for i, (axes, shape) in enumerate(zip(rule.tensors, shapes)):
        if len(axes) != len(shape):
            raise ValueError(f"{where} gives tensor {i} {len(axes)} axes; it has shape {tuple(shape)}")
        for ax, n in zip(axes, shape):
            unknown = [f for f in ax if f not in sizes]
            if len(unknown) > 1:
                raise ValueError(f"{where}: give factor_sizes for all but one of {ax} (tensor {i})")
            known = math.prod(sizes[f] for f in ax if f in sizes)
            if unknown:
                if known == 0 or n % known:
                    raise ValueError(f"{where}: axis {ax} of tensor {i} has extent {n}, not a multiple of {known}")
                sizes[unknown[0]] = n // known
    for i, (axes, shape) in enumerate(zip(rule.tensors, shapes)):
        for ax, n in zip(axes, shape):
            if math.prod(sizes[f] for f in ax) != n:
                raise ValueError(f"{where}: axis {ax} of tensor {i} has extent {n}, but its factors' extents "
                                 f"are {[sizes[f] for f in ax]}")
    return sizes


def sdy_rule(rule: CallRule, sizes: Mapping[str, int]) -> SdyShardingRule:
    """The rule for Shardy: every factor but the shardable ones needs replication."""
    def mapping(axes):
        return ArrayMapping(*(ax[0] if len(ax) == 1 else CompoundFactor(*ax) for ax in axes))
    maps = [mapping(t) for t in rule.tensors]
    whole = {ax[0] for t in rule.tensors for ax in t if len(ax) == 1}  # (Shardy infers their sizes)
    grouped = {f: sizes[f] for t in rule.tensors for ax in t if len(ax) > 1 for f in ax if f not in whole}
    return SdyShardingRule(tuple(maps[:rule.inputs]), tuple(maps[rule.inputs:]),
                           need_replication_factors=tuple(f for f in rule.factors() if f not in rule.shardable),
                           **grouped)


def plan(rule: CallRule, sizes: Mapping[str, int], mesh_shape: Mapping[str, int],
         specs: Sequence[sharding.Spec | None]) -> dict[str, tuple[str, ...]]:
    """Factor -> mesh axes, proposed by the tensors' shardings in order (inputs first): a
    shardable factor takes the mesh axes of the first axis it leads, where they are free and
    divide its extent."""
    assignment: dict[str, tuple[str, ...]] = {}
    taken: set[str] = set()
    for axes_of, spec in zip(rule.tensors, specs):
        for ax, mesh_axes in zip(axes_of, spec or ()):
            f = ax[0] if ax else None
            if not mesh_axes or f is None or f in assignment or f not in rule.shardable:
                continue
            if not sharding.can_take(mesh_axes, sizes[f], mesh_shape, taken):
                continue
            assignment[f] = tuple(mesh_axes)
            taken.update(mesh_axes)
    return assignment


def _spec(axes: tuple[Axis, ...], assignment: Mapping[str, tuple[str, ...]]) -> PartitionSpec:
    return sharding.partition_spec([assignment.get(ax[0], ()) if ax else () for ax in axes])


def _local_shape(axes: tuple[Axis, ...], shape, assignment, mesh_shape) -> tuple[int, ...]:
    return tuple(n // math.prod(mesh_shape[a] for a in assignment.get(ax[0], ())) if ax else n
                 for ax, n in zip(axes, shape))


@dataclasses.dataclass(frozen=True)
class _Call:
    """Static part of one partitioned call: the rule and the primitive's other params."""

    rule: CallRule
    params: tuple[tuple[str, object], ...]
    bind: Callable  # (args, out_avals, params) -> the results

    @property
    def kwargs(self) -> dict:
        return dict(self.params)


def _assignment(call: _Call, mesh, arg_shapes, result_shapes) -> dict[str, tuple[str, ...]]:
    """The plan for the tensors' shardings (a result's, when asked to infer it, is None)."""
    tensors = (*arg_shapes, *result_shapes)
    sizes = factor_sizes(call.rule, [s.shape for s in tensors], call.kwargs["name"])
    specs = [None if s.sharding is None else sharding.spec_of(s.sharding, len(s.shape), mesh) for s in tensors]
    return plan(call.rule, sizes, dict(mesh.shape), specs)


def _as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _partition(call: _Call, mesh, arg_shapes, result_shape):
    results = _as_tuple(result_shape)
    assignment = _assignment(call, mesh, arg_shapes, results)
    ms = dict(mesh.shape)
    rule = call.rule
    out_avals = tuple(jax.core.ShapedArray(_local_shape(axes, r.shape, assignment, ms), r.dtype)
                      for axes, r in zip(rule.tensors[rule.inputs:], results))

    @sharding.traced_unmeshed
    def lower_fn(*args):
        return tuple(call.bind(args, out_avals, call.kwargs))

    arg_shardings = tuple(NamedSharding(mesh, _spec(t, assignment)) for t in rule.tensors[:rule.inputs])
    result_shardings = tuple(NamedSharding(mesh, _spec(t, assignment)) for t in rule.tensors[rule.inputs:])
    return mesh, lower_fn, result_shardings, arg_shardings


def _infer(call: _Call, mesh, arg_shapes, result_shape):
    assignment = _assignment(call, mesh, arg_shapes, _as_tuple(result_shape))
    return tuple(NamedSharding(mesh, _spec(t, assignment)) for t in call.rule.tensors[call.rule.inputs:])


def _sdy(call: _Call, mesh, operand_types, result_types) -> SdyShardingRule:
    shapes = [tuple(t.shape) for t in (*operand_types, *result_types)]
    return sdy_rule(call.rule, factor_sizes(call.rule, shapes, call.kwargs["name"]))


def _body(call: _Call, *args):
    with sharding.unmeshed():
        return tuple(jax.jit(lambda *xs: tuple(call.bind(xs, call.kwargs["out_avals"], call.kwargs)))(*args))


_partitioned = custom_partitioning(_body, static_argnums=(0,))
_partitioned.def_partition(partition=_partition, infer_sharding_from_operands=_infer, sharding_rule=_sdy,
                           decode_shardings=False)


def partitioned(rule: CallRule, params: Mapping[str, object], bind: Callable) -> Callable:
    """The call as a function of its (global) inputs whose partitioning follows ``rule``; each
    shard runs ``bind(local inputs, local out_avals, params)``."""
    return functools.partial(_partitioned, _Call(rule, tuple(sorted(params.items())), bind))
