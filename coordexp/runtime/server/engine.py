"""The engine a rollout server drives (:class:`RolloutEngine`), and :class:`HfEngine`, its transformers version.

The server calls every engine method from ONE worker thread, in arrival order (FIFO), so an engine needs no locks
and a weight update queued before an ``/infer/`` is applied before it. One ``generate`` call may hold the requests
of several concurrent ``/infer/`` calls (``batching.py``): outputs must depend on each request and its own seed only,
never on the other requests in the list. The vLLM engine
(``coordexp.runtime.rollout.vllm_engine``) implements the same protocol.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Protocol, Sequence, runtime_checkable

from coordexp.errors import ExternalSystemError
from coordexp.runtime.rollout.base import RolloutOutput, RolloutRequest
from coordexp.runtime.rollout.logprobs import TokenLogprob, never_emit_ids, processed_logprobs
from coordexp.schema.rollout import DecodingConfig, RepeatTerminateConfig

if TYPE_CHECKING:
    import torch

    from coordexp.schema.contract import RunContract

__all__ = ["GenerationParams", "TokenLogprob", "RolloutEngine", "EngineError", "HfEngine"]


@dataclass(frozen=True)
class GenerationParams:
    """The sampling of one ``/infer/`` call, resolved against the config (request values win, config fills the
    rest). Sampling seeds are per request (:attr:`RolloutRequest.seed`, always >= 1 from the server)."""

    max_new_tokens: int
    decoding: DecodingConfig
    # logprobs the reply will carry: None (none), else the number of top alternatives per token (0: the chosen
    # token only); engines that score while sampling (vLLM) ask for them in the same generate call
    logprobs: int | None = None


class EngineError(ExternalSystemError, RuntimeError):
    """The engine cannot do what was asked (e.g. an unknown weight name, no LoRA support); the text says why."""


@runtime_checkable
class RolloutEngine(Protocol):
    """What ``coordexp serve-rollout`` needs from an inference engine.

    - ``engine_type``: reported by ``POST /get_engine_type/`` (``"LLMEngine"`` for vLLM, ``"HfEngine"``).
    - ``world_size``: ``tp * dp``, reported by ``GET /get_world_size/`` (the client's request-capacity weight).
    - ``device``: where received weights are placed (``cuda:k`` -> NCCL weight sync, ``cpu`` -> gloo).
    - ``supports_adapter``: whether :meth:`load_adapter` works (``enable_lora`` in ``/get_engine_type/``).
    - ``repeat_terminate``: the config subtree installed at construction (active iff ``enabled``); an engine that
      cannot activate an enabled guard must raise in its constructor, never run without it.

    Optional: ``token_logprobs(requests, outputs, params, top)`` -> one ``list[TokenLogprob]`` per output, covering
    its response ids then the stop token when it stopped (swift reports the unstripped ids), called after
    ``generate`` with the same params (``params.logprobs`` set: an engine may compute them while sampling). An
    engine without it answers ``logprobs: true`` with a 400 that says so.
    """

    engine_type: str
    world_size: int
    device: "torch.device"
    supports_adapter: bool
    repeat_terminate: RepeatTerminateConfig

    def generate(self, requests: Sequence[RolloutRequest], params: GenerationParams) -> list[RolloutOutput]:
        """One output per request, in order; ``prompt_token_ids`` equal ``request.prompt.input_ids`` and
        ``response_token_ids`` have the stop token stripped (use :func:`~coordexp.runtime.rollout.registry.finish_output`)."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, "torch.Tensor"]]) -> None:
        """Copy full HF-named weights (a subset is fine: one bucket at a time) into the model; unknown names or
        wrong shapes raise :class:`EngineError` and nothing of that call is half-applied where avoidable."""
        ...

    def load_adapter(self, lora_int_id: int, peft_config: Mapping[str, Any],
                     named_tensors: Iterable[tuple[str, "torch.Tensor"]]) -> None:
        """Install a LoRA adapter (PEFT state-dict names) used by later ``generate`` calls."""
        ...

    def reset_caches(self) -> bool:
        """Drop prefix/KV caches that hold activations of old weights; returns success."""
        ...

    def close(self) -> None:
        """Release the model and its memory."""
        ...


class HfEngine:
    """A rollout engine on transformers ``generate`` with its OWN copy of the model (not the learner's).

    Generation is :class:`~coordexp.runtime.rollout.hf.HfRolloutBackend` (the same decoding, repeat guard and
    stop trimming as the HF rollout backend), one backend per distinct :class:`GenerationParams`.
    """

    engine_type = "HfEngine"
    world_size = 1
    supports_adapter = False

    def __init__(self, model: Any, tokenizer: Any, *, decode_batch_size: int,
                 repeat_terminate: RepeatTerminateConfig, hf_generate: Any = None):
        from coordexp.runtime.core.repeat import RepeatGuard

        self._model = model
        self._tokenizer = tokenizer
        self.decode_batch_size = int(decode_batch_size)
        self.repeat_terminate = repeat_terminate
        self.hf_generate = hf_generate  # rollout_matching.hf_generate (None: the HF backend's default, off)
        self._guard = RepeatGuard.from_config(repeat_terminate)  # raises on an unusable subtree: start-up fails
        self._backends: dict[GenerationParams, Any] = {}
        self.weights_loaded = 0  # tensors copied in by load_weights (tests and logs read it)

    @classmethod
    def from_contract(cls, run: "RunContract", *, model: Any = None, processor: Any = None) -> "HfEngine":
        """Load the config's model (``launch.load_policy``) unless given; decoding knobs come per call.

        The engine serves the checkpoint's own weights whatever ``tuner`` says: a learner config's LoRA/DoRA block
        would wrap a fresh adapter whose names refuse the learner's full-weight pushes. A saved adapter as
        ``model.path`` (or a PEFT model given) is merged once into a plain model, which takes those pushes."""
        if model is None or processor is None:
            import dataclasses

            from coordexp.runtime.model.policy import load_policy
            from coordexp.schema.tuner import TunerConfig

            served = dataclasses.replace(run, tuner=TunerConfig(),
                                         model=run.model.model_copy(update={"gradient_checkpointing": False}))
            model, processor = load_policy(served)
        from coordexp.runtime.rollout.weight_export import is_peft

        if is_peft(model):
            model = model.merge_and_unload()
        model.eval()
        model.requires_grad_(False)
        rollout = run.rollout_matching
        return cls(model, processor.tokenizer, decode_batch_size=rollout.decode_batch_size,
                   repeat_terminate=rollout.repeat_terminate, hf_generate=rollout.hf_generate)

    @property
    def device(self) -> "torch.device":
        return next(self._require_model().parameters()).device

    @property
    def model(self) -> Any:
        return self._require_model()

    def _require_model(self) -> Any:
        if self._model is None:
            raise EngineError("this engine was closed; restart the server")
        return self._model

    def _backend(self, params: GenerationParams) -> Any:
        params = replace(params, logprobs=None)  # logprobs are scored afterwards: one backend for both
        backend = self._backends.get(params)
        if backend is None:
            from coordexp.runtime.rollout.hf import HfRolloutBackend

            backend = HfRolloutBackend(self._require_model(), self._tokenizer,
                                       decode_batch_size=self.decode_batch_size,
                                       max_new_tokens=params.max_new_tokens, decoding=params.decoding,
                                       repeat_terminate=self._guard, hf_generate=self.hf_generate)
            self._backends[params] = backend
        return backend

    def generate(self, requests: Sequence[RolloutRequest], params: GenerationParams) -> list[RolloutOutput]:
        if not requests:
            return []
        try:
            return self._backend(params).generate(requests)
        except ValueError as exc:  # unsupported decoding combination (e.g. beam sampling)
            raise EngineError(str(exc)) from None

    def token_logprobs(self, requests: Sequence[RolloutRequest], outputs: Sequence[RolloutOutput],
                       params: GenerationParams, top: int) -> list[list[TokenLogprob]]:
        """Teacher-forced log-probabilities of each output's tokens (response ids, then ``<|im_end|>`` when it
        stopped), one forward per request, with the sampling transforms of ``params`` applied as vLLM does for
        ``processed_logprobs`` (:func:`~coordexp.runtime.rollout.logprobs.processed_logprobs`: repetition penalty,
        the never-emit mask, ``coord_group_greedy``'s rule, then when sampling temperature, top-k and top-p). The
        repeat guard's forced EOS is not part of it."""
        import torch

        model = self._require_model()
        stop_id = int(self._tokenizer.convert_tokens_to_ids("<|im_end|>"))
        device = self.device
        coord_ids = self._coord_ids() if params.decoding.coord_group_greedy else None
        never = never_emit_ids(self._tokenizer, model.get_output_embeddings().weight.shape[0],
                               getattr(model.generation_config, "suppress_tokens", None) or ())
        results: list[list[TokenLogprob]] = []
        with torch.no_grad():
            for request, output in zip(requests, outputs, strict=True):
                generated = list(output.response_token_ids) + ([stop_id] if output.finish_reason != "length" else [])
                if not generated:
                    results.append([])
                    continue
                prompt = request.prompt
                ids = torch.cat([prompt.input_ids, torch.tensor(generated, dtype=torch.long)])
                inputs: dict[str, Any] = {
                    "input_ids": ids[None].to(device), "attention_mask": torch.ones_like(ids)[None].to(device),
                    "mm_token_type_ids": torch.cat([prompt.mm_token_type_ids, torch.zeros(len(generated),
                                                                                          dtype=torch.long)])[None].to(device)}
                if prompt.image_grid_thw.shape[0]:
                    pixel_values = prompt.pixel_values.to(device)
                    inputs["pixel_values"] = pixel_values.to(model.dtype) if pixel_values.is_floating_point() \
                        else pixel_values
                    inputs["image_grid_thw"] = prompt.image_grid_thw.to(device)
                start = int(prompt.input_ids.shape[0]) - 1
                logits = model(**inputs).logits[0, start:start + len(generated)].float()
                logprobs = processed_logprobs(logits, ids.to(device), start + 1, params.decoding, coord_ids,
                                              never)
                chosen = torch.tensor(generated, device=logprobs.device)
                values = logprobs.gather(1, chosen[:, None])[:, 0].tolist()
                tops: list[tuple[tuple[int, float], ...]] = [()] * len(generated)
                if top > 0:
                    best = logprobs.topk(min(top, logprobs.shape[1]), dim=1)
                    tops = [tuple((int(i), float(v)) for i, v in zip(row_ids, row_values) if v != float("-inf"))
                            for row_ids, row_values in zip(best.indices.tolist(), best.values.tolist())]
                results.append([TokenLogprob(token_id=t, logprob=float(v), top=tp)
                                for t, v, tp in zip(generated, values, tops)])
        return results

    def load_weights(self, named_tensors: Iterable[tuple[str, "torch.Tensor"]]) -> None:
        import torch

        state = self._require_model().state_dict()
        pairs = list(named_tensors)
        unknown = [name for name, _ in pairs if name not in state]
        if unknown:
            shown = ", ".join(unknown[:5]) + (f" (+{len(unknown) - 5} more)" if len(unknown) > 5 else "")
            raise EngineError(f"{len(unknown)} weight name(s) are not parameters of the served model: {shown}; send "
                              "HF checkpoint names of the same architecture (LoRA merged, PEFT prefixes stripped)")
        wrong = [(n, tuple(t.shape), tuple(state[n].shape)) for n, t in pairs if tuple(t.shape) != tuple(state[n].shape)]
        if wrong:
            name, got, want = wrong[0]
            raise EngineError(f"{len(wrong)} weight(s) have the wrong shape, e.g. {name}: got {list(got)}, the served "
                              f"model has {list(want)}; the learner and the server must hold the same model")
        with torch.no_grad():
            for name, tensor in pairs:
                state[name].copy_(tensor)
        self.weights_loaded += len(pairs)

    def load_adapter(self, lora_int_id: int, peft_config: Mapping[str, Any],
                     named_tensors: Iterable[tuple[str, "torch.Tensor"]]) -> None:
        raise EngineError("the HF rollout engine serves merged weights only (no LoRA adapters); use "
                          "rollout_matching.vllm.sync.mode: full (or fallback_to_full: true), or serve with "
                          "--engine vllm and vllm.enable_lora: true")

    def reset_caches(self) -> bool:
        return True  # generate() keeps no cache across calls

    def _coord_ids(self) -> "torch.Tensor":
        from coordexp.runtime.rollout.coord_group import coord_id_tensor

        return coord_id_tensor(self._tokenizer)

    def close(self) -> None:
        self._backends.clear()
        self._model = None
