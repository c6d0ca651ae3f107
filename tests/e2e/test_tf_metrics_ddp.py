"""Teacher-forced token figures under two learner processes (torchrun, gloo on CPU): each rank scores its shard of
the validation split (3 records: shards of 2 and 1, so one rank runs a stand-in forward) and the sums are reduced, so
both ranks report exactly what one process reports for the whole split; the per-step figures are reduced too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from coordexp.runtime.train.launch import build_trainer
from coordexp.schema.contract import load_contract
from coordexp.schema.training import TOKEN_METRICS

pytestmark = pytest.mark.slow

ENTRY = Path(__file__).with_name("tf_metrics_ddp_entry.py")


def test_two_ranks_report_the_single_process_figures(tmp_path, write_config, dataset):
    config = write_config({
        "custom": {"trainer_variant": "stage1_sft"}, "global_max_length": 1024,
        "data": {"val_jsonl": str(dataset.val_jsonl), "max_val_samples": 3},
        "rollout_matching": {"max_new_tokens": 8, "decode_batch_size": 2},
        "training": {"output_dir": str(tmp_path / "run"), "per_device_train_batch_size": 2,
                     "per_device_eval_batch_size": 1, "packing": False, "max_steps": 1, "logging_steps": 1,
                     "eval_steps": 1, "save_steps": 1000, "token_type_metrics": True},
    })
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(ENTRY),
           str(config), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["distributed"] for r in ranks)
    single = build_trainer(load_contract(config))
    try:
        alone = single.evaluate()
    finally:
        single.backend.close()
    for name in TOKEN_METRICS:
        assert ranks[0]["before"][f"eval/{name}"] == ranks[1]["before"][f"eval/{name}"]
        assert ranks[0]["before"][f"eval/{name}"] == pytest.approx(alone[f"eval/{name}"], rel=1e-5), name
    step_logs = [[h for h in r["logs"] if "loss" in h] for r in ranks]
    assert len(step_logs[0]) == 1 and all(0.0 <= h["token_acc"] <= 1.0 for h in step_logs[0])
    assert [{k: h[k] for k in TOKEN_METRICS} for h in step_logs[0]] == [
        {k: h[k] for k in TOKEN_METRICS} for h in step_logs[1]]
    assert [h["eval/token_acc"] for h in ranks[0]["logs"] if "eval/token_acc" in h] == [
        h["eval/token_acc"] for h in ranks[1]["logs"] if "eval/token_acc" in h]
