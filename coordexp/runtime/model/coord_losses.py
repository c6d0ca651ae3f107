"""Coordinate-distribution loss math on gathered logit rows (no batching, no masks).

Every function takes rows ALREADY gathered at supervised positions (``(N, V)`` full-vocab or ``(N, 1000)``
coord-vocab logits), so callers never materialise a full-vocab softmax over a whole sequence;
:func:`gathered_row_stats` goes further and reduces the supervised rows of the raw logits, a chunk at a time,
to the per-row statistics the losses need (no ``(N, V)`` copy at all). All math runs in float32 after the
shared numeric fence :func:`sanitize_logits`; the coord-vocab gate of every consumer (training loss, text gate,
diagnostics) goes through :func:`coord_vocab_log_mass_fenced` (via :func:`coord_vocab_log_mass` or
:meth:`GatheredRowStats.log_mass`) so the fences cannot drift apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

__all__ = [
    "LOGIT_CLAMP_ABS",
    "NUM_COORD_BINS",
    "TEXT_GATE_MIN_NON_COORD_MASS",
    "sanitize_logits",
    "gather_fenced_rows",
    "GatheredRowStats",
    "gathered_row_stats",
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


# One float32 chunk of gathered rows holds about this many elements (16 MiB), whatever the vocabulary size.
_CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class GatheredRowStats:
    """What the objective needs from the fenced supervised rows, without keeping the ``(N, V)`` rows."""

    coord: torch.Tensor  # (N, 1000) fenced coord columns in bin order
    lse: Mapping[float, torch.Tensor]  # temperature -> (N,) logsumexp(fenced row / T) over the full vocabulary
    label_logit: torch.Tensor  # (L,) fenced logit of labels[i] in row i, for the first L rows

    def log_mass(self, rows: slice, temperature: float) -> torch.Tensor:
        """Shared-helper coord-vocab log mass of ``rows`` at ``temperature`` (one of the computed ones)."""
        return coord_vocab_log_mass_fenced(self.coord[rows], self.lse[temperature][rows], temperature)


def _consecutive_start(coord_ids: torch.Tensor) -> Optional[int]:
    """First id when ``coord_ids`` is a consecutive run (columns are then a narrow view), else None."""
    first = int(coord_ids[0])
    run = torch.arange(first, first + coord_ids.numel(), device=coord_ids.device)
    return first if bool((coord_ids == run).all()) else None


class _ChunkFencer:
    """Gathers rows of the flattened logits a chunk at a time into fenced buffers reused across chunks."""

    def __init__(self, logits: torch.Tensor, num: int, chunk_rows: int, dtype: torch.dtype, with_mask: bool):
        vocab, size = logits.shape[-1], min(chunk_rows, num)
        self.logits = logits
        try:
            self.flat: Optional[torch.Tensor] = logits.view(-1, vocab)
        except RuntimeError:  # strides that cannot be flattened: gather by (leading...) coordinates instead
            self.flat = None
        self.rows = torch.empty((size, vocab), dtype=dtype, device=logits.device)
        same = logits.dtype == dtype and self.flat is not None
        self.raw = self.rows if same else torch.empty((size, vocab), dtype=logits.dtype, device=logits.device)
        self.passed = torch.empty((size, vocab), dtype=torch.bool, device=logits.device) if with_mask else None

    def __call__(self, index: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Fenced ``dtype`` rows ``index`` (a view of the reused buffer) and, with a mask, where the fence passed."""
        count = index.numel()
        rows, raw = self.rows[:count], self.raw[:count]
        if self.flat is not None:
            torch.index_select(self.flat, 0, index, out=raw)
        else:
            raw.copy_(self.logits[torch.unravel_index(index, self.logits.shape[:-1])])
        passed = None
        if self.passed is not None:
            passed = torch.ge(raw, -LOGIT_CLAMP_ABS, out=self.passed[:count])
            passed.logical_and_(raw <= LOGIT_CLAMP_ABS)
        if raw is not rows:
            rows.copy_(raw)
        return _fence_(rows), passed


class _GatheredRowStats(torch.autograd.Function):
    """Fenced coord columns, label logits and full-vocab logsumexps of gathered rows, computed chunk by chunk.

    Forward never holds more than one chunk of full-vocab rows; it saves the index, the small outputs and a
    reference to the logits. Backward recomputes each chunk and adds every contribution into one gradient
    buffer shaped like the logits, zero wherever the fence changed an entry (as :func:`sanitize_logits`).
    """

    @staticmethod
    def forward(ctx, logits, index, coord_ids, labels, temperatures, chunk_rows, dtype):  # type: ignore[override]
        num, num_labels = index.numel(), labels.numel()
        first = _consecutive_start(coord_ids)
        coord = torch.empty((num, coord_ids.numel()), dtype=dtype, device=logits.device)
        label_logit = torch.empty(num_labels, dtype=dtype, device=logits.device)
        lses = [torch.empty(num, dtype=dtype, device=logits.device) for _ in temperatures]
        fenced_chunk = _ChunkFencer(logits, num, chunk_rows, dtype, with_mask=False)
        work_buffer = torch.empty_like(fenced_chunk.rows)
        for start in range(0, num, chunk_rows):
            stop = min(start + chunk_rows, num)
            rows, _ = fenced_chunk(index[start:stop])
            coord[start:stop] = rows.narrow(1, first, coord_ids.numel()) if first is not None else rows[:, coord_ids]
            if start < num_labels:
                own = labels[start : min(stop, num_labels)]
                label_logit[start : start + own.numel()] = rows[: own.numel()].gather(1, own.unsqueeze(1)).squeeze(1)
            work = work_buffer[: stop - start]
            for lse, temperature in zip(lses, temperatures, strict=True):
                # torch.logsumexp(rows / T) step by step in one reused buffer (same rounding, no temporaries)
                scaled = rows if temperature == 1.0 else torch.div(rows, temperature, out=work)
                peak = scaled.amax(dim=1, keepdim=True)
                torch.sub(scaled, peak, out=work)
                lse[start:stop] = work.exp_().sum(dim=1).log_() + peak.squeeze(1)
        ctx.temperatures, ctx.chunk_rows, ctx.dtype, ctx.first = temperatures, chunk_rows, dtype, first
        ctx.save_for_backward(logits, index, coord_ids, labels, *lses)
        ctx.set_materialize_grads(False)
        return (coord, label_logit, *lses)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_coord, grad_label, *grad_lses):  # type: ignore[override]
        logits, index, coord_ids, labels, *lses = ctx.saved_tensors
        grad_logits = torch.zeros(logits.shape, dtype=logits.dtype, device=logits.device)
        flat_grad = grad_logits.view(-1, logits.shape[-1])
        num, num_labels, first = index.numel(), labels.numel(), ctx.first
        lse_terms = [(t, lse, g) for t, lse, g in zip(ctx.temperatures, lses, grad_lses, strict=True) if g is not None]
        if grad_label is None:
            num_labels = 0
        fenced_chunk = _ChunkFencer(logits, num, ctx.chunk_rows, ctx.dtype, with_mask=True)
        grad_buffer, work_buffer = torch.empty_like(fenced_chunk.rows), torch.empty_like(fenced_chunk.rows)
        for start in range(0, num, ctx.chunk_rows):
            stop = min(start + ctx.chunk_rows, num)
            rows, passed = fenced_chunk(index[start:stop])
            grad_rows, work = grad_buffer[: stop - start].zero_(), work_buffer[: stop - start]
            for temperature, lse, grad_lse in lse_terms:
                # d logsumexp(x / T) / dx = softmax(x / T) / T, in the rounding order of autograd's own backward
                scaled = rows if temperature == 1.0 else torch.div(rows, temperature, out=work)
                torch.sub(scaled, lse[start:stop].unsqueeze(1), out=work).exp_()
                work.mul_(grad_lse[start:stop].unsqueeze(1).to(work.dtype))
                grad_rows.add_(work if temperature == 1.0 else work.div_(temperature))
            if grad_coord is not None:
                if first is not None:
                    grad_rows.narrow(1, first, coord_ids.numel()).add_(grad_coord[start:stop].to(grad_rows.dtype))
                else:
                    grad_rows.index_add_(1, coord_ids, grad_coord[start:stop].to(grad_rows.dtype))
            if start < num_labels:
                own = labels[start : min(stop, num_labels)]
                local = torch.arange(own.numel(), device=own.device)
                grad_rows.index_put_(
                    (local, own), grad_label[start : start + own.numel()].to(grad_rows.dtype), accumulate=True
                )
            grad_rows.mul_(passed)  # unconditional: testing passed.all() would sync a GPU once per chunk
            flat_grad.index_add_(0, index[start:stop], grad_rows.to(logits.dtype))
        return grad_logits, None, None, None, None, None, None


def gathered_row_stats(
    logits: torch.Tensor,
    index: torch.Tensor,
    coord_ids: torch.Tensor,
    temperatures: Sequence[float],
    labels: Optional[torch.Tensor] = None,
    *,
    chunk_rows: Optional[int] = None,
    compute_dtype: torch.dtype = torch.float32,
) -> GatheredRowStats:
    """Per-row statistics of the fenced rows ``index`` of ``logits.view(-1, V)``, never holding ``(N, V)`` at once.

    Values and gradients equal gathering the rows, :func:`sanitize_logits`, then :func:`coord_columns`,
    :func:`full_vocab_logsumexp` and a label ``gather``; backward adds into one logits-shaped gradient buffer.

    Args:
        logits: ``(..., V)`` logits (any float dtype); ``index`` addresses its flattened leading dimensions.
        index: ``(N,)`` LongTensor of rows; repeated rows accumulate their gradients.
        coord_ids: ``(1000,)`` LongTensor of the coord token ids in bin order.
        temperatures: softmax temperatures (> 0) whose full-vocab logsumexp is needed.
        labels: ``(L,)`` token ids whose fenced logit is returned for the first ``L`` rows (None: no labels).
        chunk_rows: rows fenced at a time (default: about 16 MiB of float32 per chunk).
        compute_dtype: float32 (the fence contract); float64 only for exact gradient checks.
    """
    if logits.ndim < 2:
        raise ValueError(f"logits must have a vocabulary dimension (..., V) (got shape {tuple(logits.shape)})")
    vocab = logits.shape[-1]
    check_coord_ids(coord_ids, vocab)
    temps = tuple(dict.fromkeys(float(t) for t in temperatures))
    for temperature in temps:
        _check_temperature(temperature)
    index = index.to(device=logits.device, dtype=torch.long)
    num_rows = logits.numel() // vocab if vocab else 0
    if index.ndim != 1 or (index.numel() and (int(index.min()) < 0 or int(index.max()) >= num_rows)):
        raise ValueError(
            f"index must be a 1-D LongTensor of row numbers in [0, {num_rows}) of the flattened logits "
            f"(got shape {tuple(index.shape)}); build it with SupervisionBatch"
        )
    labels = torch.zeros(0, dtype=torch.long, device=logits.device) if labels is None else labels.to(logits.device)
    if labels.ndim != 1 or labels.numel() > index.numel():
        raise ValueError(
            f"labels must be a 1-D tensor of at most one token id per row (got shape {tuple(labels.shape)} for "
            f"{index.numel()} rows); the ce rows come first in index"
        )
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= vocab):
        raise ValueError(
            f"ce label ids must lie in [0, {vocab}) (got range [{int(labels.min())}, {int(labels.max())}])"
        )
    if chunk_rows is None:
        chunk_rows = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1 (got {chunk_rows})")
    coord, label_logit, *lses = _GatheredRowStats.apply(
        logits, index, coord_ids.to(logits.device), labels.long(), temps, int(chunk_rows), compute_dtype
    )
    return GatheredRowStats(coord=coord, lse=dict(zip(temps, lses, strict=True)), label_logit=label_logit)


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
    rows = torch.arange(full_logits.shape[0], device=full_logits.device)
    # the chunked row statistics: the same fence and gradient as sanitising the rows, without a fenced copy
    return gathered_row_stats(full_logits, rows, coord_ids, (temperature,)).log_mass(slice(None), temperature)


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
