"""The layering rule, checked from the code's imports (ast), so it stays true as the code grows.

schema imports nothing from runtime/cli and no torch/transformers/vllm; runtime never imports cli;
cli imports runtime (and heavy libraries) only inside function bodies; no module is over 600 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "coordexp"
FILES = sorted(PACKAGE.rglob("*.py"))
HEAVY = ("torch", "transformers", "vllm")
MAX_LINES = 600


def _imports(tree: ast.AST, top_level_only: bool) -> list[tuple[str, int]]:
    """(module, line) for every import; with ``top_level_only``, skip imports inside functions."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import) and not (top_level_only and in_function):
                found.extend((alias.name, child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and not (top_level_only and in_function):
                if child.level:  # relative import: resolve against the package path
                    found.append(("<relative>." + (child.module or ""), child.lineno))
                else:
                    found.append((child.module or "", child.lineno))
            visit(child, nested)

    visit(tree, False)
    return found


def _layer(path: Path) -> str:
    return path.relative_to(PACKAGE).parts[0] if len(path.relative_to(PACKAGE).parts) > 1 else "root"


def _is(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_package_has_the_three_layers():
    assert {"schema", "cli", "runtime"} <= {_layer(p) for p in FILES}


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_dependency_rule(path):
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    layer = _layer(path)
    every = _imports(tree, top_level_only=False)
    top = _imports(tree, top_level_only=True)
    where = path.relative_to(PACKAGE.parent)
    assert not [m for m, _ in every if m.startswith("<relative>")], f"{where}: use absolute coordexp.* imports"
    if layer == "schema":
        bad = [(m, n) for m, n in every if _is(m, "coordexp.runtime", "coordexp.cli", *HEAVY)]
        assert not bad, f"{where}: schema must not import runtime/cli/torch/transformers/vllm: {bad}"
    if layer == "runtime":
        bad = [(m, n) for m, n in every if _is(m, "coordexp.cli")]
        assert not bad, f"{where}: runtime must not import cli: {bad}"
    if layer == "cli":
        bad = [(m, n) for m, n in top if _is(m, "coordexp.runtime", *HEAVY)]
        assert not bad, f"{where}: cli may import runtime/heavy libraries only inside command bodies: {bad}"
    if layer == "root" and path.name == "__init__.py":
        bad = [(m, n) for m, n in top if _is(m, "coordexp.runtime", "coordexp.cli", *HEAVY)]
        assert not bad, f"{where}: importing coordexp must stay light: {bad}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_size(path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE.parent)} has {lines} lines (max {MAX_LINES}); split it"


def test_checker_catches_violations():
    """The rule itself works: a function-level runtime import is allowed in cli, a top-level one is not."""
    code = "import coordexp.runtime.x\ndef f():\n    import torch\n"
    tree = ast.parse(code)
    assert [m for m, _ in _imports(tree, top_level_only=True)] == ["coordexp.runtime.x"]
    assert [m for m, _ in _imports(tree, top_level_only=False)] == ["coordexp.runtime.x", "torch"]
