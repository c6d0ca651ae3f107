"""``coordexp train`` (YAML-driven training with Rich progress) and ``coordexp show-rollouts`` (rollout PNGs).

Registered on the main app by :func:`register`. The config is validated before anything heavy is imported, so an
invalid file fails in well under a second with every problem listed (exit 2). Under ``torchrun`` every rank
trains; only rank 0 prints. Errors are reported by :func:`coordexp.cli.frame.guarded` (2 input, 3 external, 1 bug).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from coordexp.cli import signals
from coordexp.cli.frame import (EXIT_EXTERNAL, EXIT_OK, err, fail, guarded, is_rank_zero, load_run_and_config, out,
                                 safe, write_result)
from coordexp.cli.overrides import SetOption
from coordexp.cli.signals import EXIT_TERMINATED, terminate_as_interrupt, watching_for_interrupt

__all__ = ["register", "train", "show_rollouts", "resolve_resume", "check_output_place", "train_command",
           "EXIT_TERMINATED"]


def resolve_resume(resume: Optional[str], output_dir: str) -> Optional[str]:
    """``None`` -> fresh start; ``auto`` -> the newest complete ``checkpoint-*`` in ``output_dir`` (incomplete ones
    are named on stderr and skipped); else an existing, complete checkpoint path."""
    from coordexp.runtime.train.checkpoints import checkpoint_problem, choose_resume

    if resume is None:
        return None
    if resume == "auto":
        choice = choose_resume(output_dir)
        for path, problem in choice.skipped:
            if is_rank_zero():
                err.print(f"[yellow]![/yellow] skipped {safe(path)}: {safe(problem)}")
        if choice.path is None:
            found = f" ({len(choice.skipped)} incomplete)" if choice.skipped else ""
            raise FileNotFoundError(
                f"--resume auto found no checkpoint to resume in training.output_dir {output_dir}{found}; "
                "start without --resume or pass a checkpoint path"
            )
        return str(choice.path)
    problem = checkpoint_problem(resume)
    if problem is not None:
        raise FileNotFoundError(f"--resume {resume} cannot be resumed from: {problem}; pass a complete checkpoint-* "
                                "path or 'auto'")
    return resume


def _finished(resume_from: Optional[str], max_steps: Optional[int]) -> Optional[int]:
    """The checkpoint's step when it already reached ``training.max_steps`` (nothing left to train), else None."""
    if resume_from is None or max_steps is None:
        return None
    from coordexp.runtime.train.checkpoints import finished_step

    step = finished_step(resume_from)
    return step if step >= max_steps else None


def _summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    def pct(value: Any) -> str:
        return "-" if value is None else f"{100 * float(value):.1f}%"

    rows = [("steps", str(summary["steps"]))]  # rollout figures are over the whole run, not its last step
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
        if summary.get("pred_per_gt") is not None:
            rows += [("predictions per GT", f"{summary['pred_per_gt']:.2f}"),
                     ("certified duplicates per image", f"{summary.get('duplicates_per_image') or 0:.2f}")]
    for alarm in summary.get("collapse_alarms") or []:
        rows.append((f"collapse alarm at step {alarm['step']} ({alarm['action']})", alarm["reasons"]))
    last_eval = summary.get("last_eval")
    if last_eval:
        when = f"eval at step {last_eval['step']}"
        rows += [(f"{when}: AP50", pct(last_eval["AP50"]))]
        if last_eval.get("f1") is not None:
            rows += [(f"{when}: precision / recall / F1", " / ".join(pct(last_eval.get(k)) for k in
                                                                     ("precision", "recall", "f1")))]
        rows += [(f"{when}: parse valid", pct(last_eval["parse_valid_rate"])),
                 (f"{when}: match", pct(last_eval["match_rate"]))]
        if last_eval.get("token_acc") is not None:
            rows.append((f"{when}: token acc", pct(last_eval["token_acc"])))
    return rows


def check_output_place(run: Any, config: Path, *, overwrite: bool, resume: bool) -> None:
    """Where the run will write, checked before anything loads (exit 2 naming ``training.output_dir``): a
    directory or a new path under a writable one; apart from the run's inputs (never the model it starts from);
    no files a run did not write (unless ``--overwrite``, which moves aside only a run's entries); and a used run
    folder only with ``--resume`` or ``--overwrite``."""
    from coordexp.cli.file_guard import check_output_dir
    from coordexp.runtime.train.run_folder import (PREVIOUS_DIR, foreign_entries, input_overlap, previous_dir_problem,
                                                   record_problem, run_entries, used_output_problem)

    out_dir = run.training.output_dir
    check_output_dir(Path(out_dir), "training.output_dir")
    if os.path.realpath(out_dir) in ("/", os.path.realpath(os.path.expanduser("~"))):
        fail(f"training.output_dir {out_dir} is the root or home folder; a run writes many files there",
             "Name a folder for the run, e.g. runs/NAME (--set training.output_dir=DIR)")
    if run.training.logging_dir is not None:
        check_output_dir(Path(run.training.logging_dir), "training.logging_dir")
    data = run.data
    model_overlap = input_overlap(out_dir, [("model.path", str(run.model.path))])
    if model_overlap is not None and (overwrite or model_overlap[1] != "contains"):
        fail(f"training.output_dir {out_dir} {model_overlap[1]} model.path {run.model.path}: the run would write "
             "over the model it starts from", "Choose an output_dir apart from model.path "
             "(--set training.output_dir=DIR); model.path is never overwritten")
    inputs = [("data.train_jsonl", data.train_jsonl), ("data.val_jsonl", data.val_jsonl),
              ("data.image_root", data.image_root), ("the config", str(config))]
    overlap = input_overlap(out_dir, inputs) if overwrite else None
    if overlap is not None and overlap[1] in ("is", "contains"):
        fail(f"training.output_dir {out_dir} {overlap[1]} {overlap[0]}: --overwrite could move the run's inputs "
             "aside", "Choose an output_dir that holds none of the run's inputs (--set training.output_dir=DIR)")
    for problem in (record_problem(out_dir), previous_dir_problem(out_dir) if overwrite else None):
        if problem is not None:
            fail(f"training.output_dir: {problem}; nothing was loaded or written",
                 "Remove or rename that entry (coordexp writes it itself), or choose another output_dir "
                 "(--set training.output_dir=DIR)")
    if resume:
        return
    foreign = foreign_entries(Path(out_dir))
    if foreign and not overwrite:
        shown = ", ".join(safe(name) for name in foreign[:4]) + (", ..." if len(foreign) > 4 else "")
        colliding = run_entries(Path(out_dir))
        fail(f"training.output_dir {out_dir} holds {len(foreign)} entr{'y' if len(foreign) == 1 else 'ies'} no "
             f"coordexp run wrote ({shown}); a run there could write over them",
             "Choose a new or empty output_dir (--set training.output_dir=DIR)" + (
                 f"; --overwrite moves the {len(colliding)} a run writes ({', '.join(colliding[:3])}) into "
                 f"OUTPUT_DIR/{PREVIOUS_DIR}/ and leaves the rest" if colliding else
                 "; --overwrite trains there and leaves every one of them as it is"))
    used = used_output_problem(out_dir)
    if used is not None and not overwrite:
        fail(f"training.output_dir {out_dir} {used}: a fresh run would overwrite it",
             f"Continue it with --resume auto, start afresh with --overwrite (the old run is moved to "
             f"OUTPUT_DIR/{PREVIOUS_DIR}/), or choose another output_dir (--set training.output_dir=DIR)")


def _replayed_overrides(output_dir: str, given: list[str]) -> list[str]:
    """``--resume``: the run record's overrides, then the ones given now (which win); the record is the run."""
    from coordexp.cli.overrides import recorded_overrides

    recorded = recorded_overrides(output_dir) or []
    if recorded and is_rank_zero():
        err.print("reusing the run's recorded overrides: " + " ".join(f"--set {safe(t)}" for t in recorded))
        keys = {text.partition("=")[0].strip() for text in recorded}
        won = [text for text in given if text.partition("=")[0].strip() in keys]
        if won:
            err.print("given again now, these win over the recorded ones: " + " ".join(f"--set {safe(t)}"
                                                                                      for t in won))
    return recorded + given


_OPTIMIZER_STATE_KEYS = frozenset(f"training.{key}" for key in (
    "learning_rate", "vit_lr", "aligner_lr", "weight_decay", "vit_weight_decay", "aligner_weight_decay",
    "adam_beta1", "adam_beta2", "warmup_ratio", "warmup_steps", "lr_scheduler_type", "lr_scheduler_kwargs", "optim"))
"""Keys a resumed run cannot take: the optimizer and its schedule are restored from the checkpoint (HF loads
``optimizer.pt`` and ``scheduler.pt`` over whatever the config says), so a new value would be recorded, not used."""


def _refuse_drift(config: Path, output_dir: str, effective: list[str], given: list[str]) -> None:
    """``--resume``: a key that changes training and differs from the record (the config was edited since, or a
    recorded relative path now resolves elsewhere) is refused, named, unless given again with --set on this command
    line (then it is the user's explicit change); an explicit change the checkpoint's optimizer state overrides is
    refused too, naming why."""
    from coordexp.cli.overrides import apply_overrides, named_by, record_drift
    from coordexp.schema.loader import load_merged

    changed = record_drift(output_dir, apply_overrides(load_merged(config), effective), [])  # the record read once
    frozen = [key for key in changed if key in _OPTIMIZER_STATE_KEYS and named_by(key, given)]
    if frozen:
        fail(f"--resume cannot change {', '.join(frozen)}: the optimizer and learning-rate schedule are restored "
             "from the checkpoint, so the run would go on at the recorded setting while its record claimed the new "
             "one", "Resume without it, or start a new run with the checkpoint as model.path and the new setting")
    drift = [key for key in changed if not named_by(key, given)]
    if drift:
        shown = ", ".join(drift[:6]) + (", ..." if len(drift) > 6 else "")
        fail(f"{config} differs from the run record {Path(output_dir) / 'coordexp_config.yaml'} on {len(drift)} "
             f"key(s) that change training: {shown}; resuming would continue a different run",
             "Pass the new value again explicitly (--set KEY=VALUE) to change it, restore the config, or train "
             "afresh with --overwrite")


def _start_point(config: Path, *, resume: Optional[str], given: list[str], overwrite: bool,
                 as_json: bool) -> tuple[Any, list[str], Optional[str]]:
    """This rank's start checks (exit 2/3 naming what to fix): the config validates (with ``--set``); with
    ``--resume`` the run record's overrides are replayed and drift refused; packages, the output folder and the
    checkpoint to resume are checked. Returns the run, its effective overrides and the checkpoint (None: fresh)."""
    run, _ = load_run_and_config(config, as_json=as_json, overrides=given)
    effective = given
    if resume is not None:
        effective = _replayed_overrides(run.training.output_dir, given)
        if effective != given:
            run, _ = load_run_and_config(config, as_json=as_json, overrides=effective)
        _refuse_drift(config, run.training.output_dir, effective, given)
    from coordexp.optional_deps import require_installed
    require_installed(run, "train")  # a missing optional package (peft, deepspeed, ...): exit 3 before any load
    check_output_place(run, config, overwrite=overwrite, resume=resume is not None)
    try:
        resume_from = resolve_resume(resume, run.training.output_dir)
    except FileNotFoundError as exc:
        fail(str(exc))
    if resume_from is not None:
        from coordexp.runtime.train.checkpoints import resume_files_problem

        problem = resume_files_problem(resume_from, run.tuner.train_type)
        if problem is not None:
            fail(f"--resume {resume_from}: {problem}", "Resume from an earlier checkpoint-N (--resume PATH), or "
                 "train afresh with --overwrite")
    return run, effective, resume_from


def train(
    config: Annotated[Path, typer.Argument(help="YAML run config.", show_default=False)],
    resume: Annotated[
        Optional[str], typer.Option("--resume", help="Checkpoint directory to resume from, or 'auto' (newest); "
                                    "the run record's --set overrides are reused.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the final summary as JSON on stdout.")] = False,
    overrides: SetOption = None,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Train afresh in a used training.output_dir: once the new run is built, the old run "
                            "(model, checkpoints, logs, record) is moved to OUTPUT_DIR/.previous/<time>.")] = False,
) -> None:
    """Train from a YAML config (stage 1 or stage 2); everything else comes from the file (and --set)."""
    given = list(overrides or [])
    if resume is not None and overwrite:
        fail("--resume and --overwrite contradict each other", "Pass --resume to continue the run, or --overwrite "
             "to start it afresh")
    from coordexp.cli.rank_start import agreed_start

    # Every rank checks how it would start; under torchrun they agree (one checkpoint) before the model loads.
    run, effective, resume_from = agreed_start(
        lambda: _start_point(config, resume=resume, given=given, overwrite=overwrite, as_json=as_json),
        lambda outcome: outcome[2])
    if resume_from is not None and is_rank_zero():
        err.print(f"resuming from {safe(resume_from)}")
        note = _restretch_note(resume_from, run.training)
        if note:
            err.print(f"[yellow]![/yellow] {safe(note)}")

    done = _finished(resume_from, run.training.max_steps)
    if done is not None:
        written = _finish_from(resume_from, run.training.output_dir) if is_rank_zero() else []
        message = (f"{resume_from} already reached training.max_steps ({run.training.max_steps}) at step {done}; "
                   "nothing to train (train on with --resume auto --set training.max_steps=N)")
        if written:
            message += f"; the run's final model was missing and is now written from it to {run.training.output_dir}"
            _write_model_card(run, _checkpoint_summary(resume_from, done, run.training.output_dir), config=config,
                              effective=effective)
        if as_json:
            write_result(json.dumps({"ok": True, "already_finished": True, "global_step": done,
                                     "checkpoint": resume_from, "final_model_written": bool(written)},
                                    indent=2) + "\n")
        elif is_rank_zero():
            out.print(f"[green]✓[/green] {safe(message)}")
        raise typer.Exit(EXIT_OK)

    from coordexp.cli.quiet import deepspeed_quiet

    with deepspeed_quiet(run.training.deepspeed is None):  # DeepSpeed's import-time lines, where it is not used
        _train(run, config=config, given=given, effective=effective, resume_from=resume_from,
               overwrite=overwrite, as_json=as_json)


def _restretch_note(checkpoint: str, training: Any) -> Optional[str]:
    """What a new ``max_steps`` on resume does to a decaying schedule: HF rebuilds it over the new length and
    restores only its step, so the rate jumps to where the longer schedule stands (said, never silent)."""
    from coordexp.runtime.model.checkpoint_files import CheckpointFileError, read_json_object

    try:
        before = read_json_object(Path(checkpoint) / "trainer_state.json").get("max_steps")
    except CheckpointFileError:
        return None
    now = training.max_steps
    if not isinstance(before, int) or now is None or before == now or training.lr_scheduler_type.startswith("constant"):
        return None
    return (f"training.max_steps is {now} where the checkpoint's run had {before}: the {training.lr_scheduler_type} "
            f"learning-rate schedule is re-stretched over {now} steps (the optimizer's step is kept), so the rate "
            "jumps to where the new schedule stands at this step")


def _checkpoint_summary(checkpoint: str, step: int, output_dir: str) -> dict[str, Any]:
    """The run summary of a run finished from ``checkpoint`` (its ``trainer_state.json`` log), for the model card."""
    from coordexp.runtime.model.checkpoint_files import CheckpointFileError, read_json_object
    from coordexp.runtime.train.progress import summarize_history

    try:
        history = read_json_object(Path(checkpoint) / "trainer_state.json").get("log_history")
    except CheckpointFileError:
        history = None
    summary = summarize_history(history if isinstance(history, list) else [])
    summary.update(global_step=step, output_dir=str(output_dir))
    return summary


def _finish_from(checkpoint: str, output_dir: str) -> list[str]:
    """A run that reached ``max_steps`` but stopped before its final save (SIGTERM or a crash after the last
    checkpoint): its final model is written from that checkpoint, so ``eval`` and ``probe`` find the trained model.
    Nothing is written when the folder already holds a final model."""
    from coordexp.runtime.model.checkpoint_files import CheckpointFileError
    from coordexp.runtime.train.checkpoints import finish_from_checkpoint
    from coordexp.runtime.train.run_folder import RunFolder

    if RunFolder(output_dir).has_final_model():
        return []
    try:
        return finish_from_checkpoint(output_dir, checkpoint)
    except CheckpointFileError as exc:
        fail(f"{checkpoint} reached training.max_steps but its model cannot be used as the final model: "
             f"{exc.message}", "Resume from an earlier checkpoint-N (--resume PATH) and train to the end")
    except OSError as exc:
        fail(f"cannot write the final model into {output_dir} ({exc.strerror or exc}); the checkpoint is kept",
             "Free space or fix the folder's permissions, then run the same command again", code=EXIT_EXTERNAL)


def resume_advice(config: Path, output_dir: str, overrides: list[str]) -> list[str]:
    """What an interrupted run kept and the exact command that continues it (secrets left for the user to add)."""
    from coordexp.runtime.train.checkpoints import choose_resume

    newest = choose_resume(output_dir).path
    if newest is None:
        return [f"no complete checkpoint was saved in {output_dir}; start again with: "
                + train_command(config, overrides, "--overwrite")]
    return [f"last complete checkpoint: {newest}",
            f"continue with: {train_command(config, overrides, '--resume', 'auto')}"]


def train_command(config: Path, overrides: list[str], *flags: str) -> str:
    """``coordexp train CONFIG FLAGS --set ...`` as a shell line; secrets left out (the user passes them again)."""
    import shlex

    from coordexp.cli.overrides import SECRET_MASK, masked_text

    sets = [t for t in (masked_text(text) for text in overrides) if SECRET_MASK not in t]
    return " ".join(["coordexp", "train", shlex.quote(str(config)), *flags,
                     *(f"--set {shlex.quote(t)}" for t in sets)])


def _prepare_folder(run: Any, *, config: Path, given: list[str], effective: list[str],
                    resume_from: Optional[str], overwrite: bool) -> None:
    """Once the run is built (rank 0): ``--overwrite`` moves the old run aside, then the record is written (a
    resumed run appends to its record)."""
    from coordexp.cli.overrides import append_resume_record, write_run_record
    from coordexp.runtime.train.run_folder import RUN_RECORD_NAME, is_run_record, move_previous_run
    from coordexp.schema.loader import load_merged

    if not is_rank_zero():
        return
    out_dir = Path(run.training.output_dir)
    if overwrite:
        moved = move_previous_run(out_dir)
        if moved is not None:
            err.print(f"moved the previous run's {len(moved[1])} entries to {safe(moved[0])} (--overwrite)")
    if resume_from is not None and is_run_record(out_dir / RUN_RECORD_NAME):
        append_resume_record(out_dir, checkpoint=resume_from, overrides=given)
        return
    from coordexp.cli.overrides import apply_overrides

    write_run_record(out_dir, apply_overrides(load_merged(config), effective), source=config, overrides=effective)


def _train(run: Any, *, config: Path, given: list[str], effective: list[str], resume_from: Optional[str],
           overwrite: bool, as_json: bool) -> None:
    """Check, train and report (``train`` after its input checks)."""
    from coordexp.runtime.train.args_check import check_training_arguments
    from coordexp.runtime.train.deepspeed import process_state_restored
    from coordexp.runtime.train.launch import RunTerminated, StopRequest, release_process_group, run_training
    from coordexp.runtime.train.progress import ProgressCallback, summarize_history

    with process_state_restored():  # a zero2 check sets RANK/WORLD_SIZE/MASTER_PORT: they do not outlive it
        check_training_arguments(run)  # what transformers would refuse after the model loads: exit 2 now

    progress = ProgressCallback(err if as_json else None, title=f"{run.trainer_variant}: {safe(config.name)}")
    single = int(os.environ.get("WORLD_SIZE", "1") or "1") == 1
    stop = StopRequest() if single and run.training.save_on_interrupt == "sigterm" else None
    with watching_for_interrupt(), terminate_as_interrupt(stop):  # Ctrl-C: guarded() says "interrupted", exit 130
        try:
            outcome = run_training(
                run,
                resume_from=resume_from,
                callbacks=[progress],
                rollout_log_every=run.training.logging_steps,
                print_logs=False,
                before_train=lambda: _prepare_folder(run, config=config, given=given, effective=effective,
                                                     resume_from=resume_from, overwrite=overwrite),
                stop=stop,
            )
        except KeyboardInterrupt as exc:
            if is_rank_zero():
                for line in resume_advice(config, run.training.output_dir, effective):
                    err.print(safe(line))
            if isinstance(exc, RunTerminated):
                err.print("terminated (SIGTERM)")
                raise typer.Exit(EXIT_TERMINATED) from None
            signals.training_interrupted = True  # the console script then ends the process at once
            raise
    release_process_group()
    if not is_rank_zero():
        raise typer.Exit(EXIT_OK)
    if stop is not None and stop.asked:
        err.print("SIGTERM arrived in the run's last step: the run finished and its final model is saved")
    summary = summarize_history(outcome.log_history)
    summary["global_step"] = outcome.global_step
    summary["output_dir"] = str(outcome.output_dir)
    card = _write_model_card(run, summary, config=config, effective=effective)
    if card is not None:
        summary["model_card"] = str(card)
    if as_json:
        write_result(json.dumps(summary, indent=2) + "\n")
        raise typer.Exit(EXIT_OK)
    from rich.table import Table

    table = Table(title="run summary", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", justify="right")
    for name, value in _summary_rows(summary):
        table.add_row(name, value)
    out.print(table)
    out.print(f"[green]✓[/green] model saved to {safe(outcome.output_dir)}")
    rollout_log = Path(outcome.output_dir) / "rollouts.jsonl"
    if rollout_log.is_file():
        out.print(f"  rollouts logged: `coordexp show-rollouts {safe(outcome.output_dir)}`")


def _write_model_card(run: Any, summary: dict[str, Any], *, config: Path, effective: list[str]) -> Optional[Path]:
    """The run folder's ``README.md`` model card (:mod:`coordexp.runtime.train.model_card`), or a line saying why
    the user's own README.md was left as it is; a card that cannot be written costs a warning, never the run."""
    from coordexp.runtime.train.model_card import write_model_card

    command = train_command(config.absolute(), effective)
    world = int(os.environ.get("WORLD_SIZE", "1") or "1")
    if world > 1:
        command = f"# under torchrun, {world} processes (python -m coordexp train ...)\n{command}"
    try:
        path, written = write_model_card(run.training.output_dir, run, summary, command=command)
    except OSError as exc:
        err.print(f"[yellow]![/yellow] the model card was not written ({safe(exc.strerror or exc)})")
        return None
    if not written:
        err.print(f"[yellow]![/yellow] {safe(path)} is not coordexp's: left as it is, no model card written")
        return None
    return path


def show_rollouts(
    run_dir: Annotated[Path, typer.Argument(help="A run's output_dir (holds rollouts.jsonl).", show_default=False)],
    png_dir: Annotated[Optional[Path], typer.Option("--out", help="PNG directory (default RUN_DIR/rollout_png).")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, help="Render the last N logged rollouts.")] = 8,
) -> None:
    """Render logged rollouts to PNGs: GT green, matched predictions blue, FPs red, FNs orange."""
    from coordexp.cli.file_guard import MAX_SOURCE_BYTES
    from coordexp.runtime.train.visualize import ROLLOUT_LOG_NAME, render_rollout_log

    log = run_dir / ROLLOUT_LOG_NAME
    if not log.is_file():
        fail(
            f"no {ROLLOUT_LOG_NAME} in {run_dir}",
            "Pass the output_dir of a `coordexp train` / `coordexp demo` run (stage 2 logs its rollouts)",
        )
    if log.stat().st_size > MAX_SOURCE_BYTES:
        fail(f"{log} is larger than the {MAX_SOURCE_BYTES}-byte limit on run-folder files",
             "Check that this is a run's rollout log")
    try:
        paths = render_rollout_log(run_dir, png_dir, limit=limit)
    except (ValueError, OSError, RecursionError) as exc:  # RecursionError: a line nested too deeply
        fail(" ".join(str(exc).split()) or type(exc).__name__,
             "The rollout log or an image it names is unreadable; re-run training to rewrite it")
    if not paths:
        fail(f"{run_dir / ROLLOUT_LOG_NAME} is empty", "Train for at least one logging step with stage 2")
    for path in paths:
        out.print(safe(path))


def register(app: typer.Typer) -> None:
    """Add ``train`` and ``show-rollouts`` to ``app``."""
    app.command("train")(guarded(train))
    app.command("show-rollouts")(guarded(show_rollouts))
