"""The vLLM colocate backend (``rollout_backend: vllm``, ``vllm.mode: colocate``, the spec's default).

- The engine starts lazily, on the first rollout, on the training process's devices (inside the offload context).
- ``sync_weights(model)`` only records the policy; the next :meth:`generate` pushes its weights in memory first,
  unless the policy's version (:mod:`coordexp.runtime.model.weight_version`: moved by every optimizer step the
  trainer records and every in-place update) is unchanged since the last push. No disk checkpoint reload.
- Sync modes (``vllm.sync.mode``, ``auto`` resolved by the contract): ``full`` pushes all weights, a PEFT LoRA
  policy merged on the fly by :mod:`coordexp.runtime.rollout.weight_export` (new tensors; the training model is
  never merged or touched); ``adapter`` pushes only the LoRA adapter. When an adapter push fails and ``fallback_to_full`` is on,
  the backend warns once and switches to ``full`` for the rest of the run.
- ``offload.*`` (when ``offload.enabled``): parameters and optimizer state leave the device for
  engine start, weight push and inference (:mod:`coordexp.runtime.rollout.offload`); call :meth:`attach_optimizer` first.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from coordexp.runtime.rollout.base import RolloutBackend, RolloutOutput, RolloutRequest
from coordexp.runtime.rollout.offload import offload_context
from coordexp.runtime.rollout.vllm_engine import EngineSettings, VllmEngine
from coordexp.runtime.rollout.weight_export import adapter_state, named_tensors, policy_version
from coordexp.runtime.rollout.weight_sync import WeightSyncError
from coordexp.schema.contract import RolloutMatchingContract, RunContract, VllmColocateContract

__all__ = ["VllmColocateBackend"]

logger = logging.getLogger(__name__)


class VllmColocateBackend(RolloutBackend):
    """Rollouts from a vLLM engine in the training process, synced in memory before each rollout."""

    def __init__(self, rollout: RolloutMatchingContract, *, model: Any, tokenizer: Any, settings: EngineSettings,
                 engine: VllmEngine | None = None, optimizer: Any = None):
        if not isinstance(rollout.backend, VllmColocateContract):
            raise TypeError(f"VllmColocateBackend needs a vllm_colocate backend contract, got {rollout.backend.kind}")
        if rollout.decoding.num_beams > 1:
            raise ValueError("rollout_matching.decoding.num_beams > 1 is not supported by rollout_backend: vllm; "
                             "use rollout_backend: hf for beam search")
        self.rollout = rollout
        self.choice: VllmColocateContract = rollout.backend
        self.settings = settings
        self.sync_mode = self.choice.sync.mode
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
    def from_run(cls, run: RunContract, model: Any, processor: Any, *,
                 engine: VllmEngine | None = None) -> "VllmColocateBackend":
        """The engine starts from ``model.path`` / ``model.dtype`` / ``training.seed`` with the template's pixel
        budget and the contract's engine knobs. ``engine``: an already started engine to share (tests); it is not
        closed by :meth:`close`."""
        rollout = run.rollout_matching
        if not isinstance(rollout.backend, VllmColocateContract):
            raise TypeError(f"VllmColocateBackend needs a vllm_colocate backend contract, got {rollout.backend.kind}")
        from coordexp.runtime.model.adapters import adapter_base, is_adapter_dir

        # a saved adapter as model.path: vLLM starts from its base; the first push brings the adapter's weights
        model_path = adapter_base(run.model.path) if is_adapter_dir(run.model.path) else run.model.path
        settings = EngineSettings.from_contract(
            rollout.backend.engine, model_path=model_path, dtype=run.model.dtype, seed=run.seed,
            repeat_terminate=rollout.repeat_terminate, min_pixels=run.template.min_pixels,
            max_pixels=run.template.max_pixels)
        return cls(rollout, model=model, tokenizer=processor.tokenizer, settings=settings, engine=engine)

    @property
    def chunk_size(self) -> int:
        """Prompts per engine generate call: decode_batch_size, capped by vllm.infer_batch_size when set."""
        cap = self.choice.engine.infer_batch_size
        return min(self.rollout.decode_batch_size, cap) if cap else self.rollout.decode_batch_size

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
        offload = self.choice.offload
        with offload_context(self._model, self._optimizer, offload, active=offload.enabled) as report:
            if self._engine is None:
                self._engine = VllmEngine.start(self.settings)
            elif self._engine.wake_up():
                self._pushed_version = None  # sleep_level 2 discarded the weights: push them again
            self._push_if_changed()
            outputs: list[RolloutOutput] = []
            step = self.chunk_size
            for start in range(0, len(requests), step):
                outputs += self._engine.generate(requests[start:start + step], decoding=self.rollout.decoding,
                                                 max_new_tokens=self.rollout.max_new_tokens)
            self._engine.sleep()  # vllm.sleep_level > 0: free vLLM's GPU memory while the learner trains
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
                adapter = adapter_state(self._model)
                self._engine.load_adapter(self._adapter_id, adapter.config, adapter.tensors)
            except Exception as exc:  # any adapter failure: fall back per spec, or stop with the reason
                if not self.choice.sync.fallback_to_full:
                    raise WeightSyncError(
                        f"vllm.sync.mode: adapter failed ({type(exc).__name__}: {exc})",
                        hint="set rollout_matching.vllm.sync.fallback_to_full: true or sync.mode: full") from exc
                if not self._warned_fallback:
                    logger.warning("vLLM adapter sync failed (%s: %s); switching to full merged-weight sync for the "
                                   "rest of this run (vllm.sync.fallback_to_full)", type(exc).__name__, exc)
                    self._warned_fallback = True
                self.sync_mode = "full"
                self._engine.clear_adapter()
        if self.sync_mode == "full":
            self._engine.clear_adapter()
            self._engine.load_weights(named_tensors(self._model))
        self.pushes += 1
        self._pushed_version = policy_version(self._model)
