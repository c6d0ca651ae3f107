"""``coordexp train`` under a multi-rank launch: the ranks agree on how the run starts before the model loads.

Each rank runs the start checks on its own (``--resume`` replay and drift, installed packages, the output folder,
the checkpoint ``--resume`` names) with :func:`~coordexp.cli.frame.fail` deferred; then the ranks exchange what
they decided (:mod:`coordexp.runtime.train.rank_agreement`). All of them start from the same checkpoint, or every
one of them exits with the failing ranks' reasons, each prefixed by its rank: rank 0 prints them all, every other
rank one line (its own reason, else the first one). A single process reports its own failure as ``fail`` does.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

import typer

from coordexp.cli.frame import EXIT_EXTERNAL, Failure, err, failures_deferred, is_rank_zero, print_failure, safe
from coordexp.errors import exit_code_for
from coordexp.optional_deps import as_external_error

__all__ = ["agreed_start"]

T = TypeVar("T")


def _reason(exc: BaseException) -> tuple[str, int]:
    if isinstance(exc, Failure):
        return exc.message, int(exc.exit_code)
    if isinstance(exc, typer.Exit):
        return f"stopped with exit {exc.exit_code} before it could start (its own output says why)", int(exc.exit_code)
    exc = as_external_error(exc) or exc
    message = getattr(exc, "message", None)
    return f"{type(exc).__name__}: {message if isinstance(message, str) else exc}", exit_code_for(exc)


def agreed_start(checks: Callable[[], T], checkpoint_of: Callable[[T], Optional[str]]) -> T:
    """Run ``checks`` (this rank's start checks) and return what they return once every rank of the launch has
    passed its own and all start from the same checkpoint (``checkpoint_of`` names this rank's; None: fresh);
    else exit on every rank with the failing ranks' reasons."""
    from coordexp.runtime.train.rank_agreement import (checkpoint_view, disagreement, exchange_views, failure_view,
                                                       launch_world)

    rank, world_size = launch_world()
    failure: Optional[BaseException] = None
    with failures_deferred():
        try:
            outcome = checks()
        except (typer.Exit, Exception) as exc:  # noqa: BLE001 - every rank must hear why this one stops
            failure = exc
    if world_size <= 1:
        if isinstance(failure, Failure) and not failure.shown:
            print_failure(failure.message, failure.hint)
        if failure is not None:
            raise failure
        return outcome
    if failure is not None:
        view = failure_view(rank, *_reason(failure))
    else:
        view = checkpoint_view(rank, checkpoint_of(outcome))
    try:
        views = exchange_views(view, world_size)
    except ConnectionError as exc:
        print_failure(str(exc), "Launch with torchrun (or set MASTER_ADDR and MASTER_PORT for every rank)")
        raise typer.Exit(EXIT_EXTERNAL) from None
    problem = disagreement(views)
    if problem is None:
        return outcome
    hint = problem.hint
    if isinstance(failure, Failure) and failure.hint and len({v.reason for v in views}) == 1:
        hint = failure.hint  # every rank failed alike: its own advice fits
    if is_rank_zero():
        err.print(f"[red]✗[/red] the {world_size} ranks cannot start this run together:")
        for line in problem.lines:
            err.print(f"  {safe(line)}")
        err.print(f"[dim]{safe(hint)}[/dim]")
    else:
        own = problem.own_line(rank)
        err.print(f"[red]✗[/red] {safe(own)}. [dim]{safe(hint)}[/dim]")  # one line, the rank already named
    if failure is not None and not isinstance(failure, typer.Exit) and exit_code_for(
            as_external_error(failure) or failure) == 1:
        raise failure  # a bug: reported in full by guarded()
    raise typer.Exit(problem.code)
