"""Real vLLM (in-process, CPU build or GPU) against HF on the tiny Qwen2-VL model in float32: greedy parity with
images, seeded sampling, the V1 repeat processor, in-memory weight and adapter sync, and stage 2 with colocated
vLLM rollouts. All tests share ONE engine (see conftest)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from coordexp.runtime.rollout.registry import RolloutRequest, finish_output
from coordexp.runtime.rollout.hf import HfRolloutBackend
from coordexp.runtime.rollout.vllm_colocate import VllmColocateBackend
from coordexp.runtime.model.encoding import EncodingError, encode_prompt
from coordexp.runtime.core.repeat import RepeatGuard
from coordexp.schema.contract import VllmColocateContract, load_contract
from coordexp.schema.rollout import DecodingConfig
from coordexp.schema.template import TemplateConfig

from testkit import perturb_

from .conftest import GUARD, LORA_RANK, MAX_NEW, SKIP_REASON, TEMPLATE, VLLM_MISSING, load_hf_model

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(VLLM_MISSING, reason=SKIP_REASON)]
GREEDY = DecodingConfig()


def hf_rollouts(model, processor, requests, decoding=GREEDY):
    backend = HfRolloutBackend(model, processor.tokenizer, decode_batch_size=4, max_new_tokens=MAX_NEW,
                               decoding=decoding, repeat_terminate=GUARD)
    return backend.generate(requests)


def colocate_backend(write_run_config, engine, model, processor, **vllm_overrides):
    run = load_contract(write_run_config({"rollout_matching": {"vllm": vllm_overrides}} if vllm_overrides else {}))
    return VllmColocateBackend.from_run(run, model, processor, engine=engine)


def test_greedy_rollouts_equal_hf_token_for_token_with_images(engine, model_dir, processor, rollout_requests):
    hf = hf_rollouts(load_hf_model(model_dir), processor, rollout_requests)
    vllm = engine.generate(rollout_requests, decoding=GREEDY, max_new_tokens=MAX_NEW)
    assert [o.response_token_ids for o in vllm] == [o.response_token_ids for o in hf]
    assert [o.finish_reason for o in vllm] == [o.finish_reason for o in hf]
    for request, output in zip(rollout_requests, vllm):
        assert output.prompt_token_ids == tuple(request.prompt.input_ids.tolist())  # expanded image pads included
        assert engine.end_of_turn_id not in output.response_token_ids
    image_tokens = {int(r.prompt.mm_token_type_ids.sum()) for r in rollout_requests}
    assert len(image_tokens) > 1  # images of different sizes were expanded identically
    assert any(o.response_token_ids for o in vllm)


def test_coord_group_greedy_equals_hf_token_for_token(engine, model_dir, processor, rollout_requests):
    """decoding.coord_group_greedy through vLLM's processor (per-request opt-in) and HF's: the same ids, and not
    plain greedy's (on this random model plain greedy writes text where the coords hold most of the mass)."""
    grouped = DecodingConfig(coord_group_greedy=True)
    model = load_hf_model(model_dir)
    hf = hf_rollouts(model, processor, rollout_requests, decoding=grouped)
    mixed = [grouped, GREEDY, grouped, GREEDY]  # one request at a time, opting in or not
    vllm = [engine.generate([r], decoding=d, max_new_tokens=MAX_NEW)[0] for r, d in zip(rollout_requests, mixed)]
    batch = engine.generate(rollout_requests, decoding=grouped, max_new_tokens=MAX_NEW)
    plain = hf_rollouts(model, processor, rollout_requests)
    assert [o.response_token_ids for o in batch] == [o.response_token_ids for o in hf]
    assert [o.response_token_ids for o in vllm[::2]] == [o.response_token_ids for o in hf[::2]]
    assert [o.response_token_ids for o in vllm[1::2]] == [o.response_token_ids for o in plain[1::2]]
    assert [o.response_token_ids for o in hf] != [o.response_token_ids for o in plain]


def test_seeded_sampling_depends_on_the_request_seed_only(engine, rollout_requests):
    sampling = DecodingConfig(temperature=1.0, top_p=0.9, top_k=50)
    batch = engine.generate(rollout_requests, decoding=sampling, max_new_tokens=MAX_NEW)
    alone = [engine.generate([r], decoding=sampling, max_new_tokens=MAX_NEW)[0] for r in reversed(rollout_requests)]
    assert [o.response_token_ids for o in batch] == [o.response_token_ids for o in reversed(alone)]
    reseeded = [dataclasses.replace(r, seed=r.seed + 7) for r in rollout_requests]
    other = engine.generate(reseeded, decoding=sampling, max_new_tokens=MAX_NEW)
    assert [o.response_token_ids for o in other] != [o.response_token_ids for o in batch]


def test_repeat_processor_forces_eos_for_the_offending_sequence_only(engine, model_dir, processor, rollout_requests):
    from vllm import SamplingParams

    coord_7 = processor.tokenizer.convert_tokens_to_ids("<|coord_7|>")
    prompts = [engine.vllm_prompt(r) for r in rollout_requests]
    pushed = {0, 2}  # these rows are pushed to repeat <|coord_7|>; the guard stops after 3 repeats
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop_token_ids=sorted(engine.stop_ids),
                             logit_bias={coord_7: 100.0} if i in pushed else None, detokenize=False)
              for i in range(len(prompts))]
    results = engine.llm.generate(prompts, params, use_tqdm=False)
    guard = RepeatGuard.from_config(GUARD)
    outputs = [finish_output(r.prompt_token_ids, r.outputs[0].token_ids, stop_ids=engine.stop_ids,
                             decode=str, guard=guard) for r in results]
    for i in pushed:
        assert list(results[i].outputs[0].token_ids) == [coord_7] * 3 + [engine.end_of_turn_id]
        assert outputs[i].finish_reason == "repeat"
    # the other rows are exactly what they are without the pushed rows in the batch (and what HF generates)
    hf = hf_rollouts(load_hf_model(model_dir), processor, rollout_requests)
    for i in set(range(len(prompts))) - pushed:
        assert outputs[i].response_token_ids == hf[i].response_token_ids
        assert outputs[i].finish_reason == hf[i].finish_reason


def test_prompt_encoded_with_another_pixel_budget_fails_the_alignment_check(engine, processor, records):
    other = TemplateConfig(system_prompt=TEMPLATE.system_prompt, user_prompt=TEMPLATE.user_prompt,
                           min_pixels=28 * 28, max_pixels=28 * 28)
    request = RolloutRequest(prompt=encode_prompt(processor, records[0], other), index=0, record=records[0])
    with pytest.raises(EncodingError, match="template's pixel budget"):
        engine.generate([request], decoding=GREEDY, max_new_tokens=4)


def test_weight_push_makes_vllm_equal_hf_with_the_new_weights(write_run_config, restore_engine, model_dir,
                                                             processor, rollout_requests):
    model = load_hf_model(model_dir)
    backend = colocate_backend(write_run_config, restore_engine, model, processor)
    before = backend.generate(rollout_requests)
    assert backend.pushes == 1
    perturb_(model, seed=5)
    backend.sync_weights(model)
    after = backend.generate(rollout_requests)  # image requests (already seen by the encoder cache) right after
    assert backend.pushes == 2
    assert [o.response_token_ids for o in after] == [o.response_token_ids for o in hf_rollouts(model, processor,
                                                                                              rollout_requests)]
    assert [o.response_token_ids for o in after] != [o.response_token_ids for o in before]
    backend.sync_weights(model)  # nothing changed: the push is skipped
    again = backend.generate(rollout_requests[:1])
    assert (backend.pushes, backend.skipped_pushes) == (2, 1)
    assert again[0].response_token_ids == after[0].response_token_ids
    backend.close()
    assert restore_engine.llm is not None  # a shared engine is not closed by the backend


def _lora_policy(model_dir):
    peft = pytest.importorskip("peft", reason="adapter sync tests need peft (pip install peft)")
    model = load_hf_model(model_dir)
    config = peft.LoraConfig(r=LORA_RANK, lora_alpha=16, lora_dropout=0.0,
                             target_modules=r".*language_model.*\.(q|k|v|o|gate|up|down)_proj")
    policy = peft.get_peft_model(model, config)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return policy


@pytest.mark.parametrize("sync_mode", ["adapter", "full"])
def test_lora_policy_sync_equals_hf_peft(write_run_config, restore_engine, model_dir, processor, rollout_requests,
                                         sync_mode):
    policy = _lora_policy(model_dir)
    base_before = {n: p.detach().clone() for n, p in policy.named_parameters() if "base_layer" in n}
    expected = hf_rollouts(policy, processor, rollout_requests)
    base_only = hf_rollouts(load_hf_model(model_dir), processor, rollout_requests)
    assert [o.response_token_ids for o in expected] != [o.response_token_ids for o in base_only]
    backend = colocate_backend(write_run_config, restore_engine, policy, processor, enable_lora=True,
                               sync={"mode": sync_mode})
    assert backend.sync_mode == sync_mode
    got = backend.generate(rollout_requests)
    assert [o.response_token_ids for o in got] == [o.response_token_ids for o in expected]
    assert (restore_engine.adapter is not None) == (sync_mode == "adapter")
    # the training model was not merged or modified by the on-the-fly merge
    from peft.tuners.lora import LoraLayer

    assert not any(m.merged for m in policy.modules() if isinstance(m, LoraLayer))
    assert all(torch.equal(p, base_before[n]) for n, p in policy.named_parameters() if "base_layer" in n)


def test_adapter_failure_falls_back_to_full_once(write_run_config, restore_engine, model_dir, processor,
                                                 rollout_requests, caplog):
    model = load_hf_model(model_dir)  # not a PEFT model: the adapter push fails
    backend = colocate_backend(write_run_config, restore_engine, model, processor, enable_lora=True,
                               sync={"mode": "adapter", "fallback_to_full": True})
    with caplog.at_level("WARNING"):
        got = backend.generate(rollout_requests)
        perturb_(model, seed=3)
        backend.sync_weights(model)
        got = backend.generate(rollout_requests)
    assert backend.sync_mode == "full"
    assert sum("switching to full" in r.message for r in caplog.records) == 1
    assert [o.response_token_ids for o in got] == [o.response_token_ids for o in hf_rollouts(model, processor,
                                                                                            rollout_requests)]


@pytest.mark.slow
def test_stage2_trains_three_steps_with_colocated_vllm_rollouts(write_run_config, restore_engine, processor,
                                                                 rollout_requests, tmp_path):
    from coordexp.runtime.train.launch import build_trainer

    run = load_contract(write_run_config({"training": {
        "output_dir": str(tmp_path / "run"), "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
        "max_steps": 3, "logging_steps": 1, "save_steps": 1000, "learning_rate": 1e-2}}))
    assert isinstance(run.rollout_matching.backend, VllmColocateContract)
    trainer = build_trainer(run)
    assert isinstance(trainer.backend, VllmColocateBackend)
    trainer.backend.close()  # lazily built, never started; share the session engine instead
    backend = VllmColocateBackend.from_run(run, trainer.model, processor, engine=restore_engine)
    trainer.backend = backend
    trainer.train()
    assert trainer.state.global_step == 3
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert all(h["rollout/samples"] == 4 for h in trainer.state.log_history if "loss" in h)
    # one rollout call per optimizer step (both micro-steps' prompts): a push before each, none skipped
    assert backend.pushes == 3 and backend.skipped_pushes == 0
    backend.sync_weights(trainer.model)
    after = backend.generate(rollout_requests)
    assert backend.pushes == 4  # the last optimizer step
    expected = hf_rollouts(trainer.model, processor, rollout_requests)
    assert [o.response_token_ids for o in after] == [o.response_token_ids for o in expected]


def test_engine_implements_the_rollout_server_protocol(engine, model_dir, processor, rollout_requests):
    from coordexp.runtime.server.engine import GenerationParams, RolloutEngine

    assert isinstance(engine, RolloutEngine)
    assert (engine.engine_type, engine.world_size, engine.supports_adapter) == ("LLMEngine", 1, True)
    assert engine.repeat_terminate == GUARD and engine.reset_caches() is True
    served = engine.generate(rollout_requests[:2], GenerationParams(max_new_tokens=MAX_NEW, decoding=GREEDY))
    hf = hf_rollouts(load_hf_model(model_dir), processor, rollout_requests[:2])
    assert [o.response_token_ids for o in served] == [o.response_token_ids for o in hf]
