"""The per-sample glue: counters add up, Y_train re-parses, the spec's two sanity checks fire."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from coordexp.runtime.rollout.base import RolloutOutput
from coordexp.runtime.model.data import load_records
from coordexp.runtime.model.encoding import EncodingError, encode_prompt
from coordexp.runtime.core.objects import DetObject
from coordexp.runtime.core.parsing import parse_rollout
from coordexp.runtime.train.rollout_step import HostContext, build_gt_sample, build_rollout_sample
from coordexp.runtime.core.serialize import loads_coord_json, serialize_objects
from coordexp.schema.contract import load_contract

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "stage2_cpu_hf.yaml"


@pytest.fixture(scope="module")
def ctx(tiny_processor):
    contract = load_contract(EXAMPLE)
    return HostContext.create(tiny_processor, contract.rollout_matching, contract.template)


@pytest.fixture(scope="module")
def record(synthetic_dataset):
    records = [r for r in load_records(synthetic_dataset.train_jsonl) if len(r.objects) >= 3]
    return records[0]


def _rollout(ctx, prompt, text: str, *, stop: bool = True) -> RolloutOutput:
    ids = ctx.tokenizer.encode(text, add_special_tokens=False)
    return RolloutOutput(tuple(prompt.input_ids.tolist()), tuple(ids), text, "stop" if stop else "length")


def test_gt_sample_supervises_every_assistant_token(ctx, record):
    prompt = encode_prompt(ctx.processor, record, ctx.template)
    sample = build_gt_sample(record, prompt, ctx)
    ids = sample.target.ids
    sup = sample.supervision
    covered = np.sort(np.concatenate([sup.ce_positions, sup.coord_positions]))
    assert covered.tolist() == list(range(len(ids)))
    assert ids[-1] == ctx.eos_id
    text = ctx.tokenizer.decode(list(ids[:-1]), skip_special_tokens=False)
    assert loads_coord_json(text) == loads_coord_json(serialize_objects(record.objects))
    assert sample.encoded.input_ids[sample.encoded.assistant_start :].tolist() == list(ids)
    assert sample.counters is None


def test_gt_sample_is_tokenized_as_the_tokenizer_tokenizes_the_whole_serialization(ctx, record):
    """Stage 1 trains the sequence a plain SFT of the serialization trains (regression: it was ``{`` + ``"object``
    where the tokenizer writes ``{"`` + ``object``, a split the model then never emits at inference)."""
    sample = build_gt_sample(record, encode_prompt(ctx.processor, record, ctx.template), ctx)
    expected = ctx.tokenizer.encode(serialize_objects(record.objects), add_special_tokens=False)
    assert list(sample.target.ids) == expected + [ctx.eos_id]


def test_a_fully_matched_rollout_trains_on_its_own_tokens(ctx, record):
    """Nothing to append: ``Y_train`` is the rollout itself plus EOS, token for token (regression: the fused
    closing token was cut and re-split, e.g. ``"]}}`` -> ``"]}`` + ``}``, a tokenization the model never emits)."""
    prompt = encode_prompt(ctx.processor, record, ctx.template)
    text = serialize_objects(record.objects)
    ids = ctx.tokenizer.encode(text, add_special_tokens=False)
    sample = build_rollout_sample(record, prompt, _rollout(ctx, prompt, text), ctx)
    assert sample.counters.matched == len(record.objects) and sample.target.n_fn_appended == 0
    assert list(sample.target.ids) == ids + [ctx.eos_id]


def test_rollout_sample_counts_add_up_and_y_train_reparses(ctx, record):
    prompt = encode_prompt(ctx.processor, record, ctx.template)
    gt0 = record.objects[0]
    ghost = DetObject("ghost", "bbox_2d", (0, 0, 5, 5)) if gt0.geometry == "poly" else DetObject("ghost", "poly", (0, 0, 5, 0, 5, 5))
    body = serialize_objects([gt0, ghost])[:-1]
    text = body + ', "object_3": {"desc": "broken", "bbox_2d": ["<|coord_1|>", "<|coord_2|>"]}}'
    sample = build_rollout_sample(record, prompt, _rollout(ctx, prompt, text), ctx)
    c = sample.counters
    assert (c.pred_valid, c.pred_dropped, c.pred_parsed) == (2, 1, 3)
    assert c.matched == 1 and c.fn_appended == len(record.objects) - 1
    assert c.matched + c.fn_appended == c.gt_objects == len(record.objects)
    assert c.fp == 1
    reparsed = parse_rollout(list(sample.target.ids), ctx.tokenizer, ctx.vocab, piece_table=ctx.pieces)
    keys = [o.key for o in reparsed.objects if o.valid]
    assert keys == ["object_1", "object_2"] + [f"object_{n}" for n in range(4, 4 + len(record.objects) - 1)]
    assert not reparsed.truncated
    # the matched prediction's coord slots are supervised with the GT bins
    matched_slots = reparsed.objects[0].coord_token_indices
    sup = sample.supervision
    lookup = dict(zip(sup.coord_positions.tolist(), sup.coord_targets.tolist()))
    if gt0.geometry == "bbox_2d":
        assert [lookup[i] for i in matched_slots] == pytest.approx(list(gt0.coords))
    else:
        assert all(i in lookup for i in matched_slots)


def test_prompt_mismatch_fails_the_sanity_check(ctx, record):
    prompt = encode_prompt(ctx.processor, record, ctx.template)
    out = _rollout(ctx, prompt, "{}")
    shifted = RolloutOutput(out.prompt_token_ids[:-1], out.response_token_ids, out.text, out.finish_reason)
    with pytest.raises(EncodingError):
        build_rollout_sample(record, prompt, shifted, ctx)


def test_garbage_rollout_appends_all_ground_truth(ctx, record):
    prompt = encode_prompt(ctx.processor, record, ctx.template)
    sample = build_rollout_sample(record, prompt, _rollout(ctx, prompt, "I see shapes", stop=False), ctx)
    assert sample.counters.fn_appended == len(record.objects)
    assert sample.counters.prefix_fallbacks == 1
    decoded = ctx.tokenizer.decode(list(sample.target.ids[:-1]), skip_special_tokens=False)
    assert len(loads_coord_json(decoded)) == len(record.objects)
