"""The vLLM V1 logits processor of coordexp rollouts: never-emit ids, coord-group greedy, repeat-aware EOS forcing.

vLLM V1 ignores per-request logits processors; a batch-level processor class is installed once, at engine start
(``LLM(logits_processors=[cls])``, or ``coordexp.runtime.rollout.vllm_repeat:CoordexpLogitsProcessor`` by name in
multiprocess engines and ``serve-rollout``). vLLM constructs it itself, so its configuration travels in the
environment variable :data:`GUARD_ENV` (set by :mod:`coordexp.runtime.rollout.vllm_engine` before the engine starts; child
processes inherit it). Per row it:

- sets ids the policy must never emit to ``-inf``: padded vocabulary rows (``>= len(tokenizer)``) and the
  image/video placeholders (the same ids the HF backend suppresses);
- for the requests whose ``SamplingParams.extra_args`` hold :data:`COORD_GROUP_ARG` (``decoding.coord_group_greedy``,
  greedy requests only), leaves only the coord tokens where they hold more than half the probability and only
  the other tokens elsewhere (:mod:`coordexp.runtime.rollout.coord_group`, the HF backend's rule);
- when ``rollout_matching.repeat_terminate`` is active, keeps one :class:`~coordexp.runtime.core.repeat.RepeatTracker`
  per request (O(1) per generated id, the same pure definition as the HF processor) and forces EOS for exactly
  the rows whose generated ids trip the guard; the other rows continue.

Only :func:`coordexp.runtime.rollout.vllm_import.import_vllm` imports vLLM; the class is built on first attribute access.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

from coordexp.runtime.core.repeat import RepeatGuard, RepeatTracker
from coordexp.runtime.rollout.logprobs import never_emit_ids

__all__ = ["GUARD_ENV", "COORD_GROUP_ARG", "PROCESSOR_QUALNAME", "ProcessorSettings", "RowTrackers", "encode_settings",
           "decode_settings", "CoordexpLogitsProcessor", "processor_class", "constructed_count"]

GUARD_ENV = "COORDEXP_VLLM_LOGITS_PROCESSOR"
COORD_GROUP_ARG = "coordexp_coord_group_greedy"  # the SamplingParams.extra_args key a request opts in with
PROCESSOR_QUALNAME = "coordexp.runtime.rollout.vllm_repeat:CoordexpLogitsProcessor"
_CONSTRUCTED = [0]


@dataclasses.dataclass(frozen=True)
class ProcessorSettings:
    """What the processor needs besides vLLM's config: the guard and the end-of-turn id it forces."""

    guard: RepeatGuard
    eos_token_id: int


def encode_settings(settings: ProcessorSettings) -> str:
    return json.dumps({"guard": dataclasses.asdict(settings.guard), "eos_token_id": settings.eos_token_id})


def decode_settings(payload: str | None) -> ProcessorSettings:
    """The settings in ``payload`` (the env var's value); a missing value is a start-up error, never a silent off."""
    if not payload:
        raise RuntimeError(
            f"the coordexp vLLM logits processor was installed but {GUARD_ENV} is not set; start the engine through "
            "coordexp.runtime.rollout.vllm_engine (it sets the repeat_terminate settings before vLLM builds the processor)")
    data = json.loads(payload)
    return ProcessorSettings(guard=RepeatGuard(**data["guard"]), eos_token_id=int(data["eos_token_id"]))


def constructed_count() -> int:
    """How many processors this process has constructed (the in-process start-up check reads it)."""
    return _CONSTRUCTED[0]


class RowTrackers:
    """Per-request repeat trackers keyed by vLLM's persistent-batch row index (vLLM moves rows around).

    Each entry holds the tracker, vLLM's live list of the request's output ids, and how many of them were pushed.
    """

    def __init__(self, guard: RepeatGuard, pieces: Sequence[bytes] | None):
        self.guard, self.pieces = guard, pieces
        self.rows: dict[int, list[Any]] = {}

    def new_entry(self, _params: Any, _prompt_ids: Any, output_ids: list[int]) -> list[Any]:
        return [RepeatTracker(self.guard, self.pieces), output_ids, 0]

    def tripped_rows(self) -> list[int]:
        """Rows whose generated ids (pushed incrementally) trip the guard: the next id must be EOS."""
        tripped = []
        for row, entry in self.rows.items():
            tracker, output_ids, seen = entry
            for token_id in output_ids[seen:]:
                tracker.push(token_id)
            entry[2] = len(output_ids)
            if tracker.triggered:
                tripped.append(row)
        return tripped


def _build_class() -> type:
    from coordexp.runtime.rollout.vllm_import import import_vllm

    vllm_lp = import_vllm("vllm.v1.sample.logits_processor")
    builtin = import_vllm("vllm.v1.sample.logits_processor.builtin")
    import torch

    from coordexp.runtime.rollout.coord_group import choose_coord_group, coord_id_tensor

    class CoordexpLogitsProcessor(vllm_lp.LogitsProcessor):
        """Never-emit ids and repeat-aware EOS forcing for every request of the engine (config-first)."""

        def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool):
            settings = decode_settings(os.environ.get(GUARD_ENV))
            model_config = vllm_config.model_config
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer, trust_remote_code=False)
            vocab_rows = int(model_config.get_vocab_size())
            never = never_emit_ids(tokenizer, vocab_rows)
            self.never_ids = torch.tensor(never, dtype=torch.long, device=device)
            self.eos_token_id = settings.eos_token_id
            pieces = None
            if settings.guard.active and settings.guard.max_object_keys:
                from coordexp.runtime.core.pieces import PieceTable

                pieces = PieceTable.for_tokenizer(tokenizer).pieces
            self.trackers = RowTrackers(settings.guard, pieces) if settings.guard.active else None
            self.tokenizer = tokenizer
            self.coord_ids: "torch.Tensor | None" = None  # built when the first request opts in
            self.group_rows: dict[int, bool] = {}  # persistent-batch rows decoding with coord_group_greedy
            _CONSTRUCTED[0] += 1

        def is_argmax_invariant(self) -> bool:
            return False

        def _group_entry(self, params: Any, _prompt_ids: Any, _output_ids: Any) -> bool | None:
            if not (getattr(params, "extra_args", None) or {}).get(COORD_GROUP_ARG):
                return None
            if params.temperature > 0:
                raise ValueError(f"{COORD_GROUP_ARG} is for greedy requests (temperature 0), got temperature "
                                 f"{params.temperature}")
            if self.coord_ids is None:
                self.coord_ids = coord_id_tensor(self.tokenizer)
            return True

        def update_state(self, batch_update: Any) -> None:
            if self.trackers is not None:
                builtin.process_dict_updates(self.trackers.rows, batch_update, self.trackers.new_entry)
            builtin.process_dict_updates(self.group_rows, batch_update, self._group_entry)

        def apply(self, logits: "torch.Tensor") -> "torch.Tensor":
            if self.never_ids.numel():
                logits.index_fill_(1, self.never_ids.to(logits.device), float("-inf"))
            if self.group_rows:
                rows = torch.tensor(sorted(self.group_rows), dtype=torch.long, device=logits.device)
                logits[rows] = choose_coord_group(logits[rows], self.coord_ids)
            if self.trackers is None or not self.trackers.rows:
                return logits
            tripped = self.trackers.tripped_rows()
            if tripped:
                rows = torch.tensor(tripped, dtype=torch.long, device=logits.device)
                logits[rows] = float("-inf")
                logits[rows, self.eos_token_id] = 0.0
            return logits

    CoordexpLogitsProcessor.__module__ = __name__
    CoordexpLogitsProcessor.__qualname__ = "CoordexpLogitsProcessor"
    return CoordexpLogitsProcessor


_CLASS: list[type] = []


def processor_class() -> type:
    """The processor class (built once; importing vLLM on first use)."""
    if not _CLASS:
        _CLASS.append(_build_class())
    return _CLASS[0]


def __getattr__(name: str) -> Any:
    if name == "CoordexpLogitsProcessor":  # the FQCN vLLM resolves in multiprocess engines and serve-rollout
        return processor_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
