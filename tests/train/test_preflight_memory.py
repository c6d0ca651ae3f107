"""Preflight's memory check (issue 44): on a machine without CUDA, the model's parameters in ``model.dtype`` plus the
trained parts' gradients and AdamW states against the available RAM; more than available is a warning (it may still
run), nothing where it cannot be computed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from coordexp.runtime.train import preflight_machine
from coordexp.runtime.train.preflight import run_preflight

GIB = 2**30


def _run(dtype="float32", train_type="full", freeze_vit=True):
    return SimpleNamespace(model=SimpleNamespace(dtype=dtype), tuner=SimpleNamespace(
        train_type=train_type, freeze_llm=False, freeze_vit=freeze_vit, freeze_aligner=True))


@pytest.fixture()
def cpu_with(monkeypatch):
    def set_available(gib: float | None):
        monkeypatch.setattr(preflight_machine, "nvidia_driver_loaded", lambda: False)
        monkeypatch.setattr(preflight_machine, "available_memory", lambda: None if gib is None else int(gib * GIB))
    return set_available


SIZES = {"llm": 1_000_000_000, "vision": 500_000_000, "aligner": 50_000_000}  # a 1.5B-parameter model


def test_a_full_fine_tune_over_the_available_ram_warns_with_the_numbers(cpu_with):
    cpu_with(16)
    (check,) = preflight_machine.memory_checks(_run(), SIZES)
    assert check.ok and check.warning and check.name == "memory"
    # weights 1.55e9 * 4 B = 5.8 GiB, the LLM trains: 1e9 * 4 B * 3 = 11.2 GiB
    assert "needs about 17.0 GiB" in check.detail and "weights 5.8 GiB in float32" in check.detail
    assert "16.0 GiB of RAM is available" in check.detail


def test_what_fits_or_cannot_be_computed_says_nothing(cpu_with, monkeypatch):
    cpu_with(16)
    assert preflight_machine.memory_checks(_run(train_type="lora"), SIZES) == []  # 5.8 GiB of weights fit
    assert preflight_machine.memory_checks(_run(dtype="bfloat16"), SIZES) == []  # 2.9 + 5.6 GiB
    assert preflight_machine.memory_checks(_run(), None) == []  # no safetensors to count
    cpu_with(None)
    assert preflight_machine.memory_checks(_run(), SIZES) == []  # no MemAvailable
    cpu_with(1)
    monkeypatch.setattr(preflight_machine, "nvidia_driver_loaded", lambda: True)
    assert preflight_machine.memory_checks(_run(), SIZES) == []  # a GPU holds the model, not RAM


def test_the_driver_check_imports_no_torch_and_honours_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert preflight_machine.nvidia_driver_loaded() is False
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    import os

    assert preflight_machine.nvidia_driver_loaded() == os.path.exists("/proc/driver/nvidia/version")


def test_available_memory_reads_proc_meminfo():
    available = preflight_machine.available_memory()
    assert available is None or available > 0


def test_preflight_of_the_tiny_model_warns_when_ram_is_short(write_config, cpu_with):
    cpu_with(1e-6)  # about 1 KiB available: the tiny model does not fit
    report = run_preflight(write_config({"model": {"dtype": "float32"}}))
    (check,) = [c for c in report.checks if c.name == "memory"]
    assert check.warning and report.exit_code == 0, check.detail
    cpu_with(1024)
    assert not [c for c in run_preflight(write_config({})).checks if c.name == "memory"]
