"""``coordexp plot-run RUN_DIR``: the run's training loss and evaluation curves as one PNG (PIL, no matplotlib),
figures in percent as the CLI prints them (:func:`coordexp.runtime.train.curves.panels`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from coordexp.cli.frame import fail, guarded, out, safe

__all__ = ["register", "plot_run"]


def plot_run(
    run_dir: Annotated[Path, typer.Argument(help="A run's output_dir (trainer_state.json, or its checkpoint-*).",
                                            show_default=False)],
    png: Annotated[Optional[Path], typer.Option("--out", help="PNG path (default RUN_DIR/curves.png).")] = None,
) -> None:
    """Draw the run's loss and eval curves from its log history to a PNG: detection figures (AP50, AP, precision,
    recall, F1, match rate) in percent on their own axis, token accuracy in percent on another."""
    from coordexp.cli.file_guard import check_output_file
    from coordexp.runtime.model.checkpoint_files import read_json_object
    from coordexp.runtime.train.curves import draw_curves, find_trainer_state, run_curves

    try:
        state = find_trainer_state(run_dir)
    except FileNotFoundError as exc:
        fail(str(exc), "Pass the output_dir of a finished `coordexp train` run (or one that saved a checkpoint)")
    except OSError as exc:
        fail(f"{run_dir}: cannot be read ({exc.strerror or exc})", "Pass a run's output_dir")
    history = _log_history(read_json_object(state), state)  # bounded: size, nesting, a regular file (exit 2)
    losses, evals = run_curves(history)
    if not losses and not evals:
        fail(f"{state} logs no loss or eval figures", "Train for at least training.logging_steps steps")
    target = check_output_file(png if png is not None else run_dir / "curves.png", [state], what="--out")
    try:
        written = draw_curves(history, target, title=f"{run_dir.resolve().name}: {state.relative_to(run_dir)}")
    except (ValueError, OSError) as exc:
        fail(f"--out {png if png is not None else target}: the PNG cannot be written ({' '.join(str(exc).split())})",
             "Name a .png file in a folder you may write")
    out.print(safe(written))


_MAX_FIGURE = 10.0 ** 300  # a logged figure past this cannot be drawn (float() of a 400-digit integer overflows)


def _log_history(state: dict, path: Path) -> list[dict]:
    """The ``log_history`` entries of a trainer state, numbers too large to draw left out; exit 2 when it has none."""
    history = state.get("log_history")
    if not isinstance(history, list):
        fail(f"{path} has no log_history list", "The run's trainer_state.json is unreadable; pick another checkpoint")
    return [{k: v for k, v in entry.items() if not (isinstance(v, int) and abs(v) > _MAX_FIGURE)}
            for entry in history if isinstance(entry, dict)]


def register(app: typer.Typer) -> None:
    """Add ``plot-run`` to ``app``."""
    app.command("plot-run")(guarded(plot_run))
