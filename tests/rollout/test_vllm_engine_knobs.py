"""The vLLM engine knobs of ``rollout_matching.vllm.*`` (issue 20 item 4): typed and bounded in the schema, carried by
the contract, passed to ``vllm.LLM`` under EngineArgs' own names (null: not passed), and sleep/infer_batch_size
acting in the colocate backend. No engine is started: a fake stands in for it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from coordexp.cli.app import app
from coordexp.runtime.rollout.base import RolloutOutput
from coordexp.runtime.rollout.vllm_colocate import VllmColocateBackend
from coordexp.runtime.rollout.vllm_engine import EngineSettings, VllmEngine
from coordexp.schema.contract import load_contract
from coordexp.schema.loader import load_merged, validate_mapping

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "stage2_colocate_4gpu.yaml"
KNOBS = {
    "max_num_batched_tokens": 16384,
    "enable_chunked_prefill": True,
    "disable_chunked_mm_input": True,
    "limit_mm_per_prompt": {"image": 2, "video": 0},
    "skip_mm_profiling": True,
    "mm_encoder_tp_mode": "weights",
    "sleep_level": 1,
    "infer_batch_size": 1,
}
PASSED = ("max_num_batched_tokens", "enable_chunked_prefill", "disable_chunked_mm_input", "limit_mm_per_prompt",
          "skip_mm_profiling", "mm_encoder_tp_mode")


def _config(tmp_path: Path, **vllm) -> Path:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"extends": str(EXAMPLE), "rollout_matching": {"vllm": vllm}}))
    return cfg


def _settings(tmp_path: Path, **vllm) -> EngineSettings:
    run = load_contract(_config(tmp_path, **vllm))
    return EngineSettings.from_contract(run.rollout_matching.serving.engine, model_path="/m", dtype="bfloat16", seed=0,
                                        repeat_terminate=run.rollout_matching.repeat_terminate)


def test_every_knob_reaches_the_engine_arguments_under_vllms_own_name(tmp_path):
    kwargs = _settings(tmp_path, **KNOBS).engine_kwargs("cuda")
    assert {k: kwargs[k] for k in PASSED} == {k: KNOBS[k] for k in PASSED}
    assert kwargs["enable_sleep_mode"] is True
    assert "sleep_level" not in kwargs and "infer_batch_size" not in kwargs  # coordexp's own, not EngineArgs


def test_null_knobs_are_not_passed_so_vllms_defaults_apply(tmp_path):
    kwargs = _settings(tmp_path).engine_kwargs("cuda")
    assert not (set(PASSED) - {"limit_mm_per_prompt"}) & set(kwargs)
    assert "enable_sleep_mode" not in kwargs
    assert kwargs["limit_mm_per_prompt"] == {"image": 1, "video": 0}  # derived when the key is null


def test_the_cpu_build_never_gets_sleep_mode(tmp_path):
    assert "enable_sleep_mode" not in _settings(tmp_path, sleep_level=2).engine_kwargs("cpu")


def test_the_knob_names_are_fields_of_vllms_engine_args():
    arg_utils = pytest.importorskip("vllm.engine.arg_utils")
    names = {f.name for f in dataclasses.fields(arg_utils.EngineArgs)}
    assert set(PASSED) | {"enable_sleep_mode"} <= names


def test_a_serve_rollout_engine_never_sleeps(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(VllmEngine, "start", classmethod(lambda cls, settings: started.append(settings)))
    VllmEngine.from_contract(load_contract(_config(tmp_path, **KNOBS)))
    assert started[0].sleep_level == 0 and started[0].max_num_batched_tokens == 16384


@pytest.mark.parametrize(("vllm", "where"), [
    ({"limit_mm_per_prompt": {"image": 1, "video": 1}}, "rollout_matching.vllm.limit_mm_per_prompt.video"),
    ({"limit_mm_per_prompt": {"image": 0}}, "rollout_matching.vllm.limit_mm_per_prompt.image"),
    ({"limit_mm_per_prompt": {"audio": 1}}, "rollout_matching.vllm.limit_mm_per_prompt.audio"),
    ({"mm_encoder_tp_mode": "pipeline"}, "rollout_matching.vllm.mm_encoder_tp_mode"),
    ({"sleep_level": 3}, "rollout_matching.vllm.sleep_level"),
    ({"max_num_batched_tokens": 0}, "rollout_matching.vllm.max_num_batched_tokens"),
    ({"infer_batch_size": 0}, "rollout_matching.vllm.infer_batch_size"),
    ({"sleep_level": 2, "enable_lora": True}, "rollout_matching.vllm.sleep_level"),
])
def test_out_of_range_knobs_fail_at_their_dotted_path(tmp_path, vllm, where):
    merged = load_merged(EXAMPLE).data
    merged["rollout_matching"]["vllm"].update(vllm)
    report = validate_mapping(merged, str(tmp_path / "x.yaml"))
    assert not report.ok
    assert where in [issue.path for issue in report.errors]


def test_coordexp_schema_lists_the_knobs():
    result = CliRunner().invoke(app, ["schema"])
    assert result.exit_code == 0
    document = json.loads(result.stdout)
    vllm = document["$defs"]["VllmConfig"]["properties"]
    assert set(KNOBS) <= set(vllm)
    assert all(vllm[k].get("description") for k in KNOBS)


class _FakeEngine:
    """Records generate-call sizes and sleep/wake cycles the way VllmEngine reports them."""

    def __init__(self, level: int):
        self.level, self.asleep, self.calls, self.events = level, False, [], []

    def generate(self, requests, decoding, max_new_tokens):
        assert not self.asleep, "generate on a sleeping engine"
        self.calls.append(len(requests))
        return [RolloutOutput([1], [2], "", False, False) for _ in requests]

    def sleep(self):
        self.asleep = bool(self.level)
        if self.asleep:
            self.events.append("sleep")
        return self.asleep

    def wake_up(self):
        was, self.asleep = self.asleep, False
        if was:
            self.events.append("wake")
        return was and self.level == 2

    def clear_adapter(self):
        pass

    def load_weights(self, named):
        self.events.append("push")
        list(named)


def _backend(tmp_path, level: int, infer: int | None, decode: int = 4):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({
        "extends": str(EXAMPLE),
        "rollout_matching": {"decode_batch_size": decode, "offload": {"enabled": False},
                             "vllm": {"sleep_level": level, "infer_batch_size": infer}},
    }))
    run = load_contract(cfg)
    engine = _FakeEngine(level)
    settings = EngineSettings.from_contract(run.rollout_matching.serving.engine, model_path="/m", dtype="float32",
                                            seed=0, repeat_terminate=run.rollout_matching.repeat_terminate)
    model = torch.nn.Linear(2, 2)
    backend = VllmColocateBackend(run.rollout_matching, model=model, tokenizer=None, settings=settings,
                                  engine=engine)
    return backend, engine


@pytest.mark.parametrize(("infer", "decode", "calls"), [(None, 4, [4, 1]), (2, 4, [2, 2, 1]), (8, 2, [2, 2, 1])])
def test_infer_batch_size_caps_the_prompts_per_generate_call(tmp_path, infer, decode, calls):
    backend, engine = _backend(tmp_path, 0, infer, decode)
    assert len(backend.generate(list(range(5)))) == 5
    assert engine.calls == calls


def test_level_one_sleeps_between_rounds_and_keeps_the_pushed_weights(tmp_path):
    backend, engine = _backend(tmp_path, 1, None)
    backend.generate([0])
    backend.generate([0])
    assert engine.events == ["push", "sleep", "wake", "sleep"]  # unchanged policy: no second push


def test_level_two_pushes_the_weights_again_after_waking(tmp_path):
    backend, engine = _backend(tmp_path, 2, None)
    backend.generate([0])
    backend.generate([0])
    assert engine.events == ["push", "sleep", "wake", "push", "sleep"]
