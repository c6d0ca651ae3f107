"""``training.*``: the subset of Hugging Face ``TrainingArguments`` a run needs, plus post-rollout packing."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from coordexp.schema.base import StrictModel, path_extra
from coordexp.schema.errors import RuleViolation, raise_violations

__all__ = ["TrainingConfig"]


class TrainingConfig(StrictModel):
    """Optimiser, schedule, checkpointing and packing knobs (names follow ``transformers.TrainingArguments``)."""

    output_dir: str = Field(
        min_length=1, description="Checkpoints and logs go here.", json_schema_extra=path_extra()
    )
    per_device_train_batch_size: int = Field(1, ge=1, description="Raw samples per rank per micro-step.")
    per_device_eval_batch_size: int = Field(
        1, ge=1, description="Eval batch per rank; rollout decoding uses rollout_matching.decode_batch_size."
    )
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-steps per optimizer step.")
    max_steps: Optional[int] = Field(None, ge=1, description="Optimizer steps; null trains num_train_epochs.")
    num_train_epochs: float = Field(1.0, gt=0.0, description="Epochs when max_steps is null.")
    learning_rate: float = Field(1e-5, gt=0.0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0)
    max_grad_norm: float = Field(1.0, ge=0.0, description="Gradient clipping; 0 disables.")
    warmup_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Fraction of steps spent warming up.")
    lr_scheduler_type: Literal["constant", "constant_with_warmup", "linear", "cosine"] = Field("cosine")
    optim: Literal["adamw_torch", "adamw_torch_fused", "sgd"] = Field("adamw_torch")
    seed: int = Field(42, ge=0, description="Run seed: data order, init, and server-mode rollout seeds.")
    logging_steps: int = Field(10, ge=1, description="Log every N optimizer steps.")
    save_steps: int = Field(500, ge=1, description="Checkpoint every N optimizer steps.")
    save_total_limit: Optional[int] = Field(None, ge=1, description="Keep at most N checkpoints.")
    eval_steps: Optional[int] = Field(None, ge=1, description="Evaluate every N steps (needs data.val_jsonl).")
    dataloader_num_workers: int = Field(0, ge=0)
    report_to: Literal["none", "tensorboard", "wandb"] = Field("none", description="Metrics sink.")
    deepspeed: Optional[str] = Field(
        None, min_length=1, description="DeepSpeed JSON config path.", json_schema_extra=path_extra()
    )
    packing: bool = Field(False, description="Pack post-rollout Y_train segments into rows of packing_length.")
    packing_buffer: int = Field(512, ge=1, description="Cap on the rank-local carry buffer of segments.")
    packing_min_fill_ratio: float = Field(
        0.65, ge=0.0, le=1.0, description="Warn when a packed row is filled below this ratio (telemetry only)."
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
