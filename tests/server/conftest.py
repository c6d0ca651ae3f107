"""Fixtures of the rollout-server tests: a synthetic dataset, a config writer, and records (the tiny model is shared)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def dataset(tmp_path_factory):
    from coordexp.runtime.toy.synthetic import write_synthetic_dataset

    return write_synthetic_dataset(tmp_path_factory.mktemp("server_data"), n_train=4, n_val=0, seed=5)


@pytest.fixture(scope="session")
def server_config(tmp_path_factory, tiny_model_dir, dataset) -> Path:
    """A stage-2 config (HF rollouts, repeat guard on) for the tiny model and the synthetic data."""
    config = {
        "extends": str(REPO / "examples" / "stage2_cpu_hf.yaml"),
        "model": {"path": str(tiny_model_dir), "dtype": "float32", "attn_implementation": "sdpa"},
        "data": {"train_jsonl": str(dataset.train_jsonl), "val_jsonl": None},
        "training": {"output_dir": str(tmp_path_factory.mktemp("server_run"))},
    }
    path = tmp_path_factory.mktemp("server_cfg") / "cfg.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def run_contract(server_config):
    from coordexp.schema.contract import load_contract

    return load_contract(server_config)


@pytest.fixture(scope="session")
def records(dataset):
    from coordexp.runtime.model.data import load_records

    return load_records(dataset.train_jsonl, dataset.root)


@pytest.fixture(scope="session")
def processor(tiny_model_dir):
    from coordexp.runtime.model.encoding import load_processor

    return load_processor(tiny_model_dir)
