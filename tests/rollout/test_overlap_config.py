"""The actor-learner overlap key: off by default, server mode only; the staleness bound takes the values the
pipeline enforces (1..16, with or without overlap)."""

from __future__ import annotations

import pytest

from coordexp.schema.contract import load_contract
from coordexp.schema.errors import ConfigError
from testkit import server_rollout


def test_overlap_is_off_by_default(stage2_config, write_yaml):
    run = load_contract(write_yaml(stage2_config))
    assert run.rollout_matching.overlap.enabled is False and run.rollout_matching.overlap.staleness == 1


@pytest.mark.parametrize("backend", [{"rollout_backend": "hf"}, {"rollout_backend": "vllm", "vllm": {"mode": "colocate"}}],
                         ids=["hf", "colocate"])
def test_overlap_is_refused_where_generation_shares_the_learners_devices(stage2_config, write_yaml, backend):
    stage2_config["rollout_matching"].update(backend, overlap={"enabled": True})
    with pytest.raises(ConfigError) as info:
        load_contract(write_yaml(stage2_config))
    text = str(info.value)
    assert "overlap.enabled" in text and "vllm.mode: server" in text


def test_overlap_in_server_mode_resolves_into_the_contract(stage2_config, write_yaml):
    stage2_config["rollout_matching"].update(server_rollout([("http://127.0.0.1:8000", 51216)]),
                                             overlap={"enabled": True})
    run = load_contract(write_yaml(stage2_config))
    assert run.rollout_matching.overlap.enabled is True


@pytest.mark.parametrize("staleness", [0, 17, -1, 1.5])
def test_staleness_outside_its_bound_is_refused(stage2_config, write_yaml, staleness):
    stage2_config["rollout_matching"].update(server_rollout([("http://127.0.0.1:8000", 51216)]),
                                             overlap={"enabled": True, "staleness": staleness})
    with pytest.raises(ConfigError, match="staleness"):
        load_contract(write_yaml(stage2_config))


@pytest.mark.parametrize("staleness", [1, 2, 16])
def test_staleness_bound_is_accepted_with_and_without_overlap(stage2_config, write_yaml, staleness):
    stage2_config["rollout_matching"]["overlap"] = {"staleness": staleness}  # hf backend, overlap off: bounds the carry
    assert load_contract(write_yaml(stage2_config)).rollout_matching.overlap.staleness == staleness
    stage2_config["rollout_matching"].update(server_rollout([("http://127.0.0.1:8000", 51216)]),
                                             overlap={"enabled": True, "staleness": staleness})
    assert load_contract(write_yaml(stage2_config)).rollout_matching.overlap.staleness == staleness
