"""Issue 36 items 4, 5 and 7: the ZeRO-3 scoring copy lives for one evaluation only; an adapter loaded from a path to
train on is set up like a new one (adapter dtype, DoRA norm cache, the dropout advice from its own config). Item 7
is in tests/model/test_token_type_figures.py."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from coordexp.runtime.train.launch import build_trainer
from coordexp.schema.contract import load_contract

STAGE1 = {"custom": {"trainer_variant": "stage1_sft"}, "global_max_length": 1024,
          "rollout_matching": {"max_new_tokens": 8, "decode_batch_size": 2}}


def test_the_zero3_scoring_copy_is_released_after_each_evaluation(write_config, dataset, monkeypatch):
    import coordexp.runtime.train.trainer as trainer_module

    config = write_config({**STAGE1, "data": {"val_jsonl": str(dataset.val_jsonl), "max_val_samples": 2},
                           "training": {"per_device_train_batch_size": 2, "packing": False}})
    trainer = build_trainer(load_contract(config))
    # ZeRO-3 as the trainer sees it (the gather itself is DeepSpeed's, run in tests/e2e/test_deepspeed_torchrun.py)
    monkeypatch.setattr(trainer_module, "zero3_partitioned", lambda model: True)
    monkeypatch.setattr(trainer_module, "full_parameters", contextlib.nullcontext)
    try:
        metrics = trainer.evaluate()
        assert "eval/AP50" in metrics
        assert trainer._scoring_copy.copies == 1  # evaluation scored on the whole copy ...
        assert trainer._scoring_copy.twin is None  # ... and let it go afterwards
    finally:
        trainer.backend.close()


@pytest.mark.parametrize("adapter_dtype, expected", [("float32", torch.float32), ("model", torch.bfloat16)])
def test_an_adapter_loaded_to_train_on_is_set_up_like_a_new_one(tiny_model_dir, tmp_path, write_config, caplog,
                                                               adapter_dtype, expected):
    pytest.importorskip("peft", reason="needs peft (pip install peft)")
    from transformers import AutoModelForImageTextToText

    from coordexp.runtime.model.policy import load_policy
    from coordexp.runtime.model.tuner import apply_tuner
    from coordexp.schema.tuner import TunerConfig

    saved = tmp_path / "adapter"
    base = AutoModelForImageTextToText.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    apply_tuner(base, TunerConfig(train_type="lora", use_dora=True, lora_rank=4, lora_alpha=8, lora_dropout=0.1,
                                  train_coord_rows=False)).save_pretrained(str(saved))
    config = write_config({"model": {"path": str(saved), "dtype": "bfloat16"},
                           "tuner": {"train_type": "lora", "use_dora": True, "lora_rank": 4, "lora_alpha": 8,
                                     "adapter_dtype": adapter_dtype, "train_coord_rows": False}})
    caplog.clear()  # the adapter's own creation above warned once already
    with caplog.at_level(logging.WARNING, logger="coordexp.tuner"):
        policy, _ = load_policy(load_contract(config))
    dora_layers = [m for m in policy.modules() if type(m).__name__ == "DoraLinearLayer"]
    assert dora_layers and all("_coordexp_norm_cache" in vars(m) for m in dora_layers)
    assert {p.dtype for n, p in policy.named_parameters() if ".lora_" in n} == {expected}
    assert any(p.requires_grad for n, p in policy.named_parameters() if ".lora_" in n)
    warned = [r.getMessage() for r in caplog.records if "lora_dropout" in r.getMessage()]
    assert len(warned) == 1 and "0.1" in warned[0]  # the saved adapter's own dropout
