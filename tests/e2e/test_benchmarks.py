"""The issue benchmarks stay runnable: each runs end to end on a tiny workload and prints a consistent JSON summary.

Speed targets are never asserted here (they live in the scripts' own output); these check the figures' invariants.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run_benchmark(name: str, *args: str) -> dict:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / name), *args],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("JSON ")]
    assert len(lines) == 1, out.stdout[-3000:]
    return json.loads(lines[0][len("JSON "):])


@pytest.mark.slow  # starts a process
def test_host_pipeline_benchmark_reports_ordered_stage_figures():
    summary = _run_benchmark("bench_host_pipeline.py", "--samples", "12", "--seq-len", "96", "--vocab", "3000",
                             "--coord-slots", "16")
    for table in ("mixed", "sixty"):
        stages = summary[table]
        for figures in stages.values():
            assert 0 < figures["median_ms"] <= figures["p99_ms"]
        assert stages["total"]["median_ms"] >= max(stages[s]["median_ms"] for s in ("parse", "match+ot", "targets"))
    memory = summary["memory"]
    assert set(memory) >= {"naive", "ours", "forward_ratio"}
    expected_ratio = memory["naive"]["forward_extra_mib"] / max(memory["ours"]["forward_extra_mib"], 1e-3)
    assert memory["forward_ratio"] == pytest.approx(expected_ratio)


@pytest.mark.slow  # starts a process
def test_train_step_benchmark_counts_padding_only_in_the_padded_run():
    summary = _run_benchmark("bench_train_step.py", "--steps", "1", "--batch", "3", "--samples", "8", "--hidden", "64",
                             "--layers", "1")
    packed, padded = summary["packed"], summary["padded"]
    assert packed["computed_tokens"] == packed["trained_tokens"] > 0  # padding-free rows
    assert padded["computed_tokens"] >= padded["trained_tokens"] > 0
    for run in (packed, padded):
        assert run["tokens_per_s"] > 0 and 0 <= run["host_share"] < 1
        assert set(run["split_s"]) == {"rollout", "host", "forward", "backward", "other"}
        assert sum(run["split_s"].values()) <= run["wall_s"] * 1.01 + 1e-6
    assert 0 < packed["fill_ratio"] <= 1 and padded["fill_ratio"] is None


@pytest.mark.slow  # starts a process
def test_rollout_overlap_benchmark_reports_consistent_step_splits_and_hf_modes():
    summary = _run_benchmark("bench_rollout_overlap.py", "--steps", "1", "--batch", "2", "--new-tokens", "8",
                             "--hidden", "64", "--layers", "1", "--repeats", "1", "--hf-modes", "off,static")
    overlap = summary["overlap"]
    off, on = overlap["off"], overlap["on"]
    for run in (off, on):
        assert run["steps"] == 1 and run["step_s"] > 0 and run["rollout_wait_s"] >= 0
        assert run["train_s"] == pytest.approx(run["step_s"] - run["rollout_wait_s"])
    assert overlap["sum_s"] == pytest.approx(off["rollout_wait_s"] + off["train_s"]) == pytest.approx(off["step_s"])
    assert overlap["max_s"] == pytest.approx(max(off["rollout_wait_s"], off["train_s"]))
    assert overlap["max_s"] <= overlap["sum_s"]
    assert overlap["speedup"] == pytest.approx(off["step_s"] / on["step_s"])
    assert off["staleness_max"] == 0 and on["staleness_max"] == 1  # the timed step trained on prefetched rollouts
    modes = summary["hf_generate"]
    assert list(modes) == ["off", "static"]
    for figures in modes.values():
        assert figures["tokens"] > 0 and figures["equal_to_off"] is True
        assert figures["tokens_per_s"] == pytest.approx(figures["tokens"] / figures["seconds"])


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed; run "
                    "`bash scripts/install_vllm_cpu.sh` and use that venv's python")
def test_server_concurrency_benchmark_reports_ratios_and_push_times():
    # two push servers, not the benchmark's three: one vLLM server start less, the same parallel-push figures
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_server_concurrency.py"), "--quick",
                          "--push-servers", "2"], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    (summary,) = [json.loads(line[len("JSON "):]) for line in lines if line.startswith("JSON ")]
    concurrency = summary["concurrency"]
    assert list(concurrency) == ["1", "2", "4"]
    for figures in concurrency.values():
        assert figures["tokens"] > 0 and figures["same_tokens_as_w1"] is True
        assert figures["tokens_per_s"] == pytest.approx(figures["tokens"] / figures["seconds"])
        assert figures["ratio"] == pytest.approx(figures["tokens_per_s"] / concurrency["1"]["tokens_per_s"])
    push = summary["push"]
    assert push["megabytes"] > 0 and set(push["seconds"]) == {"1", "2"}
    assert push["ratio"] == pytest.approx(push["seconds"]["2"] / push["seconds"]["1"])
    assert lines[-1] == f"concurrency ratio W=4: {concurrency['4']['ratio']:.2f}"
