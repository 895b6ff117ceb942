"""Every function in jax_cute/kernels stays small: at most 150 lines and 12 parameters.

Lines run from the ``def`` (decorators excluded) to the function's last line, docstring and
comments included; parameters count every name a caller may pass (positional, keyword-only,
``*args`` and ``**kwargs``), not ``self`` or ``cls``. Nested functions count on their own
and inside the function that holds them.
"""

from __future__ import annotations

import ast
import pathlib

KERNELS = pathlib.Path(__file__).resolve().parents[1] / "jax_cute" / "kernels"
MAX_LINES = 150
MAX_PARAMS = 12


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    names += [p.arg for p in (a.vararg, a.kwarg) if p is not None]
    return len([n for n in names if n not in ("self", "cls")])


def _functions(path: pathlib.Path) -> list[tuple[str, int, int]]:
    """(qualified name, lines, parameters) of every function in ``path``."""
    out = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                out.append((name, child.end_lineno - child.lineno + 1, _params(child)))
                walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(ast.parse(path.read_text()), "")
    return out


def test_kernel_functions_are_small():
    too_big = [f"{path.name}:{name} ({lines} lines, {params} parameters)"
               for path in sorted(KERNELS.glob("*.py")) for name, lines, params in _functions(path)
               if lines > MAX_LINES or params > MAX_PARAMS]
    assert not too_big, "functions over 150 lines or 12 parameters:\n" + "\n".join(too_big)


def test_the_walker_counts_lines_and_parameters(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("class K:\n    def f(self, a, b=1, *c, d, **e):\n        def g(x):\n            return x\n"
                   "        return g\n")
    assert _functions(src) == [("K.f", 4, 5), ("K.f.g", 2, 1)]
