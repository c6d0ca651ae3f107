"""Resume loads every checkpoint tensor under the model's own names (regression: transformers 5 saves Qwen-VL
weights under legacy names and HF's resume loader matched none of them, so runs resumed from the base weights)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from coordexp.errors import EXIT_INVALID, exit_code_for
from coordexp.runtime.train.checkpoint_load import CheckpointMismatchError, load_checkpoint_weights, saved_name_map


def _model(path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32)


def test_a_saved_model_loads_back_bit_exact_under_its_own_names(tmp_path, tiny_model_dir):
    trained = _model(tiny_model_dir)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p))
    trained.save_pretrained(tmp_path / "ckpt")
    saved_names = set(load_file(tmp_path / "ckpt" / "model.safetensors"))
    assert saved_names == set(saved_name_map(trained))
    assert saved_names != set(trained.state_dict())  # the renaming this loader exists for
    fresh = _model(tiny_model_dir)
    assert load_checkpoint_weights(fresh, tmp_path / "ckpt")
    for (name, a), (_, b) in zip(trained.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_checkpoint_that_does_not_cover_the_model_is_refused(tmp_path, tiny_model_dir):
    model = _model(tiny_model_dir)
    model.save_pretrained(tmp_path / "ckpt")
    tensors = load_file(tmp_path / "ckpt" / "model.safetensors")
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    save_file(tensors, tmp_path / "ckpt" / "model.safetensors")
    with pytest.raises(CheckpointMismatchError, match="missing") as info:
        load_checkpoint_weights(_model(tiny_model_dir), tmp_path / "ckpt")
    assert exit_code_for(info.value) == EXIT_INVALID
    assert not load_checkpoint_weights(model, tmp_path / "nothing-here")  # not a full-model checkpoint: HF's turn
