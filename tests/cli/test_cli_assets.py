"""``coordexp make-tiny-model | expand-vocab | make-synthetic-data``: outputs, exit codes, clear refusals."""

from __future__ import annotations

import hashlib
import json

import pytest
from typer.testing import CliRunner

from coordexp.cli.app import app

runner = CliRunner()


def _run(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def cli_tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "tiny"
    result = _run("make-tiny-model", str(path), "--seed", "0")
    assert result.exit_code == 0, result.output
    assert "tiny qwen2_vl model written to" in result.output
    return path


def test_make_tiny_model_writes_a_loadable_checkpoint(cli_tiny_model):
    from transformers import AutoConfig

    from coordexp.runtime.model.encoding import load_processor
    from coordexp.runtime.core.tokens import CoordVocab

    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (cli_tiny_model / name).is_file(), name
    assert any((cli_tiny_model / n).is_file() for n in ("processor_config.json", "preprocessor_config.json"))
    assert AutoConfig.from_pretrained(str(cli_tiny_model)).model_type == "qwen2_vl"
    assert len(CoordVocab.from_tokenizer(load_processor(cli_tiny_model).tokenizer)) == 1000


def test_make_tiny_model_refuses_non_empty_dir_and_unknown_family(cli_tiny_model, tmp_path):
    result = _run("make-tiny-model", str(cli_tiny_model))
    assert result.exit_code == 2
    assert "already exists and is not an empty directory" in result.output
    result = _run("make-tiny-model", str(tmp_path / "x"), "--family", "llama")
    assert result.exit_code == 2
    assert "unknown --family 'llama'" in result.output and "qwen2_5_vl" in result.output
    assert "qwen3_vl" in result.output
    assert not (tmp_path / "x").exists()


def test_make_tiny_model_builds_qwen3_vl(tmp_path):
    """Regression (issue 19): `make-tiny-model --family qwen3_vl` exited 2 ("unknown --family")."""
    from transformers import AutoConfig

    result = _run("make-tiny-model", str(tmp_path / "q3"), "--family", "qwen3_vl")
    assert result.exit_code == 0, result.output
    assert "tiny qwen3_vl model written" in " ".join(result.output.split())
    config = AutoConfig.from_pretrained(str(tmp_path / "q3"))
    assert config.model_type == "qwen3_vl" and config.vision_config.patch_size == 16


def test_expand_vocab_on_a_checkpoint_that_has_the_tokens_copies_it(cli_tiny_model, tmp_path):
    from transformers import AutoModelForImageTextToText

    result = _run("expand-vocab", str(cli_tiny_model), str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    assert "already had all coord tokens" in result.output
    before = AutoModelForImageTextToText.from_pretrained(str(cli_tiny_model)).get_input_embeddings().weight
    after = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "out")).get_input_embeddings().weight
    assert before.shape == after.shape and bool((before == after).all())


def test_expand_vocab_refusals(cli_tiny_model, tmp_path):
    result = _run("expand-vocab", str(tmp_path), str(tmp_path / "out"))
    assert result.exit_code == 2 and "no config.json" in result.output
    result = _run("expand-vocab", str(cli_tiny_model), str(cli_tiny_model))
    assert result.exit_code == 2 and "same directory" in result.output
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    result = _run("expand-vocab", str(cli_tiny_model), str(tmp_path / "busy"))
    assert result.exit_code == 2 and "not an empty directory" in result.output


def test_make_synthetic_data_is_deterministic(tmp_path):
    outputs = []
    for name in ("a", "b"):
        result = _run("make-synthetic-data", str(tmp_path / name), "--n-train", "5", "--n-val", "2", "--seed", "9")
        assert result.exit_code == 0, result.output
        assert "5 train / 2 val images" in result.output
        outputs.append({p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                        for p in sorted((tmp_path / name).rglob("*")) if p.is_file()})
    assert outputs[0] == outputs[1] and len(outputs[0]) == 5 + 2 + 2
    first = json.loads((tmp_path / "a" / "train.jsonl").read_text().splitlines()[0])
    assert first["width"] == first["height"] == 112


def test_make_synthetic_data_rejects_bad_counts(tmp_path):
    result = _run("make-synthetic-data", str(tmp_path), "--n-train", "0")
    assert result.exit_code == 2
    assert "--n-train" in result.output
