"""Coordinate-distribution loss math on gathered logit rows (no batching, no masks).

Every function takes rows ALREADY gathered at supervised positions (``(N, V)`` full-vocab or ``(N, 1000)``
coord-vocab logits), so callers never materialise a full-vocab softmax over a whole sequence. All math runs in
float32 after the shared numeric fence :func:`sanitize_logits`; the coord-vocab gate of every consumer (training
loss, text gate, diagnostics) goes through :func:`coord_vocab_log_mass` so the fences cannot drift apart.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = [
    "LOGIT_CLAMP_ABS",
    "NUM_COORD_BINS",
    "TEXT_GATE_MIN_NON_COORD_MASS",
    "sanitize_logits",
    "gather_fenced_rows",
    "check_coord_ids",
    "coord_vocab_log_mass",
    "coord_vocab_log_mass_fenced",
    "coord_columns",
    "full_vocab_logsumexp",
    "text_gate_from_log_mass",
    "coord_gate_loss",
    "text_gate_loss",
    "coord_log_probs",
    "gaussian_soft_targets",
    "soft_ce",
    "w1_distance",
    "coord_hard_ce",
    "expected_bins",
    "smoothl1_and_ciou",
]

NUM_COORD_BINS = 1000
LOGIT_CLAMP_ABS = 1.0e4
# -log(1 - p_coord) is capped at -log(1e-6) ~= 13.8 so an all-coord text position cannot produce inf.
TEXT_GATE_MIN_NON_COORD_MASS = 1.0e-6


def _fence_(values: torch.Tensor) -> torch.Tensor:
    """Apply the fence in place to a float32 tensor this module owns."""
    torch.nan_to_num_(values, nan=0.0, posinf=LOGIT_CLAMP_ABS, neginf=-LOGIT_CLAMP_ABS)
    return values.clamp_(-LOGIT_CLAMP_ABS, LOGIT_CLAMP_ABS)


def _passes_fence(values: torch.Tensor) -> torch.Tensor:
    """Bool mask of entries the fence leaves unchanged (NaN compares False); no float temporaries."""
    passed = values >= -LOGIT_CLAMP_ABS
    return passed.logical_and_(values <= LOGIT_CLAMP_ABS)


class _SanitizeLogits(torch.autograd.Function):
    """Fence as one autograd node: keeps a bool mask (or nothing when all entries pass) instead of float copies."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        passed = _passes_fence(logits)
        out = _fence_(logits.to(torch.float32, copy=True))
        ctx.input_dtype = logits.dtype
        ctx.all_passed = bool(passed.all())
        ctx.save_for_backward(None if ctx.all_passed else passed)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (passed,) = ctx.saved_tensors
        if not ctx.all_passed:
            grad = grad * passed
        return grad.to(ctx.input_dtype)


class _GatherFencedRows(torch.autograd.Function):
    """``sanitize_logits(flat.index_select(0, index))`` fused: one float32 copy of the gathered rows only."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        gathered = flat.index_select(0, index)  # a fresh tensor: fencing it in place touches nothing shared
        passed = _passes_fence(gathered)
        out = _fence_(gathered.float())
        del gathered
        ctx.flat_shape, ctx.input_dtype = flat.shape, flat.dtype
        ctx.all_passed = bool(passed.all())
        ctx.save_for_backward(index, None if ctx.all_passed else passed)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        index, passed = ctx.saved_tensors
        if not ctx.all_passed:
            grad = grad * passed
        grad_flat = grad.new_zeros(ctx.flat_shape, dtype=ctx.input_dtype)
        return grad_flat.index_add_(0, index, grad.to(ctx.input_dtype)), None


def gather_fenced_rows(flat_logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of ``(M, V)`` logits, fenced like :func:`sanitize_logits` (float32), without an extra copy."""
    return _GatherFencedRows.apply(flat_logits, index)


def sanitize_logits(logits: torch.Tensor) -> torch.Tensor:
    """The one numeric fence: float32, NaN -> 0, +/-inf and anything beyond +/-1e4 clamped to +/-1e4.

    Gradients flow unchanged through finite in-range entries and are zero at sanitised entries.
    """
    return _SanitizeLogits.apply(logits)


def _check_temperature(temperature: float) -> None:
    if not (temperature > 0.0 and math.isfinite(temperature)):
        raise ValueError(
            f"temperature must be a finite number > 0 (got {temperature}); fix coord_reg.config.temperature"
        )


def check_coord_ids(coord_ids: torch.Tensor, vocab_size: int) -> None:
    """Fail clearly unless ``coord_ids`` is the 1000-id LongTensor of a vocabulary of ``vocab_size`` ids."""
    if coord_ids.ndim != 1 or coord_ids.numel() != NUM_COORD_BINS or coord_ids.dtype != torch.long:
        raise ValueError(
            f"coord_ids must be a 1-D LongTensor of the {NUM_COORD_BINS} ids of <|coord_0|>..<|coord_999|> "
            f"in bin order (got shape {tuple(coord_ids.shape)}, dtype {coord_ids.dtype}); build it from CoordVocab"
        )
    if coord_ids.numel() and (int(coord_ids.min()) < 0 or int(coord_ids.max()) >= vocab_size):
        raise ValueError(
            f"coord_ids must lie in [0, {vocab_size}) for logits with vocab size {vocab_size} "
            f"(got range [{int(coord_ids.min())}, {int(coord_ids.max())}]); the model's vocabulary lacks the coord "
            "tokens"
        )


def coord_columns(rows: torch.Tensor, coord_ids: torch.Tensor) -> torch.Tensor:
    """The ``(N, 1000)`` coord columns of ``(N, V)`` rows in bin order (a narrow view when the ids are consecutive)."""
    coord_ids = coord_ids.to(rows.device)
    first = int(coord_ids[0])
    if bool((coord_ids == torch.arange(first, first + coord_ids.numel(), device=rows.device)).all()):
        return rows.narrow(1, first, coord_ids.numel())
    return rows.index_select(1, coord_ids)


def full_vocab_logsumexp(fenced_full: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logsumexp(rows / T)`` per row of fenced full-vocab rows (no scaled copy at ``T == 1``)."""
    _check_temperature(temperature)
    return torch.logsumexp(fenced_full if temperature == 1.0 else fenced_full / temperature, dim=1)


def coord_vocab_log_mass(full_logits: torch.Tensor, coord_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log of the full-vocab softmax mass on the coord ids, per row: ``lse(coord/T) - lse(all/T)`` (<= 0).

    The entry point for every consumer holding raw logits (training, metrics, rollout paths).

    Args:
        full_logits: ``(N, V)`` full-vocabulary logit rows (any float dtype; sanitised here).
        coord_ids: ``(1000,)`` LongTensor of the coord token ids.
        temperature: softmax temperature (> 0).
    """
    if full_logits.ndim != 2:
        raise ValueError(f"full_logits must be 2-D (N, V) gathered rows (got shape {tuple(full_logits.shape)})")
    check_coord_ids(coord_ids, full_logits.shape[1])
    fenced = sanitize_logits(full_logits)
    return coord_vocab_log_mass_fenced(
        coord_columns(fenced, coord_ids), full_vocab_logsumexp(fenced, temperature), temperature
    )


def coord_vocab_log_mass_fenced(
    fenced_coord: torch.Tensor, full_lse: torch.Tensor, temperature: float
) -> torch.Tensor:
    """The gate math behind :func:`coord_vocab_log_mass`, for callers that fenced their rows once themselves:
    ``fenced_coord`` = the coord columns of the fenced rows, ``full_lse`` = :func:`full_vocab_logsumexp` of them.
    """
    _check_temperature(temperature)
    coord_lse = torch.logsumexp(fenced_coord if temperature == 1.0 else fenced_coord / temperature, dim=1)
    return (coord_lse - full_lse).clamp(max=0.0)


def coord_gate_loss(full_logits: torch.Tensor, coord_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per-row mass-leak penalty at coord positions: ``-log(coord-vocab mass)`` (0 when all mass is on coords)."""
    return -coord_vocab_log_mass(full_logits, coord_ids, temperature)


def text_gate_from_log_mass(log_mass: torch.Tensor) -> torch.Tensor:
    """``-log(1 - exp(log_mass))`` per row, capped at ``-log(1e-6)`` so an all-coord text row stays finite."""
    log_mass = log_mass.clamp(max=math.log1p(-TEXT_GATE_MIN_NON_COORD_MASS))
    # log(1 - e^x) computed stably on both sides of x = -ln 2; both branches are finite on the clamped domain.
    log_non_coord = torch.where(
        log_mass > -math.log(2.0),
        torch.log(-torch.expm1(log_mass)),
        torch.log1p(-torch.exp(log_mass)),
    )
    return -log_non_coord


def text_gate_loss(full_logits: torch.Tensor, coord_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per-row penalty at supervised text positions: ``-log(1 - coord-vocab mass)``, capped at ``-log(1e-6)``.

    FP-neutral: it only pushes coord mass away from positions whose label is text; ~0 when no coord mass.
    """
    return text_gate_from_log_mass(coord_vocab_log_mass(full_logits, coord_ids, temperature))


def coord_log_probs(coord_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(sanitised coord logits / T)`` over the 1000 coord bins of each row."""
    _check_temperature(temperature)
    if coord_logits.ndim != 2 or coord_logits.shape[1] != NUM_COORD_BINS:
        raise ValueError(
            f"coord_logits must have shape (N, {NUM_COORD_BINS}) (got {tuple(coord_logits.shape)}); "
            "slice the full-vocab rows with coord_ids first"
        )
    return torch.log_softmax(sanitize_logits(coord_logits) / temperature, dim=1)


def gaussian_soft_targets(
    centres: torch.Tensor, sigma: float, truncate: Optional[float], num_bins: int = NUM_COORD_BINS
) -> torch.Tensor:
    """Unimodal soft targets ``q[n, k] ~ exp(-(k - c_n)^2 / (2 sigma^2))``, normalised per row.

    Args:
        centres: ``(N,)`` continuous target bins; clamped to ``[0, num_bins - 1]``.
        sigma: width in bins (> 0).
        truncate: zero every bin with ``|k - c| > truncate`` (None keeps the full Gaussian); the nearest bin
            is always kept, so ``truncate=0`` with an integer centre is a one-hot.
        num_bins: number of coord bins.
    """
    if not (sigma > 0.0 and math.isfinite(sigma)):
        raise ValueError(
            f"target_sigma must be a finite number > 0 bins (got {sigma}); fix coord_reg.config.target_sigma"
        )
    if truncate is not None and not truncate >= 0.0:
        raise ValueError(
            f"target_truncate must be >= 0 or null (got {truncate}); fix coord_reg.config.target_truncate"
        )
    if centres.ndim != 1:
        raise ValueError(f"centres must be a 1-D tensor of target bins (got shape {tuple(centres.shape)})")
    c = torch.nan_to_num(centres.float(), nan=0.0).clamp(0.0, float(num_bins - 1)).unsqueeze(1)
    k = torch.arange(num_bins, dtype=torch.float32, device=centres.device).unsqueeze(0)
    dist = k - c
    log_w = -0.5 * (dist / sigma) ** 2
    if truncate is not None:
        nearest = dist.abs() == dist.abs().min(dim=1, keepdim=True).values
        log_w = log_w.masked_fill((dist.abs() > truncate) & ~nearest, float("-inf"))
    # Normalising in log space keeps a tiny sigma from underflowing to an all-zero row.
    return torch.softmax(log_w, dim=1)


def soft_ce(log_p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Per-row soft cross-entropy ``-sum_k q_k log p_k`` (``log_p`` from :func:`coord_log_probs`)."""
    return -(q * log_p).sum(dim=1)


def w1_distance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Per-row 1-D Wasserstein distance in units of the full range: ``sum_k |CDF_p(k) - CDF_q(k)| / (K - 1)``."""
    num_bins = p.shape[1]
    return (torch.cumsum(p, dim=1) - torch.cumsum(q, dim=1)).abs().sum(dim=1) / float(num_bins - 1)


def coord_hard_ce(log_p: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-row hard CE on the coord sub-vocabulary with target bin ``round(target)`` (clamped to 0..999)."""
    bins = torch.round(targets.float()).clamp(0, log_p.shape[1] - 1).long()
    return -log_p.gather(1, bins.unsqueeze(1)).squeeze(1)


def expected_bins(p: torch.Tensor) -> torch.Tensor:
    """Per-row expected bin ``sum_k p_k * k`` (float bins, 0..999)."""
    k = torch.arange(p.shape[1], dtype=p.dtype, device=p.device)
    return p @ k


def smoothl1_and_ciou(
    pred: torch.Tensor, target: torch.Tensor, eps: float = 1.0e-7
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean SmoothL1 (beta 1, per coordinate) and mean ``1 - CIoU`` of ``(K, 4)`` xyxy boxes in [0, 1] units.

    SmoothL1 compares the raw coordinates; CIoU canonicalises each box to (min, max) corners first, so an
    expected box with crossed corners still gets a meaningful overlap gradient. Degenerate boxes (zero width
    or height, allowed by the data) are kept finite by ``eps``.
    """
    if pred.numel() == 0:
        zero = pred.sum() * 0.0
        return zero, zero
    smoothl1 = F.smooth_l1_loss(pred, target, reduction="mean", beta=1.0)

    def canonical(box: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x1, y1, x2, y2 = box.unbind(dim=1)
        return torch.minimum(x1, x2), torch.minimum(y1, y2), torch.maximum(x1, x2), torch.maximum(y1, y2)

    px1, py1, px2, py2 = canonical(pred)
    gx1, gy1, gx2, gy2 = canonical(target)
    pw, ph, gw, gh = px2 - px1, py2 - py1, gx2 - gx1, gy2 - gy1
    inter = (torch.minimum(px2, gx2) - torch.maximum(px1, gx1)).clamp(min=0.0) * (
        torch.minimum(py2, gy2) - torch.maximum(py1, gy1)
    ).clamp(min=0.0)
    union = pw * ph + gw * gh - inter
    iou = inter / (union + eps)
    centre_dist2 = ((px1 + px2) - (gx1 + gx2)) ** 2 / 4.0 + ((py1 + py2) - (gy1 + gy2)) ** 2 / 4.0
    diag2 = (torch.maximum(px2, gx2) - torch.minimum(px1, gx1)) ** 2 + (
        torch.maximum(py2, gy2) - torch.minimum(py1, gy1)
    ) ** 2
    v = (4.0 / math.pi**2) * (torch.atan(gw / (gh + eps)) - torch.atan(pw / (ph + eps))) ** 2
    with torch.no_grad():
        alpha = v / (1.0 - iou + v + eps)
    ciou = iou - centre_dist2 / (diag2 + eps) - alpha * v
    return smoothl1, (1.0 - ciou).mean()
