"""``serve-rollout --engine hf`` started from a learner config with a ``tuner`` block serves the checkpoint's own
weights: no fresh adapter is wrapped, so the learner's full-weight pushes load and change what is served; a saved
adapter as ``model.path`` is served merged."""

from __future__ import annotations

import copy

import pytest
import torch

from coordexp.runtime.model.data import load_records
from coordexp.runtime.model.encoding import encode_prompt, load_processor
from coordexp.runtime.model.tuner import apply_tuner
from coordexp.runtime.rollout.base import RolloutRequest
from coordexp.runtime.rollout.hf import HfRolloutBackend
from coordexp.runtime.rollout.weight_export import is_peft, named_tensors
from coordexp.runtime.server.engine import GenerationParams, HfEngine
from coordexp.schema.contract import load_contract
from coordexp.schema.rollout import DecodingConfig, RepeatTerminateConfig
from coordexp.schema.template import TemplateConfig
from coordexp.schema.tuner import TunerConfig

pytest.importorskip("peft", reason="needs peft (pip install peft)")

LEARNER_TUNER = {"train_type": "lora", "use_dora": True, "lora_rank": 4, "lora_alpha": 8}
PARAMS = GenerationParams(max_new_tokens=10, decoding=DecodingConfig())


@pytest.fixture(scope="module")
def requests_(tiny_model_dir, dataset):
    processor = load_processor(tiny_model_dir)
    template = TemplateConfig(system_prompt="Find shapes.", user_prompt="List them.")
    return [RolloutRequest(prompt=encode_prompt(processor, r, template), index=k, seed=7 + k)
            for k, r in enumerate(load_records(dataset.train_jsonl)[:4])]


def _plain(model_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32)


def _trained_learner(model_dir, seed=5):
    """A DoRA learner whose adapter moved away from its initial values (as after some optimizer steps)."""
    policy = apply_tuner(_plain(model_dir), TunerConfig(**LEARNER_TUNER))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if ".lora_" in name:
                parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
    return policy


def _tokens_of(model, processor, requests):
    backend = HfRolloutBackend(model, processor.tokenizer, decode_batch_size=4, max_new_tokens=PARAMS.max_new_tokens,
                               decoding=PARAMS.decoding, repeat_terminate=RepeatTerminateConfig())
    return [o.response_token_ids for o in backend.generate(requests)]


def test_a_learner_tuner_block_serves_the_checkpoint_and_takes_full_weight_pushes(write_config, tiny_model_dir,
                                                                                  requests_):
    run = load_contract(write_config({"tuner": LEARNER_TUNER}))
    assert run.tuner.train_type == "lora"
    engine = HfEngine.from_contract(run)
    served = engine.model
    assert not is_peft(served)  # no fresh adapter around the checkpoint
    checkpoint = _plain(tiny_model_dir).state_dict()
    for name, tensor in served.state_dict().items():
        assert torch.equal(tensor, checkpoint[name]), name
    processor = load_processor(tiny_model_dir)
    before = [o.response_token_ids for o in engine.generate(requests_, PARAMS)]
    assert before == _tokens_of(_plain(tiny_model_dir), processor, requests_)

    learner = _trained_learner(tiny_model_dir)
    engine.load_weights(named_tensors(learner))  # the learner's full (merged) push: every name is the engine's
    after = [o.response_token_ids for o in engine.generate(requests_, PARAMS)]
    assert after == _tokens_of(copy.deepcopy(learner).merge_and_unload(), processor, requests_)
    assert after != before


def test_a_saved_adapter_as_model_path_is_served_merged(write_config, tiny_model_dir, requests_, tmp_path):
    learner = _trained_learner(tiny_model_dir, seed=9)
    adapter_dir = tmp_path / "adapter"
    learner.save_pretrained(str(adapter_dir))
    run = load_contract(write_config({"tuner": LEARNER_TUNER, "model": {"path": str(adapter_dir)}}))
    engine = HfEngine.from_contract(run)
    assert not is_peft(engine.model)
    names = set(engine.model.state_dict())
    assert {name for name, _ in named_tensors(learner)} <= names  # pushes of the same learner still load
    processor = load_processor(tiny_model_dir)
    expected = _tokens_of(copy.deepcopy(learner).merge_and_unload(), processor, requests_)
    assert [o.response_token_ids for o in engine.generate(requests_, PARAMS)] == expected
