"""YAML reading and writing with YAML 1.2 scalars: ``yes``/``on``/``010``/``1:30`` stay strings, not bool/int.

Duplicate keys and non-string keys are errors instead of silently keeping the last value. Reading is bounded so
that no file can hang ``validate``: at most :data:`MAX_CONFIG_BYTES` per file, and at most :data:`MAX_YAML_NODES`
nodes per document with every alias expanded (a 334-byte alias bomb expands to 10**9 nodes).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from coordexp.schema.file_read import FileReadError, read_capped_text

__all__ = ["YamlReadError", "read_yaml_file", "parse_yaml_text", "dump_yaml", "MAX_CONFIG_BYTES", "MAX_YAML_NODES"]

MAX_CONFIG_BYTES = 256 * 1024
"""Size cap of one config file (the examples are about 2 KiB): parsing up to the cap stays well under a second."""
MAX_YAML_NODES = 20_000
"""Cap on the nodes of one document with every alias expanded at each use (a full config has a few hundred)."""


class YamlReadError(FileReadError):
    """The file could not be read or parsed; ``hint`` says how to fix it."""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader with the YAML 1.2 core schema for bool/int/float/null."""


_YAML11_ONLY = {"bool", "int", "float", "timestamp"}
_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag.rsplit(":", 1)[-1] not in _YAML11_ONLY]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}

_CORE = (
    ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
    ("tag:yaml.org,2002:int", r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", "-+0123456789"),
    (
        "tag:yaml.org,2002:float",
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$",
        "-+.0123456789",
    ),
)
for _tag, _pattern, _first in _CORE:
    _StrictLoader.add_implicit_resolver(_tag, re.compile(_pattern), list(_first))


def _construct_bool(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> bool:
    return loader.construct_scalar(node).lower() == "true"


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    if text.startswith(("0o", "0x")):
        return int(text, 0)
    return int(text, 10)


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict:
    own_keys: set = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if not isinstance(key, str):
            raise YamlReadError(
                f"line {line}: key {key!r} is a {type(key).__name__}, keys must be strings",
                "Quote the key or fix the indentation.",
            )
        if key in own_keys:
            raise YamlReadError(f"line {line}: duplicate key {key!r}", "Keep one occurrence of the key.")
        own_keys.add(key)
    loader.flatten_mapping(node)  # merge keys (<<) come first, so the mapping's own keys win
    mapping: dict = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, str):
            raise YamlReadError(f"line {key_node.start_mark.line + 1}: keys must be strings", "Quote the key.")
        mapping[key] = loader.construct_object(value_node, deep=True)
    return mapping


_StrictLoader.add_constructor("tag:yaml.org,2002:bool", _construct_bool)
_StrictLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)

if getattr(yaml, "__with_libyaml__", False):

    class _StrictCLoader(yaml.CSafeLoader):
        """The same schema and constructors over libyaml's parser (several times faster than pure Python)."""

    _StrictCLoader.yaml_implicit_resolvers = _StrictLoader.yaml_implicit_resolvers
    _StrictCLoader.yaml_constructors = _StrictLoader.yaml_constructors
    _LOADER: type = _StrictCLoader
else:  # pragma: no cover - PyYAML built without libyaml
    _LOADER = _StrictLoader


def _children(node: yaml.Node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _check_expanded_size(root: yaml.Node) -> None:
    """Refuse documents whose alias-expanded node count exceeds :data:`MAX_YAML_NODES`, or that are recursive.

    Sizes are memoised per distinct node (an alias is the anchored node object itself), so an alias bomb costs
    its few distinct nodes here instead of the billion that later walks would visit.
    """
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            on_path.discard(key)
            sizes[key] = 1 + sum(sizes.get(id(child), 1) for child in _children(node))  # a scalar is 1
            if sizes[key] > MAX_YAML_NODES:
                raise YamlReadError(
                    f"document expands to more than {MAX_YAML_NODES:,} nodes (each use of an alias counts its whole "
                    f"anchored value; line {node.start_mark.line + 1})",
                    f"A config has a few hundred nodes; the cap is {MAX_YAML_NODES:,}. Write the values out instead "
                    "of nesting aliases.",
                )
            continue
        if key in sizes:
            continue
        on_path.add(key)
        stack.append((node, True))
        for child in _children(node):
            if isinstance(child, yaml.ScalarNode):
                continue
            if id(child) in on_path:
                raise YamlReadError(
                    f"line {child.start_mark.line + 1}: recursive alias (an anchored value contains itself)",
                    "Remove the alias that points back into its own anchor.",
                )
            if id(child) not in sizes:
                stack.append((child, False))


def parse_yaml_text(text: str) -> Any:
    """Parse one YAML document; raises :class:`YamlReadError` with the line on any syntax problem."""
    try:
        loader = _LOADER(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            _check_expanded_size(node)
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except YamlReadError:
        raise
    except yaml.YAMLError as exc:
        raise _syntax_error(exc, text) from None
    except RecursionError:
        raise YamlReadError("invalid YAML: nesting is too deep", "Flatten the document.") from None


_UNCLOSED = ("simple key", "quoted scalar", "flow sequence", "flow mapping")
"""Parser contexts that begin a construct the problem found only later (a key without ``:``, a quote or bracket not
closed): the problem mark lies on a later line, often the next key's or the end of the file, so the line named is
the context's, where the construct began."""


def _syntax_error(exc: yaml.YAMLError, text: str) -> YamlReadError:
    """The line at fault (the unclosed construct's first line, never past the last line), its text, and "tab" when a
    tab character is the cause (YAML indents with spaces only)."""
    mark, context = getattr(exc, "problem_mark", None), getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    if mark is None:
        return YamlReadError(f"invalid YAML: {problem}", "Fix the YAML syntax.")
    lines = text.splitlines() or [""]
    at = lines[mark.line] if mark.line < len(lines) else ""
    if "\t" in at[:mark.column + 1].lstrip(" ") or "tab" in problem and "\t" in at:
        column = at.index("\t")
        return YamlReadError(f"invalid YAML: line {mark.line + 1}, column {column + 1}: a tab character ({problem}) "
                             f"in line {mark.line + 1}: {at[:120]!r}",
                             "YAML indents with spaces only: replace the tab with spaces.")
    line, column = mark.line, mark.column
    where = str(getattr(exc, "context", None) or "")
    if context is not None and context.line < line and any(kind in where for kind in _UNCLOSED):
        line, column, problem = context.line, context.column, f"{problem} ({where}, which begins here)"
    if line >= len(lines) or not lines[line].strip():  # the end of the file: the last line that holds text
        line = max((i for i, text_line in enumerate(lines[:line + 1]) if text_line.strip()), default=0)
        column = len(lines[line])
    return YamlReadError(f"invalid YAML: line {line + 1}, column {column + 1}: {problem}; line {line + 1}: "
                         f"{lines[line][:120]!r}", "Fix the YAML syntax at that position.")


def read_yaml_file(path: Path) -> Any:
    """Read and parse ``path``; every failure (missing, directory, binary, syntax) is a :class:`YamlReadError`."""
    text = read_capped_text(path, max_bytes=MAX_CONFIG_BYTES, kind="YAML", suffix=".yaml", error=YamlReadError)
    return parse_yaml_text(text)


class _Dumper(yaml.SafeDumper):
    """Block style, insertion order, quoting strings that YAML 1.1 readers would turn into bool/int."""


def _represent_str(dumper: yaml.SafeDumper, value: str):
    style = None
    if value.lower() in {"yes", "no", "on", "off", "y", "n", "true", "false", "null", "~"}:
        style = "'"
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)


def dump_yaml(data: Any) -> str:
    """Canonical YAML text for a plain mapping (keys keep their order)."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True, width=110)
