"""The rollout backend interface (docs/design.md, rollout backend interface).

The trainer talks to every backend (HF ``generate``, vLLM colocate, vLLM server) through :class:`RolloutBackend`
and gets the same :class:`RolloutOutput` fields back, so strict token-aligned parsing never depends on which one ran.
The interface declares every hook the trainer calls (no-op defaults), so the trainer never probes a backend.
:func:`finish_output` is the one place that turns raw generated ids into an output (stop trim and finish reason),
so every backend trims and labels identically.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

from coordexp.errors import ExternalSystemError
from coordexp.runtime.core.repeat import RepeatGuard, count_object_keys, should_terminate

if TYPE_CHECKING:
    from coordexp.runtime.model.data import DetectionRecord
    from coordexp.runtime.model.encoding import EncodedPrompt
    from coordexp.schema.contract import RunContract

__all__ = [
    "FinishReason",
    "RolloutRequest",
    "RolloutOutput",
    "RolloutBackend",
    "BackendUnavailableError",
    "finish_output",
]

FinishReason = Literal["stop", "length", "repeat"]


@dataclass(frozen=True)
class RolloutRequest:
    """One sample to roll out: its encoded prompt (which defines ``prompt_token_ids``), its position in the
    trainer's batch, and its sampling seed. ``record`` is for backends that must send image paths (vLLM server).
    ``greedy``: decode this request greedily although the run samples (the reward objective's greedy group member;
    the HF backend honours it, and validation refuses it for the others). ``draft_token_ids`` is the record's ground
    truth as the model is trained to write it (the stage-1 target ids,
    :func:`coordexp.runtime.train.rollout_step.label_draft_ids`): a backend may use it to decode faster
    (``hf_generate.label_drafts``), never to decode differently."""

    prompt: "EncodedPrompt"
    index: int
    seed: int = 0
    record: "DetectionRecord | None" = None
    greedy: bool = False
    draft_token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class RolloutOutput:
    """One rollout. ``response_token_ids`` are the generated ids up to, not including, the stop token (no padding);
    ``prompt_token_ids`` are exactly the request's encoded prompt ids (the trainer's prompt-alignment check).

    ``finish_reason``: ``stop`` (the model ended its turn), ``repeat`` (the repeat guard forced EOS) or ``length``
    (``max_new_tokens`` reached without a stop).
    """

    prompt_token_ids: tuple[int, ...]
    response_token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    policy_version: int | None = None  # optimizer steps of the policy that generated it (set by the trainer)


class BackendUnavailableError(ExternalSystemError, RuntimeError):
    """The configured rollout backend cannot be used in this installation (message says why, hint what to do)."""


class RolloutBackend(ABC):
    """What the trainer needs from a rollout engine. Outputs come back in request order, one per request.

    Every backend is built the same way, ``cls.from_run(run, model, processor)``: it reads its own settings from
    ``run.rollout_matching.backend`` and anything else (template, model path, dtype, seed) from the run contract
    (see :func:`coordexp.runtime.rollout.registry.create_backend`). Per micro-step the trainer calls
    :meth:`begin_step`, :meth:`sync_weights`, then :meth:`generate` (training and evaluation alike).
    """

    @classmethod
    @abstractmethod
    def from_run(cls, run: "RunContract", model: Any, processor: Any) -> "RolloutBackend":
        """Build the backend of ``run.rollout_matching.backend`` for the live policy ``model``."""

    @abstractmethod
    def generate(self, requests: Sequence[RolloutRequest]) -> list[RolloutOutput]:
        """Roll out every request (no gradients), batching at most ``decode_batch_size`` per decode call."""

    def generate_with_metadata(self, requests: Sequence[RolloutRequest]) -> tuple[list[RolloutOutput], dict[str, Any]]:
        """:meth:`generate` and the metadata of THAT call (what the run log records with it). The default reads
        :meth:`run_metadata` right after, in the same thread: exact while one generation runs at a time; a backend
        that generates on several threads overrides it."""
        outputs = self.generate(requests)
        return outputs, self.run_metadata()

    def begin_step(self, global_step: int) -> None:
        """The trainer's optimizer step before the next rollouts (backends name it in their errors)."""

    def attach_optimizer(self, optimizer: Any) -> None:
        """The optimizer, once the trainer has created it (a backend that offloads its state keeps it)."""

    def sync_weights(self, model: Any) -> None:
        """Make the next rollouts use ``model``'s current weights (called before every rollout; cheap when the
        weights did not change since the last call)."""

    def close(self) -> None:
        """Release engines, memory and connections; the backend is unusable afterwards."""

    def run_metadata(self) -> dict[str, Any]:
        """What the run's metadata log records about this backend after a rollout (JSON values only: endpoints,
        effective sync mode, fallback events, the last calls and their seeds). Nothing by default."""
        return {}

    def __enter__(self) -> "RolloutBackend":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def finish_output(
    prompt_token_ids: Sequence[int],
    generated_ids: Sequence[int],
    *,
    stop_ids: frozenset[int],
    decode: Callable[[list[int]], str],
    guard: RepeatGuard | None = None,
    pieces: Sequence[bytes] | None = None,
) -> RolloutOutput:
    """Cut ``generated_ids`` at the first stop id (dropping it and anything after: padding of finished rows) and
    name the reason. A stopped response that trips ``guard`` is labelled ``repeat``: the guard forces EOS exactly
    when the ids before it trip, so this post-hoc check equals "the guard fired" for every backend."""
    generated = [int(i) for i in generated_ids]
    cut = next((k for k, token_id in enumerate(generated) if token_id in stop_ids), None)
    response = generated if cut is None else generated[:cut]
    reason: FinishReason = "length" if cut is None else "stop"
    if cut is not None and guard is not None and guard.active:
        keys = count_object_keys(response, pieces) if guard.max_object_keys and pieces is not None else 0
        if should_terminate(response, guard, object_key_count=keys):
            reason = "repeat"
    return RolloutOutput(
        prompt_token_ids=tuple(int(i) for i in prompt_token_ids),
        response_token_ids=tuple(response),
        text=decode(response),
        finish_reason=reason,
    )
