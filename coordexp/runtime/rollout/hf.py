"""The HF rollout backend: batched, left-padded ``model.generate`` on the live policy, no gradients.

- Requests are decoded in chunks of ``decode_batch_size`` (the spec's single microbatch knob), in request order.
- Greedy (``temperature: 0``), sampling, or beam search (``num_beams > 1``: HF returns its best beam, ranked by
  ``sequences_scores`` = summed log-prob / length**length_penalty with the model's ``length_penalty``).
- Sampling is seeded PER REQUEST: ``generate`` runs in greedy mode and :class:`SeededSampler`, the last logits
  processor, draws each row's token with its own ``torch.Generator(seed)``, after the HF temperature / top-k /
  top-p warpers. A request's rollout therefore depends on its seed only, not on the chunk it lands in, and the
  global RNG is never touched (HF ``generate`` takes no generator).
- ``repetition_penalty`` is applied by :class:`PaddingAwareRepetitionPenalty` (prompt + generated ids, like vLLM),
  which ignores left padding so that batched and per-sample rollouts are identical.
- ``decoding.coord_group_greedy`` is :class:`CoordGroupGreedy` (greedy picks the token's kind, coordinate or text,
  by its mass first: :mod:`coordexp.runtime.rollout.coord_group`), before the repeat guard, which may still force EOS.
- ``repeat_terminate`` is :class:`RepeatGuardProcessor`: rows that trip :mod:`coordexp.runtime.core.repeat` get every
  logit but EOS set to -inf; the other rows continue.
- Ids the policy must never emit are suppressed: padded embedding rows (``>= len(tokenizer)``) and the
  image/video placeholders (they would misalign the vision features in the teacher-forced forward).
- An adapter (LoRA/DoRA) policy decodes through merged weights (:class:`MergedDecodeModel`: a plain twin, merged
  again only when the policy's parameters changed, i.e. once per optimizer step); the policy is only read.
- ``rollout_matching.hf_generate``: ``static_cache`` preallocates the KV cache (``cache_implementation="static"``)
  sized to the chunk's prompt width + ``max_new_tokens`` rounded up to a multiple of :data:`CACHE_LENGTH_BUCKET`
  (transformers keeps the largest size seen, so the cache only grows, in whole buckets); ``compile`` lets
  transformers ``torch.compile`` the decode-step forward over it (its ``CompileConfig``, forced on for CPU too when
  asked). A compiled chunk is padded with copies of its last request up to a power of two (at most
  ``decode_batch_size``), so a run compiles once per row bucket, not once per chunk size; the copies' outputs are
  dropped (every row depends on its own request and seed only). Both default to on for CUDA (greedy and sampling)
  and off elsewhere (docs/design.md, Rollout backend interface); outputs are token-for-token those of the
  dynamic cache (tests/rollout/test_backends_hf.py, tests/rollout/test_hf_decode_speed.py).
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any, Sequence

import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from coordexp.runtime.rollout.coord_group import choose_coord_group, coord_id_tensor
from coordexp.runtime.rollout.base import RolloutBackend, RolloutOutput, RolloutRequest, finish_output
from coordexp.runtime.rollout.merged_decode import MergedDecodeModel
from coordexp.runtime.rollout.weight_export import unwrap_model, zero3_partitioned
from coordexp.runtime.rollout.zero3_decode import GatheredDecodeModel
from coordexp.runtime.core.pieces import PieceTable
from coordexp.runtime.core.repeat import RepeatGuard, RepeatTracker, count_object_keys, should_terminate
from coordexp.schema.contract import RunContract
from coordexp.schema.rollout import DecodingConfig, HfGenerateConfig, RepeatTerminateConfig

__all__ = ["HfRolloutBackend", "CoordGroupGreedy", "RepeatGuardProcessor", "SeededSampler",
           "PaddingAwareRepetitionPenalty", "CACHE_LENGTH_BUCKET", "row_bucket"]

logger = logging.getLogger("coordexp.rollout.hf")
END_OF_TURN_TOKEN = "<|im_end|>"
CACHE_LENGTH_BUCKET = 128  # static KV cache lengths are whole multiples of this (fewer sizes, fewer recompiles)
_NEVER_EMIT_TOKENS = ("<|image_pad|>", "<|video_pad|>")


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
    ``greedy`` are left alone (the greedy step takes their likeliest token)."""

    def __init__(self, seeds: Sequence[int], decoding: DecodingConfig, greedy: Sequence[bool] = ()):
        self.seeds = [int(s) for s in seeds]
        self.greedy = [bool(g) for g in greedy] or [False] * len(self.seeds)
        self.warpers: list[LogitsProcessor] = [TemperatureLogitsWarper(max(decoding.temperature, 1e-4))]
        if decoding.top_k > 0:
            self.warpers.append(TopKLogitsWarper(decoding.top_k))
        if decoding.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(decoding.top_p))
        self._generators: list[torch.Generator] | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._generators is None:
            if len(self.seeds) != scores.shape[0]:
                raise ValueError(f"SeededSampler has {len(self.seeds)} seeds for {scores.shape[0]} rows")
            self._generators = [torch.Generator(device=scores.device).manual_seed(s) for s in self.seeds]
        warped = scores.float()
        for warper in self.warpers:
            warped = warper(input_ids, warped)
        probs = torch.softmax(warped, dim=-1)
        choices = torch.cat([torch.multinomial(row, 1, generator=g) for row, g in zip(probs, self._generators)])
        chosen = torch.full_like(scores, float("-inf")).scatter(1, choices[:, None], 0.0)
        if any(self.greedy):
            keep = torch.tensor(self.greedy, device=scores.device)[:, None]
            chosen = torch.where(keep, scores, chosen)
        return chosen


def _unwrap(model: Any) -> Any:
    """The module that owns ``generate`` (inside DDP / accelerate wrappers)."""
    model = unwrap_model(model)
    if not hasattr(model, "generate"):
        raise TypeError(f"the HF rollout backend needs a transformers model with generate(); got {type(model)!r}")
    return model


def row_bucket(rows: int, cap: int) -> int:
    """The rows a compiled chunk of ``rows`` requests is padded to: the next power of two, at most ``cap``."""
    bucket = 1
    while bucket < rows:
        bucket *= 2
    return max(rows, min(bucket, cap))


class HfRolloutBackend(RolloutBackend):
    """Rollouts with the live training model (``sync_weights`` only rebinds: it already has the new weights; an
    adapter policy is merged again before the next decode when its weights changed)."""

    def __init__(self, model: Any, tokenizer: Any, *, decode_batch_size: int, max_new_tokens: int,
                 decoding: DecodingConfig, repeat_terminate: RepeatTerminateConfig | RepeatGuard,
                 hf_generate: HfGenerateConfig | None = None):
        if decode_batch_size < 1 or max_new_tokens < 1:
            raise ValueError(f"decode_batch_size ({decode_batch_size}) and max_new_tokens ({max_new_tokens}) must "
                             "be >= 1; set rollout_matching.decode_batch_size / max_new_tokens")
        if decoding.num_beams > 1 and decoding.temperature > 0:
            raise ValueError(
                f"rollout_matching.decoding: num_beams {decoding.num_beams} with temperature {decoding.temperature} "
                "(beam sampling) is not supported by the HF rollout backend; use temperature: 0 for beam search, "
                "or num_beams: 1 for sampling")
        self._model = model
        self._tokenizer = tokenizer
        self.decode_batch_size = int(decode_batch_size)
        self.max_new_tokens = int(max_new_tokens)
        self.decoding = decoding
        self.hf_generate = hf_generate or HfGenerateConfig()
        self.guard = repeat_terminate if isinstance(repeat_terminate, RepeatGuard) else RepeatGuard.from_config(
            repeat_terminate)
        self._pieces = PieceTable.for_tokenizer(tokenizer).pieces if self.guard.active else None
        self._coord_ids: torch.Tensor | None = None  # built on the first coord_group_greedy decode
        end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN_TOKEN)
        if end_of_turn is None or end_of_turn == tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no {END_OF_TURN_TOKEN} token; rollouts stop at the end of the "
                             "assistant turn, so use a Qwen chat tokenizer")
        self.end_of_turn_id = int(end_of_turn)
        self.decode_calls = 0  # generate() calls made (one per chunk); telemetry and tests read it
        self.merged = MergedDecodeModel()
        self.gathered = GatheredDecodeModel()  # a DeepSpeed ZeRO-3 policy decodes on a whole copy
        self.compiled_shapes: dict[tuple[int, int], float] = {}  # (rows, cache length) -> first call's seconds

    @classmethod
    def from_run(cls, run: RunContract, model: Any, processor: Any) -> "HfRolloutBackend":
        rollout = run.rollout_matching
        return cls(model, processor.tokenizer, decode_batch_size=rollout.decode_batch_size,
                   max_new_tokens=rollout.max_new_tokens, decoding=rollout.decoding,
                   repeat_terminate=rollout.repeat_terminate, hf_generate=rollout.hf_generate)

    def sync_weights(self, model: Any) -> None:
        self._model = model
        self.decode_model()  # the sync point merges (once per optimizer step), not the first chunk after it

    def close(self) -> None:
        self._model = None
        self.merged.release()
        self.gathered.release()

    def decode_model(self) -> Any:
        """The module ``generate`` runs on: the policy, or its merged twin for an adapter policy
        (``hf_generate.merge_adapter``), merged again when the policy's weights changed since the last merge."""
        if self._model is None:
            raise RuntimeError("this HF rollout backend was closed; create a new one")
        policy = _unwrap(self._model)
        if zero3_partitioned(policy):  # copied whole at the sync point (gathered there), never read partitioned
            return self.gathered.model_for(policy)
        return self.merged.model_for(policy) if self.hf_generate.merge_adapter else policy

    def generate(self, requests: Sequence[RolloutRequest]) -> list[RolloutOutput]:
        if self._model is None:
            raise RuntimeError("this HF rollout backend was closed; create a new one")
        outputs: list[RolloutOutput] = []
        for start in range(0, len(requests), self.decode_batch_size):
            outputs.extend(self._generate_chunk(list(requests[start:start + self.decode_batch_size])))
        return outputs

    def _generate_chunk(self, chunk: list[RolloutRequest]) -> list[RolloutOutput]:
        policy = self.decode_model()
        static, compiled = self.hf_generate.resolved(on_cuda=next(policy.parameters()).device.type == "cuda",
                                                     beam_search=self.decoding.num_beams > 1)
        rows = chunk + [chunk[-1]] * (row_bucket(len(chunk), self.decode_batch_size) - len(chunk) if compiled else 0)
        was_training = policy.training
        policy.eval()
        try:
            with torch.no_grad():
                batch, pad_lengths = self._left_padded_batch(policy, rows)
                width = batch["input_ids"].shape[1]
                config, stop_ids = self._generation_config(policy, static=static, compiled=compiled, width=width)
                processors = self._processors(rows, pad_lengths, width)
                self.decode_calls += 1
                started = time.perf_counter()
                result = policy.generate(**batch, generation_config=config,
                                         logits_processor=LogitsProcessorList(processors))
                if compiled:
                    self._note_compiled_call(len(rows), getattr(policy, "_previous_max_cache_length", 0),
                                             time.perf_counter() - started)
        finally:
            policy.train(was_training)
        sequences = result if isinstance(result, torch.Tensor) else result.sequences
        decode = self._decode
        return [
            finish_output(request.prompt.input_ids.tolist(), generated, stop_ids=stop_ids, decode=decode,
                          guard=self.guard, pieces=self._pieces)
            for request, generated in zip(chunk, sequences[:len(chunk), width:].tolist())
        ]

    def _note_compiled_call(self, rows: int, cache_length: int, seconds: float) -> None:
        """The first call of each compiled shape (where compilation happens) is logged once, with its time."""
        shape = (rows, int(cache_length))
        if shape in self.compiled_shapes:
            return
        self.compiled_shapes[shape] = seconds
        logger.info("compiled decode: the first call at %d rows x %d cached tokens took %.1f s (compilation "
                    "included; later calls of this shape reuse it)%s", rows, shape[1], seconds,
                    "" if len(self.compiled_shapes) > 1 else "; rollout_matching.hf_generate.compile: false turns "
                    "compilation off")

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _pad_id(self, policy: Any) -> int:
        for candidate in (self._tokenizer.pad_token_id, policy.generation_config.pad_token_id,
                          self._tokenizer.eos_token_id):
            if candidate is not None:
                return int(candidate)
        return self.end_of_turn_id

    def _left_padded_batch(self, policy: Any, chunk: list[RolloutRequest]) -> tuple[dict, torch.Tensor]:
        device = next(policy.parameters()).device
        prompts = [request.prompt for request in chunk]
        width = max(p.prompt_len for p in prompts)
        pad_lengths = torch.tensor([width - p.prompt_len for p in prompts], dtype=torch.long)
        pad_id = self._pad_id(policy)

        def left_pad(tensors: list[torch.Tensor], value: int) -> torch.Tensor:
            return torch.stack([
                torch.cat([torch.full((width - t.shape[0],), value, dtype=t.dtype), t]) for t in tensors
            ]).to(device)

        batch = {
            "input_ids": left_pad([p.input_ids for p in prompts], pad_id),
            "attention_mask": left_pad([p.attention_mask for p in prompts], 0),
            "mm_token_type_ids": left_pad([p.mm_token_type_ids for p in prompts], 0),
        }
        if any(p.image_grid_thw.shape[0] for p in prompts):  # a text-only chunk has no vision input at all
            pixel_values = torch.cat([p.pixel_values for p in prompts]).to(device)
            if pixel_values.is_floating_point():
                pixel_values = pixel_values.to(policy.dtype)
            batch["pixel_values"] = pixel_values
            batch["image_grid_thw"] = torch.cat([p.image_grid_thw for p in prompts]).to(device)
        return batch, pad_lengths

    def _generation_config(self, policy: Any, *, static: bool = False, compiled: bool = False,
                           width: int = 0) -> tuple[Any, frozenset[int]]:
        """The model's generation config with every decoding knob taken from the contract (config-first)."""
        config = copy.deepcopy(policy.generation_config)
        eos = config.eos_token_id
        eos_ids = [self.end_of_turn_id] + [int(i) for i in ([] if eos is None else [eos] if isinstance(eos, int)
                                                              else eos) if int(i) != self.end_of_turn_id]
        vocab_rows = policy.get_output_embeddings().weight.shape[0]
        never = {int(self._tokenizer.convert_tokens_to_ids(t)) for t in _NEVER_EMIT_TOKENS
                 if self._tokenizer.convert_tokens_to_ids(t) not in (None, self._tokenizer.unk_token_id)}
        never.update(range(len(self._tokenizer), vocab_rows))
        never.update(int(i) for i in (config.suppress_tokens or []))
        config.update(
            max_new_tokens=self.max_new_tokens, max_length=None, min_new_tokens=None, min_length=0,
            do_sample=False,  # sampling is SeededSampler's job (per-request generators)
            num_beams=self.decoding.num_beams, num_return_sequences=1,
            temperature=1.0, top_p=1.0, top_k=None, repetition_penalty=1.0,
            eos_token_id=eos_ids, pad_token_id=self._pad_id(policy), suppress_tokens=sorted(never),
            use_cache=True, return_dict_in_generate=True, output_scores=False,
        )
        config.update(**self._cache_settings(policy, static=static, compiled=compiled, width=width))
        return config, frozenset(eos_ids)

    def _cache_settings(self, policy: Any, *, static: bool, compiled: bool, width: int) -> dict[str, Any]:
        """``hf_generate`` (resolved for the device) as generation-config fields; the dynamic cache and no
        compilation when it is off. A static cache is sized in whole :data:`CACHE_LENGTH_BUCKET` steps."""
        if not static:
            return {"cache_implementation": None, "compile_config": None, "disable_compile": True,
                    "max_cache_len": None}
        needed = width + self.max_new_tokens
        length = -(-needed // CACHE_LENGTH_BUCKET) * CACHE_LENGTH_BUCKET
        if not compiled:
            return {"cache_implementation": "static", "compile_config": None, "disable_compile": True,
                    "max_cache_len": length}
        from transformers import CompileConfig

        on_cuda = next(policy.parameters()).device.type == "cuda"
        # CUDA graphs ("reduce-overhead") are the point on a GPU; elsewhere inductor's default mode
        compile_config = CompileConfig(fullgraph=False, mode="reduce-overhead" if on_cuda else "default")
        compile_config._compile_all_devices = True  # transformers otherwise compiles only on accelerators
        return {"cache_implementation": "static", "compile_config": compile_config, "disable_compile": False,
                "max_cache_len": length}

    def _processors(self, chunk: list[RolloutRequest], pad_lengths: torch.Tensor,
                    width: int) -> list[LogitsProcessor]:
        beams = self.decoding.num_beams
        processors: list[LogitsProcessor] = []
        if self.decoding.repetition_penalty != 1.0:
            processors.append(PaddingAwareRepetitionPenalty(self.decoding.repetition_penalty, pad_lengths, beams))
        if self.decoding.coord_group_greedy:
            if self._coord_ids is None:
                self._coord_ids = coord_id_tensor(self._tokenizer)
            processors.append(CoordGroupGreedy(self._coord_ids))
        if self.guard.active:
            processors.append(RepeatGuardProcessor(self.guard, prompt_width=width, eos_token_id=self.end_of_turn_id,
                                                   pieces=self._pieces, rows_reorder=beams > 1))
        if self.decoding.temperature > 0:
            processors.append(SeededSampler([request.seed for request in chunk], self.decoding,
                                            [request.greedy for request in chunk]))
        return processors
