"""Named values that kernel methods hand each other while a kernel is traced.

A :class:`Bundle` is a plain Python object on purpose: the DSL flattens a dataclass or a named
tuple passed to a ``@cute.jit`` function into IR values (a Python int in it becomes a run-time
integer, which ``range_constexpr`` then refuses), while a plain object passes through as it is,
like ``self``. Imports no DSL.
"""

from __future__ import annotations

from typing import Any


class Bundle:
    """Fields named by the subclass's ``__slots__``, set positionally or by name (None when
    omitted)."""

    __slots__: tuple[str, ...] = ()

    def __init__(self, *values: Any, **named: Any):
        if len(values) > len(self.__slots__):
            raise TypeError(f"{type(self).__name__} takes {len(self.__slots__)} fields, not {len(values)}")
        for name, value in zip(self.__slots__, values):
            setattr(self, name, value)
        for name in self.__slots__[len(values):]:
            setattr(self, name, named.pop(name, None))
        if named:
            raise TypeError(f"{type(self).__name__} has no fields {sorted(named)}")
