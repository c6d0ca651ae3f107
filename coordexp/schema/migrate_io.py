"""``coordexp migrate`` on files without ever losing the original bytes.

The new text goes to a temp file in the target's own folder and is renamed over the target (atomic on POSIX);
``--in-place`` first writes a byte-identical backup under a fresh name (``.bak``, then ``.bak.1``, ...: an existing
backup, or a symlink in its place, is never written through). Symlinks are followed to their target, which is
rewritten while the link stays a link. Read-only targets, and ``-o`` naming the input without ``--in-place``,
are refused before anything is written; no temp file survives, on success or on error.
"""

from __future__ import annotations

import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from coordexp.errors import UserInputError
from coordexp.schema.migrate import Migration, migrate_text
from coordexp.schema.yaml_io import MAX_CONFIG_BYTES, YamlReadError, read_yaml_file

__all__ = ["MigrationRefused", "MigratedFile", "migrate_file", "replace_atomically", "TEMP_SUFFIX"]

TEMP_SUFFIX = ".migrate-tmp"
_MAX_BACKUPS = 1000


class MigrationRefused(UserInputError):
    """``migrate`` will not write where it was asked to (read-only, the input itself, a failed write): exit 2."""


@dataclass(frozen=True)
class MigratedFile:
    """What ``migrate`` did: the new text, the migration report, where it wrote, and the backup it kept."""

    text: str
    migration: Migration
    written: Optional[Path]
    backup: Optional[Path]


def _read_original(path: Path) -> bytes:
    """The exact bytes of ``path`` (after the same checks ``validate`` makes: exists, a file, within the cap)."""
    read_yaml_file(path)  # raises YamlReadError for a missing, binary, oversized or unparsable file
    with path.open("rb") as handle:
        return handle.read(MAX_CONFIG_BYTES + 1)


def _is_read_only(path: Path) -> bool:
    """No write permission for us, or no write bit at all (honoured even for root, who could write anyway)."""
    mode = path.stat().st_mode
    return not os.access(path, os.W_OK) or not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)


def _check_writable(target: Path) -> None:
    folder = target.parent
    try:
        info = os.stat(target) if os.path.lexists(target) else None
    except OSError as exc:  # a name over NAME_MAX, a symlink loop, a component that is a file
        raise MigrationRefused(f"cannot write {target} ({exc.strerror or exc}); nothing was written",
                               hint="Choose another output path (each name at most 255 bytes).") from None
    if info is not None and not stat.S_ISREG(info.st_mode):
        raise MigrationRefused(f"{target} is not a regular file (a directory, FIFO or device); nothing was written",
                               hint="Write to a new file or a regular file with -o.")
    if info is not None and _is_read_only(target):
        raise MigrationRefused(f"{target} is read-only; nothing was written",
                               hint="Make it writable (chmod u+w) or write elsewhere with -o NEW.yaml.")
    if not folder.is_dir():
        raise MigrationRefused(f"folder {folder} does not exist; nothing was written", hint="Create it first.")
    if _is_read_only(folder):
        raise MigrationRefused(f"folder {folder} is read-only (the new file is written there and renamed); nothing "
                               "was written", hint="Make the folder writable or write elsewhere with -o.")


def _same_file(a: Path, b: Path) -> bool:
    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` exclusively (never through an existing file or symlink) with ``data``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            fd = -1
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        if fd != -1:
            os.close(fd)
        path.unlink(missing_ok=True)
        raise


def _write_backup(target: Path, original: bytes) -> Path:
    """``TARGET.bak``, or the first free ``TARGET.bak.N``: an existing name (a symlink too) is never reused."""
    mode = stat.S_IMODE(target.stat().st_mode)
    for n in range(_MAX_BACKUPS):
        backup = target.with_name(target.name + (".bak" if n == 0 else f".bak.{n}"))
        if os.path.lexists(backup):
            continue
        try:
            _write_new(backup, original, mode)
        except FileExistsError:
            continue  # appeared since the check: take the next number
        return backup
    raise MigrationRefused(f"{target} already has {_MAX_BACKUPS} backups (.bak ... .bak.{_MAX_BACKUPS - 1})",
                           hint="Delete the old backups you no longer need.")


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def replace_atomically(target: Path, data: bytes, *, prefix: Optional[str] = None, suffix: str = TEMP_SUFFIX) -> None:
    """Write ``data`` to a temp file beside ``target`` (``prefix``, default ``.<name>.``) and rename it over
    ``target``, keeping its mode (a new file gets the umask's); the temp never survives."""
    mode = stat.S_IMODE(target.stat().st_mode) if target.exists() else 0o666 & ~_current_umask()
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}." if prefix is None else prefix,
                                    suffix=suffix)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def migrate_file(source: Path, *, in_place: bool = False, output: Optional[Path] = None) -> MigratedFile:
    """Migrate ``source``: in place (with a backup), to ``output``, or only return the text (stdout).

    Raises :class:`YamlReadError` or :class:`ConfigError` for a bad input and :class:`MigrationRefused` when the
    target cannot be written safely; in every case the original bytes are untouched.
    """
    if in_place and output is not None:
        raise MigrationRefused("use either --in-place or --output, not both")
    source = Path(source)
    if output is not None and source.exists() and _same_file(source, Path(output)):
        raise MigrationRefused(
            f"--output {output} is the input file; it would be overwritten without a backup",
            hint="Use --in-place to rewrite it (a .bak backup is kept), or name another output file.",
        )
    original = _read_original(source)
    try:
        text = original.decode("utf-8")
    except UnicodeDecodeError:  # read_yaml_file already refused this; kept for a file changed in between
        raise YamlReadError("not a UTF-8 text file", "Pass a YAML config file.") from None
    new_text, migration = migrate_text(text, source, source if in_place else output)
    if "\r\n" in text and new_text is not text:
        new_text = new_text.replace("\r\n", "\n").replace("\n", "\r\n")  # keep the file's Windows line endings
    if not in_place and output is None:
        return MigratedFile(new_text, migration, None, None)
    target = source.resolve() if in_place else Path(output).resolve()  # through symlinks: the link stays a link
    _check_writable(target)
    backup = None
    try:
        if in_place:
            if not migration.changed:
                return MigratedFile(new_text, migration, None, None)
            backup = _write_backup(target, original)
        replace_atomically(target, new_text.encode("utf-8"))
    except OSError as exc:
        where = f" (the original is unchanged; backup: {backup})" if backup else " (nothing was changed)"
        raise MigrationRefused(f"cannot write {target}: {exc.strerror or exc}{where}",
                               hint="Check the folder's permissions and free space.") from None
    return MigratedFile(new_text, migration, source if in_place else Path(output), backup)
