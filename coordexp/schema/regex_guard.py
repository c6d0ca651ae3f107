"""A user's regular expression (``tuner.target_regex``) with a bound on what it can cost: Python's ``re`` backtracks,
so a 20-character pattern can take longer than the age of the universe on a 50-character module name, and a
pattern nested a thousand groups deep exhausts the parser's recursion (docs/design.md, decision 12).

Three guards, cheapest first: group nesting is counted without recursion and capped at :data:`MAX_GROUP_DEPTH`; a
repeated group whose body repeats again (``(x+)+``, the classic exponential shape) is refused from the parse tree;
and matching runs under a wall-clock budget (:data:`MATCH_BUDGET_S` for all names together), interrupted by a
timer signal on the main thread (``re`` checks for signals while it backtracks) or in a child process elsewhere.
Standard library only, so the schema (``validate``) and the runtime (``train``) share it.
"""

from __future__ import annotations

import itertools
import json
import re
import signal
import subprocess
import sys
import threading
import warnings
from typing import Iterable, Sequence

try:
    from re import _parser as _sre_parse  # the parse tree of the installed re (Python >= 3.11)
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as _sre_parse  # type: ignore[no-redef]

__all__ = ["MAX_GROUP_DEPTH", "MATCH_BUDGET_S", "RegexCostError", "group_depth", "compile_bounded", "fullmatching",
           "representative_names"]

MAX_GROUP_DEPTH = 32
"""Deepest nesting of groups accepted (a target regex needs three or four levels)."""
MATCH_BUDGET_S = 2.0
"""Seconds all module names together may take to match; the tiny model's take about a millisecond."""
_INDICES = ("0", "1", "9", "10", "27", "35", "63")  # layer numbers a representative name is written with


class RegexCostError(ValueError):
    """The pattern cannot be used: it does not compile, nests too deeply, or could take unbounded time to match."""


def group_depth(pattern: str) -> int:
    """How deeply groups nest in ``pattern`` (escapes and character classes skipped), counted without recursion."""
    depth = deepest = 0
    i, in_class = 0, False
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
            i += 1
            if i < len(pattern) and pattern[i] == "^":
                i += 1
            if i < len(pattern) and pattern[i] == "]":  # a "]" right after "[" or "[^" is a literal
                i += 1
            continue
        elif char == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif char == ")":
            depth = max(depth - 1, 0)
        i += 1
    return deepest


def _subpatterns(av: object) -> list:
    found, stack = [], [av]
    while stack:
        item = stack.pop()
        if isinstance(item, _sre_parse.SubPattern):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return found


def _repeats(op: object, av: object) -> bool:
    """A backtracking repeat that can run more than once (``*``, ``+``, ``{2,}``; not ``?`` nor possessive)."""
    name = str(op)
    return name in ("MAX_REPEAT", "MIN_REPEAT") and isinstance(av, tuple) and av[1] > 1


def _nested_repeat(tree: object) -> bool:
    """Whether some repeated body itself holds a repeat (an atomic group stops the backtracking: not counted)."""
    def holds_repeat(sub: object) -> bool:
        for op, av in sub:  # type: ignore[attr-defined]
            if str(op) == "ATOMIC_GROUP":
                continue
            if _repeats(op, av) or any(holds_repeat(s) for s in _subpatterns(av)):
                return True
        return False

    def walk(sub: object) -> bool:
        for op, av in sub:  # type: ignore[attr-defined]
            if _repeats(op, av) and any(holds_repeat(s) for s in _subpatterns(av)):
                return True
            if any(walk(s) for s in _subpatterns(av)):
                return True
        return False

    return walk(tree)


def compile_bounded(pattern: str) -> re.Pattern[str]:
    """``re.compile(pattern)`` after the nesting cap and the nested-repeat refusal; :class:`RegexCostError` says why
    a pattern is refused."""
    depth = group_depth(pattern)
    if depth > MAX_GROUP_DEPTH:
        raise RegexCostError(f"groups nest {depth} deep; at most {MAX_GROUP_DEPTH} are accepted")
    try:
        with warnings.catch_warnings():  # "possible nested set" and the like: the pattern is the user's
            warnings.simplefilter("ignore")
            tree = _sre_parse.parse(pattern)
            compiled = re.compile(pattern)
    except re.error as exc:
        raise RegexCostError(f"does not compile: {exc}") from None
    except (RecursionError, OverflowError, ValueError) as exc:
        raise RegexCostError(f"does not compile ({type(exc).__name__}: {str(exc)[:120]})") from None
    if _nested_repeat(tree):
        raise RegexCostError("a repeated group repeats again inside (a nested quantifier such as (x+)+ or "
                             "([a-z.]+)*): matching can take exponential time")
    return compiled


class _OutOfTime(Exception):
    pass


def _over_budget(pattern: str, budget_s: float, count: int) -> RegexCostError:
    return RegexCostError(f"matching it against {count} module names took more than {budget_s:g} s (the pattern "
                          "backtracks heavily: several quantifiers can match the same characters)")


def _match_with_alarm(compiled: re.Pattern[str], names: Sequence[str], budget_s: float) -> list[str]:
    def stop(signum: int, frame: object) -> None:
        raise _OutOfTime()

    previous = signal.signal(signal.SIGALRM, stop)
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, budget_s)
            return [name for name in names if compiled.fullmatch(name)]
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _OutOfTime:
        raise _over_budget(compiled.pattern, budget_s, len(names)) from None
    finally:
        signal.signal(signal.SIGALRM, previous)


_CHILD = ("import json, re, sys; pattern, names = json.load(sys.stdin); "
          "json.dump([n for n in names if re.fullmatch(pattern, n)], sys.stdout)")


def _match_in_child(pattern: str, names: Sequence[str], budget_s: float) -> list[str]:
    try:
        done = subprocess.run([sys.executable, "-I", "-c", _CHILD], input=json.dumps([pattern, list(names)]),
                              capture_output=True, text=True, timeout=budget_s + 5.0, check=True)
    except subprocess.TimeoutExpired:
        raise _over_budget(pattern, budget_s, len(names)) from None
    return list(json.loads(done.stdout))


def fullmatching(compiled: re.Pattern[str], names: Iterable[str], *, budget_s: float = MATCH_BUDGET_S) -> list[str]:
    """The names ``compiled`` fullmatches, in order; :class:`RegexCostError` when they take more than ``budget_s``."""
    names = list(names)
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        return _match_with_alarm(compiled, names, budget_s)
    return _match_in_child(compiled.pattern, names, budget_s)  # signals reach the main thread only


def representative_names(templates: Iterable[str]) -> list[str]:
    """Module names written from ``templates`` (``{i}`` a layer or block number) with a few numbers each."""
    names: list[str] = []
    for template in templates:
        parts = template.split("{i}")
        for numbers in itertools.product(_INDICES, repeat=len(parts) - 1):
            names.append(parts[0] + "".join(n + rest for n, rest in zip(numbers, parts[1:])))
    return names
