"""Regression: every backend hands back stop-trimmed response ids (RolloutOutput), so the rollout's finish reason,
not a stop token in the ids, says whether the model ended its turn. Reading only the ids counted every rollout as
cut off: cut_off_rate 100% and premature EOS 0% on every run, and the collapse alarm's cut-off bound fired at
every window (found on decision 18's screen, seed 111)."""

from __future__ import annotations

import pytest

from coordexp.runtime.core.serialize import serialize_objects
from coordexp.runtime.model.data import load_records
from coordexp.runtime.model.encoding import encode_prompt
from coordexp.runtime.rollout.base import RolloutOutput, finish_output
from coordexp.runtime.train.rollout_step import HostContext, build_rollout_sample
from coordexp.schema.contract import load_contract

from tests.train.test_trailing_unmatched import EXAMPLE


@pytest.fixture(scope="module")
def ctx(tiny_processor):
    contract = load_contract(EXAMPLE)
    return HostContext.create(tiny_processor, contract.rollout_matching, contract.template)


@pytest.mark.parametrize("ended", [True, False])
def test_a_stop_trimmed_rollout_that_ended_its_turn_counts_as_eos_stopped(ctx, synthetic_dataset, ended):
    record = next(iter(load_records(synthetic_dataset.train_jsonl)))
    prompt = encode_prompt(ctx.processor, record, ctx.template)
    ids = ctx.tokenizer.encode(serialize_objects(record.objects), add_special_tokens=False)
    generated = ids + [ctx.eos_id] if ended else ids
    rollout = finish_output(tuple(prompt.input_ids.tolist()), generated, stop_ids=frozenset({ctx.eos_id}),
                            decode=ctx.tokenizer.decode)
    assert rollout.response_token_ids == tuple(ids)  # what every backend returns: the stop token is gone
    counters = build_rollout_sample(record, prompt, rollout, ctx).counters
    assert counters.eos_stopped == int(ended)
    assert counters.ratios()["cut_off_rate"] == (0.0 if ended else 1.0)


def test_a_repeat_guard_stop_is_a_cut_off(ctx, synthetic_dataset):
    record = next(iter(load_records(synthetic_dataset.train_jsonl)))
    prompt = encode_prompt(ctx.processor, record, ctx.template)
    ids = ctx.tokenizer.encode(serialize_objects(record.objects), add_special_tokens=False)
    rollout = RolloutOutput(tuple(prompt.input_ids.tolist()), tuple(ids), "", "repeat")
    assert build_rollout_sample(record, prompt, rollout, ctx).counters.eos_stopped == 0
