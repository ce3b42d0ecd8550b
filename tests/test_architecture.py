"""The shape of the code base, held by reading its source (docs/ARCHITECTURE.md):

- the concept map: which concept (package, or part of one) may import which, lazy imports
  and ``importlib`` imports counted (those under ``TYPE_CHECKING`` aside);
- no import cycle between modules, counted the same way;
- no function over ``MAX_FUNCTION_LINES`` lines (its docstring aside; Triton kernels, device
  code written as one unit, aside);
- ``engines/`` keeps at most six modules at its root (the contract and its facades);
- sizes: files over 500 lines and classes over 25 methods or 400 lines are reported (printed);
  only god-object sizes fail (800 lines, 35 methods).
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("relay", "engines", "reward", "launcher")
#: concept -> the concepts it may import. engines' root holds the contract (interface.py,
#: kv_pool.py, settings.py) and its facade (actor.py: the engine behind relay, whichever backend).
CONCEPTS: dict[str, set[str]] = {
    "relay": set(),
    "engines.contract": {"relay"},
    "engines.kernels": set(),
    "engines.models": {"relay", "engines.contract", "engines.kernels"},
    "engines.weight_sync": {"relay", "engines.contract"},
    "engines.builtin": {"relay", "engines.contract", "engines.kernels", "engines.models", "engines.weight_sync"},
    "engines.sglang": {"relay", "engines.contract", "engines.weight_sync"},
    "engines.trainer": {"relay", "engines.contract", "engines.kernels", "engines.models", "engines.weight_sync"},
    "engines.facade": {"relay", "engines.contract", "engines.builtin", "engines.sglang"},
    "reward": {"relay", "engines.contract"},
    "launcher": {"relay", "engines.contract", "engines.facade", "engines.models", "engines.builtin",
                 "engines.trainer", "engines.weight_sync", "reward"},
}
ENGINE_PARTS = ("models", "kernels", "builtin", "sglang", "trainer", "weight_sync")
MAX_ENGINES_ROOT_MODULES = 6
MAX_FUNCTION_LINES = 80
REPORT_FILE_LINES, FAIL_FILE_LINES = 500, 800
REPORT_CLASS_METHODS, FAIL_CLASS_METHODS = 25, 35
REPORT_CLASS_LINES, FAIL_CLASS_LINES = 400, 800


def _modules() -> dict[str, str]:
    """Production module name -> path."""
    out = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    out[module.removesuffix(".__init__")] = path
    return out


MODULES = _modules()
TREES = {module: ast.parse(open(path).read(), path) for module, path in MODULES.items()}


def concept(module: str) -> str:
    if module in ("engines", "engines.interface", "engines.kv_pool", "engines.settings"):
        return "engines.contract"
    if module == "engines.actor":
        return "engines.facade"
    parts = module.split(".")
    if parts[0] == "engines" and len(parts) > 1 and parts[1] in ENGINE_PARTS:
        return f"engines.{parts[1]}"
    return parts[0]


def _resolve(name: str, module: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name if name and name != module else None


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                skip |= {id(n) for n in ast.walk(sub)}
    return skip


def imports(module: str) -> set[str]:
    """Repository modules that ``module`` imports anywhere in it (relative imports resolved;
    ``importlib.import_module("x")`` with a literal name counted; TYPE_CHECKING imports not)."""
    tree = TREES[module]
    skip = _type_checking_nodes(tree)
    package = module if MODULES[module].endswith("__init__.py") else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            # `from package import module` imports that module; `from module import name`, the module
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        elif (isinstance(node, ast.Call) and ast.unparse(node.func) in ("importlib.import_module", "import_module")
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names = [node.args[0].value]
        else:
            continue
        found |= {m for m in (_resolve(name, module) for name in names) if m}
    return found


GRAPH = {module: imports(module) for module in MODULES}


def test_concepts_import_only_what_the_concept_map_allows():
    against = sorted(f"{module} -> {other}" for module, others in GRAPH.items() for other in others
                     if concept(other) != concept(module) and concept(other) not in CONCEPTS[concept(module)])
    assert not against, f"imports against the concept map (tests/test_architecture.py CONCEPTS): {against}"


def test_no_import_cycle_between_modules_counting_lazy_imports():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def strong(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            strong(module)
    assert not cycles, f"modules that import each other (directly or around a cycle): {cycles}"


def _code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    first = node.body[0]
    docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
        first.value.value, str)
    start = first.end_lineno + 1 if docstring and len(node.body) > 1 else first.lineno
    return node.end_lineno - start + 1


def test_no_function_is_over_80_lines():
    long = {}
    for module, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if any("jit" in ast.unparse(d) for d in node.decorator_list):
                    continue  # a Triton kernel: device code, one unit
                if (n := _code_lines(node)) > MAX_FUNCTION_LINES:
                    long[f"{module}.{node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (docstring aside): {long}"


def test_engines_root_holds_the_contract_and_its_facades_only():
    root = sorted(name for name in os.listdir(os.path.join(ROOT, "engines")) if name.endswith(".py"))
    assert len(root) <= MAX_ENGINES_ROOT_MODULES, f"engines/ has {len(root)} modules at its root: {root}"


def _class_sizes() -> dict[str, tuple[int, int]]:
    """Each class: (methods counted over its bases defined here, lines)."""
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

    return {f"{module}.{node.name}": (len(methods(node, {node.name})), node.end_lineno - node.lineno + 1)
            for module, tree in TREES.items() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}


def test_sizes_are_reported_and_only_god_objects_fail():
    files = {module: len(open(path).read().splitlines()) for module, path in MODULES.items()}
    classes = _class_sizes()
    big_files = {m: n for m, n in files.items() if n > REPORT_FILE_LINES}
    big_classes = {c: s for c, s in classes.items() if s[0] > REPORT_CLASS_METHODS or s[1] > REPORT_CLASS_LINES}
    print(f"size report: files over {REPORT_FILE_LINES} lines {big_files}; classes over {REPORT_CLASS_METHODS} "
          f"methods or {REPORT_CLASS_LINES} lines (methods, lines) {big_classes}")
    gods = {m: n for m, n in files.items() if n > FAIL_FILE_LINES}
    gods |= {c: s for c, s in classes.items() if s[0] > FAIL_CLASS_METHODS or s[1] > FAIL_CLASS_LINES}
    assert not gods, f"god objects (files over {FAIL_FILE_LINES} lines, classes over {FAIL_CLASS_METHODS} methods " \
                     f"or {FAIL_CLASS_LINES} lines): {gods}"


def test_the_checks_see_what_they_claim():
    """The import reader finds lazy, relative and importlib imports and skips TYPE_CHECKING ones."""
    assert "engines.builtin.tp" in GRAPH["engines.actor"]  # a lazy import inside a method
    assert "relay._forkserver" in GRAPH["relay._zygote"]  # a lazy import inside a function
    assert "relay._runtime" not in GRAPH["relay._processes"]  # only under TYPE_CHECKING there
    assert concept("engines.builtin.engine") == "engines.builtin" and concept("engines.actor") == "engines.facade"
