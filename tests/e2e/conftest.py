"""Fixtures of the end-to-end trainer tests: a synthetic dataset and a config writer (the tiny model is shared)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from coordexp.schema.loader import deep_merge

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def dataset(tmp_path_factory):
    from coordexp.runtime.toy.synthetic import write_synthetic_dataset

    return write_synthetic_dataset(tmp_path_factory.mktemp("e2e_data"), n_train=16, n_val=4, seed=3)


@pytest.fixture()
def write_config(tmp_path, tiny_model_dir, dataset):
    """Write a stage config extending examples/stage2_cpu_hf.yaml with the tiny model, the dataset and overrides."""

    def write(overrides: dict, name: str = "cfg.yaml") -> Path:
        config = {
            "extends": str(REPO / "examples" / "stage2_cpu_hf.yaml"),
            "model": {"path": str(tiny_model_dir), "dtype": "float32", "attn_implementation": "sdpa"},
            "data": {"train_jsonl": str(dataset.train_jsonl), "val_jsonl": None},
        }
        config = deep_merge(config, overrides)
        path = tmp_path / name
        path.write_text(yaml.safe_dump(config), encoding="utf-8")
        return path

    return write
