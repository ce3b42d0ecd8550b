"""The shape of the code base, held by reading its source (docs/ARCHITECTURE.md):

- no production file over 500 lines;
- no class over 25 methods, counted over its bases defined here (a mixin does not hide
  size), nor over 400 lines;
- no import cycle between modules;
- packages import only downwards: relay <- engines <- reward <- launcher (relay imports none
  of the others, engines only relay, reward relay and engines).
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = ("relay", "engines", "reward", "launcher")  # each may import only those before it
MAX_FILE_LINES = 500
MAX_CLASS_METHODS = 25
MAX_CLASS_LINES = 400


def _modules() -> dict[str, str]:
    """Production module name -> path."""
    out = {}
    for package in LAYERS:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    out[module.removesuffix(".__init__")] = path
    return out


MODULES = _modules()
TREES = {module: ast.parse(open(path).read(), path) for module, path in MODULES.items()}


def _imports(module: str, tree: ast.AST, top_level_only: bool) -> set[str]:
    """Repository modules that ``module`` imports (relative imports resolved)."""
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    package = module if MODULES[module].endswith("__init__.py") else module.rpartition(".")[0]
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            # `from package import module` imports that module; `from module import name`, the module
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def test_no_production_file_is_over_500_lines():
    long = {
        module: n for module, path in MODULES.items() if (n := len(open(path).read().splitlines())) > MAX_FILE_LINES
    }
    assert not long, f"files over {MAX_FILE_LINES} lines: {long}"


def test_no_class_is_over_25_methods_counted_over_its_bases_or_over_400_lines():
    classes: dict[str, ast.ClassDef] = {}
    for tree in TREES.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, node)  # by name: bases are referred to by name

    def methods(cls: ast.ClassDef, seen: set) -> set[str]:
        names = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for base in cls.bases:
            name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
            if name in classes and name not in seen:
                names |= methods(classes[name], seen | {name})
        return names

    big = {}
    for module, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                count, lines = len(methods(node, {node.name})), node.end_lineno - node.lineno + 1
                if count > MAX_CLASS_METHODS or lines > MAX_CLASS_LINES:
                    big[f"{module}.{node.name}"] = f"{count} methods, {lines} lines"
    assert not big, f"classes over {MAX_CLASS_METHODS} methods or {MAX_CLASS_LINES} lines: {big}"


def test_no_import_cycle_between_modules():
    graph = {module: _imports(module, tree, top_level_only=True) for module, tree in TREES.items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done
    cycles = []

    def visit(module: str, path: list) -> None:
        state[module] = 1
        for other in sorted(graph[module]):
            if state.get(other) == 1:
                cycles.append(path[path.index(other) :] + [other] if other in path else [module, other])
            elif other not in state:
                visit(other, path + [other])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, f"import cycles: {cycles}"


def test_packages_import_only_downwards():
    upward = []
    for module, tree in TREES.items():
        layer = LAYERS.index(module.split(".")[0])
        for other in _imports(module, tree, top_level_only=False):  # lazy imports count too
            if LAYERS.index(other.split(".")[0]) > layer:
                upward.append(f"{module} -> {other}")
    assert not upward, f"imports against the layering {' <- '.join(LAYERS)}: {sorted(upward)}"
