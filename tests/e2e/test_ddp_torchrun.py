"""Two learner processes under real torchrun (gloo on CPU): stage 2 trains without deadlock and stays in sync (the
reward objective's two-rank runs: tests/e2e/test_reward_distributed.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testkit import rank_shared_logs

pytestmark = pytest.mark.slow

ENTRY = Path(__file__).with_name("ddp_entry.py")


def _two_ranks(config: Path, tmp_path: Path) -> list[dict]:
    """Train ``config`` under torchrun with two CPU ranks (gloo); what each rank's entry wrote."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(ENTRY),
           str(config), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_two_process_stage2_trains_in_lockstep(tmp_path, write_config):
    config = write_config(
        {
            "training": {
                "output_dir": str(tmp_path / "run"),
                "per_device_train_batch_size": 2,
                "gradient_accumulation_steps": 1,
                "max_steps": 3,
                "logging_steps": 1,
                "save_steps": 1000,
                "packing": True,
                "packing_buffer": 64,
            },
            "global_max_length": 1024,
            "rollout_matching": {"rollout_backend": "hf", "decode_batch_size": 2, "max_new_tokens": 16},
        }
    )
    ranks = _two_ranks(config, tmp_path)
    assert all(r["distributed"] and r["world_size"] == 2 for r in ranks)
    assert [r["global_step"] for r in ranks] == [3, 3]
    # DDP all-reduces gradients, so both replicas hold identical weights after every step.
    assert ranks[0]["params_sha256"] == ranks[1]["params_sha256"]
    # Logged values are reduced across ranks (loss, rollout counters, packing): both ranks log the same numbers.
    assert rank_shared_logs(ranks[0]["logs"]) == rank_shared_logs(ranks[1]["logs"])
    assert all(log["rollout/samples"] == 4 for log in ranks[0]["logs"])  # 2 ranks x batch 2
