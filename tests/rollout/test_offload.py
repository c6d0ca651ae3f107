"""The offload context: a no-op unless the contract says offload_active (vLLM colocate), never moves sharded
state, and (on a GPU) brings parameters, gradients and optimizer state back bit-identical as the same objects."""

from __future__ import annotations

import copy

import pytest
import torch

from coordexp.runtime.rollout.offload import OffloadError, check_offloadable, offload_context
from coordexp.schema.contract import load_contract
from coordexp.schema.rollout import OffloadConfig

BOTH = OffloadConfig(enabled=True, offload_model=True, offload_optimizer=True)


def _trained_pair(device: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(3, 8, device=device)).square().mean().backward()
        optimizer.step()
    model(torch.randn(3, 8, device=device)).square().mean().backward()  # grads of an accumulation step in flight
    return model, optimizer


def _snapshot(model, optimizer):
    params = {n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    return params, state


def _assert_same(model, optimizer, snapshot, device):
    params, state = snapshot
    for name, parameter in model.named_parameters():
        assert parameter.device.type == device
        assert torch.equal(parameter.detach(), params[name][0]) and torch.equal(parameter.grad, params[name][1])
    for parameter, values in optimizer.state.items():
        for key, value in values.items():
            assert torch.equal(value, state[id(parameter)][key])


@pytest.mark.parametrize("backend_yaml", [{"rollout_backend": "hf"},
                                          {"vllm": {"mode": "server", "server": {"servers": [
                                              {"base_url": "http://127.0.0.1:8000", "group_port": 51216}]}}}],
                         ids=["hf", "server"])
def test_offload_is_inactive_for_hf_and_server_backends(stage2_config, write_yaml, backend_yaml):
    stage2_config["rollout_matching"].update(backend_yaml)
    stage2_config["rollout_matching"]["offload"] = BOTH.model_dump()
    run = load_contract(write_yaml(stage2_config))
    assert run.rollout_matching.offload_active is False
    model, optimizer = _trained_pair("cpu")
    storage = {n: p.data_ptr() for n, p in model.named_parameters()}
    with offload_context(model, optimizer, BOTH, active=False, target="meta") as report:
        assert {n: p.data_ptr() for n, p in model.named_parameters()} == storage  # nothing moved, not even to meta
    assert report.tensors_moved == 0


def test_offload_active_for_colocate(stage2_config, write_yaml):
    stage2_config["rollout_matching"]["offload"] = BOTH.model_dump()
    rollout = load_contract(write_yaml(stage2_config)).rollout_matching
    assert rollout.offload_active is True and rollout.backend.offload == BOTH


def test_tensors_already_on_the_target_stay_put():
    model, optimizer = _trained_pair("cpu")
    snapshot = _snapshot(model, optimizer)
    with offload_context(model, optimizer, BOTH, active=True, target="cpu") as report:
        pass
    assert report.tensors_moved == 0
    _assert_same(model, optimizer, snapshot, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device round trip needs a CUDA device")
def test_round_trip_is_bit_identical_and_keeps_object_identity():
    model, optimizer = _trained_pair("cuda")
    snapshot = _snapshot(model, optimizer)
    objects = [id(p) for p in model.parameters()]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with offload_context(model, optimizer, BOTH, active=True) as report:
        assert all(p.device.type == "cpu" for p in model.parameters())
        assert all(v.device.type == "cpu" for s in optimizer.state.values() for v in s.values())
        assert torch.cuda.memory_allocated() < before
    assert report.tensors_moved > 0 and report.devices == {"cuda:0"}
    assert [id(p) for p in model.parameters()] == objects
    _assert_same(model, optimizer, snapshot, "cuda")
    model(torch.randn(3, 8, device="cuda")).square().mean().backward()
    optimizer.step()  # the optimizer still owns the same, working state


def test_state_comes_back_when_the_block_raises():
    model, optimizer = _trained_pair("cpu")
    snapshot = _snapshot(model, optimizer)
    with pytest.raises(RuntimeError, match="engine died"):
        with offload_context(model, optimizer, BOTH, active=True):
            raise RuntimeError("engine died")
    _assert_same(model, optimizer, snapshot, "cpu")


def test_deepspeed_zero_parameters_fail_fast_with_mitigations():
    model, optimizer = _trained_pair("cpu")
    next(model.parameters()).ds_id = 0  # what ZeRO-3 attaches to the parameters it partitions
    with pytest.raises(OffloadError, match="DeepSpeed ZeRO.*offload.enabled: false"):
        with offload_context(model, optimizer, BOTH, active=True):
            pass


def test_fsdp_wrapper_fails_fast():
    class FullyShardedDataParallel(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    with pytest.raises(OffloadError, match="sharded"):
        check_offloadable(FullyShardedDataParallel(copy.deepcopy(torch.nn.Linear(2, 2))), None)
