"""Issue 36's public face: a stage-2 LoRA run with HF rollouts, trained a few steps at a high learning rate under
``optim: adamw_torch_fused`` and again under ``training.deepspeed: zero2`` (one process), evaluates at its final step
exactly as ``coordexp eval --checkpoint OUTPUT_DIR`` evaluates the saved model, counter for counter. Both settings
update the weights without moving their in-place version counters, so before every optimizer step was recorded
(coordexp.runtime.model.weight_version) the in-training rollouts decoded the step-0 weights for the whole run.
With ``tuner.lora_bias: all`` the saved biases moved away from the base model's (the first rollout used to freeze
them)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from coordexp.cli.app import app

pytestmark = pytest.mark.slow
pytest.importorskip("peft", reason="needs peft (pip install peft)")

STEPS = 3
NO_DEEPSPEED = importlib.util.find_spec("deepspeed") is None
RUNS = {
    "fused_adamw_lora_bias": ({"optim": "adamw_torch_fused"}, {"lora_bias": "all"}),
    "zero2_dora": ({"deepspeed": "zero2"}, {"use_dora": True}),
}


def _final_eval(output_dir: Path) -> dict:
    state = json.loads((output_dir / f"checkpoint-{STEPS}" / "trainer_state.json").read_text(encoding="utf-8"))
    evals = [h for h in state["log_history"] if "eval/AP50" in h]
    assert evals and evals[-1]["step"] == STEPS
    return evals[-1]


@pytest.mark.parametrize("name", list(RUNS))
def test_the_evaluation_at_the_last_step_equals_coordexp_eval_of_the_saved_model(write_config, dataset, tmp_path,
                                                                                monkeypatch, name):
    if "deepspeed" in RUNS[name][0] and NO_DEEPSPEED:
        pytest.skip("deepspeed is not installed (bash scripts/install_deepspeed.sh)")
    from coordexp.runtime.rollout.hf import HfRolloutBackend
    from coordexp.runtime.train.launch import run_training
    from coordexp.schema.contract import load_contract

    # the token ids of every HF rollout call: the untrained tiny model writes no parseable object, so its counters
    # alone could agree for two different weights; the generated tokens cannot
    generated: list[list[list[int]]] = []
    real_generate = HfRolloutBackend.generate

    def recorded(self, requests):
        outputs = real_generate(self, requests)
        generated.append([list(o.response_token_ids) for o in outputs])
        return outputs

    monkeypatch.setattr(HfRolloutBackend, "generate", recorded)

    training, tuner = RUNS[name]
    output_dir = tmp_path / "run"
    config = write_config({
        "global_max_length": 1024,
        "data": {"val_jsonl": str(dataset.val_jsonl), "max_val_samples": 2},
        "rollout_matching": {"rollout_backend": "hf", "decode_batch_size": 2, "max_new_tokens": 24},
        "tuner": {"train_type": "lora", "lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.0,
                  "train_coord_rows": False, **tuner},
        "training": {"output_dir": str(output_dir), "max_steps": STEPS, "save_steps": STEPS, "eval_steps": STEPS,
                     "logging_steps": 1, "per_device_train_batch_size": 2, "per_device_eval_batch_size": 2,
                     "gradient_accumulation_steps": 1, "packing": False, "learning_rate": 5e-2,
                     "warmup_ratio": 0.0, "lr_scheduler_type": "constant", **training},
    })
    outcome = run_training(load_contract(config), print_logs=False)
    assert outcome.global_step == STEPS
    in_training = _final_eval(output_dir)
    last_eval_rollouts = generated[-1]  # the final evaluation's tokens

    result = CliRunner().invoke(app, ["eval", str(config), "--checkpoint", str(output_dir), "--json", "--pngs", "0",
                                      "--out", str(tmp_path / "eval")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout[result.stdout.index("{"):])
    assert report["adapter"] == str(output_dir)
    counters = report["counters"]
    assert counters["rollout_tokens"] > 0
    assert {key: in_training[f"eval/{key}"] for key in counters} == counters
    assert in_training["eval/AP50"] == pytest.approx(report["bbox"]["AP50"])
    assert generated[-1] == last_eval_rollouts  # coordexp eval wrote the final evaluation's tokens ...
    base = CliRunner().invoke(app, ["eval", str(config), "--checkpoint", load_contract(config).model.path, "--json",
                                    "--pngs", "0", "--out", str(tmp_path / "base")], catch_exceptions=False)
    assert base.exit_code == 0, base.output
    assert generated[-1] != last_eval_rollouts  # ... which the untrained base model does not write

    if tuner.get("lora_bias") == "all":
        from safetensors.torch import load_file
        from transformers import AutoModelForImageTextToText

        saved = load_file(output_dir / "adapter_model.safetensors")
        base = AutoModelForImageTextToText.from_pretrained(load_contract(config).model.path).state_dict()
        biases = {k: v for k, v in saved.items() if k.endswith(".bias")}
        assert biases
        moved = [k for k, v in biases.items()
                 if not torch.equal(v, base[k.removeprefix("base_model.model.").replace(".base_layer.", ".")])]
        assert len(moved) == len(biases), sorted(set(biases) - set(moved))[:3]
