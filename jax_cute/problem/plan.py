"""One entry from a call's layouts to the flat problem a kernel takes, dense or grouped.

``plan`` is what dispatch asks of the problem model: the flat problem (``gemm_plan`` for a dense
GEMM, ``ragged_layouts.flatten_grouped`` for a grouped one), the buffer shapes it needs, and
for a dense call that may take copies, the rewrite that makes it expressible; or why there is
none. ``prepare`` readies the operands at launch as the plan says (padding, the one copy).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp

from jax_cute.problem.gemm_layouts import GemmLayouts
from jax_cute.problem.gemm_plan import FlatGemm, Rewrite, materialise, plan_gemm, plan_with_copies
from jax_cute.problem.ragged_layouts import FlatGrouped, RaggedLayouts, flatten_grouped

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    flat: FlatGemm | FlatGrouped
    buffers: tuple[Shape, Shape, Shape]   # a, b, c as the kernel reads and writes them (padded)
    given: tuple[Shape, Shape, Shape]     # a, b, c as the call has them (a rewrite's own for c)
    rewrite: Rewrite | None
    batch_modes: int                      # the kernel's batch modes (C's)
    padded_c: bool                        # C's buffer is padded: the output is sliced back


def plan(layouts: GemmLayouts | RaggedLayouts, shapes: Sequence[Shape], dtypes: Sequence[str], *,
         copies: bool, unaligned_c: bool = False) -> Plan | str:
    """The kernel problem of a call with ``layouts`` over inputs of ``shapes`` (a, b) and the
    ``dtypes`` of a, b and c, or why there is none. ``copies``: a dense call may be rewritten
    into copies (``gemm_plan.plan_with_copies``); otherwise its buffers may only be padded.
    ``unaligned_c``: a dense call's kernel stores C without TMA (``gemm_plan.plan_gemm``)."""
    c_shape = tuple(layouts.c_shape)
    given = [tuple(shapes[0]), tuple(shapes[1]), c_shape]
    if isinstance(layouts, RaggedLayouts):
        flat = flatten_grouped(layouts, dtypes)
        return flat if isinstance(flat, str) else Plan(flat, tuple(given), tuple(given), None, 1, False)
    rewrite = None
    if copies:
        flat, buffers, given, rewrite = plan_with_copies(layouts, given, dtypes, unaligned_c)
    else:
        flat, buffers = plan_gemm(layouts, given, dtypes, unaligned_c)
    if isinstance(flat, str):
        return flat
    buffers, given = tuple(map(tuple, buffers)), tuple(map(tuple, given))
    return Plan(flat, buffers, given, rewrite, flat.batch_modes, buffers[2] != given[2])


def prepare(p: Plan, a, b) -> tuple:
    """The operands as the kernel reads them: padded to the plan's buffers, and an operand no
    kernel layout expresses copied into one (the plan's logged copy)."""
    a, b = _pad_to(a, p.buffers[0]), _pad_to(b, p.buffers[1])
    flat = p.flat
    if isinstance(flat, FlatGemm):
        if flat.a_src is not None:
            a = materialise(a, flat.a_src, flat.a)
        if flat.b_src is not None:
            b = materialise(b, flat.b_src, flat.b)
    return a, b


def _pad_to(x, shape: Shape):
    return x if x.shape == tuple(shape) else jnp.pad(x, [(0, n - m) for m, n in zip(x.shape, shape)])
