"""Reading ZeRO-3 weights (docs/design.md, decision 14) without DeepSpeed itself: parameters marked the way ZeRO-3
marks them (``ds_id``, ``ds_status``, ``ds_tensor``). The export refuses shards that are not gathered (it exported
empty tensors before), the policy version follows the shards, and HF rollouts decode on a whole copy built while the
weights are gathered, without DeepSpeed's hooks. The real thing runs in tests/e2e/test_deepspeed_torchrun.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from coordexp.runtime.model.weight_version import note_optimizer_step
from coordexp.runtime.rollout.sync_errors import WeightSyncError
from coordexp.runtime.rollout.weight_export import full_parameters, named_tensors, policy_version, zero3_partitioned
from coordexp.runtime.rollout.zero3_decode import GatheredDecodeModel

AVAILABLE, NOT_AVAILABLE = SimpleNamespace(name="AVAILABLE"), SimpleNamespace(name="NOT_AVAILABLE")


def _zero3_like(status=AVAILABLE) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    for index, parameter in enumerate(model.parameters()):
        parameter.ds_id, parameter.ds_status = index, status
        parameter.ds_tensor = parameter.detach().reshape(-1)[:1].clone()  # this rank's shard
    return model


def _set_status(model: torch.nn.Module, status) -> None:
    for parameter in model.parameters():
        parameter.ds_status = status


def test_the_export_refuses_shards_that_are_not_gathered():
    model = _zero3_like(NOT_AVAILABLE)
    with pytest.raises(WeightSyncError, match="ZeRO-3 shard: exporting them would send empty tensors") as caught:
        list(named_tensors(model))
    assert "full_parameters" in caught.value.hint
    _set_status(model, AVAILABLE)  # what a gather leaves
    assert [name for name, _ in named_tensors(model)] == [name for name, _ in model.named_parameters()]


def test_full_parameters_is_a_no_op_without_zero3():
    model = torch.nn.Linear(2, 2)
    assert not zero3_partitioned(model) and zero3_partitioned(_zero3_like())
    with full_parameters(model) as inside:
        assert inside is model


def test_the_policy_version_follows_the_shards():
    model = _zero3_like()
    before = policy_version(model)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.ds_tensor.data.add_(1.0)  # how DeepSpeed's optimizer writes: the version does not move
    assert policy_version(model) == before
    note_optimizer_step(model)
    assert policy_version(model) != before


def test_rollouts_decode_on_a_whole_copy_without_deepspeeds_hooks():
    model = _zero3_like()
    calls: list[str] = []

    def deepspeed_hook(module, args):
        calls.append("deepspeed")

    deepspeed_hook.__module__ = "deepspeed.runtime.zero.parameter_offload"
    model[0].register_forward_pre_hook(deepspeed_hook)
    model[0].register_forward_pre_hook(lambda module, args: calls.append("own"))
    model[0].ds_grads_remaining = 0  # DeepSpeed's module state stays behind too
    copies = GatheredDecodeModel()
    with pytest.raises(RuntimeError, match="no gathered copy"):
        _set_status(model, NOT_AVAILABLE)
        copies.model_for(model)
    _set_status(model, AVAILABLE)
    twin = copies.model_for(model)
    assert twin is not model and not hasattr(twin[0], "ds_grads_remaining")
    assert all(not hasattr(p, "ds_id") and not p.requires_grad for p in twin.parameters())
    x = torch.ones(1, 4)
    assert torch.equal(twin(x), model(x))
    calls.clear()
    twin(x)
    assert calls == ["own"]  # the model's own hook runs, DeepSpeed's does not
    # partitioned again (training): the copy stays as it was, even after a step, until the next gather
    _set_status(model, NOT_AVAILABLE)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    note_optimizer_step(model)
    assert copies.model_for(model) is twin and not torch.equal(twin[0].weight, model[0].weight)
    _set_status(model, AVAILABLE)
    assert copies.model_for(model) is twin and torch.equal(twin[0].weight, model[0].weight)  # refreshed in place
    assert copies.copies == 2
