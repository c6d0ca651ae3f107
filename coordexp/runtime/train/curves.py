"""A run's loss and evaluation curves as one PNG, drawn with PIL from its ``trainer_state.json`` log history (the
run folder's, else its newest checkpoint's), so a run can be looked at without TensorBoard or matplotlib."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from coordexp.runtime.train.run_folder import save_image

__all__ = ["Curve", "Panel", "find_trainer_state", "load_log_history", "run_curves", "rollout_curves", "panels",
           "draw_curves", "EVAL_CURVES", "DETECTION_CURVES", "TOKEN_CURVES", "ROLLOUT_CURVES", "REWARD_CURVES",
           "POLICY_CURVES"]

DETECTION_CURVES = ("AP50", "AP", "precision", "recall", "f1", "match_rate", "recall_objects_1_6",
                    "recall_objects_7_10", "recall_objects_11_plus")
"""The ``eval/<name>`` detection figures, drawn in percent on their own axis: early in a run they sit near 0 (AP
0.3%) where token accuracy already reads 83%, and one linear axis for both showed them as a flat line at zero."""
TOKEN_CURVES = ("token_acc",)
"""The teacher-forced ``eval/<name>`` figures, in percent on a panel of their own."""
EVAL_CURVES = DETECTION_CURVES + TOKEN_CURVES
"""Every ``eval/<name>`` figure drawn (logged as fractions in [0, 1]), when the run logged it."""
ROLLOUT_CURVES = ("pred_per_gt", "duplicates_per_image", "cut_off_rate")
"""The stage-2 training windows' ``rollout/<name>`` figures a collapse moves (docs/figures.md)."""
REWARD_CURVES = ("reward/mean", "reward/group_std", "reward/zero_advantage_group_share", "reward/closing_advantage")
"""The reward objective's windows: what the groups earned, how much they differ, the share that teaches nothing,
and the credit the closing token got (docs/design.md, decision 19)."""
POLICY_CURVES = ("reward/entropy_coord", "reward/entropy_text", "loss/kl")
"""The reward objective's policy, in nats: its entropy at the trained coordinate and text tokens, and the k3 KL to
the starting checkpoint (when ``reward.kl_weight`` > 0)."""
_COLOURS = ((31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14), (140, 86, 75),
            (127, 127, 127))
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


@dataclass(frozen=True)
class Curve:
    name: str
    points: tuple[tuple[float, float], ...]  # (step, value)


@dataclass(frozen=True)
class Panel:
    """One panel of the PNG: its curves on one axis scaled to their own range; ``percent``: values are percent."""

    title: str
    curves: tuple[Curve, ...]
    percent: bool = False


def find_trainer_state(run_dir: Path) -> Path:
    """``RUN_DIR/trainer_state.json``, else the newest ``checkpoint-N/trainer_state.json``; FileNotFoundError names
    what was looked for."""
    direct = run_dir / "trainer_state.json"
    if direct.is_file():
        return direct
    numbered = [(int(m.group(1)), p) for p in run_dir.glob("checkpoint-*")
                if (m := _CHECKPOINT.match(p.name)) and (p / "trainer_state.json").is_file()]
    if not numbered:
        raise FileNotFoundError(f"no trainer_state.json in {run_dir} or its checkpoint-* directories")
    return max(numbered)[1] / "trainer_state.json"


def load_log_history(path: Path) -> list[dict[str, Any]]:
    """The ``log_history`` list of a ``trainer_state.json``; ValueError when the file is not one."""
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        raise ValueError(f"{path} has no log_history list")
    return [entry for entry in history if isinstance(entry, dict)]


def _series(history: Sequence[Mapping[str, Any]], key: str) -> tuple[tuple[float, float], ...]:
    points = []
    for entry in history:
        value, step = entry.get(key), entry.get("step")
        if isinstance(value, (int, float)) and isinstance(step, (int, float)) and value == value:  # not NaN
            points.append((float(step), float(value)))
    return tuple(points)


def run_curves(history: Sequence[Mapping[str, Any]]) -> tuple[list[Curve], list[Curve]]:
    """(training loss curves, evaluation curves) of a log history; empty lists where nothing was logged."""
    losses = [Curve(name, points) for name, key in (("loss", "loss"),) if (points := _series(history, key))]
    evals = [Curve(f"eval {name}", points) for name in EVAL_CURVES if (points := _series(history, f"eval/{name}"))]
    return losses, evals


def rollout_curves(history: Sequence[Mapping[str, Any]]) -> list[Curve]:
    """The stage-2 windows' collapse figures (:data:`ROLLOUT_CURVES`); empty for stage 1."""
    return [Curve(name, points) for name in ROLLOUT_CURVES if (points := _series(history, f"rollout/{name}"))]


def _in_percent(curves: Sequence[Curve]) -> tuple[Curve, ...]:
    return tuple(Curve(c.name, tuple((step, 100.0 * value) for step, value in c.points)) for c in curves)


def panels(history: Sequence[Mapping[str, Any]]) -> list[Panel]:
    """What :func:`draw_curves` draws, value for value: the training loss; the detection figures in percent (the
    CLI's unit); token accuracy in percent on its own axis (when logged); the stage-2 rollout windows (when
    logged); the reward objective's rewards, and its policy's entropy and KL (when logged)."""
    losses, evals = run_curves(history)
    named = {curve.name: curve for curve in evals}
    detection = [named[f"eval {name}"] for name in DETECTION_CURVES if f"eval {name}" in named]
    tokens = [named[f"eval {name}"] for name in TOKEN_CURVES if f"eval {name}" in named]
    rollouts = rollout_curves(history)
    found = [Panel("training loss", tuple(losses)), Panel("evaluation: detection (%)", _in_percent(detection), True)]
    if tokens:
        found.append(Panel("evaluation: teacher-forced token accuracy (%)", _in_percent(tokens), True))
    if rollouts:
        found.append(Panel("stage-2 rollouts", tuple(rollouts)))
    for title, keys in (("reward objective", REWARD_CURVES), ("policy entropy and KL (nats)", POLICY_CURVES)):
        curves = tuple(Curve(key.split("/", 1)[1], points) for key in keys if (points := _series(history, key)))
        if curves:
            found.append(Panel(title, curves))
    return found


def _panel(draw: Any, box: tuple[int, int, int, int], panel: Panel, font: Any) -> None:
    left, top, right, bottom = box
    curves, unit = panel.curves, "%" if panel.percent else ""
    draw.rectangle(box, outline=(90, 90, 90))
    draw.text((left, top - 16), panel.title, fill=(0, 0, 0), font=font)
    values = [v for c in curves for _, v in c.points]
    steps = [s for c in curves for s, _ in c.points]
    if not values:
        draw.text((left + 10, top + 10), "nothing logged", fill=(120, 120, 120), font=font)
        return
    low, high = min(values), max(values)
    if high - low < 1e-12:
        low, high = low - 0.5, high + 0.5
    first, last = min(steps), max(steps)
    span = max(last - first, 1.0)

    def xy(step: float, value: float) -> tuple[float, float]:
        return (left + (step - first) / span * (right - left), bottom - (value - low) / (high - low) * (bottom - top))

    for label, y in ((f"{high:.4g}{unit}", top), (f"{low:.4g}{unit}", bottom - 10)):
        draw.text((left - 58, y), label, fill=(60, 60, 60), font=font)
    draw.text((left, bottom + 4), f"step {first:.0f}", fill=(60, 60, 60), font=font)
    draw.text((right - 70, bottom + 4), f"step {last:.0f}", fill=(60, 60, 60), font=font)
    for index, curve in enumerate(curves):
        colour = _COLOURS[index % len(_COLOURS)]
        points = [xy(s, v) for s, v in curve.points]
        if len(points) > 1:
            draw.line(points, fill=colour, width=2)
        for x, y in points:
            draw.ellipse((x - 2, y - 2, x + 2, y + 2), fill=colour)
        row, column = divmod(index, 5)
        draw.text((left + 8 + 150 * column, top + 6 + 14 * row), f"{curve.name} {curve.points[-1][1]:.4g}{unit}",
                  fill=colour, font=font)


def draw_curves(history: Sequence[Mapping[str, Any]], out_png: Path, *, title: str) -> Path:
    """The :func:`panels` over steps, each with its range and last values."""
    from PIL import Image, ImageDraw, ImageFont

    drawn = panels(history)
    width, panel_h = 900, 260
    image = Image.new("RGB", (width, 60 + len(drawn) * (panel_h + 50)), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    draw.text((20, 12), title, fill=(0, 0, 0), font=font)
    for k, panel in enumerate(drawn):
        top = 60 + k * (panel_h + 50)
        _panel(draw, (80, top, width - 30, top + panel_h), panel, font)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    save_image(image, out_png)
    return out_png
