"""The /infer/ scheduler (batching.py) with a scripted engine: concurrent calls merge into ONE engine call, a big call
cannot starve a small one (round-robin rounds), weight updates stay between rounds in FIFO order, one bad call fails
alone; plus stop-string cutting and the per-sequence seed rule. Progress is read from the engine's call log and
readiness events, never from the clock."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

import pytest
import torch

from coordexp.runtime.rollout.base import RolloutOutput, RolloutRequest
from coordexp.runtime.server.batching import BatchPolicy, Scheduler
from coordexp.runtime.server.engine import GenerationParams
from coordexp.runtime.server.infer import cut_at_stop
from coordexp.runtime.server.worker import FifoWorker
from coordexp.schema.rollout import DecodingConfig

WAIT_S = 60.0
GREEDY = GenerationParams(8, DecodingConfig())
SAMPLED = GenerationParams(8, DecodingConfig(temperature=1.0))


class ScriptedEngine:
    """Answers each sequence with (job name, item, seed); logs every call's sequences. ``hold`` blocks the first
    call until released (``entered`` says it started)."""

    def __init__(self, hold: bool = False):
        self.calls: list[list[tuple[str, int]]] = []
        self.entered, self.release = threading.Event(), threading.Event()
        self.hold = hold
        self.fail_on: str | None = None

    def generate(self, requests, params):
        self.calls.append([(r.record, r.index) for r in requests])
        if self.hold and len(self.calls) == 1:
            self.entered.set()
            assert self.release.wait(WAIT_S)
        if self.fail_on and any(r.record == self.fail_on for r in requests):
            raise RuntimeError(f"engine broke on {self.fail_on}")
        return [RolloutOutput((1, 2), (r.index, r.seed), f"{r.record}:{r.index}", "stop") for r in requests]


@dataclass
class Spec:
    """A JobSpec whose item j is one sequence named (name, j); ``bad_item`` cannot be encoded."""

    name: str
    count: int
    params: GenerationParams = GREEDY
    width: int = 1
    bad_item: int | None = None
    closed: bool = False
    log: list = field(default_factory=list)

    def encode(self, item):
        if item == self.bad_item:
            raise ValueError(f"{self.name}[{item}] cannot be encoded")
        prompt = type("P", (), {"input_ids": torch.tensor([1, 2])})()
        return [RolloutRequest(prompt=prompt, index=item, seed=100 + item, record=self.name)]

    def finish(self, item, results):
        return results

    def reply(self, results):
        return [[out.text for out, _ in item] for item in results]

    def close(self):
        self.closed = True


def make(hold=False, **policy):
    engine = ScriptedEngine(hold)
    worker = FifoWorker()
    return engine, worker, Scheduler(engine, worker, BatchPolicy(window_s=0, **policy))


def gate(worker: FifoWorker) -> threading.Event:
    """Block the worker with a barrier operation until the returned event is set."""
    opened = threading.Event()
    worker.submit(lambda: opened.wait(WAIT_S))
    return opened


def test_calls_queued_while_the_engine_is_busy_become_one_engine_call():
    engine, worker, scheduler = make(max_batch_seqs=64)
    opened = gate(worker)
    jobs = [scheduler.submit(Spec(f"rank{k}", 3)) for k in range(4)]
    assert scheduler.stats()["waiting_jobs"] == 4
    opened.set()
    replies = [job.result(WAIT_S) for job in jobs]
    assert replies == [[[f"rank{k}:{j}"] for j in range(3)] for k in range(4)]  # each caller its own, in order
    assert len(engine.calls) == 1 and len(engine.calls[0]) == 12
    stats = scheduler.stats()
    assert stats["engine_calls"] == 1 and stats["merged_calls"] == 1 and stats["max_jobs_per_call"] == 4
    worker.stop()


def test_a_big_call_cannot_starve_a_small_one():
    """Regression (issue 23): one /infer/ of many sequences blocked every other /infer/ until it ended. Now the small
    call is in the very next engine call and ends long before the big one."""
    engine, worker, scheduler = make(hold=True, max_batch_seqs=4)
    big = scheduler.submit(Spec("big", 40))
    assert engine.entered.wait(WAIT_S)  # the big call's first round is inside the engine
    small = scheduler.submit(Spec("small", 2))
    engine.release.set()
    assert small.result(WAIT_S) == [["small:0"], ["small:1"]]
    big.result(WAIT_S)
    rounds_with = [k for k, call in enumerate(engine.calls) if any(name == "small" for name, _ in call)]
    assert rounds_with == [1]  # both its sequences, next round, sharing it round-robin with the big call
    assert sorted(engine.calls[1]) == [("big", 4), ("big", 5), ("small", 0), ("small", 1)]
    assert all(len(call) <= 4 for call in engine.calls) and len(engine.calls) == 11
    worker.stop()


def test_other_sampling_parameters_take_turns():
    engine, worker, scheduler = make(hold=True, max_batch_seqs=2)
    big = scheduler.submit(Spec("big", 10))
    assert engine.entered.wait(WAIT_S)
    other = scheduler.submit(Spec("other", 1, params=SAMPLED))
    engine.release.set()
    other.result(WAIT_S)
    big.result(WAIT_S)
    # never merged with a call of other parameters, and served right after the round in flight
    assert [name for name, _ in engine.calls[1]] == ["other"]
    assert all({name for name, _ in call} == {"big"} for k, call in enumerate(engine.calls) if k != 1)
    worker.stop()


def test_a_weight_update_waits_for_the_call_in_flight_and_later_calls_wait_for_it():
    """FIFO across operations: a call queued before an update runs entirely before it (all its rounds), a call
    queued after it runs after it; nothing is merged across the update."""
    engine, worker, scheduler = make(hold=True, max_batch_seqs=2)
    log: list[str] = []
    real_generate = engine.generate

    def logged(requests, params):
        out = real_generate(requests, params)
        log.append("+".join(sorted({r.record for r in requests})))
        return out

    engine.generate = logged
    before = scheduler.submit(Spec("before", 5))
    assert engine.entered.wait(WAIT_S)
    update: Future = worker.submit(lambda: log.append("UPDATE"))
    after = scheduler.submit(Spec("after", 2))
    engine.release.set()
    before.result(WAIT_S)
    update.result(WAIT_S)
    after.result(WAIT_S)
    assert log == ["before", "before", "before", "UPDATE", "after"]
    worker.stop()


def test_a_call_that_cannot_be_encoded_fails_alone():
    engine, worker, scheduler = make(max_batch_seqs=16)
    opened = gate(worker)
    bad = Spec("bad", 2, bad_item=1)
    good = scheduler.submit(Spec("good", 2))
    failing = scheduler.submit(bad)
    opened.set()
    assert good.result(WAIT_S) == [["good:0"], ["good:1"]]
    with pytest.raises(ValueError, match=r"bad\[1\]"):
        failing.result(WAIT_S)
    assert bad.closed
    worker.stop()


def test_an_engine_failure_in_a_merged_call_is_retried_call_by_call():
    engine, worker, scheduler = make(max_batch_seqs=16)
    engine.fail_on = "poison"
    opened = gate(worker)
    good = scheduler.submit(Spec("good", 2))
    poison = scheduler.submit(Spec("poison", 1))
    opened.set()
    assert good.result(WAIT_S) == [["good:0"], ["good:1"]]
    with pytest.raises(RuntimeError, match="poison"):
        poison.result(WAIT_S)
    worker.stop()


def test_stop_cancels_waiting_calls_and_refuses_new_ones():
    from coordexp.runtime.server.worker import WorkerStopped

    engine, worker, scheduler = make(max_batch_seqs=4)
    opened = gate(worker)
    spec = Spec("late", 3)
    waiting = scheduler.submit(spec)
    scheduler.stop()
    assert waiting.cancelled() and spec.closed
    with pytest.raises(WorkerStopped):
        scheduler.submit(Spec("later", 1))
    opened.set()
    worker.stop()
    assert engine.calls == []


def test_an_empty_call_is_answered_without_the_engine():
    engine, worker, scheduler = make()
    assert scheduler.submit(Spec("empty", 0)).result(WAIT_S) == []
    assert engine.calls == []
    worker.stop()


def _decode(ids):
    return "".join(chr(ord("a") + i) for i in ids)


@pytest.mark.parametrize("stops, kept", [(["cd"], 4), (["zz"], 6), (["b", "e"], 2), (["abcdef"], 6)])
def test_cut_at_stop_keeps_the_token_that_completes_the_stop_string(stops, kept):
    output = RolloutOutput((9,), (0, 1, 2, 3, 4, 5), _decode([0, 1, 2, 3, 4, 5]), "length")
    cut, tokens = cut_at_stop(output, list(range(6)), stops, _decode)
    assert cut.response_token_ids == tuple(range(kept)) and cut.text == _decode(list(range(kept)))
    assert tokens == list(range(kept))
    assert cut.finish_reason == ("length" if kept == 6 and stops == ["zz"] else "stop")


def test_seeds_follow_the_one_seed_rule():
    """Regression (issue 21): ``(seed + i) & mask or 1`` gave 2**31 and 2**31 + 1 the same seed."""
    from coordexp.runtime.core.distribution import normalize_seed
    from coordexp.runtime.server.infer import InferPlanner

    planner = InferPlanner.__new__(InferPlanner)
    seeds = InferPlanner.seeds(planner, 3, 1, 2**31)
    assert seeds == [normalize_seed(2**31 + i) for i in range(3)] and len(set(seeds)) == 3
    assert InferPlanner.seeds(planner, 2, 2, 7) == [7, 8, 9, 10]  # request j, choice k: seed + j*n + k
