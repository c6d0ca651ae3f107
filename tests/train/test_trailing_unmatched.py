"""``rollout_matching.trailing_unmatched: drop``: Y_train's prefix ends after the rollout's last matched object, so
the target never teaches going on past objects that matched nothing. Measured reason (docs/design.md, decision 15):
with the spec's prefix a stage-1 model on 1-2 shapes learned to write two objects for one-object images (39 -> 82 of
127 images) and its FPs per image rose 0.68 -> 0.93 within 200 steps."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from coordexp.runtime.core.objects import DetObject
from coordexp.runtime.core.serialize import serialize_objects
from coordexp.runtime.model.data import load_records
from coordexp.runtime.model.encoding import encode_prompt
from coordexp.runtime.rollout.base import RolloutOutput
from coordexp.runtime.train.rollout_step import HostContext, build_gt_sample, build_rollout_sample
from coordexp.schema.contract import load_contract

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "stage2_cpu_hf.yaml"
BROKEN = '"object_9": {"desc": "broken", "bbox_2d": ["<|coord_1|>", "<|coord_2|>"]}'


def _context(processor, trailing: str) -> HostContext:
    contract = load_contract(EXAMPLE)
    rollout = dataclasses.replace(contract.rollout_matching, trailing_unmatched=trailing)
    return HostContext.create(processor, rollout, contract.template)


@pytest.fixture(scope="module")
def keep(tiny_processor):
    return _context(tiny_processor, "keep")


@pytest.fixture(scope="module")
def drop(tiny_processor):
    return _context(tiny_processor, "drop")


@pytest.fixture(scope="module")
def record(synthetic_dataset):
    return next(r for r in load_records(synthetic_dataset.train_jsonl) if len(r.objects) >= 3)


GHOST = DetObject("ghost", "bbox_2d", (990, 990, 999, 999))  # a corner speck: matches no synthetic shape (an FP)


def _sample(ctx, record, text):
    prompt = encode_prompt(ctx.processor, record, ctx.template)
    ids = ctx.tokenizer.encode(text, add_special_tokens=False)
    rollout = RolloutOutput(tuple(prompt.input_ids.tolist()), tuple(ids), text, "stop")
    return build_rollout_sample(record, prompt, rollout, ctx), prompt


def test_objects_after_the_last_match_are_cut_and_the_ground_truth_follows(keep, drop, record):
    first = record.objects[0]
    text = serialize_objects([first, GHOST])[:-1] + ", " + BROKEN + "}"
    kept, _ = _sample(keep, record, text)
    dropped, _ = _sample(drop, record, text)
    assert "ghost" in keep.tokenizer.decode(list(kept.target.ids))  # the spec: the FP stays, the append follows it

    # drop: the matched object, then the rest of the ground truth: exactly the GT serialization
    assert list(dropped.target.ids) == drop.tokenizer.encode(serialize_objects(record.objects),
                                                             add_special_tokens=False) + [drop.eos_id]
    assert dropped.target.ids[: dropped.target.prefix_len] == kept.target.ids[: dropped.target.prefix_len]
    c = dropped.counters  # the rollout's own figures are unchanged; the cut is counted
    assert (c.pred_valid, c.pred_dropped, c.matched, c.fp, c.trailing_dropped) == (2, 1, 1, 1, 2)
    assert kept.counters.trailing_dropped == 0
    assert c.ratios()["trailing_dropped_per_image"] == 2


def test_the_matched_objects_coord_slots_keep_their_targets(keep, drop, record):
    first = record.objects[0]
    text = serialize_objects([first, GHOST])
    kept, _ = _sample(keep, record, text)
    dropped, _ = _sample(drop, record, text)
    n = len(first.coords)
    # the matched slots come first, supervised towards the ground truth, at the same positions as without the cut
    assert kept.supervision.coord_targets[:n].tolist() == pytest.approx(list(first.coords))
    assert dropped.supervision.coord_positions[:n].tolist() == kept.supervision.coord_positions[:n].tolist()
    assert dropped.supervision.coord_targets[:n].tolist() == kept.supervision.coord_targets[:n].tolist()


def test_a_rollout_that_matched_nothing_trains_the_ground_truth(drop, record):
    sample, prompt = _sample(drop, record, serialize_objects([GHOST]))
    assert sample.target.ids == build_gt_sample(record, prompt, drop).target.ids
    assert sample.counters.fp == 1 and sample.counters.trailing_dropped == 1


def test_an_unmatched_object_before_a_matched_one_stays(keep, drop, record):
    first = record.objects[0]
    text = serialize_objects([GHOST, first])  # only a suffix may be cut: the FP before the match stays
    kept, _ = _sample(keep, record, text)
    dropped, _ = _sample(drop, record, text)
    assert dropped.target.ids == kept.target.ids and dropped.counters.trailing_dropped == 0


def test_the_default_is_the_spec():
    assert load_contract(EXAMPLE).rollout_matching.trailing_unmatched == "keep"
