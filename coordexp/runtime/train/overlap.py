"""Actor-learner overlap (issue 14 item 1): the next micro-step's rollouts are generated while this one trains.

One background thread calls ``backend.generate`` for the next micro-step's requests (plain HTTP in server mode: no
collective runs off the main thread, so every DDP rank stays in lockstep). The weight push stays on the main thread
and is ordered after the in-flight generation: a micro-step first waits for its own rollouts, then pushes the
current weights (a no-op between optimizer steps), then requests the next micro-step's rollouts. So the server never
switches weights mid-request, and a sample is at most one optimizer step behind the policy that trains on it.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from coordexp.runtime.rollout.base import RolloutBackend, RolloutOutput, RolloutRequest

__all__ = ["PlannedMicroStep", "PrefetchedRollouts", "RolloutPrefetcher"]


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
    requested_at: float
    seconds: float  # generation time on the background thread


@dataclass
class _InFlight:
    micro_step: Any
    seeds: tuple[int, ...]
    records: tuple[Any, ...]
    policy_version: int
    requested_at: float
    future: "Future[tuple[list[RolloutOutput], float]]"


@dataclass
class RolloutPrefetcher:
    """At most one generation in flight, keyed by the micro-step it is for. ``events`` records every request and
    take as ``(kind, micro_step, policy_version, perf_counter)`` (tests and the benchmark read it)."""

    backend: "RolloutBackend"
    staleness: int = 1
    events: list[tuple[str, Any, int, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-prefetch")
        self._in_flight: _InFlight | None = None

    def request(self, micro_step: Any, records: Sequence[Any], requests: Sequence["RolloutRequest"], policy_version: int) -> None:
        """Start generating ``micro_step``'s rollouts in the background with the weights the server has now."""
        if self._in_flight is not None:
            raise RuntimeError(f"a prefetch for micro-step {self._in_flight.micro_step} is still in flight; take it "
                               "before requesting another (the weight push must not overtake it)")
        requests = list(requests)

        def generate() -> tuple[list["RolloutOutput"], float]:
            start = time.perf_counter()
            outputs = self.backend.generate(requests)
            return outputs, time.perf_counter() - start

        now = time.perf_counter()
        seeds = tuple(int(r.seed) for r in requests)
        self._in_flight = _InFlight(micro_step, seeds, tuple(records), policy_version, now, self._pool.submit(generate))
        self.events.append(("request", micro_step, policy_version, now))

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
        outputs, seconds = pending.future.result()
        if pending.micro_step != micro_step or pending.seeds != tuple(int(x) for x in seeds) or len(pending.records) != len(records) or any(
            a is not b for a, b in zip(pending.records, records)
        ):
            return None
        self.events.append(("take", micro_step, pending.policy_version, time.perf_counter()))
        return PrefetchedRollouts(outputs, pending.policy_version, pending.requested_at, seconds)

    def close(self) -> None:
        """Wait for the in-flight generation (the backend is closed after this) and stop the thread."""
        try:
            self.wait()
        finally:
            self._in_flight = None
            self._pool.shutdown(wait=True)
