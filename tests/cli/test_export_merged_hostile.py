"""``coordexp export-merged`` on hostile input (issue 30 item 1): every adapter and OUT_DIR problem is exit 2 naming
the file and what is wrong, found before the merge (no weights loaded where it can be), nothing written, no network
access whatever the environment says; a merged model with a non-finite tensor is never written; ``--base`` other
than the recorded base is used and said."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
from pathlib import Path
from typing import Callable

import pytest
import torch
from typer.testing import CliRunner

from coordexp.cli.app import app

pytest.importorskip("peft", reason="needs peft (pip install peft)")
runner = CliRunner()
WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, tiny_model_dir) -> Path:
    """A saved LoRA adapter (q_proj, v_proj; random non-zero weights) on the tiny model, with its processor."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from coordexp.runtime.model.encoding import load_processor

    folder = tmp_path_factory.mktemp("adapter") / "adapter"
    model = AutoModelForImageTextToText.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in peft.named_parameters():
            if ".lora_" in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)
    peft.save_pretrained(str(folder))
    load_processor(tiny_model_dir).save_pretrained(str(folder))
    return folder


@pytest.fixture
def copy_of(adapter, tmp_path) -> Callable[[], Path]:
    def make() -> Path:
        target = tmp_path / "case_adapter"
        shutil.copytree(adapter, target)
        return target
    return make


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _export(*args) -> tuple[int, str]:
    result = runner.invoke(app, ["export-merged", *[str(a) for a in args]])
    return result.exit_code, " ".join(result.output.split())


def _refused(adapter_dir: Path, out: Path, *expected: str, extra=()) -> str:
    before = _snapshot(adapter_dir)
    code, text = _export(adapter_dir, out, *extra)
    assert code == 2, text
    assert "internal error" not in text and "Traceback" not in text, text
    for part in expected:
        assert part in text, text
    assert not os.path.lexists(out) or (out.is_dir() and not any(out.iterdir())), "something was written"
    assert _snapshot(adapter_dir) == before, "the adapter changed"
    return text


def _set_config(folder: Path, raw_value: str, key: str) -> None:
    """Write ``key`` into adapter_config.json as the raw JSON text ``raw_value`` (NaN, 401 digits, ...)."""
    config = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
    config[key] = "__PLACEHOLDER__"
    text = json.dumps(config).replace('"__PLACEHOLDER__"', raw_value)
    (folder / "adapter_config.json").write_text(text, encoding="utf-8")


# --------------------------------------------------------------------------------------------- adapter config

@pytest.mark.parametrize("key, raw, expected", [
    ("r", "1" + "0" * 400, '"r"'),
    ("r", '"x"', '"r"'),
    ("r", "-1", '"r"'),
    ("r", "0", '"r"'),
    ("r", "true", '"r"'),
    ("target_modules", "5", '"target_modules"'),
    ("target_modules", '"(.+)+Q"', '"target_modules"'),
    ("target_modules", '"' + ".*" * 30 + 'Q"', "took more than"),
    ("lora_alpha", "NaN", '"lora_alpha"'),
    ("lora_alpha", "Infinity", '"lora_alpha"'),
    ("lora_alpha", "-8", '"lora_alpha"'),
    ("lora_dropout", "2.5", '"lora_dropout"'),
    ("modules_to_save", '{"a": 1}', '"modules_to_save"'),
    ("rank_pattern", '{"q_proj": 0}', '"rank_pattern"'),
    ("use_dora", '"yes"', '"use_dora"'),
    ("peft_type", '"IA3"', "not a PEFT LoRA adapter config"),
], ids=lambda v: v if len(str(v)) < 16 else f"{len(str(v))}-chars")
def test_a_broken_adapter_config_is_exit_2_naming_the_file_and_key(copy_of, tmp_path, key, raw, expected):
    folder = copy_of()
    _set_config(folder, raw, key)
    _refused(folder, tmp_path / "merged", "adapter_config.json", expected)


@pytest.mark.parametrize("raw", ["[99999999]", '{"embed_tokens": [5, 99999999]}'])
def test_trainable_token_indices_past_the_vocabulary_are_exit_2(copy_of, tmp_path, raw):
    folder = copy_of()
    _set_config(folder, raw, "trainable_token_indices")
    _refused(folder, tmp_path / "merged", "adapter_config.json", '"trainable_token_indices" names row 99999999')


@pytest.mark.parametrize("raw", ["[-1]", '["5"]', "[1.5]", '{"embed_tokens": "x"}', "5"])
def test_trainable_token_indices_that_are_no_row_ids_are_exit_2(copy_of, tmp_path, raw):
    folder = copy_of()
    _set_config(folder, raw, "trainable_token_indices")
    _refused(folder, tmp_path / "merged", "adapter_config.json", '"trainable_token_indices"')


def test_an_adapter_config_nested_100000_deep_is_exit_2(copy_of, tmp_path):
    folder = copy_of()
    (folder / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
    _refused(folder, tmp_path / "merged", "adapter_config.json", "nested too deeply")


# -------------------------------------------------------------------------------------------- adapter weights

def _rewrite_weights(folder: Path, change: Callable[[dict], None]) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(str(folder / WEIGHTS))
    change(weights)
    save_file(weights, str(folder / WEIGHTS))


def _first(weights: dict, part: str) -> str:
    return next(name for name in sorted(weights) if part in name)


def _wrong_shape(weights: dict) -> None:
    name = _first(weights, "lora_A")
    weights[name] = torch.zeros(weights[name].shape[0], weights[name].shape[1] + 3)


def _nan(weights: dict) -> None:
    name = _first(weights, "lora_B")
    weights[name][0, 0] = float("nan")


def _missing_tensor(weights: dict) -> None:
    del weights[_first(weights, "lora_B")]


def _foreign_tensor(weights: dict) -> None:
    weights["base_model.model.model.language_model.layers.0.mlp.nope.lora_A.weight"] = torch.zeros(4, 4)


@pytest.mark.parametrize("damage, expected", [
    (lambda f: (f / WEIGHTS).unlink(), "no adapter weights"),
    (lambda f: os.truncate(f / WEIGHTS, 500), "truncated"),
    (lambda f: (f / WEIGHTS).write_bytes(os.urandom(4000)), "corrupt"),
    (lambda f: _rewrite_weights(f, _wrong_shape), "do not fit the base model"),
    (lambda f: _rewrite_weights(f, _nan), "non-finite"),
    (lambda f: _rewrite_weights(f, _missing_tensor), "missing"),
    (lambda f: _rewrite_weights(f, _foreign_tensor), "no place in the base"),
], ids=["missing", "truncated", "garbage", "wrong-shape", "nan", "missing-tensor", "foreign-tensor"])
def test_broken_adapter_weights_are_exit_2_naming_the_file(copy_of, tmp_path, damage, expected):
    folder = copy_of()
    damage(folder)
    _refused(folder, tmp_path / "merged", str(folder), expected)


@pytest.mark.parametrize("content", ["garbage{", "{}", '{"version": "1.0", "model": 5}'])
def test_a_broken_tokenizer_json_is_exit_2_naming_it(copy_of, tmp_path, content):
    folder = copy_of()
    (folder / "tokenizer.json").write_text(content, encoding="utf-8")
    _refused(folder, tmp_path / "merged", str(folder), "tokenizer")


# ----------------------------------------------------------------------------------------------------- OUT_DIR

def _dangling(tmp: Path) -> Path:
    (tmp / "out").symlink_to(tmp / "nowhere")
    return tmp / "out"


def _loop(tmp: Path) -> Path:
    (tmp / "loop_a").symlink_to(tmp / "loop_b")
    (tmp / "loop_b").symlink_to(tmp / "loop_a")
    return tmp / "loop_a"


def _under_file(tmp: Path) -> Path:
    (tmp / "a_file").write_text("mine", encoding="utf-8")
    return tmp / "a_file" / "merged"


def _busy(tmp: Path) -> Path:
    (tmp / "busy").mkdir()
    (tmp / "busy" / "keep.txt").write_text("mine", encoding="utf-8")
    return tmp / "busy"


@pytest.mark.parametrize("make, expected", [
    (_dangling, "dangling symlink"),
    (_loop, "symlink loop"),
    (_under_file, "which is a file"),
    (lambda tmp: tmp / ("x" * 300), "too long"),
    (lambda tmp: Path("/proc/self/coordexp-merged"), "nothing can be created"),
    (_busy, "not an empty directory"),
], ids=["dangling", "loop", "under-a-file", "300-byte-name", "proc-self", "not-empty"])
def test_an_unusable_out_dir_is_refused_before_any_weight_loads(adapter, tmp_path, monkeypatch, make, expected):
    from transformers import AutoModelForImageTextToText

    def no_loading(*args, **kwargs):
        raise AssertionError("weights loaded although OUT_DIR is unusable")

    monkeypatch.setattr(AutoModelForImageTextToText, "from_pretrained", no_loading)
    out = make(tmp_path)
    before = sorted(os.listdir(tmp_path))
    code, text = _export(adapter, out)
    assert code == 2 and expected in text and "internal error" not in text, text
    assert sorted(os.listdir(tmp_path)) == before
    if os.path.islink(out):
        assert not os.path.exists(tmp_path / "nowhere")  # a dangling link's target was not created


def test_a_base_that_cannot_be_read_is_said_so_not_reported_missing(adapter, tmp_path, tiny_model_dir, monkeypatch):
    real_stat = os.stat
    base_config = str(Path(tiny_model_dir) / "config.json")

    def stat(path, *args, **kwargs):  # what a base folder without read permission gives (root ignores modes)
        if os.fspath(path) == base_config:
            raise PermissionError(errno.EACCES, "Permission denied", base_config)
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    code, text = _export(adapter, tmp_path / "merged")
    assert code == 2 and "Permission denied" in text and str(tiny_model_dir) in text, text
    assert "not a local checkpoint" not in text
    assert not (tmp_path / "merged").exists()


@pytest.fixture
def no_network(monkeypatch):
    """Any name lookup or connection fails the test (and is recorded), whatever HF_HUB_OFFLINE says."""
    attempts: list = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError(errno.ENETUNREACH, "network access during a test")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    return attempts


@pytest.mark.parametrize("case", ["weights missing", "recorded base a hub id", "--base a hub id"])
def test_no_network_access_whatever_is_missing(copy_of, tmp_path, no_network, case):
    folder = copy_of()
    extra: tuple = ()
    if case == "weights missing":
        (folder / WEIGHTS).unlink()
    elif case == "recorded base a hub id":
        _set_config(folder, '"Qwen/Qwen2-VL-2B-Instruct"', "base_model_name_or_path")
    else:
        extra = ("--base", "Qwen/Qwen2-VL-2B-Instruct")
    _refused(folder, tmp_path / "merged", extra=extra)
    assert no_network == []


# ---------------------------------------------------------------------------------------- merge and --base

def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    merged: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        merged.update(load_file(str(file)))
    return merged


def test_a_merge_with_non_finite_values_is_never_written(copy_of, tmp_path):
    """Finite adapter weights whose product overflows float32: the merged tensor is named and nothing written."""
    folder = copy_of()

    def huge(weights: dict) -> None:
        for name in weights:
            weights[name] = torch.full_like(weights[name], 1e30)

    _rewrite_weights(folder, huge)
    text = _refused(folder, tmp_path / "merged", "non-finite", "was not written")
    assert "q_proj.weight" in text or "v_proj.weight" in text, text


def test_the_merge_writes_a_finite_checkpoint_into_an_empty_dir_through_a_symlink(adapter, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    before = _snapshot(adapter)
    code, text = _export(adapter, tmp_path / "link")
    assert code == 0, text
    assert (tmp_path / "link").is_symlink() and (tmp_path / "empty" / "config.json").is_file()
    tensors = _tensors(tmp_path / "empty")
    assert tensors and all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point())
    assert (tmp_path / "empty" / "tokenizer.json").is_file() and _snapshot(adapter) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no scratch folder left


def test_a_base_other_than_the_recorded_one_is_used_and_said(adapter, tmp_path, tiny_model_dir):
    other = tmp_path / "other_base"
    shutil.copytree(tiny_model_dir, other)
    code, text = _export(adapter, tmp_path / "merged", "--base", other)
    assert code == 0, text
    assert f"using --base {other}" in text and str(tiny_model_dir) in text, text
    same = _tensors(tmp_path / "merged")
    code, text = _export(adapter, tmp_path / "merged_recorded")
    assert code == 0 and "using --base" not in text, text
    recorded = _tensors(tmp_path / "merged_recorded")
    assert set(same) == set(recorded) and all(torch.equal(same[k], recorded[k]) for k in same)


def test_a_base_the_adapter_does_not_fit_is_refused(adapter, tmp_path):
    """A base of another width: said that it is not the recorded one, then refused (the shapes do not fit)."""
    from coordexp.runtime.toy.tiny_model import build_tiny_model

    wider = build_tiny_model(tmp_path / "wider_base", hidden_size=192)
    text = _refused(adapter, tmp_path / "merged", extra=("--base", wider))
    assert f"using --base {wider}" in text and "does not belong to this base" in text, text


def test_a_missing_base_is_refused_naming_it(adapter, tmp_path):
    text = _refused(adapter, tmp_path / "merged", extra=("--base", tmp_path / "no_such_base"))
    assert "no_such_base" in text and "never downloads" in text, text


def test_eval_checkpoint_with_trainable_token_indices_past_the_vocabulary_is_exit_2(copy_of, tmp_path, tiny_model_dir):
    import yaml

    from coordexp.runtime.toy.synthetic import write_synthetic_dataset
    from testkit import REPO

    folder = copy_of()
    _set_config(folder, "[99999999]", "trainable_token_indices")
    data = write_synthetic_dataset(tmp_path / "data", n_train=2, n_val=2, seed=0)
    config = tmp_path / "eval.yaml"
    config.write_text(yaml.safe_dump({
        "extends": str(REPO / "examples" / "stage2_cpu_hf.yaml"), "model": {"path": str(tiny_model_dir)},
        "data": {"train_jsonl": str(data.train_jsonl), "val_jsonl": str(data.val_jsonl)},
        "training": {"output_dir": str(tmp_path / "run")}}), encoding="utf-8")
    result = runner.invoke(app, ["eval", str(config), "--checkpoint", str(folder), "--out", str(tmp_path / "out")])
    text = " ".join(result.output.split())
    assert result.exit_code == 2, text
    assert '"trainable_token_indices" names row 99999999' in text and "internal error" not in text
