"""Base model shared by every config section: strict scalars, unknown keys rejected, immutable."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A config section: YAML ``"1"`` is not an int and ``yes`` is not a bool; unknown keys fail; frozen."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, validate_default=True)
