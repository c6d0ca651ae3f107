"""Whole-step rollout batches: the planned micro-steps of one optimizer step are rolled out at its sync point in one
backend call, with the seeds each micro-step draws on its own (so the samples do not change), a diverged plan
falls back to the micro-step's own call, and overlap prefetches the rest of a step in one call."""

from __future__ import annotations

import pytest

from coordexp.runtime.model.data import load_records
from coordexp.runtime.train.metrics import StepStats
from coordexp.runtime.train.pipeline import MicroStepPipeline, PipelineSettings
from coordexp.runtime.train.rollout_step import HostContext
from coordexp.runtime.train.run_log import RunLog
from coordexp.schema.contract import load_contract

from train.test_pipeline import EXAMPLE, GroundTruthBackend


class SeedRecorder(GroundTruthBackend):
    """The ground-truth backend that also keeps every call's seeds."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.seeds: list[list[int]] = []

    def generate(self, requests):
        self.seeds.append([r.seed for r in requests])
        return super().generate(requests)


@pytest.fixture(scope="module")
def host(tiny_processor):
    contract = load_contract(EXAMPLE)
    return HostContext.create(tiny_processor, contract.rollout_matching, contract.template)


@pytest.fixture(scope="module")
def records(synthetic_dataset):
    return [r for r in load_records(synthetic_dataset.train_jsonl) if r.objects][:8]


def _pipeline(host, tmp_path, backend, **settings) -> MicroStepPipeline:
    return MicroStepPipeline(host, backend, PipelineSettings(seed=11, per_device_batch=2, decode_batch_size=2,
                                                             **settings),
                             stats=StepStats(), run_log=RunLog(tmp_path, 0), policy=lambda: "policy")


def _train(pipe, batches_per_step, *, planned: bool):
    """Every micro-step's samples, step by step (the trainer plans each step's micro-batches first)."""
    seen = []
    for step, batches in enumerate(batches_per_step):
        if planned:
            pipe.plan(step, batches, None)
        for batch in batches:
            seen.append(pipe.samples(batch, step))
    return seen


def _summary(samples):
    return [(s.target.ids, s.policy_version) for micro in samples for s in micro]


def test_a_planned_step_is_one_backend_call_with_the_per_micro_step_seeds(host, records, tmp_path):
    steps = [[tuple(records[0:2]), tuple(records[2:4]), tuple(records[4:6])], [tuple(records[6:8]),
                                                                              tuple(records[0:2])]]
    one_call = SeedRecorder(host.tokenizer)
    whole = _train(_pipeline(host, tmp_path / "a", one_call), steps, planned=True)
    per_micro = SeedRecorder(host.tokenizer)
    alone = _train(_pipeline(host, tmp_path / "b", per_micro), steps, planned=False)
    assert one_call.calls == [6, 4]  # gradient_accumulation_steps x batch prompts per call
    assert per_micro.calls == [2, 2, 2, 2, 2]
    assert one_call.seeds == [sum(per_micro.seeds[:3], []), sum(per_micro.seeds[3:], [])]  # the same seeds
    assert _summary(whole) == _summary(alone)  # and so the same samples, at the same policy versions
    assert len(one_call.syncs) == len(per_micro.syncs) == 2


def test_a_diverged_plan_rolls_the_micro_step_out_on_its_own(host, records, tmp_path):
    backend = SeedRecorder(host.tokenizer)
    pipe = _pipeline(host, tmp_path, backend)
    pipe.plan(0, [tuple(records[0:2]), tuple(records[2:4])], None)
    first = pipe.samples(records[0:2], 0)
    second = pipe.samples(records[4:6], 0)  # not what was planned for micro-step 1
    assert backend.calls == [4, 2]
    assert [s.encoded.total_len for s in first] and len(second) == 2
    assert backend.seeds[1] == pipe.request_seeds(0, 1, 2)  # micro-step 1's own seeds


def test_overlap_prefetches_the_rest_of_a_step_in_one_call_at_the_same_versions(host, records, tmp_path):
    backend = SeedRecorder(host.tokenizer)
    pipe = _pipeline(host, tmp_path, backend, overlap=True, max_steps=2)
    step0 = [tuple(records[0:2]), tuple(records[2:4]), tuple(records[4:6])]
    step1 = [tuple(records[6:8]), tuple(records[0:2]), tuple(records[2:4])]
    versions = []
    pipe.plan(0, step0, step1[0])
    for batch in step0:
        versions += [s.policy_version for s in pipe.samples(batch, 0)]
    pipe.plan(1, step1, None)
    for batch in step1:
        versions += [s.policy_version for s in pipe.samples(batch, 1)]
    pipe.close()
    # step 0 in one call; step 1's first micro-step prefetched during step 0 (one step old, as before); the rest of
    # step 1 prefetched in one call after step 1's push
    assert backend.calls == [6, 2, 4]
    assert versions == [0] * 6 + [0, 0] + [1] * 4
    events = [(kind, key, version) for kind, key, version, _ in pipe.prefetcher.events]
    assert events == [("request", (1, 0), 0), ("take", (1, 0), 0), ("request", (1, 1), 1), ("take", (1, 1), 1)]
    assert not backend.sync_during_generation and pipe.sync_points == [0, 1]


def test_a_step_larger_than_decode_batch_size_is_said_once(host, records, tmp_path, caplog):
    import logging

    steps = [[tuple(records[0:2]), tuple(records[2:4]), tuple(records[4:6])]] * 3
    with caplog.at_level(logging.WARNING, logger="coordexp.train"):
        _train(_pipeline(host, tmp_path / "small", SeedRecorder(host.tokenizer)), steps, planned=True)
    advice = [r.getMessage() for r in caplog.records if "decode_batch_size" in r.getMessage()]
    assert len(advice) == 1 and "6 prompts" in advice[0] and "3 calls of at most 2" in advice[0]
    caplog.clear()
    wide = MicroStepPipeline(host, SeedRecorder(host.tokenizer), PipelineSettings(seed=11, per_device_batch=2,
                                                                                 decode_batch_size=6),
                             stats=StepStats(), run_log=RunLog(tmp_path / "wide", 0), policy=lambda: "policy")
    with caplog.at_level(logging.WARNING, logger="coordexp.train"):
        _train(wide, steps, planned=True)
    assert not [r for r in caplog.records if "decode_batch_size" in r.getMessage()]
