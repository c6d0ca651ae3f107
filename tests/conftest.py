"""Shared fixtures: a minimal valid stage-2 config as a dict, and a helper that writes YAML files."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable

import pytest
import yaml

STAGE2_CONFIG = {
    "global_max_length": 2048,
    "model": {"path": "Qwen/Qwen2.5-VL-3B-Instruct"},
    "data": {"train_jsonl": "data/train.jsonl"},
    "training": {"output_dir": "runs/test"},
    "custom": {"trainer_variant": "stage2_rollout_aligned"},
    "rollout_matching": {
        "pipeline": {
            "objective": [
                {
                    "name": "token_ce",
                    "enabled": True,
                    "weight": 1.0,
                    "channels": ["B"],
                    "config": {"rollout_fn_desc_weight": 0.0, "rollout_matched_prefix_struct_weight": 0.0},
                },
                {
                    "name": "coord_reg",
                    "enabled": True,
                    "weight": 1.0,
                    "channels": ["B"],
                    "config": {
                        "coord_ce_weight": 0.0,
                        "soft_ce_weight": 1.0,
                        "w1_weight": 1.0,
                        "coord_gate_weight": 1.0,
                        "text_gate_weight": 0.0,
                        "temperature": 1.0,
                        "target_sigma": 2.0,
                        "target_truncate": None,
                    },
                },
                {
                    "name": "bbox_geo",
                    "enabled": True,
                    "weight": 0.5,
                    "channels": ["A", "B"],
                    "config": {"smoothl1_weight": 1.0, "ciou_weight": 1.0},
                },
            ],
            "diagnostics": [{"name": "coord_diag", "enabled": True, "weight": 0.0, "channels": ["B"], "config": {}}],
        }
    },
}


@pytest.fixture
def stage2_config() -> dict:
    """A fresh deep copy of a minimal valid stage-2 config (mutate freely)."""
    return copy.deepcopy(STAGE2_CONFIG)


@pytest.fixture
def write_yaml(tmp_path: Path) -> Callable[..., Path]:
    """``write_yaml(data_or_text, name="cfg.yaml")`` -> path of the written file under ``tmp_path``."""

    def _write(content, name: str = "cfg.yaml") -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        text = content if isinstance(content, str) else yaml.safe_dump(content, sort_keys=False)
        path.write_text(text, encoding="utf-8")
        return path

    return _write


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The tiny Qwen2-VL checkpoint (model, tokenizer with coord tokens, image processor), built once per session
    and shared by every test folder; tests never write into it."""
    from coordexp.runtime.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2_vl"), family="qwen2_vl", seed=0)
