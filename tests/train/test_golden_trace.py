"""A golden loss trace: three optimizer steps of stage 2 on the tiny model (float64, HF rollouts, greedy, packing
with a carry across steps, 2 micro-steps per step), its logged figures checked in. Any change to the numbers the
trainer produces (targets, packing, losses, seeds, the order of rollouts and weight pushes) shows up here; when a
change is meant, regenerate the table with ``pytest tests/train/test_golden_trace.py -s`` (it prints the trace)
and say why in the commit. The tolerance covers float32 reductions that vary with thread scheduling (~2e-7)."""

from __future__ import annotations

import json

import pytest
import torch

from coordexp.runtime.train.launch import build_trainer
from coordexp.schema.contract import load_contract

GOLDEN = [
    {"loss": 15.436052322387695, "grad_norm": 22.098421454330712, "loss/token_ce": 9.846339225769043,
     "loss/coord_reg": 5.589712142944336, "rollout/matched": 0.0, "rollout/pred_valid": 0.0,
     "rollout/fn_appended": 2.0, "tokens/trained": 583},
    {"loss": 19.464670181274414, "grad_norm": 10.171780506149728, "loss/token_ce": 8.706114292144775,
     "loss/coord_reg": 10.758556842803955, "rollout/matched": 0.0, "rollout/pred_valid": 0.0,
     "rollout/fn_appended": 15.0, "tokens/trained": 1177},
    {"loss": 8.798175811767578, "grad_norm": 13.002225800800494, "loss/token_ce": 3.742384672164917,
     "loss/coord_reg": 5.05579137802124, "rollout/matched": 0.0, "rollout/pred_valid": 0.0,
     "rollout/fn_appended": 2.0, "tokens/trained": 576},
]


@pytest.mark.slow
def test_three_steps_reproduce_the_golden_trace(tmp_path, write_config):
    run = load_contract(write_config({
        "training": {"output_dir": str(tmp_path / "golden"), "per_device_train_batch_size": 2,
                     "gradient_accumulation_steps": 2, "max_steps": 3, "save_steps": 1000, "logging_steps": 1,
                     "packing": True, "packing_buffer": 64, "learning_rate": 5e-3, "warmup_ratio": 0.0, "seed": 11},
        "global_max_length": 1024,
        "rollout_matching": {"rollout_backend": "hf", "decode_batch_size": 2, "max_new_tokens": 24,
                             "decoding": {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "num_beams": 1}},
    }, name="golden.yaml"))
    trainer = build_trainer(run)
    trainer.model.to(torch.float64)
    trainer.train()
    trace = [{k: h[k] for k in GOLDEN[0] if k in h} for h in trainer.state.log_history if "loss" in h]
    print("trace:", json.dumps(trace))
    assert [sorted(t) for t in trace] == [sorted(g) for g in GOLDEN]
    for got, want in zip(trace, GOLDEN, strict=True):
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-9), (key, got[key], value)
