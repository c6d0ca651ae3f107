"""The logits processors of the HF rollout backend (and of its label-drafted decoding, which applies them one row
and one position at a time): repetition penalty without left padding, coordinate-group greedy, the repeat guard's
forced EOS, and per-request seeded sampling. See :mod:`coordexp.runtime.rollout.hf` for the order they run in.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import LogitsProcessor
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from coordexp.runtime.rollout.coord_group import choose_coord_group
from coordexp.runtime.core.repeat import RepeatGuard, RepeatTracker, count_object_keys, should_terminate
from coordexp.schema.rollout import DecodingConfig

__all__ = ["RepeatGuardProcessor", "CoordGroupGreedy", "PaddingAwareRepetitionPenalty", "SeededSampler"]


class RepeatGuardProcessor(LogitsProcessor):
    """Forces EOS for exactly the rows whose generated ids (after column ``prompt_width``) trip ``guard``.

    Rows keep their identity in greedy/sampling decoding, so one :class:`RepeatTracker` per row is updated with
    the new column (O(1) per step). Beam search reorders rows every step: then each row is re-checked from its ids.
    """

    def __init__(self, guard: RepeatGuard, *, prompt_width: int, eos_token_id: int,
                 pieces: Sequence[bytes] | None, rows_reorder: bool):
        self.guard, self.prompt_width, self.eos_token_id = guard, prompt_width, eos_token_id
        self.pieces, self.rows_reorder = pieces, rows_reorder
        self._trackers: list[RepeatTracker] | None = None
        self._seen = 0

    def _tripped_rows(self, input_ids: torch.Tensor) -> list[bool]:
        if self.rows_reorder:
            generated = input_ids[:, self.prompt_width:].tolist()
            counts = [count_object_keys(g, self.pieces) if self.guard.max_object_keys else 0 for g in generated]
            return [should_terminate(g, self.guard, object_key_count=c) for g, c in zip(generated, counts)]
        if self._trackers is None:
            self._trackers = [RepeatTracker(self.guard, self.pieces) for _ in range(input_ids.shape[0])]
        new_columns = input_ids[:, self.prompt_width + self._seen:].tolist()
        self._seen = input_ids.shape[1] - self.prompt_width
        for tracker, ids in zip(self._trackers, new_columns):
            for token_id in ids:
                tracker.push(token_id)
        return [tracker.triggered for tracker in self._trackers]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        tripped = self._tripped_rows(input_ids)
        if not any(tripped):
            return scores
        rows = torch.tensor(tripped, dtype=torch.bool, device=scores.device)
        forced = scores.masked_fill(rows[:, None], float("-inf"))
        forced[rows, self.eos_token_id] = 0.0
        return forced


class CoordGroupGreedy(LogitsProcessor):
    """Leaves only the coord tokens where they hold more than half the probability, only the other tokens elsewhere
    (greedy then takes the likeliest of the kind); see
    :func:`~coordexp.runtime.rollout.coord_group.choose_coord_group`."""

    def __init__(self, coord_ids: torch.Tensor):
        self.coord_ids = coord_ids

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return choose_coord_group(scores, self.coord_ids)


class PaddingAwareRepetitionPenalty(LogitsProcessor):
    """HF's repetition penalty (``score / p`` if positive, ``score * p`` if negative, once per distinct id seen in
    prompt + generated ids) with left-padding positions ignored; ``pad_lengths`` is per sample, beams share it."""

    def __init__(self, penalty: float, pad_lengths: torch.Tensor, num_beams: int = 1):
        self.penalty = float(penalty)
        self.pad_lengths = pad_lengths.repeat_interleave(num_beams)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        pads = self.pad_lengths.to(input_ids.device)
        columns = torch.arange(input_ids.shape[1], device=input_ids.device)
        first_real = input_ids.gather(1, pads[:, None])  # padding is replaced by an id the row holds anyway
        ids = torch.where(columns[None, :] < pads[:, None], first_real, input_ids)
        seen = scores.gather(1, ids)
        seen = torch.where(seen < 0, seen * self.penalty, seen / self.penalty)
        return scores.scatter(1, ids, seen)


class SeededSampler(LogitsProcessor):
    """Samples each row's next token with that row's own generator and leaves only it finite (so the greedy step
    of ``generate`` picks it). Temperature, top-k and top-p are HF's warpers, applied in that order. Rows flagged
    ``greedy`` keep their scores (the greedy step takes their likeliest token; their generator still draws)."""

    def __init__(self, seeds: Sequence[int], decoding: DecodingConfig, greedy: Sequence[bool] = ()):
        self.seeds = [int(s) for s in seeds]
        self.greedy = [bool(g) for g in greedy] or [False] * len(self.seeds)
        self.warpers: list[LogitsProcessor] = [TemperatureLogitsWarper(max(decoding.temperature, 1e-4))]
        if decoding.top_k > 0:
            self.warpers.append(TopKLogitsWarper(decoding.top_k))
        if decoding.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(decoding.top_p))
        self._generators: list[torch.Generator] | None = None

    def probabilities(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The distribution each row's token is drawn from: the warpers over float scores, then softmax."""
        warped = scores.float()
        for warper in self.warpers:
            warped = warper(input_ids, warped)
        return torch.softmax(warped, dim=-1)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._generators is None:
            if len(self.seeds) != scores.shape[0]:
                raise ValueError(f"SeededSampler has {len(self.seeds)} seeds for {scores.shape[0]} rows")
            self._generators = [torch.Generator(device=scores.device).manual_seed(s) for s in self.seeds]
        probs = self.probabilities(input_ids, scores)
        choices = torch.cat([torch.multinomial(row, 1, generator=g) for row, g in zip(probs, self._generators)])
        chosen = torch.full_like(scores, float("-inf")).scatter(1, choices[:, None], 0.0)
        if any(self.greedy):
            keep = torch.tensor(self.greedy, device=scores.device)[:, None]
            chosen = torch.where(keep, scores, chosen)
        return chosen
