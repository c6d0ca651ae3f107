"""Shared fixtures of the runtime tests: the tiny tokenizer (built once per session), its coord vocab and pieces."""

from __future__ import annotations

import pytest

from coordexp.runtime.pieces import PieceTable
from coordexp.runtime.tiny import build_tiny_tokenizer
from coordexp.runtime.tokens import CoordVocab


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
    from coordexp.runtime.encoding import load_processor

    return load_processor(tiny_model_dir)


@pytest.fixture(scope="session")
def synthetic_dataset(tmp_path_factory):
    """A small deterministic synthetic shapes dataset (12 train / 4 val images of 112 x 112)."""
    from coordexp.runtime.synthetic import write_synthetic_dataset

    return write_synthetic_dataset(tmp_path_factory.mktemp("synthetic"), n_train=12, n_val=4, seed=0)
