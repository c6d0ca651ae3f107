"""``training.*``: Hugging Face ``TrainingArguments`` as a run sets them, plus coordexp's own knobs (per-part
learning rates, effective batch size, DeepSpeed presets, post-rollout packing).

The fields typed here are *owned* (coordexp reads or resolves them); every other ``TrainingArguments`` field is
typed from transformers' own dataclass (``hf_surface.py``) and passed through, or refused with the reason
(docs/design.md, decision 13).
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, create_model, field_validator, model_validator

from coordexp.schema.base import (
    MAX_BATCH,
    MAX_DEVICES,
    MAX_WORKERS,
    BatchSize,
    Count,
    PathStr,
    Probability,
    Seed,
    StrictModel,
    float_in,
    int_in,
    path_extra,
)
from coordexp.schema.deepspeed_file import content_violations, deepspeed_stage, load_violations, preset_json_path
from coordexp.schema.errors import RuleViolation, raise_violations
from coordexp.schema.hf_surface import passthrough_fields, refused_fields
from coordexp.schema.hf_training_fields import HF_TRAINING_FIELDS, REPORT_TO_CHOICES

__all__ = ["TrainingConfig", "SchedulerKwargs", "DEEPSPEED_PRESETS", "HF_PASSTHROUGH", "BEST_MODEL_METRICS",
           "TOKEN_METRICS", "best_model_metric", "zero_stage", "deepspeed_violations", "evaluation_data_violations"]

DEEPSPEED_PRESETS = ("zero2", "zero3")
"""Shipped DeepSpeed configs (coordexp/runtime/train/deepspeed/<name>.json, "auto" values filled by transformers)."""

LearningRate = float_in(gt=0.0, le=10.0)
WeightDecay = float_in(ge=0.0, le=10.0)
ReportTarget = Literal[REPORT_TO_CHOICES]  # type: ignore[valid-type]


class SchedulerKwargs(StrictModel):
    """``lr_scheduler_kwargs`` of ``cosine_with_min_lr``: the floor the cosine decays to, as exactly one of an
    absolute rate (the LLM's; every part ends at the same fraction of its own rate) or a fraction."""

    min_lr: Optional[float_in(ge=0.0, le=10.0)] = Field(None, description="Absolute floor of learning_rate.")
    min_lr_rate: Optional[Probability] = Field(None, description="Floor as a fraction of each group's rate.")

    @model_validator(mode="after")
    def _exactly_one(self) -> "SchedulerKwargs":
        if (self.min_lr is None) == (self.min_lr_rate is None):
            raise_violations([RuleViolation("min_lr", "set exactly one of min_lr and min_lr_rate",
                                            "e.g. lr_scheduler_kwargs: {min_lr_rate: 0.1}")])
        return self


class _OwnedTrainingFields(StrictModel):
    """Optimiser, schedule, checkpointing and packing knobs coordexp reads itself (names follow
    ``transformers.TrainingArguments`` and ms-swift where they exist)."""

    output_dir: PathStr = Field(
        description="Checkpoints and logs go here.", json_schema_extra=path_extra()
    )
    per_device_train_batch_size: BatchSize = Field(1, description="Raw samples per rank per micro-step.")
    per_device_eval_batch_size: BatchSize = Field(
        1, description="Eval batch per rank; rollout decoding uses rollout_matching.decode_batch_size."
    )
    gradient_accumulation_steps: BatchSize = Field(1, description="Micro-steps per optimizer step.")
    effective_batch_size: Optional[int_in(1, MAX_BATCH * MAX_DEVICES)] = Field(
        None, description="Samples per optimizer step over all ranks: gradient_accumulation_steps = effective / "
        "(per_device_train_batch_size * WORLD_SIZE), resolved at launch (must divide).")
    max_steps: Optional[Count] = Field(None, description="Optimizer steps; null trains num_train_epochs.")
    num_train_epochs: float_in(gt=0.0, le=1e6) = Field(1.0, description="Epochs when max_steps is null (at most 1e6).")
    learning_rate: LearningRate = Field(1e-5, description="Peak learning rate of the LLM part, in (0, 10].")
    vit_lr: Optional[LearningRate] = Field(None, description="Peak rate of the vision tower; null = learning_rate.")
    aligner_lr: Optional[LearningRate] = Field(None, description="Peak rate of the aligner; null = learning_rate.")
    weight_decay: WeightDecay = Field(0.0, description="AdamW weight decay of the LLM part, in [0, 10].")
    vit_weight_decay: Optional[WeightDecay] = Field(None, description="Vision tower; null = weight_decay.")
    aligner_weight_decay: Optional[WeightDecay] = Field(None, description="Aligner; null = weight_decay.")
    adam_beta1: float_in(ge=0.0, lt=1.0) = Field(0.9)
    adam_beta2: float_in(ge=0.0, lt=1.0) = Field(0.999)
    max_grad_norm: float_in(ge=0.0, le=1e6) = Field(1.0, description="Gradient clipping; 0 disables.")
    warmup_ratio: Probability = Field(0.0, description="Fraction of steps spent warming up.")
    lr_scheduler_type: Literal["constant", "constant_with_warmup", "linear", "cosine", "cosine_with_min_lr"] = Field(
        "cosine", description="cosine_with_min_lr decays to the floor in lr_scheduler_kwargs.")
    lr_scheduler_kwargs: Optional[SchedulerKwargs] = Field(
        None, description="cosine_with_min_lr only: {min_lr: float} or {min_lr_rate: float}.")
    optim: Literal["adamw_torch", "adamw_torch_fused", "sgd"] = Field("adamw_torch")
    seed: Seed = Field(42, description="Run seed (0..2**32-1): data order, init, and rollout seeds.")
    logging_steps: Count = Field(10, description="Log every N optimizer steps.")
    token_type_metrics: bool = Field(
        False, description="Log teacher-forced accuracy and cross-entropy of the trained tokens per logging step: "
        "all, text and coord tokens (token_acc, text_token_acc, coord_token_acc, *_token_loss).")
    logging_dir: Optional[PathStr] = Field(
        None, description="TensorBoard event folder (transformers 5 reads TENSORBOARD_LOGGING_DIR; coordexp sets "
        "it); null = under output_dir.", json_schema_extra=path_extra())
    save_steps: Count = Field(500, description="Checkpoint every N optimizer steps.")
    save_total_limit: Optional[Count] = Field(None, description="Keep at most N checkpoints.")
    save_on_interrupt: Literal["sigterm", "never"] = Field(
        "sigterm", description="sigterm: on SIGTERM (SLURM or Kubernetes preemption) the step in progress finishes, "
        "its checkpoint is saved and the run stops (exit 143; a second SIGTERM stops at once); never: stop at "
        "once. Single-process runs only (torchrun ranks would stop at different steps). Ctrl-C always stops at "
        "once.")
    save_safetensors: Literal[True] = Field(
        True, description="Accepted for older configs: transformers 5 always saves safetensors (false is refused).")
    eval_steps: Optional[Count] = Field(None, description="Evaluate every N steps (needs data.val_jsonl).")
    dataloader_num_workers: int_in(0, MAX_WORKERS) = Field(0)
    report_to: list[ReportTarget] = Field(
        default_factory=list, description="Metrics sinks (a list; the string 'none' or one name is accepted).",
        max_length=len(REPORT_TO_CHOICES))
    deepspeed: Optional[PathStr] = Field(
        None, description="A shipped preset (zero2, zero3) or a DeepSpeed JSON path starting with '.', '/' or '~' "
        "(resolved against this file's folder).", json_schema_extra=path_extra("hub-or-path"))
    packing: bool = Field(False, description="Pack post-rollout Y_train segments into rows of packing_length.")
    packing_buffer: BatchSize = Field(512, description="Cap on the rank-local carry buffer of segments.")
    packing_min_fill_ratio: Probability = Field(
        0.65, description="Warn when a packed row is filled below this ratio (telemetry only)."
    )
    packing_drop_last: bool = Field(
        True, description="Carry-only mode: leftovers are dropped at the end (must be true with packing)."
    )

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to_list(cls, value):
        if isinstance(value, str):  # transformers accepts one name; "none" means no sink
            return [] if value == "none" else [value]
        if isinstance(value, list) and value == ["none"]:  # transformers reads ["none"] as no sink too
            return []
        return value

    @field_validator("deepspeed", mode="before")
    @classmethod
    def _deepspeed_ref(cls, value):
        if isinstance(value, dict):
            raise ValueError("an inline DeepSpeed dict is not supported: use a preset (zero2, zero3) or write it to "
                             "a JSON file and give its path")
        if isinstance(value, str) and value not in DEEPSPEED_PRESETS and not value.startswith((".", "/", "~")):
            raise ValueError(f"{value!r} is neither a preset ({', '.join(DEEPSPEED_PRESETS)}) nor a path (paths "
                             "start with '.', '/' or '~', e.g. ./ds_zero2.json)")
        return value

    @model_validator(mode="after")
    def _rules(self) -> "_OwnedTrainingFields":
        violations = []
        if self.packing and not self.packing_drop_last:
            violations.append(RuleViolation(
                "packing_drop_last",
                "training.packing: true requires packing_drop_last: true (carry-only mode; the trainer runs "
                "no extra flush steps after the last step)",
                "Set training.packing_drop_last: true, or training.packing: false."))
        violations += self._batch_rules() + self._schedule_rules() + self._passthrough_rules()
        metric = getattr(self, "metric_for_best_model", None)
        if metric is not None and best_model_metric(metric) is None:
            violations.append(RuleViolation(
                "metric_for_best_model", f"training.metric_for_best_model {metric!r} is not a figure coordexp's "
                "training evaluation reports, so the first evaluation could not compare it",
                f"Use one of {', '.join(BEST_MODEL_METRICS)} (an eval_ prefix is optional), or remove it."))
        if getattr(self, "bf16", False) and getattr(self, "fp16", False):
            violations.append(RuleViolation("fp16", "bf16 and fp16 are both true", "Choose one mixed precision."))
        raise_violations(violations)
        return self

    def _batch_rules(self) -> list[RuleViolation]:
        out = []
        eff = self.effective_batch_size
        if eff is not None and self.gradient_accumulation_steps != 1:
            out.append(RuleViolation(
                "effective_batch_size", "effective_batch_size and gradient_accumulation_steps both set: the "
                "effective batch size resolves the accumulation steps from the world size at launch",
                "Keep one of them."))
        if eff is not None and eff % self.per_device_train_batch_size:
            out.append(RuleViolation(
                "effective_batch_size", f"effective_batch_size ({eff}) is not a multiple of "
                f"per_device_train_batch_size ({self.per_device_train_batch_size})",
                "Make it per_device_train_batch_size * world size * accumulation steps."))
        return out

    def _passthrough_rules(self) -> list[RuleViolation]:
        """Combinations of passed-through fields that TrainingArguments, the Trainer or torch's DataLoader refuse
        when training starts (tests/schema/test_training_passthrough.py checks each against the real ones)."""
        out = []
        if not self.dataloader_num_workers:
            for name, what in (("dataloader_prefetch_factor", "how many batches each worker prefetches"),
                               ("dataloader_persistent_workers", "whether workers outlive an epoch"),
                               ("dataloader_multiprocessing_context", "how workers start")):
                if getattr(self, name, None) not in (None, False):
                    out.append(RuleViolation(
                        name, f"{name} configures data-loading worker processes ({what}), but "
                        "dataloader_num_workers is 0: there are none (torch's DataLoader refuses the combination)",
                        f"Set training.dataloader_num_workers to 1 or more, or remove {name}."))
        if getattr(self, "save_strategy", None) == "best" and getattr(self, "metric_for_best_model", None) is None:
            out.append(RuleViolation(
                "save_strategy", "save_strategy: best saves when the best metric improves, but "
                "metric_for_best_model is not set", f"Set training.metric_for_best_model (one of "
                f"{', '.join(BEST_MODEL_METRICS[:3])}, ...), or use save_strategy: steps."))
        if getattr(self, "fp16_full_eval", False) and getattr(self, "bf16_full_eval", False):
            out.append(RuleViolation("fp16_full_eval", "fp16_full_eval and bf16_full_eval are both true",
                                     "Choose one precision for evaluation."))
        return out

    def _schedule_rules(self) -> list[RuleViolation]:
        out = []
        kwargs = self.lr_scheduler_kwargs
        if self.lr_scheduler_type == "cosine_with_min_lr" and kwargs is None:
            out.append(RuleViolation(
                "lr_scheduler_kwargs", "lr_scheduler_type: cosine_with_min_lr needs its floor",
                "Add lr_scheduler_kwargs: {min_lr: 1.0e-6} or {min_lr_rate: 0.1}."))
        if self.lr_scheduler_type != "cosine_with_min_lr" and kwargs is not None:
            out.append(RuleViolation(
                "lr_scheduler_kwargs", f"lr_scheduler_kwargs only applies to cosine_with_min_lr, not "
                f"{self.lr_scheduler_type}", "Remove it, or set lr_scheduler_type: cosine_with_min_lr."))
        if kwargs is not None and kwargs.min_lr is not None and kwargs.min_lr > self.learning_rate:
            out.append(RuleViolation(
                "lr_scheduler_kwargs.min_lr", f"min_lr ({kwargs.min_lr}) is above learning_rate "
                f"({self.learning_rate}): the floor must not exceed the peak", "Lower min_lr."))
        warmup = getattr(self, "warmup_steps", 0)
        if "warmup_steps" in self.model_fields_set and warmup and self.warmup_ratio:
            out.append(RuleViolation("warmup_steps", "warmup_steps and warmup_ratio both set",
                                     "Keep one of them."))
        return out


_AP_NAMES = ("AP", "AP50", "AP75", "AP_small", "AP_medium", "AP_large", "AR100")
TOKEN_METRICS: tuple[str, ...] = (
    "token_acc", "text_token_acc", "coord_token_acc", "token_loss", "text_token_loss", "coord_token_loss",
)
"""Teacher-forced figures of the validation split's ground-truth serialization (runtime/model/token_types.py):
full-vocabulary argmax accuracy and cross-entropy over all supervised tokens, text tokens and coord tokens."""
BEST_MODEL_METRICS: tuple[str, ...] = (
    *_AP_NAMES, *(f"segm_{name}" for name in _AP_NAMES),
    "match_rate", "parse_valid_rate", "parse_drop_rate", "truncation_rate", "eos_stop_rate", "fn_per_image",
    "fp_per_image", "valid_pred_per_image", *TOKEN_METRICS,
)
"""What ``metric_for_best_model`` may name: figures coordexp's training evaluation returns (as ``eval_<name>``, next
to the logged ``eval/<name>``): rollout AP and counters, and the teacher-forced token figures; ``segm_*`` need
polygon ground truth in the validation set. A name ending in ``loss`` defaults to ``greater_is_better: false``."""


def best_model_metric(name: str) -> str | None:
    """``name`` without an ``eval_`` / ``eval/`` prefix when evaluation reports it, else None."""
    for prefix in ("eval_", "eval/"):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name if name in BEST_MODEL_METRICS else None


def zero_stage(deepspeed: Optional[str]) -> Optional[int]:
    """The ZeRO stage of ``training.deepspeed``: 2 / 3 for the presets, a JSON file's ``zero_optimization.stage``
    as DeepSpeed reads it (``"3"`` and ``3.0`` are 3; absent is 0), read bounded; None when the file cannot be
    read or the stage is not one (:func:`deepspeed_violations` reports why)."""
    if deepspeed is None:
        return None
    if deepspeed in DEEPSPEED_PRESETS:
        return int(deepspeed.removeprefix("zero"))
    config, problems = load_violations(deepspeed)
    return _stage_of(config) if problems == [] else None


def _stage_of(config: object) -> Optional[int]:
    zero = config.get("zero_optimization", {}) if isinstance(config, dict) else None
    return deepspeed_stage(zero.get("stage", 0)) if isinstance(zero, dict) else None


def deepspeed_violations(training: "_OwnedTrainingFields", *, adapter: bool, rolls_out: bool,
                         colocate_offload: bool, model_dtype: str = "bfloat16") -> list[RuleViolation]:
    """DeepSpeed with what cannot be made correct under it (docs/design.md, decision 14): vLLM colocate's offload
    (it moves storage ZeRO owns), and ZeRO-3 with an adapter whose rollouts read merged weights (the merge copies
    adapted layers, which hold one rank's shard under ZeRO-3); a JSON file's content as transformers and DeepSpeed
    would refuse it at launch (``schema/deepspeed_file.py``)."""
    stage = zero_stage(training.deepspeed) if training.deepspeed in DEEPSPEED_PRESETS else None
    problems: list[RuleViolation] = []
    if training.deepspeed is not None:  # a preset's packaged JSON is checked as a file of the same content is
        preset = training.deepspeed in DEEPSPEED_PRESETS
        path = str(preset_json_path(training.deepspeed)) if preset else training.deepspeed
        config, read_problems = load_violations(path)  # read once, bounded
        problems = read_problems or []
        if read_problems == []:
            stage = _stage_of(config)
            problems = content_violations(config, training, model_dtype=model_dtype,
                                          shown=f"preset {training.deepspeed}" if preset else training.deepspeed[:300])
    out = []
    if training.deepspeed is not None and colocate_offload:
        out.append(RuleViolation(
            "rollout_matching.offload.enabled", "rollout_matching.offload moves the model's weights and optimizer "
            "state off the GPU around colocated rollouts, but under training.deepspeed ZeRO owns that storage",
            "Set rollout_matching.offload.enabled: false, and use DeepSpeed's own offload_optimizer / "
            "offload_param in a DeepSpeed JSON config (training.deepspeed: ./ds.json)."))
    if stage == 3 and adapter and rolls_out:
        out.append(RuleViolation(
            "training.deepspeed", "ZeRO-3 with tuner.train_type: lora is refused when the run rolls out (stage 2, "
            "or evaluation): rollouts read the adapter merged into copies of its layers, and under ZeRO-3 those "
            "layers hold only one rank's shard",
            "Use training.deepspeed: zero2 (an adapter's frozen base needs no partitioning), or tuner.train_type: "
            "full with zero3."))
    return problems + out


def evaluation_data_violations(training: "_OwnedTrainingFields", val_jsonl: Optional[str]) -> list[RuleViolation]:
    """``training.eval_strategy`` other than no without ``data.val_jsonl``: the Trainer refuses to start (it has no
    eval_dataset); ``save_strategy: best`` with no evaluation would never save; paths relative to the root."""
    strategy = getattr(training, "eval_strategy", "no")
    if "eval_strategy" in training.model_fields_set and strategy != "no" and val_jsonl is None:
        return [RuleViolation(
            "training.eval_strategy", f"training.eval_strategy: {strategy} evaluates during training, but "
            "data.val_jsonl is not set (there is nothing to evaluate)",
            "Set data.val_jsonl, or remove training.eval_strategy (evaluation runs when data.val_jsonl and "
            "training.eval_steps are set).")]
    if getattr(training, "save_strategy", None) == "best":
        evaluates = strategy != "no" if "eval_strategy" in training.model_fields_set else (
            training.eval_steps is not None)
        if val_jsonl is None or not evaluates:
            missing = "data.val_jsonl is not set" if val_jsonl is None else "training.eval_steps is not set"
            return [RuleViolation(
                "training.save_strategy", f"training.save_strategy: best saves a checkpoint when an evaluation "
                f"improves, but {missing}, so no evaluation runs and the run would write no checkpoint",
                "Set data.val_jsonl and training.eval_steps, or use save_strategy: steps.")]
    return []


_OWNED = set(_OwnedTrainingFields.model_fields)
HF_PASSTHROUGH: tuple[str, ...] = tuple(passthrough_fields(_OWNED))
"""The ``TrainingArguments`` fields passed to transformers unchanged (launch.training_arguments reads them)."""

TrainingConfig = create_model(  # type: ignore[call-overload]
    "TrainingConfig",
    __base__=_OwnedTrainingFields,
    __module__=__name__,
    __doc__="``training.*``: coordexp's own knobs plus every YAML-writable ``TrainingArguments`` field of the "
    "installed transformers (typed and bounded from its dataclass); refused fields fail with the reason.",
    **passthrough_fields(_OWNED),
    **refused_fields(_OWNED),
)
assert set(HF_TRAINING_FIELDS) <= set(TrainingConfig.model_fields)  # every HF field is owned, passed or refused
