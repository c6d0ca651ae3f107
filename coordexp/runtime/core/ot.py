"""Self-context coord targets for matched pairs: Sinkhorn OT + barycentric projection only (docs/design.md, OT).

For a pair involving a polygon (poly<->poly, bbox<->poly, poly<->bbox) both shapes become point sets (a bbox is its
corners (x1,y1),(x2,y1),(x2,y2),(x1,y2)), an entropic OT plan ``T`` between uniform marginals is computed on an L1
or L2 (Euclidean distance) ground cost in norm1000 units, and each predicted point gets the barycentre
``g_hat_i = sum_j T_ij g_j / sum_j T_ij`` of the GT points. The plan is plain numpy: a stop-grad aligner.
bbox<->bbox pairs take the GT bins directly. Targets are continuous bins in [0, 999] (soft-target centres).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain

import numpy as np

from coordexp.runtime.core.objects import DetObject
from coordexp.schema.matching import OtConfig

__all__ = ["barycentric_targets", "ground_cost", "pair_coord_targets", "sinkhorn_plan"]

COORD_MAX = 999.0


def _check_args(epsilon: float, iters: int) -> None:
    if not (np.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"Sinkhorn epsilon must be a finite number > 0, got {epsilon!r} (rollout_matching.ot.epsilon).")
    if iters < 1:
        raise ValueError(f"Sinkhorn iters must be >= 1, got {iters!r} (rollout_matching.ot.iters).")


def ground_cost(a: np.ndarray, b: np.ndarray, cost: str) -> np.ndarray:
    """Pairwise ``(..., N, M)`` cost between points ``a (..., N, 2)`` and ``b (..., M, 2)``: ``l1`` or ``l2`` (Euclidean)."""
    if cost not in ("l1", "l2"):
        raise ValueError(f"unknown OT ground cost {cost!r}; expected 'l1' or 'l2' (rollout_matching.ot.cost).")
    dx = a[..., :, None, 0] - b[..., None, :, 0]  # per coordinate: no (..., N, M, 2) temporaries
    dy = a[..., :, None, 1] - b[..., None, :, 1]
    if cost == "l1":
        np.abs(dx, out=dx)
        dx += np.abs(dy)
        return dx
    dx *= dx
    dy *= dy
    dx += dy
    return np.sqrt(dx)


if hasattr(np, "vecmat"):  # numpy >= 2.2: the cheapest small batched vector-matrix product
    _vecmat = np.vecmat
else:  # pragma: no cover - older numpy
    def _vecmat(x: np.ndarray, m: np.ndarray, out: np.ndarray) -> np.ndarray:
        out[...] = np.matmul(x[..., None, :], m)[..., 0, :]
        return out


# Exp-domain scaling is the same iteration as log-domain (u = exp(f/eps), v = exp(g/eps)) and ~3x cheaper; it is
# exact in float64 while the kernel's dynamic range exp(range(C)/eps) stays far from under/overflow.
_EXP_DOMAIN_MAX_RANGE = 100.0


def _logsumexp0(x: np.ndarray) -> np.ndarray:
    """log-sum-exp over the leading axis (contiguous reductions, the fast direction for small point sets)."""
    peak = x.max(axis=0)
    np.subtract(x, peak, out=x)
    np.exp(x, out=x)
    return peak + np.log(x.sum(axis=0))


def _sinkhorn_log(
    scaled: np.ndarray, row_valid: np.ndarray, col_valid: np.ndarray, iters: int
) -> tuple[np.ndarray, np.ndarray]:
    """Log-domain Sinkhorn on a padded batch of ``cost / eps``; returns the plan and its row-normalised form.

    Padded rows and columns carry log-mass ``-inf`` so they never receive or send mass. The column update runs
    last, so column marginals hold exactly. Row normalisation cancels the row potential, so the normalised plan is
    a softmax of ``g_j - C_ij / eps`` and never underflows to 0/0.
    """
    batch, n, m = scaled.shape
    by_col = np.ascontiguousarray(scaled.transpose(2, 0, 1))  # (M, B, N): reduce over GT points j
    by_row = np.ascontiguousarray(scaled.transpose(1, 0, 2))  # (N, B, M): reduce over predicted points i
    log_a = np.where(row_valid, -np.log(row_valid.sum(axis=1, keepdims=True)), -np.inf)
    log_b = np.where(col_valid, -np.log(col_valid.sum(axis=1, keepdims=True)), -np.inf)
    f = np.zeros((batch, n))
    g = np.where(col_valid, 0.0, -np.inf)
    for _ in range(iters):
        f = log_a - _logsumexp0(g.T[:, :, None] - by_col)
        g = log_b - _logsumexp0(f.T[:, :, None] - by_row)
    logits = g[:, None, :] - scaled
    plan = np.exp(f[:, :, None] + logits)
    weights = np.exp(logits - logits.max(axis=2, keepdims=True))
    weights /= weights.sum(axis=2, keepdims=True)
    weights *= row_valid[:, :, None]
    return plan, weights


def _sinkhorn_exp(
    scaled: np.ndarray,
    row_valid: np.ndarray,
    col_valid: np.ndarray,
    iters: int,
    with_plan: bool = True,
    valid: np.ndarray | None = None,
    shift: np.ndarray | None = None,
) -> tuple[np.ndarray | None, np.ndarray]:
    """Exp-domain twin of :func:`_sinkhorn_log` for batches whose ``range(C) / eps`` is at most the safe range.

    ``valid`` (the real entries) and ``shift`` (their minimum per item, ``(B, 1, 1)``) when the caller has them.
    """
    if valid is None:
        valid = row_valid[:, :, None] & col_valid[:, None, :]
    # Padded entries get kernel 1 and marginal 0: their scalings come out exactly 0 and no denominator is 0.
    if shift is None:
        shift = np.where(valid, scaled, np.inf).min(axis=(1, 2), keepdims=True)
    kernel = np.where(valid, np.exp(-(scaled - shift)), 1.0)
    a = row_valid / row_valid.sum(axis=1, keepdims=True)
    b = col_valid / col_valid.sum(axis=1, keepdims=True)
    kernel_t = np.ascontiguousarray(kernel.transpose(0, 2, 1))
    u = np.zeros(a.shape)
    v = col_valid.astype(np.float64)
    for _ in range(iters):  # u = a / (K v), v = b / (K^T u), as row-vector products written in place
        np.divide(a, _vecmat(v, kernel_t, out=u), out=u)
        np.divide(b, _vecmat(u, kernel, out=v), out=v)
    scaled_rows = kernel * v[:, None, :] * row_valid[:, :, None]
    plan = u[:, :, None] * scaled_rows if with_plan else None
    row_sum = scaled_rows.sum(axis=2, keepdims=True)
    row_sum[row_sum == 0] = 1.0  # a padded row: all zeros, and stays so
    weights = np.divide(scaled_rows, row_sum, out=scaled_rows)
    return plan, weights


def _sinkhorn_batch(
    scaled: np.ndarray,
    n_rows: np.ndarray,
    n_cols: np.ndarray,
    iters: int,
    force_log: bool = False,
    with_plan: bool = True,
) -> tuple[np.ndarray | None, np.ndarray]:
    """Plans ``(B, N, M)`` (None unless ``with_plan``) and row-normalised plans for a padded batch (uniform
    marginals over the real points)."""
    batch, n, m = scaled.shape
    row_valid = np.arange(n)[None, :] < n_rows[:, None]
    col_valid = np.arange(m)[None, :] < n_cols[:, None]
    valid = row_valid[:, :, None] & col_valid[:, None, :]
    lowest = np.where(valid, scaled, np.inf).min(axis=(1, 2), keepdims=True)
    spread = np.where(valid, scaled, -np.inf).max(axis=(1, 2)) - lowest[:, 0, 0]
    fast = (spread <= _EXP_DOMAIN_MAX_RANGE) & (not force_log)
    if fast.all():  # the usual case: one solver for the whole batch, no gather/scatter
        return _sinkhorn_exp(scaled, row_valid, col_valid, iters, with_plan, valid, lowest)
    plan = np.zeros(scaled.shape) if with_plan else None
    weights = np.zeros(scaled.shape)
    for chosen, solver in ((fast, _sinkhorn_exp), (~fast, _sinkhorn_log)):
        if chosen.any():
            part_plan, weights[chosen] = solver(scaled[chosen], row_valid[chosen], col_valid[chosen], iters)
            if with_plan:
                plan[chosen] = part_plan
    return plan, weights


def sinkhorn_plan(cost: np.ndarray, epsilon: float, iters: int) -> np.ndarray:
    """Entropic OT plan ``(N, M)`` between uniform marginals for ``cost`` (the log-domain iteration).

    Stable for ``epsilon`` tiny relative to the costs (no ``exp`` of a large positive number is ever taken).
    Column sums are exactly ``1 / M``; row sums converge to ``1 / N`` with ``iters``.
    """
    _check_args(epsilon, iters)
    cost = np.asarray(cost, dtype=np.float64)
    if cost.ndim != 2 or 0 in cost.shape or not np.isfinite(cost).all():
        raise ValueError(f"Sinkhorn cost must be a finite, non-empty 2-D array; got shape {cost.shape}.")
    n, m = cost.shape
    plan, _ = _sinkhorn_batch(cost[None] / epsilon, np.array([n]), np.array([m]), iters, force_log=True)
    return plan[0]


def _flat_points(obj: DetObject, role: str) -> tuple[int, ...]:
    """Vertices as a flat ``x, y, ...`` tuple (a bbox as its 4 corners); malformed coordinate counts fail clearly."""
    c, n = obj.coords, len(obj.coords)
    if obj.geometry == "bbox_2d":
        if n != 4:
            raise ValueError(f"{role} bbox_2d {obj.desc!r} has {n} coords; expected exactly 4 (x1, y1, x2, y2).")
        return (c[0], c[1], c[2], c[1], c[2], c[3], c[0], c[3])
    if obj.geometry == "poly":
        if n < 6 or n % 2:
            raise ValueError(f"{role} poly {obj.desc!r} has {n} coords; expected an even count >= 6 (>= 3 vertices).")
        return c
    raise ValueError(f"{role} {obj.desc!r} has unknown geometry {obj.geometry!r}; expected 'bbox_2d' or 'poly'.")


def _padded(flat_sets: list[tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray]:
    """Point sets as one zero-padded ``(B, N_max, 2)`` array clamped to [0, 999], plus the point counts."""
    sizes = [len(f) for f in flat_sets]
    values = np.fromiter(chain.from_iterable(flat_sets), dtype=np.float64, count=sum(sizes))
    counts = np.array(sizes) // 2
    out = np.zeros((len(sizes), int(counts.max()) * 2))
    out[np.arange(out.shape[1]) < 2 * counts[:, None]] = values  # row-major: each set fills its row's front
    np.clip(out, 0.0, COORD_MAX, out=out)
    return out.reshape(len(sizes), -1, 2), counts


def pair_coord_targets(
    preds: Sequence[DetObject], gts: Sequence[DetObject], pairs: Iterable[tuple[int, int]], cfg: OtConfig
) -> dict[tuple[int, int], np.ndarray]:
    """Targets ``float (len(preds[pi].coords),)`` per matched pair, in the predicted object's coord-slot order.

    bbox<->bbox: the GT bins. Any pair involving a poly: barycentric projection, all such pairs in one padded
    Sinkhorn batch. A poly pred's slots take its projected vertices; a bbox pred takes the axis-aligned box of its
    4 projected corners (x1 = min x, y1 = min y, x2 = max x, y2 = max y), so a box matched to a polygon is pulled
    to that polygon's extent (a box onto a triangle gives the triangle's bounding box) and its slots stay ordered.
    All targets are clipped to [0, 999].
    """
    _check_args(cfg.epsilon, cfg.iters)
    targets: dict[tuple[int, int], np.ndarray] = {}
    ot_keys: list[tuple[int, int]] = []
    ot_box_pred: list[bool] = []
    pred_sets: list[tuple[int, ...]] = []
    gt_sets: list[tuple[int, ...]] = []
    box_keys: list[tuple[int, int]] = []
    box_coords: list[tuple[int, ...]] = []
    for pi, gi in pairs:
        pred, gt = preds[pi], gts[gi]
        pc, gc = pred.coords, gt.coords
        if pred.geometry == "bbox_2d" and gt.geometry == "bbox_2d" and len(pc) == 4 and len(gc) == 4:
            box_keys.append((pi, gi))
            box_coords.append(gc)
            continue
        # Raises for malformed shapes (two bboxes of 4 coords each took the branch above).
        pred_sets.append(_flat_points(pred, "predicted"))
        gt_sets.append(_flat_points(gt, "ground-truth"))
        ot_keys.append((pi, gi))
        ot_box_pred.append(pred.geometry == "bbox_2d")
    if box_keys:  # the GT bins, clamped; rows of one array (one conversion for all box pairs)
        boxes = np.fromiter(chain.from_iterable(box_coords), np.float64, 4 * len(box_coords)).reshape(-1, 4)
        np.minimum(np.maximum(boxes, 0.0, out=boxes), COORD_MAX, out=boxes)
        targets.update(zip(box_keys, boxes))
    if not ot_keys:
        return targets
    pred_pts, n_rows = _padded(pred_sets)
    gt_pts, n_cols = _padded(gt_sets)
    scaled = ground_cost(pred_pts, gt_pts, cfg.cost) / cfg.epsilon
    _, weights = _sinkhorn_batch(scaled, n_rows, n_cols, cfg.iters, with_plan=False)
    projected = np.clip(np.matmul(weights, gt_pts), 0.0, COORD_MAX)  # convex combinations: clip is a no-op guard
    corner_boxes = np.concatenate([projected[:, :4].min(axis=1), projected[:, :4].max(axis=1)], axis=1)
    flat = projected.reshape(len(ot_keys), -1)
    for b, (key, box_pred, n) in enumerate(zip(ot_keys, ot_box_pred, (2 * n_rows).tolist())):
        targets[key] = corner_boxes[b] if box_pred else flat[b, :n]
    return targets


def barycentric_targets(pred: DetObject, gt: DetObject, cfg: OtConfig) -> np.ndarray:
    """Coord targets ``float (len(pred.coords),)`` for one matched pair, in the predicted object's slot order."""
    return pair_coord_targets([pred], [gt], [(0, 0)], cfg)[(0, 0)]
