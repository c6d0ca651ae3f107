"""Build a training run from the normalized contract: policy, processor, data, TrainingArguments, backend, trainer.

The same path loads the tiny offline model and a real checkpoint (``from_pretrained`` on ``model.path``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from coordexp.runtime.train.divergence import NonFiniteTrainingError, diverged
from coordexp.runtime.rollout.registry import create_backend
from coordexp.runtime.model.data import load_records
from coordexp.runtime.model.policy import LaunchError, load_policy
from coordexp.runtime.train.rollout_step import HostContext

if TYPE_CHECKING:
    from coordexp.runtime.train.trainer import CoordExpTrainer
    from coordexp.schema.contract import RunContract

__all__ = ["LaunchError", "load_policy", "training_arguments", "build_trainer", "TrainOutcome", "run_training",
           "release_process_group", "RunTerminated", "StopRequest", "non_finite_stop",
           "CollapseStopError", "NonFiniteTrainingError", "accumulation_steps", "intervals_from_args"]

def accumulation_steps(t: Any, world_size: int) -> int:
    """``gradient_accumulation_steps``, or ``effective_batch_size / (per_device_train_batch_size * world_size)``
    when the effective batch size is set (exit 2 when it does not divide)."""
    if t.effective_batch_size is None:
        return t.gradient_accumulation_steps
    per_step = t.per_device_train_batch_size * world_size
    if t.effective_batch_size % per_step:
        raise LaunchError(
            f"training.effective_batch_size ({t.effective_batch_size}) is not a multiple of "
            f"per_device_train_batch_size ({t.per_device_train_batch_size}) * WORLD_SIZE ({world_size}) = {per_step}",
            hint="Change effective_batch_size, per_device_train_batch_size or the number of ranks so it divides.")
    return t.effective_batch_size // per_step


def training_arguments(run: "RunContract", **overrides: Any):
    """The HF ``TrainingArguments`` of ``training.*``: the passed-through HF fields as written, the owned ones
    resolved (accumulation from effective_batch_size and WORLD_SIZE, DeepSpeed presets, evaluation), and the
    fields coordexp controls set here (docs/design.md, decision 13)."""
    import torch
    from transformers import TrainingArguments

    from coordexp.runtime.train.deepspeed import resolve_deepspeed, single_process_rendezvous, skip_cpu_shm_op
    from coordexp.schema.training import HF_PASSTHROUGH, best_model_metric

    t = run.training
    on_cpu = not torch.cuda.is_available()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    evaluate = run.data.val_jsonl is not None and t.eval_steps is not None
    if t.logging_dir is not None:  # transformers 5 dropped TrainingArguments.logging_dir for this variable
        os.environ["TENSORBOARD_LOGGING_DIR"] = t.logging_dir
    passed = {name: getattr(t, name) for name in HF_PASSTHROUGH}
    if passed.get("metric_for_best_model") is not None:  # HF reads eval_<name>; the schema accepted the name
        passed["metric_for_best_model"] = "eval_" + best_model_metric(passed["metric_for_best_model"])
    if passed["ddp_find_unused_parameters"] is None:
        passed["ddp_find_unused_parameters"] = False  # every trainable parameter gets a gradient each step
    if "eval_strategy" in t.model_fields_set:
        evaluate = t.eval_strategy != "no"
    kwargs: dict[str, Any] = dict(
        passed,
        output_dir=t.output_dir,
        per_device_train_batch_size=t.per_device_train_batch_size,
        per_device_eval_batch_size=t.per_device_eval_batch_size,
        gradient_accumulation_steps=accumulation_steps(t, world_size),
        max_steps=t.max_steps if t.max_steps is not None else -1,
        num_train_epochs=t.num_train_epochs,
        learning_rate=t.learning_rate,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        max_grad_norm=t.max_grad_norm,
        warmup_steps=t.warmup_steps if "warmup_steps" in t.model_fields_set else (
            t.warmup_ratio if t.warmup_ratio < 1 else 0),
        lr_scheduler_type=t.lr_scheduler_type,
        lr_scheduler_kwargs=t.lr_scheduler_kwargs.model_dump(exclude_none=True) if t.lr_scheduler_kwargs else None,
        optim=t.optim,
        seed=t.seed,
        logging_steps=t.logging_steps,
        save_steps=t.save_steps,
        save_total_limit=t.save_total_limit,
        eval_strategy=t.eval_strategy if "eval_strategy" in t.model_fields_set else ("steps" if evaluate else "no"),
        eval_steps=t.eval_steps if evaluate else None,
        dataloader_num_workers=t.dataloader_num_workers,
        report_to=list(t.report_to) or "none",
        deepspeed=resolve_deepspeed(t.deepspeed),
        remove_unused_columns=False,
        use_cpu=on_cpu,
        ddp_backend="gloo" if on_cpu and world_size > 1 else None,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    if kwargs["deepspeed"] is not None:  # before TrainingArguments starts DeepSpeed's comm backend
        single_process_rendezvous()
        if on_cpu:
            skip_cpu_shm_op()
        floor = kwargs["lr_scheduler_kwargs"] or {}
        if "min_lr" in floor:  # transformers divides by optimizer.defaults["lr"], which DeepSpeed's optimizer lacks
            kwargs["lr_scheduler_kwargs"] = {"min_lr_rate": floor["min_lr"] / kwargs["learning_rate"]}
    return TrainingArguments(**kwargs)


def build_trainer(
    run: "RunContract",
    *,
    model: Any = None,
    processor: Any = None,
    callbacks: Sequence[Any] = (),
    rollout_log_every: int = 0,
    args_overrides: dict[str, Any] | None = None,
) -> "CoordExpTrainer":
    """Everything wired: records, backend (stage 2), trainer. Pass ``model``/``processor`` to reuse loaded ones."""
    from coordexp.runtime.train.dataset import RecordDataset
    from coordexp.runtime.train.trainer import CoordExpTrainer

    if model is None or processor is None:
        model, processor = load_policy(run)  # refuses NaN or Inf weights
    data = run.data
    train_records = load_records(data.train_jsonl, data.image_root, max_samples=data.max_train_samples,
                                 object_order=data.object_order)
    if not train_records:
        raise LaunchError(f"{data.train_jsonl} has no records; a run needs at least one training sample")
    val = None
    if data.val_jsonl is not None:
        val = RecordDataset(load_records(data.val_jsonl, data.image_root, max_samples=data.max_val_samples,
                                         object_order=data.object_order))
    host = HostContext.create(processor, run.rollout_matching, run.template, max_length=run.sample_max_length)
    backend = None
    if run.trainer_variant == "stage2_rollout_aligned" or val is not None:  # stage 1 rolls out for evaluation only
        backend = create_backend(run, model, processor)
    return CoordExpTrainer(
        model=model,
        args=training_arguments(run, **(args_overrides or {})),
        train_dataset=RecordDataset(train_records),
        eval_dataset=val,
        callbacks=list(callbacks),
        run=run,
        host=host,
        backend=backend,
        rollout_log_every=rollout_log_every,
    )


class RunTerminated(KeyboardInterrupt):
    """SIGTERM during a run: unwinds like Ctrl-C (checkpoints are atomic, nothing is half-written); exit 143."""


class StopRequest:
    """A stop asked for while training (SIGTERM under ``training.save_on_interrupt: sigterm``): the step in progress
    finishes, its checkpoint is saved, and :func:`run_training` raises :class:`RunTerminated` without writing a
    final model, unless that step was the last (then the run is finished: its final model is written and the run
    ends as a success). ``training`` says whether a stop can wait: the loop runs, or the final save does."""

    def __init__(self) -> None:
        self.asked = False
        self.training = False

    def callback(self) -> Any:
        from transformers import TrainerCallback

        request = self

        class _StopAtStepEnd(TrainerCallback):
            def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                request.training = True

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                if request.asked:
                    control.should_save = True
                    control.should_training_stop = True

        return _StopAtStepEnd()  # ``training`` stays set through the final save; run_training clears it


def intervals_from_args() -> Any:
    """A callback giving a resumed run this launch's ``logging_steps``, ``eval_steps`` and ``save_steps``: HF takes
    them from the checkpoint's ``trainer_state.json`` on resume (a ``--set training.save_steps=100`` would be recorded
    and ignored); for a fresh run they are the same values."""
    from transformers import TrainerCallback

    class _IntervalsFromArgs(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            state.compute_steps(args, state.max_steps)

    return _IntervalsFromArgs()


def non_finite_stop() -> Any:
    """A callback that ends the run when a logged ``loss`` or ``grad_norm`` is NaN or Inf, naming the step: a
    diverged run must not go on writing checkpoints of non-finite weights under normal-looking progress."""
    import math

    from transformers import TrainerCallback

    class _NonFiniteStop(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
            for key in ("loss", "grad_norm"):
                value = (logs or {}).get(key)
                if isinstance(value, (int, float)) and not math.isfinite(value):
                    raise diverged(key, value, state.global_step, args.output_dir)

    return _NonFiniteStop()


class CollapseStopError(LaunchError):
    """``collapse_alarm.action: stop`` ended the run: a stop, not a success (exit 2, the step and its checkpoint
    named); the collapsed weights are never written as the final model."""


def _refuse_collapse_stop(trainer: Any) -> None:
    from coordexp.runtime.train.collapse import CollapseCallback

    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, CollapseCallback) and callback.stopped_at is not None:
            step = callback.stopped_at
            raise CollapseStopError(
                f"the collapse alarm stopped the run at step {step} ({callback.stop_reasons}); its checkpoint is "
                f"{Path(trainer.args.output_dir) / f'checkpoint-{step}'} and no final model was written",
                hint="see docs/figures.md (collapse alarm); resume from an earlier checkpoint with other settings, "
                     "or set rollout_matching.collapse_alarm.action: warn")


@dataclass(frozen=True)
class TrainOutcome:
    output_dir: Path
    global_step: int
    log_history: tuple[dict, ...]


def run_training(
    run: "RunContract",
    *,
    resume_from: str | None = None,
    callbacks: Sequence[Any] = (),
    rollout_log_every: int = 0,
    print_logs: bool = True,
    before_train: Callable[[], None] | None = None,
    stop: StopRequest | None = None,
) -> TrainOutcome:
    """Train, save the final model (with its processor) to ``training.output_dir`` and return the log history.
    ``before_train`` runs once the model, data and trainer are built, before the first step (what ``train`` does to
    the run folder: ``--overwrite``'s move, the run record), so a run that cannot start has changed nothing.
    ``stop`` (a :class:`StopRequest`) ends the run at a step boundary with that step's checkpoint."""
    from transformers.trainer_callback import PrinterCallback

    from coordexp.runtime.train.deepspeed import process_state_restored

    with process_state_restored():  # also TENSORBOARD_LOGGING_DIR (training.logging_dir): this run's only
        callbacks = [*callbacks, non_finite_stop(), intervals_from_args(),
                     *([stop.callback()] if stop is not None else [])]
        trainer = build_trainer(run, callbacks=callbacks, rollout_log_every=rollout_log_every)
        if not print_logs:
            trainer.remove_callback(PrinterCallback)  # raw log dicts on stdout; the CLI shows its own progress
        try:
            if before_train is not None:
                before_train()
            trainer.train(resume_from_checkpoint=resume_from)
            _refuse_collapse_stop(trainer)
            finished = trainer.state.global_step >= trainer.state.max_steps > 0
            if stop is not None and stop.asked and not finished:
                raise RunTerminated()  # stopped at a step boundary, its checkpoint saved: no final model
            trainer.save_model()  # a SIGTERM now waits for the final save (``stop.training`` is still set)
            trainer.save_state()  # OUTPUT_DIR/trainer_state.json: the whole run's log history (coordexp plot-run)
        finally:
            if stop is not None:
                stop.training = False
            if trainer.backend is not None:
                trainer.backend.close()
    return TrainOutcome(Path(run.training.output_dir), trainer.state.global_step, tuple(trainer.state.log_history))


def release_process_group() -> None:
    """End this process's ``torch.distributed`` group after a run every rank finished: a barrier, then
    ``destroy_process_group``. A torchrun process that exits with the group alive can abort in gloo's worker threads
    at interpreter shutdown ("terminate called without an active exception", SIGABRT; docs/training.md).
    Only on success: after a rank failed, the others may be inside a collective and a barrier would hang them. A
    one-process group stays (a single-process DeepSpeed run's: the next run in this process joins it again)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
        dist.destroy_process_group()
