"""``tuner.*``: what trains. Full fine-tuning (the default) or a LoRA/DoRA adapter through PEFT, and which parts
of the model (language model, vision tower, aligner) are frozen. Names follow ms-swift's ``TunerArguments``."""

from __future__ import annotations

import re
from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from coordexp.schema.base import StrictModel, float_in, int_in
from coordexp.schema.errors import RuleViolation, raise_violations
from coordexp.schema.target_regex import TARGET_REGEX_HINT, target_regex_problem
from coordexp.schema.training import LearningRate, WeightDecay

__all__ = ["TunerConfig", "MAX_LORA_RANK"]

MAX_LORA_RANK = 1024
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")


class TunerConfig(StrictModel):
    """Full fine-tuning or a PEFT LoRA/DoRA adapter; the freeze switches name the three parts of a Qwen-VL model
    (docs/design.md, decision 12)."""

    train_type: Literal["full", "lora"] = Field(
        "full", description="full: train every unfrozen parameter; lora: train a PEFT LoRA (or DoRA) adapter.")
    use_dora: bool = Field(False, description="lora: weight-decomposed LoRA (DoRA) instead of plain LoRA.")
    lora_rank: int_in(1, MAX_LORA_RANK) = Field(8, description="lora: adapter rank r.")
    lora_alpha: float_in(gt=0.0, le=1e6) = Field(32.0, description="lora: scaling numerator (scale = alpha / r).")
    lora_dropout: float_in(ge=0.0, lt=1.0) = Field(
        0.05, description="lora: dropout on the adapter input. Unset: 0.05 for LoRA, 0 for DoRA (DoRA with dropout "
        "runs every adapted base layer twice per forward and backward).")
    adapter_dtype: Literal["float32", "model"] = Field(
        "float32", description="lora: dtype of the adapter weights. float32 (PEFT's default) keeps small updates, "
        "e.g. of DoRA's magnitudes, that bfloat16 rounds away; model (the model's dtype) saves a float32 copy of "
        "each adapted weight per forward.")
    lora_bias: Literal["none", "all", "lora_only"] = Field("none", description="lora: which biases train.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["all-linear"],
        description="lora: module names (suffixes) that get adapters; 'all-linear' means every Linear of the "
        "unfrozen parts (never lm_head).", max_length=256)
    target_regex: Optional[str] = Field(
        None, description="lora: a regex over full module names (re.fullmatch); overrides target_modules and the "
        "freeze switches' choice of targets.", max_length=4096)
    modules_to_save: list[str] = Field(
        default_factory=list, description="lora: modules trained in full and saved with the adapter.", max_length=256)
    freeze_llm: bool = Field(False, description="Freeze the language model (embeddings, blocks, lm_head).")
    freeze_vit: bool = Field(True, description="Freeze the vision tower (patch/position embeddings and blocks).")
    freeze_aligner: bool = Field(
        True, description="Freeze the aligner: the visual merger and, for Qwen3-VL, the DeepStack mergers.")
    train_coord_rows: bool = Field(
        True, description="lora: also train the 1000 coord-token rows of the input embeddings and of lm_head (PEFT "
        "trainable tokens, saved with the adapter; a checkpoint that ties lm_head to the embeddings trains one shared "
        "table). false: the coord rows stay as in the checkpoint. Off when freeze_llm is on.")
    coord_embed_lr: Optional[LearningRate] = Field(
        None, description="lora: peak rate of the input embeddings' coord rows (also lm_head's when the checkpoint "
        "ties them); null = training.learning_rate.")
    coord_head_lr: Optional[LearningRate] = Field(
        None, description="lora: peak rate of lm_head's coord rows (checkpoints with an untied lm_head); null = "
        "training.learning_rate.")
    coord_weight_decay: Optional[WeightDecay] = Field(
        None, description="lora: AdamW weight decay of the coord rows (it pulls the rows themselves towards 0, as "
        "full fine-tuning does); null = training.weight_decay.")

    @model_validator(mode="before")
    @classmethod
    def _dora_dropout_default(cls, data: Any) -> Any:
        """An unset ``lora_dropout`` is 0 under DoRA (runtime/model/adapter_speed.py says why)."""
        if isinstance(data, dict) and data.get("use_dora") is True and "lora_dropout" not in data:
            return {**data, "lora_dropout": 0.0}
        return data

    @field_validator("target_modules", mode="before")
    @classmethod
    def _all_linear_as_a_string(cls, value: Any) -> Any:
        """``target_modules: all-linear`` as ms-swift and PEFT users write it (PEFT's string form)."""
        return [value] if value == "all-linear" else value

    @field_validator("target_modules", "modules_to_save")
    @classmethod
    def _module_names(cls, names: list[str]) -> list[str]:
        bad = [n for n in names if not _MODULE_NAME.match(n) and n != "all-linear"]
        if bad:
            raise ValueError(f"{bad[:3]} are not module names (letters, digits, '_' and '.')")
        return names

    @field_validator("target_regex")
    @classmethod
    def _bounded_and_adaptable(cls, pattern: Optional[str]) -> Optional[str]:
        """Compiles within a bounded cost and matches no Qwen-VL module LoRA cannot adapt (schema/target_regex.py)."""
        problem = None if pattern is None else target_regex_problem(pattern)
        if problem is not None:
            raise ValueError(f"{problem}. {TARGET_REGEX_HINT}")
        return pattern

    @model_validator(mode="after")
    def _something_trains(self) -> "TunerConfig":
        violations = []
        if self.train_type == "full" and self.freeze_llm and self.freeze_vit and self.freeze_aligner:
            violations.append(RuleViolation(
                "freeze_llm", "every part is frozen (freeze_llm, freeze_vit and freeze_aligner): nothing would train",
                "Unfreeze at least one part, or use tuner.train_type: lora."))
        if self.train_type == "full" and (self.use_dora or self.target_regex is not None or self.modules_to_save):
            violations.append(RuleViolation(
                "train_type", "use_dora, target_regex and modules_to_save configure an adapter, but train_type is full",
                "Set tuner.train_type: lora, or remove the adapter settings."))
        violations += self._coord_row_violations()
        raise_violations(violations)
        return self

    @property
    def trains_coord_rows(self) -> bool:
        """Whether an adapter run also trains the coord rows (lora, train_coord_rows, language model not frozen)."""
        return self.train_type == "lora" and self.train_coord_rows and not self.freeze_llm

    def _coord_row_violations(self) -> list[RuleViolation]:
        rates = [k for k in ("coord_embed_lr", "coord_head_lr", "coord_weight_decay") if getattr(self, k) is not None]
        if rates and self.train_type == "full":
            return [RuleViolation(rates[0], f"{', '.join(rates)} set the adapter's coord-row rates, but train_type is "
                                  "full (the whole embedding and lm_head train at training.learning_rate)",
                                  "Set tuner.train_type: lora, or remove them.")]
        if rates and not self.train_coord_rows:
            return [RuleViolation(rates[0], f"{', '.join(rates)} set coord-row rates, but train_coord_rows is false",
                                  "Remove them, or set tuner.train_coord_rows: true.")]
        if rates and self.freeze_llm:
            return [RuleViolation(rates[0], f"{', '.join(rates)} set coord-row rates, but the coord rows belong to "
                                  "the language model, which freeze_llm freezes",
                                  "Set tuner.freeze_llm: false, or remove them.")]
        return []
