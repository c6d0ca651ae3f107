"""``benchmarks/bench_gpu_stage2.py --smoke`` runs end to end on CPU (toy size) and its figures are consistent; the
published shapes it builds at full size are Qwen3-VL's. Speed is never asserted here."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_gpu_stage2.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_gpu_stage2", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_the_published_shapes_give_qwen3_vls_parameter_counts(tiny_tokenizer):
    """Built on the meta device (no memory): 2B, 4B and 8B parameter counts of the published checkpoints."""
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    bench = _module()
    counts = {}
    for size in ("2b", "4b", "8b"):
        config = bench.qwen3_vl_config(tiny_tokenizer, bench.SHAPES[size])
        with torch.device("meta"):
            model = Qwen3VLForConditionalGeneration._from_config(config)
        counts[size] = sum(p.numel() for p in model.parameters()) / 1e9
        assert config.text_config.vocab_size == 151_936
    assert counts["2b"] == pytest.approx(2.13, abs=0.05)  # Qwen3-VL-2B-Instruct: 2.13 B (tied embeddings)
    assert counts["4b"] == pytest.approx(4.44, abs=0.05)
    assert counts["8b"] == pytest.approx(8.77, abs=0.05)


@pytest.mark.slow  # starts a process that trains
def test_the_smoke_run_prints_consistent_figures():
    out = subprocess.run([sys.executable, str(SCRIPT), "--smoke"], capture_output=True, text=True, timeout=900,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("JSON ")]
    assert len(lines) == 1, out.stdout[-3000:]
    summary = json.loads(lines[0][len("JSON "):])
    assert summary["device"] == "CPU" and summary["size"] == "toy"
    limit = summary["bandwidth"]["decode_limit_tokens_per_s"]
    assert limit == pytest.approx(2 * summary["bandwidth"]["bytes_per_s"] / summary["model"]["weight_bytes"])
    assert set(summary["decode"]) == {"plain generate (dynamic cache)", "device default (hf_generate unset)",
                                      "DoRA r16 unmerged (dynamic cache)", "DoRA r16 merged (default)"}
    decode = summary["decode"]
    for figures in decode.values():
        assert figures["tokens"] > 0 and figures["tokens_per_s"] == pytest.approx(figures["tokens"] / figures["seconds"])
    assert summary["ratios"]["dora_rollout_s_over_full_default"] == pytest.approx(
        decode["device default (hf_generate unset)"]["tokens_per_s"] / decode["DoRA r16 merged (default)"]["tokens_per_s"])
    cost = summary["dora_cost"]
    assert list(cost) == ["full fine-tuning", "DoRA, PEFT defaults (dropout 0.05)", "DoRA, coordexp default",
                          "DoRA, coordexp, adapter_dtype: model"]
    assert cost["full fine-tuning"]["over_full"] == 1.0
    for figures in cost.values():
        assert figures["seconds"] > 0
        assert figures["over_full"] == pytest.approx(figures["seconds"] / cost["full fine-tuning"]["seconds"])
    runs = summary["runs"]
    assert set(runs) == {"full, packed", "DoRA r16, packed", "DoRA r16, padded"}
    for name, run in runs.items():
        assert set(run["split_s"]) == {"rollout", "host", "forward", "backward", "other"}
        assert run["trained_tokens"] > 0 and run["rollout_tokens_per_s"] > 0 and run["peak_gib"] is None
        assert (run["fill_ratio"] is None) == name.endswith("padded")
    ratios = summary["ratios"]
    full, dora = runs["full, packed"], runs["DoRA r16, packed"]
    assert ratios["dora_over_full_compute_per_token"] == pytest.approx(
        dora["compute_s_per_token"] / full["compute_s_per_token"])
    assert ratios["dora_over_full_rollout_s"] == pytest.approx(dora["split_s"]["rollout"] / full["split_s"]["rollout"])
    assert "Stage-2 steps" in out.stdout and "Ratios" in out.stdout
