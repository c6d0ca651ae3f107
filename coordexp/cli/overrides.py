"""``--set dotted.key=value`` overrides: applied to the loaded YAML (after ``extends``) before validation, so an
override is validated exactly like the file; values are YAML scalars (``--set training.max_steps=10``, ``=true``,
``=null``); list items by index (``rollout_matching.pipeline.objective.0.weight=0.5``)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml

from coordexp.errors import UserInputError

__all__ = ["Override", "parse_override", "apply_overrides", "OVERRIDE_ORIGIN", "write_resolved_config",
           "RESOLVED_CONFIG_NAME"]

OVERRIDE_ORIGIN = "--set"
"""The origin an override's key paths get: its relative paths resolve against the current directory (the parent of
``--set``), and its problems name ``--set`` instead of a file."""
RESOLVED_CONFIG_NAME = "coordexp_config.yaml"


@dataclass(frozen=True)
class Override:
    text: str
    path: tuple[str, ...]
    value: Any


def parse_override(text: str) -> Override:
    """``a.b.0.c=value`` -> path and YAML scalar value; a malformed one is a :class:`UserInputError` (exit 2)."""
    key, sep, raw = text.partition("=")
    parts = tuple(key.strip().split("."))
    if not sep or not all(parts):
        raise UserInputError(f"--set {text!r} is not dotted.key=value",
                             hint="Write e.g. --set training.max_steps=10 (list items by index: a.0.b=1)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise UserInputError(f"--set {text!r}: the value is not YAML ({' '.join(str(exc).split())})",
                             hint="Quote a string with YAML's special characters: --set 'key=\"a: b\"'") from None
    return Override(text, parts, value)


def _set(node: Any, override: Override) -> None:
    for depth, part in enumerate(override.path):
        last = depth == len(override.path) - 1
        where = ".".join(override.path[:depth]) or "the config"
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise UserInputError(f"--set {override.text}: {where} is a list of {len(node)}; {part!r} is not "
                                     "one of its indices", hint="Index list items from 0: a.0.b=value")
            if last:
                node[int(part)] = override.value
            else:
                node = node[int(part)]
        elif isinstance(node, dict):
            if last:
                node[part] = override.value
            else:
                node = node.setdefault(part, {})
        else:
            raise UserInputError(f"--set {override.text}: {where} is a value ({node!r}), not a mapping or list",
                                 hint="Set the parent key itself, or fix the dotted path")


def apply_overrides(merged: Any, overrides: Sequence[str]) -> Any:
    """A copy of ``merged`` (a :class:`coordexp.schema.loader.MergedConfig`) with ``overrides`` applied in order."""
    from coordexp.schema.loader import MergedConfig

    data = copy.deepcopy(merged.data)
    origins = dict(merged.origins)
    for text in overrides:
        override = parse_override(text)
        _set(data, override)
        for path in [p for p in origins if p[:len(override.path)] == override.path]:
            del origins[path]
        origins[override.path] = OVERRIDE_ORIGIN
    return MergedConfig(data=data, origins=origins, files=merged.files)


def write_resolved_config(output_dir: str | Path, config: Any, *, source: Path, overrides: Sequence[str]) -> Path:
    """``OUTPUT_DIR/coordexp_config.yaml``: the validated config this run trained with (paths absolute, defaults
    filled), headed by the file and the ``--set`` overrides it came from."""
    target = Path(output_dir) / RESOLVED_CONFIG_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    header = [f"# resolved by `coordexp train` from {source}"]
    header += [f"#   --set {text}" for text in overrides]
    body = yaml.safe_dump(config.model_dump(mode="json", exclude_none=False), sort_keys=False)
    target.write_text("\n".join(header) + "\n" + body, encoding="utf-8")
    return target
