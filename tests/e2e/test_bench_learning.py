"""benchmarks/bench_learning.py stays runnable: a tiny budget end to end (stage 1, then stage 2 and stage 1
continued from the same checkpoint), one consistent JSON summary. Its numbers are never asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_learning_benchmark_reports_three_runs_from_one_checkpoint(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_learning.py"), "--workdir", str(tmp_path),
         "--stage1-steps", "2", "--k", "1", "--n-train", "8", "--n-val", "2", "--max-new-tokens", "24",
         "--score", "constant"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("JSON ")]
    assert len(lines) == 1, out.stdout[-3000:]
    runs = json.loads(lines[0][len("JSON "):])["runs"]
    assert list(runs) == ["stage1", "stage2", "stage1_continued"]
    assert [runs[name]["train"]["steps"] for name in runs] == [2, 1, 1]
    for figures in runs.values():
        assert figures["train"]["trained_tokens"] > 0 and figures["train"]["wall_s"] > 0
        ev = figures["eval"]
        assert ev["gt_objects"] > 0 and all(0.0 <= ev[k] <= 1.0 for k in ("AP", "AP50", "AR100"))
    # both continuations started from the stage-1 checkpoint
    for name in ("stage2", "stage1_continued"):
        config = (tmp_path / f"{name}.yaml").read_text()
        assert str(tmp_path / "stage1") in config
    assert (tmp_path / "eval_stage2" / "coco_results.json").is_file()
