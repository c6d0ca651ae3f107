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
- ``hf_generate.label_drafts``: requests carrying ``draft_token_ids`` (their ground truth) decode by speculative
  decoding with that draft (:mod:`coordexp.runtime.rollout.label_drafts`): the same tokens, fewer forwards; with a
  static cache, compile or beam search the chunk decodes plainly (docs/design.md, Label-drafted decoding).
  ``run_metadata()`` reports the last call's :class:`~coordexp.runtime.rollout.label_drafts.DraftFigures`.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any, Sequence

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from coordexp.runtime.rollout.coord_group import coord_id_tensor
from coordexp.runtime.rollout.base import RolloutBackend, RolloutOutput, RolloutRequest, finish_output
from coordexp.runtime.rollout.hf_processors import (
    CoordGroupGreedy,
    PaddingAwareRepetitionPenalty,
    RepeatGuardProcessor,
    SeededSampler,
)
from coordexp.runtime.rollout.logprobs import never_emit_ids
from coordexp.runtime.rollout.label_drafts import (
    DraftFigures,
    TokenChooser,
    decode_with_label_drafts,
    unsupported_generation_fields,
)
from coordexp.runtime.rollout.merged_decode import MergedDecodeModel
from coordexp.runtime.rollout.weight_export import unwrap_model, zero3_partitioned
from coordexp.runtime.rollout.zero3_decode import GatheredDecodeModel
from coordexp.runtime.core.pieces import PieceTable
from coordexp.runtime.core.repeat import RepeatGuard
from coordexp.schema.contract import RunContract
from coordexp.schema.rollout import DecodingConfig, HfGenerateConfig, RepeatTerminateConfig

__all__ = ["HfRolloutBackend", "CoordGroupGreedy", "RepeatGuardProcessor", "SeededSampler",
           "PaddingAwareRepetitionPenalty", "CACHE_LENGTH_BUCKET", "row_bucket"]

logger = logging.getLogger("coordexp.rollout.hf")
END_OF_TURN_TOKEN = "<|im_end|>"
CACHE_LENGTH_BUCKET = 128  # static KV cache lengths are whole multiples of this (fewer sizes, fewer recompiles)


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
        self.draft_figures = DraftFigures()  # label drafts over this backend's life (telemetry, the benchmark)
        self._call_figures = DraftFigures()  # ... in the last generate() call (run_metadata)
        self._draft_fallbacks: set[str] = set()  # reasons already logged for decoding plainly despite label_drafts

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
        self._call_figures = DraftFigures()
        outputs: list[RolloutOutput] = []
        for start in range(0, len(requests), self.decode_batch_size):
            outputs.extend(self._generate_chunk(list(requests[start:start + self.decode_batch_size])))
        self.draft_figures.add(self._call_figures)
        return outputs

    def run_metadata(self) -> dict[str, Any]:
        """The last call's label-draft figures (:class:`DraftFigures`), when it decoded with drafts."""
        if not self._call_figures.forwards:
            return {}
        return {"label_drafts": self._call_figures.as_dict()}

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
                self.decode_calls += 1
                if self._label_drafts_apply(chunk, static=static, config=config):
                    generated = self._decode_drafted(policy, chunk, batch, config, stop_ids)
                else:
                    generated = self._generate_plainly(policy, rows, batch, pad_lengths, config, compiled)
        finally:
            policy.train(was_training)
        decode = self._decode
        return [
            finish_output(request.prompt.input_ids.tolist(), ids, stop_ids=stop_ids, decode=decode,
                          guard=self.guard, pieces=self._pieces)
            for request, ids in zip(chunk, generated[:len(chunk)])
        ]

    def _generate_plainly(self, policy: Any, rows: list[RolloutRequest], batch: dict, pad_lengths: torch.Tensor,
                          config: Any, compiled: bool) -> list[list[int]]:
        """``generate`` with the backend's logits processors; each row's ids after the prompt (padding included)."""
        width = batch["input_ids"].shape[1]
        started = time.perf_counter()
        result = policy.generate(**batch, generation_config=config,
                                 logits_processor=LogitsProcessorList(self._processors(rows, pad_lengths, width)))
        if compiled:
            self._note_compiled_call(len(rows), getattr(policy, "_previous_max_cache_length", 0),
                                     time.perf_counter() - started)
        sequences = result if isinstance(result, torch.Tensor) else result.sequences
        return sequences[:, width:].tolist()

    def _label_drafts_apply(self, chunk: list[RolloutRequest], *, static: bool, config: Any) -> bool:
        """Whether this chunk decodes with label drafts: on (``null``: unless a static cache or beam search decodes,
        the documented defaults), some request carries a draft, and nothing this decoding does not reproduce is on
        (said once per reason where drafts were asked for or the generation config is the cause: those chunks decode
        plainly)."""
        asked = self.hf_generate.label_drafts
        if asked is False or not any(r.draft_token_ids for r in chunk):
            return False
        beam_search = self.decoding.num_beams > 1
        if asked is None and (static or beam_search):
            return False
        reason = None
        if beam_search:
            reason = "beam search keeps its beams in generate()"
        elif static:
            reason = "the static KV cache (and compile) run inside generate()"
        elif unsupported_generation_fields(config):
            reason = f"the model's generation config sets {unsupported_generation_fields(config)}"
        if reason is not None and reason not in self._draft_fallbacks:
            self._draft_fallbacks.add(reason)
            logger.info("hf_generate.label_drafts: decoding plainly because %s (outputs are the same either way)",
                        reason)
        return reason is None

    def _decode_drafted(self, policy: Any, chunk: list[RolloutRequest], batch: dict, config: Any,
                        stop_ids: frozenset[int]) -> list[list[int]]:
        """The chunk decoded by :func:`decode_with_label_drafts` (the same tokens as :meth:`_generate_plainly`)."""
        if self.decoding.coord_group_greedy and self._coord_ids is None:
            self._coord_ids = coord_id_tensor(self._tokenizer)
        device = batch["input_ids"].device
        chooser = TokenChooser(seeds=[r.seed for r in chunk], greedy=[r.greedy for r in chunk],
                               decoding=self.decoding, never_emit=config.suppress_tokens or (),
                               coord_ids=self._coord_ids if self.decoding.coord_group_greedy else None,
                               guard=self.guard, pieces=self._pieces, eos_id=self.end_of_turn_id, device=device)
        generated, figures = decode_with_label_drafts(
            policy, batch, [r.prompt.input_ids.tolist() for r in chunk], [r.draft_token_ids for r in chunk],
            chooser=chooser, stop_ids=stop_ids, max_new_tokens=self.max_new_tokens,
            draft_tokens=self.hf_generate.draft_tokens, filler_id=self._pad_id(policy))
        self._call_figures.add(figures)
        return generated

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
        never = never_emit_ids(self._tokenizer, vocab_rows, config.suppress_tokens or ())
        config.update(
            max_new_tokens=self.max_new_tokens, max_length=None, min_new_tokens=None, min_length=0,
            do_sample=False,  # sampling is SeededSampler's job (per-request generators)
            num_beams=self.decoding.num_beams, num_return_sequences=1,
            temperature=1.0, top_p=1.0, top_k=None, repetition_penalty=1.0,
            eos_token_id=eos_ids, pad_token_id=self._pad_id(policy), suppress_tokens=never,
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
