"""``decoding.coord_group_greedy``: greedy picks the token's kind (coordinate or text) by its total probability,
then the likeliest token of that kind (docs/design.md, decision 16). The rule on its own, the HF backend on the
tiny model, the config and the server's per-request resolution."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from coordexp.runtime.model.data import load_records
from coordexp.runtime.model.encoding import encode_prompt
from coordexp.runtime.rollout.coord_group import choose_coord_group, coord_id_tensor
from coordexp.runtime.rollout.hf import HfRolloutBackend
from coordexp.runtime.rollout.registry import RolloutRequest
from coordexp.schema.rollout import DecodingConfig, RepeatTerminateConfig
from coordexp.schema.template import TemplateConfig

from .conftest import load_hf_model

TEMPLATE = TemplateConfig(system_prompt="Find shapes.", user_prompt="List them.", min_pixels=28 * 28 * 4,
                          max_pixels=28 * 28 * 16)


@st.composite
def logits_and_coords(draw):
    rows = draw(st.integers(1, 4))
    vocab = draw(st.integers(3, 24))
    values = draw(arrays(np.float32, (rows, vocab), elements=st.one_of(
        st.floats(-30, 30, width=32), st.just(float("-inf")))))
    coords = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=vocab - 1, unique=True))
    return torch.from_numpy(values), torch.tensor(coords, dtype=torch.long)


@given(logits_and_coords())
@settings(max_examples=300, deadline=None)
def test_the_argmax_is_a_coord_exactly_when_the_coords_hold_more_than_half_the_mass(case):
    logits, coords = case
    out = choose_coord_group(logits, coords)
    probs = torch.softmax(logits.double(), dim=-1)
    is_coord = torch.zeros(logits.shape[1], dtype=torch.bool)
    is_coord[coords] = True
    for row in range(logits.shape[0]):
        if torch.isinf(logits[row]).all():
            continue  # nothing to choose
        mass = float(probs[row, is_coord].sum())
        if abs(mass - 0.5) < 1e-5:
            continue  # a float tie: either choice is the rule's
        winner, loser = (is_coord, ~is_coord) if mass > 0.5 else (~is_coord, is_coord)
        assert torch.isinf(out[row, loser]).all() and (out[row, loser] < 0).all()
        assert torch.equal(out[row, winner], logits[row, winner])  # the likeliest token of the winning kind


def test_a_spread_coordinate_beats_a_text_token_that_beats_each_bin():
    coords = torch.arange(2, 12)
    logits = torch.zeros(2, 12)
    logits[:, 0] = 1.0  # e^1 = 2.7 < 10 bins of e^0: the coords hold 10 / 13.7 of row 0
    logits[1, 0] = 3.0  # e^3 = 20.1 > 10: text wins row 1
    logits[0, 7] = 0.5  # the likeliest bin of row 0
    out = choose_coord_group(logits, coords)
    assert out.argmax(-1).tolist() == [7, 0]
    assert logits.argmax(-1).tolist() == [0, 0]  # what plain greedy writes


def test_spread_text_beats_coordinates_that_beat_each_text_token():
    """The demo's broken `"desc": "<|coord_979|>"` (decision 16): after `"desc": "` the colour words shared 0.6
    of the mass, each below the coords' 0.4. Comparing the coords' total with the single best text token wrote the
    coordinate; the kinds' totals write the colour."""
    coords = torch.arange(4, 14)
    probs = torch.full((1, 14), 0.04)  # ten bins: 0.4 in all
    probs[0, :4] = torch.tensor([0.3, 0.15, 0.1, 0.05])  # four colour words: 0.6
    assert choose_coord_group(probs.log(), coords).argmax(-1).tolist() == [0]
    probs = torch.full((1, 14), 0.059)
    probs[0, :4] = torch.tensor([0.2, 0.1, 0.05, 0.05])  # the words now hold 0.4, the bins 0.6
    probs[0, 9] = 0.069
    assert choose_coord_group(probs.log(), coords).argmax(-1).tolist() == [9]


@pytest.fixture(scope="module")
def model(model_dir):
    return load_hf_model(model_dir)  # the tiny Qwen2-VL; ``processor`` is the rollout suite's, of the same model


@pytest.fixture(scope="module")
def requests_(processor, synthetic_dataset):
    records = load_records(synthetic_dataset.train_jsonl)[:3]
    return [RolloutRequest(prompt=encode_prompt(processor, r, TEMPLATE), index=k, seed=1 + k)
            for k, r in enumerate(records)]


class FlatCoords:
    """A test logits processor run before the backend's own: every coord logit c, one text token c + 2 (so the
    text token beats each bin, e^2 < 1000, but holds far less than half the mass)."""

    def __init__(self, coords, text_id):
        self.coords, self.text_id = coords, text_id

    def __call__(self, input_ids, scores):
        scores = torch.full_like(scores, -50.0)
        scores[:, self.coords] = 0.0
        scores[:, self.coords[5]] = 0.01
        scores[:, self.text_id] = 2.0
        return scores


def decode(model, processor, requests, decoding, inject=None, monkeypatch=None):
    backend = HfRolloutBackend(model, processor.tokenizer, decode_batch_size=4, max_new_tokens=6, decoding=decoding,
                               repeat_terminate=RepeatTerminateConfig())
    if inject is not None:
        original = model.generate

        def generate(**kwargs):
            kwargs["logits_processor"].insert(0, inject)
            return original(**kwargs)

        monkeypatch.setattr(model, "generate", generate)
    return [o.response_token_ids for o in backend.generate(requests)]


def test_hf_rollouts_take_the_group_where_plain_greedy_takes_the_text_token(model, processor, requests_, monkeypatch):
    coords = coord_id_tensor(processor.tokenizer)
    text_id = processor.tokenizer.convert_tokens_to_ids("{")
    flat = FlatCoords(coords, text_id)
    plain = decode(model, processor, requests_, DecodingConfig(), flat, monkeypatch)
    monkeypatch.undo()
    grouped = decode(model, processor, requests_, DecodingConfig(coord_group_greedy=True), flat, monkeypatch)
    assert plain == [(text_id,) * 6] * len(requests_)
    assert grouped == [(int(coords[5]),) * 6] * len(requests_)


def test_hf_rollouts_follow_the_rule_on_the_models_own_logits(model, processor, requests_):
    """Every generated token, checked against a teacher-forced forward: a coord exactly when the coord tokens hold
    more than half the probability of the tokens the backend may emit."""
    from coordexp.runtime.rollout.logprobs import NEVER_EMIT_TOKENS

    tokenizer = processor.tokenizer
    coords = coord_id_tensor(tokenizer)
    never = [tokenizer.convert_tokens_to_ids(t) for t in NEVER_EMIT_TOKENS]
    outputs = decode(model, processor, requests_, DecodingConfig(coord_group_greedy=True))
    checked = 0
    for request, ids in zip(requests_, outputs):
        inputs = request.prompt.model_inputs()
        full = torch.cat([inputs["input_ids"], torch.tensor([ids], dtype=torch.long)], dim=1)
        inputs = {**inputs, "input_ids": full, "attention_mask": torch.ones_like(full)}
        if "mm_token_type_ids" in inputs:
            types = inputs["mm_token_type_ids"]
            inputs["mm_token_type_ids"] = torch.cat([types, torch.zeros((1, len(ids)), dtype=types.dtype)], dim=1)
        with torch.no_grad():
            logits = model(**inputs).logits[0, -len(ids) - 1 : -1].double()
        logits[:, never] = float("-inf")
        logits[:, len(tokenizer):] = float("-inf")
        logp = torch.log_softmax(logits, dim=-1)
        mass = logp[:, coords].exp().sum(-1)
        for step, token in enumerate(ids):
            if abs(float(mass[step]) - 0.5) < 1e-4:
                continue
            assert (token in set(coords.tolist())) == bool(mass[step] > 0.5), (step, token)
            checked += 1
    assert checked > 0


def test_config_refuses_the_rule_outside_greedy_decoding():
    from pydantic import ValidationError

    assert DecodingConfig(coord_group_greedy=True).coord_group_greedy
    for bad in ({"temperature": 0.7}, {"num_beams": 2}):
        with pytest.raises(ValidationError, match="coord_group_greedy changes greedy decoding only"):
            DecodingConfig(coord_group_greedy=True, **bad)


def test_the_server_applies_its_setting_to_greedy_requests_only():
    from coordexp.runtime.rollout import protocol as p
    from coordexp.runtime.server.engine import GenerationParams
    from coordexp.runtime.server.infer import InferPlanner

    planner = InferPlanner.__new__(InferPlanner)
    planner.defaults = GenerationParams(64, DecodingConfig(coord_group_greedy=True))
    planner.max_model_len = 512
    greedy = planner.generation_params(p.RequestConfig(temperature=0.0))
    sampled = planner.generation_params(p.RequestConfig(temperature=0.9))
    assert greedy.decoding.coord_group_greedy and not sampled.decoding.coord_group_greedy
    planner.defaults = GenerationParams(64, DecodingConfig())
    assert not planner.generation_params(p.RequestConfig(temperature=0.0)).decoding.coord_group_greedy
