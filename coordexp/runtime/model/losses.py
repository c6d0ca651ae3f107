"""The rollout-channel objective: ``token_ce``, ``coord_reg``, ``bbox_geo`` and the ``coord_diag`` diagnostics.

Normalisation (docs/design.md, decision 8: a packed row's loss is its segments' unpacked loss): every term is a mean
over the supervised positions (or boxes) of the whole micro-batch, pooled across segments and rows. No term
depends on where a segment sits in a row, on padding, or on how segments are grouped into rows, so laying out
the same segments packed or unpacked yields the same loss and the same gradient on each supervised logit.

Every term reads only per-row statistics of the logit rows at supervised positions (coord columns, full-vocab
logsumexps, label logits from :func:`gathered_row_stats`, computed a chunk of rows at a time), never a
full-vocab log-softmax over the whole sequence nor a copy of the supervised rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Mapping, NamedTuple, Sequence

import numpy as np
import torch

from coordexp.runtime.model.coord_losses import (
    NUM_COORD_BINS,
    GatheredRowStats,
    check_coord_ids,
    coord_hard_ce,
    coord_log_probs,
    expected_bins,
    gathered_row_stats,
    gaussian_soft_targets,
    smoothl1_and_ciou,
    soft_ce,
    text_gate_from_log_mass,
    w1_distance,
)
from coordexp.runtime.core.objects import TokenSupervision
from coordexp.runtime.model.repeat_loss import repeat_unlikelihood
from coordexp.schema.pipeline import BboxGeoConfig, CoordRegConfig, PipelineConfig
from coordexp.schema.rollout import RepeatUnlikelihoodConfig

__all__ = ["SupervisionSegment", "SupervisionBatch", "LossDenominators", "ObjectiveResult", "compute_objective"]

_MAX_BIN = float(NUM_COORD_BINS - 1)


class SupervisionSegment(NamedTuple):
    """One sample's supervision placed in a forward row; ``assistant_start`` is the absolute position of its first
    assistant token in row ``row`` (prompt tokens come before it)."""

    supervision: TokenSupervision
    assistant_ids: Sequence[int]
    row: int
    assistant_start: int


def _as_index_array(values: object, name: str, where: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.size == 0:
        return arr.astype(np.int64).reshape(arr.shape if arr.ndim else (0,))
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{where}: {name} must hold integers (got dtype {arr.dtype})")
    return arr.astype(np.int64)


def _check_positions(positions: np.ndarray, name: str, n_assistant: int, where: str) -> None:
    if positions.ndim != 1:
        raise ValueError(f"{where}: {name} must be 1-D (got shape {positions.shape})")
    if positions.size and (positions.min() < 0 or positions.max() >= n_assistant):
        bad = positions[(positions < 0) | (positions >= n_assistant)]
        raise ValueError(
            f"{where}: {name} {bad[:5].tolist()} fall outside the assistant span [0, {n_assistant}); "
            "supervision must index the assistant ids of its own Y_train"
        )
    if np.unique(positions).size != positions.size:
        raise ValueError(f"{where}: {name} repeats a position; each token is supervised at most once")


def _checked_values(
    sup: TokenSupervision, n_ce: int, n_coord: int, where: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CE weights, coord targets and bbox slots of one segment, validated against the position counts."""
    ce_w = np.asarray(sup.ce_weights, dtype=np.float32).reshape(-1)
    if ce_w.size != n_ce or not np.all(np.isfinite(ce_w)) or (ce_w.size and ce_w.min() <= 0):
        raise ValueError(
            f"{where}: ce_weights must be finite, > 0 and one per ce position (got {ce_w.size} weights for "
            f"{n_ce} positions); leave a zero-weight token out of ce_positions instead"
        )
    targets = np.asarray(sup.coord_targets, dtype=np.float32).reshape(-1)
    if targets.size != n_coord or not np.all(np.isfinite(targets)):
        raise ValueError(
            f"{where}: coord_targets must be finite, one per coord position ({targets.size} vs {n_coord})"
        )
    if targets.size and (targets.min() < 0.0 or targets.max() > _MAX_BIN):
        raise ValueError(
            f"{where}: coord_targets must lie in [0, 999] norm1000 bins (got [{targets.min()}, {targets.max()}])"
        )
    slots = _as_index_array(sup.bbox_slots, "bbox_slots", where)
    if slots.size == 0:
        slots = np.zeros((0, 4), dtype=np.int64)
    if slots.ndim != 2 or slots.shape[1] != 4:
        raise ValueError(f"{where}: bbox_slots must have shape (K, 4) (got {slots.shape})")
    if slots.size and (slots.min() < 0 or slots.max() >= n_coord):
        raise ValueError(
            f"{where}: bbox_slots must index coord_positions [0, {n_coord}) (got range [{slots.min()}, {slots.max()}])"
        )
    return ce_w, targets, slots


def _checked_negatives(sup: TokenSupervision, n_assistant: int, where: str) -> tuple[np.ndarray, ...]:
    """(positions, tokens, bins, exclude) of the unlikelihood negatives, one per position and token."""
    arrays = [_as_index_array(getattr(sup, f"ul_{name}"), f"ul_{name}", where).reshape(-1)
              for name in ("positions", "tokens", "bins", "exclude")]
    positions, tokens, bins, exclude = arrays
    if len({a.size for a in arrays}) != 1:
        raise ValueError(f"{where}: ul_positions, ul_tokens, ul_bins and ul_exclude need one entry each per negative")
    if positions.size and (positions.min() < 0 or positions.max() >= n_assistant):
        raise ValueError(f"{where}: ul_positions fall outside the assistant span [0, {n_assistant})")
    if tokens.size and tokens.min() < 0:
        raise ValueError(f"{where}: ul_tokens must be token ids (>= 0)")
    for name, values in (("ul_bins", bins), ("ul_exclude", exclude)):
        if values.size and (values.min() < -1 or values.max() > _MAX_BIN):
            raise ValueError(f"{where}: {name} must be coord bins in [0, 999] or -1")
    return positions, tokens, bins, exclude


def _checked_policy_tokens(sup: TokenSupervision, n_assistant: int, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(positions, advantages) of the policy-gradient tokens: distinct positions in the span, finite advantages."""
    positions = _as_index_array(sup.pg_positions, "pg_positions", where).reshape(-1)
    _check_positions(positions, "pg_positions", n_assistant, where)
    advantages = np.asarray(sup.pg_advantages, dtype=np.float32).reshape(-1)
    if advantages.size != positions.size or not np.all(np.isfinite(advantages)):
        raise ValueError(f"{where}: pg_advantages must be finite, one per pg position ({advantages.size} vs "
                         f"{positions.size})")
    return positions, advantages


def _segment_arrays(segment: SupervisionSegment, seq_len: int, where: str) -> dict[str, np.ndarray]:
    """Validate one segment and return its absolute label positions, labels, weights, targets and slots."""
    sup, row, start = segment.supervision, int(segment.row), int(segment.assistant_start)
    ids = _as_index_array(segment.assistant_ids, "assistant_ids", where)
    n = int(ids.size)
    if row < 0:
        raise ValueError(f"{where}: row must be >= 0 (got {row})")
    if start < 0 or start + n > seq_len:
        raise ValueError(
            f"{where}: assistant span [{start}, {start + n}) does not fit a row of seq_len={seq_len}; "
            "the packed/padded row is shorter than the segments placed in it"
        )
    ce_pos = _as_index_array(sup.ce_positions, "ce_positions", where)
    coord_pos = _as_index_array(sup.coord_positions, "coord_positions", where)
    _check_positions(ce_pos, "ce_positions", n, where)
    _check_positions(coord_pos, "coord_positions", n, where)
    overlap = np.intersect1d(ce_pos, coord_pos)
    if overlap.size:
        raise ValueError(
            f"{where}: positions {overlap[:5].tolist()} are in both ce_positions and coord_positions; coord tokens "
            "are supervised only by coord_reg/bbox_geo (fix the target builder)"
        )
    ce_w, targets, slots = _checked_values(sup, ce_pos.size, coord_pos.size, where)
    ul = _checked_negatives(sup, n, where)
    pg_pos, pg_adv = _checked_policy_tokens(sup, n, where)
    abs_ce, abs_coord = start + ce_pos, start + coord_pos
    if any(a.size and a.min() == 0 for a in (abs_ce, abs_coord, start + ul[0], start + pg_pos)):
        raise ValueError(
            f"{where}: a label sits at absolute position 0 of row {row}, where no logit predicts it; the assistant "
            "span must start after the prompt (assistant_start >= 1)"
        )
    base = row * seq_len - 1
    return {
        "ce_index": base + abs_ce,
        "ce_labels": ids[ce_pos] if ce_pos.size else np.zeros(0, dtype=np.int64),
        "ce_weights": ce_w,
        "coord_index": base + abs_coord,
        "coord_targets": targets,
        "bbox_slots": slots,
        "span": np.array([row, start, start + n], dtype=np.int64),
        "ul_index": base + start + ul[0],
        "ul_tokens": ul[1],
        "ul_bins": ul[2],
        "ul_exclude": ul[3],
        "pg_index": base + start + pg_pos,
        "pg_labels": ids[pg_pos] if pg_pos.size else np.zeros(0, dtype=np.int64),
        "pg_advantages": pg_adv,
    }


@dataclass(frozen=True)
class SupervisionBatch:
    """Supervision of one forward micro-batch in FLATTENED LOGIT coordinates.

    The logit predicting the label at absolute position ``p`` of row ``r`` is row ``r * seq_len + p - 1`` of
    ``logits.view(-1, V)``. ``bbox_slots`` index ``coord_logit_index``; ``text_gate`` uses the ce positions.
    """

    ce_logit_index: torch.Tensor  # int64 (Nce,)
    ce_labels: torch.Tensor  # int64 (Nce,)
    ce_weights: torch.Tensor  # float32 (Nce,)
    coord_logit_index: torch.Tensor  # int64 (Nc,)
    coord_targets: torch.Tensor  # float32 (Nc,) continuous bins in [0, 999]
    bbox_slots: torch.Tensor  # int64 (K, 4) indices into coord_logit_index
    seq_len: int
    num_rows: int  # rows the segments occupy (max row + 1); the logits may not have fewer
    # unlikelihood negatives of certified repeats (TokenSupervision.ul_*), in flattened logit coordinates
    ul_logit_index: torch.Tensor = torch.zeros(0, dtype=torch.long)
    ul_tokens: torch.Tensor = torch.zeros(0, dtype=torch.long)
    ul_bins: torch.Tensor = torch.zeros(0, dtype=torch.long)
    ul_exclude: torch.Tensor = torch.zeros(0, dtype=torch.long)
    # policy-gradient tokens of the reward objective (TokenSupervision.pg_*): their logit rows, ids and advantages
    pg_logit_index: torch.Tensor = torch.zeros(0, dtype=torch.long)
    pg_labels: torch.Tensor = torch.zeros(0, dtype=torch.long)
    pg_advantages: torch.Tensor = torch.zeros(0, dtype=torch.float32)

    @classmethod
    def from_segments(cls, segments: Sequence[SupervisionSegment], seq_len: int) -> "SupervisionBatch":
        """Flatten per-sample supervision into logit coordinates, validating every index against its row.

        Raises:
            ValueError: an index outside its assistant span or row, a label at position 0, overlapping assistant
                spans in one row, or malformed supervision arrays (the message names the segment).
        """
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 to hold a prompt token and a label (got {seq_len})")
        parts = [_segment_arrays(SupervisionSegment(*seg), seq_len, f"segment {i}") for i, seg in enumerate(segments)]
        spans = sorted((tuple(p["span"].tolist()), i) for i, p in enumerate(parts))
        for (prev, i_prev), (cur, i_cur) in zip(spans, spans[1:], strict=False):
            if prev[0] == cur[0] and cur[1] < prev[2] and prev[2] > prev[1] and cur[2] > cur[1]:
                raise ValueError(
                    f"segments {i_prev} and {i_cur} overlap in row {cur[0]} (assistant spans "
                    f"[{prev[1]}, {prev[2]}) and [{cur[1]}, {cur[2]})); each packed segment needs its own offset"
                )
        coord_offsets = np.cumsum([0] + [p["coord_index"].size for p in parts])

        def cat(key: str, dtype: np.dtype, shape: tuple[int, ...] = (0,)) -> np.ndarray:
            arrays = [p[key] for p in parts]
            return np.concatenate(arrays).astype(dtype) if arrays else np.zeros(shape, dtype=dtype)

        slots = [p["bbox_slots"] + off for p, off in zip(parts, coord_offsets[:-1], strict=True)]
        return cls(
            ce_logit_index=torch.from_numpy(cat("ce_index", np.int64)),
            ce_labels=torch.from_numpy(cat("ce_labels", np.int64)),
            ce_weights=torch.from_numpy(cat("ce_weights", np.float32)),
            coord_logit_index=torch.from_numpy(cat("coord_index", np.int64)),
            coord_targets=torch.from_numpy(cat("coord_targets", np.float32)),
            bbox_slots=torch.from_numpy(
                np.concatenate(slots).astype(np.int64) if slots else np.zeros((0, 4), np.int64)
            ),
            seq_len=int(seq_len),
            num_rows=max((int(p["span"][0]) + 1 for p in parts), default=0),
            **{f"ul_{name}": torch.from_numpy(cat(f"ul_{name}", np.int64))
               for name in ("tokens", "bins", "exclude")},
            ul_logit_index=torch.from_numpy(cat("ul_index", np.int64)),
            pg_logit_index=torch.from_numpy(cat("pg_index", np.int64)),
            pg_labels=torch.from_numpy(cat("pg_labels", np.int64)),
            pg_advantages=torch.from_numpy(cat("pg_advantages", np.float32)),
        )

    def to(self, device: torch.device | str) -> "SupervisionBatch":
        """The same batch with its tensors on ``device``."""
        moved = {
            name: getattr(self, name).to(device)
            for name in (
                "ce_logit_index",
                "ce_labels",
                "ce_weights",
                "coord_logit_index",
                "coord_targets",
                "bbox_slots",
                "ul_logit_index",
                "ul_tokens",
                "ul_bins",
                "ul_exclude",
                "pg_logit_index",
                "pg_labels",
                "pg_advantages",
            )
        }
        return SupervisionBatch(**moved, seq_len=self.seq_len, num_rows=self.num_rows)

    def at_kept_positions(self) -> tuple[torch.Tensor, "SupervisionBatch"]:
        """``(positions, batch)``: the sorted sequence positions whose logits the losses read (union over rows; at
        least one), and this batch re-indexed for logits computed at those positions only (``model(...,
        logits_to_keep=positions)``). Prompt and padding logits are never read, so the LM head then runs on K
        instead of T positions, and the logits and their gradient shrink by K / T."""
        flat = torch.cat([self.ce_logit_index, self.coord_logit_index, self.ul_logit_index, self.pg_logit_index])
        if flat.numel():
            positions = torch.unique(flat % self.seq_len)  # sorted
        else:
            positions = torch.zeros(1, dtype=torch.long, device=flat.device)
        kept = int(positions.numel())

        def remap(index: torch.Tensor) -> torch.Tensor:
            return (index // self.seq_len) * kept + torch.searchsorted(positions, index % self.seq_len)

        return positions, replace(
            self,
            ce_logit_index=remap(self.ce_logit_index),
            coord_logit_index=remap(self.coord_logit_index),
            ul_logit_index=remap(self.ul_logit_index),
            pg_logit_index=remap(self.pg_logit_index),
            seq_len=kept,
        )


@dataclass(frozen=True)
class LossDenominators:
    """What each term averages over. A step trained as several packed rows passes the whole step's counts to every
    row, so the rows' losses (and gradients) add up to the one-forward loss of all its segments (decision 8); under
    DDP or ZeRO the trainer passes the counts summed over every rank, with ``ranks`` set, so each term is the
    micro-step's token mean over all ranks (the ranks' gradients are averaged, so a rank's share is scaled by
    ``ranks``)."""

    ce_weight: float  # token_ce: sum of the CE weights
    ce: int  # text_gate: supervised text positions
    coord: int  # coord_ce, soft_ce, w1, gate: coord slots
    boxes: int  # smoothl1, ciou: bbox slots
    negatives: int = 0  # repeat_ul: unlikelihood negatives
    policy_tokens: int = 0  # policy_gradient: rollout tokens trained by the reward objective
    # how many ranks' tokens the counts add up (trainer: all of them): their gradients are averaged, so a rank's
    # sum divides by count / ranks and the average is the whole micro-step's token mean
    ranks: int = 1

    @classmethod
    def of(cls, batch: "SupervisionBatch") -> "LossDenominators":
        return cls(
            float(batch.ce_weights.double().sum()),
            int(batch.ce_logit_index.numel()),
            int(batch.coord_logit_index.numel()),
            int(batch.bbox_slots.shape[0]),
            int(batch.ul_logit_index.numel()),
            int(batch.pg_logit_index.numel()),
        )

    def __add__(self, other: "LossDenominators") -> "LossDenominators":
        return LossDenominators(
            self.ce_weight + other.ce_weight, self.ce + other.ce, self.coord + other.coord, self.boxes + other.boxes,
            self.negatives + other.negatives, self.policy_tokens + other.policy_tokens,
        )

    def over_ranks(self, sum_over_ranks: Callable[[list[float]], list[float]], ranks: int) -> "LossDenominators":
        """These counts summed over ``ranks`` ranks by ``sum_over_ranks`` (an all-reduce every rank calls with the
        same list), with ``ranks`` set (:meth:`scales`, :attr:`policy_normaliser`)."""
        ce_weight, ce, coord, boxes, negatives, policy_tokens = sum_over_ranks(
            [self.ce_weight, float(self.ce), float(self.coord), float(self.boxes), float(self.negatives),
             float(self.policy_tokens)])
        return LossDenominators(ce_weight, int(ce), int(coord), int(boxes), int(negatives), int(policy_tokens), ranks)

    @property
    def policy_normaliser(self) -> float:
        """What this rank's policy-gradient sum divides by (``ranks``)."""
        return self.policy_tokens / self.ranks

    def scales(self, whole: "LossDenominators") -> dict[str, float]:
        """Per-term factors turning this batch's means into its share of ``whole``'s means (1 where both are empty);
        ``whole.ranks`` ranks' averaged gradients each carry ``ranks`` times their share."""

        def share(part: float, total: float) -> float:
            return part * whole.ranks / total if total else 1.0

        coord, box = share(self.coord, whole.coord), share(self.boxes, whole.boxes)
        return {"token_ce": share(self.ce_weight, whole.ce_weight), "text_gate": share(self.ce, whole.ce),
                "coord_ce": coord, "soft_ce": coord, "w1": coord, "gate": coord, "smoothl1": box, "ciou": box,
                "repeat_ul": share(self.negatives, whole.negatives)}


@dataclass(frozen=True)
class ObjectiveResult:
    """``total`` carries the graph; ``terms`` are detached module losses (unweighted) and their sub-terms."""

    total: torch.Tensor
    terms: Mapping[str, float]
    diagnostics: Mapping[str, float]
    counts: Mapping[str, int]


@dataclass(frozen=True)
class _FencedRows:
    """Statistics of the fenced logit rows at every supervised position (text rows first, then coord slots)."""

    stats: GatheredRowStats  # label logits for the text rows; lse at every temperature a term needs
    num_ce: int

    @property
    def num_rows(self) -> int:
        return int(self.stats.coord.shape[0])

    @property
    def coord_slot_coord(self) -> torch.Tensor:
        return self.stats.coord[self.num_ce :]

    def log_mass(self, rows: slice, temperature: float) -> torch.Tensor:
        """Shared-helper coord-vocab log mass of ``rows`` (a slice of the text-then-coord layout)."""
        return self.stats.log_mass(rows, temperature)


def _coord_term_weights(cfg: CoordRegConfig) -> dict[str, float]:
    return {
        "coord_ce": cfg.coord_ce_weight,
        "soft_ce": cfg.soft_ce_weight,
        "w1": cfg.w1_weight,
        "gate": cfg.coord_gate_weight,
        "text_gate": cfg.text_gate_weight,
    }


def _token_ce(rows: _FencedRows, batch: SupervisionBatch, zero: torch.Tensor) -> torch.Tensor:
    """``sum(w * ce) / sum(w)``; ce = lse - logit[label] (no full-vocab log-softmax copy is kept)."""
    if rows.num_ce == 0:
        return zero
    ce = rows.stats.lse[1.0][: rows.num_ce] - rows.stats.label_logit
    weights = batch.ce_weights.to(ce.device)
    return (weights * ce).sum() / weights.sum()


def _coord_reg(
    rows: _FencedRows, targets: torch.Tensor, cfg: CoordRegConfig, zero: torch.Tensor, scales: Mapping[str, float]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted sum of the coord_reg terms; a term with weight 0 is neither computed nor reported."""
    weights = _coord_term_weights(cfg)
    active = {name for name, w in weights.items() if w > 0}
    terms: dict[str, torch.Tensor] = {name: zero for name in active}
    num_coord = rows.num_rows - rows.num_ce
    if num_coord:
        log_p = coord_log_probs(rows.coord_slot_coord, cfg.temperature)
        if active & {"soft_ce", "w1"}:
            q = gaussian_soft_targets(targets, cfg.target_sigma, cfg.target_truncate)
        if "coord_ce" in active:
            terms["coord_ce"] = coord_hard_ce(log_p, targets).mean()
        if "soft_ce" in active:
            terms["soft_ce"] = soft_ce(log_p, q).mean()
        if "w1" in active:
            terms["w1"] = w1_distance(log_p.exp(), q).mean()
    if {"gate", "text_gate"} & active:
        # one shared-helper call covers both gates over the rows they need: text rows first, coord-slot rows after
        start = 0 if "text_gate" in active else rows.num_ce
        stop = rows.num_rows if "gate" in active else rows.num_ce
        log_mass = rows.log_mass(slice(start, stop), cfg.temperature)
        if "gate" in active and num_coord:
            terms["gate"] = (-log_mass[rows.num_ce - start :]).mean()
        if "text_gate" in active and rows.num_ce:
            terms["text_gate"] = text_gate_from_log_mass(log_mass[: rows.num_ce]).mean()
    terms = {name: value * scales.get(name, 1.0) for name, value in terms.items()}
    total = zero
    for name, value in terms.items():
        total = total + weights[name] * value
    return total, terms


def _bbox_geo(
    rows: _FencedRows, batch: SupervisionBatch, cfg: BboxGeoConfig, zero: torch.Tensor, scales: Mapping[str, float]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SmoothL1 and 1 - CIoU on the expected box (temperature-1 softmax over the coord bins) of each bbox slot."""
    device = rows.stats.coord.device
    slots = batch.bbox_slots.to(device)
    if slots.shape[0] == 0:
        smoothl1, one_minus_ciou = zero, zero
    else:
        flat_slots = slots.reshape(-1)
        log_p = coord_log_probs(rows.coord_slot_coord.index_select(0, flat_slots), 1.0)
        pred = (expected_bins(log_p.exp()) / _MAX_BIN).reshape(-1, 4)
        target = (batch.coord_targets.to(device).index_select(0, flat_slots) / _MAX_BIN).reshape(-1, 4)
        smoothl1, one_minus_ciou = smoothl1_and_ciou(pred, target)
        smoothl1, one_minus_ciou = smoothl1 * scales.get("smoothl1", 1.0), one_minus_ciou * scales.get("ciou", 1.0)
    total = cfg.smoothl1_weight * smoothl1 + cfg.ciou_weight * one_minus_ciou
    return total, {"smoothl1": smoothl1, "ciou": one_minus_ciou}


@torch.no_grad()
def _coord_diagnostics(rows: _FencedRows, targets: torch.Tensor) -> dict[str, float]:
    """Temperature-1 health of the coord distribution; 0.0 where there is no position to average over."""
    out = {"coord_diag/coord_mass": 0.0, "coord_diag/text_coord_mass": 0.0}
    out.update({"coord_diag/entropy": 0.0, "coord_diag/expected_bin_abs_err": 0.0})
    if rows.num_rows == 0:
        return out
    mass = rows.log_mass(slice(None), 1.0).exp()
    if rows.num_ce:
        out["coord_diag/text_coord_mass"] = mass[: rows.num_ce].mean().item()
    if rows.num_rows > rows.num_ce:
        out["coord_diag/coord_mass"] = mass[rows.num_ce :].mean().item()
        log_p = coord_log_probs(rows.coord_slot_coord, 1.0)
        p = log_p.exp()
        out["coord_diag/entropy"] = (-(p * log_p).sum(dim=1)).mean().item()
        out["coord_diag/expected_bin_abs_err"] = (expected_bins(p) - targets).abs().mean().item()
    return out


def _needed_temperatures(pipeline: PipelineConfig) -> list[float]:
    """Temperatures whose full-vocab logsumexp some enabled term reads (token_ce and coord_diag use 1)."""
    temperatures = []
    if pipeline.module("token_ce") is not None or pipeline.module("coord_diag") is not None:
        temperatures.append(1.0)
    coord_reg_module = pipeline.module("coord_reg")
    if coord_reg_module is not None:
        weights = _coord_term_weights(coord_reg_module.config)
        if weights["gate"] > 0 or weights["text_gate"] > 0:
            temperatures.append(coord_reg_module.config.temperature)
    return temperatures


def compute_objective(
    logits: torch.Tensor,
    batch: SupervisionBatch,
    coord_ids: torch.Tensor,
    pipeline: PipelineConfig,
    denominators: LossDenominators | None = None,
    repeat_ul: RepeatUnlikelihoodConfig | None = None,
) -> ObjectiveResult:
    """Total loss ``sum(module.weight * module_loss)`` over the modules that run on the rollout channel ``B``.

    Args:
        logits: ``(R, T, V)`` logits of the one forward pass (any float dtype; maths in float32).
        batch: supervision in flattened logit coordinates, built for ``seq_len == T``.
        coord_ids: ``(1000,)`` LongTensor of the coord token ids in bin order.
        pipeline: the contract's ``rollout_matching.pipeline``.
        denominators: the counts the means divide by (default: this batch's own); one row of a multi-row step
            passes the step's, so its ``total`` and ``terms`` are its share of the step's loss.
        repeat_ul: ``rollout_matching.repeat_unlikelihood`` when ``repeats: unlikelihood`` (None: no such term);
            reported as ``repeat_ul`` and the pushed-down probability ``repeat_ul/mass`` (means over negatives).

    ``token_ce`` is ``sum(w * ce) / sum(w)`` over supervised text positions (full vocab, sanitised logits);
    every other term is a plain mean over its positions or boxes. With nothing to average, a term is exactly 0
    (never NaN) and ``total`` still backpropagates (a zero gradient). Memory: the supervised rows are fenced a
    chunk at a time and reduced to per-row statistics (``(N, 1000)`` coord columns, logsumexps, label logits);
    the only logits-sized tensor is the one gradient buffer of the backward pass.
    """
    if logits.ndim != 3:
        raise ValueError(f"logits must have shape (rows, seq_len, vocab) (got {tuple(logits.shape)})")
    num_rows, seq_len, vocab = logits.shape
    if seq_len != batch.seq_len or num_rows < batch.num_rows:
        raise ValueError(
            f"logits shape {tuple(logits.shape)} does not match the supervision batch (seq_len={batch.seq_len}, "
            f"rows >= {batch.num_rows}); build the SupervisionBatch for the same packed/padded layout"
        )
    check_coord_ids(coord_ids, vocab)
    device = logits.device
    # A graph-free zero: deriving it from the logits would add a full-size zero gradient to the backward pass.
    zero = torch.zeros((), dtype=torch.float32, device=device)
    index = torch.cat([batch.ce_logit_index, batch.coord_logit_index]).to(device)
    token_ce_on = pipeline.module("token_ce") is not None
    rows = _FencedRows(
        gathered_row_stats(
            logits,
            index,
            coord_ids,
            _needed_temperatures(pipeline),
            labels=batch.ce_labels if token_ce_on else None,
        ),
        int(batch.ce_logit_index.numel()),
    )
    targets = batch.coord_targets.to(device)
    scales = {} if denominators is None else LossDenominators.of(batch).scales(denominators)

    total = zero
    terms: dict[str, torch.Tensor] = {}
    token_ce_module = pipeline.module("token_ce")
    if token_ce_module is not None:
        terms["token_ce"] = _token_ce(rows, batch, zero) * scales.get("token_ce", 1.0)
        total = total + token_ce_module.weight * terms["token_ce"]
    coord_reg_module = pipeline.module("coord_reg")
    if coord_reg_module is not None:
        module_loss, sub = _coord_reg(rows, targets, coord_reg_module.config, zero, scales)
        terms["coord_reg"] = module_loss
        terms.update({f"coord_reg/{k}": v for k, v in sub.items()})
        total = total + coord_reg_module.weight * module_loss
    bbox_geo_module = pipeline.module("bbox_geo")
    if bbox_geo_module is not None:
        module_loss, sub = _bbox_geo(rows, batch, bbox_geo_module.config, zero, scales)
        terms["bbox_geo"] = module_loss
        terms.update({f"bbox_geo/{k}": v for k, v in sub.items()})
        total = total + bbox_geo_module.weight * module_loss
    if repeat_ul is not None:
        n_neg = int(batch.ul_logit_index.numel())
        term, mass = zero, zero
        if n_neg:
            term, mass = repeat_unlikelihood(logits, batch.ul_logit_index, batch.ul_tokens, batch.ul_bins,
                                             batch.ul_exclude, coord_ids, repeat_ul.band)
            term, mass = term / n_neg, mass / n_neg
        share = scales.get("repeat_ul", 1.0)
        terms["repeat_ul"], terms["repeat_ul/mass"] = term * share, mass * share
        if repeat_ul.weight > 0 and n_neg:
            total = total + repeat_ul.weight * terms["repeat_ul"]

    if rows.stats.coord.requires_grad and not total.requires_grad:
        total = total + rows.stats.coord.sum() * 0.0  # nothing supervised: an exact 0 that still backpropagates
    diagnostics = _coord_diagnostics(rows, targets) if pipeline.module("coord_diag") is not None else {}
    counts = {
        "num_ce_tokens": rows.num_ce,
        "num_coord_tokens": int(batch.coord_logit_index.numel()),
        "num_bbox_slots": int(batch.bbox_slots.shape[0]),
    }
    if repeat_ul is not None:
        counts["num_ul_negatives"] = int(batch.ul_logit_index.numel())
    return ObjectiveResult(
        total=total, terms={k: float(v.detach()) for k, v in terms.items()}, diagnostics=diagnostics, counts=counts
    )
