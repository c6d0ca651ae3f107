"""Merged weight export of real Qwen-VL LoRA and DoRA policies (tiny Qwen2-VL and Qwen3-VL, adapters from
``apply_tuner``) equals PEFT's own ``merge_and_unload``, and exporting leaves the training model bit-identical."""

from __future__ import annotations

import copy

import pytest
import torch

from coordexp.runtime.model.tuner import apply_tuner
from coordexp.runtime.rollout.weight_export import adapter_state, named_tensors, policy_version
from coordexp.runtime.rollout.weight_sync import WeightSyncError
from coordexp.schema.tuner import TunerConfig

pytest.importorskip("peft", reason="needs peft (pip install peft)")


def _policy(model_dir, *, use_dora: bool, seed: int, **tuner):
    """A float32 tiny policy wrapped by apply_tuner, with every adapter tensor randomised (a fresh lora_B is zero,
    which would make any merge look right)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32)
    policy = apply_tuner(model, TunerConfig(train_type="lora", use_dora=use_dora, lora_rank=4, lora_alpha=8,
                                            **tuner))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_magnitude_vector" in name:  # stays positive: a row norm
                parameter.mul_(0.5 + torch.rand(parameter.shape, generator=generator))
            elif ".lora_" in name:
                parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
            elif ".modules_to_save." in name:
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return policy


def _bits(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


FAMILIES = ["qwen2_vl", "qwen3_vl"]


@pytest.fixture(params=FAMILIES)
def family_dir(request, tiny_model_dir, qwen3_model_dir):
    return request.param, (tiny_model_dir if request.param == "qwen2_vl" else qwen3_model_dir)


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_export_equals_merge_and_unload_and_leaves_the_policy_bit_identical(family_dir, use_dora):
    family, model_dir = family_dir
    saved = ["model.visual.deepstack_merger_list.0"] if family == "qwen3_vl" else ["model.visual.merger"]
    policy = _policy(model_dir, use_dora=use_dora, seed=1, modules_to_save=saved)
    before, version = _bits(policy), policy_version(policy)

    exported = dict(named_tensors(policy))

    after = dict(policy.named_parameters())
    assert set(after) == set(before)
    for name, value in before.items():  # the training model is only read: same bits, same in-place versions
        assert torch.equal(after[name].detach().view(torch.int32), value.view(torch.int32)), name
    assert policy_version(policy) == version
    reference = copy.deepcopy(policy).merge_and_unload().state_dict()
    assert set(exported) == set(reference)
    for name, tensor in reference.items():
        torch.testing.assert_close(exported[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    # the merge changed something real: adapted weights and the trained modules_to_save differ from the base
    base = dict(policy.get_base_model().named_parameters())
    q_proj = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(exported[q_proj], base[q_proj.replace(".weight", ".base_layer.weight")])
    merger = next(n for n in exported if n.startswith(saved[0] + ".") and n.endswith("weight"))
    original = merger.replace(saved[0], saved[0] + ".original_module")
    assert not torch.allclose(exported[merger], base[original])


def test_dora_export_is_not_plain_lora_math(tiny_model_dir):
    """DoRA's merge rescales every output row by magnitude / ||W + dW||: adding the plain LoRA delta alone (the old
    export) gives a different weight, so the test above would catch a DoRA-blind merge."""
    policy = _policy(tiny_model_dir, use_dora=True, seed=2)
    layer = policy.get_base_model().model.language_model.layers[0].self_attn.q_proj
    plain = layer.base_layer.weight + layer.get_delta_weight("default")
    exported = dict(named_tensors(policy))["model.language_model.layers.0.self_attn.q_proj.weight"]
    assert not torch.allclose(exported, plain, atol=1e-4)
    norms = exported.norm(dim=1)
    torch.testing.assert_close(norms, layer.lora_magnitude_vector["default"].weight.detach(), rtol=1e-4, atol=1e-5)


def test_dora_adapter_state_is_refused_so_adapter_sync_falls_back(tiny_model_dir):
    policy = _policy(tiny_model_dir, use_dora=True, seed=3)
    with pytest.raises(WeightSyncError, match="DoRA") as info:
        adapter_state(policy)
    assert "sync.mode: full" in info.value.hint
    plain = _policy(tiny_model_dir, use_dora=False, seed=3)
    state = adapter_state(plain)
    assert state.config["use_dora"] is False
    assert any(".lora_A." in name for name, _ in state.tensors)


@pytest.mark.vllm
@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_colocate_adapter_sync_of_an_apply_tuner_policy(write_run_config, restore_engine, model_dir, processor,
                                                        rollout_requests, caplog, use_dora):
    """Plain LoRA is served as a vLLM adapter; DoRA falls back (one warning) to merged weights. Either way vLLM
    rolls out exactly what HF generates with the PEFT policy."""
    from coordexp.runtime.rollout.hf import HfRolloutBackend
    from coordexp.runtime.rollout.vllm_colocate import VllmColocateBackend
    from coordexp.schema.contract import load_contract

    from .conftest import GUARD, LORA_RANK, MAX_NEW

    run = load_contract(write_run_config({"rollout_matching": {"vllm": {
        "enable_lora": True, "sync": {"mode": "adapter", "fallback_to_full": True}}}}))
    policy = _policy(model_dir, use_dora=use_dora, seed=7)
    assert policy.peft_config["default"].r <= LORA_RANK
    policy.eval()
    hf = HfRolloutBackend(policy, processor.tokenizer, decode_batch_size=4, max_new_tokens=MAX_NEW,
                          decoding=run.rollout_matching.decoding, repeat_terminate=GUARD)
    expected = [o.response_token_ids for o in hf.generate(rollout_requests)]
    backend = VllmColocateBackend.from_run(run, policy, processor, engine=restore_engine)
    with caplog.at_level("WARNING"):
        got = [o.response_token_ids for o in backend.generate(rollout_requests)]
    assert got == expected
    assert backend.sync_mode == ("full" if use_dora else "adapter")
    assert (restore_engine.adapter is not None) == (not use_dora)
    assert sum("switching to full" in r.getMessage() for r in caplog.records) == (1 if use_dora else 0)
    backend.close()


def test_export_with_gradients_present_leaves_them_and_exports_plain_tensors(tiny_model_dir):
    """Mid-accumulation the adapter holds gradients: the export leaves them as they are and yields tensors that
    carry no gradient and need none."""
    policy = _policy(tiny_model_dir, use_dora=True, seed=8)
    ids = torch.tensor([[3, 9, 27, 81, 4]])
    policy(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    assert grads
    reference = copy.deepcopy(policy).merge_and_unload().state_dict()
    exported = dict(named_tensors(policy))
    for name, tensor in reference.items():
        torch.testing.assert_close(exported[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
        assert exported[name].grad is None and not exported[name].requires_grad
    for name, parameter in policy.named_parameters():
        if name in grads:
            assert torch.equal(parameter.grad, grads[name]), name


def test_colocate_engine_starts_from_the_base_of_an_adapter_model_path(tmp_path, write_run_config, model_dir):
    """vLLM cannot load an adapter directory as a model: the colocated engine starts from the adapter's base and
    the first push brings the adapted weights."""
    from coordexp.runtime.rollout.vllm_colocate import VllmColocateBackend
    from coordexp.schema.contract import load_contract

    adapter = tmp_path / "adapter"
    _policy(model_dir, use_dora=False, seed=9).save_pretrained(str(adapter))
    run = load_contract(write_run_config({"model": {"path": str(adapter)}}, name="adapter_path.yaml"))
    backend = VllmColocateBackend.from_run(run, object(), type("P", (), {"tokenizer": None})())
    assert backend.settings.model_path == str(model_dir)
    plain = load_contract(write_run_config({}, name="plain_path.yaml"))
    assert VllmColocateBackend.from_run(plain, object(), type("P", (), {"tokenizer": None})()).settings.model_path \
        == str(model_dir)
