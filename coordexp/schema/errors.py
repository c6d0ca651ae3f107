"""Config problems as data: every issue carries a dotted path, what is wrong, how to fix it, and its file."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Union

from coordexp.errors import UserInputError

__all__ = ["ConfigIssue", "ConfigError", "RuleViolation", "ConfigRuleError", "format_path", "parse_path"]

PathPart = Union[str, int]


def format_path(parts: Iterable[PathPart]) -> str:
    """``("a", "b", 0, "c")`` -> ``a.b[0].c``; the empty path is the file's top level."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def parse_path(dotted: str) -> tuple[PathPart, ...]:
    """``a.b[0].c`` -> ``("a", "b", 0, "c")``, the inverse of :func:`format_path`. A non-numeric index such as
    the ``[*]`` of a legacy-key pattern stays the string ``"[*]"``."""
    parts: list[PathPart] = []
    for piece in dotted.split("."):
        while "[" in piece:
            head, _, rest = piece.partition("[")
            if head:
                parts.append(head)
            index, _, piece = rest.partition("]")
            parts.append(int(index) if index.isdigit() else f"[{index}]")
        if piece:
            parts.append(piece)
    return tuple(parts)


@dataclass(frozen=True)
class ConfigIssue:
    """One problem (or warning) in a config file."""

    path: str
    message: str
    hint: str = ""
    file: Optional[str] = None

    def render(self) -> str:
        """One line: ``path: message. hint`` (the top level prints as ``<top level>``)."""
        where = self.path or "<top level>"
        text = f"{where}: {self.message}"
        return f"{text}. {self.hint}" if self.hint else text

    def to_dict(self) -> dict:
        return {"path": self.path, "message": self.message, "hint": self.hint, "file": self.file}


class ConfigError(UserInputError, ValueError):
    """A config failed to load or validate; ``issues`` holds every problem found, not just the first."""

    def __init__(self, issues: Iterable[ConfigIssue]):
        self.issues: tuple[ConfigIssue, ...] = tuple(issues)
        super().__init__(self._summary())

    def _summary(self) -> str:
        files = sorted({i.file for i in self.issues if i.file})
        head = f"{len(self.issues)} config problem(s)" + (f" in {', '.join(files)}" if files else "")
        return head + ":\n" + "\n".join(f"  - {i.render()}" for i in self.issues)


@dataclass(frozen=True)
class RuleViolation:
    """A broken cross-field rule, ``path`` relative to the model whose validator found it."""

    path: str
    message: str
    hint: str = ""


class ConfigRuleError(UserInputError, ValueError):
    """Raised by model validators so the loader can report every violated rule at its own dotted path."""

    def __init__(self, violations: Iterable[RuleViolation]):
        self.violations: tuple[RuleViolation, ...] = tuple(violations)
        super().__init__("; ".join(f"{v.path}: {v.message}. {v.hint}".rstrip(". ") for v in self.violations))


def raise_violations(violations: list[RuleViolation]) -> None:
    """Raise :class:`ConfigRuleError` when any rule was violated (helper for ``model_validator``)."""
    if violations:
        raise ConfigRuleError(violations)
