"""Bounded reads of the small text files a config names (the YAML configs themselves, a DeepSpeed JSON): regular
files (a FIFO would wait for a writer), read up to a size cap (``/dev/zero`` never ends), UTF-8 without NUL, and
JSON nested at most :data:`MAX_JSON_DEPTH` deep; every failure is the caller's :class:`UserInputError` subclass,
so ``validate`` exits 2 with the reason instead of hanging, eating memory or hitting ``RecursionError``."""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from coordexp.errors import UserInputError

__all__ = ["FileReadError", "read_capped_text", "read_json_file", "MAX_JSON_BYTES", "MAX_JSON_DEPTH"]

MAX_JSON_BYTES = 256 * 1024
"""Size cap of a JSON settings file a config names (DeepSpeed's are under 2 KiB)."""
MAX_JSON_DEPTH = 32
"""Deepest nesting accepted (a DeepSpeed config nests 3 deep); deeper would exhaust the parser's recursion."""
_BRACKET_OR_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)


class FileReadError(UserInputError):
    """A named file could not be read or parsed; ``hint`` says how to fix it."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.message = message
        self.hint = hint


def _broken_link(path: Path) -> str:
    """Why ``path``, which does not resolve to a file, is a broken symlink ("" when it is no symlink at all)."""
    if not os.path.islink(path):
        return ""
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symlink loop (the link leads back to itself and never reaches a file)"
    return f"a symlink to a missing file ({os.readlink(path)[:200]!r})"


def _open_flags() -> int:
    """Read only, never waiting to open (a FIFO) nor taking a terminal as the controlling one."""
    return os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)


def _open_problem(path: Path, exc: OSError, kind: str, error: type[FileReadError]) -> FileReadError:
    if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR) and not os.path.exists(path):
        link = _broken_link(path)
        if link:
            return error(link, f"Point the link at a {kind} file, or name the file itself.")
        return error("file not found", "Check the path (relative paths are from the current directory).")
    if exc.errno in (errno.ENXIO, errno.EOPNOTSUPP):  # a socket (or a FIFO on some systems)
        return error("is a FIFO or socket, not a file", "Pass a file.")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return error(f"cannot read file ({exc.strerror})", "Check the file permissions.")
    reason = exc.strerror or str(exc)  # a name over NAME_MAX, a NUL byte (ValueError), a path through a file
    return error(f"cannot use this path ({reason})", "Check the path; each file or folder name may have at most 255 "
                                                     "bytes.")


def read_capped_text(path: Path, *, max_bytes: int, kind: str, suffix: str,
                     error: type[FileReadError] = FileReadError) -> str:
    """The UTF-8 text of the regular file ``path`` (at most ``max_bytes``); ``kind`` names what it should be
    ("YAML", "JSON") and ``suffix`` the file to pass instead, in the messages. The file is opened once, without
    waiting (a FIFO, a terminal), and judged by what was opened (``fstat``), never checked by name and reopened."""
    try:
        fd = os.open(path, _open_flags())
    except ValueError as exc:  # a NUL byte in the name
        raise error(f"cannot use this path ({exc})", "Check the path.") from None
    except OSError as exc:
        raise _open_problem(path, exc, kind, error) from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise error(f"is a directory, not a {kind} file", f"Pass a {suffix} file.")
        if stat.S_ISFIFO(info.st_mode) or stat.S_ISSOCK(info.st_mode):  # reading one would wait for a writer
            raise error("is a FIFO or socket, not a file", f"Pass a {suffix} file.")
        if os.isatty(fd):  # a terminal: reading waits for someone to type
            raise error("is a terminal, not a file", f"Pass a {suffix} file.")
        try:
            raw = _read_up_to(fd, max_bytes + 1)  # never more than the cap, whatever the file claims (or a device)
        except BlockingIOError:  # a device with nothing to read now: reading would wait
            raise error("is a device that waits for input, not a file", f"Pass a {suffix} file.") from None
        except OSError as exc:  # /proc/self/mem: a regular file that refuses reads
            raise error(f"cannot read file ({exc.strerror or exc})", "Check the file permissions.") from None
    finally:
        os.close(fd)
    if len(raw) > max_bytes:
        raise error(f"file is larger than the {max_bytes // 1024} KiB cap on {kind} settings files",
                    f"A {kind} settings file is a few KiB; check that the path names the right file.")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise error("not a UTF-8 text file (binary data?)", f"Pass a {suffix} file.") from None
    if "\x00" in text:
        raise error("not a text file (contains NUL bytes)", f"Pass a {suffix} file.")
    return text


def _read_up_to(fd: int, limit: int) -> bytes:
    """Up to ``limit`` bytes of ``fd``, reading until the end of the file (one read may return less)."""
    parts, size = [], 0
    while size < limit:
        part = os.read(fd, limit - size)
        if not part:
            break
        parts.append(part)
        size += len(part)
    return b"".join(parts)


def json_depth(text: str) -> int:
    """The deepest bracket nesting of JSON ``text`` (brackets inside strings do not count)."""
    depth = deepest = 0
    for match in _BRACKET_OR_STRING.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif token in "]}":
            depth -= 1
    return deepest


def read_json_file(path: Path, *, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Parse the JSON file ``path`` under the bounds of :func:`read_capped_text` and :data:`MAX_JSON_DEPTH`."""
    text = read_capped_text(path, max_bytes=max_bytes, kind="JSON", suffix=".json")
    if json_depth(text) > MAX_JSON_DEPTH:
        raise FileReadError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels",
                            "A settings file nests a few levels; check that the path names the right file.")
    try:
        return json.loads(text)
    except ValueError as exc:  # also int() of a literal past Python's digit limit
        raise FileReadError(f"invalid JSON ({str(exc)[:200]})", "Fix the JSON syntax at that position.") from None
