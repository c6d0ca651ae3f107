"""The layering rules, checked from the code's imports (ast), so they stay true as the code grows.

- ``coordexp.errors`` imports only the standard library; ``schema`` imports nothing from runtime/cli and no
  torch/transformers/vllm; importing ``coordexp`` stays light.
- ``runtime`` is layered by concern: ``core`` < ``model`` < ``rollout`` < ``server`` | ``train`` < ``toy``. A
  package imports only from its own layer or below (``server`` and ``train`` are peers and never import each other);
  ``core`` imports no heavy library at module level; runtime never imports cli.
- cli imports runtime (and heavy libraries) only inside command bodies.
- No import cycles between modules; no private (underscore) name imported across packages; no module over 600 lines.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "coordexp"
FILES = sorted(PACKAGE.rglob("*.py"))
HEAVY = ("torch", "transformers", "vllm")
MAX_LINES = 600
RUNTIME_RANK = {"core": 0, "model": 1, "rollout": 2, "server": 3, "train": 3, "toy": 4}
STDLIB = set(sys.stdlib_module_names)


def _imports(tree: ast.AST, top_level_only: bool) -> list[tuple[str, int]]:
    """(module, line) for every import; with ``top_level_only``, skip imports inside functions."""
    return [(module, line) for module, _, line in _import_names(tree, top_level_only)]


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _import_names(tree: ast.AST, top_level_only: bool, *, typing_too: bool = True
                  ) -> list[tuple[str, str | None, int]]:
    """(module, imported name or None, line) for every import; without ``typing_too``, skip ``if TYPE_CHECKING:``."""
    found: list[tuple[str, str | None, int]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if not typing_too and _is_type_checking(child):
                continue
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import) and not (top_level_only and in_function):
                found.extend((alias.name, None, child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and not (top_level_only and in_function):
                module = ("<relative>." + (child.module or "")) if child.level else (child.module or "")
                found.extend((module, alias.name, child.lineno) for alias in child.names)
            visit(child, nested)

    visit(tree, False)
    return found


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(path: Path) -> str:
    return path.relative_to(PACKAGE).parts[0] if len(path.relative_to(PACKAGE).parts) > 1 else "root"


def _runtime_package(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["coordexp", "runtime"] else None


def _package_of(module: str) -> str:
    return module.rsplit(".", 1)[0]


def _is(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


MODULES = {_module_name(p): p for p in FILES}


def _resolve(module: str, name: str | None) -> str:
    """``from a.b import c``: the module ``a.b.c`` when it is one, else ``a.b``."""
    if name and f"{module}.{name}" in MODULES:
        return f"{module}.{name}"
    return module


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        graph[name] = {
            target
            for module, alias, _ in _import_names(tree, top_level_only=False, typing_too=False)
            if (target := _resolve(module, alias)) in MODULES and target != name
        }
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


def test_package_has_the_layers():
    assert {"schema", "cli", "runtime"} <= {_layer(p) for p in FILES}
    assert set(RUNTIME_RANK) == {p.name for p in (PACKAGE / "runtime").iterdir() if (p / "__init__.py").is_file()}


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_dependency_rule(path):
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    layer = _layer(path)
    every = _imports(tree, top_level_only=False)
    top = _imports(tree, top_level_only=True)
    where = path.relative_to(PACKAGE.parent)
    assert not [m for m, _ in every if m.startswith("<relative>")], f"{where}: use absolute coordexp.* imports"
    if path.name == "errors.py" and layer == "root":
        bad = [(m, n) for m, n in every if m.split(".")[0] not in STDLIB and m != "__future__"]
        assert not bad, f"{where}: the error family imports only the standard library: {bad}"
    if layer == "schema":
        bad = [(m, n) for m, n in every if _is(m, "coordexp.runtime", "coordexp.cli", *HEAVY)]
        assert not bad, f"{where}: schema must not import runtime/cli/torch/transformers/vllm: {bad}"
    if layer == "runtime":
        bad = [(m, n) for m, n in every if _is(m, "coordexp.cli")]
        assert not bad, f"{where}: runtime must not import cli: {bad}"
        own = _runtime_package(_module_name(path))
        if own is not None:
            rank = RUNTIME_RANK[own]
            upward = [(m, n) for m, n in every if (other := _runtime_package(m)) is not None and other != own
                      and RUNTIME_RANK[other] >= rank]
            assert not upward, f"{where}: runtime.{own} may import only lower layers ({RUNTIME_RANK}): {upward}"
        if own == "core":
            heavy = [(m, n, line) for m, n, line in _import_names(tree, top_level_only=True, typing_too=False)
                     if _is(m, *HEAVY)]
            assert not heavy, f"{where}: core imports no torch/transformers/vllm at module level: {heavy}"
    if layer == "cli":
        bad = [(m, n) for m, n in top if _is(m, "coordexp.runtime", *HEAVY)]
        assert not bad, f"{where}: cli may import runtime/heavy libraries only inside command bodies: {bad}"
    if layer == "root" and path.name == "__init__.py":
        bad = [(m, n) for m, n in top if _is(m, "coordexp.runtime", "coordexp.cli", *HEAVY)]
        assert not bad, f"{where}: importing coordexp must stay light: {bad}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_private_name_crosses_a_package(path):
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    own = _package_of(_module_name(path)) if path.name != "__init__.py" else _module_name(path)
    bad = [
        (module, alias, line)
        for module, alias, line in _import_names(tree, top_level_only=False)
        if module.startswith("coordexp") and alias and alias.startswith("_") and not alias.startswith("__")
        and _package_of(module) != own and module != own
    ]
    assert not bad, f"{path.relative_to(PACKAGE.parent)} imports private names of another package: {bad}"


def test_no_import_cycles():
    assert _cycles(_graph()) == []


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_size(path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE.parent)} has {lines} lines (max {MAX_LINES}); split it"


def test_checker_catches_violations():
    """The rules themselves work: a function-level runtime import is allowed in cli, a top-level one is not; a
    two-module loop is a cycle; an upward import is reported."""
    code = "import coordexp.runtime.x\ndef f():\n    import torch\n"
    tree = ast.parse(code)
    assert [m for m, _ in _imports(tree, top_level_only=True)] == ["coordexp.runtime.x"]
    assert [m for m, _ in _imports(tree, top_level_only=False)] == ["coordexp.runtime.x", "torch"]
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    assert _runtime_package("coordexp.runtime.train.trainer") == "train"
    assert _runtime_package("coordexp.schema.root") is None
