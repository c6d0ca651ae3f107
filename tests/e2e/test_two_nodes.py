"""Two torchrun agents on 127.0.0.1 as two "nodes" (``--nnodes 2``, one process each, gloo): issue 55, item 3.

- Stage 1 and a server-mode stage 2 train with the same per-step losses and final weights as one agent's 2-process
  run of the same config (the ranks, data shards and collectives are the same; only the rendezvous differs).
- ``--resume auto`` agrees on one checkpoint across the ranks before the model loads: a node whose
  ``training.output_dir`` lacks the checkpoint (a folder that is not shared) stops EVERY rank with exit 2 and its
  reason prefixed by its rank (before, it exited alone and rank 0 hung in the rendezvous until killed); nodes that
  see the same checkpoint go on.
Every launch is bounded (a hang guard that kills the agents' process groups); nothing asserts on wall-clock time.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testkit import ServeRolloutProcess, free_port, server_rollout

pytestmark = pytest.mark.slow

DDP_ENTRY = Path(__file__).with_name("ddp_entry.py")
SERVER_ENTRY = Path(__file__).parents[1] / "rollout" / "torchrun_server_entry.py"
HANG_GUARD_S = 300  # a training launch
START_GUARD_S = 120  # a launch that stops (or agrees) before the model loads
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
TRAINING = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": 2, "logging_steps": 1,
            "save_steps": 1000, "packing": True, "packing_buffer": 64}
ROLLOUT = {"decode_batch_size": 2, "max_new_tokens": 16}


def _launch(commands: list[list[str]], guard_s: float = HANG_GUARD_S) -> list[tuple[int, str]]:
    """Start every command at once (each in its own process group) and return each one's (exit code, output);
    all are killed if one is still running after ``guard_s``."""
    procs = [subprocess.Popen(cmd, env={**os.environ, **ENV}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True) for cmd in commands]
    results = []
    deadline = time.monotonic() + guard_s
    try:
        for proc in procs:
            output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((proc.returncode, output))
    except subprocess.TimeoutExpired:
        outputs = []
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            outputs.append(proc.communicate(timeout=30)[0][-3000:])
        raise AssertionError(f"an agent still ran after {guard_s} s (a hang):\n" + "\n---\n".join(outputs))
    return results


def _torchrun(*launch: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launch]


def _two_agents(target: list[str], per_node: tuple[list[str], list[str]] = ([], []), *, static: bool = False,
                guard_s: float = HANG_GUARD_S) -> list[tuple[int, str]]:
    """Two agents (``--nnodes 2 --nproc_per_node 1``) of ``target`` (+ each node's own arguments): a c10d
    rendezvous like examples/slurm_2nodes.sbatch, or ``static`` (--node_rank fixes which agent is rank 0)."""
    port = free_port()
    commands = []
    for node, extra in enumerate(per_node):
        where = (["--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port)] if static else
                 ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "two-nodes"])
        commands.append(_torchrun("--nnodes", "2", "--nproc_per_node", "1", *where, *target, *extra))
    return _launch(commands, guard_s)


def _one_agent(target: list[str]) -> list[tuple[int, str]]:
    return _launch([_torchrun("--standalone", "--nproc_per_node", "2", *target)])


def _ranks(out_dir: Path, results: list[tuple[int, str]]) -> list[dict]:
    for code, output in results:
        assert code == 0, output[-4000:]
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["distributed"], r["world_size"]) for r in ranks] == [(True, 2)] * 2
    assert ranks[0]["params_sha256"] == ranks[1]["params_sha256"]
    return ranks


def _trained(entry: Path, config: Path, out_dir: Path, *, nodes: int) -> list[dict]:
    out_dir.mkdir()
    target = [str(entry), str(config), str(out_dir)]
    return _ranks(out_dir, _two_agents(target) if nodes == 2 else _one_agent(target))


def _stage2_config(write_config, server: ServeRolloutProcess, out_dir: Path) -> Path:
    """Server-mode stage 2 against ``server``; each learner run has its own weight-sync group port."""
    rollout = server_rollout([(server.base_url, free_port())], server={"timeout_s": 60.0, "infer_timeout_s": 120.0},
                             **ROLLOUT)
    return write_config({"global_max_length": 1024, "rollout_matching": rollout,
                         "training": {**TRAINING, "output_dir": str(out_dir / "run")}}, name=f"{out_dir.name}.yaml")


def test_two_agents_train_stage1_and_server_stage2_like_one_agent_with_two_processes(tmp_path, write_config):
    stage1 = write_config({"custom": {"trainer_variant": "stage1_sft"}, "global_max_length": 1024,
                           "training": {**TRAINING, "output_dir": str(tmp_path / "stage1")}}, name="stage1.yaml")
    one, two = (_trained(DDP_ENTRY, stage1, tmp_path / f"stage1_{n}", nodes=n) for n in (1, 2))
    assert [r["global_step"] for r in two] == [TRAINING["max_steps"]] * 2
    assert [log["loss"] for log in two[0]["logs"]] == [log["loss"] for log in one[0]["logs"]]
    assert len(two[0]["logs"]) == TRAINING["max_steps"]
    assert two[0]["params_sha256"] == one[0]["params_sha256"]

    server = ServeRolloutProcess(write_config({"rollout_matching": ROLLOUT}, name="server.yaml"),
                                 tmp_path / "server.log", env=ENV)
    try:
        server.wait_healthy()
        one, two = (_trained(SERVER_ENTRY, _stage2_config(write_config, server, tmp_path / f"stage2_{n}"),
                             tmp_path / f"stage2_{n}", nodes=n) for n in (1, 2))
        status = server.sync_status()
    finally:
        server.kill()
    assert [r["global_step"] for r in two] == [TRAINING["max_steps"]] * 2
    assert two[0]["losses"] == one[0]["losses"] and len(two[0]["losses"]) == TRAINING["max_steps"]
    assert two[0]["rollout_samples"] == [4, 4]  # 2 ranks x batch 2, rolled out by the server
    assert two[0]["params_sha256"] == one[0]["params_sha256"]
    assert status["failed"] == 0  # rank 0 pushed the weights of both runs


def _checkpoint(model: Path, run_dir: Path, step: int) -> Path:
    """A complete ``checkpoint-<step>`` (the tiny model and a trainer state) in ``run_dir``."""
    path = shutil.copytree(model, run_dir / f"checkpoint-{step}")
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step, "max_steps": step, "log_history": []}))
    return path


def test_resume_auto_agrees_on_one_checkpoint_across_nodes_or_stops_every_rank(tmp_path, write_config,
                                                                                 tiny_model_dir):
    config = write_config({"custom": {"trainer_variant": "stage1_sft"}, "global_max_length": 1024,
                           "training": {**TRAINING, "max_steps": 6}}, name="stage1.yaml")
    train = ["-m", "coordexp", "train", str(config), "--resume", "auto"]
    node0, node1 = tmp_path / "node0" / "run", tmp_path / "node1" / "run"
    _checkpoint(tiny_model_dir, node0, 6)
    node1.parent.mkdir()

    # Each node's own folder (not shared): rank 1 sees no checkpoint. Every rank stops, exit 2, naming rank 1.
    results = _two_agents(train, ([f"--set=training.output_dir={node0}"], [f"--set=training.output_dir={node1}"]),
                          static=True, guard_s=START_GUARD_S)
    (code0, out0), (code1, out1) = results
    text0, text1 = (" ".join(out.split()) for out in (out0, out1))
    reason = f"rank 1: --resume auto found no checkpoint to resume in training.output_dir {node1}"
    assert reason in text0 and reason in text1, (out0[-3000:], out1[-3000:])
    assert "resuming from" not in text0 and "must be one folder every node mounts" in text0
    assert "exitcode : 2" in text0 and "exitcode : 2" in text1, (out0[-3000:], out1[-3000:])  # each worker exited 2
    assert code0 != 0 and code1 != 0

    # One shared folder: both ranks agree on checkpoint-6 (it already reached max_steps: nothing to train).
    results = _two_agents(train, ([f"--set=training.output_dir={node0}"],) * 2, static=True, guard_s=START_GUARD_S)
    assert [code for code, _ in results] == [0, 0], [out[-3000:] for _, out in results]
    assert "already reached training.max_steps (6) at step 6" in " ".join(results[0][1].split())
