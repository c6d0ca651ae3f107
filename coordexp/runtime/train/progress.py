"""Training progress for people: a Rich live panel on a terminal, one plain line per log otherwise.

:class:`ProgressCallback` is a ``transformers.TrainerCallback``; it reads only what the trainer logs
(``loss``, ``tokens/trained``, ``packing/fill_ratio``, ``rollout/*``, ``eval/*``), so it works for stage 1 and
stage 2. Only the main process (rank 0) draws or prints. During an evaluation the trainer reports the images rolled
out (:func:`report_eval_progress`, an ``on_prediction_step`` event with ``eval_progress=(done, total)``): the
panel shows it, a plain log prints ``eval  step N  rolling out 32/64 images  ETA 40s`` at most every
:data:`EVAL_PRINT_INTERVAL_S`. The run's ETA is training time per step times the steps left plus the mean
evaluation time times the evaluations left, so it does not jump after each evaluation. :func:`summarize_history`
turns a finished run's log history into the numbers the end-of-run summary shows: sums over the whole run, and each
evaluation's headline figures.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional, Sequence

from transformers import TrainerCallback

__all__ = ["ProgressSnapshot", "ProgressCallback", "EvalFigures", "snapshot_from_logs", "format_log_line",
           "format_eval_line", "eval_figures", "summarize_history", "report_eval_progress", "evaluations_left",
           "EVAL_PRINT_INTERVAL_S"]

EVAL_PRINT_INTERVAL_S = 10.0
"""Least time between two plain ``eval  ... rolling out`` lines of one evaluation (the first chunk always prints)."""


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
    pred_per_gt: Optional[float] = None  # valid predictions per ground-truth object (a repeat collapse raises it)
    duplicates_per_image: Optional[float] = None  # certified duplicates (core.set_figures)
    tokens_per_s: Optional[float] = None
    elapsed_s: Optional[float] = None
    eta_s: Optional[float] = None
    rollouts_seen: bool = False  # stage 1 never logs rollouts: its lines carry no rollout columns


@dataclass(frozen=True)
class EvalFigures:
    """One evaluation's headline figures (``eval/*`` of the trainer's log); None where it was not computed."""

    step: int
    ap50: Optional[float] = None
    parse_valid_rate: Optional[float] = None
    match_rate: Optional[float] = None
    token_acc: Optional[float] = None
    precision: Optional[float] = None  # class-aware, box IoU 0.5 (core.set_figures)
    recall: Optional[float] = None
    f1: Optional[float] = None

    def to_dict(self) -> dict[str, Any]:
        """Fractions (the text surfaces print percent)."""
        return {"step": self.step, "AP50": self.ap50, "precision": self.precision, "recall": self.recall,
                "f1": self.f1, "parse_valid_rate": self.parse_valid_rate, "match_rate": self.match_rate,
                "token_acc": self.token_acc}


def eval_figures(logs: Mapping[str, Any], step: int) -> Optional[EvalFigures]:
    """The headline figures of an evaluation's log entry; None when ``logs`` holds no ``eval/`` key."""
    if not any(str(key).startswith("eval/") for key in logs):
        return None

    def number(key: str) -> Optional[float]:
        value = logs.get(key)
        return None if value is None else float(value)

    return EvalFigures(step=step, ap50=number("eval/AP50"),
                       parse_valid_rate=_ratio(logs.get("eval/pred_valid"), logs.get("eval/pred_parsed")),
                       match_rate=number("eval/match_rate"), token_acc=number("eval/token_acc"),
                       precision=number("eval/precision"), recall=number("eval/recall"), f1=number("eval/f1"))


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
    if any(str(key).startswith("rollout/") for key in logs):
        update["rollouts_seen"] = True
    if "rollout/pred_parsed" in logs:
        update["parse_valid_rate"] = _ratio(logs.get("rollout/pred_valid"), logs["rollout/pred_parsed"])
    if "rollout/gt_objects" in logs or "rollout/match_rate" in logs:
        update["match_rate"] = logs.get("rollout/match_rate")
    if "rollout/fn_appended" in logs:
        update["fn_appended"] = float(logs["rollout/fn_appended"])
    for name in ("pred_per_gt", "duplicates_per_image"):
        if f"rollout/{name}" in logs:
            update[name] = float(logs[f"rollout/{name}"])
    if "packing/fill_ratio" in logs:
        update["fill_ratio"] = float(logs["packing/fill_ratio"])
    if tokens is not None and seconds is not None and seconds > 0:
        update["tokens_per_s"] = float(tokens) / seconds
    return replace(previous, **update)


def _fmt(value: Optional[float], spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _pct(rate: Optional[float]) -> str:
    return _fmt(None if rate is None else 100 * rate, ".1f", "%")


def format_duration(seconds: Optional[float]) -> str:
    """``1h02m``, ``3m05s``, ``42s``; ``-`` when unknown."""
    if seconds is None:
        return "-"
    whole = max(0, int(round(seconds)))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _fields(s: ProgressSnapshot) -> list[tuple[str, str]]:
    fields = [("step", f"{s.step}/{s.max_steps}" if s.max_steps > 0 else str(s.step)), ("loss", _fmt(s.loss, ".4f"))]
    if s.rollouts_seen:
        fields += [("parse valid", _pct(s.parse_valid_rate)), ("match", _pct(s.match_rate)),
                   ("FN appended", _fmt(s.fn_appended, ".0f")), ("pred/GT", _fmt(s.pred_per_gt, ".2f")),
                   ("dup/img", _fmt(s.duplicates_per_image, ".2f"))]
    if s.fill_ratio is not None:
        fields.append(("fill", _pct(s.fill_ratio)))
    fields += [("tok/s", _fmt(s.tokens_per_s, ".0f")), ("elapsed", format_duration(s.elapsed_s)),
               ("ETA", format_duration(s.eta_s))]
    return fields


_NARROW_NAMES = {"step": "step", "loss": "loss", "parse valid": "valid", "match": "match", "pred/GT": "pred/GT",
                 "dup/img": "dup/img", "tok/s": "tok/s", "ETA": "ETA"}


def _narrow_fields(s: ProgressSnapshot) -> list[tuple[str, str]]:
    """The live table's columns for a narrow terminal, a stage-2 row whole in 80 columns: the run's health and the
    time left (FN appended, fill and elapsed go; the plain log line and the summary keep them)."""
    return [(_NARROW_NAMES[name], value) for name, value in _fields(s) if name in _NARROW_NAMES]


def format_log_line(snapshot: ProgressSnapshot) -> str:
    """One plain line (no colour, no control codes) for logs, pipes and CI."""
    return "  ".join(f"{name} {value}" for name, value in _fields(snapshot))


def _eval_fields(figures: EvalFigures) -> list[tuple[str, str]]:
    fields = [("step", str(figures.step)), ("AP50", _pct(figures.ap50))]
    if figures.f1 is not None or figures.precision is not None:
        fields += [("P", _pct(figures.precision)), ("R", _pct(figures.recall)), ("F1", _pct(figures.f1))]
    fields += [("parse valid", _pct(figures.parse_valid_rate)), ("match", _pct(figures.match_rate))]
    if figures.token_acc is not None:
        fields.append(("token acc", _pct(figures.token_acc)))
    return fields


def format_eval_line(figures: EvalFigures) -> str:
    """The plain line an evaluation prints, percent throughout: ``eval  step 50  AP50 41.2%  P 80.0%  R 70.0%  F1
    74.7%  parse valid 98.0%  match 61.5% ...`` (P/R/F1 class-aware at box IoU 0.5, match the stage-2 matcher's)."""
    return "eval  " + "  ".join(f"{name} {value}" for name, value in _eval_fields(figures))


class ProgressCallback(TrainerCallback):
    """Drives a Rich live display (TTY) or prints :func:`format_log_line` per log (not a TTY); rank 0 only.

    ``console`` defaults to a stdout console; ``live`` forces the mode (None: live exactly when it is a terminal).
    Plain lines are printed unwrapped (``soft_wrap``): a pipe's 80 columns never split a line.
    """

    def __init__(self, console: Any = None, *, live: Optional[bool] = None, title: str = "training") -> None:
        from rich.console import Console

        self.console = console if console is not None else Console(highlight=False)
        self.use_live = self.console.is_terminal if live is None else live
        self.title = title
        self.snapshot = ProgressSnapshot()
        self.last_eval: Optional[EvalFigures] = None
        self._live: Any = None
        self._last_time: Optional[float] = None
        self._start: Optional[tuple[float, int]] = None  # (monotonic time, global step) when training began
        self._eval_every = 0  # evaluate every N steps (eval_strategy steps), 0: no periodic evaluation
        self._eval_delay = 0
        self._eval_seconds = 0.0  # wall time of the finished evaluations of this run
        self._eval_count = 0
        self._last_eval_step = -1
        self._eval_began: Optional[float] = None  # the evaluation in progress
        self._eval_printed: Optional[float] = None
        self.eval_status: Optional[str] = None  # "eval  step N  rolling out d/t images  ETA x" while one runs

    # -- rendering --------------------------------------------------------------------------------------------
    def _table(self, fields: Sequence[tuple[str, str]]) -> Any:
        from rich.table import Table

        table = Table(title=self.title, show_header=True, header_style="bold", expand=False)
        for name, _ in fields:
            table.add_column(name, justify="right")
        table.add_row(*(value for _, value in fields))
        return table

    def renderable(self) -> Any:
        """The bar, the table and the eval lines; a terminal too narrow for every column whole (a stage-2 table
        needs about 100 at 80 columns every cell was cut to ``…``) gets :func:`_narrow_fields` instead."""
        from rich.console import Group
        from rich.measure import Measurement
        from rich.padding import Padding
        from rich.progress_bar import ProgressBar
        from rich.text import Text

        s = self.snapshot
        table = self._table(_fields(s))
        unbounded = self.console.options.update_width(10_000)
        if Measurement.get(self.console, unbounded, table).maximum > self.console.width:
            table = self._table(_narrow_fields(s))
        bar = ProgressBar(total=max(s.max_steps, 1), completed=min(s.step, max(s.max_steps, 1)), width=60)
        lines = [Text(line) for line in (None if self.last_eval is None else format_eval_line(self.last_eval),
                                         self.eval_status) if line]  # plain: no number highlighting
        return Group(Padding(bar, 0), table, *lines)  # padded: a bare bar ends no line (the title ran onto it)

    def _timed(self, step: int, max_steps: int) -> ProgressSnapshot:
        """The snapshot at ``step`` with elapsed time and the ETA: the training time per step so far (evaluations
        left out) times the steps left, plus the mean evaluation time times the evaluations still to run."""
        if self._start is None:
            return replace(self.snapshot, step=step, max_steps=max_steps)
        began, first_step = self._start
        now = time.monotonic()
        elapsed = now - began
        current = 0.0 if self._eval_began is None else now - self._eval_began
        training = max(0.0, elapsed - self._eval_seconds - current)
        done = step - first_step
        eta = None
        if done > 0 and max_steps > 0:
            eta = training / done * max(0, max_steps - step)
            mean_eval = self._eval_seconds / self._eval_count if self._eval_count else None
            if mean_eval is not None and self._eval_every:
                eta += mean_eval * evaluations_left(step, max_steps, self._eval_every, self._last_eval_step,
                                                    self._eval_delay)
        return replace(self.snapshot, step=step, max_steps=max_steps, elapsed_s=elapsed, eta_s=eta)

    def _print(self, line: str) -> None:
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    # -- TrainerCallback hooks --------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        self._last_time = time.monotonic()
        self._start = (self._last_time, state.global_step)
        strategy = getattr(args, "eval_strategy", "no")
        if str(getattr(strategy, "value", strategy)) == "steps":
            self._eval_every = int(getattr(state, "eval_steps", 0) or getattr(args, "eval_steps", 0) or 0)
            self._eval_delay = int(getattr(args, "eval_delay", 0) or 0)
        self._last_eval_step = state.global_step  # a resumed run evaluated up to here
        self.snapshot = self._timed(state.global_step, state.max_steps)
        if state.is_world_process_zero and self.use_live:
            from rich.live import Live

            self._live = Live(self.renderable(), console=self.console, refresh_per_second=4, transient=False)
            self._live.start()

    def on_step_end(self, args, state, control, **kwargs):
        if self._live is not None:
            self.snapshot = self._timed(state.global_step, state.max_steps)
            self._live.update(self.renderable())

    def on_prediction_step(self, args, state, control, eval_progress=None, **kwargs):
        """An evaluation chunk is done: ``eval_progress`` is ``(images done, images)`` on this rank."""
        if eval_progress is None:
            return
        done, total = (int(n) for n in eval_progress)
        now = time.monotonic()
        if self._eval_began is None:
            self._eval_began, self._eval_printed = now, None
        spent = now - self._eval_began
        eta = spent / done * max(0, total - done) if done > 0 else None
        self.eval_status = (f"eval  step {state.global_step}  rolling out {done}/{total} images  "
                            f"ETA {format_duration(eta)}")
        if not state.is_world_process_zero:
            return
        if self._live is not None:
            self.snapshot = self._timed(state.global_step, state.max_steps)
            self._live.update(self.renderable())
        elif 0 < done < total and (self._eval_printed is None or now - self._eval_printed >= EVAL_PRINT_INTERVAL_S):
            self._eval_printed = now
            self._print(self.eval_status)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self._eval_began is not None:
            self._eval_seconds += time.monotonic() - self._eval_began
            self._eval_count += 1
        self._eval_began, self.eval_status = None, None
        self._last_eval_step = state.global_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs:
            return
        figures = eval_figures(logs, state.global_step)
        if figures is not None:
            self.last_eval = figures
            if state.is_world_process_zero:
                if self._live is not None:
                    self._live.update(self.renderable())
                else:
                    self._print(format_eval_line(figures))
            return
        if "loss" not in logs:
            return  # end-of-train summaries are not training windows
        now = time.monotonic()
        seconds = None if self._last_time is None else now - self._last_time
        self._last_time = now
        self.snapshot = snapshot_from_logs(
            self._timed(state.global_step, state.max_steps), logs, step=state.global_step,
            max_steps=state.max_steps, seconds=seconds,
        )
        if not state.is_world_process_zero:
            return
        if self._live is not None:
            self._live.update(self.renderable())
        else:
            self._print(format_log_line(self.snapshot))

    def on_train_end(self, args, state, control, **kwargs):
        if self._live is not None:
            self._live.update(self.renderable())
            self._live.stop()
            self._live = None


def evaluations_left(step: int, max_steps: int, every: int, last_evaluated: int, delay: int = 0) -> int:
    """How many evaluations an ``eval_strategy: steps`` run of ``max_steps`` still runs at ``step``: one at each
    multiple of ``every`` from ``step`` on (the one at ``step`` runs after its log) not yet evaluated, from
    ``delay`` on (transformers' ``eval_delay``)."""
    if every <= 0:
        return 0
    first = max(step, last_evaluated + 1, delay, 1)
    return max(0, max_steps // every - (first - 1) // every)


def report_eval_progress(trainer: Any, done: int, total: int) -> None:
    """Tell the trainer's callbacks that ``done`` of this rank's ``total`` evaluation images are rolled out
    (``on_prediction_step`` with ``eval_progress``; callbacks that do not read it ignore it)."""
    trainer.control = trainer.callback_handler.call_event("on_prediction_step", trainer.args, trainer.state,
                                                          trainer.control, eval_progress=(done, total))


_RUN_COUNTERS = ("samples", "pred_valid", "pred_parsed", "gt_objects", "matched", "fn_appended", "fp",
                 "truncated_rollouts", "certified_duplicates", "eos_stopped")


def summarize_history(log_history: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Steps, first/final training loss, the rollout counters summed over the whole run (each logging window logs
    its own sums) with the rates recomputed from them, and every evaluation's headline figures."""
    train_logs = [entry for entry in log_history if "loss" in entry]
    # every training window: the logged ones and the last, partial one (trainer.log tags it "final")
    windows = [entry for entry in log_history if "loss" in entry or entry.get("window") == "final"]
    summary: dict[str, Any] = {
        "steps": max((int(entry.get("step", 0)) for entry in log_history), default=0),
        "first_loss": float(train_logs[0]["loss"]) if train_logs else None,
        "final_loss": float(train_logs[-1]["loss"]) if train_logs else None,
    }
    rollout: dict[str, float] = {}
    for entry in windows:
        for name in _RUN_COUNTERS:
            value = entry.get(f"rollout/{name}")
            if value is not None:
                rollout[name] = rollout.get(name, 0.0) + float(value)
    summary["rollout"] = rollout
    if rollout:
        summary["parse_valid_rate"] = _ratio(rollout.get("pred_valid"), rollout.get("pred_parsed"))
        summary["match_rate"] = _ratio(rollout.get("matched"), rollout.get("gt_objects"))
        summary["pred_per_gt"] = _ratio(rollout.get("pred_valid"), rollout.get("gt_objects"))
        summary["duplicates_per_image"] = _ratio(rollout.get("certified_duplicates"), rollout.get("samples"))
        summary["truncation_rate"] = _ratio(rollout.get("truncated_rollouts"), rollout.get("samples"))
        summary["cut_off_rate"] = (None if not rollout.get("samples") or "eos_stopped" not in rollout
                                   else 1.0 - rollout["eos_stopped"] / rollout["samples"])
    evaluations = [figures.to_dict() for entry in log_history
                   if (figures := eval_figures(entry, int(entry.get("step", 0)))) is not None]
    summary["collapse_alarms"] = [{"step": int(entry.get("step", 0)), "reasons": str(entry["collapse_alarm"]),
                                   "action": entry.get("action", "warn")}
                                  for entry in log_history if "collapse_alarm" in entry]
    summary["evaluations"] = evaluations
    summary["last_eval"] = evaluations[-1] if evaluations else None
    return summary
