"""The reward objective's per-group glue (issue 52): one image's rollouts become policy-gradient samples whose
advantages sit on exactly each object's tokens and the closing tokens, also after the samples are packed into one
row the way the trainer lays them out."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from coordexp.runtime.core.serialize import serialize_objects
from coordexp.runtime.model.data import load_records
from coordexp.runtime.model.encoding import encode_prompt
from coordexp.runtime.model.losses import SupervisionBatch, SupervisionSegment
from coordexp.runtime.model.packed_forward import collate_packed, mrope_index_of
from coordexp.runtime.rollout.base import RolloutOutput
from coordexp.runtime.train.reward_step import build_reward_group, build_reward_samples, object_spans
from coordexp.runtime.train.rollout_step import HostContext
from coordexp.schema.contract import load_contract
from coordexp.schema.rollout import RewardConfig

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "stage2_cpu_hf.yaml"
REWARD = RewardConfig(credit="object", duplicate_penalty=0.3, stop_penalty=0.1, close_bonus=0.2)


def _ctx(processor, reward: RewardConfig) -> HostContext:
    contract = load_contract(EXAMPLE)
    rollout = replace(contract.rollout_matching, objective="reward", reward=reward)
    return HostContext.create(processor, rollout, contract.template)


@pytest.fixture(scope="module")
def ctx(tiny_processor):
    return _ctx(tiny_processor, REWARD)


@pytest.fixture(scope="module")
def record(synthetic_dataset):
    return next(r for r in load_records(synthetic_dataset.train_jsonl) if len(r.objects) >= 3)


def _output(ctx, prompt, text: str, finish: str = "stop") -> RolloutOutput:
    ids = ctx.tokenizer.encode(text, add_special_tokens=False)
    return RolloutOutput(tuple(prompt.input_ids.tolist()), tuple(ids), text, finish)


def _group(ctx, record):
    """Three rollouts of ``record``: the first two objects; the first object and a copy of it; every object."""
    prompt = encode_prompt(ctx.processor, record, ctx.template)
    gts = list(record.objects)
    texts = [serialize_objects(gts[:2]), serialize_objects([gts[0], gts[0]]), serialize_objects(gts)]
    return prompt, [_output(ctx, prompt, t) for t in texts]


def _expected(record):
    """Per rollout (object advantages, closing advantage), by hand: every rollout finds object 0 (no advantage);
    object 1 is found by two of three (1 - 1/2); the rest only by the last (1 - 0); the copy is a repeat; closing
    with g objects missing costs 0.1 g, closing with none missing earns 0.2."""
    g = len(record.objects)
    return [((0.0, 0.5), -0.1 * (g - 2)), ((0.0, -0.3), -0.1 * (g - 1)), ((0.0, 0.5) + (1.0,) * (g - 2), 0.2)]


def _landmarks(ctx, ids, objects) -> list[list[int]]:
    """Per object of a serialized rollout, found without the parser: the token holding the first byte of its
    ``"object_k"`` key and the tokens of its coordinates (coord tokens in order, as many as it has)."""
    pieces = [ctx.pieces.text_of([i]) for i in ids]
    starts = np.cumsum([0] + [len(p) for p in pieces])
    text = b"".join(pieces)
    coord_ids = set(ctx.vocab.ids)
    coords = iter([p for p, t in enumerate(ids) if t in coord_ids])
    marks = []
    for k, obj in enumerate(objects, start=1):
        key = int(np.searchsorted(starts, text.index(f'"object_{k}"'.encode()), side="right")) - 1
        marks.append([key] + [next(coords) for _ in obj.coords])
    return marks


def test_each_object_and_the_close_carry_their_advantage_on_exactly_their_tokens(ctx, record):
    prompt, outputs = _group(ctx, record)
    samples, figures = build_reward_group(record, prompt, outputs, ctx)
    assert len(samples) == 3 and figures.samples == 3 and figures.closings == 3
    gts = list(record.objects)
    written = [gts[:2], [gts[0], gts[0]], gts]
    for sample, output, (per_object, closing), objects in zip(samples, outputs, _expected(record), written,
                                                               strict=True):
        ids = sample.target.ids
        for marks, expected in zip(_landmarks(ctx, ids, objects), per_object, strict=True):
            assert np.allclose(sample.supervision.pg_advantages[marks], expected, atol=1e-6)
        assert ids == output.response_token_ids + (ctx.eos_id,)
        sup = sample.supervision
        assert sup.pg_positions.tolist() == list(range(len(ids))) and not sup.ce_positions.size
        adv = sup.pg_advantages
        spans = object_spans(sample.parse, sample.valid_positions)
        assert len(spans) == len(per_object)
        last_brace = max(i for i in range(len(ids) - 1) if "}" in ctx.tokenizer.decode([ids[i]]))
        for (start, end), expected in zip(spans, per_object, strict=True):
            inside = [p for p in range(start, end) if p < last_brace]  # the list's closing token closes, not credits
            assert np.allclose(adv[inside], expected, atol=1e-6)
        assert np.allclose(adv[last_brace:], closing, atol=1e-6)  # the list's close and the EOS
        covered = {p for start, end in spans for p in range(start, end)} | set(range(last_brace, len(ids)))
        assert not np.any(adv[sorted(set(range(len(ids))) - covered)])  # "{" and separators: no credit
        assert sample.counters is not None and sample.counters.rollout_tokens == len(output.response_token_ids)


def test_advantages_land_on_the_same_tokens_after_packing(ctx, record, tiny_model_dir):
    from packing_kit import load_eval_model

    prompt, outputs = _group(ctx, record)
    samples, _ = build_reward_group(record, prompt, outputs, ctx)
    batch = collate_packed([s.encoded for s in samples], mrope_index_of(load_eval_model(tiny_model_dir)))
    segments = [SupervisionSegment(s.supervision, s.target.ids, *batch.placement(i)) for i, s in enumerate(samples)]
    full = SupervisionBatch.from_segments(segments, batch.seq_len)
    positions, kept = full.at_kept_positions()  # as the trainer runs the LM head
    input_ids = batch.input_ids.reshape(-1)
    offset = 0
    for i, sample in enumerate(samples):
        n = len(sample.target.ids)
        row, start = batch.placement(i)
        rows = slice(offset, offset + n)
        # each policy token's logit row predicts the packed row's token at that position, which is the sample's
        assert (full.pg_logit_index[rows] % batch.seq_len + 1).tolist() == list(range(start, start + n))
        assert input_ids[start:start + n].tolist() == list(sample.target.ids) == full.pg_labels[rows].tolist()
        assert np.allclose(full.pg_advantages[rows].numpy(), sample.supervision.pg_advantages)
        assert (positions[kept.pg_logit_index[rows]] + 1).tolist() == list(range(start, start + n))
        offset += n
    assert offset == full.pg_logit_index.numel()


def test_sequence_credit_puts_the_rollouts_advantage_on_every_token(tiny_processor, record):
    ctx = _ctx(tiny_processor, RewardConfig(credit="sequence", duplicate_penalty=0.3))
    prompt, outputs = _group(ctx, record)
    samples, figures = build_reward_group(record, prompt, outputs, ctx)
    g = len(record.objects)
    rewards = [2 / g, 1 / g - 0.3, 1.0]
    for sample, reward, others in zip(samples, rewards, ([1, 2], [0, 2], [0, 1]), strict=True):
        expected = reward - np.mean([rewards[k] for k in others])
        assert np.allclose(sample.supervision.pg_advantages, expected, atol=1e-6)
    assert figures.reward_mean == pytest.approx(np.mean(rewards))


def test_a_cut_rollout_gets_no_eos_and_no_closing_credit_and_sft_copies_follow(tiny_processor, record):
    ctx = _ctx(tiny_processor, REWARD.model_copy(update={"sft_weight": 1.0}))
    prompt, outputs = _group(ctx, record)
    cut = replace(outputs[0], finish_reason="length")
    samples, figures = build_reward_group(record, prompt, [cut, outputs[1]], ctx)
    assert len(samples) == 4  # two policy samples, then the two rollouts' SFT targets
    assert samples[0].target.ids == cut.response_token_ids and figures.closings == 2
    g = len(record.objects)  # the cut rollout wrote 2 objects: g - 2 missing, then the cut-off penalty
    assert samples[0].supervision.pg_advantages[-1] == pytest.approx(-0.1 * (g - 2) - REWARD.cutoff_penalty)
    assert [s.counters is None for s in samples] == [False, False, True, True]  # each rollout counted once
    assert samples[2].supervision.ce_positions.size and not samples[2].supervision.pg_positions.size
    with pytest.raises(ValueError, match="groups of 3"):
        build_reward_samples([record] * 2, [prompt] * 2, outputs[:2], ctx, 3, None)
