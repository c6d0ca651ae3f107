"""``coordexp demo``: the README's main job, a CPU run of stage 1 then stage 2 on a tiny model and synthetic shapes.

The orchestration lives in :mod:`coordexp.runtime.toy.demo`; this module is the command-line glue and the summary.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from coordexp.cli.frame import EXIT_OK, err, guarded, load_run, out, safe, write_result

__all__ = ["register", "demo", "EXAMPLES_DIR"]

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
QUICK_STEPS = {"stage1": 4, "stage2": 2, "eval_records": 4, "summary_records": 4, "eval_every": 2, "n_train": 16}


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _num(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.4f}"


def demo(
    stage1: Annotated[Path, typer.Option(  # the defaults shown relative: the absolute path is cut at 80 columns
        "--stage1", help="Stage-1 config.", show_default="examples/demo_stage1.yaml",
    )] = EXAMPLES_DIR / "demo_stage1.yaml",
    stage2: Annotated[Path, typer.Option(
        "--stage2", help="Stage-2 config (model.path = stage 1's output_dir).",
        show_default="examples/demo_stage2.yaml",
    )] = EXAMPLES_DIR / "demo_stage2.yaml",
    quick: Annotated[
        bool, typer.Option("--quick", help="Smoke run: a few steps per stage (also COORDEXP_DEMO_QUICK=1).")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON on stdout.")] = False,
    threads: Annotated[int, typer.Option(
        "--threads", min=1, max=256,
        help="torch CPU threads. 1 (the default) prints the same figures whatever the machine's core count; more "
             "threads change float rounding, and a different stage-1 model follows (docs/design.md, decision 16).",
    )] = 1,
) -> None:
    """Build the tiny model and data (reused when present), train stage 1 until rollouts parse, then stage 2 from
    that checkpoint; print before/after rollout health and the paths of rollout PNGs."""
    for path in (stage1, stage2):
        load_run(path, as_json=as_json)  # both files checked before anything is built or loaded

    import torch

    from coordexp.runtime.toy.demo import DemoPlan, result_to_dict, run_demo
    from coordexp.runtime.train.progress import ProgressCallback

    quick = quick or os.environ.get("COORDEXP_DEMO_QUICK") == "1"
    plan = DemoPlan(
        stage1_config=stage1,
        stage2_config=stage2,
        **(
            dict(
                stage1_max_steps=QUICK_STEPS["stage1"],
                stage2_max_steps=QUICK_STEPS["stage2"],
                eval_records=QUICK_STEPS["eval_records"],
                summary_records=QUICK_STEPS["summary_records"],
                stage1_eval_every=QUICK_STEPS["eval_every"],
                n_train=QUICK_STEPS["n_train"],
            )
            if quick
            else {}
        ),
    )
    console = err if as_json else out

    def log(message: str) -> None:
        console.print(f"[cyan]demo[/cyan] {safe(message)}")

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        started = time.monotonic()
        result = run_demo(plan, callbacks_for=lambda stage: [ProgressCallback(console, title=safe(stage))], log=log)
        total = time.monotonic() - started
    finally:
        torch.set_num_threads(before)  # an in-process caller (tests, notebooks) keeps its own setting
    summary = result_to_dict(result)
    summary["seconds"]["total"] = total
    summary["threads"] = threads
    if as_json:
        write_result(json.dumps(summary, indent=2) + "\n")
        raise typer.Exit(EXIT_OK)
    _print_summary(result, total)


def _print_summary(result: Any, total: float) -> None:
    from rich.table import Table

    table = Table(title="stage 2: before vs after (val rollouts)")
    table.add_column("")
    table.add_column("before stage 2", justify="right")
    table.add_column("after stage 2", justify="right")
    b, a = result.before, result.after
    table.add_row("parse valid rate", _pct(b.parse_valid_rate), _pct(a.parse_valid_rate))
    table.add_row("match rate (stage-2 matcher)", _pct(b.match_rate), _pct(a.match_rate))
    table.add_row("box AP50 (COCO)", _pct(b.ap50), _pct(a.ap50))
    for name, key in (("precision (class-aware, IoU 0.5)", "precision"), ("recall", "recall"), ("F1", "f1")):
        table.add_row(name, _pct(b.figures.get(key)), _pct(a.figures.get(key)))
    dups = [e.figures.get("duplicates_per_image") for e in (b, a)]
    table.add_row("duplicates per image", *("-" if v is None else f"{v:.2f}" for v in dups))
    table.add_row("stage-2 loss on val", _num(b.loss), _num(a.loss))
    table.add_row("valid objects / GT", f"{b.counters.pred_valid} / {b.counters.gt_objects}",
                  f"{a.counters.pred_valid} / {a.counters.gt_objects}")
    table.add_row("FN appended", str(b.counters.fn_appended), str(a.counters.fn_appended))
    table.add_row("truncated rollouts", f"{b.counters.truncated_rollouts}/{b.counters.samples}",
                  f"{a.counters.truncated_rollouts}/{a.counters.samples}")
    out.print(table)
    reached = "reached" if result.stage1_reached_target else "did not reach"
    out.print(f"stage 1: {result.stage1_steps} steps ({reached} the parse and match targets) -> {safe(result.stage1_dir)}")
    out.print(f"stage 2: {result.stage2_steps} steps -> {safe(result.stage2_dir)}")
    times = ", ".join(f"{name} {seconds:.0f}s" for name, seconds in result.seconds.items())
    out.print(f"time: {total:.0f}s ({times})")
    out.print("rollout PNGs (GT green, matched blue, FP red, FN orange):")
    for path in result.pngs:
        out.print(f"  {safe(path)}")


def register(app: typer.Typer) -> None:
    """Add ``demo`` to ``app``."""
    app.command("demo")(guarded(demo))
