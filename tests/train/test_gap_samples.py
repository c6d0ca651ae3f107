"""Gap-augmented ground-truth samples (data.gt_prefix_mix; docs/design.md, decision 18): the prefix is the
ground truth's own serialization of the objects given, untrained, and the target is the objects left out in
reading order, fully taught like stage 1's."""

from __future__ import annotations

import dataclasses
import random

import pytest

from coordexp.runtime.core.parsing import parse_rollout
from coordexp.runtime.model.data import load_records
from coordexp.runtime.core.serialize import serialize_objects
from coordexp.runtime.model.encoding import encode_prompt
from coordexp.runtime.train.rollout_step import HostContext, build_gt_sample, gt_prefix
from coordexp.schema.contract import load_contract
from coordexp.schema.data import GtPrefixMix

from tests.train.test_evaluate import EXAMPLE


@pytest.fixture()
def host_and_record(tiny_processor, synthetic_dataset):
    contract = load_contract(EXAMPLE)
    host = HostContext.create(tiny_processor, contract.rollout_matching, contract.template)
    return host, next(r for r in load_records(synthetic_dataset.train_jsonl) if len(r.objects) >= 3)


def test_a_gap_sample_teaches_the_left_out_objects_after_an_untaught_prefix(host_and_record):
    host, record = host_and_record
    mix = GtPrefixMix(none=0, leave_one_out=1)
    host = dataclasses.replace(host, rollout=dataclasses.replace(host.rollout, gt_prefix_mix=mix))
    prompt = encode_prompt(host.processor, record, host.template)
    given = gt_prefix(len(record.objects), mix, random.Random(7))
    sample = build_gt_sample(record, prompt, host, random.Random(7))
    target = sample.target
    left = [g for g in range(len(record.objects)) if g not in given]
    assert target.fn_gt_indices == tuple(left) and len(left) == 1
    objs = parse_rollout(list(target.ids), host.tokenizer, host.vocab).objects
    assert [o.to_det_object() for o in objs] == [record.objects[k] for k in given] + [record.objects[left[0]]]
    # the prefix is the ground truth's own serialization of the given objects, and nothing in it is trained
    text = serialize_objects([record.objects[k] for k in given], host.rollout.object_field_order)
    prefix = tuple(host.tokenizer.encode(text, add_special_tokens=False))
    assert target.ids[:target.prefix_len] == prefix[:target.prefix_len]
    sup = target.supervision
    assert sup.ce_positions.min() >= target.prefix_len and sup.coord_positions.min() >= objs[-1].token_span[0]
    assert len(sup.coord_positions) == len(record.objects[left[0]].coords)
    plain = build_gt_sample(record, prompt, host)  # no draw: plain stage 1 (the evaluation's teacher forcing)
    assert plain.target.fn_gt_indices == tuple(range(len(record.objects)))
