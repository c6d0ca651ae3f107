"""The normalised contract: resolved sync mode, servers, timeouts, packing length, frozen objects."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from coordexp.schema.contract import (
    HfBackendContract,
    RunContract,
    ServerEndpoint,
    VllmColocateContract,
    VllmServerContract,
    build_contract,
    load_contract,
)
from coordexp.schema.errors import ConfigError
from coordexp.schema.loader import validate_mapping

REPO = Path(__file__).resolve().parents[2]


def _contract(data: dict) -> RunContract:
    report = validate_mapping(data)
    assert report.ok, [i.render() for i in report.errors]
    return build_contract(report.config)


def _server_mode(data: dict, **vllm) -> dict:
    data["rollout_matching"]["vllm"] = {
        "mode": "server",
        "server": {"servers": [{"base_url": "http://a:8000/", "group_port": 51216},
                               {"base_url": "https://b:9000", "group_port": 51217}], "infer_timeout_s": 0},
        **vllm,
    }
    return data


@pytest.mark.parametrize(("requested", "lora", "resolved"),
                         [("auto", True, "adapter"), ("auto", False, "full"), ("full", True, "full"),
                          ("adapter", True, "adapter")])
def test_sync_mode_resolution(stage2_config, requested, lora, resolved):
    stage2_config["rollout_matching"]["vllm"] = {"enable_lora": lora, "sync": {"mode": requested}}
    sync = _contract(stage2_config).rollout_matching.backend.sync
    assert (sync.mode, sync.requested_mode) == (resolved, requested)


def test_server_list_and_timeouts(stage2_config):
    rm = _contract(_server_mode(stage2_config)).rollout_matching
    assert isinstance(rm.backend, VllmServerContract)
    assert rm.backend.servers == (ServerEndpoint("http://a:8000", 51216), ServerEndpoint("https://b:9000", 51217))
    assert (rm.backend.timeout_s, rm.backend.infer_timeout_s) == (240.0, None)  # <= 0 means no timeout
    assert rm.serving.sync_timeout_s == 240.0


def test_packing_length_and_max_model_len(stage2_config):
    rm = _contract(stage2_config).rollout_matching
    assert rm.packing.packing_length == 2048 and rm.backend.engine.max_model_len == 2048
    stage2_config["template"] = {"max_length": 1024}
    stage2_config["training"].update({"packing": True, "packing_buffer": 64, "packing_min_fill_ratio": 0.5})
    packing = _contract(stage2_config).rollout_matching.packing
    assert (packing.enabled, packing.packing_length, packing.buffer, packing.min_fill_ratio, packing.drop_last) == (
        True, 1024, 64, 0.5, True)


def test_hf_backend_has_no_vllm_mode_and_offload_is_inactive(stage2_config):
    stage2_config["rollout_matching"].update(
        {"rollout_backend": "hf", "offload": {"enabled": True, "offload_model": True}})
    rm = _contract(stage2_config).rollout_matching
    assert rm.backend == HfBackendContract() and rm.offload_active is False


@pytest.mark.parametrize(("overrides", "expected"), [
    ({"rollout_backend": "hf"}, HfBackendContract),
    ({"rollout_backend": "vllm", "vllm": {"mode": "colocate"}}, VllmColocateContract),
    ({"rollout_backend": "vllm", "vllm": {"mode": "server", "server": {
        "servers": [{"base_url": "http://a:1", "group_port": 2}]}}}, VllmServerContract),
])
def test_backend_choice_is_one_typed_contract_with_only_its_settings(stage2_config, overrides, expected):
    stage2_config["rollout_matching"].update(overrides)
    contract = _contract(stage2_config)
    backend = contract.rollout_matching.backend
    assert type(backend) is expected
    plain = contract.to_dict()["rollout_matching"]["backend"]
    assert plain["kind"] == backend.kind
    assert ("servers" in plain, "engine" in plain, "offload" in plain) == (
        expected is VllmServerContract, expected is VllmColocateContract, expected is VllmColocateContract)


def test_top_level_fields(stage2_config):
    stage2_config["training"]["seed"] = 7
    stage2_config["custom"]["object_field_order"] = "geometry_first"
    contract = _contract(stage2_config)
    assert (contract.trainer_variant, contract.global_max_length, contract.seed) == ("stage2_rollout_aligned", 2048, 7)
    assert contract.rollout_matching.object_field_order == "geometry_first"
    assert contract.data.image_root == str(Path(contract.data.train_jsonl).parent)
    assert contract.rollout_matching.pipeline.module("coord_reg").config.target_sigma == 2.0


def test_contract_is_frozen(stage2_config):
    contract = _contract(stage2_config)
    with pytest.raises(dataclasses.FrozenInstanceError):
        contract.seed = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        contract.rollout_matching.decode_batch_size = 2  # type: ignore[misc]


@pytest.mark.parametrize(("world_size", "mode", "fails"), [(1, "adapter", False), (2, "adapter", True),
                                                          (2, "full", False)])
def test_require_full_sync_for(stage2_config, world_size, mode, fails):
    rm = _contract(_server_mode(stage2_config, enable_lora=True, sync={"mode": mode})).rollout_matching
    if not fails:
        rm.require_full_sync_for(world_size)
        return
    with pytest.raises(ConfigError) as info:
        rm.require_full_sync_for(world_size)
    (issue,) = info.value.issues
    assert issue.path == "rollout_matching.vllm.sync.mode" and "sync.mode: full" in issue.hint


def test_every_example_builds_a_json_contract():
    for path in sorted((REPO / "examples").glob("*.yaml")):
        contract = load_contract(path)
        text = json.dumps(contract.to_dict())
        assert json.loads(text)["rollout_matching"]["packing"]["packing_length"] > 0


def test_example_specifics():
    server = load_contract(REPO / "examples" / "stage2_server_3v1.yaml").rollout_matching
    assert isinstance(server.backend, VllmServerContract) and len(server.backend.servers) == 1
    assert server.decode_batch_size == 8
    cpu = load_contract(REPO / "examples" / "stage2_cpu_hf.yaml")
    assert isinstance(cpu.rollout_matching.backend, HfBackendContract)
    assert cpu.model.path == str(REPO / ".coordexp" / "tiny-model")
    assert cpu.rollout_matching.packing.packing_length == 512
    assert load_contract(REPO / "examples" / "stage1_sft.yaml").trainer_variant == "stage1_sft"
