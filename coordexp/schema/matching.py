"""Matching and OT knobs (`rollout_matching.matching.*`, `rollout_matching.ot.*`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from coordexp.schema.base import StrictModel


class MatchingConfig(StrictModel):
    """Hungarian matching with AABB candidate reduction and maskIoU gating (docs/design.md, matching)."""

    candidate_top_k: int = Field(10, ge=1, description="GT candidates kept per prediction by AABB IoU.")
    maskiou_gate: float = Field(0.3, ge=0.0, le=1.0, description="Pairs with maskIoU below this are infeasible.")
    maskiou_resolution: int = Field(256, ge=8, le=2048, description="Side R of the R x R raster canvas.")
    fp_cost: float = Field(1.0, ge=0.0, description="Cost of assigning a prediction to the dummy GT (FP).")
    fn_cost: float = Field(1.0, ge=0.0, description="Cost of leaving a GT unmatched (FN, appended).")


class OtConfig(StrictModel):
    """Sinkhorn OT with barycentric projection for pairs involving a polygon."""

    cost: Literal["l1", "l2"] = Field("l2", description="Ground cost in norm1000 space.")
    epsilon: float = Field(10.0, gt=0.0, description="Entropic regularisation, in cost units.")
    iters: int = Field(30, ge=1, le=10_000, description="Sinkhorn iterations (log-domain).")
