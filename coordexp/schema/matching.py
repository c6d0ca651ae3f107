"""Matching and OT knobs (`rollout_matching.matching.*`, `rollout_matching.ot.*`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from coordexp.schema.base import MAX_TOKENS, Probability, StrictModel, Weight, float_in, int_in


MIN_OT_EPSILON = 1e-6
"""Smallest Sinkhorn ``epsilon``: the kernel is ``cost / epsilon`` in float64 with costs up to ~2e6 (squared
norm1000 distances); a subnormal epsilon makes it inf and the OT targets NaN, 1e-6 keeps it below 1e13."""


class MatchingConfig(StrictModel):
    """Hungarian matching with AABB candidate reduction and maskIoU gating (docs/design.md, matching)."""

    candidate_top_k: int_in(1, MAX_TOKENS) = Field(10, description="GT candidates kept per prediction by AABB IoU.")
    maskiou_gate: Probability = Field(0.3, description="Pairs with maskIoU below this are infeasible.")
    maskiou_resolution: int_in(8, 2048) = Field(256, description="Side R of the R x R raster canvas.")
    fp_cost: Weight = Field(1.0, description="Cost of assigning a prediction to the dummy GT (FP).")
    fn_cost: Weight = Field(1.0, description="Cost of leaving a GT unmatched (FN, appended).")


class OtConfig(StrictModel):
    """Sinkhorn OT with barycentric projection for pairs involving a polygon."""

    cost: Literal["l1", "l2"] = Field("l2", description="Ground cost in norm1000 space.")
    epsilon: float_in(ge=MIN_OT_EPSILON, le=1e6) = Field(
        10.0, description="Entropic regularisation, in cost units, in [1e-6, 1e6] (cost / epsilon must stay finite).")
    iters: int_in(1, 10_000) = Field(30, description="Sinkhorn iterations (log-domain).")
