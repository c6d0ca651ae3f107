"""The reward objective in the micro-step pipeline (issue 52): each image is requested ``group_size`` (+1 greedy)
times in a row with its own seed, a whole optimizer step still goes to the backend in one call, every group's
figures reach the step log."""

from __future__ import annotations

from dataclasses import replace

import pytest

from coordexp.runtime.core.serialize import serialize_objects
from coordexp.runtime.model.data import load_records
from coordexp.runtime.rollout.base import RolloutBackend, RolloutOutput
from coordexp.runtime.train.metrics import StepStats, WindowContext, step_log_values
from coordexp.runtime.train.pipeline import MicroStepPipeline, PipelineSettings
from coordexp.runtime.train.rollout_step import HostContext
from coordexp.runtime.train.run_log import RunLog
from coordexp.schema.contract import load_contract
from coordexp.schema.rollout import RewardConfig
from testkit import REPO

GROUP = 3  # two sampled rollouts and the greedy one


class HalfWhenGreedyBackend(RolloutBackend):
    """Sampled requests get their record's whole ground truth, greedy ones its first object only; keeps the
    requests of every call."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.calls: list[list] = []

    @classmethod
    def from_run(cls, run, model, processor):
        raise NotImplementedError("built by the test")

    def generate(self, requests):
        self.calls.append(list(requests))
        outputs = []
        for request in requests:
            objects = request.record.objects[:1] if request.greedy else request.record.objects
            text = serialize_objects(objects)
            ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
            outputs.append(RolloutOutput(tuple(request.prompt.input_ids.tolist()), ids, text, "stop"))
        return outputs


@pytest.fixture(scope="module")
def host(tiny_processor):
    contract = load_contract(REPO / "examples" / "stage2_cpu_hf.yaml")
    rollout = replace(contract.rollout_matching, objective="reward",
                      reward=RewardConfig(group_size=2, include_greedy=True, credit="sequence"))
    return HostContext.create(tiny_processor, rollout, contract.template)


@pytest.fixture(scope="module")
def records(synthetic_dataset):
    return [r for r in load_records(synthetic_dataset.train_jsonl) if len(r.objects) >= 2][:4]


def test_each_image_is_a_group_of_seeded_requests_in_one_call_per_step(host, records, tmp_path):
    settings = PipelineSettings(seed=3, per_device_batch=2, decode_batch_size=16, reward_group=GROUP,
                                greedy_member=True)
    pipe = MicroStepPipeline(host, HalfWhenGreedyBackend(host.tokenizer), settings, stats=StepStats(),
                             run_log=RunLog(tmp_path, 0), policy=lambda: "policy")
    backend = pipe.backend
    pipe.plan(0, [records[:2], records[2:4]], None)
    first = pipe.samples(records[:2], 0)
    second = pipe.samples(records[2:4], 0)
    assert len(backend.calls) == 1 and len(backend.calls[0]) == 2 * 2 * GROUP  # the whole step, one call
    requests = backend.calls[0]
    assert [r.record for r in requests] == [r for r in records for _ in range(GROUP)]
    assert [r.greedy for r in requests] == [False, False, True] * 4
    seeds = [r.seed for r in requests]
    assert len(set(seeds)) == len(seeds)
    assert seeds[:2 * GROUP] == pipe.request_seeds(0, 0, 2 * GROUP)  # a resumed run draws the same
    assert pipe.stats.seeds == seeds
    assert len(first) == len(second) == 2 * GROUP and all(s.supervision.pg_positions.size for s in first)
    groups = pipe.stats.reward_groups
    assert len(groups) == 4 and all(g.samples == GROUP for g in groups)
    # sampled rollouts find everything (reward 1), the greedy one a single object: not a zero-advantage group
    g = len(records[0].objects)
    assert groups[0].reward_mean == pytest.approx((2 + 1 / g) / 3) and not groups[0].zero_advantage
    pipe.stats.add({}, trained=0, computed=0, counters=[s.counters for s in first + second])
    logs = step_log_values(pipe.stats, WindowContext(world_size=1, device="cpu", stage2=True, buffered=None,
                                                     packing_length=0, min_fill_ratio=0.0, fallback_events=None,
                                                     is_main=True, reward=True))
    assert logs["reward/groups"] == 4 and logs["reward/samples"] == logs["rollout/samples"] == 12
    assert logs["reward/zero_advantage_group_share"] == 0.0 and logs["reward/closing_advantage"] is not None
    assert logs["reward/mean"] == pytest.approx(sum(x.reward_mean for x in groups) / 4)


def test_sft_keeps_one_request_per_record(host, records):
    assert PipelineSettings(seed=0).expand(records[:2]) == records[:2]
    assert PipelineSettings(seed=0, reward_group=2).expand(records[:2]) == [records[0]] * 2 + [records[1]] * 2


def test_evaluation_decodes_greedily_with_the_hf_backend(host, records, tmp_path):
    """Training samples, evaluation does not: the HF backend takes the greedy flag on every evaluation request
    (``coordexp eval`` reads the same contract property)."""
    assert host.rollout.greedy_evaluation
    assert PipelineSettings.reward_shape(host.rollout, True)["greedy_eval"] is True  # as the trainer builds it
    pipe = MicroStepPipeline(host, HalfWhenGreedyBackend(host.tokenizer),
                             PipelineSettings(seed=3, decode_batch_size=4, reward_group=GROUP, greedy_eval=True),
                             stats=StepStats(), run_log=RunLog(tmp_path, 0), policy=lambda: "policy")
    chunks = list(pipe.eval_chunks(records[:3], 0))
    assert [len(c.records) for c in chunks] == [3]  # one request per record: evaluation is not grouped
    assert all(r.greedy for r in pipe.backend.calls[0])
    sft = replace(host.rollout, objective="sft")
    assert not sft.greedy_evaluation and PipelineSettings.reward_shape(sft, True) == {}


def test_a_ground_truth_window_logs_no_reward_figures():
    """Regression (seed 140 of the screen): the recipe's ground-truth steps (gt_step_share 0.5) logged reward/mean 0
    in every other window, halving any mean over the run; a window without a reward group logs none."""
    logs = step_log_values(StepStats(), WindowContext(world_size=1, device="cpu", stage2=True, buffered=None,
                                                      packing_length=0, min_fill_ratio=0.0, fallback_events=None,
                                                      is_main=True, reward=True))
    assert not any(key.startswith("reward/") for key in logs)


def test_the_entropy_per_token_type_is_the_windows_token_mean():
    """Two forward rows of one window: the logged coordinate and text entropies are their summed nats over their
    summed tokens (not a mean of row means), and a type with no trained token logs nothing."""
    from coordexp.runtime.core.reward import GroupFigures
    from coordexp.runtime.model.policy_gradient import ENTROPY_SUMS

    stats = StepStats()
    stats.reward_groups.append(GroupFigures(reward_mean=0.5, reward_std=0.1, zero_advantage=False, samples=3,
                                            advantage_sum=0.0, advantage_tokens=4, closing_sum=0.0, closings=0))
    stats.add_entropy(dict(zip(ENTROPY_SUMS, (6.0, 2.0, 1.0, 10.0))))
    stats.add_entropy(dict(zip(ENTROPY_SUMS, (2.0, 6.0, 0.0, 0.0))))
    context = WindowContext(world_size=1, device="cpu", stage2=True, buffered=None, packing_length=0,
                            min_fill_ratio=0.0, fallback_events=None, is_main=True, reward=True)
    logs = step_log_values(stats, context)
    assert logs["reward/entropy_coord"] == pytest.approx(8.0 / 8) and logs["reward/entropy_text"] == pytest.approx(0.1)
    stats.entropy = [3.0, 1.0, 0.0, 0.0]
    assert "reward/entropy_text" not in step_log_values(stats, context)
