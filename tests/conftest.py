"""Shared fixtures: a minimal valid stage-2 config as a dict, a YAML writer, the tiny model, tokenizer and
processor (built once per session), a synthetic dataset with a stage-2 config writer (folders with their own
``dataset``/``write_config`` override these), and stub rollout servers."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Callable

import pytest
import yaml

from coordexp.runtime.core.pieces import PieceTable
from coordexp.runtime.core.tokens import CoordVocab
from coordexp.runtime.toy.tiny import build_tiny_tokenizer
from coordexp.schema.loader import deep_merge
from testkit import REPO, STAGE2_CONFIG, StubServer


@pytest.fixture(autouse=True)
def _deepspeed_state_stays_in_its_test():
    """A test that builds a DeepSpeed trainer in this process must not hand DeepSpeed to the tests after it (CI ran
    plain stage-2 tests, and the processes they start, under ZeRO-2 after tests/e2e/test_upstream_recipe.py)."""
    from coordexp.runtime.train.deepspeed import process_state_restored

    with process_state_restored():
        yield


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
    from coordexp.runtime.toy.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2_vl"), family="qwen2_vl", seed=0)


@pytest.fixture(scope="session")
def qwen3_model_dir(tmp_path_factory):
    """The tiny Qwen3-VL checkpoint (patch 16, DeepStack, interleaved M-RoPE), built once per session."""
    from coordexp.runtime.toy.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_vl"), family="qwen3_vl", seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    """A folder holding the saved tiny tokenizer (``AutoTokenizer.from_pretrained`` loads it)."""
    path = tmp_path_factory.mktemp("tiny_tokenizer")
    build_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))


@pytest.fixture(scope="session")
def coord_vocab(tiny_tokenizer):
    return CoordVocab.from_tokenizer(tiny_tokenizer)


@pytest.fixture(scope="session")
def piece_table(tiny_tokenizer):
    return PieceTable.for_tokenizer(tiny_tokenizer)


@pytest.fixture(scope="session")
def piece_id(tiny_tokenizer, piece_table):
    """``piece_id('"]},')`` -> the id of the single token whose text is exactly that (fails if there is none)."""
    by_text = {}
    for i, piece in enumerate(piece_table.pieces):
        by_text.setdefault(piece, i)

    def lookup(text: str) -> int:
        key = text.encode("utf-8")
        if key not in by_text:
            raise AssertionError(f"the tiny tokenizer has no single token {text!r}")
        return by_text[key]

    return lookup


@pytest.fixture(scope="session")
def tiny_processor(tiny_model_dir):
    from coordexp.runtime.model.encoding import load_processor

    return load_processor(tiny_model_dir)


@pytest.fixture(scope="session")
def synthetic_dataset(tmp_path_factory):
    """A small deterministic synthetic shapes dataset (12 train / 4 val images of 112 x 112)."""
    from coordexp.runtime.toy.synthetic import write_synthetic_dataset

    return write_synthetic_dataset(tmp_path_factory.mktemp("synthetic"), n_train=12, n_val=4, seed=0)


@pytest.fixture()
def stub():
    with StubServer() as server:
        yield server


@pytest.fixture()
def timer():
    start = time.monotonic()
    return lambda: time.monotonic() - start




@pytest.fixture(scope="session")
def dataset(tmp_path_factory):
    from coordexp.runtime.toy.synthetic import write_synthetic_dataset

    return write_synthetic_dataset(tmp_path_factory.mktemp("client_data"), n_train=8, n_val=2, seed=3)



@pytest.fixture()
def write_config(tmp_path, tiny_model_dir, dataset):
    """Write a config extending examples/stage2_cpu_hf.yaml with the tiny model, the dataset and overrides."""
    import yaml

    def write(overrides: dict, name: str = "cfg.yaml"):
        config = {
            "extends": str(REPO / "examples" / "stage2_cpu_hf.yaml"),
            "model": {"path": str(tiny_model_dir), "dtype": "float32", "attn_implementation": "sdpa"},
            "data": {"train_jsonl": str(dataset.train_jsonl), "val_jsonl": None},
            "training": {"output_dir": str(tmp_path / "run")},
        }
        config = deep_merge(config, overrides)
        path = tmp_path / name
        path.write_text(yaml.safe_dump(config), encoding="utf-8")
        return path

    return write
