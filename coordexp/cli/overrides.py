"""``--set dotted.key=value`` overrides and the run record (``OUTPUT_DIR/coordexp_config.yaml``).

Overrides are applied to the loaded YAML (after ``extends``) before validation, so an override is validated exactly
like the file; a value is read by the files' own YAML 1.2 reader with its bounds (``2e-5`` is a float, ``010`` is
10, ``on`` is a string, aliases are capped), ``--set training.max_steps=10``, ``=true``, ``=null``; list items by
index (``rollout_matching.pipeline.objective.0.weight=0.5``).

The run record holds what the user wrote (the file's keys after ``extends``, plus the overrides; paths absolute),
not every default, so validating and training from it gives the same resolved contract. Its header names the
config and each override as a JSON string (a newline in a value cannot end a comment); secrets are masked in header
and body with a text the schema refuses, so a masked value is never used as the secret. A resumed run appends a
section to the record; ``--resume`` replays the recorded overrides (:func:`recorded_overrides`).
"""

from __future__ import annotations

import copy
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional, Sequence

import typer

from coordexp.errors import UserInputError

__all__ = ["SetOption", "Override", "parse_override", "apply_overrides", "OVERRIDE_ORIGIN", "write_run_record",
           "append_resume_record", "recorded_overrides", "record_drift", "named_by", "masked_text",
           "RESOLVED_CONFIG_NAME", "SECRET_MASK", "MAX_VALUE_CHARS"]

OVERRIDE_ORIGIN = "--set"
"""The origin an override's key paths get: its relative paths resolve against the current directory (the parent of
``--set``), and its problems name ``--set`` instead of a file."""
RESOLVED_CONFIG_NAME = "coordexp_config.yaml"
SECRET_MASK = "*** masked (pass it again) ***"
"""What a secret's value becomes in the record: spaces make it an invalid token, so reusing it is refused."""
MAX_VALUE_CHARS = 4096
"""Longest ``--set`` value (an integer literal of up to 4096 digits still converts at once; the schema then bounds
it like a file value)."""
SetOption = Annotated[Optional[list[str]], typer.Option(
    "--set", metavar="KEY=VALUE", show_default=False,
    help="Override a config key: dotted.key=value (a YAML 1.2 value, read like the file; list items by index, "
         "a.0.b=1); repeatable, validated like the file.")]
"""The ``--set`` option of every command that reads a run config (train, eval, probe, preflight, serve-rollout)."""
_SET_LINE = re.compile(r'^# --set: (".*")\s*$')


@dataclass(frozen=True)
class Override:
    text: str
    path: tuple[str, ...]
    value: Any


def _secret(path: Sequence[str]) -> bool:
    from coordexp.schema.issues import SECRET_KEYS

    return bool(path) and path[-1] in SECRET_KEYS


def parse_override(text: str) -> Override:
    """``a.b.0.c=value`` -> path and value (read as YAML 1.2, like the files); a malformed one is a
    :class:`UserInputError` (exit 2)."""
    from coordexp.schema.yaml_io import YamlReadError, parse_yaml_text

    key, sep, raw = text.partition("=")
    parts = tuple(key.strip().split("."))
    if not sep or not all(parts):
        raise UserInputError(f"--set {text[:200]!r} is not dotted.key=value",
                             hint="Write e.g. --set training.max_steps=10 (list items by index: a.0.b=1)")
    shown = f"{key.strip()}=<masked>" if _secret(parts) else text[:200]
    if len(raw) > MAX_VALUE_CHARS:
        raise UserInputError(f"--set {key.strip()[:200]}: the value is {len(raw)} characters long, over the "
                             f"{MAX_VALUE_CHARS}-character limit", hint="Write long values in the config file")
    try:
        value = parse_yaml_text(raw) if raw.strip() else None
    except YamlReadError as exc:
        raise UserInputError(f"--set {shown!r}: the value is not YAML ({exc.message})",
                             hint="Quote a string with YAML's special characters: --set 'key=\"a: b\"'") from None
    except (ValueError, RecursionError) as exc:  # int() past Python's digit limit, nesting too deep
        raise UserInputError(f"--set {shown!r}: the value cannot be read ({type(exc).__name__})",
                             hint="Write a number of at most a few digits, or a plain value") from None
    return Override(text, parts, value)


def _set(node: Any, override: Override) -> None:
    for depth, part in enumerate(override.path):
        last = depth == len(override.path) - 1
        where = ".".join(override.path[:depth]) or "the config"
        if isinstance(node, list):
            index = int(part) if part.isascii() and part.isdigit() and len(part) < 10 else None
            if index is None or index >= len(node):
                raise UserInputError(f"--set {'.'.join(override.path)}: {where} "
                                     f"is a list of {len(node)}; {part[:40]!r} is not one of its indices",
                                     hint="Index list items from 0: a.0.b=value")
            if last:
                node[index] = override.value
            else:
                node = node[index]
        elif isinstance(node, dict):
            if last:
                node[part] = override.value
            else:
                node = node.setdefault(part, {})
        else:
            raise UserInputError(f"--set {'.'.join(override.path)}: {where} is a value, not a mapping or list",
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


def resolved_text(text: str) -> str:
    """An override as the run record keeps it: a relative path value (a key the schema marks as a path) made
    absolute against the folder it was given in, so a resume from another folder replays the same file."""
    from coordexp.schema.loader import PATH_FIELDS

    try:
        override = parse_override(text)
    except UserInputError:  # kept as given (a record header escapes any text)
        return text
    kind = dict(PATH_FIELDS).get(override.path)
    value = override.value
    if kind is None or not isinstance(value, str) or not value or "\x00" in value:
        return text
    if kind == "hub-or-path" and not value.startswith((".", "/", "~")):
        return text  # a hub id
    expanded = os.path.expanduser(value)
    if os.path.isabs(expanded):
        return text
    return f"{'.'.join(override.path)}={json.dumps(os.path.normpath(os.path.abspath(expanded)))}"


def masked_text(text: str) -> str:
    key = text.partition("=")[0].strip()
    return f"{key}={SECRET_MASK}" if _secret(tuple(key.split("."))) else text


def _mask_secrets(node: Any) -> Any:
    from coordexp.schema.issues import SECRET_KEYS

    if isinstance(node, dict):
        return {k: SECRET_MASK if k in SECRET_KEYS and v is not None else _mask_secrets(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_mask_secrets(v) for v in node]
    return node


def _quoted(text: str) -> str:
    return json.dumps(text, ensure_ascii=True)  # escapes newlines and every non-ASCII character: one comment line


def _stamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def write_run_record(output_dir: str | Path, merged: Any, *, source: Path, overrides: Sequence[str]) -> Path:
    """``OUTPUT_DIR/coordexp_config.yaml``: the keys this run was given (``merged``: the loaded config with its
    overrides applied), headed by the file and the overrides it came from."""
    from coordexp.runtime.train.run_folder import RECORD_MARK, write_result_file
    from coordexp.schema.loader import written_config
    from coordexp.schema.yaml_io import dump_yaml

    target = Path(output_dir) / RESOLVED_CONFIG_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    header = [f"{RECORD_MARK}: written by `coordexp train` at {_stamp()}; what the run was given (defaults omitted)",
              f"# config: {_quoted(str(Path(source).absolute()))}"]
    header += [f"# --set: {_quoted(masked_text(resolved_text(text)))}" for text in overrides]
    body = dump_yaml(_mask_secrets(written_config(merged)))
    return write_result_file(target, ("\n".join(header) + "\n" + body).encode("utf-8"))


def append_resume_record(output_dir: str | Path, *, checkpoint: str, overrides: Sequence[str]) -> Path:
    """A resumed run's section at the end of the record: when, from which checkpoint, with which new overrides."""
    from coordexp.runtime.train.run_folder import is_run_record, write_result_file

    target = Path(output_dir) / RESOLVED_CONFIG_NAME
    if not is_run_record(target):  # a link or a FIFO put there since the checks: never written through
        raise UserInputError(f"{target} is no run record coordexp wrote; the resume was not recorded",
                             hint="restore the run's coordexp_config.yaml")
    lines = [f"# resumed at {_stamp()} from {_quoted(str(checkpoint))}"]
    lines += [f"# --set: {_quoted(masked_text(resolved_text(text)))}" for text in overrides]
    return write_result_file(target, target.read_bytes() + ("\n".join(lines) + "\n").encode("utf-8"))


def recorded_overrides(output_dir: str | Path) -> list[str] | None:
    """The overrides the record of ``output_dir`` lists, in order (None when it holds no record); masked secrets
    are left out (they must be passed again)."""
    from coordexp.runtime.train.run_folder import is_run_record
    from coordexp.schema.file_read import FileReadError, read_capped_text
    from coordexp.schema.yaml_io import MAX_CONFIG_BYTES

    path = Path(output_dir) / RESOLVED_CONFIG_NAME
    if not is_run_record(path):
        return None
    try:
        text = read_capped_text(path, max_bytes=2 * MAX_CONFIG_BYTES, kind="YAML", suffix=".yaml")
    except FileReadError as exc:
        raise UserInputError(f"{path}: {exc.message}", hint="the run record is unreadable; pass --set again "
                             "or resume from a checkpoint path") from None
    found = []
    for line in text.splitlines():
        match = _SET_LINE.match(line)
        if match:
            try:
                value = json.loads(match.group(1))
            except ValueError:
                continue
            if isinstance(value, str) and SECRET_MASK not in value:
                found.append(value)
    return found


_TRAINING_KEYS = ("max_steps", "num_train_epochs", "learning_rate", "per_device_train_batch_size",
                  "gradient_accumulation_steps", "effective_batch_size", "lr_scheduler_type", "warmup_steps",
                  "warmup_ratio", "weight_decay", "seed", "optim", "packing", "vit_lr", "aligner_lr",
                  "vit_weight_decay", "aligner_weight_decay", "adam_beta1", "adam_beta2", "lr_scheduler_kwargs")
_RUN_SECTIONS = ("data", "rollout_matching", "model", "tuner", "custom", "template", "global_max_length")


def _leaves(node: Any, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    if isinstance(node, dict):
        found: dict[tuple[str, ...], Any] = {}
        for key, value in node.items():
            found.update(_leaves(value, (*prefix, str(key))))
        return found
    return {prefix: node}


def _changes_training(path: tuple[str, ...]) -> bool:
    if _secret(path):
        return False
    if path[0] == "training":
        return len(path) > 1 and path[1] in _TRAINING_KEYS
    return path[0] in _RUN_SECTIONS


def record_drift(output_dir: str | Path, merged_now: Any, passed: Sequence[str]) -> list[str]:
    """``--resume``: the keys that change training (steps, data, learning rate, rollout settings, the model) whose
    value now differs from the run record's, unless ``passed`` (the overrides given) names them; ``[]`` when the
    folder has no readable record."""
    from coordexp.runtime.train.run_folder import RECORD_MARK, is_run_record
    from coordexp.schema.errors import ConfigError
    from coordexp.schema.loader import load_merged, written_config

    record = Path(output_dir) / RESOLVED_CONFIG_NAME
    if not is_run_record(record):  # a regular file with the mark (never a FIFO)
        return []
    try:
        with record.open("rb") as handle:
            if not handle.read(len(RECORD_MARK)).decode("utf-8", "replace") == RECORD_MARK:
                return []  # an older record held every default: nothing to compare with
        then = _leaves(written_config(load_merged(record)))
    except (OSError, ConfigError):
        return []
    now = _leaves(written_config(merged_now))
    return [".".join(path) for path in sorted(set(then) | set(now))
            if _changes_training(path) and then.get(path) != now.get(path) and not named_by(".".join(path), passed)]


def named_by(key: str, passed: Sequence[str]) -> bool:
    """Whether an override in ``passed`` sets the dotted ``key``, a mapping holding it or a value inside it."""
    path = tuple(key.split("."))
    named = (tuple(text.partition("=")[0].strip().split(".")) for text in passed)
    return any(path[:len(other)] == other or other[:len(path)] == path for other in named)
