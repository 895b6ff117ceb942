"""jax_cute's modules import one way, down through layers (``LAYERS``), top to bottom:

  front      the facade, the command line, kernelize and its matcher
  primitives primitives/ and fp8/: the JAX rules of every primitive (fp8/: the block-scaled ones,
             their quantization and training layers)
  dispatch   dispatch (kernel or XLA), autotune and the first-use check it runs
  problem / cache / compile
             problem/ (layouts -> the flat problem), the kernel cache and its keys, and the
             custom call, which packs the descriptors of a kernel's signature (kernels/abi.py)
  kernels    kernels/: the CuTe DSL families, their specs, build and ABI
  base       leaves every layer reads: layout algebra, config, arch, the activation registry,
             jaxpr helpers, the runtime and the native extension

A module imports only modules of its own layer or of layers below it, and never a private
(underscore) name of another module. The graph counts every import of a jax_cute module, at
the top of a module or inside a function, so a cycle cannot hide behind a function-local
import. Function-local imports are allowed only where a module must not be imported eagerly
(the DSL's compiler, which a machine that only loads cached kernels may lack, and our native
extension, which may be unbuilt).
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
    "jax_cute.fp8.wgrad_operands": "the fp8 weight gradient's operand kernels: defined with the DSL",
    "jax_cute.fp8.weight_operands": "the fp8 weights' operand kernel: defined with the DSL",
}
EXTENSIONS = ("jax_cute._ffi",)

# Top to bottom: (layer, the modules in it: a name, or a package and everything under it)
LAYERS = (
    ("front", ("jax_cute", "jax_cute.__main__", "jax_cute.kernelize", "jax_cute.epilogue_match")),
    ("primitives", ("jax_cute.primitives", "jax_cute.fp8")),
    ("dispatch", ("jax_cute.dispatch", "jax_cute.autotune", "jax_cute.selfcheck")),
    ("problem / cache / compile", ("jax_cute.problem", "jax_cute.cache", "jax_cute.cache_key",
                                   "jax_cute.launcher_code", "jax_cute.custom_call")),
    ("kernels", ("jax_cute.kernels",)),
    ("base", ("jax_cute.layout", "jax_cute.config", "jax_cute.arch", "jax_cute.activations", "jax_cute.runtime",
              "jax_cute.version", "jax_cute.jaxprs", "jax_cute._ffi")),
)


def layer_of(module: str) -> int:
    """The index in ``LAYERS`` of ``module``'s layer (the longest matching name wins)."""
    best = None
    for i, (_, names) in enumerate(LAYERS):
        for n in names:
            if (module == n or module.startswith(n + ".")) and (best is None or len(n) > len(best[1])):
                best = (i, n)
    if best is None:
        raise AssertionError(f"{module} is in no layer of tests/test_import_graph.py's LAYERS")
    return best[0]


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


def test_modules_import_only_their_layer_and_below():
    modules = _modules()
    upward = []
    for m, p in modules.items():
        if m in EXTENSIONS:
            continue
        for n, _ in _imports(p, modules):
            if n in modules and layer_of(n) < layer_of(m):
                upward.append(f"{m} ({LAYERS[layer_of(m)][0]}) imports {n} ({LAYERS[layer_of(n)][0]})")
    assert not upward, "imports up the layers:\n" + "\n".join(sorted(set(upward)))


def _private_names(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> list[str]:
    """``module.name`` for each private name ``path`` imports from another jax_cute module
    (``from m import _x``; a private submodule such as the extension ``_ffi`` is a module, not a
    name) or reads as an attribute of an imported jax_cute module (``m._x``)."""
    tree = ast.parse(path.read_text())
    found, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("jax_cute"):
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in modules:
                    aliases[a.asname or a.name] = full
                elif a.name.startswith("_") and not a.name.startswith("__"):
                    found.append(full)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("jax_cute") and a.asname:
                    aliases[a.asname] = a.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                and node.attr.startswith("_") and not node.attr.startswith("__") \
                and f"{aliases[node.value.id]}.{node.attr}" not in modules:
            found.append(f"{aliases[node.value.id]}.{node.attr}")
    return found


def test_no_module_imports_a_private_name_of_another():
    modules = _modules()
    found = sorted({f"{m}: {name}" for m, p in modules.items() if m not in EXTENSIONS
                    for name in _private_names(p, modules)})
    assert not found, f"private names used across modules: {found}"


def test_the_private_name_check_sees_both_forms(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from jax_cute.primitives import sharding\nfrom jax_cute.layout import _x\n"
                   "sharding._one_shard(None)\n")
    modules = {"jax_cute.primitives.sharding": src, "jax_cute.layout": src}
    assert sorted(_private_names(src, modules)) == ["jax_cute.layout._x", "jax_cute.primitives.sharding._one_shard"]
