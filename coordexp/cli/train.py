"""``coordexp train`` (YAML-driven training with Rich progress) and ``coordexp show-rollouts`` (rollout PNGs).

Registered on the main app by :func:`register`. The config is validated before anything heavy is imported, so an
invalid file fails in well under a second with every problem listed (exit 2). Under ``torchrun`` every rank
trains; only rank 0 prints.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape

__all__ = ["register", "train", "show_rollouts", "resolve_resume", "USER_ERRORS"]

EXIT_OK, EXIT_INTERNAL, EXIT_INVALID = 0, 1, 2
_out = Console(highlight=False, soft_wrap=True)
_err = Console(stderr=True, highlight=False, soft_wrap=True)

# Exception class names that mean "the input is wrong" (exit 2), resolved lazily so this module stays light.
USER_ERRORS = (
    ("coordexp.runtime.train.launch", "LaunchError"),
    ("coordexp.runtime.model.data", "DatasetError"),
    ("coordexp.runtime.model.encoding", "EncodingError"),
    ("coordexp.runtime.model.mrope", "PackingError"),
    ("coordexp.runtime.rollout.base", "BackendUnavailableError"),
    ("coordexp.schema.errors", "ConfigError"),
    ("coordexp.schema.errors", "ConfigRuleError"),
)


def _is_rank_zero() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _user_error_types() -> tuple[type, ...]:
    import importlib

    return tuple(getattr(importlib.import_module(module), name) for module, name in USER_ERRORS)


def _fail(message: str, hint: str = "", code: int = EXIT_INVALID) -> None:
    if _is_rank_zero():
        _err.print(f"[red]✗[/red] {escape(message)}" + (f". [dim]{escape(hint)}[/dim]" if hint else ""))
    raise typer.Exit(code)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def resolve_resume(resume: Optional[str], output_dir: str) -> Optional[str]:
    """``None`` -> fresh start; ``auto`` -> the newest ``checkpoint-*`` in ``output_dir``; else an existing path."""
    if resume is None:
        return None
    if resume == "auto":
        from transformers.trainer_utils import get_last_checkpoint

        last = get_last_checkpoint(output_dir) if Path(output_dir).is_dir() else None
        if last is None:
            raise FileNotFoundError(
                f"--resume auto found no checkpoint-* directory in training.output_dir {output_dir}; "
                "start without --resume or pass a checkpoint path"
            )
        return last
    if not Path(resume).is_dir():
        raise FileNotFoundError(f"--resume {resume} is not a checkpoint directory; pass a checkpoint-* path or 'auto'")
    return resume


def _summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    def pct(value: Any) -> str:
        return "-" if value is None else f"{100 * float(value):.1f}%"

    rows = [("steps", str(summary["steps"]))]
    rows.append(("final loss", "-" if summary["final_loss"] is None else f"{summary['final_loss']:.4f}"))
    rollout = summary.get("rollout") or {}
    if rollout:
        rows += [
            ("parse valid rate", pct(summary.get("parse_valid_rate"))),
            ("match rate", pct(summary.get("match_rate"))),
            ("FN appended", f"{rollout.get('fn_appended', 0):.0f}"),
            ("FP", f"{rollout.get('fp', 0):.0f}"),
            ("truncated rollouts", f"{rollout.get('truncated_rollouts', 0):.0f}"),
        ]
    return rows


def train(
    config: Annotated[Path, typer.Argument(help="YAML run config.", show_default=False)],
    resume: Annotated[
        Optional[str], typer.Option("--resume", help="Checkpoint directory to resume from, or 'auto' (newest).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the final summary as JSON on stdout.")] = False,
) -> None:
    """Train from a YAML config (stage 1 or stage 2); everything else comes from the file."""
    from coordexp.cli.app import print_invalid_report
    from coordexp.schema.contract import build_contract
    from coordexp.schema.loader import validate_config_file

    report = validate_config_file(config)
    if not report.ok:
        if _is_rank_zero():
            print_invalid_report(_err, str(config), report)
            _err.print(f"[dim]Nothing was loaded. Fix the file (`coordexp validate {escape(str(config))}`).[/dim]")
        raise typer.Exit(EXIT_INVALID)
    run = build_contract(report.config)

    try:
        resume_from = resolve_resume(resume, run.training.output_dir)
    except FileNotFoundError as exc:
        _fail(str(exc))

    from coordexp.runtime.train.progress import ProgressCallback, summarize_history

    progress = ProgressCallback(_err if as_json else None, title=f"{run.trainer_variant}: {config.name}")
    user_errors = _user_error_types()
    try:
        from coordexp.runtime.train.launch import run_training

        outcome = run_training(
            run,
            resume_from=resume_from,
            callbacks=[progress],
            rollout_log_every=run.training.logging_steps,
            print_logs=False,
        )
    except user_errors as exc:
        _fail(f"{type(exc).__name__}: {_one_line(exc)}", "Fix the config or data named above and re-run")
    except (KeyboardInterrupt, typer.Exit):
        raise
    except Exception as exc:  # noqa: BLE001 - reported as an internal error with a debug switch
        if os.environ.get("COORDEXP_DEBUG") == "1":
            raise
        _fail(
            f"internal error: {type(exc).__name__}: {_one_line(exc)}",
            "This is a bug in coordexp. Re-run with COORDEXP_DEBUG=1 for the traceback; report it",
            EXIT_INTERNAL,
        )

    if not _is_rank_zero():
        raise typer.Exit(EXIT_OK)
    summary = summarize_history(outcome.log_history)
    summary["global_step"] = outcome.global_step
    summary["output_dir"] = str(outcome.output_dir)
    if as_json:
        sys.stdout.write(json.dumps(summary, indent=2) + "\n")
        raise typer.Exit(EXIT_OK)
    from rich.table import Table

    table = Table(title="run summary", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")
    for name, value in _summary_rows(summary):
        table.add_row(name, value)
    _out.print(table)
    _out.print(f"[green]✓[/green] model saved to {escape(str(outcome.output_dir))}")
    rollout_log = Path(outcome.output_dir) / "rollouts.jsonl"
    if rollout_log.is_file():
        _out.print(f"  rollouts logged: `coordexp show-rollouts {escape(str(outcome.output_dir))}`")


def show_rollouts(
    run_dir: Annotated[Path, typer.Argument(help="A run's output_dir (holds rollouts.jsonl).", show_default=False)],
    out: Annotated[Optional[Path], typer.Option("--out", help="PNG directory (default RUN_DIR/rollout_png).")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, help="Render the last N logged rollouts.")] = 8,
) -> None:
    """Render logged rollouts to PNGs: GT green, matched predictions blue, FPs red, FNs orange."""
    from coordexp.runtime.train.visualize import ROLLOUT_LOG_NAME, render_rollout_log

    if not (run_dir / ROLLOUT_LOG_NAME).is_file():
        _fail(
            f"no {ROLLOUT_LOG_NAME} in {run_dir}",
            "Pass the output_dir of a `coordexp train` / `coordexp demo` run (stage 2 logs its rollouts)",
        )
    try:
        paths = render_rollout_log(run_dir, out, limit=limit)
    except (ValueError, OSError) as exc:
        _fail(_one_line(exc), "The rollout log or an image it names is unreadable; re-run training to rewrite it")
    if not paths:
        _fail(f"{run_dir / ROLLOUT_LOG_NAME} is empty", "Train for at least one logging step with stage 2")
    for path in paths:
        _out.print(escape(str(path)))


def register(app: typer.Typer) -> None:
    """Add ``train`` and ``show-rollouts`` to ``app``."""
    app.command("train")(train)
    app.command("show-rollouts")(show_rollouts)
