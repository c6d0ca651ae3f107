"""The frame every ``coordexp`` command runs in: exit codes, consoles, safe printing, "load the run or exit 2", and
the guarded runner that turns any exception into one message and the exit code of its class.

The API other command modules use (stable names; light imports only: typer, rich, the standard library):

- ``EXIT_OK`` 0, ``EXIT_INTERNAL`` 1 (a bug), ``EXIT_INVALID`` 2 (user input), ``EXIT_EXTERNAL`` 3 (an external
  system): re-exported from :mod:`coordexp.errors`.
- ``out`` / ``err``: the Rich consoles on stdout / stderr.
- ``safe(value)``: a user-supplied string (key, value, path, a message quoting user input) made safe to embed in
  Rich markup: control characters escaped (ESC prints as ``\\x1b``), then markup escaped. ``plain(value)`` escapes
  the control characters only (for text written without Rich).
- ``is_rank_zero()``; ``fail(message, hint, code)`` prints ``✗ message. hint`` (on rank 0; another rank prints it as
  one line prefixed ``[rank k]``) and exits with ``code``; inside ``failures_deferred()`` it only raises its
  ``Failure`` (message, hint, code) for the caller to report with ``print_failure``.
- ``issue_line`` / ``print_invalid_report``: how a config problem and an invalid file's report are printed.
- ``load_run(path, as_json=...)``: validate a config and build its run contract, or print the report and exit 2.
- ``guarded(command)``: wrap a command function (``app.command("name")(guarded(fn))``). An exception escaping it
  exits ``exit_code_for(exc)``: 2/3 print ``✗ message. hint`` and no traceback; anything else prints "internal
  error ... this is a bug in coordexp" and exits 1. ``COORDEXP_DEBUG=1`` adds the traceback. When the command has a
  ``--json`` flag bound to the parameter ``as_json`` and it is set, the error is also one JSON object on stdout.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn, Optional, Sequence, TextIO, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from coordexp.errors import (
    EXIT_EXTERNAL,
    EXIT_INTERNAL,
    EXIT_INVALID,
    EXIT_OK,
    ExternalSystemError,
    UserInputError,
    exit_code_for,
)
from coordexp.optional_deps import as_external_error

__all__ = [
    "EXIT_OK", "EXIT_INTERNAL", "EXIT_INVALID", "EXIT_EXTERNAL", "EXIT_INTERRUPTED", "DEBUG_ENV",
    "out", "err", "safe", "plain", "is_rank_zero", "fail", "Failure", "failures_deferred", "print_failure",
    "issue_line", "print_invalid_report", "load_run", "load_run_and_config", "validate_with_overrides",
    "guarded", "report_exception", "error_payload", "write_result",
]

EXIT_INTERRUPTED = 130
DEBUG_ENV = "COORDEXP_DEBUG"
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)
_result_stream: Optional[TextIO] = None  # stdout while a --json command runs (sys.stdout is then stderr)


def write_result(text: str) -> None:
    """The one way a command's machine-read result reaches stdout. While a ``--json`` command runs, ``sys.stdout``
    points at stderr, so what libraries print there (DeepSpeed's logger, raw log lines) cannot corrupt the JSON a
    launcher parses."""
    (_result_stream or sys.stdout).write(text)

# C0 (but newline/tab, handled below), DEL, C1 (0x9b is a one-byte CSI on some terminals), the Unicode line and
# paragraph separators, and the bidirectional overrides/isolates that can reorder what a reader sees.
_CONTROL = "\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
_UNSAFE_INLINE = re.compile(f"[\t\n{_CONTROL}]")
_UNSAFE_MULTILINE = re.compile(f"[{_CONTROL}]")
F = TypeVar("F", bound=Callable[..., Any])
# Exits and usage errors that typer turns into its own exit codes. Usage errors derive from click's ClickException,
# which recent typer versions vendor: found through the public BadParameter, so no second click is imported.
_USAGE_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
_PASS_THROUGH = (typer.Exit, typer.Abort, _USAGE_ERROR)


def _escape_char(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def plain(value: object, *, multiline: bool = False) -> str:
    """``str(value)`` with control characters shown as escapes (``\\x1b``), so printing it cannot drive the
    terminal; ``multiline`` keeps newlines and tabs (messages that list problems line by line). A trailing
    backslash is shown as ``\\x5c`` too: Rich prints it once or twice depending on what follows it."""
    pattern = _UNSAFE_MULTILINE if multiline else _UNSAFE_INLINE
    shown = pattern.sub(_escape_char, str(value))
    return shown[:-1] + "\\x5c" if shown.endswith("\\") else shown


def safe(value: object, *, multiline: bool = False) -> str:
    """A user-supplied string ready to embed in Rich markup: :func:`plain`, then markup escaped."""
    return escape(plain(value, multiline=multiline))


def is_rank_zero() -> bool:
    """False on every torchrun rank but 0: those train silently."""
    return os.environ.get("RANK", "0") in ("", "0")


def _sentence(message: str, hint: str = "") -> str:
    """``message. hint`` in markup, both escaped, without doubling a final full stop."""
    text = safe(message.rstrip(), multiline=True)
    if hint:
        text = text.rstrip(".") + f". [dim]{safe(hint.strip(), multiline=True)}[/dim]"
    return text


class Failure(typer.Exit):
    """What :func:`fail` raises: the exit ``code`` with its ``message`` and ``hint``; ``shown`` when this rank has
    already printed it (an invalid config's full report)."""

    def __init__(self, message: str, hint: str = "", code: int = EXIT_INVALID, *, shown: bool = False) -> None:
        super().__init__(code)
        self.message, self.hint, self.shown = message, hint, shown


_deferred: list[bool] = []


@contextlib.contextmanager
def failures_deferred() -> Iterator[None]:
    """Inside, :func:`fail` raises its :class:`Failure` without printing it (the caller reports it, e.g. once every
    rank's outcome is known)."""
    _deferred.append(True)
    try:
        yield
    finally:
        _deferred.pop()


def print_failure(message: str, hint: str = "") -> None:
    """``✗ message. hint`` on stderr: in full on rank 0, as one line prefixed ``[rank k]`` on any other rank (a
    rank's reason may be its own: a file its node lacks)."""
    if is_rank_zero():
        err.print(f"[red]✗[/red] {_sentence(message, hint)}")
    else:
        err.print(f"{_rank_prefix()}[red]✗[/red] {_sentence(' '.join(message.split()), hint)}")


def _rank_prefix() -> str:
    rank = os.environ.get("RANK", "0") or "0"
    return "" if rank == "0" else safe(f"[rank {rank}] ")


def fail(message: str, hint: str = "", code: int = EXIT_INVALID) -> NoReturn:
    """Print ``✗ message. hint`` on stderr (:func:`print_failure`) and exit with ``code`` (default 2, user input)."""
    if not _deferred:
        print_failure(message, hint)
    raise Failure(message, hint, code)


def issue_line(issue: Any, top_file: Optional[str]) -> str:
    """One config problem (a :class:`~coordexp.schema.errors.ConfigIssue`) as markup: path, message, hint, and the
    file it came from when that is not the file named on the command line."""
    text = f"[bold]{safe(issue.path or '<top level>')}[/bold]: {safe(issue.message)}"
    if issue.hint:
        text += f". [dim]{safe(issue.hint)}[/dim]"
    if issue.file and issue.file != top_file:
        text += f" [dim](in {safe(issue.file)})[/dim]"
    return text


def print_invalid_report(console: Console, shown: str, report: Any) -> None:
    """The ``✗ FILE: N problem(s)`` line and one bullet per error, as every command that validates prints them."""
    console.print(f"[red]✗[/red] {safe(shown)}: {len(report.errors)} problem(s)")
    for issue in report.errors:
        console.print("  [red]•[/red] " + issue_line(issue, report.path))


def load_run(path: Path, *, as_json: bool = False, overrides: Sequence[str] = ()) -> Any:
    """The :class:`~coordexp.schema.contract.RunContract` of the config at ``path``; if the file is invalid, print
    every problem (and, with ``as_json``, the report as JSON on stdout) and exit 2 before anything is loaded."""
    return load_run_and_config(path, as_json=as_json, overrides=overrides)[0]


def load_run_and_config(path: Path, *, as_json: bool = False, overrides: Sequence[str] = ()) -> tuple[Any, Any]:
    """:func:`load_run` and the validated config it came from; ``overrides`` (``dotted.key=value``, see
    :mod:`coordexp.cli.overrides`) are applied to the loaded YAML and validated with it."""
    from coordexp.schema.contract import build_contract
    from coordexp.schema.errors import ConfigError
    from coordexp.schema.loader import validate_config_file

    if overrides:
        report = validate_with_overrides(path, overrides)
    else:
        report = validate_config_file(path)
    errors = list(report.errors)
    if report.ok:
        try:
            return build_contract(report.config), report.config
        except ConfigError as exc:  # a rule only the contract checks: report it like the schema's own
            errors = list(exc.issues)
    summary = f"{path}: {len(errors)} problem(s)" + (f", the first: {errors[0].render()}" if errors else "")
    if not is_rank_zero():
        fail(summary)  # one line on another rank (its node may lack a file the config names)
    err.print(f"[red]✗[/red] {safe(path)}: {len(errors)} problem(s)")
    for issue in errors:
        err.print("  [red]•[/red] " + issue_line(issue, report.path))
    err.print(f"[dim]Nothing was loaded. Fix the file (`coordexp validate {safe(path)}`).[/dim]")
    if as_json:
        write_result(json.dumps({"ok": False, "exit_code": EXIT_INVALID, "path": str(path),
                                 "errors": [i.to_dict() for i in errors]}, indent=2) + "\n")
    raise Failure(summary, shown=True)


def validate_with_overrides(path: Path, overrides: Sequence[str]) -> Any:
    """The validation report of the config at ``path`` with ``overrides`` applied (a malformed override raises
    :class:`~coordexp.errors.UserInputError`)."""
    from coordexp.cli.overrides import apply_overrides
    from coordexp.schema.errors import ConfigError
    from coordexp.schema.loader import ValidationReport, load_merged, validate_merged

    try:
        merged = load_merged(path)
    except ConfigError as exc:
        return ValidationReport(str(path), None, exc.issues, ())
    return validate_merged(apply_overrides(merged, overrides))


def error_payload(exc: BaseException) -> dict[str, Any]:
    """The ``--json`` form of an error: exit code, kind, class, message, hint (and config issues when it has them)."""
    code = exit_code_for(exc)
    kind = {EXIT_INVALID: "user_input", EXIT_EXTERNAL: "external_system"}.get(code, "internal")
    message = getattr(exc, "message", None) if isinstance(exc, (UserInputError, ExternalSystemError)) else None
    payload: dict[str, Any] = {"ok": False, "exit_code": code, "error": {
        "kind": kind, "type": type(exc).__name__, "message": message if message is not None else str(exc),
        "hint": getattr(exc, "hint", "") or ""}}
    issues = getattr(exc, "issues", None)
    if issues and all(hasattr(i, "to_dict") for i in issues):
        payload["error"]["issues"] = [i.to_dict() for i in issues]
    return payload


def report_exception(exc: BaseException, *, as_json: bool = False) -> int:
    """Print ``exc`` the way the CLI reports errors (see the module docstring) and return its exit code."""
    code = exit_code_for(exc)
    debug = os.environ.get(DEBUG_ENV) == "1"
    # Rank 0 says it in full; another rank in one line (its reason may be its own: a file its node lacks), a bug
    # in full on every rank.
    if not is_rank_zero() and code != EXIT_INTERNAL and not debug:
        message = getattr(exc, "message", None)
        print_failure(message if isinstance(message, str) else str(exc), getattr(exc, "hint", "") or "")
        return code
    prefix = _rank_prefix()
    if debug:
        err.print(plain("".join(traceback.format_exception(exc)), multiline=True), markup=False)
    if code == EXIT_INTERNAL:
        text = " ".join(str(exc).split()) or "(no message)"
        err.print(f"{prefix}[red]✗ internal error[/red]: {safe(type(exc).__name__)}: {safe(text)}")
        if not debug:
            err.print(f"[dim]This is a bug in coordexp; rerun with {DEBUG_ENV}=1 for the traceback and report "
                      "it.[/dim]")
    else:
        message = getattr(exc, "message", None)
        err.print(f"{prefix}[red]✗[/red] {_sentence(message if isinstance(message, str) else str(exc), exc.hint)}")
    if as_json:
        write_result(json.dumps(error_payload(exc), indent=2) + "\n")
    return code


def guarded(command: F) -> F:
    """``command`` with every escaping exception reported by :func:`report_exception` and mapped to its exit code
    (typer/click exits and usage errors pass through; Ctrl-C exits 130)."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("as_json"):
            return _with_stdout_for_results_only(run_guarded, *args, **kwargs)
        return run_guarded(*args, **kwargs)

    def run_guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except _PASS_THROUGH:
            raise
        except KeyboardInterrupt:
            err.print("interrupted")
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except Exception as exc:  # noqa: BLE001 - the one place exceptions become exit codes
            exc = as_external_error(exc) or exc  # a missing package, an unreachable hub: exit 3 with what to run
            raise typer.Exit(report_exception(exc, as_json=bool(kwargs.get("as_json")))) from None

    return run  # type: ignore[return-value]


def _with_stdout_for_results_only(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    global _result_stream
    saved, outer = sys.stdout, _result_stream
    _result_stream, sys.stdout = saved, sys.stderr
    try:
        return call(*args, **kwargs)
    finally:
        sys.stdout, _result_stream = saved, outer
