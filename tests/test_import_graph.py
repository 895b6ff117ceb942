"""jax_cute's modules import one way: primitive -> dispatch -> cache/compile -> custom call.

The graph counts every import of a jax_cute module, at the top of a module or inside a
function, so a cycle cannot hide behind a function-local import. Function-local imports are
allowed only where a module must not be imported eagerly (the DSL's compiler, which a machine
that only loads cached kernels may lack, and our native extension, which may be unbuilt).
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "jax_cute"

# jax_cute modules that may be imported inside a function, and why
LAZY = {
    "jax_cute.kernels.dsl": "imports the DSL's compiler",
    "jax_cute.kernels.sm90_kernel": "the Hopper kernel: imports the DSL's compiler (sm90_gemm builds launchers with it)",
    "jax_cute.kernels.sm100_kernel": "the Blackwell kernel: imports the DSL's compiler (sm100_gemm builds launchers "
                                     "with it)",
    "jax_cute._ffi": "the native extension, which may not be built",
}
EXTENSIONS = ("jax_cute._ffi",)


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    found = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {**found, **{e: PACKAGE for e in EXTENSIONS}}


def _imports(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> list[tuple[str, bool]]:
    """(imported jax_cute module, imported inside a function) for every import in ``path``."""
    tree = ast.parse(path.read_text())
    nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f) if n is not f}
    out = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import sub` imports the submodule sub; `from mod import name` imports mod
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                     for a in node.names]
        out += [(n, id(node) in nested) for n in names if n == "jax_cute" or n.startswith("jax_cute.")]
    return out


def test_no_import_cycle_in_jax_cute():
    modules = _modules()
    graph = {m: sorted({n for n, _ in _imports(p, modules) if n != m}) for m, p in modules.items()
             if m not in EXTENSIONS}
    # The package's __init__ is the public facade: nothing inside may import it, except the
    # command line (python -m jax_cute), which is a user of the package like any other.
    importers = [m for m, deps in graph.items() if "jax_cute" in deps and m not in ("jax_cute", "jax_cute.__main__")]
    assert not importers, f"modules importing the jax_cute facade itself: {importers}"
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in graph.get(m, []):
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n] if n in stack else [m, n]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if n in graph and not state.get(n):
                visit(n, stack + [n])
        state[m] = 2

    for m in graph:
        if not state.get(m):
            visit(m, [m])


def test_function_local_imports_are_only_the_lazy_ones():
    modules = _modules()
    found = {(m, n) for m, p in modules.items() if m not in EXTENSIONS
             for n, inside in _imports(p, modules) if inside}
    unexpected = sorted((m, n) for m, n in found if n not in LAZY)
    assert not unexpected, f"function-local imports of jax_cute modules: {unexpected}"


def test_the_graph_sees_function_local_imports(tmp_path):
    """The walker itself: an import inside a function is found and marked as such."""
    src = tmp_path / "m.py"
    src.write_text("import jax_cute.layout\n\ndef f():\n    from jax_cute import dispatch\n")
    found = _imports(src, {"jax_cute.dispatch": src, "jax_cute.layout": src})
    assert ("jax_cute.layout", False) in found and ("jax_cute.dispatch", True) in found
