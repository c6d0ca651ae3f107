"""File safety for commands that read user files and write results (``convert``, ``eval``): bounded reads of regular
files only, and output targets that can never be an input, a device, a FIFO or a read-only file (standard library
only; every refusal is a :class:`~coordexp.errors.UserInputError`, exit 2, naming the path).

Reads: a FIFO, character device or directory is refused before it is opened (``/dev/zero`` or a FIFO would block or
never end), and at most ``max_bytes`` are read from a regular file. Writes: the target is checked first (see
:func:`check_output_file`), then written to a temp file in the same directory and renamed over it, so a reader
sees the old file or the whole new one, and a failed write leaves nothing behind.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Iterable, Optional

from coordexp.errors import UserInputError
from coordexp.schema.migrate_io import replace_atomically

__all__ = ["MAX_SOURCE_BYTES", "read_source_bytes", "read_source_text", "check_path_names", "check_output_file",
           "check_output_dir", "write_atomic", "write_new_file", "same_file"]

MAX_SOURCE_BYTES = 2 * 2**30
"""Largest input file read (2 GiB: LVIS v1 train is 1.1 GB); larger ones are refused rather than read to the end."""
_TEMP_PREFIX = ".coordexp-write-"  # short: a 255-byte target name still leaves room for the temp file's name
_FALLBACK_NAME_MAX, _FALLBACK_PATH_MAX = 255, 4096


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def _name_max(folder: Path) -> tuple[int, int]:
    """The file system's NAME_MAX / PATH_MAX at the nearest existing ancestor of ``folder`` (255 / 4096 if unknown)."""
    probe = folder
    for _ in range(256):
        try:
            if probe.is_dir():
                return (os.pathconf(probe, "PC_NAME_MAX"), os.pathconf(probe, "PC_PATH_MAX"))
        except (OSError, ValueError):
            break
        if probe.parent == probe:
            break
        probe = probe.parent
    return _FALLBACK_NAME_MAX, _FALLBACK_PATH_MAX


def check_path_names(path: Path, what: str) -> None:
    """Refuse a path with a NUL byte, a lone surrogate, a component longer than the file system allows or a whole
    path over PATH_MAX, before any system call fails on it."""
    text = os.fspath(path)
    if "\x00" in text:
        raise UserInputError(f"{what} {text!r} contains a NUL byte", hint="write the plain file path")
    try:
        encoded = os.fsencode(text)
    except UnicodeEncodeError:
        raise UserInputError(f"{what} {ascii(text)} cannot be encoded for the file system") from None
    absolute = os.fsencode(os.path.abspath(text))
    name_max, path_max = _name_max(Path(os.path.abspath(text)).parent)
    longest = max((len(part) for part in encoded.split(b"/")), default=0)
    if longest > name_max:
        raise UserInputError(f"{what} has a {longest}-byte path component; this file system allows {name_max} "
                             f"bytes per name", hint="use a shorter file or folder name")
    if len(absolute) >= path_max:
        raise UserInputError(f"{what} is {len(absolute)} bytes long as an absolute path; this file system allows "
                             f"{path_max - 1}", hint="use a shorter path")


def read_source_bytes(path: Path, what: str = "input", *, max_bytes: Optional[int] = None) -> bytes:
    """The bytes of the regular file ``path`` (through symlinks), at most ``max_bytes`` (default
    :data:`MAX_SOURCE_BYTES`); a FIFO, device or directory is refused without blocking on it."""
    limit = MAX_SOURCE_BYTES if max_bytes is None else max_bytes
    check_path_names(path, f"{what} {path}")
    try:
        info = os.stat(path)
    except OSError as exc:
        raise UserInputError(f"{path}: cannot read ({_reason(exc)})", hint=f"check the {what} path") from None
    if not stat.S_ISREG(info.st_mode):
        raise UserInputError(f"{path}: is {_kind(info.st_mode)}, not a regular file",
                             hint=f"the {what} must be a file; nothing was read")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise UserInputError(f"{path}: cannot read ({_reason(exc)})", hint=f"check the {what} permissions") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped for a FIFO since the check
            raise UserInputError(f"{path}: is not a regular file", hint=f"the {what} must be a file")
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, min(1 << 24, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as exc:
        raise UserInputError(f"{path}: cannot read ({_reason(exc)})", hint=f"check the {what} file") from None
    finally:
        os.close(fd)
    if total > limit:
        raise UserInputError(f"{path}: larger than the {limit}-byte limit on {what} files",
                             hint="split the file, or check that this is the file you meant")
    return b"".join(chunks)


def read_source_text(path: Path, what: str = "input", *, max_bytes: Optional[int] = None) -> str:
    """:func:`read_source_bytes` decoded as UTF-8 (a leading byte-order mark dropped); a bad byte names its offset."""
    raw = read_source_bytes(path, what, max_bytes=max_bytes)
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UserInputError(f"{path}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start})",
                             hint="save the file as UTF-8") from None


def same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name the same file (same path through symlinks, or the same inode: a hard link)."""
    try:
        if os.path.realpath(a) == os.path.realpath(b):
            return True
        first, second = os.stat(a), os.stat(b)
    except (OSError, ValueError):
        return False
    return (first.st_dev, first.st_ino) == (second.st_dev, second.st_ino)


def _read_only(path: Path, info: os.stat_result) -> bool:
    """No write permission for us, or no write bit at all (honoured even for root, who could write anyway)."""
    return not os.access(path, os.W_OK) or not info.st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)


def _check_folder(folder: Path, what: str) -> None:
    """The nearest existing ancestor of ``folder`` is a writable directory (nothing is created here)."""
    probe = folder
    while True:
        try:
            info = os.stat(probe)
        except FileNotFoundError:
            if probe.parent == probe:
                break
            probe = probe.parent
            continue
        except OSError as exc:
            raise UserInputError(f"{what}: cannot use {probe} ({_reason(exc)})", hint="choose another location"
                                 ) from None
        if not stat.S_ISDIR(info.st_mode):
            raise UserInputError(f"{what}: {probe} is {_kind(info.st_mode)}, not a directory",
                                 hint="choose a path inside a directory")
        if not os.access(probe, os.W_OK | os.X_OK):
            raise UserInputError(f"{what}: the directory {probe} is not writable", hint="choose another location")
        return


def check_output_file(path: Path, inputs: Iterable[Path], what: str = "--output") -> Path:
    """The real path to write ``path`` at (a symlink is followed, so the link stays a link), after refusing an
    input file (also through a symlink or hard link), a directory, FIFO, device or socket, and a read-only file;
    its folder (or the nearest existing ancestor) must be a writable directory. Nothing is created."""
    check_path_names(path, f"{what} {path}")
    real = Path(os.path.realpath(path))
    check_path_names(real, f"{what} {path}")
    try:
        info: Optional[os.stat_result] = os.stat(real)
    except FileNotFoundError:
        info = None
    except OSError as exc:
        raise UserInputError(f"{what} {path}: cannot use this path ({_reason(exc)})", hint="choose another file"
                             ) from None
    for source in inputs:
        if source is not None and same_file(source, path):
            raise UserInputError(f"{what} {path} is the input file {source}; it would be destroyed",
                                 hint="write the output to a new file")
    if info is not None:
        if not stat.S_ISREG(info.st_mode):
            raise UserInputError(f"{what} {path} is {_kind(info.st_mode)}; the output must be a regular file or a "
                                 "new path", hint="choose another output file; nothing was written")
        if _read_only(real, info):
            raise UserInputError(f"{what} {path} is read-only; nothing was written",
                                 hint="make it writable (chmod u+w) or choose another output file")
    _check_folder(real.parent, f"{what} {path}")
    return real


def check_output_dir(path: Path, what: str = "--out") -> Path:
    """A directory that can take new files: an existing writable directory, or a new path under one (never a link
    that points nowhere: creating the folder there would fail after the work)."""
    check_path_names(path, f"{what} {path}")
    if os.path.islink(path) and not os.path.exists(path):
        raise UserInputError(f"{what} {path} is a link to {os.readlink(path)}, which does not exist",
                             hint="create the folder it points at, or name a real folder")
    real = Path(os.path.realpath(path))
    try:
        info: Optional[os.stat_result] = os.stat(real)
    except FileNotFoundError:
        info = None
    except OSError as exc:
        raise UserInputError(f"{what} {path}: cannot use this path ({_reason(exc)})", hint="choose another folder"
                             ) from None
    if info is not None and not stat.S_ISDIR(info.st_mode):
        raise UserInputError(f"{what} {path} is {_kind(info.st_mode)}, not a directory",
                             hint="name a directory (new or existing) for the results")
    _check_folder(real, f"{what} {path}")
    return real


def write_atomic(path: Path, data: bytes, what: str = "--output") -> None:
    """Write ``data`` to a temp file beside ``path`` (the real path from :func:`check_output_file`) and rename it
    over ``path`` (:func:`coordexp.schema.migrate_io.replace_atomically`); parents are created now. An OS error is
    a :class:`UserInputError` and leaves no temp file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_atomically(path, data, prefix=_TEMP_PREFIX, suffix=".tmp")
    except OSError as exc:
        raise UserInputError(f"{what} {path}: cannot write ({_reason(exc)}); nothing was written",
                             hint="check the folder's permissions and free space") from None


def write_new_file(path: Path, data: bytes, what: str = "--output") -> None:
    """Create ``path`` holding ``data``, whole or not at all, and never over a file that appeared meanwhile: a temp
    file beside it is hard-linked into place (``link`` fails on an existing name); where the file system has no
    hard links, an exclusive create. A name taken since the check is a :class:`UserInputError`, the file left be."""
    import errno
    import tempfile

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(prefix=_TEMP_PREFIX, suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            mask = os.umask(0)
            os.umask(mask)
            os.chmod(temp, 0o666 & ~mask)
            try:
                os.link(temp, path)
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                    raise
                with open(path, "xb") as handle:  # no hard links here: exclusive create, never a replace
                    handle.write(data)
        finally:
            os.unlink(temp)
    except FileExistsError:
        raise UserInputError(f"{what} {path} appeared while it was being written; it was left as it is",
                             hint="choose a new name") from None
    except OSError as exc:
        raise UserInputError(f"{what} {path}: cannot write ({_reason(exc)}); nothing was written",
                             hint="check the folder's permissions and free space") from None
