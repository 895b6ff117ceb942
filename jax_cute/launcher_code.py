"""The code a user's ``cute_call`` launcher compiles: a digest to key its disk cache entry on.

The DSL compiles the launcher and, through it, every ``@cute.kernel`` and ``@cute.jit``
function it calls, reading them from their modules as they are now. So the digest covers the
launcher's source and, recursively, the source of every function, class or module-level
constant of user code its code names (globals, closure cells, attributes of user modules it
names). Libraries (the DSL, JAX, numpy, the standard library, jax_cute, whose kernel sources
are keyed anyway) are keyed by their versions elsewhere and not walked.

What cannot be keyed (a function without readable source, an object of a user class) makes
:func:`launcher_digest` return the reason instead: such a kernel is cached in memory only.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import sys
import types
from typing import Callable

# Top-level packages whose code is keyed by version (cache_key.TOOLCHAIN) or not part of a
# kernel's code, and is therefore not walked.
_LIBRARIES = frozenset({"cutlass", "cuda", "nvidia_cutlass_dsl", "jax", "jaxlib", "numpy", "jax_cute", "ml_dtypes",
                        "typing_extensions"})
_SIMPLE = (int, float, complex, bool, str, bytes, type(None), type(Ellipsis))


class _Unkeyable(Exception):
    pass


def _is_library(module_name: str | None) -> bool:
    top = (module_name or "").partition(".")[0]
    return top in _LIBRARIES or top in sys.stdlib_module_names or top == "builtins"


def _constant(value: object) -> str | None:
    """A stable text for a constant (numbers, strings, and tuples, lists, sets and dicts of
    them), else None."""
    if isinstance(value, _SIMPLE):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, (tuple, list)):
        items = [_constant(v) for v in value]
        return None if None in items else f"{type(value).__name__}:[{','.join(items)}]"
    if isinstance(value, (set, frozenset)):
        items = [_constant(v) for v in value]
        return None if None in items else f"{type(value).__name__}:[{','.join(sorted(items))}]"
    if isinstance(value, dict):
        items = [(_constant(k), _constant(v)) for k, v in value.items()]
        if any(k is None or v is None for k, v in items):
            return None
        return "dict:{" + ",".join(sorted(f"{k}={v}" for k, v in items)) + "}"
    return None


def _code_names(code: types.CodeType) -> set[str]:
    """Every global or attribute name ``code`` and its nested code objects use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


class _Walk:
    def __init__(self) -> None:
        self.hash = hashlib.sha256()
        self.seen: set[int] = set()

    def add(self, label: str, text: str) -> None:
        self.hash.update(f"{label}\0{len(text)}\0{text}\0".encode())

    def value(self, label: str, value: object, names: set[str]) -> None:
        """Key ``value`` (reached as ``label``) by what it is."""
        text = _constant(value)
        if text is not None:
            self.add(label, text)
            return
        if isinstance(value, types.ModuleType):
            if _is_library(value.__name__) or id(value) in self.seen:
                return
            self.seen.add(id(value))
            # a user module: key the names the code takes from it (``mod.kernel``)
            for name in sorted(names):
                if name in vars(value):
                    self.value(f"{label}.{name}", vars(value)[name], names)
            return
        if isinstance(value, functools.partial):
            self.value(f"{label}.func", value.func, names)
            for i, arg in enumerate((*value.args, *value.keywords.values())):
                self.value(f"{label} argument {i}", arg, names)
            self.add(f"{label} keywords", ",".join(sorted(value.keywords)))
            return
        if isinstance(value, (types.FunctionType, type)) or hasattr(value, "__wrapped__"):
            self.function(label, value)  # (library functions and classes are skipped there)
            return
        if isinstance(value, types.BuiltinFunctionType) or (
                _is_library(type(value).__module__) and type(value).__module__ != "builtins"):
            return  # builtins such as min, and objects of library types (DSL numeric types, dtypes)
        raise _Unkeyable(f"{label} is a {type(value).__name__} object, which cannot be keyed on its code")

    def function(self, label: str, fn: Callable) -> None:
        fn = inspect.unwrap(fn)
        if id(fn) in self.seen:
            return
        self.seen.add(id(fn))
        if _is_library(getattr(fn, "__module__", None)):
            return
        qual = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"
        try:
            source = inspect.getsource(fn)
        except (OSError, TypeError):
            raise _Unkeyable(f"the source of {qual} (reached as {label}) cannot be read") from None
        self.add(qual, source)
        if isinstance(fn, type):
            return  # a class: its source is its code; its methods' globals are its module's
        if not isinstance(fn, types.FunctionType):
            raise _Unkeyable(f"{qual} (reached as {label}) is not a Python function")
        names = _code_names(fn.__code__)
        for default in (fn.__defaults__ or ()) + tuple((fn.__kwdefaults__ or {}).values()):
            self.value(f"{qual} default", default, names)
        free = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
        for name, cell in sorted(free.items()):
            try:
                content = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            self.value(f"{qual} closure {name}", content, names)
        for name in sorted(names):
            if name in fn.__globals__:
                self.value(f"{qual} global {name}", fn.__globals__[name], names)


def launcher_digest(launcher: Callable) -> tuple[str | None, str]:
    """(digest, "") of the code ``launcher`` compiles, or (None, why it cannot be keyed)."""
    walk = _Walk()
    try:
        walk.function("the launcher", launcher)
    except _Unkeyable as e:
        return None, str(e)
    except RecursionError:
        return None, "its code references nest too deeply to walk"
    return walk.hash.hexdigest(), ""
