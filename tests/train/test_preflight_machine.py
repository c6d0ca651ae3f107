"""Preflight checks the machine (``coordexp/runtime/train/preflight_machine.py``): the packages the config needs,
CUDA for bf16 / flash-attn / colocated vLLM, stage 2's starting model, and only the lines that apply to stage 1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from coordexp.errors import EXIT_EXTERNAL, EXIT_OK
from coordexp.runtime.train import preflight_machine
from coordexp.runtime.train.preflight import run_preflight

ROOT = Path(__file__).resolve().parents[2]
GPU_CONFIG = {"model": {"dtype": "bfloat16"},
              "rollout_matching": {"rollout_backend": "vllm", "vllm": {"mode": "colocate"}}}


@pytest.fixture()
def no_cuda(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def named(report, name):
    return [c for c in report.checks if c.name == name]


def test_a_gpu_config_on_a_machine_without_cuda_warns_naming_both_settings(write_config, no_cuda):
    """Regression (issue 44): `init --device gpu`'s config (bfloat16, vLLM colocated) passed preflight silently on
    a CPU box."""
    assert preflight_machine.cuda_device_count() == 0
    report = run_preflight(write_config(GPU_CONFIG))
    warnings = [c for c in report.checks if c.warning]
    details = " ".join(c.detail for c in warnings)
    assert "no CUDA device" in details and "bfloat16" in details and "vllm colocated" in details
    assert all(c.ok for c in warnings)


def test_vllm_not_installed_fails_with_exit_3_and_the_install_line(write_config, no_cuda, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    report = run_preflight(write_config(GPU_CONFIG))
    assert report.exit_code == EXIT_EXTERNAL
    failed = named(report, "package vllm")
    assert failed and not failed[0].ok and "pip install 'coordexp[vllm]'" in failed[0].detail


def test_flash_attention_without_cuda_fails_with_exit_3(write_config, no_cuda):
    report = run_preflight(write_config({"model": {"attn_implementation": "flash_attention_2"}}))
    assert report.exit_code == EXIT_EXTERNAL
    assert any(not c.ok and "flash_attention_2" in c.detail for c in named(report, "cuda"))


def test_with_cuda_the_same_config_passes_without_warning(write_config, monkeypatch):
    monkeypatch.setattr(preflight_machine, "cuda_device_count", lambda: 2)
    report = run_preflight(write_config(GPU_CONFIG))
    assert [c.detail for c in named(report, "cuda")] == ["2 CUDA device(s) for model.dtype: bfloat16, "
                                                         "rollout_matching.rollout_backend: vllm colocated"]
    assert not [c for c in named(report, "cuda") if c.warning]


def test_stage2_from_an_untrained_model_warns_and_a_coordexp_run_does_not(write_config, tiny_model_dir, tmp_path):
    report = run_preflight(write_config({}))
    start = named(report, "stage 2 start")[0]
    assert start.warning and "no coordexp training record" in start.detail and report.exit_code == EXIT_OK
    trained = tmp_path / "stage1"
    trained.mkdir()
    for item in tiny_model_dir.iterdir():
        (trained / item.name).symlink_to(item)
    (trained / "coordexp_config.yaml").write_text("{}\n", encoding="utf-8")
    start = named(run_preflight(write_config({"model": {"path": str(trained)}})), "stage 2 start")[0]
    assert not start.warning and "trained by coordexp" in start.detail


def test_stage1_shows_no_rollout_lines(write_config):
    report = run_preflight(write_config({"custom": {"trainer_variant": "stage1_sft"}}))
    names = [c.name for c in report.checks]
    assert "model" in names and "train data" in names, [c.detail for c in report.checks]
    assert "overlap" not in names and "servers" not in names and "stage 2 start" not in names, names


@pytest.mark.slow
def test_the_cli_prints_the_warning_on_a_cpu_machine(write_config):
    env = {"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "coordexp.cli.app", "preflight", str(write_config(GPU_CONFIG))],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert "! cuda: no CUDA device on this machine: model.dtype: bfloat16" in " ".join(done.stdout.split()), done.stdout
    as_json = subprocess.run([sys.executable, "-m", "coordexp.cli.app", "preflight", str(write_config(GPU_CONFIG)),
                              "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert any(c["warning"] for c in json.loads(as_json.stdout)["checks"])


def test_a_hub_id_names_the_download_command_that_exists(write_config):
    report = run_preflight(write_config({"model": {"path": "Qwen/Qwen2.5-VL-3B-Instruct"}}))
    model = named(report, "model")[0]
    assert not model.ok and "hf download Qwen/Qwen2.5-VL-3B-Instruct --local-dir Qwen2.5-VL-3B-Instruct" in model.detail
    assert "huggingface-cli" not in model.detail
