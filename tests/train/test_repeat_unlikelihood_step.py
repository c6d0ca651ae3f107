"""``rollout_matching.repeats: unlikelihood`` through the per-sample pipeline (docs/design.md, decision 18): the
target is drop's, the repeat becomes a negative inside the encoded assistant span, and the counters say so."""

from __future__ import annotations

import dataclasses

import pytest

from coordexp.runtime.core.serialize import serialize_objects
from coordexp.runtime.model.data import load_records
from coordexp.runtime.model.encoding import encode_prompt
from coordexp.runtime.rollout.base import RolloutOutput
from coordexp.runtime.train.rollout_step import HostContext, build_rollout_sample
from coordexp.schema.contract import load_contract

from tests.train.test_trailing_unmatched import EXAMPLE


def _context(processor, repeats):
    contract = load_contract(EXAMPLE)
    return HostContext.create(processor, dataclasses.replace(contract.rollout_matching, repeats=repeats),
                              contract.template)


@pytest.fixture(scope="module")
def record(synthetic_dataset):
    return next(r for r in load_records(synthetic_dataset.train_jsonl) if len(r.objects) >= 2)


def _sample(ctx, record, objects):
    prompt = encode_prompt(ctx.processor, record, ctx.template)
    text = serialize_objects(objects)
    ids = ctx.tokenizer.encode(text, add_special_tokens=False)
    rollout = RolloutOutput(tuple(prompt.input_ids.tolist()), tuple(ids), text, "stop")
    return build_rollout_sample(record, prompt, rollout, ctx)


def test_a_repeat_becomes_one_negative_on_drops_target(tiny_processor, record):
    first, second = record.objects[0], record.objects[1]
    objects = [first, first, second]
    ul = _sample(_context(tiny_processor, "unlikelihood"), record, objects)
    drop = _sample(_context(tiny_processor, "drop"), record, objects)
    neutral = _sample(_context(tiny_processor, "neutral"), record, objects)
    assert ul.target.ids == drop.target.ids != neutral.target.ids
    sup = ul.supervision
    assert sup.ul_positions.size == 1 and drop.supervision.ul_positions.size == 0
    assert (ul.counters.repeats_removed, ul.counters.repeat_negatives) == (1, 1)
    assert neutral.counters.certified_duplicates == 1 and neutral.counters.repeat_negatives == 0
    pos = int(sup.ul_positions[0])
    assert ul.target.prefix_len <= pos < len(ul.target.ids) - 1
    assert ul.encoded.prompt_len <= ul.encoded.assistant_start + pos < ul.encoded.total_len
    assert int(sup.ul_tokens[0]) != ul.target.ids[pos]
