"""Load a YAML config: ``extends:`` chains, legacy keys, strict schema validation, every issue at once.

``extends`` is a path or a list of paths relative to the file that names it; bases apply in order, then the
file itself; mappings deep-merge, lists and scalars replace. Relative path values resolve against the
directory of the file that set them.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from pydantic import ValidationError

from coordexp.schema.errors import ConfigError, ConfigIssue
from coordexp.schema.issues import PathTuple, validation_issues
from coordexp.schema.legacy import find_legacy_keys, strip_legacy_keys
from coordexp.schema.root import CoordExpConfig, config_warnings
from coordexp.schema.yaml_io import YamlReadError, read_yaml_file

__all__ = [
    "MergedConfig",
    "ValidationReport",
    "written_config",
    "deep_merge",
    "load_config",
    "load_merged",
    "validate_config_file",
    "validate_mapping",
    "validate_merged",
    "PATH_FIELDS",
]

EXTENDS_KEY = "extends"
MAX_REPORTED_ISSUES = 100
"""Schema problems listed per file; the rest are counted in one closing line (a file of 9,000 stray keys
otherwise spends seconds on spelling suggestions nobody reads)."""


@dataclass
class MergedConfig:
    """The raw mapping after ``extends`` merging, with the file that set each key path."""

    data: dict
    origins: dict[PathTuple, str] = field(default_factory=dict)
    files: tuple[str, ...] = ()

    def file_of(self, path: PathTuple) -> Optional[str]:
        """The file that set ``path`` (or its nearest existing ancestor)."""
        for n in range(len(path), -1, -1):
            if path[:n] in self.origins:
                return self.origins[path[:n]]
        return None


@dataclass(frozen=True)
class ValidationReport:
    """The outcome of validating one file: the config (when valid), errors and warnings."""

    path: str
    config: Optional[CoordExpConfig]
    errors: tuple[ConfigIssue, ...]
    warnings: tuple[ConfigIssue, ...]

    @property
    def ok(self) -> bool:
        return not self.errors


def _record_origins(node: Any, path: PathTuple, file: str, origins: dict[PathTuple, str]) -> None:
    origins[path] = file
    if isinstance(node, dict):
        for key, value in node.items():
            _record_origins(value, (*path, key), file, origins)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _record_origins(value, (*path, i), file, origins)


def deep_merge(base: dict, override: dict) -> dict:
    """``override`` on top of ``base``: mappings merge key by key, everything else (lists too) replaces."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _subtree_paths(node: Any, path: PathTuple) -> Iterator[PathTuple]:
    """``path`` and the path of every value below it."""
    stack = [(node, path)]
    while stack:
        node, path = stack.pop()
        yield path
        if isinstance(node, dict):
            stack.extend((value, (*path, key)) for key, value in node.items())
        elif isinstance(node, list):
            stack.extend((value, (*path, i)) for i, value in enumerate(node))


_NOTHING = object()


def _overlay_origins(
    into: dict[PathTuple, str], below: Any, layer: dict, layer_origins: dict[PathTuple, str], path: PathTuple = ()
) -> None:
    """Record that ``layer`` was merged on top of ``below``: replaced subtrees forget their old origins.

    Walks only the two trees (not every recorded path per key), so a file of many keys loads in linear time.
    """
    for key, value in layer.items():
        child = (*path, key)
        old = below.get(key, _NOTHING) if isinstance(below, dict) else _NOTHING
        if isinstance(value, dict) and isinstance(old, dict):
            into[child] = layer_origins.get(child, into.get(child, ""))
            _overlay_origins(into, old, value, layer_origins, child)
            continue
        if old is not _NOTHING:
            for stale in _subtree_paths(old, child):
                into.pop(stale, None)
        for fresh in _subtree_paths(value, child):
            if fresh in layer_origins:
                into[fresh] = layer_origins[fresh]


def _display(path: Path) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive on Windows
        return str(path)
    return str(path) if rel.startswith("..") else rel


MAX_EXTENDS_DEPTH = 16
"""Longest ``extends`` chain (a file, its base, the base's base, ...)."""
MAX_EXTENDS_FILES = 64
"""Distinct files one config may pull in through ``extends``."""
MAX_MERGED_NODES = 200_000
"""Values copied by all the ``extends`` merges of one load together (a base listed many times counts each time)."""


@dataclass
class _LoadState:
    """One ``load_merged`` call: each file is read once (a diamond of ``extends`` stays linear) within budgets."""

    loaded: dict[Path, Union[MergedConfig, ConfigError]] = field(default_factory=dict)
    sizes: dict[int, int] = field(default_factory=dict)
    merged_nodes: int = 0

    def charge_merge(self, layer: MergedConfig, shown: str) -> None:
        """Count the values a merge of ``layer`` copies; refuse once the load exceeds :data:`MAX_MERGED_NODES`."""
        size = self.sizes.get(id(layer))
        if size is None:
            size = self.sizes[id(layer)] = sum(1 for _ in _subtree_paths(layer.data, ()))
        self.merged_nodes += size
        if self.merged_nodes > MAX_MERGED_NODES:
            raise ConfigError([ConfigIssue(
                EXTENDS_KEY,
                f"extends merges copy more than {MAX_MERGED_NODES:,} values in total",
                "List each base once; a config and its bases hold a few hundred values.",
                shown,
            )])


def load_merged(path: Union[str, Path]) -> MergedConfig:
    """Read ``path`` and its ``extends`` chain into one raw mapping; raises :class:`ConfigError`."""
    return _load_merged(Path(path).absolute(), chain=(), state=_LoadState())


_PATH_HINT = "Check the path: a file name of at most 255 bytes, no NUL byte, in folders you may read."


def _path_error(exc: Exception) -> str:
    """The OS reason without the (possibly huge or hostile) path itself."""
    return (exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)).replace("\x00", "\\x00")


def _load_merged(path: Path, chain: tuple[Path, ...], state: _LoadState) -> MergedConfig:
    shown = _display(path)
    try:
        resolved = path.resolve()
    except (OSError, ValueError) as exc:  # a NUL byte, a name too long for the file system, an unreadable folder
        raise ConfigError([ConfigIssue("", f"cannot use this path ({_path_error(exc)})", _PATH_HINT, shown)]) from None
    except RuntimeError:  # Python < 3.13 reports a symlink loop as RuntimeError
        raise ConfigError([ConfigIssue("", "a symlink loop (the link leads back to itself and never reaches a file)",
                                       "Point the link at a YAML file, or name the file itself.", shown)]) from None
    if resolved in chain:
        cycle = " -> ".join(_display(p) for p in (*chain, resolved))
        issue = ConfigIssue(EXTENDS_KEY, f"extends cycle: {cycle}", "Remove one of the extends links.", shown)
        raise ConfigError([issue])
    earlier = state.loaded.get(resolved)
    if isinstance(earlier, ConfigError):
        raise earlier
    if earlier is not None:
        return earlier  # reached twice (a diamond): read and merged once
    if len(chain) >= MAX_EXTENDS_DEPTH:
        names = " -> ".join(_display(p) for p in (*chain[:2], Path("..."), *chain[-1:], resolved))
        raise ConfigError([ConfigIssue(
            EXTENDS_KEY, f"extends chain is deeper than {MAX_EXTENDS_DEPTH} files ({names})",
            "Flatten the chain: a config rarely needs more than two levels of bases.", shown,
        )])
    if len(state.loaded) >= MAX_EXTENDS_FILES:
        raise ConfigError([ConfigIssue(
            EXTENDS_KEY, f"extends pulls in more than {MAX_EXTENDS_FILES} files",
            "Merge some bases into one file.", shown,
        )])
    try:
        merged = _read_and_merge(path, shown, resolved, chain, state)
    except ConfigError as exc:
        state.loaded[resolved] = exc
        raise
    state.loaded[resolved] = merged
    return merged


def _base_hint(issue: ConfigIssue, base_path: Path) -> str:
    """A missing base is looked up from the folder of the file that names it, not from the current directory."""
    if issue.message == "file not found":
        return (f"Looked for {base_path}: a relative extends path is read from the folder of the file that names "
                "it. Fix the path or write it absolute.")
    return issue.hint


def _read_and_merge(
    path: Path, shown: str, resolved: Path, chain: tuple[Path, ...], state: _LoadState
) -> MergedConfig:
    try:
        data = read_yaml_file(path)
    except YamlReadError as exc:
        raise ConfigError([ConfigIssue("", exc.message, exc.hint, shown)]) from None
    except (OSError, ValueError) as exc:  # the path itself is unusable (NUL byte, too long, no permission on a folder)
        raise ConfigError([ConfigIssue("", f"cannot read file ({_path_error(exc)})", _PATH_HINT, shown)]) from None
    if data is None:
        raise ConfigError(
            [ConfigIssue("", "file is empty", "A config is a mapping with global_max_length, model, data, ...", shown)]
        )
    if not isinstance(data, dict):
        raise ConfigError(
            [
                ConfigIssue(
                    "",
                    f"top level must be a mapping of sections, got a {type(data).__name__}",
                    "Write `key: value` lines (global_max_length, model, data, training, custom, rollout_matching).",
                    shown,
                )
            ]
        )
    bases = data.pop(EXTENDS_KEY, None)
    if bases is None:
        base_list: list = []
    elif isinstance(bases, str):
        base_list = [bases]
    elif isinstance(bases, list) and all(isinstance(b, str) for b in bases):
        base_list = bases
    else:
        raise ConfigError(
            [ConfigIssue(EXTENDS_KEY, "extends must be a path or a list of paths", "e.g. extends: base.yaml", shown)]
        )
    merged = MergedConfig({}, {}, ())
    issues: list[ConfigIssue] = []
    for base in base_list:
        base_path = Path(os.path.expanduser(base))
        base_path = base_path if base_path.is_absolute() else path.parent / base_path
        try:
            loaded = _load_merged(base_path, (*chain, resolved), state)
        except ConfigError as exc:
            issues.extend(
                i if i.path or i.message.startswith("extends") else ConfigIssue(
                    EXTENDS_KEY, f"base {base!r}: {i.message}", _base_hint(i, base_path), shown
                )
                for i in exc.issues
            )
            continue
        state.charge_merge(loaded, shown)
        _overlay_origins(merged.origins, merged.data, loaded.data, loaded.origins)
        merged.data = deep_merge(merged.data, loaded.data)
        merged.files = (*merged.files, *(f for f in loaded.files if f not in merged.files))
    if issues:
        raise ConfigError(dict.fromkeys(issues))  # a failing base reached twice is reported once
    own: dict[PathTuple, str] = {}
    _record_origins(data, (), shown, own)
    _overlay_origins(merged.origins, merged.data, data, own)
    merged.data = deep_merge(merged.data, data)
    merged.origins[()] = shown
    merged.files = (*merged.files, shown)
    return merged


def _path_fields(model: type, prefix: PathTuple = ()) -> list[tuple[PathTuple, str]]:
    """Dotted paths of every string field marked as a filesystem path in the schema."""
    from pydantic import BaseModel

    from coordexp.schema.base import PATH_MARKER

    found = []
    for name, info in model.model_fields.items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        if PATH_MARKER in extra:
            found.append(((*prefix, name), extra[PATH_MARKER]))
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            found.extend(_path_fields(annotation, (*prefix, name)))
    return found


_PATH_FIELDS = _path_fields(CoordExpConfig)
PATH_FIELDS: tuple[tuple[PathTuple, str], ...] = tuple(_PATH_FIELDS)
"""``(dotted key path, kind)`` of every config key the schema marks as a path (kind ``path`` or ``hub-or-path``)."""


def _resolve_paths(data: dict, merged: MergedConfig) -> dict:
    """Relative path values become absolute, against the directory of the file that set each one."""
    for key_path, kind in _PATH_FIELDS:
        parent = data
        for part in key_path[:-1]:
            parent = parent.get(part) if isinstance(parent, dict) else None
        value = parent.get(key_path[-1]) if isinstance(parent, dict) else None
        if not isinstance(value, str) or not value or "\x00" in value:
            continue  # a NUL byte is refused by the schema (PathStr); expanduser would raise on it
        if kind == "hub-or-path" and not value.startswith((".", "/", "~")):
            continue  # a hub id such as Qwen/Qwen2.5-VL-3B-Instruct
        expanded = Path(os.path.expanduser(value))
        if not expanded.is_absolute():
            origin = merged.file_of(key_path) or "."
            expanded = Path(origin).absolute().parent / expanded
        parent[key_path[-1]] = os.path.normpath(str(expanded))
    return data


def written_config(merged: MergedConfig) -> dict:
    """What the user wrote (the files' keys after ``extends``, and any ``--set``), relative paths made absolute
    against the file that set each: a run record of it validates to the same config from any folder, and keeps
    which keys were written (defaults stay defaults)."""
    return _resolve_paths(copy.deepcopy(merged.data), merged)


def _in_parent(issue: ConfigIssue, top: Optional[str]) -> ConfigIssue:
    """A legacy key set in a base file: say that migrating the leaf covers it (the chain is followed)."""
    if not issue.file or not top or issue.file == top:
        return issue
    hint = (f"{issue.hint} It is set in {issue.file}, a base of {top}: `coordexp migrate {top} -o NEW.yaml` writes "
            f"one self-contained file with it moved, `coordexp migrate {top} --in-place` migrates every file of "
            "the chain.")
    return ConfigIssue(issue.path, issue.message, hint.strip(), issue.file)


def validate_merged(merged: MergedConfig) -> ValidationReport:
    """Legacy keys first (their message wins), then the schema; all issues of the file at once."""
    top = merged.files[-1] if merged.files else None
    hits = find_legacy_keys(merged.data)
    issues = [_in_parent(hit.issue(merged.file_of(hit.path)), top) for hit in hits]
    # a stripped legacy key (or the key it names) must not also be reported as "required key is missing"
    covered = {h.dotted for h in hits} | {
        h.replacement.split(":")[0].removesuffix("[]") for h in hits if h.replacement
    }
    data = _resolve_paths(strip_legacy_keys(merged.data, hits), merged)
    unlisted = 0
    try:
        config = CoordExpConfig.model_validate(data)
    except ValidationError as exc:
        config = None
        for seen, (loc, issue) in enumerate(validation_issues(exc, data, CoordExpConfig)):
            if issue.message.startswith("required key is missing") and issue.path in covered:
                continue  # the legacy message above already names this key
            if len(issues) >= MAX_REPORTED_ISSUES:
                unlisted += max(exc.error_count() - seen, 1)
                break
            issues.append(ConfigIssue(issue.path, issue.message, issue.hint, merged.file_of(loc)))
    if len(issues) > MAX_REPORTED_ISSUES:  # legacy keys alone can be thousands (a relocated namespace)
        unlisted += len(issues) - MAX_REPORTED_ISSUES
        issues = issues[:MAX_REPORTED_ISSUES]
    if unlisted:
        issues.append(ConfigIssue("", f"and about {unlisted} more problem(s) not listed",
                                  "Fix the ones above first (unknown keys are often one mis-indented block).", top))
    if issues:
        return ValidationReport(top or "", None, tuple(issues), ())
    warnings = tuple(ConfigIssue(w.path, w.message, w.hint, top) for w in config_warnings(config))
    return ValidationReport(top or "", config, (), warnings)


def validate_config_file(path: Union[str, Path]) -> ValidationReport:
    """Validate one file without raising (what ``coordexp validate`` shows)."""
    try:
        merged = load_merged(path)
    except ConfigError as exc:
        return ValidationReport(_display(Path(path).absolute()), None, exc.issues, ())
    return validate_merged(merged)


def load_config(path: Union[str, Path]) -> CoordExpConfig:
    """The validated config of ``path``; raises :class:`ConfigError` listing every problem of the file."""
    report = validate_config_file(path)
    if not report.ok:
        raise ConfigError(report.errors)
    assert report.config is not None
    return report.config


def validate_mapping(data: dict, file: str = "<memory>") -> ValidationReport:
    """Validate an in-memory mapping as if it were the whole content of ``file`` (no ``extends``)."""
    origins: dict[PathTuple, str] = {}
    _record_origins(data, (), file, origins)
    return validate_merged(MergedConfig(copy.deepcopy(data), origins, (file,)))
