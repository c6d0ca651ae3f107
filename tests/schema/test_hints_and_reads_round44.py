"""Issue 44, items 6 and 7: key hints (``batch_size``, ``lr``), YAML syntax errors that name the right line with
its text and say "tab", the bounded reader on a terminal and on a name that changes after a check, DeepSpeed NVMe
offload to a folder DeepSpeed will create, and the shipped presets' content checked like a file's."""

from __future__ import annotations

import copy
import json
import os
import threading

import pytest

from coordexp.schema.file_read import FileReadError, read_capped_text
from coordexp.schema.loader import validate_mapping
from coordexp.schema.yaml_io import YamlReadError, parse_yaml_text
from testkit import STAGE2_CONFIG


def _errors(config: dict) -> dict[str, str]:
    return {issue.path: issue.render() for issue in validate_mapping(config).errors}


def _with(section: str | None, key: str, value=1, **training) -> dict:
    config = copy.deepcopy(STAGE2_CONFIG)
    config["training"].update(training)
    (config[section] if section else config)[key] = value
    return config


# -- key hints ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("section", "key", "wanted"), [
    ("training", "batch_size", ["'per_device_train_batch_size'", "'effective_batch_size'"]),
    ("training", "bs", ["'per_device_train_batch_size'"]),
    ("training", "lr", ["'learning_rate'"]),
    (None, "lr", ["'training.learning_rate'"]),
    ("model", "learning_rate", ["'training.learning_rate'"]),
    ("training", "epochs", ["'num_train_epochs'"]),
])
def test_common_short_and_misplaced_keys_get_the_schema_field(section, key, wanted):
    path = f"{section}.{key}" if section else key
    text = _errors(_with(section, key))[path]
    assert "unknown key" in text and all(name in text for name in wanted), text


def test_a_typo_still_gets_its_close_spelling():
    assert "Did you mean 'learning_rate'?" in _errors(_with("training", "learning_rte"))["training.learning_rte"]


# -- YAML syntax errors ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "line", "excerpt"), [
    ("a: 1\nfoo\nb: 2\n", 2, "'foo'"),  # a key without ':' (PyYAML: line 3)
    ("training:\n  lr: 1\n  x: [1, 2\nmodel: 3\n", 3, "'  x: [1, 2'"),  # an unclosed bracket (PyYAML: line 4)
    ("a: 'x\nb: 2\n", 1, "\"a: 'x\""),  # an unclosed quote (PyYAML: past the last line)
    ("a: [1, 2\n", 1, "'a: [1, 2'"),
    ("a:\n  b: 1\n c: 2\n", 3, "' c: 2'"),  # a bad indent: the line itself
])
def test_a_syntax_error_names_the_line_at_fault_and_shows_it(text, line, excerpt):
    with pytest.raises(YamlReadError) as caught:
        parse_yaml_text(text)
    message = caught.value.message
    assert message.startswith(f"invalid YAML: line {line}, ") and f"line {line}: {excerpt}" in message, message


@pytest.mark.parametrize(("text", "line"), [("a: 1\nb:\n\tc: 2\n", 3), ("key: value\n\tother: 1\n", 2)])
def test_a_tab_is_named(text, line):
    with pytest.raises(YamlReadError) as caught:
        parse_yaml_text(text)
    assert f"line {line}, column 1: a tab character" in caught.value.message, caught.value.message
    assert "\\t" in caught.value.message and "spaces" in caught.value.hint


# -- the bounded reader --------------------------------------------------------------------------------------------
def _read(path) -> str | FileReadError:
    try:
        return read_capped_text(path, max_bytes=1024, kind="YAML", suffix=".yaml")
    except FileReadError as exc:
        return exc


def _in_thread(call, unblock) -> object:
    outcome: list = []
    worker = threading.Thread(target=lambda: outcome.append(call()), daemon=True)
    worker.start()
    worker.join(20)
    if worker.is_alive():  # the old code blocked: unblock it so the suite goes on, then fail
        unblock()
        worker.join(5)
        pytest.fail("the bounded reader waited")
    return outcome[0]


def test_a_terminal_is_refused_without_waiting_for_input():
    pty = pytest.importorskip("pty")
    leader, follower = pty.openpty()
    try:
        result = _in_thread(lambda: _read(os.ttyname(follower)), lambda: os.write(leader, b"a: 1\n"))
    finally:
        os.close(leader)
        os.close(follower)
    assert isinstance(result, FileReadError) and "terminal" in result.message


def test_the_file_is_judged_as_opened_not_checked_by_name_and_reopened(tmp_path, monkeypatch):
    """A regular file that becomes a FIFO right after any check by name (a race): the old code checked the name,
    then opened it again (and saw, or waited on, something else); one open of the name, judged by fstat, reads what
    it opened."""
    path = tmp_path / "cfg.yaml"
    path.write_text("a: 1\n", encoding="utf-8")
    real_stat = os.stat

    def stat_then_swap(target, *args, **kwargs):
        info = real_stat(target, *args, **kwargs)
        if os.fspath(target) == str(path) and not os.path.exists(str(path) + ".swapped"):
            os.rename(path, str(path) + ".swapped")
            os.mkfifo(path)
        return info

    monkeypatch.setattr(os, "stat", stat_then_swap)

    def unblock():
        with open(path, "w"):
            pass

    result = _in_thread(lambda: _read(path), unblock)
    assert result == "a: 1\n", result  # what was opened is read: a check by name would have seen the swap


# -- DeepSpeed ---------------------------------------------------------------------------------------------------
def _deepspeed(tmp_path, content: dict, **training) -> dict[str, str]:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(content), encoding="utf-8")
    return _errors(_with("training", "deepspeed", str(path), **training))


def test_nvme_offload_to_a_folder_deepspeed_will_create_is_accepted(tmp_path):
    nvme = {"device": "nvme", "nvme_path": str(tmp_path / "not" / "yet")}
    assert _deepspeed(tmp_path, {"zero_optimization": {"stage": 3, "offload_param": nvme}}) == {}
    (tmp_path / "a_file").write_text("x")
    nvme["nvme_path"] = str(tmp_path / "a_file" / "swap")
    text = _deepspeed(tmp_path, {"zero_optimization": {"stage": 3, "offload_param": nvme}})["training.deepspeed"]
    assert "a_file is not a folder" in text


@pytest.mark.parametrize("preset", ["zero2", "zero3"])
def test_a_preset_is_checked_like_the_same_json_as_a_file(tmp_path, preset):
    from coordexp.runtime.train.deepspeed import PRESET_DIR

    content = json.loads((PRESET_DIR / f"{preset}.json").read_text(encoding="utf-8"))
    as_file = _deepspeed(tmp_path, content, bf16=True)
    config = _with("training", "deepspeed", preset, bf16=True)
    config["model"]["dtype"] = "float32"
    as_file_float32 = _errors({**config, "training": {**config["training"], "deepspeed": str(tmp_path / "ds.json")}})
    as_preset = _errors(config)
    assert as_file == {}  # bfloat16 model: fine either way
    assert "cast the model to bfloat16, but model.dtype is float32" in as_file_float32["training.deepspeed"]
    text = as_preset["training.deepspeed"]
    assert f"preset {preset}: bf16.enabled makes DeepSpeed cast the model to bfloat16" in text
    assert "training.bf16: false" in text
