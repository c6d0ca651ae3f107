"""``training.*``: the subset of Hugging Face ``TrainingArguments`` a run needs, plus post-rollout packing."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from coordexp.schema.base import (
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
from coordexp.schema.errors import RuleViolation, raise_violations

__all__ = ["TrainingConfig"]


class TrainingConfig(StrictModel):
    """Optimiser, schedule, checkpointing and packing knobs (names follow ``transformers.TrainingArguments``)."""

    output_dir: PathStr = Field(
        description="Checkpoints and logs go here.", json_schema_extra=path_extra()
    )
    per_device_train_batch_size: BatchSize = Field(1, description="Raw samples per rank per micro-step.")
    per_device_eval_batch_size: BatchSize = Field(
        1, description="Eval batch per rank; rollout decoding uses rollout_matching.decode_batch_size."
    )
    gradient_accumulation_steps: BatchSize = Field(1, description="Micro-steps per optimizer step.")
    max_steps: Optional[Count] = Field(None, description="Optimizer steps; null trains num_train_epochs.")
    num_train_epochs: float_in(gt=0.0, le=1e6) = Field(1.0, description="Epochs when max_steps is null (at most 1e6).")
    learning_rate: float_in(gt=0.0, le=10.0) = Field(1e-5, description="Peak learning rate, in (0, 10].")
    weight_decay: float_in(ge=0.0, le=10.0) = Field(0.0, description="AdamW weight decay, in [0, 10].")
    adam_beta1: float_in(ge=0.0, lt=1.0) = Field(0.9)
    adam_beta2: float_in(ge=0.0, lt=1.0) = Field(0.999)
    max_grad_norm: float_in(ge=0.0, le=1e6) = Field(1.0, description="Gradient clipping; 0 disables.")
    warmup_ratio: Probability = Field(0.0, description="Fraction of steps spent warming up.")
    lr_scheduler_type: Literal["constant", "constant_with_warmup", "linear", "cosine"] = Field("cosine")
    optim: Literal["adamw_torch", "adamw_torch_fused", "sgd"] = Field("adamw_torch")
    seed: Seed = Field(42, description="Run seed (0..2**32-1): data order, init, and rollout seeds.")
    logging_steps: Count = Field(10, description="Log every N optimizer steps.")
    save_steps: Count = Field(500, description="Checkpoint every N optimizer steps.")
    save_total_limit: Optional[Count] = Field(None, description="Keep at most N checkpoints.")
    eval_steps: Optional[Count] = Field(None, description="Evaluate every N steps (needs data.val_jsonl).")
    dataloader_num_workers: int_in(0, MAX_WORKERS) = Field(0)
    report_to: Literal["none", "tensorboard", "wandb"] = Field("none", description="Metrics sink.")
    deepspeed: Optional[PathStr] = Field(
        None, description="DeepSpeed JSON config path.", json_schema_extra=path_extra()
    )
    packing: bool = Field(False, description="Pack post-rollout Y_train segments into rows of packing_length.")
    packing_buffer: BatchSize = Field(512, description="Cap on the rank-local carry buffer of segments.")
    packing_min_fill_ratio: Probability = Field(
        0.65, description="Warn when a packed row is filled below this ratio (telemetry only)."
    )
    packing_drop_last: bool = Field(
        True, description="Carry-only mode: leftovers are dropped at the end (must be true with packing)."
    )

    @model_validator(mode="after")
    def _packing_rules(self) -> "TrainingConfig":
        violations = []
        if self.packing and not self.packing_drop_last:
            violations.append(
                RuleViolation(
                    "packing_drop_last",
                    "training.packing: true requires packing_drop_last: true (carry-only mode; the trainer runs "
                    "no extra flush steps after the last step)",
                    "Set training.packing_drop_last: true, or training.packing: false.",
                )
            )
        raise_violations(violations)
        return self
