"""One ``/infer/`` call as a scheduler job: what is refused, the sampling it resolves to, per-sequence seeds, lazy
encoding, stop strings and swift's reply shape (the rest of the server lives in ``app.py``; merging in
``batching.py``).

- Seeds (docs/design.md#ms310): request ``j``, choice ``k`` samples with ``normalize_seed(seed + j*n + k)``
  (MS310's per-request ``seed + j`` when n = 1; the one seed rule of ``coordexp.runtime.core.distribution``); an
  unset seed (None or 0, as in MS310) draws from the server's own seeded RNG.
- Custom ``stop`` strings (swift honours them): generation ends at the engine's stop tokens, then each choice is cut
  after the first token whose text completes a stop string; that token stays (vLLM keeps it in ``token_ids`` and
  swift decodes the content from them), ``finish_reason`` is ``stop``, logprobs are cut with it.
- System prompt: a request without a system message gets the chat template's own default (as ``swift rollout``
  gives it) unless the server was started with an explicit one (``serve-rollout --system``).
- Items are encoded when the scheduler's round takes them: an item that cannot be encoded (a bad image, a prompt
  too long for ``max_model_len``) fails its whole call with a 400 when its turn comes, and the work already done for
  that call is dropped; refusals that need no encoding come before anything is queued.
"""

from __future__ import annotations

import random
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

from pydantic import ValidationError

from coordexp.runtime.core.distribution import SEED_MASK, normalize_seed
from coordexp.runtime.rollout import protocol as p
from coordexp.runtime.rollout.base import RolloutOutput, RolloutRequest
from coordexp.runtime.server.engine import GenerationParams, TokenLogprob
from coordexp.runtime.server.inputs import InferInputError, encode_served, request_to_prompt
from coordexp.runtime.server.limits import validation_error_detail
from coordexp.schema.rollout import DecodingConfig
from coordexp.schema.template import TemplateConfig

__all__ = ["InferPlanner", "InferJob", "cut_at_stop", "END_OF_TURN_TOKEN", "MAX_TOP_LOGPROBS"]

END_OF_TURN_TOKEN = "<|im_end|>"
MAX_TOP_LOGPROBS = 20  # vLLM's default max_logprobs: what a swift server answers at most


def cut_at_stop(output: RolloutOutput, tokens: Sequence[Any] | None, stops: Sequence[str],
                decode: Callable[[list[int]], str]) -> tuple[RolloutOutput, Any]:
    """``output`` (and its per-token logprobs) cut after the first token whose text completes one of ``stops``;
    unchanged when no stop string occurs. The cut point is the shortest prefix whose decoded text holds a stop
    string (found by bisection: a prefix's text only grows)."""
    ids = list(output.response_token_ids)
    if not stops or not ids or not any(stop in output.text for stop in stops):
        return output, tokens

    def holds(count: int) -> bool:
        text = decode(ids[:count])
        return any(stop in text for stop in stops)

    low, high = 1, len(ids)
    while low < high:
        middle = (low + high) // 2
        if holds(middle):
            high = middle
        else:
            low = middle + 1
    kept = ids[:low]
    cut = replace(output, response_token_ids=tuple(kept), text=decode(kept), finish_reason="stop")
    return cut, (list(tokens)[:low] if tokens is not None else None)


class InferPlanner:
    """Turns ``/infer/`` bodies into :class:`InferJob` s for one engine and shapes their replies."""

    def __init__(self, engine: Any, processor: Any, template: TemplateConfig, *, image_root: Path | None,
                 defaults: GenerationParams, max_model_len: int, model_name: str, system: str | None = None):
        self.engine, self.processor, self.template = engine, processor, template
        self.image_root, self.defaults, self.max_model_len = image_root, defaults, max_model_len
        self.model_name, self.system = model_name, system
        self._lock = threading.Lock()
        self._requests = 0
        self._unseeded = random.Random(0)  # like vLLM's engine seed 0: unseeded calls still reproduce per process
        tokenizer = processor.tokenizer
        self.stop_strings = {END_OF_TURN_TOKEN, tokenizer.eos_token or END_OF_TURN_TOKEN}

    def engine_decode(self, ids: list[int]) -> str:
        """Token ids to text exactly as the engines decode a response (special tokens kept)."""
        return self.processor.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def refused_fields(self, body: p.InferRequestBody) -> list[str]:
        """``field: reason`` for every request field this server would not honour (never silently ignored)."""
        config = body.request_config
        refused = [f"{name}: not an ms-swift 3.12 /infer/ field" for name in p.unknown_infer_fields(body)]
        checks = (
            ("request_config.stream", config.stream, "streaming is not served; send stream: false"),
            ("request_config.structured_outputs_regex", config.structured_outputs_regex is not None,
             "guided decoding is not served (the learner parses and checks rollouts itself)"),
            ("request_config.logprobs", config.logprobs and not callable(getattr(self.engine, "token_logprobs", None)),
             f"the {self.engine.engine_type} engine does not return logprobs"),
            ("request_config.top_logprobs", config.top_logprobs is not None and not config.logprobs,
             "needs logprobs: true"),
            ("request_config.top_logprobs", config.top_logprobs is not None
             and not 0 <= config.top_logprobs <= MAX_TOP_LOGPROBS, f"must be 0..{MAX_TOP_LOGPROBS}"),
            ("request_config.presence_penalty", config.presence_penalty != 0, "not supported; leave it 0"),
            ("request_config.frequency_penalty", config.frequency_penalty != 0, "not supported; leave it 0"),
            ("request_config.length_penalty", config.length_penalty != 1.0,
             "not supported (beam search ranks with the model's own length_penalty); leave it 1.0"),
            ("request_config.best_of", config.best_of not in (None, 1, config.n), "not supported; leave it unset"),
            ("request_config.stop", bool(self.extra_stops(config)) and config.num_beams > 1,
             "stop strings are not served with beam search (num_beams > 1); drop them or use num_beams: 1"),
            ("metrics", body.metrics is not None, "metrics are computed by the client; send null"),
            ("template", body.template is not None, "the server renders with the model's own chat template; send null"),
            ("adapter_request", body.adapter_request is not None,
             "per-request adapters are not served; push weights with the weight-sync endpoints"),
        )
        return refused + [f"{name}: {reason}" for name, bad, reason in checks if bad]

    def extra_stops(self, config: p.RequestConfig) -> tuple[str, ...]:
        """The request's stop strings beyond the engine's own stop tokens, in request order."""
        return tuple(dict.fromkeys(s for s in config.stop if s not in self.stop_strings))

    def generation_params(self, config: p.RequestConfig) -> GenerationParams:
        base = self.defaults.decoding
        decoding = {
            "temperature": base.temperature if config.temperature is None else config.temperature,
            "top_p": base.top_p if config.top_p is None else config.top_p,
            "top_k": base.top_k if config.top_k is None else (-1 if config.top_k <= 0 else config.top_k),
            "num_beams": config.num_beams if config.num_beams > 1 else base.num_beams,
            "repetition_penalty": base.repetition_penalty if config.repetition_penalty is None
            else config.repetition_penalty,
        }
        # the server's own decoding.coord_group_greedy applies to the requests that decode greedily
        decoding["coord_group_greedy"] = (base.coord_group_greedy and decoding["temperature"] == 0
                                          and decoding["num_beams"] == 1)
        try:
            resolved = DecodingConfig.model_validate(decoding)
        except ValidationError as exc:
            raise InferInputError(validation_error_detail(exc.errors(), prefix="request_config")) from None
        max_new = self.defaults.max_new_tokens if config.max_tokens is None else config.max_tokens
        if not 1 <= max_new < self.max_model_len:
            raise InferInputError(f"request_config.max_tokens: {max_new} must be in 1..{self.max_model_len - 1} "
                                  f"(this engine's max_model_len {self.max_model_len} holds prompt and completion)")
        return GenerationParams(max_new_tokens=int(max_new), decoding=resolved,
                                logprobs=(config.top_logprobs or 0) if config.logprobs else None)

    def seeds(self, count: int, n: int, seed: int | None) -> list[int]:
        """Request j, choice k: ``normalize_seed(seed + j*n + k)``; unset (None or 0): the server's own RNG."""
        if seed:
            return [normalize_seed(seed + i) for i in range(count * n)]
        with self._lock:
            return [self._unseeded.randint(1, SEED_MASK) for _ in range(count * n)]

    def job(self, body: p.InferRequestBody) -> "InferJob":
        """The job of one call (raises :class:`InferInputError` for what is refused before any work)."""
        refused = self.refused_fields(body)
        if refused:
            raise InferInputError("these request fields cannot be honoured: " + "; ".join(refused))
        config = body.request_config
        params = self.generation_params(config)
        return InferJob(self, body, params, self.seeds(len(body.infer_requests), config.n, config.seed))

    # -------------------------------------------------------------------------------------------- replies

    def _token_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self.processor.tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", errors="replace"))}

    def choice_logprobs(self, tokens: Sequence[TokenLogprob], with_top: bool) -> p.ChoiceLogprobs:
        """swift's per-choice shape: ``{"content": [{token, logprob, bytes[, top_logprobs]}]}``."""
        content = []
        for entry in tokens:
            item = self._token_entry(entry.token_id, entry.logprob)
            if with_top:
                item["top_logprobs"] = [self._token_entry(i, v) for i, v in entry.top]
            content.append(p.LogprobToken.model_validate(item))
        return p.ChoiceLogprobs(content=content)

    def reply(self, outputs: Sequence[RolloutOutput], logprobs: Sequence[p.ChoiceLogprobs | None],
              details: bool) -> dict[str, Any]:
        with self._lock:
            self._requests += 1
            request_id = str(self._requests)
        prompt_ids = list(outputs[0].prompt_token_ids)
        choices = [p.ChatCompletionChoice(
            index=k, message=p.ResponseMessage(content=out.text),
            finish_reason="length" if out.finish_reason == "length" else "stop", logprobs=logprobs[k],
            token_ids=list(out.response_token_ids) if details else None) for k, out in enumerate(outputs)]
        completion = sum(len(out.response_token_ids) for out in outputs)
        reasons = [out.finish_reason for out in outputs]
        triggered = int("repeat" in reasons)
        response = p.ChatCompletionResponse(
            model=self.model_name, id=request_id, created=int(time.time()), choices=choices,
            usage=p.UsageInfo(prompt_tokens=len(prompt_ids), completion_tokens=completion,
                              total_tokens=len(prompt_ids) + completion),
            prompt_token_ids=prompt_ids if details else None)
        item = p.RolloutResponseItem(response=response, rollout_infos={"repeat_terminate_triggered": triggered},
                                     coordexp=p.CoordexpInferInfo(repeat_terminate_triggered=triggered,
                                                                  finish_reasons=reasons))
        return item.model_dump(mode="json", exclude_none=False)


class InferJob:
    """One ``/infer/`` call for :class:`~coordexp.runtime.server.batching.Scheduler`: items encoded on demand (base64
    images land in a scratch folder that lives until the job ends), outputs post-processed per item."""

    def __init__(self, planner: InferPlanner, body: p.InferRequestBody, params: GenerationParams, seeds: list[int]):
        self.planner, self.body, self.params, self.seeds = planner, body, params, seeds
        self.config = body.request_config
        self.count, self.width = len(body.infer_requests), int(self.config.n)
        self.stops = planner.extra_stops(self.config)
        self._scratch: tempfile.TemporaryDirectory | None = None

    def encode(self, item: int) -> list[RolloutRequest]:
        planner = self.planner
        if self._scratch is None:
            self._scratch = tempfile.TemporaryDirectory(prefix="coordexp-infer-")
        served = request_to_prompt(self.body.infer_requests[item], item, planner.template, planner.image_root,
                                   Path(self._scratch.name), system=planner.system)
        prompt = encode_served(planner.processor, served)
        max_new = self.params.max_new_tokens
        if prompt.prompt_len + max_new > planner.max_model_len:
            raise InferInputError(f"infer_requests[{item}]: the prompt is {prompt.prompt_len} tokens; with max_tokens "
                                  f"{max_new} it exceeds this engine's max_model_len {planner.max_model_len}; "
                                  "shorten the prompt or lower max_tokens")
        n = self.width
        return [RolloutRequest(prompt=prompt, index=item * n + k, seed=self.seeds[item * n + k], record=served.record)
                for k in range(n)]

    def finish(self, item: int, results: list[tuple[RolloutOutput, Any]]) -> list[tuple[RolloutOutput, Any]]:
        decode = self.planner.engine_decode
        with_top = self.config.top_logprobs is not None
        finished = []
        for output, tokens in results:
            output, tokens = cut_at_stop(output, tokens, self.stops, decode)
            finished.append((output, self.planner.choice_logprobs(tokens, with_top) if tokens is not None else None))
        return finished

    def reply(self, results: list[list[tuple[RolloutOutput, Any]]]) -> list[dict[str, Any]]:
        details = self.config.return_details
        return [self.planner.reply([o for o, _ in item], [lp for _, lp in item], details) for item in results]

    def close(self) -> None:
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None
