"""The one error family: every error coordexp raises on purpose says what went wrong, how to fix it, and which
exit code a script sees (standard library only, so every layer, the schema included, can raise it).

- :class:`UserInputError` (exit 2): the config, the data, an encoding or packing limit, the launch inputs.
- :class:`ExternalSystemError` (exit 3): a rollout server, weight sync, the device topology, an unavailable
  backend or package, offload, a busy port: something outside coordexp failed or cannot do what was asked.
- Anything else is a bug in coordexp (exit 1).

Classes keep their historical bases too (``ValueError``, ``RuntimeError``, ``ImportError``) as a second base, so
existing ``except`` clauses hold: ``class DatasetError(UserInputError, ValueError)``.
"""

from __future__ import annotations

__all__ = [
    "EXIT_OK",
    "EXIT_INTERNAL",
    "EXIT_INVALID",
    "EXIT_EXTERNAL",
    "CoordexpError",
    "UserInputError",
    "ExternalSystemError",
    "MissingDependencyError",
    "exit_code_for",
]

EXIT_OK, EXIT_INTERNAL, EXIT_INVALID, EXIT_EXTERNAL = 0, 1, 2, 3


class CoordexpError(Exception):
    """Base of every deliberate coordexp error: ``message`` says what happened, ``hint`` how to fix it (optional)."""

    exit_code: int = EXIT_INTERNAL

    def __init__(self, message: str = "", *args: object, hint: str = "") -> None:
        super().__init__(message, *args)
        # Plain attributes (not properties): several historical subclasses assign ``self.message`` themselves.
        self.message = str(message)
        self.hint = hint

    def __str__(self) -> str:
        # The historical classes were plain exceptions whose str() was their first argument: keep that.
        return self.message if len(self.args) <= 1 else super().__str__()


class UserInputError(CoordexpError):
    """The input is wrong (config, data, arguments, a limit the user can change): exit 2."""

    exit_code = EXIT_INVALID


class ExternalSystemError(CoordexpError):
    """A system coordexp depends on failed or refused (server, transport, devices, installed packages): exit 3."""

    exit_code = EXIT_EXTERNAL


class MissingDependencyError(ExternalSystemError, ImportError):
    """An optional package the configuration needs is not installed; the hint names the ``pip install``."""


def exit_code_for(exc: BaseException) -> int:
    """2 for user input, 3 for an external system, 1 for anything else (a bug)."""
    return exc.exit_code if isinstance(exc, CoordexpError) else EXIT_INTERNAL
