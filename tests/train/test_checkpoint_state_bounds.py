"""``--resume`` reads a checkpoint's ``trainer_state.json`` through the bounded reader (issue 45): a 100k-deep
document, a 401-digit step or a FIFO is a named problem (the checkpoint is skipped, exit 2), never exit 1 or a hang."""

from __future__ import annotations

import os

import pytest

from coordexp.runtime.train.checkpoints import checkpoint_problem, choose_resume


@pytest.mark.parametrize("state", ["[" * 100_000 + "]" * 100_000, '{"global_step": 1' + "0" * 400 + "}",
                                   '{"global_step": "2"}', "not json", "fifo"])
def test_a_damaged_trainer_state_is_a_named_problem(tmp_path, state):
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"x")
    if state == "fifo":
        os.mkfifo(checkpoint / "trainer_state.json")
    else:
        (checkpoint / "trainer_state.json").write_text(state)
    problem = checkpoint_problem(checkpoint)
    assert problem is not None and "trainer_state.json" in problem
    choice = choose_resume(tmp_path)
    assert choice.path is None and choice.skipped[0][0] == checkpoint


def test_a_sound_checkpoint_is_chosen(tmp_path):
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"x")
    (checkpoint / "trainer_state.json").write_text('{"global_step": 2}')
    assert checkpoint_problem(checkpoint) is None and choose_resume(tmp_path).path == checkpoint
