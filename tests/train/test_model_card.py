"""The run's model card, ``OUTPUT_DIR/README.md`` (issue 55, item 6): written for full and LoRA runs at the end of
training, PEFT's empty template replaced, a README.md of the user's never replaced (nor left changed by PEFT's
save). No training here: the card is rendered from a run contract and a run summary."""

from __future__ import annotations

import copy

import pytest

from coordexp.runtime.train.model_card import (MODEL_CARD_MARK, card_owner, kept_user_card, restore_user_card,
                                               write_model_card)
from testkit import STAGE2_CONFIG

SUMMARY = {"steps": 40, "global_step": 40, "final_loss": 0.123456,
           "last_eval": {"step": 40, "AP50": 0.0031, "precision": 0.5, "recall": 0.25, "f1": 1 / 3,
                         "parse_valid_rate": 0.98, "match_rate": 0.4, "token_acc": 0.83}}
COMMAND = "coordexp train /abs/cfg.yaml --set training.max_steps=40"


def _run(write_yaml, tmp_path, **sections):
    from coordexp.cli.frame import load_run_and_config

    data = copy.deepcopy(STAGE2_CONFIG)
    data.update({"data": {"train_jsonl": str(tmp_path / "train.jsonl"), "val_jsonl": str(tmp_path / "val.jsonl")},
                 "model": {"path": str(tmp_path / "base")},
                 "training": {"output_dir": str(tmp_path / "run"), "max_steps": 40}}, **sections)
    return load_run_and_config(write_yaml(data))[0]


def _peft_template() -> str:
    """The card PEFT writes into a LoRA run folder (huggingface_hub's default template, library_name peft)."""
    from huggingface_hub import ModelCard, ModelCardData

    card = ModelCard.from_template(ModelCardData())
    card.data["library_name"] = "peft"
    return str(card)


def test_a_full_run_gets_a_card_with_its_facts(write_yaml, tmp_path):
    run = _run(write_yaml, tmp_path, custom={"trainer_variant": "stage1_sft"})
    path, written = write_model_card(tmp_path / "run", run, SUMMARY, command=COMMAND)
    text = path.read_text(encoding="utf-8")
    assert written and path == tmp_path / "run" / "README.md" and card_owner(tmp_path / "run") == "coordexp"
    assert text.startswith("---\n") and MODEL_CARD_MARK in text and "library_name: transformers" in text
    for fact in (str(tmp_path / "base"), str(tmp_path / "train.jsonl"), str(tmp_path / "val.jsonl"),
                 "40 (training.max_steps 40)", "stage 1 (`stage1_sft`)", "full fine-tune", "0.1235", COMMAND,
                 "## Last evaluation (step 40", "| 0.3% | 50.0% | 25.0% | 33.3% | 98.0% | 40.0% |"):
        assert fact in text, fact
    again, rewritten = write_model_card(tmp_path / "run", run, {**SUMMARY, "last_eval": None}, command=COMMAND)
    assert rewritten and "None ran during training" in again.read_text(encoding="utf-8")  # ours: rewritten


def test_a_lora_run_replaces_pefts_empty_template(write_yaml, tmp_path):
    run = _run(write_yaml, tmp_path, tuner={"train_type": "lora", "lora_rank": 4, "lora_alpha": 8})
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "README.md").write_text(_peft_template(), encoding="utf-8")
    assert card_owner(tmp_path / "run") == "peft"
    path, written = write_model_card(tmp_path / "run", run, SUMMARY, command=COMMAND)
    text = path.read_text(encoding="utf-8")
    assert written and "Model Card for Model ID" not in text and "More Information Needed" not in text
    assert "library_name: peft" in text and "LoRA adapter (r 4, alpha 8)" in text and "export-merged" in text
    assert "stage 2 (`stage2_rollout_aligned`)" in text and "token_ce" in text


@pytest.mark.parametrize("mine", ["# My run\n\nnotes I keep here\n", "library_name: peft\n# Model Card of mine\n"])
def test_the_users_readme_is_never_replaced(write_yaml, tmp_path, mine):
    run = _run(write_yaml, tmp_path)
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "README.md").write_text(mine, encoding="utf-8")
    assert card_owner(folder) == "user"
    path, written = write_model_card(folder, run, SUMMARY, command=COMMAND)
    assert not written and path.read_text(encoding="utf-8") == mine


def test_a_save_that_changed_the_users_readme_is_undone(tmp_path):
    """PEFT's save_pretrained rewrites any README.md it finds (``create_or_update_model_card``: huggingface_hub's
    ``ModelCard.load``, ``library_name: peft`` set, saved; done here the same way, without loading PEFT): the
    trainer keeps the user's bytes around each save (kept_user_card / restore_user_card)."""
    from huggingface_hub import ModelCard

    mine = b"# notes of mine\n"
    (tmp_path / "README.md").write_bytes(mine)
    kept = kept_user_card(tmp_path)
    card = ModelCard.load(tmp_path / "README.md")
    card.data["library_name"] = "peft"
    card.save(tmp_path / "README.md")
    assert (tmp_path / "README.md").read_bytes() != mine  # what PEFT's save does to it
    assert restore_user_card(tmp_path, kept) and (tmp_path / "README.md").read_bytes() == mine
    assert not restore_user_card(tmp_path, kept)  # unchanged: nothing written
    (tmp_path / "ours").mkdir()
    assert kept_user_card(tmp_path / "ours") is None and not restore_user_card(tmp_path / "ours", None)


def test_train_writes_the_card_with_its_command_line_or_says_it_kept_the_users(write_yaml, tmp_path, capsys):
    from pathlib import Path

    from coordexp.cli.train import _write_model_card

    run = _run(write_yaml, tmp_path)
    folder = tmp_path / "run"
    sets = ["training.max_steps=40", "rollout_matching.vllm.server.sync_token=s3cret-token"]
    path = _write_model_card(run, dict(SUMMARY), config=Path("cfg.yaml"), effective=sets)
    text = path.read_text(encoding="utf-8")
    assert f"coordexp train {Path('cfg.yaml').absolute()} --set training.max_steps=40\n" in text
    assert "s3cret" not in text  # a secret is left for the user to pass again
    path.write_text("# mine\n", encoding="utf-8")
    assert _write_model_card(run, dict(SUMMARY), config=Path("cfg.yaml"), effective=[]) is None
    assert (folder / "README.md").read_text(encoding="utf-8") == "# mine\n"
    said = " ".join(capsys.readouterr().err.split())
    assert "is not coordexp's: left as it is, no model card written" in said and "README.md" in said
