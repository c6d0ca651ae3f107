"""YAML reading and writing with YAML 1.2 scalars: ``yes``/``on``/``010``/``1:30`` stay strings, not bool/int.

Duplicate keys and non-string keys are errors instead of silently keeping the last value.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

__all__ = ["YamlReadError", "read_yaml_file", "parse_yaml_text", "dump_yaml"]


class YamlReadError(Exception):
    """The file could not be read or parsed; ``hint`` says how to fix it."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.message = message
        self.hint = hint


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


def parse_yaml_text(text: str) -> Any:
    """Parse one YAML document; raises :class:`YamlReadError` with the line on any syntax problem."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - _StrictLoader derives from SafeLoader
    except YamlReadError:
        raise
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise YamlReadError(f"invalid YAML: {where}{problem}", "Fix the YAML syntax at that position.") from None
    except RecursionError:
        raise YamlReadError("invalid YAML: nesting is too deep", "Flatten the document.") from None


def read_yaml_file(path: Path) -> Any:
    """Read and parse ``path``; every failure (missing, directory, binary, syntax) is a :class:`YamlReadError`."""
    if not path.exists():
        raise YamlReadError("file not found", "Check the path (relative paths are from the current directory).")
    if path.is_dir():
        raise YamlReadError("is a directory, not a YAML file", "Pass a .yaml file.")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise YamlReadError(f"cannot read file ({exc.strerror or exc})", "Check the file permissions.") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise YamlReadError("not a UTF-8 text file (binary data?)", "Pass a YAML config file.") from None
    if "\x00" in text:
        raise YamlReadError("not a text file (contains NUL bytes)", "Pass a YAML config file.")
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
