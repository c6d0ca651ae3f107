"""The stage-2 collapse alarm (docs/figures.md): each logging window's rollout figures against the bounds of
``rollout_matching.collapse_alarm``; a line when a bound is first crossed and, with ``action: stop``, a checkpoint
and the end of the run. The alarm is kept in the run's log history (``collapse_alarm`` entries), so the run summary
and ``trainer_state.json`` say why a run stopped."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from transformers import TrainerCallback

from coordexp.schema.rollout import CollapseAlarmConfig

__all__ = ["CollapseWatch", "CollapseCallback"]


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


@dataclass
class CollapseWatch:
    """Which bounds a window crosses; each bound speaks once, when first crossed (a window back inside re-arms it)."""

    config: CollapseAlarmConfig
    best_precision: Optional[float] = None
    crossed: set[str] = field(default_factory=set)

    def check(self, window: Mapping[str, Any]) -> list[str]:
        """The reasons newly crossed by one window's ``rollout/*`` figures (fractions); none, and nothing remembered,
        for a window over fewer than ``min_gt_objects`` ground-truth objects (its rates are noise)."""
        c = self.config

        def get(name: str) -> Optional[float]:
            value = window.get(f"rollout/{name}")
            return None if value is None else float(value)

        objects = get("gt_objects")
        if objects is not None and objects < c.min_gt_objects:
            return []

        per_gt, precision = get("pred_per_gt"), get("match_precision")
        fell = (precision is not None and self.best_precision is not None
                and precision <= self.best_precision - c.precision_drop)
        now: dict[str, str] = {}
        if per_gt is not None and per_gt > c.pred_per_gt_max and fell:
            now["pred_per_gt"] = (f"{per_gt:.2f} predictions per GT object (bound {c.pred_per_gt_max:g}) while match "
                                  f"precision fell to {_pct(precision)} from {_pct(self.best_precision)}")
        checks = (("duplicate_rate", get("duplicate_rate"), c.duplicate_rate_max, "of the predictions repeat an "
                   "earlier one (certified duplicates)", 1),
                  ("cut_off_rate", get("cut_off_rate"), c.cut_off_rate_max, "of the rollouts were cut off before "
                   "EOS (length limit or repeat guard)", 1),
                  ("parse_valid_rate", get("parse_valid_rate"), c.parse_valid_min, "of the parsed objects are "
                   "valid", -1))
        for name, value, bound, what, sign in checks:
            if value is not None and sign * (value - bound) > 0:
                now[name] = f"{_pct(value)} {what} (bound {_pct(bound)})"
        if precision is not None:
            self.best_precision = precision if self.best_precision is None else max(self.best_precision, precision)
        fresh = [now[name] for name in now if name not in self.crossed]
        self.crossed = set(now)
        return fresh


class CollapseCallback(TrainerCallback):
    """Runs :class:`CollapseWatch` on every stage-2 training window (every rank sees the same reduced figures, so
    every rank stops at the same step); rank 0 prints and records."""

    def __init__(self, config: CollapseAlarmConfig, *, say: Callable[[str], None], record: Callable[..., Any]):
        self.watch = CollapseWatch(config)
        self.action = config.action
        self.stopped_at: int | None = None
        """The step ``action: stop`` ended the run at (a stop, not a success: no final model is written)."""
        self.stop_reasons = ""  # the bounds crossed at that step
        self.say = say
        self.record = record

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "rollout/samples" not in logs or any(str(k).startswith("eval/") for k in logs):
            return
        reasons = self.watch.check(logs)
        if not reasons:
            return
        stop = self.action == "stop"
        entry = {"collapse_alarm": "; ".join(reasons), "action": self.action, "step": int(state.global_step)}
        state.log_history.append(entry)
        if state.is_world_process_zero:
            self.record("collapse_alarm", step=int(state.global_step), reasons=reasons, action=self.action)
            ending = " Stopping with a checkpoint (collapse_alarm.action: stop)." if stop else ""
            self.say(f"collapse alarm at step {state.global_step}: {'; '.join(reasons)}.{ending} See docs/figures.md.")
        if stop:
            self.stopped_at = int(state.global_step)
            self.stop_reasons = "; ".join(reasons)
            control.should_save = True
            control.should_training_stop = True
