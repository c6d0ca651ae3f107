"""``tuner.target_regex`` with a bound on its cost (issue 30 item 2): deep nesting and catastrophic backtracking are
exit 2 at ``validate`` (never a RecursionError, never a hang), a pattern that would match modules PEFT's LoRA cannot
adapt is refused naming them with the fix, and the same guards hold on the checkpoint's own module names when
training starts (``resolve_targets``), before PEFT ever runs the pattern."""

from __future__ import annotations

import importlib.util
import re
import threading

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from coordexp.cli.app import app
from coordexp.schema.loader import validate_mapping
from coordexp.schema.regex_guard import (MAX_GROUP_DEPTH, RegexCostError, compile_bounded, fullmatching,
                                         group_depth)
from coordexp.schema.tuner import TunerConfig
from testkit import REPO

runner = CliRunner()

NESTED_1000 = "(" * 1000 + "q_proj" + ")" * 1000
CATASTROPHIC = {
    "(.+)+Q": r"(.+)+Q",
    "([a-z_.0-9]+)+X": r"([a-z_.0-9]+)+X",
    "(\\w*\\.?)*Z": r"(\w*\.?)*Z",
    "30 x .* then Q": ".*" * 30 + "Q",  # no nested quantifier: only the time budget stops it
    "2047 x .* then Q": ".*" * 2047 + "Q",  # 4,095 characters, under the cap
}
UNSUPPORTED = {
    ".*": ("model (Qwen2VLModel)",),
    ".*layernorm": ("input_layernorm",),
    ".*self_attn": ("self_attn (Qwen2VLAttention)",),
    r"model\.language_model\.layers\.\d+": ("Qwen2VLDecoderLayer",),
    r".*\.mlp\..*": ("mlp.act (QuickGELUActivation)", "mlp.act_fn"),
    r"model\.visual\.merger\.mlp\.\d": ("model.visual.merger.mlp.1 (GELU)",),
}
GOOD = [r".*\.q_proj", r".*\.(q_proj|k_proj|v_proj|o_proj)", r"model\.language_model\.layers\.\d+\.mlp\.\w+_proj",
        r"^(model\.visual\.merger\.(linear_fc1|linear_fc2)|model\.language_model\.layers\.(1)\.(self_attn\."
        r"(q_proj|k_proj|v_proj|o_proj)|mlp\.(gate_proj|up_proj|down_proj)))$",
        r"(?:model\.language_model\.layers\.(?:0|1)\.self_attn\.[qkvo]_proj)"]


def _lora(stage2_config: dict, regex: str) -> dict:
    stage2_config["tuner"] = {"train_type": "lora", "target_regex": regex}
    return stage2_config


def _regex_issue(stage2_config: dict, regex: str):
    report = validate_mapping(_lora(stage2_config, regex))
    assert not report.ok
    (issue,) = [i for i in report.errors if i.path == "tuner.target_regex"]
    return issue


# ------------------------------------------------------------------------------------------------ validate

def test_a_thousand_nested_groups_are_a_config_issue_not_a_recursion_error(stage2_config, write_yaml):
    issue = _regex_issue(stage2_config, NESTED_1000)
    assert f"at most {MAX_GROUP_DEPTH}" in issue.message and "1000 deep" in issue.message
    result = runner.invoke(app, ["validate", str(write_yaml(stage2_config))], catch_exceptions=False)
    assert result.exit_code == 2 and "RecursionError" not in result.output and "internal" not in result.output


@pytest.mark.parametrize("name", list(CATASTROPHIC))
def test_catastrophic_patterns_are_refused_at_validate(stage2_config, write_yaml, name):
    issue = _regex_issue(stage2_config, CATASTROPHIC[name])
    assert "exponential" in issue.message or "took more than" in issue.message, issue.message
    for command in ("validate", "train"):  # train validates first: it never reaches the model
        result = runner.invoke(app, [command, str(write_yaml(stage2_config))], catch_exceptions=False)
        assert result.exit_code == 2, result.output
        assert "tuner.target_regex" in result.output and "internal" not in result.output


@pytest.mark.parametrize("regex", list(UNSUPPORTED))
def test_a_pattern_matching_modules_lora_cannot_adapt_is_refused_naming_them(stage2_config, regex):
    issue = _regex_issue(stage2_config, regex)
    text = f"{issue.message} {issue.hint}"
    assert "cannot adapt" in text and r".*\.(q_proj|k_proj|v_proj|o_proj)" in text, text
    for name in UNSUPPORTED[regex]:
        assert name in text, text


@pytest.mark.parametrize("regex", GOOD)
def test_patterns_that_name_adaptable_layers_validate(stage2_config, regex):
    report = validate_mapping(_lora(stage2_config, regex))
    assert report.ok, report.errors


PIECES = st.sampled_from(["(", ")", "(?:", "[a-z_.]", ".", "*", "+", "?", "|", r"\.", r"\d", "q_proj", "layers",
                          "{2,}", "{1,3}", "^", "$", "a", "(?>", r"\w", "[", "]"])


@given(parts=st.lists(PIECES, max_size=24))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_pattern_validates_or_is_one_issue_at_its_path(stage2_config, parts):
    """Whatever the pattern, validation answers (no exception escapes), and a refusal is at tuner.target_regex."""
    report = validate_mapping(_lora(stage2_config, "".join(parts)))
    assert report.ok or [i.path for i in report.errors] == ["tuner.target_regex"], report.errors


@given(depth=st.integers(min_value=0, max_value=3000))
@settings(max_examples=40, deadline=None)
def test_group_depth_is_counted_without_recursion(depth):
    pattern = "(?:" * depth + "x" + ")" * depth
    assert group_depth(pattern) == depth
    assert group_depth(r"\(" * depth + "[(]" * depth) == 0  # escaped and bracketed parentheses are no groups
    if depth > MAX_GROUP_DEPTH:
        with pytest.raises(RegexCostError, match="nest"):
            compile_bounded(pattern)
    else:
        assert compile_bounded(pattern).fullmatch("x")


def test_the_module_table_matches_the_installed_transformers():
    spec = importlib.util.spec_from_file_location("gen_modules", REPO / "scripts" / "gen_qwen_vl_modules.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    committed = (REPO / "coordexp" / "schema" / "qwen_vl_modules.py").read_text(encoding="utf-8")
    assert module.render() == committed, "rerun .venv/bin/python scripts/gen_qwen_vl_modules.py"


# ------------------------------------------------------------------------------------- the start of training

@pytest.fixture(scope="module")
def qwen2(tiny_model_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(tiny_model_dir), dtype=torch.float32)


def _unchecked(regex: str) -> TunerConfig:
    """A lora tuner whose pattern skipped validation (an older run contract): the runtime guard must hold alone."""
    return TunerConfig.model_construct(**{**TunerConfig().model_dump(), "train_type": "lora", "target_regex": regex})


@pytest.mark.parametrize("regex, expected", [
    (".*", "model (Qwen2VLModel)"),
    (r".*\.(q_proj|input_layernorm)", "input_layernorm (Qwen2VLRMSNorm)"),
    (r".*rotary_emb", "Qwen2VLRotaryEmbedding"),
    (NESTED_1000, "1000 deep"),
    (r"(.+)+Q", "exponential"),
    (".*" * 30 + "Q", "took more than"),
], ids=["dot-star", "norm", "rotary", "nested", "catastrophic", "slow"])
def test_resolve_targets_refuses_before_peft_runs_the_pattern(qwen2, regex, expected):
    from coordexp.runtime.model.tuner import TunerError, apply_tuner, resolve_targets

    with pytest.raises(TunerError) as info:
        resolve_targets(qwen2, _unchecked(regex))
    assert expected in str(info.value) and info.value.hint
    with pytest.raises(TunerError):  # apply_tuner too: PEFT's own ValueError is never reached
        apply_tuner(qwen2, _unchecked(regex))


def test_resolve_targets_keeps_the_pattern_for_peft_when_every_match_is_adaptable(qwen2):
    from coordexp.runtime.model.tuner import resolve_targets

    assert resolve_targets(qwen2, _unchecked(r".*\.(q_proj|v_proj)")) == r".*\.(q_proj|v_proj)"


def test_the_budget_holds_off_the_main_thread_too():
    """Signals reach only the main thread: elsewhere the match runs in a child process with a timeout."""
    outcome: dict = {}

    def match() -> None:
        try:
            outcome["names"] = fullmatching(re.compile(".*" * 30 + "Q"), ["model.language_model.layers.0.mlp"],
                                            budget_s=0.5)
        except RegexCostError as exc:
            outcome["error"] = exc

    worker = threading.Thread(target=match)
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive() and "took more than" in str(outcome.get("error")), outcome
    assert fullmatching(re.compile(r".*mlp"), ["a.mlp", "b.attn"]) == ["a.mlp"]
