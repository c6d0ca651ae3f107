"""``coordexp plot-run RUN_DIR``: the run's training loss and evaluation curves as one PNG (PIL, no matplotlib)."""

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
    """Draw the run's loss and eval curves (AP50, AP, match rate, token accuracy) from its log history to a PNG."""
    from coordexp.runtime.train.curves import draw_curves, find_trainer_state, load_log_history, run_curves

    try:
        state = find_trainer_state(run_dir)
        history = load_log_history(state)
    except FileNotFoundError as exc:
        fail(str(exc), "Pass the output_dir of a finished `coordexp train` run (or one that saved a checkpoint)")
    except (ValueError, OSError) as exc:
        fail(" ".join(str(exc).split()), "The run's trainer_state.json is unreadable; pick another checkpoint")
    losses, evals = run_curves(history)
    if not losses and not evals:
        fail(f"{state} logs no loss or eval figures", "Train for at least training.logging_steps steps")
    target = png if png is not None else run_dir / "curves.png"
    written = draw_curves(history, target, title=f"{run_dir.resolve().name}: {state.relative_to(run_dir)}")
    out.print(safe(written))


def register(app: typer.Typer) -> None:
    """Add ``plot-run`` to ``app``."""
    app.command("plot-run")(guarded(plot_run))
