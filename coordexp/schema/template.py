"""``template.*``: the chat prompt around each image and the image-resolution budget."""

from __future__ import annotations

from typing import Optional

from pydantic import Field, model_validator

from coordexp.schema.base import MAX_PIXELS, MAX_TOKENS, StrictModel, int_in
from coordexp.schema.errors import RuleViolation, raise_violations

__all__ = ["TemplateConfig", "DEFAULT_SYSTEM_PROMPT", "DEFAULT_USER_PROMPT"]

DEFAULT_SYSTEM_PROMPT = (
    "You are a visual detector. Answer with one JSON object mapping object_1..object_n to "
    '{"desc": <text>, "bbox_2d" or "poly": <coord tokens>}, coordinates normalised to 0..999.'
)
DEFAULT_USER_PROMPT = "Detect every object in the image."


class TemplateConfig(StrictModel):
    """Prompt text and processor limits; generation and teacher forcing use the same encoding."""

    system_prompt: str = Field(DEFAULT_SYSTEM_PROMPT, description="System message prepended to every sample.")
    user_prompt: str = Field(DEFAULT_USER_PROMPT, description="User text that follows the image.")
    max_pixels: int_in(28 * 28, MAX_PIXELS) = Field(
        1_003_520, description="Upper bound on resized image pixels (Qwen-VL processor)."
    )
    min_pixels: int_in(28 * 28, MAX_PIXELS) = Field(3_136, description="Lower bound on resized image pixels.")
    max_length: Optional[int_in(16, MAX_TOKENS)] = Field(
        None, description="Token cap per encoded sample; null means global_max_length."
    )

    @model_validator(mode="after")
    def _pixel_bounds(self) -> "TemplateConfig":
        violations = []
        if self.min_pixels > self.max_pixels:
            violations.append(
                RuleViolation(
                    "min_pixels",
                    f"min_pixels ({self.min_pixels}) is larger than max_pixels ({self.max_pixels})",
                    "Lower template.min_pixels or raise template.max_pixels.",
                )
            )
        raise_violations(violations)
        return self
