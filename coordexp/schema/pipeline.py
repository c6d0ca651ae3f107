"""Loss pipeline modules (`rollout_matching.pipeline.*`, docs/design.md, decision 5): explicit, complete, no defaults.

Every entry authors ``name, enabled, weight, channels, config``; each ``config`` holds exactly its module's
allowlist (no defaults, so a missing key fails as well as an unknown one).
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from coordexp.schema.base import StrictModel, Weight, float_in

Channel = Literal["A", "B"]
NonNegFloat = Weight  # every loss weight: finite, in [0, MAX_WEIGHT]
MIN_TARGET_SIGMA = 1e-3
"""Smallest ``target_sigma`` (bins). The soft target is ``softmax(-(k - c)^2 / (2 sigma^2))`` in float32: below
about 3e-20 every bin's exponent overflows to -inf and the target (so the loss and every weight) turns NaN; at
1e-3 the target is already a one-hot, so nothing smaller is useful."""
Sigma = float_in(ge=MIN_TARGET_SIGMA, le=1000.0)  # a width on the 1000-bin coord axis


class TokenCeConfig(StrictModel):
    """Hard CE over the full vocabulary. Tail structure tokens and EOS always get weight 1."""

    rollout_fn_desc_weight: NonNegFloat = Field(
        description="CE weight on desc-value tokens of appended FN objects (0 = spec baseline, masked)."
    )
    rollout_matched_prefix_struct_weight: NonNegFloat = Field(
        description="CE weight on structure tokens of matched prefix objects (0 = spec baseline)."
    )


class CoordRegConfig(StrictModel):
    """Coordinate-distribution losses at every supervised coord position."""

    coord_ce_weight: NonNegFloat = Field(description="Hard CE on the coord sub-vocabulary.")
    soft_ce_weight: NonNegFloat = Field(description="Soft CE against the Gaussian target.")
    w1_weight: NonNegFloat = Field(description="1-D Wasserstein distance via CDFs, normalised by 999.")
    coord_gate_weight: NonNegFloat = Field(description="Penalty on full-vocab mass outside coord ids at coord slots.")
    text_gate_weight: NonNegFloat = Field(description="Penalty on coord-vocab mass at supervised text positions.")
    temperature: float_in(ge=1e-3, le=1e3) = Field(
        description="Softmax temperature for coord distributions and gates, in [1e-3, 1e3]."
    )
    target_sigma: Sigma = Field(description="Gaussian soft-target sigma, in bins [1e-3, 1000] (1e-3 is a one-hot; "
                                "smaller values make the target NaN in float32).")
    target_truncate: Optional[float_in(ge=0.0, le=1000.0)] = Field(
        description="Zero the target beyond this many bins from the centre; null keeps the full Gaussian."
    )


class BboxGeoConfig(StrictModel):
    """Opt-in geometry terms on the expected box (softmax-weighted mean over coord bins)."""

    smoothl1_weight: NonNegFloat = Field(description="SmoothL1 between expected and target box (norm1000/999).")
    ciou_weight: NonNegFloat = Field(description="1 - CIoU between expected and target box.")


class CoordDiagConfig(StrictModel):
    """Diagnostics only: coord-vocab mass, entropy, expected-bin error. Takes no keys."""


class _ModuleBase(StrictModel):
    enabled: bool
    weight: NonNegFloat
    channels: list[Channel] = Field(min_length=1, description="Non-empty subset of {A, B}; this trainer runs B.")

    @field_validator("channels")
    @classmethod
    def _unique_channels(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"channels must not repeat a channel (got {value}); use a subset of ['A', 'B']")
        return value

    @property
    def runs_on_rollout_channel(self) -> bool:
        """Whether this module contributes in the rollout channel ``B`` (what stage 2 trains)."""
        return self.enabled and "B" in self.channels


class TokenCeModule(_ModuleBase):
    name: Literal["token_ce"]
    config: TokenCeConfig


class CoordRegModule(_ModuleBase):
    name: Literal["coord_reg"]
    config: CoordRegConfig


class BboxGeoModule(_ModuleBase):
    name: Literal["bbox_geo"]
    config: BboxGeoConfig


class CoordDiagModule(_ModuleBase):
    name: Literal["coord_diag"]
    config: CoordDiagConfig


ObjectiveModule = Annotated[Union[TokenCeModule, CoordRegModule, BboxGeoModule], Field(discriminator="name")]
DiagnosticModule = Annotated[Union[CoordDiagModule], Field(discriminator="name")]


class PipelineConfig(StrictModel):
    """``rollout_matching.pipeline``: the objective and diagnostics manifests."""

    objective: list[ObjectiveModule] = Field(min_length=1)
    diagnostics: list[DiagnosticModule] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_names(self) -> "PipelineConfig":
        for field in ("objective", "diagnostics"):
            names = [m.name for m in getattr(self, field)]
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise ValueError(f"duplicate module name(s) in pipeline.{field}: {dupes}; list each module once")
        return self

    def module(self, name: str):
        """The enabled rollout-channel module called ``name``, or None."""
        for m in [*self.objective, *self.diagnostics]:
            if m.name == name and m.runs_on_rollout_channel:
                return m
        return None
