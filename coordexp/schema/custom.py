"""``custom.*``: which trainer runs and how objects are serialised."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from coordexp.schema.base import StrictModel

__all__ = ["CustomConfig", "TrainerVariant", "ObjectFieldOrder"]

TrainerVariant = Literal["stage1_sft", "stage2_rollout_aligned"]
ObjectFieldOrder = Literal["desc_first", "geometry_first"]


class CustomConfig(StrictModel):
    """Project-specific switches (docs/design.md, decision 2: stage 1 teacher-forced SFT, stage 2 rollout matching)."""

    trainer_variant: TrainerVariant = Field(
        description="stage1_sft: teacher-forced SFT on the ground truth; stage2_rollout_aligned: rollout matching."
    )
    object_field_order: ObjectFieldOrder = Field(
        "desc_first", description="Field order inside each serialised object: desc before or after the geometry."
    )
