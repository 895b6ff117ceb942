"""A kernel's ``@cute.jit`` launcher, derived from its ABI signature (kernels/abi.py).

The compiled launcher takes one argument per :class:`~jax_cute.kernels.abi.Signature` entry, in
order (the handler fills them from the same signature): :func:`launcher_for` builds that
function once for any signature and hands the arguments, by name, to the kernel's own entry
point. Imports the DSL: only kernel builds import it.
"""

from __future__ import annotations

import inspect
from typing import Callable

from jax_cute.kernels import abi
from jax_cute.kernels.dsl import cute, cuda_driver, Float32, Int32, Int64

_SCALARS = {"int32": Int32, "int64": Int64, "float32": Float32}


def annotation(arg: abi.Arg) -> type:
    """The DSL type a launcher's parameter for ``arg`` is declared with."""
    if isinstance(arg, abi.TensorArg):
        return cute.Tensor
    if isinstance(arg, abi.StreamArg):
        return cuda_driver.CUstream
    return _SCALARS[arg.dtype]


def launcher_for(signature: abi.Signature, body: Callable[..., None]) -> Callable:
    """A ``@cute.jit`` function whose parameters are ``signature``'s arguments (named and typed
    after them, in order) and which calls ``body`` with them as keyword arguments."""
    names = tuple(a.name for a in signature)
    if len(set(names)) != len(names) or not all(n.isidentifier() for n in names):
        raise ValueError(f"a launcher's arguments need distinct identifier names, not {names}")

    def launch(*args):
        body(**dict(zip(names, args)))

    launch.__signature__ = inspect.Signature(
        [inspect.Parameter(a.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=annotation(a))
         for a in signature])
    return cute.jit(launch)
