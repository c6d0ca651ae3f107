"""Two torchrun agents on 127.0.0.1 as two "nodes" (``--nnodes 2``, one process each, gloo): issue 55, item 3.

- Stage 1 trains with the same per-step losses and final weights as one agent's 2-process run of the same config
  (the ranks, data shards and collectives are the same; only the rendezvous differs). Server-mode stage 2 under
  two agents is checked the same way against the 2-process server run of tests/rollout/test_torchrun_server.py.
- ``--resume auto`` agrees on one checkpoint across the ranks before the model loads: a node whose
  ``training.output_dir`` lacks the checkpoint (a folder that is not shared) stops EVERY rank with exit 2 and its
  reason prefixed by its rank (before, it exited alone and rank 0 went on and hung until killed). The stage-1 test's
  launches are the agreeing case (a fresh start on every rank).
Every launch is bounded (a hang guard kills the agents' process groups); nothing asserts on wall-clock time.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest

from testkit import launch_bounded, torchrun_two_agents

pytestmark = pytest.mark.slow

START_GUARD_S = 120  # a launch that stops (or agrees) before the model loads
TRAINING = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": 2, "logging_steps": 1,
            "save_steps": 1000, "packing": True, "packing_buffer": 64}


def _trained(run_dir: Path, results: list[tuple[int, str]]) -> tuple[list[float], str]:
    """The per-step losses and the final weights' digest of a finished ``coordexp train`` run."""
    for code, output in results:
        assert code == 0, output[-4000:]
    state = json.loads((run_dir / "trainer_state.json").read_text())
    return [h["loss"] for h in state["log_history"] if "loss" in h], _sha(run_dir / "model.safetensors")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_two_agents_train_stage1_like_one_agent_with_two_processes(tmp_path, write_config, tiny_model_dir):
    """The documented launch (``torchrun ... -m coordexp train``): the ranks agree on a fresh start, then train."""
    config = write_config({"custom": {"trainer_variant": "stage1_sft"}, "global_max_length": 1024,
                           "training": TRAINING}, name="stage1.yaml")
    train = ["-m", "coordexp", "train", str(config)]
    one_dir, two_dir = tmp_path / "one_agent", tmp_path / "two_agents"
    one = _trained(one_dir, launch_bounded([[sys.executable, "-m", "torch.distributed.run", "--standalone",
                                             "--nproc_per_node", "2", *train, f"--set=training.output_dir={one_dir}"]],
                                           300))
    two = _trained(two_dir, torchrun_two_agents(train, ([f"--set=training.output_dir={two_dir}"],) * 2))
    assert len(two[0]) == TRAINING["max_steps"]
    assert two == one  # the same losses at every step, the same final weights
    assert two[1] != _sha(tiny_model_dir / "model.safetensors")  # it trained: equal untrained weights prove nothing


def _checkpoint(model: Path, run_dir: Path, step: int) -> Path:
    """A complete ``checkpoint-<step>`` (the tiny model and a trainer state) in ``run_dir``."""
    path = shutil.copytree(model, run_dir / f"checkpoint-{step}")
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step, "max_steps": step, "log_history": []}))
    return path


def test_resume_auto_on_a_node_without_the_checkpoint_stops_every_rank_naming_it(tmp_path, write_config,
                                                                                 tiny_model_dir):
    config = write_config({"custom": {"trainer_variant": "stage1_sft"}, "global_max_length": 1024,
                           "training": {**TRAINING, "max_steps": 8}}, name="stage1.yaml")
    train = ["-m", "coordexp", "train", str(config), "--resume", "auto"]
    node0, node1 = tmp_path / "node0" / "run", tmp_path / "node1" / "run"
    _checkpoint(tiny_model_dir, node0, 6)
    node1.parent.mkdir()

    # Each node's own folder (not shared): rank 1 sees no checkpoint. Every rank stops, exit 2, naming rank 1.
    results = torchrun_two_agents(train, ([f"--set=training.output_dir={node0}"],
                                          [f"--set=training.output_dir={node1}"]), static=True, guard_s=START_GUARD_S)
    (code0, out0), (code1, out1) = results
    text0, text1 = (" ".join(out.split()) for out in (out0, out1))
    reason = f"rank 1: --resume auto found no checkpoint to resume in training.output_dir {node1}"
    assert reason in text0 and reason in text1, (out0[-3000:], out1[-3000:])
    assert "resuming from" not in text0 and "must be one folder every node mounts" in text0
    # torchrun's report of each agent's worker: both exited 2 (each agent then exits non-zero itself)
    assert "exitcode : 2" in text0 and "exitcode : 2" in text1, (out0[-3000:], out1[-3000:])
    assert code0 != 0 and code1 != 0
