"""The vLLM engine wrapper: the ONE module that imports vLLM (lazily), shared by the colocate backend and
``coordexp serve-rollout --engine vllm``.

- :class:`EngineSettings` is everything the engine is built from (the contract's ``rollout_matching.vllm``, the
  model path and dtype, the template's pixel budget, the repeat guard). On a CPU-only machine the engine runs
  in-process with the settings verified for vLLM's CPU build (float32 parity with HF, eager, ``uni`` executor,
  a small KV cache); the tensor-parallel size is checked against the visible devices at start.
- Prompts go in as ids with ONE ``<|image_pad|>`` per image plus the images (vLLM expands the pads with the same
  processor and pixel budget); vLLM's returned prompt ids must equal :func:`~coordexp.runtime.model.encoding.encode_prompt`'s
  (the prompt-alignment sanity check), and responses are stop-trimmed by
  :func:`~coordexp.runtime.rollout.base.finish_output` like every backend's.
- Logprobs (``serve-rollout --engine vllm``, ``/infer/`` with ``logprobs: true``) come from the same generate call
  (``SamplingParams(logprobs=k)``), with the engine in vLLM's ``processed_logprobs`` mode: values after the
  repetition penalty and, when sampling, temperature/top-k/top-p, as swift 3.12 reports them. coordexp's logits
  processor runs before them too, so never-emit ids are excluded and a guard-forced EOS has logprob 0.
- :meth:`VllmEngine.load_weights` reloads weights in memory through the worker's layerwise ``reload_weights``
  (re-running the CPU/GPU repacking; a direct ``model.load_weights`` silently does nothing or crashes there),
  then resets the prefix and encoder caches (a stale encoder-cache entry kills the engine on the next image).
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from coordexp.runtime.rollout.base import RolloutOutput, RolloutRequest, finish_output
from coordexp.runtime.rollout.logprobs import TokenLogprob, from_vllm_steps
from coordexp.runtime.model.encoding import IMAGE_PAD_TOKEN, EncodingError, load_images
from coordexp.runtime.core.repeat import RepeatGuard
from coordexp.runtime.rollout.vllm_import import VllmUnavailableError, import_vllm, visible_devices
from coordexp.runtime.rollout.vllm_repeat import (COORD_GROUP_ARG, GUARD_ENV, ProcessorSettings, constructed_count,
                                                 encode_settings)

from coordexp.schema.rollout import RepeatTerminateConfig

if TYPE_CHECKING:
    import torch

    from coordexp.schema.contract import RunContract, VllmEngineContract
    from coordexp.schema.rollout import DecodingConfig

__all__ = ["VllmUnavailableError", "EngineSettings", "AdapterHandle", "VllmEngine", "import_vllm",
           "visible_devices", "END_OF_TURN_TOKEN"]

END_OF_TURN_TOKEN = "<|im_end|>"
CPU_KV_CACHE_BYTES = 256 << 20
MAX_LOGPROBS = 20  # top alternatives per token a request may ask for (vLLM's default max_logprobs, swift's cap)
# vLLM on CPU, in-process: the recipe verified against HF (see docs/testing.md).
CPU_ENVIRONMENT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                   "VLLM_TARGET_DEVICE": "cpu"}
@dataclass(frozen=True)
class EngineSettings:
    """Everything a vLLM engine is built from; :meth:`from_contract` maps ``rollout_matching.vllm`` onto it."""

    model_path: str
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.45
    max_model_len: int = 4096
    max_num_seqs: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    enable_lora: bool = False
    max_lora_rank: int = 64
    seed: int = 0
    min_pixels: int | None = None
    max_pixels: int | None = None
    max_images_per_prompt: int = 1
    # EngineArgs knobs of rollout_matching.vllm.*: None = not passed, vLLM's default applies
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool | None = None
    disable_chunked_mm_input: bool | None = None
    limit_mm_per_prompt: Mapping[str, int] | None = None  # None: {"image": max_images_per_prompt, "video": 0}
    skip_mm_profiling: bool | None = None
    mm_encoder_tp_mode: str | None = None
    sleep_level: int = 0  # > 0: built with enable_sleep_mode; VllmEngine.sleep() uses this level (GPU only)
    repeat_terminate: RepeatTerminateConfig = RepeatTerminateConfig()
    kv_cache_memory_bytes: int | None = None  # CPU: the KV budget in bytes (None: CPU_KV_CACHE_BYTES)
    logprobs_mode: str = "processed_logprobs"  # what SamplingParams(logprobs=k) reports (swift 3.12's choice)

    @property
    def repeat_guard(self) -> RepeatGuard:
        return RepeatGuard.from_config(self.repeat_terminate)

    @classmethod
    def from_contract(cls, vllm: "VllmEngineContract", *, model_path: str, dtype: str, seed: int,
                      repeat_terminate: RepeatTerminateConfig, min_pixels: int | None = None, max_pixels: int | None = None,
                      **overrides: Any) -> "EngineSettings":
        settings = cls(
            model_path=str(model_path), dtype=dtype, tensor_parallel_size=vllm.tensor_parallel_size,
            gpu_memory_utilization=vllm.gpu_memory_utilization, max_model_len=vllm.max_model_len,
            max_num_seqs=vllm.max_num_seqs, enable_prefix_caching=vllm.enable_prefix_caching,
            enforce_eager=vllm.enforce_eager, enable_lora=vllm.enable_lora, seed=seed,
            min_pixels=min_pixels, max_pixels=max_pixels, repeat_terminate=repeat_terminate,
            max_num_batched_tokens=vllm.max_num_batched_tokens, enable_chunked_prefill=vllm.enable_chunked_prefill,
            disable_chunked_mm_input=vllm.disable_chunked_mm_input,
            limit_mm_per_prompt=dict(vllm.limit_mm_per_prompt) if vllm.limit_mm_per_prompt is not None else None,
            skip_mm_profiling=vllm.skip_mm_profiling, mm_encoder_tp_mode=vllm.mm_encoder_tp_mode,
            sleep_level=vllm.sleep_level)
        return replace(settings, **overrides)

    def engine_kwargs(self, device: str) -> dict[str, Any]:
        """``LLM(**kwargs)`` for ``device`` ("cuda" or "cpu"); CPU forces the verified in-process settings."""
        kwargs: dict[str, Any] = dict(
            model=self.model_path, tokenizer=self.model_path, dtype=self.dtype, seed=self.seed,
            max_model_len=self.max_model_len, tensor_parallel_size=self.tensor_parallel_size,
            enable_prefix_caching=self.enable_prefix_caching, enforce_eager=self.enforce_eager,
            limit_mm_per_prompt=dict(self.limit_mm_per_prompt or {"image": self.max_images_per_prompt, "video": 0}),
            logprobs_mode=self.logprobs_mode, max_logprobs=MAX_LOGPROBS,
        )
        if self.max_num_seqs is not None:
            kwargs["max_num_seqs"] = self.max_num_seqs
        for name in ("max_num_batched_tokens", "enable_chunked_prefill", "disable_chunked_mm_input",
                     "skip_mm_profiling", "mm_encoder_tp_mode"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        pixels = {k: v for k, v in (("min_pixels", self.min_pixels), ("max_pixels", self.max_pixels)) if v}
        if pixels:
            kwargs["mm_processor_kwargs"] = pixels
        if self.enable_lora:
            kwargs.update(enable_lora=True, max_lora_rank=self.max_lora_rank, max_loras=1)
        if device == "cpu":
            kwargs.update(enforce_eager=True, distributed_executor_backend="uni",
                          kv_cache_memory_bytes=self.kv_cache_memory_bytes or CPU_KV_CACHE_BYTES)
            if self.dtype == "auto":
                kwargs["dtype"] = "float32"  # bit-level greedy parity with the float32 HF policy
        else:
            kwargs["gpu_memory_utilization"] = self.gpu_memory_utilization
            if self.kv_cache_memory_bytes:
                kwargs["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
            if self.sleep_level:
                kwargs["enable_sleep_mode"] = True  # vLLM's CPU build has no sleep mode: never passed there
        return kwargs


def check_tensor_parallel(size: int, device: str, count: int) -> None:
    """Fail at start when ``tensor_parallel_size`` needs more devices than this process sees."""
    if device == "cpu" and size != 1:
        raise VllmUnavailableError(
            f"rollout_matching.vllm.tensor_parallel_size is {size} but this process sees no GPU (vLLM's CPU build "
            "runs one in-process worker); set rollout_matching.vllm.tensor_parallel_size: 1 on CPU, or run on a "
            "GPU machine")
    if size > count:
        raise VllmUnavailableError(
            f"rollout_matching.vllm.tensor_parallel_size is {size} but this process sees {count} {device} "
            f"device(s) (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); lower "
            f"tensor_parallel_size to at most {count}, or make more GPUs visible to each training process")


@dataclass(frozen=True)
class AdapterHandle:
    """The LoRA adapter rollouts use (``request`` is vLLM's LoRARequest for the folder at ``path``)."""

    int_id: int
    path: str
    request: Any


def collapse_image_pads(input_ids: Sequence[int], pad_id: int) -> list[int]:
    """``encode_prompt`` ids with each run of image pads (one run per image) collapsed to one pad, as vLLM wants."""
    collapsed: list[int] = []
    for token_id in input_ids:
        token_id = int(token_id)
        if token_id == pad_id and collapsed and collapsed[-1] == pad_id:
            continue
        collapsed.append(token_id)
    return collapsed


class VllmEngine:
    """A started vLLM engine plus the tokenizer facts rollouts need; see the module docstring."""

    engine_type = "LLMEngine"  # what /get_engine_type/ reports for vLLM (TRL's convention)

    def __init__(self, llm: Any, settings: EngineSettings, tokenizer: Any, device: str):
        self.llm, self.settings, self.tokenizer, self.device_kind = llm, settings, tokenizer, device
        self.end_of_turn_id = int(tokenizer.convert_tokens_to_ids(END_OF_TURN_TOKEN))
        self.image_pad_id = int(tokenizer.convert_tokens_to_ids(IMAGE_PAD_TOKEN))
        stop = {self.end_of_turn_id}
        if tokenizer.eos_token_id is not None:
            stop.add(int(tokenizer.eos_token_id))
        self.stop_ids = frozenset(stop)
        self._adapter_serial = 0
        self.adapter: AdapterHandle | None = None  # the adapter later generate() calls use
        self.guard = settings.repeat_guard
        self.repeat_terminate = settings.repeat_terminate
        self._adapter_dir = tempfile.TemporaryDirectory(prefix="coordexp-lora-") if settings.enable_lora else None
        self.pieces = None
        if self.guard.active and self.guard.max_object_keys:
            from coordexp.runtime.core.pieces import PieceTable

            self.pieces = PieceTable.for_tokenizer(tokenizer).pieces
        self.start_seconds = 0.0
        self.last_push_seconds = 0.0
        self.asleep = False
        # (output, its logprobs) of the last generate() that asked for them; token_logprobs() reads them back
        self._scored: list[tuple[RolloutOutput, list[TokenLogprob]]] = []

    # -- start / stop -----------------------------------------------------------------------------------------
    @classmethod
    def start(cls, settings: EngineSettings) -> "VllmEngine":
        """Check devices, set the processor's settings, build ``vllm.LLM``; fail fast with the reason."""
        from transformers import AutoTokenizer

        device, count = visible_devices()
        check_tensor_parallel(settings.tensor_parallel_size, device, count)
        if device == "cpu":
            for key, value in CPU_ENVIRONMENT.items():
                os.environ.setdefault(key, value)
        # In-process by default (colocate: weights go to the worker without serialization); an explicit
        # VLLM_ENABLE_V1_MULTIPROCESSING=1 gets the multiprocess engine, whose weight push ships a callable.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        tokenizer = AutoTokenizer.from_pretrained(settings.model_path)
        end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN_TOKEN)
        if end_of_turn is None or end_of_turn == tokenizer.unk_token_id:
            raise ValueError(f"{settings.model_path}: the tokenizer has no {END_OF_TURN_TOKEN} token; rollouts stop "
                             "at the end of the assistant turn, so use a Qwen chat tokenizer")
        os.environ[GUARD_ENV] = encode_settings(ProcessorSettings(settings.repeat_guard, int(end_of_turn)))  # raises
        # on an unusable subtree, before anything starts
        vllm = import_vllm("vllm")
        from coordexp.runtime.rollout.vllm_repeat import PROCESSOR_QUALNAME, processor_class

        in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        processor = processor_class() if in_process else PROCESSOR_QUALNAME
        before = constructed_count()
        started = time.perf_counter()
        try:
            llm = vllm.LLM(logits_processors=[processor], **settings.engine_kwargs(device))
        except Exception as exc:  # vLLM raises many types; name the settings that were used
            raise VllmUnavailableError(
                f"the vLLM engine failed to start for {settings.model_path} on {device} "
                f"(tensor_parallel_size {settings.tensor_parallel_size}, gpu_memory_utilization "
                f"{settings.gpu_memory_utilization}, max_model_len {settings.max_model_len}): "
                f"{type(exc).__name__}: {exc}. Lower gpu_memory_utilization/max_model_len/max_num_seqs, or use "
                "rollout_matching.rollout_backend: hf") from exc
        if in_process and constructed_count() == before:
            llm.llm_engine.engine_core.shutdown()
            raise VllmUnavailableError(
                "the vLLM engine started without constructing coordexp's logits processor, so repeat_terminate and "
                "the never-emit ids would be ignored; this vLLM build does not support V1 logits processors "
                "(LLM(logits_processors=...)). Upgrade vllm, disable rollout_matching.repeat_terminate, or use "
                "rollout_backend: hf")
        engine = cls(llm, settings, tokenizer, device)
        engine.start_seconds = time.perf_counter() - started
        return engine

    @classmethod
    def from_contract(cls, run: "RunContract", **overrides: Any) -> "VllmEngine":
        """Start the engine of a run (``serve-rollout --engine vllm``): its model, dtype, seed, template pixel
        budget, ``rollout_matching.vllm`` settings and repeat guard; ``overrides`` are EngineSettings fields.
        A server engine never sleeps (it does not share its GPU with training), so sleep_level defaults to 0."""
        overrides.setdefault("sleep_level", 0)
        from coordexp.runtime.model.adapters import AdapterDirError, is_adapter_dir

        if is_adapter_dir(run.model.path):  # vLLM would serve the bare base, silently not the trained policy
            raise AdapterDirError(
                f"model.path {run.model.path} is a saved LoRA adapter; serve-rollout --engine vllm serves a full "
                "checkpoint", hint=f"write one with `coordexp export-merged {run.model.path} MERGED_DIR` and point "
                "model.path at MERGED_DIR, or serve with --engine hf (it loads base + adapter)")
        settings = EngineSettings.from_contract(
            run.rollout_matching.serving.engine, model_path=run.model.path, dtype=run.model.dtype, seed=run.seed,
            repeat_terminate=run.rollout_matching.repeat_terminate, min_pixels=run.template.min_pixels,
            max_pixels=run.template.max_pixels, **overrides)
        return cls.start(settings)

    @property
    def world_size(self) -> int:
        return self.settings.tensor_parallel_size

    @property
    def max_model_len(self) -> int:
        """Prompt plus completion tokens one request may hold (the server bounds ``max_tokens`` with it)."""
        return self.settings.max_model_len

    @property
    def supports_adapter(self) -> bool:
        return self.settings.enable_lora

    @property
    def device(self) -> "torch.device":
        import torch

        return torch.device("cuda", torch.cuda.current_device()) if self.device_kind == "cuda" else torch.device("cpu")

    def close(self) -> None:
        """Shut the engine core down (its memory is released); the engine is unusable afterwards."""
        if self.llm is not None:
            core = getattr(self.llm.llm_engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            self.llm = None
        if self._adapter_dir is not None:
            self._adapter_dir.cleanup()
            self._adapter_dir = None

    def _live(self) -> Any:
        if self.llm is None:
            raise RuntimeError("this vLLM engine was closed; start a new one")
        return self.llm

    # -- generation -------------------------------------------------------------------------------------------
    def sampling_params(self, decoding: "DecodingConfig", max_new_tokens: int, seed: int,
                        logprobs: int | None = None) -> Any:
        """vLLM's SamplingParams for ``decoding`` (greedy at temperature 0; beam search is rejected at validation);
        ``logprobs``: also return the sampled token's logprob and that many top alternatives per step."""
        if decoding.num_beams > 1:
            raise ValueError(f"decoding.num_beams {decoding.num_beams}: beam search is not supported by the vLLM "
                             "backend; use rollout_backend: hf or num_beams: 1")
        vllm = import_vllm("vllm")
        greedy = decoding.temperature == 0.0
        return vllm.SamplingParams(
            n=1, max_tokens=int(max_new_tokens), temperature=float(decoding.temperature),
            top_p=1.0 if greedy else float(decoding.top_p), top_k=0 if greedy or decoding.top_k < 1 else decoding.top_k,
            repetition_penalty=float(decoding.repetition_penalty), seed=None if greedy else int(seed),
            stop_token_ids=sorted(self.stop_ids), detokenize=False, skip_special_tokens=False,
            logprobs=None if logprobs is None else int(logprobs), flat_logprobs=logprobs is not None,
            extra_args={COORD_GROUP_ARG: True} if decoding.coord_group_greedy else None,
        )

    def vllm_prompt(self, request: RolloutRequest) -> dict[str, Any]:
        """The TokensPrompt of ``request``: one pad per image, and the record's images (loaded like encode_prompt)."""
        prompt = request.prompt
        n_images = int(prompt.image_grid_thw.shape[0]) if prompt.image_grid_thw is not None else 0
        ids = collapse_image_pads(prompt.input_ids.tolist(), self.image_pad_id)
        entry: dict[str, Any] = {"prompt_token_ids": ids}
        if n_images:
            record = request.record
            if record is None:
                raise ValueError(f"rollout request {request.index} has {n_images} image(s) but no record: the vLLM "
                                 "backend sends the images themselves, so build RolloutRequest(record=...)")
            images = load_images(record)
            entry["multi_modal_data"] = {"image": images if len(images) > 1 else images[0]}
        return entry

    def generate(self, requests: Sequence[RolloutRequest], params: Any = None, *,
                 decoding: "DecodingConfig | None" = None, max_new_tokens: int | None = None) -> list[RolloutOutput]:
        """Roll out ``requests`` in one engine call (vLLM batches them), with the current adapter if any; outputs
        in request order; a request flagged ``greedy`` decodes greedily whatever ``decoding`` samples. ``params``
        is the server's GenerationParams (or pass ``decoding`` and ``max_new_tokens``);
        ``params.logprobs`` set: the logprobs are kept for :meth:`token_logprobs`."""
        logprobs = None
        if params is not None:
            decoding, max_new_tokens, logprobs = params.decoding, params.max_new_tokens, params.logprobs
        if decoding is None or max_new_tokens is None:
            raise TypeError("VllmEngine.generate needs params=GenerationParams(...) or decoding= and max_new_tokens=")
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs {logprobs}: this engine returns 0..{MAX_LOGPROBS} alternatives per token")
        self._scored = []
        if not requests:
            return []
        llm = self._live()
        adapter = self.adapter
        prompts = [self.vllm_prompt(r) for r in requests]
        greedy = decoding.model_copy(update={"temperature": 0.0})  # a reward group's greedy member (request flag)
        params = [self.sampling_params(greedy if r.greedy else decoding, max_new_tokens, r.seed, logprobs)
                  for r in requests]
        results = llm.generate(prompts, params, use_tqdm=False,
                               lora_request=adapter.request if adapter is not None else None)
        outputs = []
        for request, result in zip(requests, results, strict=True):
            expected = request.prompt.input_ids.tolist()
            got = [int(i) for i in result.prompt_token_ids]
            if got != expected:
                position = next((k for k, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
                raise EncodingError(
                    f"vLLM's prompt ids differ from the teacher-forced encoding for request {request.index} at "
                    f"position {position} (vLLM {len(got)} ids, encode_prompt {len(expected)}); the engine must use "
                    "the template's pixel budget (EngineSettings.min_pixels/max_pixels = template.min_pixels/"
                    "max_pixels) and the checkpoint's processor")
            completion = result.outputs[0]
            output = finish_output(got, completion.token_ids, stop_ids=self.stop_ids, decode=self._decode,
                                   guard=self.guard, pieces=self.pieces)
            outputs.append(output)
            if logprobs is not None:
                self._scored.append((output, self._output_logprobs(output, completion, logprobs)))
        return outputs

    def _output_logprobs(self, output: RolloutOutput, completion: Any, top: int) -> list[TokenLogprob]:
        """The logprobs of ``output``'s response ids, then of the stop token when it stopped (the HF engine's
        shape: swift reports the unstripped ids); vLLM's ids past the stop (none in practice) are dropped."""
        kept = len(output.response_token_ids) + (0 if output.finish_reason == "length" else 1)
        ids = [int(i) for i in completion.token_ids[:kept]]
        return from_vllm_steps(ids, completion.logprobs or [], top)

    def token_logprobs(self, requests: Sequence[RolloutRequest], outputs: Sequence[RolloutOutput], params: Any,
                       top: int) -> list[list[TokenLogprob]]:
        """The logprobs vLLM computed while sampling ``outputs`` (the server's RolloutEngine hook): the last
        :meth:`generate` must have produced them with ``params.logprobs >= top``, as ``/infer/`` does."""
        asked = getattr(params, "logprobs", None)
        if asked is None or top > asked:
            raise ValueError(f"token_logprobs(top={top}) needs generate() called with GenerationParams(logprobs >= "
                             f"{top}); vLLM computes logprobs while sampling, not afterwards")
        result = []
        for output in outputs:
            scored = next((tokens for done, tokens in self._scored if done is output), None)
            if scored is None:
                raise ValueError("token_logprobs got an output that the last generate() did not produce with "
                                 "logprobs; call it right after generate(requests, params) with the same params")
            result.append([replace(t, top=t.top[:top]) for t in scored])
        return result

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    # -- weights ----------------------------------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, "torch.Tensor"]]) -> None:
        """Reload weights (HF checkpoint names) in memory, then reset the caches. Multiprocess engines get a
        safetensors blob and a worker-side callable (tensors do not survive vLLM's RPC transport)."""
        llm = self._live()
        started = time.perf_counter()
        tensors = [(name, tensor.detach()) for name, tensor in named_tensors]
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors, "is_checkpoint_format": True})
        else:
            from safetensors.torch import save

            blob = save({name: t.contiguous().cpu() for name, t in tensors})
            llm.collective_rpc(_reload_from_blob, args=(blob,))
        self.reset_caches()
        self.last_push_seconds = time.perf_counter() - started

    push_weights = load_weights

    def sleep(self) -> bool:
        """Release vLLM's GPU memory until :meth:`wake_up` (``settings.sleep_level`` 1: weights to CPU, KV cache
        freed; 2: both freed). A no-op at level 0 and on CPU; whether the engine sleeps now."""
        if self.settings.sleep_level and self.device_kind != "cpu" and not self.asleep:
            self._live().sleep(level=self.settings.sleep_level)
            self.asleep = True
        return self.asleep

    def wake_up(self) -> bool:
        """Undo :meth:`sleep`; True when the weights were discarded (level 2) and must be pushed again."""
        if not self.asleep:
            return False
        self._live().wake_up()
        self.asleep = False
        self.reset_caches()
        return self.settings.sleep_level == 2

    def reset_caches(self) -> bool:
        """Reset the prefix and encoder caches (required after every weight push); whether both resets held."""
        llm = self._live()
        prefix_ok = llm.reset_prefix_cache()
        llm.llm_engine.reset_encoder_cache()
        return prefix_ok is not False

    def load_adapter(self, lora_int_id: int, peft_config: Mapping[str, Any],
                     named_tensors: Iterable[tuple[str, "torch.Tensor"]]) -> AdapterHandle:
        """Make a PEFT LoRA adapter (PEFT state-dict names, ``adapter_config`` dict) the one rollouts use next.

        vLLM loads adapters from a folder only, so the adapter is written to a private temp folder and loaded in
        place under ``lora_int_id`` (a reused id replaces the old weights); the caches are reset.
        """
        if self._adapter_dir is None:
            raise ValueError("adapter sync needs an engine started with enable_lora (rollout_matching.vllm."
                             "enable_lora: true)")
        import json

        from safetensors.torch import save_file

        vllm_lora = import_vllm("vllm.lora.request")
        llm = self._live()
        started = time.perf_counter()
        self._adapter_serial += 1
        folder = Path(self._adapter_dir.name) / f"adapter-{self._adapter_serial}"
        folder.mkdir(parents=True)
        save_file({k: v.detach().contiguous().cpu() for k, v in named_tensors},
                  str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps(dict(peft_config), default=_json_default))
        previous = self.adapter
        if previous is not None and previous.int_id != int(lora_int_id):
            llm.llm_engine.remove_lora(previous.int_id)
        request = vllm_lora.LoRARequest(f"adapter-{int(lora_int_id)}", int(lora_int_id), str(folder),
                                        load_inplace=True)
        self.reset_caches()
        self.adapter = AdapterHandle(int(lora_int_id), str(folder), request)
        self.last_push_seconds = time.perf_counter() - started
        return self.adapter

    def clear_adapter(self) -> None:
        """Roll out with the base weights again (full sync after an adapter fallback)."""
        if self.adapter is not None:
            self._live().llm_engine.remove_lora(self.adapter.int_id)
            self.adapter = None


def _json_default(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if hasattr(value, "value"):
        return value.value
    return str(value)


def _reload_from_blob(worker: Any, blob: bytes) -> None:
    """Runs on each vLLM worker (multiprocess engines): reload the weights held in a safetensors blob."""
    from safetensors.torch import load

    worker.reload_weights(weights_iterator=list(load(blob).items()), is_checkpoint_format=True)
