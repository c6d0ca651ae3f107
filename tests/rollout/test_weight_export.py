"""The one weight export: parameter versions, HF-named tensors with LoRA merged into new tensors (the training
model only read), one adapter-state shape, and the server weight channel built on it."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from coordexp.errors import ExternalSystemError
from coordexp.runtime.rollout.vllm_server import ServerWeightChannel
from coordexp.runtime.rollout.weight_export import (
    AdapterState,
    adapter_state,
    named_tensors,
    policy_version,
    unwrap_model,
)
from coordexp.runtime.rollout.weight_sync import SyncReport, WeightSyncError


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 2)


class Wrapper(torch.nn.Module):
    """Holds the policy as ``.module``, like DDP and accelerate wrappers."""

    def __init__(self, module):
        super().__init__()
        self.module = module


def lora_policy(seed: int = 0):
    peft = pytest.importorskip("peft", reason="needs peft (pip install peft)")
    torch.manual_seed(seed)
    policy = peft.get_peft_model(Block(), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_()
    return policy


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_bit_identical(model, before: dict[str, torch.Tensor]) -> None:
    now = dict(model.named_parameters())
    assert set(now) == set(before)
    for name, value in before.items():
        assert torch.equal(now[name].detach().view(torch.int32), value.view(torch.int32)), name


def test_policy_version_changes_on_updates_only():
    model = torch.nn.Linear(3, 2)
    version = policy_version(model)
    for parameter in model.parameters():
        parameter.data = parameter.data.clone()  # an offload round trip swaps storage, not values
    assert policy_version(model) == version
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    assert policy_version(model) != version


def test_unwrap_reaches_the_policy_inside_nested_wrappers():
    policy = Block()
    assert unwrap_model(Wrapper(Wrapper(policy))) is policy and unwrap_model(policy) is policy
    assert [n for n, _ in named_tensors(Wrapper(policy))] == [n for n, _ in policy.named_parameters()]


def test_plain_policy_tensors_are_its_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    assert [(n, t.data_ptr()) for n, t in named_tensors(model)] == [
        (n, p.data_ptr()) for n, p in model.named_parameters()]


def test_lora_merge_on_the_fly_equals_peft_merge_and_leaves_the_policy_unmerged():
    policy = lora_policy()
    before = snapshot(policy)
    merged = dict(named_tensors(policy))
    assert set(merged) == {"q_proj.weight", "q_proj.bias", "head.weight", "head.bias"}
    reference = dict(copy.deepcopy(policy).merge_and_unload().named_parameters())
    assert all(torch.allclose(merged[n], reference[n], atol=1e-6) for n in merged)
    assert not policy.base_model.model.q_proj.merged
    assert not torch.allclose(policy.base_model.model.q_proj.base_layer.weight, merged["q_proj.weight"])
    assert_bit_identical(policy, before)


def test_adapter_state_has_one_shape_with_json_plain_config():
    policy = lora_policy()
    state = adapter_state(Wrapper(policy))
    assert isinstance(state, AdapterState) and state.name == "default"
    assert json.loads(json.dumps(state.config)) == state.config  # plain data: ready for the wire and for vLLM
    assert state.config["r"] == 2 and sorted(state.config["target_modules"]) == ["q_proj"]
    names = [name for name, _ in state.tensors]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    lora = {n: p for n, p in policy.named_parameters() if "lora_" in n}
    assert all(any(torch.equal(t, p) for p in lora.values()) for _, t in state.tensors)


def test_adapter_state_of_a_plain_model_is_a_weight_sync_error_with_a_hint():
    with pytest.raises(WeightSyncError, match="needs a PEFT LoRA policy") as info:
        adapter_state(torch.nn.Linear(2, 2))
    assert isinstance(info.value, ExternalSystemError) and isinstance(info.value, RuntimeError)
    assert "sync.mode: full" in info.value.hint


class RecordingClient:
    base_url = "http://127.0.0.1:1"

    def __init__(self):
        self.announced: list[list[dict]] = []
        self.adapters: list[tuple[int, dict]] = []
        self.resets = 0

    def update_flattened_params(self, metadatas):
        self.announced.append(metadatas)

    def update_adapter_flattened_param(self, lora_id, config, metadatas):
        self.adapters.append((lora_id, config))
        self.announced.append(metadatas)

    def reset_prefix_cache(self):
        self.resets += 1


class CheckingSender:
    """Stands in for the transport; while it consumes the tensors it checks the training model is untouched (an
    in-place merge would show here even if an unmerge restored it afterwards)."""

    def __init__(self, model, before):
        self.model, self.before, self.sent = model, before, {}

    def _consume(self, tensors, announce):
        for name, tensor in tensors:
            assert_bit_identical(self.model, self.before)
            self.sent[name] = tensor.clone()
        announce([])
        return SyncReport(1, len(self.sent), 0, 1e-3)

    def send_full(self, tensors, *, announce, **options):
        return self._consume(tensors, announce)

    def send_adapter(self, tensors, *, announce):
        return self._consume(tensors, announce)


@pytest.mark.parametrize("mode", ["full", "adapter"])
def test_server_channel_push_leaves_every_training_parameter_bit_identical(mode):
    from peft.tuners.lora import LoraLayer

    policy = lora_policy(seed=1)
    before = snapshot(policy)
    channel = ServerWeightChannel(timeout_s=5)
    sender = CheckingSender(policy, before)
    channel._sender = lambda client: sender  # the transport is tested in test_weight_sync.py
    client = RecordingClient()
    channel(client, Wrapper(policy), mode)
    assert_bit_identical(policy, before)
    assert not any(m.merged for m in policy.modules() if isinstance(m, LoraLayer))
    assert client.resets == 1
    if mode == "full":
        assert set(sender.sent) == {"q_proj.weight", "q_proj.bias", "head.weight", "head.bias"}
        reference = dict(copy.deepcopy(policy).merge_and_unload().named_parameters())
        assert all(torch.allclose(sender.sent[n], reference[n], atol=1e-6) for n in sender.sent)
    else:
        assert client.adapters == [(1, adapter_state(policy).config)]
        assert set(sender.sent) == {n for n, _ in adapter_state(policy).tensors}
