"""The walk of a GEMM's lowering through the modules ("rooms"), kept short.

``dispatch.gemm`` walks a call from the primitive's request to the custom call: the problem
model plans it, the kernel side says what it takes and which config, the cache gives the
compiled kernel, and at launch the custom call is emitted. The walk is the sequence of modules
that dispatch calls into while a matmul (plain, fused, grouped) is lowered for sm_90a,
consecutive calls into one module being one stay. Dispatch itself is the corridor, not a room,
and neither are the base modules every layer reads (``test_import_graph.LAYERS``'s "base":
config, arch, layout, the activation registry). A walk that returns to a module it already
left more than ``MAX_RETURNS`` times is a design that has lost its direction.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import pytest

import jax_cute
from jax_cute import config
from test_import_graph import LAYERS, layer_of

MAX_RETURNS = 4
BASE = next(i for i, (name, _) in enumerate(LAYERS) if name == "base")
BF16 = jnp.bfloat16


def _s(*shape, dtype=BF16):
    return jax.ShapeDtypeStruct(shape, dtype)


CALLS = {
    "matmul": (lambda a, b: jax_cute.matmul(a, b), [_s(256, 128), _s(128, 64)]),
    "fused": (lambda a, b, c: jax_cute.matmul(a, b, bias=c, activation="swiglu"), [_s(256, 128), _s(128, 256), _s(256)]),
    "grouped": (lambda a, b, g, c: jax_cute.ragged_dot(a, b, g, bias=c, activation="silu"),
                [_s(512, 128), _s(4, 128, 64), _s(4, dtype=jnp.int32), _s(4, 64)]),
}


def walk(f, args) -> list[str]:
    """The rooms dispatch calls into while ``f`` is lowered for sm_90a, one entry per stay."""
    rooms: list[str] = []

    def profile(frame, event, arg):
        if event != "call" or frame.f_back is None or frame.f_back.f_globals.get("__name__") != "jax_cute.dispatch":
            return
        room = frame.f_globals.get("__name__", "")
        if room.startswith("jax_cute") and room != "jax_cute.dispatch" and layer_of(room) != BASE \
                and (not rooms or rooms[-1] != room):
            rooms.append(room)

    with config.override(target_arch="sm_90a"):
        traced = jax.jit(f).trace(*args)
        traced.lower(lowering_platforms=("cuda",))   # compiled (or loaded) once, outside the walk
        sys.setprofile(profile)
        try:
            jax.jit(lambda *xs: f(*xs)).trace(*args).lower(lowering_platforms=("cuda",))
        finally:
            sys.setprofile(None)
    return rooms


@pytest.mark.parametrize("name", sorted(CALLS))
def test_the_lowering_walk_returns_to_a_room_at_most_four_times(name):
    rooms = walk(*CALLS[name])
    assert rooms and rooms[-1] == "jax_cute.custom_call", rooms   # it reaches the custom call
    returns = len(rooms) - len(set(rooms))
    assert returns <= MAX_RETURNS, f"{len(rooms)} stays in {len(set(rooms))} rooms, {returns} returns: {rooms}"
