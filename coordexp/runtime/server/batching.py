"""Request coalescing and fair scheduling of ``/infer/`` calls on the rollout server's ONE engine worker.

Why: with one engine call per HTTP request, the learner's concurrent ranks each got a fraction of the batch the
engine can run, and one huge request blocked every other for minutes (docs/design.md, server mode).

- Every ``/infer/`` is a :class:`Job`; its items (request ``j`` gives ``n`` sequences) are encoded lazily, when a
  round takes them, so a big request never encodes everything before others get a turn.
- **Epochs keep the FIFO guarantees.** A job's epoch is the number of other worker operations (weight updates,
  cache resets) submitted before it arrived. The tick of epoch ``e`` sits in the worker's queue where the first
  job of ``e`` arrived and serves only jobs of epochs ``<= e``, round after round, until none is left: a weight
  update acknowledged after a job runs after all of it, one acknowledged before it runs before it, and weights
  never change inside a round (rounds run on the worker, between its other operations).
- **A round is ONE ``engine.generate`` call.** It takes the oldest waiting job's :class:`GenerationParams`; every
  waiting job with the same params contributes items, one item per job in turn (round-robin), until the round
  holds ``max_batch_seqs`` sequences (and ``max_batch_tokens`` sequences x ``max_tokens``). The least recently
  served jobs come first (new ones before all), so parameter sets take turns.
- **Fairness bound**: a job that arrives while a round runs gets items into the very next round (a round holds
  at least one item of the least recently served job), and each round gives every job of its parameter set an
  equal share of the budget: no request waits behind the whole of another, only behind the engine call in flight
  (at most ``max_batch_seqs`` sequences of ``max_tokens``). Jobs of other parameters that are also new come in
  arrival order, one round each.
- The first round of a tick waits ``window_s`` (a few ms), and again while calls keep arriving (at most
  ``MAX_WINDOWS`` windows), so calls sent together land in one engine call; calls that arrive while the engine is
  busy are merged anyway. Each job gets exactly its own outputs, in order; seeds
  are per sequence, so a merged call samples what separate calls would.
- A failing engine call with several jobs is retried job by job, so one bad request fails only its own caller.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from coordexp.runtime.rollout.base import RolloutOutput, RolloutRequest
from coordexp.runtime.server.engine import GenerationParams
from coordexp.runtime.server.worker import FifoWorker

__all__ = ["BatchPolicy", "JobSpec", "Job", "Scheduler", "DEFAULT_WINDOW_S", "DEFAULT_MAX_BATCH_SEQS"]

log = logging.getLogger("coordexp.serve")
DEFAULT_WINDOW_S = 0.010
MAX_WINDOWS = 8  # an idle engine waits at most this many windows while calls keep arriving
DEFAULT_MAX_BATCH_SEQS = 256  # an engine that states no batch size (vLLM's own default max_num_seqs on GPU)
Result = tuple[RolloutOutput, Any]  # one sequence's output and its logprobs (None when not asked)


@dataclass(frozen=True)
class BatchPolicy:
    """The budget of one engine call and the coalescing window; see the module docstring."""

    max_batch_seqs: int = DEFAULT_MAX_BATCH_SEQS
    max_batch_tokens: int | None = None  # sequences x max_tokens per engine call (None: sequences only)
    window_s: float = DEFAULT_WINDOW_S

    def __post_init__(self) -> None:
        if self.max_batch_seqs < 1 or (self.max_batch_tokens is not None and self.max_batch_tokens < 1):
            raise ValueError(f"max_batch_seqs ({self.max_batch_seqs}) and max_batch_tokens ({self.max_batch_tokens}) "
                             "must be >= 1")
        if not 0 <= self.window_s <= 1:
            raise ValueError(f"the coalescing window must be 0..1 s, got {self.window_s}")


class JobSpec(Protocol):
    """What the service hands the scheduler for one ``/infer/``."""

    params: GenerationParams
    count: int  # items (requests) in the call
    width: int  # sequences per item (n)

    def encode(self, item: int) -> list[RolloutRequest]:
        """The ``width`` engine requests of item ``item`` (raises on an item that cannot be encoded)."""
        ...

    def finish(self, item: int, results: list[Result]) -> list[Result]:
        """Per-item post-processing of the engine's results (e.g. stop strings), on the worker."""
        ...

    def reply(self, results: list[list[Result]]) -> Any:
        """The caller's answer from every item's results, in order."""
        ...

    def close(self) -> None:
        """Release what the job holds (scratch files)."""
        ...


@dataclass(eq=False)
class Job:
    spec: Any
    epoch: int
    future: Future = field(default_factory=Future)
    next_item: int = 0
    last_round: int = -1  # the round that last served it (-1: none yet); the least recently served go first
    results: list[list[Result] | None] = field(default_factory=list)
    done_items: int = 0

    def __post_init__(self) -> None:
        self.results = [None] * self.spec.count


class Scheduler:
    """Merges concurrent jobs into engine calls on ``worker``; ``engine`` needs ``generate`` (and
    ``token_logprobs`` for jobs that ask for logprobs)."""

    def __init__(self, engine: Any, worker: FifoWorker, policy: BatchPolicy | None = None):
        self.engine, self.worker, self.policy = engine, worker, policy or BatchPolicy()
        self._jobs: list[Job] = []
        self._armed: int | None = None  # the epoch whose tick is queued or running and still takes jobs
        self._stopping = False
        self._rounds = 0
        self._arrivals = 0
        self.engine_calls = self.merged_calls = self.jobs_done = self.sequences = self.max_jobs_per_call = 0
        self.last_call_jobs = 0

    # -------------------------------------------------------------------------------------------- submit

    def submit(self, job_spec: Any) -> Future:
        """Queue one job; its future holds ``job_spec.reply(...)`` or the exception that ended it."""
        with self.worker.lock:
            if self._stopping:
                from coordexp.runtime.server.worker import WorkerStopped

                raise WorkerStopped("the server is shutting down and takes no more work")
            job = Job(job_spec, self.worker.epoch)
            if job_spec.count == 0:
                job.future.set_result(job_spec.reply([]))
                job_spec.close()
                return job.future
            epoch = job.epoch
            if self._armed != epoch:  # the tick first: a stopped worker raises before anything changes
                self.worker.submit(lambda: self._tick(epoch), barrier=False)
                self._armed = epoch
            self._jobs.append(job)  # the tick cannot look before this: it takes the same lock
            self._arrivals += 1
        return job.future

    def stats(self) -> dict[str, int]:
        """Counters for ``GET /coordexp/batch_status/`` (tests and the concurrency benchmark read them)."""
        with self.worker.lock:
            waiting = len(self._jobs)
        return {"engine_calls": self.engine_calls, "merged_calls": self.merged_calls, "jobs_done": self.jobs_done,
                "sequences": self.sequences, "max_jobs_per_call": self.max_jobs_per_call,
                "last_call_jobs": self.last_call_jobs, "waiting_jobs": waiting,
                "max_batch_seqs": self.policy.max_batch_seqs}

    def stop(self) -> None:
        """No more rounds start; every waiting job is cancelled (its caller is answered 503)."""
        with self.worker.lock:
            self._stopping = True
            jobs, self._jobs = self._jobs, []
        for job in jobs:
            job.future.cancel()
            job.spec.close()

    # -------------------------------------------------------------------------------------------- rounds

    def _tick(self, epoch: int) -> None:
        seen = -1
        for _ in range(MAX_WINDOWS if self.policy.window_s else 0):
            if self._arrivals == seen:  # a quiet window: the burst is in
                break
            seen = self._arrivals
            time.sleep(self.policy.window_s)  # calls sent together arrive within a few ms: one engine call
        while self._round(epoch):
            pass

    def _pick(self, epoch: int) -> dict[Job, list[int]] | None:
        """This round's items per job (under the lock), or None when nothing of ``epoch`` is left."""
        with self.worker.lock:
            for job in [j for j in self._jobs if j.future.cancelled()]:
                self._drop(job)
            ready = [j for j in self._jobs if j.epoch <= epoch and j.next_item < j.spec.count]
            if not ready or self._stopping:
                if self._armed == epoch:
                    self._armed = None
                return None
            ready.sort(key=lambda j: j.last_round)  # stable: arrival order among equals
            key = ready[0].spec.params
            same = [j for j in ready if j.spec.params == key]
            picks: dict[Job, list[int]] = {}
            seqs = tokens = 0
            full = False
            while not full:
                progressed = False
                for job in same:
                    if job.next_item >= job.spec.count:
                        continue
                    width = job.spec.width
                    cost = width * key.max_new_tokens
                    cap_tokens = self.policy.max_batch_tokens
                    if seqs and (seqs + width > self.policy.max_batch_seqs
                                 or (cap_tokens is not None and tokens + cost > cap_tokens)):
                        full = True
                        break
                    picks.setdefault(job, []).append(job.next_item)
                    job.next_item += 1
                    seqs, tokens, progressed = seqs + width, tokens + cost, True
                if not progressed:
                    break
            self._rounds += 1
            for job in picks:  # served jobs queue behind the others: parameter sets take turns
                job.last_round = self._rounds
            return picks

    def _drop(self, job: Job) -> None:
        if job in self._jobs:
            self._jobs.remove(job)
        job.spec.close()

    def _fail(self, job: Job, exc: BaseException) -> None:
        with self.worker.lock:
            self._drop(job)
        _settle(job.future, error=exc)

    def _round(self, epoch: int) -> bool:
        picks = self._pick(epoch)
        if not picks:
            return False
        parts: list[tuple[Job, list[int], list[RolloutRequest]]] = []
        for job, items in picks.items():
            try:
                requests = [r for item in items for r in job.spec.encode(item)]
            except Exception as exc:  # noqa: BLE001 - this caller's item cannot be encoded: its job alone fails
                self._fail(job, exc)
                continue
            parts.append((job, items, requests))
        if not parts:
            return True
        try:
            self._generate(parts)
        except Exception as exc:  # noqa: BLE001 - find the job that broke it; the others still get answers
            if len(parts) == 1:
                self._fail(parts[0][0], exc)
            else:
                log.warning("a merged engine call of %d requests failed (%s); retrying them one by one",
                            len(parts), type(exc).__name__)
                for part in parts:
                    try:
                        self._generate([part])
                    except Exception as single:  # noqa: BLE001 - reported to that caller
                        self._fail(part[0], single)
        return True

    def _generate(self, parts: list[tuple[Job, list[int], list[RolloutRequest]]]) -> None:
        """ONE engine call for every part, then each job's results go back to it; completed jobs are answered."""
        params: GenerationParams = parts[0][0].spec.params
        requests = [r for _, _, reqs in parts for r in reqs]
        outputs = self.engine.generate(requests, params) if requests else []
        if len(outputs) != len(requests):
            from coordexp.runtime.server.engine import EngineError

            raise EngineError(f"the engine returned {len(outputs)} outputs for {len(requests)} requests")
        logprobs: list[Any] = [None] * len(outputs)
        if params.logprobs is not None and outputs:
            logprobs = list(self.engine.token_logprobs(requests, outputs, params, params.logprobs))
        self.engine_calls += 1
        self.merged_calls += len(parts) > 1
        self.sequences += len(requests)
        self.last_call_jobs = len(parts)
        self.max_jobs_per_call = max(self.max_jobs_per_call, len(parts))
        start = 0
        for job, items, reqs in parts:
            width = job.spec.width
            for k, item in enumerate(items):
                begin = start + k * width
                chunk = list(zip(outputs[begin:begin + width], logprobs[begin:begin + width]))
                try:
                    job.results[item] = job.spec.finish(item, chunk)
                except Exception as exc:  # noqa: BLE001 - that caller's post-processing failed
                    self._fail(job, exc)
                    break
                job.done_items += 1
            start += len(reqs)
            if job.done_items == job.spec.count and not job.future.done():
                self._complete(job)

    def _complete(self, job: Job) -> None:
        with self.worker.lock:
            self._drop(job)
        try:
            reply = job.spec.reply(list(job.results))  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - delivered to the caller
            _settle(job.future, error=exc)
            return
        self.jobs_done += 1
        _settle(job.future, reply)



def _settle(future: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Set a job's outcome unless its caller gave up on it (cancelled at shutdown)."""
    from concurrent.futures import InvalidStateError

    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass
