"""The vLLM colocate backend (``rollout_backend: vllm``, ``vllm.mode: colocate``, the spec's default).

- The engine starts lazily, on the first rollout, on the training process's devices (inside the offload context).
- ``sync_weights(model)`` only records the policy; the next :meth:`generate` pushes its weights in memory first,
  unless the policy's parameter version is unchanged since the last push (every in-place update, an optimizer
  step or a ``load_state_dict``, bumps ``tensor._version``). No disk checkpoint reload.
- Sync modes (``vllm.sync.mode``, ``auto`` resolved by the contract): ``full`` pushes all weights, a PEFT LoRA
  policy merged on the fly (``W + scale * B @ A`` computed into new tensors; the training model is never merged or
  touched); ``adapter`` pushes only the LoRA adapter. When an adapter push fails and ``fallback_to_full`` is on,
  the backend warns once and switches to ``full`` for the rest of the run.
- ``offload.*`` (when the contract says ``offload_active``): parameters and optimizer state leave the device for
  engine start, weight push and inference (:mod:`coordexp.runtime.rollout.offload`); call :meth:`attach_optimizer` first.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Sequence

import torch

from coordexp.runtime.rollout.base import RolloutBackend, RolloutOutput, RolloutRequest
from coordexp.runtime.rollout.offload import offload_context
from coordexp.runtime.rollout.vllm_engine import EngineSettings, VllmEngine
from coordexp.schema.contract import RolloutMatchingContract

__all__ = ["VllmColocateBackend", "policy_named_tensors", "policy_version", "adapter_state"]

logger = logging.getLogger(__name__)
_PEFT_PREFIX = "base_model.model."
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _unwrap(model: Any) -> Any:
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def _is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "base_model")


def policy_version(model: Any) -> tuple:
    """A cheap fingerprint of the policy's parameter values: ``(name, tensor._version)`` per parameter (any
    in-place update bumps ``_version``); equal fingerprints mean no push is needed."""
    return (id(model),) + tuple((name, p._version) for name, p in _unwrap(model).named_parameters())


def policy_named_tensors(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights under HF checkpoint names; a PEFT LoRA model is merged on the fly into new tensors
    (``base + delta``), so the training model itself is never merged."""
    model = _unwrap(model)
    if not _is_peft(model):
        yield from ((name, p.detach()) for name, p in model.named_parameters())
        return
    from peft.tuners.lora import LoraLayer

    adapter = model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapter[0]
    lora_modules = {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    for name, parameter in model.named_parameters():
        if ".lora_" in name or ".original_module." in name:
            continue
        hf_name = name[len(_PEFT_PREFIX):] if name.startswith(_PEFT_PREFIX) else name
        hf_name = hf_name.replace(f".modules_to_save.{adapter}.", ".")
        tensor = parameter.detach()
        if ".base_layer." in name:
            owner = name.split(".base_layer.")[0]
            hf_name = hf_name.replace(".base_layer.", ".")
            module = lora_modules.get(owner)
            if module is not None and name.endswith(".weight") and not module.merged \
                    and adapter in getattr(module, "lora_A", {}):
                with torch.no_grad():
                    tensor = tensor + module.get_delta_weight(adapter).to(tensor.dtype)
        yield hf_name, tensor


def adapter_state(model: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The active LoRA adapter's tensors and ``adapter_config`` dict (what PEFT's ``save_pretrained`` writes)."""
    model = _unwrap(model)
    if not _is_peft(model):
        raise ValueError(f"vllm.sync.mode: adapter needs a PEFT LoRA policy, got {type(model).__name__}; use "
                         "sync.mode: full (or auto) for a fully fine-tuned model")
    from peft import get_peft_model_state_dict

    adapter = model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapter[0]
    tensors = get_peft_model_state_dict(model, adapter_name=adapter)
    config = model.peft_config[adapter].to_dict()
    return tensors, config


def _model_path(model: Any) -> str:
    inner = _unwrap(model)
    inner = inner.get_base_model() if _is_peft(inner) else inner
    path = getattr(inner, "name_or_path", None) or getattr(getattr(inner, "config", None), "_name_or_path", None)
    if not path:
        raise ValueError("the vLLM colocate backend starts its engine from the policy's checkpoint folder; pass "
                         "model_path=... (the model was not loaded with from_pretrained)")
    return str(path)


class VllmColocateBackend(RolloutBackend):
    """Rollouts from a vLLM engine in the training process, synced in memory before each rollout."""

    name = "vllm_colocate"

    def __init__(self, rollout: RolloutMatchingContract, *, model: Any, tokenizer: Any, settings: EngineSettings,
                 engine: VllmEngine | None = None, optimizer: Any = None):
        if rollout.decoding.num_beams > 1:
            raise ValueError("rollout_matching.decoding.num_beams > 1 is not supported by rollout_backend: vllm; "
                             "use rollout_backend: hf for beam search")
        self.rollout = rollout
        self.settings = settings
        self.sync_mode = rollout.vllm.sync_mode
        self._model = model
        self._tokenizer = tokenizer
        self._optimizer = optimizer
        self._engine = engine
        self._owns_engine = engine is None
        self._pushed_version: tuple | None = None
        self._adapter_id = 1
        self._warned_fallback = False
        self.pushes = 0  # weight/adapter pushes made (tests and telemetry read it)
        self.skipped_pushes = 0
        self.last_offload = None

    @classmethod
    def from_contract(cls, rollout: RolloutMatchingContract, *, model: Any, tokenizer: Any,
                      **options: Any) -> "VllmColocateBackend":
        """Options: ``model_path`` (default: the policy's ``name_or_path``), ``dtype`` (default: the policy's),
        ``seed``, ``template`` (its pixel budget is the engine's), ``optimizer`` (for offload), ``engine`` (an
        already started :class:`VllmEngine` to share; it is not closed by :meth:`close`), ``engine_overrides``
        (extra :class:`EngineSettings` fields, e.g. ``kv_cache_memory_bytes``)."""
        known = {"model_path", "dtype", "seed", "template", "optimizer", "engine", "engine_overrides"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"the vLLM colocate backend got unknown options {unknown}; known: {sorted(known)}")
        template = options.get("template")
        dtype = options.get("dtype") or _DTYPE_NAMES.get(getattr(_unwrap(model), "dtype", None), "auto")
        settings = EngineSettings.from_contract(
            rollout.vllm, model_path=options.get("model_path") or _model_path(model), dtype=dtype,
            seed=int(options.get("seed", 0)), repeat_terminate=rollout.repeat_terminate,
            min_pixels=getattr(template, "min_pixels", None), max_pixels=getattr(template, "max_pixels", None),
            **(options.get("engine_overrides") or {}))
        return cls(rollout, model=model, tokenizer=tokenizer, settings=settings, engine=options.get("engine"),
                   optimizer=options.get("optimizer"))

    def attach_optimizer(self, optimizer: Any) -> None:
        """The optimizer whose state the offload context moves (the trainer creates it after the backend)."""
        self._optimizer = optimizer

    @property
    def engine(self) -> VllmEngine | None:
        return self._engine

    def sync_weights(self, model: Any) -> None:
        self._model = model

    def close(self) -> None:
        if self._engine is not None and self._owns_engine:
            self._engine.close()
        self._engine = None
        self._model = None

    def generate(self, requests: Sequence[RolloutRequest]) -> list[RolloutOutput]:
        if self._model is None:
            raise RuntimeError("this vLLM colocate backend was closed; create a new one")
        if not requests:
            return []
        offload = self.rollout.offload
        with offload_context(self._model, self._optimizer, offload, active=self.rollout.offload_active) as report:
            if self._engine is None:
                self._engine = VllmEngine.start(self.settings)
            self._push_if_changed()
            outputs: list[RolloutOutput] = []
            step = self.rollout.decode_batch_size
            for start in range(0, len(requests), step):
                outputs += self._engine.generate(requests[start:start + step], decoding=self.rollout.decoding,
                                                 max_new_tokens=self.rollout.max_new_tokens)
        self.last_offload = report
        return outputs

    # -- weight sync ------------------------------------------------------------------------------------------
    def _push_if_changed(self) -> None:
        version = policy_version(self._model)
        if version == self._pushed_version:
            self.skipped_pushes += 1
            return
        if self.sync_mode == "adapter":
            try:
                tensors, config = adapter_state(self._model)
                self._engine.load_adapter(self._adapter_id, config, tensors.items())
            except Exception as exc:  # any adapter failure: fall back per spec, or stop with the reason
                if not self.rollout.vllm.fallback_to_full:
                    raise RuntimeError(f"vllm.sync.mode: adapter failed ({type(exc).__name__}: {exc}); set "
                                       "rollout_matching.vllm.sync.fallback_to_full: true or sync.mode: full") from exc
                if not self._warned_fallback:
                    logger.warning("vLLM adapter sync failed (%s: %s); switching to full merged-weight sync for the "
                                   "rest of this run (vllm.sync.fallback_to_full)", type(exc).__name__, exc)
                    self._warned_fallback = True
                self.sync_mode = "full"
                self._engine.clear_adapter()
        if self.sync_mode == "full":
            self._engine.clear_adapter()
            self._engine.load_weights(policy_named_tensors(self._model))
        self.pushes += 1
        self._pushed_version = policy_version(self._model)
