"""``rollout_matching.objective`` and ``rollout_matching.reward.*`` (issue 52): every new number is finite and
bounded, every refusal names its dotted path and says what to do, and the default leaves stage 2 as it was."""

from __future__ import annotations

import copy
import json
import math

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from coordexp.cli.app import app
from coordexp.schema.loader import validate_mapping
from coordexp.schema.rollout import RewardConfig, RolloutMatchingConfig

_RW = "rollout_matching.reward"
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
# every numeric key: (lowest accepted, highest accepted)
BOUNDS = {"group_size": (2, 64), "iou_threshold": (0.05, 1.0), "duplicate_penalty": (0.0, 10.0),
          "spurious_penalty": (0.0, 10.0), "stop_penalty": (0.0, 10.0), "close_bonus": (0.0, 10.0),
          "cutoff_penalty": (0.0, 10.0),
          "sft_weight": (0.0, 100.0), "kl_weight": (0.0, 100.0)}
runner = CliRunner()


def _reward_config(base: dict, **reward) -> dict:
    rm = base["rollout_matching"]
    rm.update(objective="reward", rollout_backend="hf", decoding=dict(SAMPLING), reward=reward)
    return base


def _error_paths(config: dict) -> dict[str, str]:
    return {e.path: e.render() for e in validate_mapping(config).errors}


def test_the_default_objective_is_sft_and_every_reward_default_validates(stage2_config):
    report = validate_mapping(stage2_config)
    assert report.ok and report.config.rollout_matching.objective == "sft"
    assert validate_mapping(_reward_config(stage2_config)).ok
    assert set(BOUNDS) <= set(RewardConfig.model_fields)


@pytest.mark.parametrize("key", sorted(BOUNDS))
def test_the_bounds_themselves_validate(stage2_config, key):
    for value in BOUNDS[key]:
        assert validate_mapping(_reward_config(stage2_config, **{key: value})).ok, (key, value)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(sorted(BOUNDS)),
       value=st.one_of(st.sampled_from([math.inf, -math.inf, math.nan, 1e300, -1e-9]),
                       st.floats(allow_nan=True, allow_infinity=True)))
def test_a_value_outside_its_bounds_is_refused_at_its_dotted_path(stage2_config, key, value):
    low, high = BOUNDS[key]
    if math.isfinite(value) and low <= value <= high and (key != "group_size" or float(value).is_integer()):
        return
    errors = _error_paths(_reward_config(dict(stage2_config, rollout_matching=dict(stage2_config["rollout_matching"])),
                                         **{key: value}))
    assert f"{_RW}.{key}" in errors, errors


def test_the_validate_command_exits_2_naming_each_refused_key(stage2_config, tmp_path):
    for key, (low, high) in BOUNDS.items():
        config = _reward_config(yaml.safe_load(yaml.safe_dump(stage2_config)), **{key: high + 1})
        path = tmp_path / f"{key}.yaml"
        path.write_text(yaml.safe_dump(config), encoding="utf-8")
        result = runner.invoke(app, ["validate", "--json", str(path)], catch_exceptions=False)
        assert result.exit_code == 2, key
        (item,) = json.loads(result.stdout)
        assert f"{_RW}.{key}" in [e["path"] for e in item["errors"]], item


def test_an_unknown_reward_key_and_an_unknown_objective_fail_at_their_paths(stage2_config):
    errors = _error_paths(_reward_config(stage2_config, grup_size=4))
    assert f"{_RW}.grup_size" in errors
    assert f"{_RW}.credit" in _error_paths(_reward_config(copy.deepcopy(stage2_config), credit="tokens"))
    assert f"{_RW}.include_greedy" in _error_paths(_reward_config(copy.deepcopy(stage2_config), include_greedy="x"))
    stage2_config["rollout_matching"]["objective"] = "rl"
    assert "rollout_matching.objective" in _error_paths(stage2_config)


def test_the_kl_term_is_refused_under_zero3_only(stage2_config, tmp_path):
    """The frozen reference is a whole copy of the starting model: ZeRO-2 keeps whole parameters on every rank, so
    the copy is built; ZeRO-3 partitions them from loading on, preset or JSON file alike."""
    assert validate_mapping(_reward_config(stage2_config, kl_weight=0.05)).ok
    stage2_config["training"]["deepspeed"] = "zero2"
    assert f"{_RW}.kl_weight" not in _error_paths(_reward_config(copy.deepcopy(stage2_config), kl_weight=0.05))
    ds_json = tmp_path / "ds.json"
    ds_json.write_text('{"zero_optimization": {"stage": "3"}, "train_micro_batch_size_per_gpu": "auto"}')
    for deepspeed in ("zero3", str(ds_json)):
        stage2_config["training"]["deepspeed"] = deepspeed
        errors = _error_paths(_reward_config(copy.deepcopy(stage2_config), kl_weight=0.05))
        assert "ZeRO-3" in errors[f"{_RW}.kl_weight"] and "kl_weight: 0" in errors[f"{_RW}.kl_weight"], deepspeed
        assert f"{_RW}.kl_weight" not in _error_paths(_reward_config(copy.deepcopy(stage2_config), kl_weight=0.0))


@pytest.mark.parametrize("decoding", [{"temperature": 0.0}, {"temperature": 0.7}, {"top_p": 0.9}, {"top_k": 50},
                                      {"repetition_penalty": 1.1}])
def test_the_reward_objective_needs_the_policys_own_distribution(stage2_config, decoding):
    config = _reward_config(stage2_config)
    config["rollout_matching"]["decoding"].update(decoding)
    errors = _error_paths(config)
    assert "rollout_matching.decoding" in errors and "temperature: 1.0" in errors["rollout_matching.decoding"]
    config["rollout_matching"]["objective"] = "sft"
    assert "rollout_matching.decoding" not in _error_paths(config)  # sft decodes as it likes


def test_greedy_members_need_a_per_request_backend_and_overlap_is_refused(stage2_config):
    config = _reward_config(stage2_config, include_greedy=True)
    assert validate_mapping(config).ok
    config["rollout_matching"]["rollout_backend"] = "vllm"  # colocate: the engine takes a decoding per request
    assert f"{_RW}.include_greedy" not in _error_paths(config)
    config["rollout_matching"]["vllm"] = {"mode": "server", "server": {"servers": [
        {"base_url": "http://127.0.0.1:8000", "group_port": 51216}]}}
    assert f"{_RW}.include_greedy" in _error_paths(config)  # one decoding setting per server call
    model = RolloutMatchingConfig.model_validate({"rollout_backend": "vllm", "objective": "reward",
                                                  "decoding": SAMPLING})
    assert model.reward.group_size == 4 and model.reward.credit == "object"
    with pytest.raises(ValueError, match="overlap"):
        RolloutMatchingConfig.model_validate({"rollout_backend": "vllm", "objective": "reward", "decoding": SAMPLING,
                                              "vllm": {"mode": "server", "server": {"servers": [
                                                  {"base_url": "http://127.0.0.1:8000", "group_port": 51216}]}},
                                              "overlap": {"enabled": True}})


@pytest.mark.parametrize(("key", "value"), [("fn_placement", "reading_order"), ("repeats", "drop"),
                                            ("objective", "reward"), ("collapse_alarm", {"action": "stop"}),
                                            ("gt_step_share", 0.5)])
def test_a_stage2_only_key_in_a_stage1_config_is_warned_about(key, value, stage2_config):
    """Regression (issue 56, item 27): stage-2-only keys in a stage-1 config were ignored without a word."""
    import copy

    from coordexp.schema.loader import validate_mapping

    data = copy.deepcopy(stage2_config)
    data["rollout_matching"][key] = value
    if key == "objective":
        data["rollout_matching"]["decoding"] = {"temperature": 1.0}
    stage2 = validate_mapping(data)
    assert stage2.ok, stage2.errors
    assert not any(w.path == f"rollout_matching.{key}" for w in stage2.warnings)
    data["custom"] = {**data.get("custom", {}), "trainer_variant": "stage1_sft"}
    report = validate_mapping(data)
    assert report.ok, report.errors
    assert any(w.path == f"rollout_matching.{key}" and "no effect in stage1_sft" in w.message
               for w in report.warnings)


def test_a_packing_buffer_that_cannot_hold_a_reward_step_is_refused_naming_what_fits(stage2_config):
    """Regression: the screen's first reward arm crashed at its first rollout step (PackingLimitError, 1 buffered + 16
    new segments > packing_buffer 16) after 27 minutes of stage 1; validation now says so before anything runs."""
    import copy

    from coordexp.schema.loader import validate_mapping

    data = copy.deepcopy(stage2_config)
    data["rollout_matching"].update({"objective": "reward", "decoding": {"temperature": 1.0}})
    data["training"].update({"packing": True, "packing_buffer": 16, "per_device_train_batch_size": 4})
    report = validate_mapping(data)
    assert [e.path for e in report.errors] == ["training.packing_buffer"]
    assert "packing_buffer: 32" in report.errors[0].render()
    data["training"]["packing_buffer"] = 32
    assert validate_mapping(data).ok
