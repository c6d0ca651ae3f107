"""Pydantic errors -> :class:`ConfigIssue`: dotted paths with list indices, no union tags, a fix for each."""

from __future__ import annotations

import difflib
import typing
from typing import Any, Iterator, Optional, Union

from pydantic import BaseModel, ValidationError

from coordexp.schema.errors import ConfigIssue, ConfigRuleError, format_path, parse_path

__all__ = ["PathTuple", "short_repr", "validation_issues"]

PathTuple = tuple[Union[str, int], ...]
_MISSING = object()


def _clean_loc(loc: tuple, raw: Any) -> tuple[PathTuple, PathTuple]:
    """(path in the user's mapping, loc with union tags) -- tags are loc items the raw data does not have."""
    path: list = []
    node = raw
    for part in loc:
        if isinstance(node, dict):
            if part in node:
                path.append(part)
                node = node[part]
                continue
            if isinstance(part, str) and node.get("name") == part:
                continue  # discriminator tag of a pipeline module union
            path.append(part)
            node = _MISSING
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            path.append(part)
            node = node[part]
        else:
            path.append(part)
            node = _MISSING
    return tuple(path), tuple(loc)


def _unwrap(annotation: Any) -> Union[type, list, None]:
    """The model class an annotation holds (through Optional, list, Annotated); a list of models for a union."""
    for _ in range(8):
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return annotation
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
        if origin is typing.Annotated or (origin in (list, tuple) and args):
            annotation = args[0]
        elif origin is Union or str(origin) == "<class 'types.UnionType'>":
            members = [a for a in args if a is not type(None)]
            if len(members) == 1:
                annotation = members[0]
                continue
            models = [_unwrap(m) for m in members]
            return [m for m in models if isinstance(m, type)]
        else:
            return None
    return None


def _allowed_keys(root: type, loc: tuple) -> Optional[list[str]]:
    """Field names of the model that owns the last key of ``loc`` (None if it cannot be resolved)."""
    current: Union[type, list, None] = root
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        if isinstance(current, list):  # a tagged union: this loc item is the tag
            current = next((m for m in current if part in typing.get_args(m.model_fields["name"].annotation)), None)
            continue
        info = current.model_fields.get(part) if current is not None else None
        if info is None:
            return None
        current = _unwrap(info.annotation)
    return sorted(current.model_fields) if isinstance(current, type) else None


SECRET_KEYS = frozenset({"sync_token"})  # config keys whose value an error message must not repeat


def short_repr(value: Any) -> str:
    """``repr(value)`` cut to 60 characters, for a value quoted in an error or a migration report."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_SHORT_NAMES = {
    "lr": ("learning_rate",), "batch_size": ("per_device_train_batch_size", "effective_batch_size"),
    "bs": ("per_device_train_batch_size", "effective_batch_size"), "epochs": ("num_train_epochs",),
    "steps": ("max_steps",), "grad_accum": ("gradient_accumulation_steps",),
    "accumulation_steps": ("gradient_accumulation_steps",), "warmup": ("warmup_ratio", "warmup_steps"),
    "max_length": ("global_max_length",), "model_path": ("path",), "output": ("output_dir",),
}
"""Common short names of keys; a name is suggested only where the schema has that field (the schema owns keys)."""


def _candidates(key: str, allowed: list[str]) -> list[str]:
    """Up to three fields of ``allowed`` that ``key`` probably means: the fields of a known short name
    (``batch_size``: the per-device and the effective batch size), else close spellings and fields ending in
    ``_key``."""
    found = [name for name in _SHORT_NAMES.get(key.lower(), ()) if name in allowed]
    if found:
        return found
    found = difflib.get_close_matches(key, allowed, n=2)
    if len(key) >= 4:
        found += [name for name in allowed if name.endswith("_" + key)]
    return list(dict.fromkeys(found))[:3]


def _elsewhere(root: Optional[type], key: str) -> list[str]:
    """``section.field`` for each top-level section of ``root`` that has ``key`` (or its short name's field)."""
    out = []
    for section, info in (root.model_fields.items() if root is not None else ()):
        model = _unwrap(info.annotation)
        if isinstance(model, type):
            names = {key, *_SHORT_NAMES.get(key.lower(), ())}
            out += [f"{section}.{name}" for name in sorted(names) if name in model.model_fields]
    return out[:3]


def _hint_for(err: dict, allowed: Optional[list[str]], key: str, root: Optional[type] = None) -> tuple[str, str]:
    kind = err["type"]
    value = err.get("input")
    if kind == "extra_forbidden":
        hint = "Remove it or fix its spelling."
        if allowed:
            close = _candidates(key, allowed) or _elsewhere(root, key)
            listing = ", ".join(allowed) if len(allowed) <= 12 else "see `coordexp schema`"
            guess = f"Did you mean {' or '.join(map(repr, close))}? " if close else ""
            hint = f"{guess}Allowed keys here: {listing}."
        return "unknown key", hint
    if kind == "missing":
        return "required key is missing", f"Add `{key}: ...` (see `coordexp schema` for its type)."
    msg = err["msg"]
    got = f" (got {short_repr(value)})" if key not in SECRET_KEYS else ""  # a secret is never echoed
    if kind in {"int_type", "float_type", "bool_type", "string_type"} and isinstance(value, str):
        if kind == "bool_type":
            return msg + got, "Write true or false without quotes (yes/no/on/off are strings)."
        if _looks_numeric(value):
            return msg + got, "Quoted values are strings; write the number without quotes."
        return msg + got, "Write a number here (digits, e.g. 10 or 1e-4), not a word."
    if kind == "bool_type":
        return msg + got, "Write true or false."
    if kind in {"model_type", "dict_type", "model_attributes_type"}:
        return f"expected a mapping of keys{got}", "Write nested `key: value` lines under this key."
    if kind == "list_type":
        return f"expected a list{got}", "Write a YAML list (`- item` lines or [a, b])."
    if kind == "literal_error":
        return msg + got, "Use one of the listed values exactly (case-sensitive)."
    if kind == "union_tag_invalid" or kind == "union_tag_not_found":
        return msg + got, "Set `name:` to one of the module names listed."
    if kind == "finite_number":
        return msg + got, "inf and nan are not allowed here; write a finite number."
    if kind.startswith(("greater", "less", "too_short", "too_long")):
        return msg + got, "Change the value to satisfy the bound (the limits are in `coordexp schema`)."
    if kind == "value_error":
        text = str(err.get("ctx", {}).get("error", msg))
        return text + got, "Fix the value as described."
    return msg + got, "Fix the value at this path."


def validation_issues(
    exc: ValidationError, raw: Any, root: Optional[type] = None
) -> Iterator[tuple[PathTuple, ConfigIssue]]:
    """Yield ``(path tuple, issue)`` for every error, expanding cross-field rule errors into their paths.

    ``raw`` is the validated input (to tell union tags from keys); ``root`` the model (for key suggestions).
    """
    for err in exc.errors(include_url=False):
        path, loc = _clean_loc(tuple(err["loc"]), raw)
        cause = err.get("ctx", {}).get("error") if err["type"] == "value_error" else None
        if isinstance(cause, ConfigRuleError):
            for v in cause.violations:
                full = (*path, *parse_path(v.path))
                yield full, ConfigIssue(format_path(full), v.message, v.hint)
            continue
        key = str(path[-1]) if path else ""
        allowed = _allowed_keys(root, loc) if root is not None and loc else None
        message, hint = _hint_for(err, allowed, key, root)
        yield path, ConfigIssue(format_path(path), message, hint)


def _looks_numeric(text: str) -> bool:
    """Whether ``text`` would be a number once unquoted (so the quotes are the mistake, not the value)."""
    try:
        float(text.strip())
    except ValueError:
        return False
    return True
