"""Training-time rollout counters: parsing and matching health as plain integer counts (no IoU, ever).

Counters are summed across micro-steps and ranks (:meth:`RolloutCounters.merge`, :func:`sum_counters`, or an
``all_reduce(SUM)`` of :meth:`RolloutCounters.to_tensor`) and every ratio is recomputed from the sums, never
averaged: averaging per-step ratios would weight a 1-object image like a 60-object one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Iterable, Literal, Mapping, Optional, Sequence

if TYPE_CHECKING:
    import torch

__all__ = [
    "AMBIGUOUS_REASON",
    "DEFAULT_DROP_REASONS",
    "DEFAULT_PREFIX_FALLBACK_REASONS",
    "DecodeMode",
    "RolloutCounters",
    "sum_counters",
]

DecodeMode = Literal["greedy", "sampling", "beam"]

# Parser drop reason of an object whose coord slots cannot be aligned; counted as ambiguous-excluded, not dropped.
AMBIGUOUS_REASON = "ambiguous_alignment"

# Fixed reason vocabularies for the tensor layout: every rank must use the same tuple (pass the parser's own
# reason set to to_tensor/from_tensor if it differs). A reason outside the vocabulary fails loudly, never vanishes.
DEFAULT_DROP_REASONS: tuple[str, ...] = (
    # schema problems of a complete object (coordexp.runtime.core.parsing.SCHEMA_REASONS, minus AMBIGUOUS_REASON)
    "unknown_key",
    "duplicate_desc",
    "multiple_geometry",
    "missing_desc",
    "bad_desc_type",
    "empty_desc",
    "missing_geometry",
    "bad_nesting",
    "non_coord_value",
    "bbox_arity",
    "poly_arity",
    "bbox_invalid",
    # entries that are not usable objects at all
    "non_object_value",
    "non_object_key",
    "malformed",
    "truncated",
    "cut_fallback",
    "prefix_fallback",
)
DEFAULT_PREFIX_FALLBACK_REASONS: tuple[str, ...] = ("no_open_brace", "leading_text", "cut_fallback")

# Scalar count fields in tensor order (the reason counts follow, in vocabulary order).
_SCALAR_FIELDS: tuple[str, ...] = (
    "samples",
    "pred_valid",
    "pred_ambiguous_excluded",
    "gt_objects",
    "matched",
    "fn_appended",
    "fp",
    "gating_rejections",
    "truncated_rollouts",
    "decode_greedy",
    "decode_sampling",
    "decode_beam",
    "eos_stopped",
    "rollout_tokens",
    "trailing_dropped",
    "certified_duplicates",
    "repeats_removed",
    "repeat_negatives",
)
_REASON_FIELDS: tuple[str, ...] = ("dropped_by_reason", "prefix_fallbacks_by_reason")


def _ratio(numerator: int, denominator: int) -> Optional[float]:
    return numerator / denominator if denominator else None


@dataclass(frozen=True)
class RolloutCounters:
    """Integer counts for any number of rollouts; ``dropped_by_reason`` / ``prefix_fallbacks_by_reason`` hold the
    per-reason counts whose sums are :attr:`pred_dropped` / :attr:`prefix_fallbacks`. All counts default to 0."""

    samples: int = 0
    pred_valid: int = 0  # predicted objects that parsed valid
    pred_ambiguous_excluded: int = 0  # parsed objects excluded because their coord slots cannot be aligned
    dropped_by_reason: Mapping[str, int] = field(default_factory=dict)
    gt_objects: int = 0
    matched: int = 0
    fn_appended: int = 0  # GT objects appended to Y_train (unmatched GT)
    fp: int = 0  # valid predicted objects left unmatched
    gating_rejections: int = 0  # candidate pairs rejected by the maskIoU gate before assignment
    truncated_rollouts: int = 0
    prefix_fallbacks_by_reason: Mapping[str, int] = field(default_factory=dict)
    decode_greedy: int = 0
    decode_sampling: int = 0
    decode_beam: int = 0
    eos_stopped: int = 0  # rollouts that ended with the end-of-turn token (not by the length limit)
    rollout_tokens: int = 0  # generated tokens, summed
    trailing_dropped: int = 0  # parsed entries after the last matched one, cut from Y_train (trailing_unmatched: drop)
    certified_duplicates: int = 0  # valid predictions that repeat an earlier one (core.set_figures; label safe)
    repeats_removed: int = 0  # certified repeats left out of Y_train (rollout_matching.repeats: drop)
    repeat_negatives: int = 0  # unlikelihood negatives they became (rollout_matching.repeats: unlikelihood)

    def __post_init__(self) -> None:
        for name in _SCALAR_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"RolloutCounters.{name} must be a non-negative int count (got {value!r})")
        for name in _REASON_FIELDS:
            counts = getattr(self, name)
            for reason, value in counts.items():
                if not isinstance(reason, str) or isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(
                        f"RolloutCounters.{name} maps reason strings to non-negative ints (got {reason!r}: {value!r})"
                    )
            # zero entries are dropped so equal counts compare equal however they were built
            object.__setattr__(self, name, MappingProxyType({r: counts[r] for r in sorted(counts) if counts[r]}))

    def __reduce__(self):
        """Pickle as plain dicts (a read-only mapping view cannot be pickled): counters cross ranks inside
        ``all_gather_object`` payloads (evaluation under torchrun)."""
        fields = {name: getattr(self, name) for name in _SCALAR_FIELDS}
        fields.update({name: dict(getattr(self, name)) for name in _REASON_FIELDS})
        return (_counters_from_fields, (fields,))

    # ---------------------------------------------------------------- construction and merging

    @classmethod
    def for_sample(
        cls,
        *,
        pred_valid: int,
        drop_reasons: Iterable[str],
        gt_objects: int,
        matched: int,
        fn_appended: int,
        gating_rejections: int,
        truncated: bool,
        prefix_fallback: Optional[str],
        decode_mode: DecodeMode,
        eos_stopped: bool,
        rollout_tokens: int,
        cut_fallbacks: int = 0,
        trailing_dropped: int = 0,
        certified_duplicates: int = 0,
        repeats_removed: int = 0,
        repeat_negatives: int = 0,
    ) -> "RolloutCounters":
        """Counters of one rollout. ``drop_reasons`` lists one reason per non-valid parsed object; the
        :data:`AMBIGUOUS_REASON` entries count as ambiguous-excluded. ``fp`` is derived as valid - matched.
        ``prefix_fallback`` (the empty-prefix reason, or None) and ``cut_fallbacks`` (cuts moved back to an earlier
        boundary) are both counted in ``prefix_fallbacks_by_reason``, the latter as ``"cut_fallback"``."""
        if decode_mode not in ("greedy", "sampling", "beam"):
            raise ValueError(f"decode_mode must be 'greedy', 'sampling' or 'beam' (got {decode_mode!r})")
        if matched > min(pred_valid, gt_objects):
            raise ValueError(
                f"matched={matched} exceeds valid predictions ({pred_valid}) or GT objects ({gt_objects})"
            )
        dropped: dict[str, int] = {}
        ambiguous = 0
        for reason in drop_reasons:
            if reason == AMBIGUOUS_REASON:
                ambiguous += 1
            else:
                dropped[reason] = dropped.get(reason, 0) + 1
        fallbacks = {"cut_fallback": cut_fallbacks}
        if prefix_fallback:
            fallbacks[prefix_fallback] = fallbacks.get(prefix_fallback, 0) + 1
        return cls(
            samples=1,
            pred_valid=pred_valid,
            pred_ambiguous_excluded=ambiguous,
            dropped_by_reason=dropped,
            gt_objects=gt_objects,
            matched=matched,
            fn_appended=fn_appended,
            fp=pred_valid - matched,
            gating_rejections=gating_rejections,
            truncated_rollouts=int(truncated),
            prefix_fallbacks_by_reason=fallbacks,
            decode_greedy=int(decode_mode == "greedy"),
            decode_sampling=int(decode_mode == "sampling"),
            decode_beam=int(decode_mode == "beam"),
            eos_stopped=int(eos_stopped),
            rollout_tokens=rollout_tokens,
            trailing_dropped=trailing_dropped,
            certified_duplicates=certified_duplicates,
            repeats_removed=repeats_removed,
            repeat_negatives=repeat_negatives,
        )

    def merge(self, other: "RolloutCounters") -> "RolloutCounters":
        """Field-wise sum (micro-steps, ranks); per-reason counts are summed per reason."""
        summed: dict[str, object] = {name: getattr(self, name) + getattr(other, name) for name in _SCALAR_FIELDS}
        for name in _REASON_FIELDS:
            mine, theirs = getattr(self, name), getattr(other, name)
            summed[name] = {r: mine.get(r, 0) + theirs.get(r, 0) for r in {*mine, *theirs}}
        return RolloutCounters(**summed)

    __add__ = merge

    # ---------------------------------------------------------------- derived totals and ratios

    @property
    def pred_dropped(self) -> int:
        """Parsed objects dropped as invalid (all reasons)."""
        return sum(self.dropped_by_reason.values())

    @property
    def pred_parsed(self) -> int:
        """Every predicted object the parser saw: valid + dropped + ambiguous-excluded."""
        return self.pred_valid + self.pred_dropped + self.pred_ambiguous_excluded

    @property
    def prefix_fallbacks(self) -> int:
        """Prefix fallbacks of all reasons: empty-prefix rollouts plus cuts moved back to an earlier boundary."""
        return sum(self.prefix_fallbacks_by_reason.values())

    def ratios(self) -> dict[str, Optional[float]]:
        """Ratios recomputed from the summed counts; None where the denominator is 0 (undefined, not 0)."""
        per_image = {
            "fn_per_image": self.fn_appended,
            "fp_per_image": self.fp,
            "gt_per_image": self.gt_objects,
            "valid_pred_per_image": self.pred_valid,
            "gating_rejections_per_image": self.gating_rejections,
            "rollout_tokens_per_image": self.rollout_tokens,
            "prefix_fallbacks_per_image": self.prefix_fallbacks,
            "trailing_dropped_per_image": self.trailing_dropped,
            "duplicates_per_image": self.certified_duplicates,
        }
        per_sample_rate = {
            "truncation_rate": self.truncated_rollouts,
            "eos_stop_rate": self.eos_stopped,
            "beam_rate": self.decode_beam,
        }
        return {
            "parse_valid_rate": _ratio(self.pred_valid, self.pred_parsed),
            "parse_drop_rate": _ratio(self.pred_dropped, self.pred_parsed),
            "ambiguous_excluded_rate": _ratio(self.pred_ambiguous_excluded, self.pred_parsed),
            "match_rate": _ratio(self.matched, self.gt_objects),
            "match_precision": _ratio(self.matched, self.pred_valid),
            "pred_per_gt": _ratio(self.pred_valid, self.gt_objects),
            "duplicate_rate": _ratio(self.certified_duplicates, self.pred_valid),
            # rollouts that ended without EOS (length limit or repeat guard); truncation_rate counts only the ones
            # cut inside the JSON answer
            "cut_off_rate": _ratio(self.samples - self.eos_stopped, self.samples),
            **{name: _ratio(count, self.samples) for name, count in {**per_image, **per_sample_rate}.items()},
        }

    def to_log_dict(self, prefix: str = "rollout/") -> dict[str, float]:
        """Flat ``{prefix + name: value}`` of counts, per-reason counts and the defined ratios (undefined omitted)."""
        out: dict[str, float] = {f"{prefix}{name}": float(getattr(self, name)) for name in _SCALAR_FIELDS}
        out.update(
            {
                f"{prefix}pred_dropped": float(self.pred_dropped),
                f"{prefix}pred_parsed": float(self.pred_parsed),
                f"{prefix}prefix_fallbacks": float(self.prefix_fallbacks),
            }
        )
        out.update({f"{prefix}dropped/{r}": float(n) for r, n in self.dropped_by_reason.items()})
        out.update({f"{prefix}prefix_fallback/{r}": float(n) for r, n in self.prefix_fallbacks_by_reason.items()})
        out.update({f"{prefix}{name}": value for name, value in self.ratios().items() if value is not None})
        return out

    # ---------------------------------------------------------------- fixed-layout tensor for all_reduce(SUM)

    @staticmethod
    def tensor_layout(
        drop_reasons: Sequence[str] = DEFAULT_DROP_REASONS,
        fallback_reasons: Sequence[str] = DEFAULT_PREFIX_FALLBACK_REASONS,
    ) -> tuple[str, ...]:
        """Names of the tensor entries, in order: scalar counts, then ``dropped/<r>``, then ``prefix_fallback/<r>``."""
        for name, vocab in (("drop_reasons", drop_reasons), ("fallback_reasons", fallback_reasons)):
            if len(set(vocab)) != len(vocab):
                raise ValueError(f"{name} vocabulary repeats a reason: {list(vocab)}")
        return (
            *_SCALAR_FIELDS,
            *(f"dropped/{r}" for r in drop_reasons),
            *(f"prefix_fallback/{r}" for r in fallback_reasons),
        )

    def to_tensor(
        self,
        drop_reasons: Sequence[str] = DEFAULT_DROP_REASONS,
        fallback_reasons: Sequence[str] = DEFAULT_PREFIX_FALLBACK_REASONS,
        device: "torch.device | str | None" = None,
    ) -> "torch.Tensor":
        """int64 vector in :meth:`tensor_layout` order; every rank must pass the same vocabularies."""
        import torch

        self.tensor_layout(drop_reasons, fallback_reasons)
        for name, counts, vocab in (
            ("drop", self.dropped_by_reason, drop_reasons),
            ("prefix-fallback", self.prefix_fallbacks_by_reason, fallback_reasons),
        ):
            unknown = sorted(set(counts) - set(vocab))
            if unknown:
                raise ValueError(
                    f"{name} reason(s) {unknown} are not in the tensor vocabulary {list(vocab)}; pass the full reason "
                    "set (the same tuple on every rank) to to_tensor/from_tensor"
                )
        values = [getattr(self, name) for name in _SCALAR_FIELDS]
        values += [self.dropped_by_reason.get(r, 0) for r in drop_reasons]
        values += [self.prefix_fallbacks_by_reason.get(r, 0) for r in fallback_reasons]
        return torch.tensor(values, dtype=torch.int64, device=device)

    @classmethod
    def from_tensor(
        cls,
        tensor: "torch.Tensor",
        drop_reasons: Sequence[str] = DEFAULT_DROP_REASONS,
        fallback_reasons: Sequence[str] = DEFAULT_PREFIX_FALLBACK_REASONS,
    ) -> "RolloutCounters":
        """Inverse of :meth:`to_tensor` (for example after ``all_reduce(SUM)``) with the same vocabularies."""
        layout = cls.tensor_layout(drop_reasons, fallback_reasons)
        values = [int(v) for v in tensor.detach().reshape(-1).cpu().tolist()]
        if len(values) != len(layout):
            raise ValueError(
                f"counter tensor has {len(values)} entries but the layout for these vocabularies has {len(layout)}; "
                "use the same drop/fallback reason tuples as to_tensor"
            )
        n = len(_SCALAR_FIELDS)
        scalars = dict(zip(_SCALAR_FIELDS, values[:n], strict=True))
        dropped = dict(zip(drop_reasons, values[n : n + len(drop_reasons)], strict=True))
        fallbacks = dict(zip(fallback_reasons, values[n + len(drop_reasons) :], strict=True))
        return cls(**scalars, dropped_by_reason=dropped, prefix_fallbacks_by_reason=fallbacks)


def _counters_from_fields(fields: dict) -> RolloutCounters:
    return RolloutCounters(**fields)


def sum_counters(counters: Iterable[RolloutCounters]) -> RolloutCounters:
    """Sum any number of counters (an empty iterable gives all zeros)."""
    total = RolloutCounters()
    for item in counters:
        total = total.merge(item)
    return total
