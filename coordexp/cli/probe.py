"""``coordexp probe CFG``: how a checkpoint behaves when its own answer goes wrong, on any converted dataset: the
set figures of its greedy rollouts, deletion recovery, the duplicate probe, the exposure gap and Oracle-K recall
(:mod:`coordexp.runtime.train.probe`; docs/figures.md). Checked like ``eval`` before any weight loads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from coordexp.cli.evaluate import (check_checkpoint_files, check_out_dir, default_out_dir, input_files,
                                   measured_identity, print_set_figures, require_packages, run_with_checkpoint)
from coordexp.cli.frame import EXIT_OK, err, guarded, load_run, out, safe, write_result
from coordexp.cli.overrides import SetOption

__all__ = ["register", "probe"]


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def probe(
    config: Annotated[Path, typer.Argument(help="The run's YAML config (its data.val_jsonl is probed).",
                                           show_default=False)],
    checkpoint: Annotated[Optional[Path], typer.Option(
        "--checkpoint", help="Model or LoRA adapter directory (default: the config's output_dir if trained, else "
                             "model.path).")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", min=1, max=1_000_000,
                                                 help="Probe the first N validation records only.")] = None,
    oracle_k: Annotated[int, typer.Option("--oracle-k", min=0, max=64,
                                          help="Sampled rollouts per image for Oracle-K recall (0: skip).")] = 4,
    temperature: Annotated[float, typer.Option("--temperature", min=0.01, max=10.0,
                                               help="Sampling temperature of the Oracle-K rollouts.")] = 1.0,
    out_dir: Annotated[Optional[Path], typer.Option(
        "--out", help="Where probe.json and recall_by_rank.png go (default: OUTPUT_DIR/probe_...).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the figures as JSON on stdout.")] = False,
    overrides: SetOption = None,
) -> None:
    """Deletion recovery, Oracle-K recall, the exposure gap and the duplicate probe of a checkpoint, next to the
    set figures of its greedy rollouts; writes probe.json and a PNG of recall by reading-order rank."""
    from coordexp.runtime.train.run_folder import PROBE_RESULT_FILES

    given = list(overrides or [])
    run = load_run(config, as_json=as_json, overrides=given)
    run, model_dir, adapter = run_with_checkpoint(run, checkpoint)
    require_packages(run, adapter)
    target = out_dir if out_dir is not None else default_out_dir(run, checkpoint, "val", kind="probe")
    check_checkpoint_files(model_dir, adapter)
    check_out_dir(target, input_files(run, config, model_dir, adapter), 0, result_files=PROBE_RESULT_FILES)

    from coordexp.runtime.train.probe import run_probe

    console = err if as_json else out
    console.print(f"[cyan]probe[/cyan] model {safe(model_dir)}" + (f" + adapter {safe(adapter)}" if adapter else ""))
    figures = run_probe(run, limit=limit, oracle_k=oracle_k, temperature=temperature, adapter=adapter,
                        out_dir=target, log=lambda message: console.print(f"[cyan]probe[/cyan] {safe(message)}"),
                        measured=measured_identity(config, model_dir, adapter, given))
    if as_json:
        write_result(json.dumps({"ok": True, "model": str(model_dir),
                                 "adapter": None if adapter is None else str(adapter), **figures}, indent=2) + "\n")
        raise typer.Exit(EXIT_OK)
    print_probe(figures)


def print_probe(figures: dict[str, Any]) -> None:
    """The set figures, then the probes, in percent."""
    print_set_figures(figures)
    cases = figures.get("probe_cases") or {}
    out.print(f"exposure gap {_pct(figures.get('exposure_gap'))}: next object right teacher-forced "
              f"{_pct(figures.get('next_object_tf'))} vs free-running {_pct(figures.get('next_object_free'))} "
              f"({cases.get('tf', 0)} images)")
    out.print(f"deletion recovery {_pct(figures.get('deletion_recovery'))}: a left-out object written before EOS "
              f"({cases.get('deletion', 0)} images)")
    out.print(f"duplicate probe {_pct(figures.get('duplicate_probe'))}: recall of the objects after a repeated one "
              f"({cases.get('duplicate', 0)} images)")
    if figures.get("oracle_k"):
        out.print(f"Oracle-{figures['oracle_k']}: recall greedy {_pct(figures.get('greedy_recall'))}, with "
                  f"{figures['oracle_k']} samples {_pct(figures.get('oracle_k_recall'))}; of greedy's "
                  f"{figures.get('greedy_missed', 0)} misses {_pct(figures.get('oracle_k_recoverable'))} are "
                  "recoverable by decoding")
    for key, value in (figures.get("files") or {}).items():
        out.print(f"{key}: {safe(value)}")


def register(app: typer.Typer) -> None:
    """Add ``probe`` to ``app``."""
    app.command("probe")(guarded(probe))
