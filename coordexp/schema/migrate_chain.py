"""``coordexp migrate`` across an ``extends`` (or upstream ``inherit``) chain.

``-o OUT`` (or stdout) writes ONE self-contained file: the chain merged (mappings deep-merge, lists and scalars
replace, later files win), then migrated as a whole, so a legacy key in a parent is moved like one in the leaf.
``--in-place`` migrates every file of the chain, bases first, each with its byte-identical backup. Relative
paths keep their meaning: a coordexp file's are relative to that file; an upstream chain's (see
:func:`~coordexp.schema.migrate_upstream.is_upstream`) were relative to the launch directory, ``base_dir``.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from coordexp.schema.errors import ConfigError, ConfigIssue
from coordexp.schema.loader import MAX_EXTENDS_DEPTH, MAX_EXTENDS_FILES, deep_merge
from coordexp.schema.migrate import HEADER, Migration, migrate_mapping, require_training_config
from coordexp.schema.migrate_io import (MigrationRefused, _check_writable, _read_original, replace_atomically,
                                        _same_file, _write_backup)
from coordexp.schema.migrate_upstream import is_upstream, resolve_paths, upstream_post, write_paths
from coordexp.schema.yaml_io import YamlReadError, dump_yaml, parse_yaml_text

__all__ = ["ChainFile", "FileOutcome", "ChainResult", "read_chain", "needs_chain", "migrate_chain"]

FLAT_HEADER = ("# Self-contained config written by `coordexp migrate` from an extends chain (comments of the "
               "original files are not kept).\n")
_LINKS = ("extends", "inherit")


@dataclass(frozen=True)
class ChainFile:
    """One file of a chain: its resolved path, its own raw mapping (links included) and its bases, in order."""

    path: Path
    raw: dict
    bases: tuple[Path, ...]


@dataclass
class FileOutcome:
    """What migrate did to one file: the migration report, and where it wrote (with the backup it kept)."""

    path: Path
    migration: Migration
    written: Optional[Path] = None
    backup: Optional[Path] = None


@dataclass
class ChainResult:
    """Per-file outcomes (one, the flattened file, unless ``--in-place``), the text, how each path resolved."""

    files: list[FileOutcome]
    text: str
    upstream: bool
    paths: list[str] = field(default_factory=list)

    @property
    def needs_user(self) -> bool:
        """Something was left out or could not be moved: ``migrate`` exits 2."""
        return any(f.migration.unresolved or f.migration.left_out for f in self.files)


def _links(raw: dict, where: Path) -> list[str]:
    bases = raw.get("extends", raw.get("inherit"))  # upstream: inherit only when extends is absent
    if bases is None:
        return []
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) and b and "\x00" not in b for b in bases):
        raise ConfigError([ConfigIssue("extends", "extends must be a path or a list of paths", "e.g. extends: "
                                       "base.yaml", str(where))])
    return bases


def read_chain(leaf: Path) -> list[ChainFile]:
    """Every file of ``leaf``'s chain, bases before the files that extend them, each once; the leaf is last."""
    order: list[ChainFile] = []
    seen: dict[Path, ChainFile] = {}

    def visit(path: Path, trail: tuple[Path, ...]) -> None:
        resolved = _resolved(path, trail)
        if resolved in trail:
            cycle = " -> ".join(str(p) for p in (*trail, resolved))
            raise ConfigError([ConfigIssue("extends", f"extends cycle: {cycle}", "Remove one of the links.")])
        if resolved in seen:
            return
        if len(trail) >= MAX_EXTENDS_DEPTH or len(seen) >= MAX_EXTENDS_FILES:
            raise ConfigError([ConfigIssue("extends", "extends chain too deep or too wide", "Flatten it.",
                                           str(resolved))])
        raw = _read_raw(path, resolved, trail)
        if not isinstance(raw, dict):
            raise ConfigError([ConfigIssue("", "top level must be a mapping of sections", "Pass a YAML config.",
                                           str(resolved))])
        bases = []
        for base in _links(raw, resolved):
            base_path = Path(os.path.expanduser(base))
            base_path = base_path if base_path.is_absolute() else resolved.parent / base_path
            visit(base_path, (*trail, resolved))
            bases.append(_resolved(base_path, trail))
        seen[resolved] = ChainFile(resolved, raw, tuple(bases))
        order.append(seen[resolved])

    visit(Path(leaf).absolute(), ())
    return order


def _broken(path: Path, trail: tuple[Path, ...], message: str, hint: str) -> ConfigError:
    """A chain file that cannot be read, named as its parent wrote it (and which file's link reached it)."""
    via = f" (reached from {trail[-1]})" if trail else ""
    return ConfigError([ConfigIssue("extends" if trail else "", f"{path}{via}: {message}", hint, str(path))])


def _resolved(path: Path, trail: tuple[Path, ...]) -> Path:
    try:
        return path.resolve()
    except RuntimeError:  # Python < 3.13 reports a symlink loop as RuntimeError
        raise _broken(path, trail, "a symlink loop (the link leads back to itself and never reaches a file)",
                      "Point the link at a YAML file, or name the file itself.") from None
    except (OSError, ValueError) as exc:  # a NUL byte, a name too long, an unreadable folder
        raise _broken(path, trail, f"cannot use this path ({getattr(exc, 'strerror', None) or exc})",
                      "Check the path: a file name of at most 255 bytes, in folders you may read.") from None


def _read_raw(path: Path, resolved: Path, trail: tuple[Path, ...]) -> object:
    """The parsed file; a missing, unreadable, non-regular or unparsable one is a :class:`ConfigError` naming it."""
    try:
        return parse_yaml_text(_read_original(path).decode("utf-8"))
    except YamlReadError as exc:
        raise _broken(path if path != resolved else resolved, trail, exc.message, exc.hint) from None
    except (OSError, ValueError) as exc:
        raise _broken(path, trail, f"cannot read file ({getattr(exc, 'strerror', None) or exc})",
                      "Check the file and its permissions.") from None


def _own(raw: dict) -> dict:
    data = copy.deepcopy(raw)
    for key in _LINKS:
        data.pop(key, None)
    return data


def needs_chain(config: Path) -> bool:
    """Whether ``config`` extends another file or uses upstream spellings (else the one-file migrate runs)."""
    try:
        raw = parse_yaml_text(_read_original(Path(config)).decode("utf-8"))
    except Exception:  # noqa: BLE001 - read_chain reports an unreadable file naming it
        return True
    return isinstance(raw, dict) and (any(k in raw for k in _LINKS) or is_upstream(raw))


def _hooks(upstream: bool, leaf: bool) -> dict:
    return {"post": (lambda rw: upstream_post(rw, leaf=leaf)) if upstream else None}


def migrate_chain(leaf: Path, *, output: Optional[Path] = None, in_place: bool = False,
                  base_dir: Optional[Path] = None) -> ChainResult:
    """Migrate ``leaf`` and its chain; see the module docstring. ``base_dir`` defaults to the current directory."""
    if in_place and output is not None:
        raise MigrationRefused("use either --in-place or --output, not both")
    files = read_chain(leaf)
    base = Path(base_dir if base_dir is not None else os.getcwd()).absolute()
    merged_raw: dict = {}
    for f in files:
        merged_raw = deep_merge(merged_raw, _own(f.raw))
    require_training_config(leaf, merged_raw)
    upstream = is_upstream(merged_raw) or any("inherit" in f.raw for f in files)
    how = f"--base-dir {base} (upstream paths were relative to the launch directory)"
    if in_place:
        return _in_place(files, upstream, base, how)
    if output is not None and any(_same_file(f.path, Path(output)) for f in files if Path(output).exists()):
        raise MigrationRefused(f"--output {output} is a file of the chain; it would be overwritten without a backup",
                               hint="Name another output file, or use --in-place.")
    paths: list[str] = []
    merged: dict = {}
    for f in files:
        own = _own(f.raw)
        if not upstream:
            resolve_paths(own, f.path.parent, paths, f"the directory of {f.path.name}")
        merged = deep_merge(merged, own)
    migration = migrate_mapping(merged, {}, **_hooks(upstream, leaf=True))
    if upstream:
        resolve_paths(migration.data, base, paths, how)
    if len(files) > 1:
        migration.changes.append(f"merged {len(files)} files ({', '.join(f.path.name for f in files)}) into one "
                                 "self-contained config (no extends)")
    outcome = FileOutcome(files[-1].path, migration)
    if output is not None:
        target = Path(output).resolve()
        write_paths(migration.data, target.parent)
        text = FLAT_HEADER + dump_yaml(migration.data)
        _check_writable(target)
        _write(target, text)
        outcome.written = Path(output)
    else:
        text = FLAT_HEADER + dump_yaml(migration.data)
    return ChainResult([outcome], text, upstream, paths)


def _write(target: Path, text: str) -> None:
    try:
        replace_atomically(target, text.encode("utf-8"))
    except OSError as exc:
        raise MigrationRefused(f"cannot write {target}: {exc.strerror or exc} (nothing was changed)",
                               hint="Check the folder's permissions and free space.") from None


def _in_place(files: list[ChainFile], upstream: bool, base: Path, how: str) -> ChainResult:
    """Every file of the chain, bases first; each sees its bases' migrated view (a pipeline made in a parent)."""
    views: dict[Path, dict] = {}
    raw_views: dict[Path, dict] = {}  # the same bases as written: upstream keys their own migration left out
    outcomes, paths, plans = [], [], []
    for f in files:
        base_view: dict = {}
        raw_base_view: dict = {}
        for b in f.bases:
            base_view = deep_merge(base_view, views[b])
            raw_base_view = deep_merge(raw_base_view, raw_views[b])
        raw_views[f.path] = deep_merge(raw_base_view, _own(f.raw))
        migration = migrate_mapping(copy.deepcopy(f.raw), base_view, raw_base_view=raw_base_view,
                                    **_hooks(upstream, leaf=f is files[-1]))
        if upstream:
            before = len(paths)
            resolve_paths(migration.data, base, paths, how)
            write_paths(migration.data, f.path.parent, climb=True)
            if len(paths) > before:
                migration.changes.append(f"{len(paths) - before} path(s) rewritten relative to {f.path.name}")
        views[f.path] = deep_merge(base_view, _own(migration.data))
        plans.append((f, migration))
    for f, migration in plans:  # refuse before writing anything when one file cannot be written
        if migration.changed:
            _check_writable(f.path)
    for f, migration in plans:
        outcome = FileOutcome(f.path, migration)
        if migration.changed:
            outcome.backup = _write_backup(f.path, _read_original(f.path))
            _write(f.path, HEADER + dump_yaml(migration.data))
            outcome.written = f.path
        outcomes.append(outcome)
    return ChainResult(outcomes, "", upstream, paths)
