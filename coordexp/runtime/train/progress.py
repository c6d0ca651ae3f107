"""Training progress for people: a Rich live panel on a terminal, one plain line per log otherwise.

:class:`ProgressCallback` is a ``transformers.TrainerCallback``; it reads only what the trainer logs
(``loss``, ``tokens/trained``, ``packing/fill_ratio``, ``rollout/*``), so it works for stage 1 and stage 2.
Only the main process (rank 0) draws or prints. :func:`summarize_history` turns a finished run's log history
into the numbers the end-of-run summary shows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional, Sequence

from transformers import TrainerCallback

__all__ = ["ProgressSnapshot", "ProgressCallback", "snapshot_from_logs", "format_log_line", "summarize_history"]


@dataclass(frozen=True)
class ProgressSnapshot:
    """The latest value of each displayed quantity; None where the run has not logged it (yet)."""

    step: int = 0
    max_steps: int = 0
    loss: Optional[float] = None
    parse_valid_rate: Optional[float] = None  # pred_valid / pred_parsed of the last logging window
    match_rate: Optional[float] = None
    fn_appended: Optional[float] = None
    fill_ratio: Optional[float] = None
    tokens_per_s: Optional[float] = None


def _ratio(numerator: Any, denominator: Any) -> Optional[float]:
    if numerator is None or not denominator:
        return None
    return float(numerator) / float(denominator)


def snapshot_from_logs(
    previous: ProgressSnapshot, logs: Mapping[str, Any], *, step: int, max_steps: int, seconds: Optional[float]
) -> ProgressSnapshot:
    """Fold one ``on_log`` payload into the snapshot; ``seconds`` is the wall time the logged tokens took."""
    tokens = logs.get("tokens/trained")
    update: dict[str, Any] = {"step": step, "max_steps": max_steps}
    if "loss" in logs:
        update["loss"] = float(logs["loss"])
    if "rollout/pred_parsed" in logs:
        update["parse_valid_rate"] = _ratio(logs.get("rollout/pred_valid"), logs["rollout/pred_parsed"])
    if "rollout/gt_objects" in logs or "rollout/match_rate" in logs:
        update["match_rate"] = logs.get("rollout/match_rate")
    if "rollout/fn_appended" in logs:
        update["fn_appended"] = float(logs["rollout/fn_appended"])
    if "packing/fill_ratio" in logs:
        update["fill_ratio"] = float(logs["packing/fill_ratio"])
    if tokens is not None and seconds is not None and seconds > 0:
        update["tokens_per_s"] = float(tokens) / seconds
    return replace(previous, **update)


def _fmt(value: Optional[float], spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _fields(s: ProgressSnapshot) -> list[tuple[str, str]]:
    return [
        ("step", f"{s.step}/{s.max_steps}" if s.max_steps > 0 else str(s.step)),
        ("loss", _fmt(s.loss, ".4f")),
        ("parse valid", _fmt(None if s.parse_valid_rate is None else 100 * s.parse_valid_rate, ".1f", "%")),
        ("match", _fmt(None if s.match_rate is None else 100 * s.match_rate, ".1f", "%")),
        ("FN appended", _fmt(s.fn_appended, ".0f")),
        ("fill", _fmt(None if s.fill_ratio is None else 100 * s.fill_ratio, ".1f", "%")),
        ("tok/s", _fmt(s.tokens_per_s, ".0f")),
    ]


def format_log_line(snapshot: ProgressSnapshot) -> str:
    """One plain line (no colour, no control codes) for logs, pipes and CI."""
    return "  ".join(f"{name} {value}" for name, value in _fields(snapshot))


class ProgressCallback(TrainerCallback):
    """Drives a Rich live display (TTY) or prints :func:`format_log_line` per log (not a TTY); rank 0 only.

    ``console`` defaults to a stdout console; ``live`` forces the mode (None: live exactly when it is a terminal).
    """

    def __init__(self, console: Any = None, *, live: Optional[bool] = None, title: str = "training") -> None:
        from rich.console import Console

        self.console = console if console is not None else Console(highlight=False)
        self.use_live = self.console.is_terminal if live is None else live
        self.title = title
        self.snapshot = ProgressSnapshot()
        self._live: Any = None
        self._last_time: Optional[float] = None

    # -- rendering --------------------------------------------------------------------------------------------
    def renderable(self) -> Any:
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        s = self.snapshot
        table = Table(title=self.title, show_header=True, header_style="bold", expand=False)
        fields = _fields(s)
        for name, _ in fields:
            table.add_column(name, justify="right")
        table.add_row(*(value for _, value in fields))
        bar = ProgressBar(total=max(s.max_steps, 1), completed=min(s.step, max(s.max_steps, 1)), width=60)
        return Group(bar, table)

    # -- TrainerCallback hooks --------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        self._last_time = time.monotonic()
        self.snapshot = replace(self.snapshot, step=state.global_step, max_steps=state.max_steps)
        if state.is_world_process_zero and self.use_live:
            from rich.live import Live

            self._live = Live(self.renderable(), console=self.console, refresh_per_second=4, transient=False)
            self._live.start()

    def on_step_end(self, args, state, control, **kwargs):
        if self._live is not None:
            self.snapshot = replace(self.snapshot, step=state.global_step, max_steps=state.max_steps)
            self._live.update(self.renderable())

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "loss" not in logs:
            return  # evaluation and end-of-train summaries are not training windows
        now = time.monotonic()
        seconds = None if self._last_time is None else now - self._last_time
        self._last_time = now
        self.snapshot = snapshot_from_logs(
            self.snapshot, logs, step=state.global_step, max_steps=state.max_steps, seconds=seconds
        )
        if not state.is_world_process_zero:
            return
        if self._live is not None:
            self._live.update(self.renderable())
        else:
            self.console.print(format_log_line(self.snapshot), markup=False, highlight=False)

    def on_train_end(self, args, state, control, **kwargs):
        if self._live is not None:
            self._live.update(self.renderable())
            self._live.stop()
            self._live = None


def summarize_history(log_history: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Steps, first/final training loss and the last logged rollout counters of a run's ``log_history``."""
    train_logs = [entry for entry in log_history if "loss" in entry]
    summary: dict[str, Any] = {
        "steps": max((int(entry.get("step", 0)) for entry in log_history), default=0),
        "first_loss": float(train_logs[0]["loss"]) if train_logs else None,
        "final_loss": float(train_logs[-1]["loss"]) if train_logs else None,
    }
    rollout = {}
    for entry in reversed(train_logs):
        rollout = {k.removeprefix("rollout/"): v for k, v in entry.items() if k.startswith("rollout/")}
        if rollout:
            break
    summary["rollout"] = rollout
    if rollout:
        summary["parse_valid_rate"] = _ratio(rollout.get("pred_valid"), rollout.get("pred_parsed"))
        summary["match_rate"] = rollout.get("match_rate")
    return summary
