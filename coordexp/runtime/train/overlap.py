"""Actor-learner overlap: the next micro-steps' rollouts are generated while this one trains (docs/design.md,
decision 14).

One background thread calls ``backend.generate_with_metadata`` for the next planned micro-steps' requests (the rest
of the optimizer step in one call, or the next step's first micro-step) (plain HTTP in
server mode: no collective runs off the main thread, so every DDP rank stays in lockstep); the metadata logged with a
rollout is the metadata of that rollout. The weight push stays on the
main thread and never overlaps a generation (:class:`coordexp.runtime.train.pipeline.MicroStepPipeline` orders them).
The thread is a daemon: a generation hung on a dead server never keeps the interpreter from exiting (Ctrl-C).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from coordexp.runtime.rollout.base import RolloutBackend, RolloutOutput, RolloutRequest

__all__ = ["PlannedMicroStep", "PrefetchedRollouts", "RolloutPrefetcher", "generate_with_metadata"]


def generate_with_metadata(backend: "RolloutBackend", requests: Sequence["RolloutRequest"]
                           ) -> tuple[list["RolloutOutput"], dict[str, Any], float]:
    """``(outputs, metadata, seconds)`` of one generation: the backend's own metadata of this call, timed."""
    start = time.perf_counter()
    outputs, metadata = backend.generate_with_metadata(list(requests))
    return outputs, metadata, time.perf_counter() - start


@dataclass(frozen=True)
class PlannedMicroStep:
    """A micro-step the dataloader has already produced: ``key`` = (optimizer step, micro-step within it)."""

    key: tuple[int, int]
    records: tuple[Any, ...]


@dataclass(frozen=True)
class PrefetchedRollouts:
    """Rollouts of one micro-step with the policy version (optimizer steps applied) that generated them."""

    outputs: list["RolloutOutput"]
    policy_version: int
    seconds: float  # generation time on the background thread
    metadata: dict[str, Any]  # the backend's metadata right after this generation


@dataclass
class _InFlight:
    micro_step: Any
    requests: tuple["RolloutRequest", ...]  # what was asked: records, prompts and seeds
    policy_version: int
    future: "Future[tuple[list[RolloutOutput], dict[str, Any], float]]"

    def is_for(self, micro_step: Any, records: Sequence[Any]) -> bool:
        """Whether this prefetch is ``micro_step``'s for exactly these records (the plan did not diverge)."""
        return self.micro_step == micro_step and len(self.requests) == len(records) and all(
            r.record is record for r, record in zip(self.requests, records))


@dataclass
class RolloutPrefetcher:
    """At most one generation in flight, keyed by the micro-step it is for. ``events`` records every request and
    take as ``(kind, micro_step, policy_version, perf_counter)`` (tests and the benchmark read it)."""

    backend: "RolloutBackend"
    events: list[tuple[str, Any, int, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._in_flight: _InFlight | None = None

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    def request(self, micro_step: Any, requests: Sequence["RolloutRequest"], policy_version: int) -> None:
        """Start generating ``micro_step``'s rollouts in the background with the weights the server has now."""
        if self._in_flight is not None:
            raise RuntimeError(f"a prefetch for micro-step {self._in_flight.micro_step} is still in flight; take it "
                               "before requesting another (the weight push must not overtake it)")
        requests = tuple(requests)
        future: Future = Future()

        def generate() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(generate_with_metadata(self.backend, requests))
            except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread by take()
                future.set_exception(exc)

        self._in_flight = _InFlight(micro_step, requests, policy_version, future)
        threading.Thread(target=generate, name="rollout-prefetch", daemon=True).start()
        self.events.append(("request", micro_step, policy_version, time.perf_counter()))

    def wait(self) -> None:
        """Block until the in-flight generation (if any) has finished; its result stays available to :meth:`take`."""
        if self._in_flight is not None:
            self._in_flight.future.exception()

    def take(self, micro_step: Any, records: Sequence[Any], seeds: Sequence[int]) -> PrefetchedRollouts | None:
        """The prefetched rollouts of ``micro_step`` (waiting for them), or None when none were requested for it.
        A prefetch for other records or seeds (the plan diverged) is waited for and discarded. Errors re-raise here,
        on the main thread, with the backend's own message."""
        pending, self._in_flight = self._in_flight, None
        if pending is None:
            return None
        outputs, metadata, seconds = pending.future.result()
        if not pending.is_for(micro_step, records) or [r.seed for r in pending.requests] != [int(x) for x in seeds]:
            return None
        self.events.append(("take", micro_step, pending.policy_version, time.perf_counter()))
        return PrefetchedRollouts(outputs, pending.policy_version, seconds, metadata)

    def close(self, *, wait: bool = True) -> None:
        """Forget the in-flight generation: waited for first unless ``wait`` is false (an interrupted run must not
        wait on a hung server; the daemon thread dies with the process)."""
        try:
            if wait:
                self.wait()
        finally:
            self._in_flight = None
