"""The stage-2 micro-step pipeline without an HF Trainer (docs/design.md, decision 14): one weight-sync point per
optimizer step whatever the evaluation chunking, sample age measured when a sample trains and bounded, prompts
encoded once with prefetch, no prefetch past ``max_steps``, and an interrupted run that does not wait on a hung
generation; ground-truth steps of stage 2 train the stage-1 targets and never touch the backend."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordexp.runtime.core.distribution import is_gt_step
from coordexp.runtime.core.serialize import serialize_objects
from coordexp.runtime.model.encoding import encode_prompt
from coordexp.runtime.model.data import load_records
from coordexp.runtime.rollout.base import RolloutBackend, RolloutOutput
from coordexp.runtime.train import pipeline as pipeline_module
from coordexp.runtime.train.metrics import StepStats, WindowContext, step_log_values
from coordexp.runtime.train.pipeline import MicroStepPipeline, PipelineSettings
from coordexp.runtime.train.rollout_step import HostContext, build_gt_sample
from coordexp.runtime.train.run_log import RunLog
from coordexp.schema.contract import load_contract
from testkit import REPO

EXAMPLE = REPO / "examples" / "stage2_cpu_hf.yaml"


class GroundTruthBackend(RolloutBackend):
    """Answers every request with its record's ground truth; records syncs and generations, and whether a sync ever
    happened while a generation was running."""

    def __init__(self, tokenizer, gate: threading.Event | None = None):
        self.tokenizer = tokenizer
        self.gate = gate
        self.syncs: list[object] = []
        self.calls: list[int] = []
        self.generating = 0
        self.sync_during_generation = False
        self.steps: list[int] = []

    @classmethod
    def from_run(cls, run, model, processor):
        raise NotImplementedError("built by the tests directly")

    def begin_step(self, global_step: int) -> None:
        self.steps.append(global_step)

    def sync_weights(self, model) -> None:
        self.sync_during_generation |= self.generating > 0
        self.syncs.append(model)

    def generate(self, requests):
        self.generating += 1
        try:
            if self.gate is not None:
                self.gate.wait()
            self.calls.append(len(requests))
            outputs = []
            for request in requests:
                text = serialize_objects(request.record.objects)
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                outputs.append(RolloutOutput(tuple(request.prompt.input_ids.tolist()), ids, text, "stop"))
            return outputs
        finally:
            self.generating -= 1

    def run_metadata(self):
        return {"calls": len(self.calls)}


@pytest.fixture(scope="module")
def host(tiny_processor):
    contract = load_contract(EXAMPLE)
    return HostContext.create(tiny_processor, contract.rollout_matching, contract.template)


@pytest.fixture(scope="module")
def records(synthetic_dataset):
    return [r for r in load_records(synthetic_dataset.train_jsonl) if r.objects][:8]


def make(host, tmp_path, backend, **settings) -> MicroStepPipeline:
    return MicroStepPipeline(host, backend, PipelineSettings(seed=3, **settings), stats=StepStats(),
                             run_log=RunLog(tmp_path, settings.get("rank", 0)), policy=lambda: "policy")


def test_one_weight_sync_point_per_optimizer_step(host, records, tmp_path):
    backend = GroundTruthBackend(host.tokenizer)
    pipe = make(host, tmp_path, backend, per_device_batch=2, decode_batch_size=2)
    for step in range(3):
        for micro in range(3):  # gradient accumulation: 3 micro-steps per optimizer step
            pipe.samples(records[2 * micro:2 * micro + 2], step)
        list(pipe.eval_chunks(records[:5], step + 1))  # evaluation after the step: 3 chunks, one sync
    assert pipe.sync_points == [0, 1, 2, 3]
    assert len(backend.syncs) == 4 and set(backend.syncs) == {"policy"}
    assert backend.calls == ([2, 2, 2] + [2, 2, 1]) * 3  # every micro-step and evaluation chunk still generated


def test_ranks_with_uneven_eval_shards_take_the_same_sync_points(host, records, tmp_path):
    """5 records on 2 ranks: shards of 3 and 2 (2 and 1 calls of 2): the sync, a collective in server mode, is taken
    once by each rank, before the first chunk."""
    pipes = [make(host, tmp_path / str(rank), GroundTruthBackend(host.tokenizer), rank=rank, world_size=2,
                  decode_batch_size=2) for rank in (0, 1)]
    for rank, pipe in enumerate(pipes):
        positions = list(range(rank, 5, 2))
        chunks = list(pipe.eval_chunks([records[i] for i in positions], 4, positions))
        assert [len(c.records) for c in chunks] == ([2, 1] if rank == 0 else [2])
        assert all(s.policy_version == 4 for c in chunks for s in c.samples)
    assert [p.sync_points for p in pipes] == [[4], [4]]
    # the seeds follow the record's position in the evaluation set, not the shard
    seeds = [list(pipes[0].eval_chunks([records[0]], 4, [2]))[0].seeds, list(pipes[1].eval_chunks([records[0]], 4, [2]))[0].seeds]
    assert seeds[0] == seeds[1]


@dataclass(frozen=True)
class Segment:
    length: int
    policy_version: int | None


def test_carried_segments_older_than_the_bound_are_dropped_and_counted(host, tmp_path):
    pipe = make(host, tmp_path, GroundTruthBackend(host.tokenizer), packing_length=150, packing_buffer=16)
    first = pipe.rows([Segment(100, 0), Segment(100, 0)], step=0)  # one fits a row, the other is carried
    assert sum(len(row) for row in first) == 1 and len(pipe.buffer) == 1
    rows = pipe.rows([Segment(100, 2), Segment(100, 2)], step=2)  # the carried one would be 2 steps old
    assert pipe.stats.stale_dropped == 1
    trained = [s for row in rows for s in row]
    assert all(s.policy_version == 2 for s in trained)
    assert pipe.stats.staleness == [0] * (1 + len(trained))  # measured when trained: step minus version


def test_a_looser_bound_keeps_the_carry_and_reports_its_age(host, tmp_path):
    pipe = make(host, tmp_path, GroundTruthBackend(host.tokenizer), packing_length=150, packing_buffer=16,
                staleness_bound=2)
    pipe.rows([Segment(100, 0), Segment(100, 0)], step=0)
    rows = pipe.rows([Segment(100, 2), Segment(100, 2)], step=2)
    assert pipe.stats.stale_dropped == 0
    assert 2 in [2 - s.policy_version for row in rows for s in row]  # the carried segment trained, 2 steps old
    assert max(pipe.stats.staleness) == 2


def test_prefetch_encodes_each_prompt_once_and_never_syncs_under_a_generation(host, records, tmp_path, monkeypatch):
    encoded: list[str] = []
    real = pipeline_module.encode_prompt

    def counting(processor, record, template):
        encoded.append(record.source)
        return real(processor, record, template)

    monkeypatch.setattr(pipeline_module, "encode_prompt", counting)
    backend = GroundTruthBackend(host.tokenizer)
    pipe = make(host, tmp_path, backend, per_device_batch=2, decode_batch_size=2, overlap=True, max_steps=2)
    batches = [tuple(records[i:i + 2]) for i in range(0, 8, 2)]
    pipe.plan(0, batches[:2], batches[2] if pipe.wants_lookahead(0) else None)
    versions = []
    for micro in range(2):
        versions += [s.policy_version for s in pipe.samples(batches[micro], 0)]
    assert not pipe.wants_lookahead(1)  # step 1 is the last (max_steps 2): nothing is read past it
    pipe.plan(1, batches[2:], None)
    for micro in range(2):
        versions += [s.policy_version for s in pipe.samples(batches[2 + micro], 1)]
    pipe.close()
    assert sorted(encoded) == sorted(r.source for r in records)  # every prompt encoded exactly once
    assert not backend.sync_during_generation
    assert pipe.sync_points == [0, 1]
    # step 0 on demand in one call ((0,0) and (0,1): whole-step batch); (1,0) prefetched during step 0; (1,1)
    # prefetched after step 1's push
    assert versions == [0, 0, 0, 0, 0, 0, 1, 1]
    assert backend.calls == [4, 2, 2]
    events = [(kind, key) for kind, key, _, _ in pipe.prefetcher.events]
    assert events == [("request", (1, 0)), ("take", (1, 0)), ("request", (1, 1)), ("take", (1, 1))]


def test_an_interrupted_run_does_not_wait_for_a_hung_generation(host, records, tmp_path):
    gate = threading.Event()  # never set before close: the "server" hangs
    backend = GroundTruthBackend(host.tokenizer, gate=gate)
    pipe = make(host, tmp_path, backend, per_device_batch=2, decode_batch_size=2, overlap=True)
    pipe.plan(0, [tuple(records[:2]), tuple(records[2:4])], None)
    pipe.prefetcher.request((0, 1), [], policy_version=0)
    threads = [t for t in threading.enumerate() if t.name == "rollout-prefetch"]
    assert threads and all(t.daemon for t in threads)  # a hung generation never holds interpreter exit
    pipe.close(interrupted=True)  # returns although the generation is still blocked
    assert not pipe.prefetcher.in_flight and backend.generating == 1
    gate.set()


# -- ground-truth steps (rollout_matching.gt_step_share, docs/design.md, decision 15) ------------------------
@settings(max_examples=200, deadline=None)
@given(share=st.floats(0.0, 1.0), n=st.integers(0, 400), start=st.integers(0, 10_000))
def test_every_window_of_steps_holds_its_share_of_gt_steps(share, n, start):
    picked = sum(is_gt_step(k, share) for k in range(start, start + n))
    assert abs(picked - n * share) <= 1.0 + 1e-9  # evenly spread: any n consecutive steps, within one step
    assert [is_gt_step(k, share) for k in range(start, start + n)] == [is_gt_step(k, share) for k in range(start, start + n)]


@pytest.mark.parametrize("share, expected", [(0.0, []), (0.25, [3, 7, 11]), (0.5, [1, 3, 5, 7, 9, 11]),
                                             (1.0, list(range(12)))])
def test_the_gt_steps_of_simple_shares(share, expected):
    assert [k for k in range(12) if is_gt_step(k, share)] == expected
    assert sum(is_gt_step(k, share) for k in range(1000)) == math.floor(1000 * share)


def test_gt_steps_train_the_ground_truth_and_never_call_the_backend(host, records, tmp_path):
    backend = GroundTruthBackend(host.tokenizer)
    pipe = make(host, tmp_path, backend, per_device_batch=2, decode_batch_size=4, gt_step_share=0.5)
    by_step = {}
    for step in range(4):
        by_step[step] = [pipe.samples(records[2 * micro:2 * micro + 2], step) for micro in range(2)]
    # steps 1 and 3 are ground-truth steps: no sync, no generation (steps 0 and 2: one call per micro-step, unplanned)
    assert pipe.sync_points == [0, 2] and backend.calls == [2, 2, 2, 2]
    for step in (1, 3):
        for micro, samples in enumerate(by_step[step]):
            part = records[2 * micro:2 * micro + 2]
            expected = [build_gt_sample(r, encode_prompt(host.processor, r, host.template), host) for r in part]
            assert [s.target.ids for s in samples] == [e.target.ids for e in expected]
            assert all(s.counters is None and s.policy_version is None for s in samples)
    assert all(s.counters is not None for step in (0, 2) for samples in by_step[step] for s in samples)
    assert pipe.stats.gt_micro_steps == 4
    logs = step_log_values(pipe.stats, WindowContext(world_size=1, device="cpu", stage2=True, buffered=None,
                                                     packing_length=0, min_fill_ratio=0.0, fallback_events=None,
                                                     is_main=True))
    assert logs["stage2/gt_micro_steps"] == 4.0


def test_rollout_seeds_do_not_depend_on_the_gt_steps(host, records, tmp_path):
    """A rollout step draws the seeds it would draw in a run without ground-truth steps (and a resumed run too)."""
    seeds = {}
    for share in (0.0, 0.5):
        pipe = make(host, tmp_path / str(share), GroundTruthBackend(host.tokenizer), per_device_batch=2,
                    gt_step_share=share)
        for step in range(4):
            pipe.samples(records[:2], step)
        seeds[share] = pipe.stats.seeds
    assert seeds[0.5] == seeds[0.0][0:2] + seeds[0.0][4:6]  # steps 0 and 2 of the rollout-only run


class RequestRecorder(GroundTruthBackend):
    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.requests: list = []

    def generate(self, requests):
        self.requests.extend(requests)
        return super().generate(requests)


@pytest.mark.parametrize("label_drafts", [None, True, False])
def test_rollout_requests_carry_the_ground_truth_draft_unless_drafts_are_off(host, records, label_drafts):
    """Every rollout request built from a record carries its stage-1 target ids as the decoding draft (the HF
    backend's label drafts), except under ``hf_generate.label_drafts: false``."""
    from dataclasses import replace

    from coordexp.runtime.train.rollout_step import label_draft_ids
    from coordexp.schema.rollout import HfGenerateConfig

    drafted = replace(host, rollout=replace(host.rollout, hf_generate=HfGenerateConfig(label_drafts=label_drafts)))
    backend = RequestRecorder(host.tokenizer)
    chunks = list(pipeline_module.iter_rollout_samples(backend, drafted, records[:4], [1, 2, 3, 4], chunk=2))
    assert len(chunks) == 2 and len(backend.requests) == 4
    expected = [None] * 4 if label_drafts is False else [label_draft_ids(r, drafted) for r in records[:4]]
    assert [r.draft_token_ids for r in backend.requests] == expected
    assert label_drafts is False or all(ids and ids[-1] == host.eos_id for ids in expected)


class DraftingBackend(GroundTruthBackend):
    """Reports label-draft figures for each call, as the HF backend's ``run_metadata()`` does."""

    def run_metadata(self):
        return {"label_drafts": {"row_forwards": 10, "generated_tokens": 40, "accepted_tokens": 28}}


def test_the_step_log_carries_the_label_draft_figures_once_per_backend_call(host, records, tmp_path):
    """Issue 54: the window's draft acceptance in the step figures (all calls summed, each call counted once)."""
    pipe = make(host, tmp_path, DraftingBackend(host.tokenizer), per_device_batch=2, decode_batch_size=4)
    for micro in range(2):
        pipe.samples(records[2 * micro:2 * micro + 2], 0)
    assert pipe.backend.calls == [2, 2]
    logs = step_log_values(pipe.stats, WindowContext(world_size=1, device="cpu", stage2=True, buffered=None,
                                                     packing_length=0, min_fill_ratio=0.0, fallback_events=None,
                                                     is_main=True))
    assert logs["rollout/draft_accepted_per_forward"] == pytest.approx(56 / 20)
    assert logs["rollout/draft_token_share"] == pytest.approx(56 / 80)
    assert logs["rollout/forwards_per_token"] == pytest.approx(20 / 80)
    plain = make(host, tmp_path / "plain", GroundTruthBackend(host.tokenizer), per_device_batch=2)
    plain.samples(records[:2], 0)
    assert not any(key.startswith("rollout/draft") for key in step_log_values(plain.stats, WindowContext(
        world_size=1, device="cpu", stage2=True, buffered=None, packing_length=0, min_fill_ratio=0.0,
        fallback_events=None, is_main=True)))
