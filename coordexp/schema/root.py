"""The top-level config (``CoordExpConfig``), its cross-section rules, and the non-fatal warnings."""

from __future__ import annotations

from pydantic import Field, model_validator

from coordexp.schema.base import MAX_TOKENS, StrictModel, int_in
from coordexp.schema.custom import CustomConfig
from coordexp.schema.data import DataConfig
from coordexp.schema.errors import ConfigIssue, RuleViolation, raise_violations
from coordexp.schema.model import ModelConfig
from coordexp.schema.rollout import RolloutMatchingConfig
from coordexp.schema.template import TemplateConfig
from coordexp.schema.training import TrainingConfig, deepspeed_violations, evaluation_data_violations, zero_stage
from coordexp.schema.tuner import TunerConfig

__all__ = ["CoordExpConfig", "config_warnings"]


class CoordExpConfig(StrictModel):
    """A whole run. Every key has exactly one owner here; the runtime reads the contract built from it."""

    global_max_length: int_in(16, MAX_TOKENS) = Field(
        description="Token cap of one encoded sample / packed row (packing_length unless template.max_length)."
    )
    model: ModelConfig
    template: TemplateConfig = Field(default_factory=TemplateConfig)
    data: DataConfig
    training: TrainingConfig
    tuner: TunerConfig = Field(default_factory=TunerConfig)
    custom: CustomConfig
    rollout_matching: RolloutMatchingConfig = Field(default_factory=RolloutMatchingConfig)

    @model_validator(mode="after")
    def _cross_section_rules(self) -> "CoordExpConfig":
        violations = []
        rm = self.rollout_matching
        if rm.pipeline is None:
            variant = self.custom.trainer_variant
            violations.append(
                RuleViolation(
                    "rollout_matching.pipeline",
                    f"rollout_matching.pipeline is required when custom.trainer_variant={variant} "
                    "(no implicit default objective manifest)",
                    "Add rollout_matching.pipeline.objective[] with token_ce and coord_reg entries (name, enabled, "
                    "weight, channels, config); see examples/base_stage2.yaml.",
                )
            )
        max_len = rm.vllm.max_model_len
        if rm.rollout_backend == "vllm" and max_len is not None and max_len < self.global_max_length:
            violations.append(
                RuleViolation(
                    "rollout_matching.vllm.max_model_len",
                    f"vllm.max_model_len ({max_len}) must be >= global_max_length ({self.global_max_length})",
                    "Raise rollout_matching.vllm.max_model_len, lower global_max_length, or remove max_model_len "
                    "to use global_max_length.",
                )
            )
        tmpl_len = self.template.max_length
        if tmpl_len is not None and tmpl_len > self.global_max_length:
            violations.append(
                RuleViolation(
                    "template.max_length",
                    f"template.max_length ({tmpl_len}) exceeds global_max_length ({self.global_max_length})",
                    "Lower template.max_length or raise global_max_length.",
                )
            )
        if rm.fn_placement != "append" and self.data.object_order == "random":
            violations.append(
                RuleViolation(
                    "rollout_matching.fn_placement",
                    f"fn_placement: {rm.fn_placement} places missed objects by reading order, but "
                    "data.object_order: random trains no reading order",
                    "Use data.object_order: keep or sorted, or fn_placement: append.",
                )
            )
        if (rm.objective == "reward" and rm.reward.kl_weight > 0 and self.training.deepspeed is not None
                and zero_stage(self.training.deepspeed) == 3):
            violations.append(RuleViolation(
                "rollout_matching.reward.kl_weight",
                f"kl_weight: {rm.reward.kl_weight} keeps a frozen whole copy of the starting model on every rank, "
                "which coordexp does not build under ZeRO-3 (its parameters are partitioned from loading on)",
                "Set rollout_matching.reward.kl_weight: 0 (reward.sft_weight or gt_step_share keep the policy near "
                "the SFT target), or use training.deepspeed: zero2 (the reference is then one whole copy per rank)."))
        if rm.objective == "reward" and self.training.packing:
            samples = self.training.per_device_train_batch_size * (rm.reward.group_size + rm.reward.include_greedy)
            if self.training.packing_buffer < 2 * samples:
                violations.append(RuleViolation(
                    "training.packing_buffer",
                    f"packing_buffer: {self.training.packing_buffer} cannot hold a reward step's rollouts: "
                    f"per_device_train_batch_size {self.training.per_device_train_batch_size} x (group_size "
                    f"{rm.reward.group_size}{' + the greedy member' if rm.reward.include_greedy else ''}) = {samples} "
                    "new segments a step, plus as many carried from the step before",
                    f"Set training.packing_buffer: {2 * samples} or more (or a smaller batch or group_size)."))
        violations += evaluation_data_violations(self.training, self.data.val_jsonl)
        violations += deepspeed_violations(
            self.training, adapter=self.tuner.train_type == "lora", colocate_offload=rm.offload.enabled and (
                rm.rollout_backend == "vllm" and rm.vllm.mode == "colocate"),
            rolls_out=self.custom.trainer_variant == "stage2_rollout_aligned" or self.data.val_jsonl is not None,
            model_dtype=self.model.dtype)
        raise_violations(violations)
        return self


STAGE2_ONLY_KEYS = ("gt_step_share", "fn_placement", "repeats", "repeat_unlikelihood", "trailing_unmatched",
                    "objective", "reward", "collapse_alarm", "overlap")
"""``rollout_matching`` keys only stage-2 training reads (the decoding, backend, length and matching keys drive
evaluation too, in any stage: the match rate is the stage-2 matcher's)."""


def config_warnings(cfg: CoordExpConfig) -> list[ConfigIssue]:
    """Settings that are legal but have no effect; ``validate`` prints them without failing."""
    warnings: list[ConfigIssue] = []
    rm = cfg.rollout_matching
    if cfg.custom.trainer_variant == "stage2_rollout_aligned" and rm.pipeline is not None:
        for field in ("objective", "diagnostics"):
            for i, module in enumerate(getattr(rm.pipeline, field)):
                if module.enabled and "B" not in module.channels:
                    warnings.append(
                        ConfigIssue(
                            f"rollout_matching.pipeline.{field}[{i}].channels",
                            f"module {module.name!r} has no channel B, so it is inert in stage2_rollout_aligned",
                            "Add 'B' to channels, or set enabled: false to make that explicit.",
                        )
                    )
    if cfg.custom.trainer_variant != "stage2_rollout_aligned":
        for key in STAGE2_ONLY_KEYS:
            if key in rm.model_fields_set:
                warnings.append(ConfigIssue(
                    f"rollout_matching.{key}",
                    f"{key} has no effect in {cfg.custom.trainer_variant}: it shapes stage 2's training on rollouts, "
                    "and stage 1 trains on ground truth only (evaluation reads only the decoding keys)",
                    f"Remove rollout_matching.{key}, or set custom.trainer_variant: stage2_rollout_aligned."))
    if rm.rollout_backend == "hf" and "vllm" in rm.model_fields_set:
        warnings.append(
            ConfigIssue(
                "rollout_matching.vllm",
                "vllm settings are ignored because rollout_backend is hf",
                "Remove rollout_matching.vllm, or set rollout_backend: vllm.",
            )
        )
    if rm.offload.enabled and not (rm.rollout_backend == "vllm" and rm.vllm.mode == "colocate"):
        warnings.append(
            ConfigIssue(
                "rollout_matching.offload.enabled",
                "offload only applies to vLLM colocate rollouts; it is a no-op with this backend",
                "Set offload.enabled: false, or use rollout_backend: vllm with vllm.mode: colocate.",
            )
        )
    if rm.rollout_backend == "vllm" and rm.vllm.mode == "colocate" and rm.vllm.server is not None:
        warnings.append(
            ConfigIssue(
                "rollout_matching.vllm.server",
                "vllm.server is ignored because vllm.mode is colocate",
                "Remove rollout_matching.vllm.server, or set vllm.mode: server.",
            )
        )
    return warnings
