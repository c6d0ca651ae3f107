"""Issue 28 item 1 end to end: a plain LoRA stage 1 (no ``modules_to_save``) from a checkpoint whose 1000 coord
rows are all one vector (what ``expand-vocab`` wrote before distinct starts) trains those rows by default, so the
coord loss falls; the adapter directory holds only those rows (not the vocabulary matrices), resume restores them,
``eval --checkpoint ADAPTER`` and ``export-merged`` use them, and the full weight export carries them.

With frozen rows every coord logit equals every other, so the soft coord CE stays at exactly log(1000)."""

from __future__ import annotations

import json
import math
import shutil
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
EMBED, HEAD = "model.language_model.embed_tokens", "lm_head"
STEPS = 4


def _cli(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def _json(result) -> dict:
    return json.loads(result.stdout[result.stdout.index("{"):])


def _coord_ids(model_dir) -> torch.Tensor:
    from coordexp.runtime.core.tokens import CoordVocab
    from coordexp.runtime.model.encoding import load_processor

    return torch.as_tensor(CoordVocab.from_tokenizer(load_processor(model_dir).tokenizer).ids)


def _matrices(model_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from coordexp.runtime.train.checkpoint_load import saved_name_map
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32)
    assert load_file(Path(model_dir) / "model.safetensors") and saved_name_map(model)
    return {EMBED: model.get_input_embeddings().weight.detach().clone(),
            HEAD: model.get_output_embeddings().weight.detach().clone()}


@pytest.fixture(scope="module")
def mean_rows_dir(tmp_path_factory, tiny_model_dir):
    """The tiny Qwen2-VL (lm_head untied) with every coord row of the embeddings and head set to the mean of the
    other tokens' rows: the start an expanded checkpoint had before, and the one where frozen rows cannot learn."""
    from transformers import AutoModelForImageTextToText

    from coordexp.runtime.model.encoding import load_processor

    out = tmp_path_factory.mktemp("mean_rows") / "ckpt"
    shutil.copytree(tiny_model_dir, out)
    ids = _coord_ids(out)
    vocab = len(load_processor(out).tokenizer)
    others = torch.ones(vocab, dtype=torch.bool)
    others[ids] = False
    model = AutoModelForImageTextToText.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        for weight in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
            weight[ids] = weight[:vocab][others].mean(dim=0)
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def coord_run(tmp_path_factory, mean_rows_dir, dataset):
    """``coordexp train`` of a 4-step plain LoRA stage 1 (coord rows at their default rate), checkpoints at 2 and 4."""
    root = tmp_path_factory.mktemp("coord_rows_run")
    config = {
        "extends": str(REPO / "examples" / "stage1_sft.yaml"),
        "global_max_length": 1024,
        "model": {"path": str(mean_rows_dir), "dtype": "float32", "attn_implementation": "sdpa"},
        "data": {"train_jsonl": str(dataset.train_jsonl), "val_jsonl": str(dataset.val_jsonl)},
        "training": {"output_dir": str(root / "run"), "max_steps": STEPS, "save_steps": 2, "logging_steps": 1,
                     "per_device_train_batch_size": 4, "learning_rate": 1e-2, "warmup_ratio": 0.0,
                     "lr_scheduler_type": "constant", "packing": False},
        "rollout_matching": {"rollout_backend": "hf", "decode_batch_size": 2, "max_new_tokens": 24},
        "tuner": {"train_type": "lora", "lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.0},
    }
    path = root / "cfg.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    result = _cli("train", path, "--json")
    assert result.exit_code == 0, result.output
    return path, root / "run"


def _tables(adapter_dir) -> dict[str, torch.Tensor]:
    """The coord-row tables saved in an adapter directory, by the module they belong to."""
    from safetensors.torch import load_file

    saved = load_file(Path(adapter_dir) / "adapter_model.safetensors")
    return {n.removeprefix("base_model.model.").split(".token_adapter.")[0]: t
            for n, t in saved.items() if ".trainable_tokens_delta" in n}


def test_plain_lora_stage1_trains_the_coord_rows_and_the_coord_loss_falls(coord_run, mean_rows_dir):
    _, out = coord_run
    state = json.loads((out / f"checkpoint-{STEPS}" / "trainer_state.json").read_text(encoding="utf-8"))
    soft_ce = [h["loss/coord_reg/soft_ce"] for h in state["log_history"] if "loss/coord_reg/soft_ce" in h]
    assert len(soft_ce) == STEPS
    assert soft_ce[0] == pytest.approx(math.log(1000), abs=1e-3)  # every coord logit equal at the start
    assert all(b < a for a, b in zip(soft_ce, soft_ce[1:])) and soft_ce[-1] < soft_ce[0] - 0.3, soft_ce
    tables, base, ids = _tables(out), _matrices(mean_rows_dir), _coord_ids(mean_rows_dir)
    assert set(tables) == {EMBED, HEAD}
    for name, table in tables.items():
        assert table.shape == (1000, base[name].shape[1])
        assert not torch.allclose(table, base[name][ids], atol=1e-4), name
    # no longer one vector: every head row gets a gradient (the softmax), an input row when its token is read
    assert len({tuple(row) for row in tables[HEAD].tolist()}) == 1000
    assert len({tuple(row) for row in tables[EMBED].tolist()}) > 100


def test_the_adapter_directory_holds_the_coord_rows_not_the_vocabulary_matrices(coord_run, mean_rows_dir):
    from safetensors.torch import load_file

    _, out = coord_run
    saved = load_file(out / "adapter_model.safetensors")
    base = _matrices(mean_rows_dir)
    vocab_rows, hidden = base[EMBED].shape
    assert all(vocab_rows not in t.shape for t in saved.values())  # no whole embedding / head matrix
    lora = sum(t.numel() for n, t in saved.items() if ".lora_" in n)
    coord = sum(t.numel() for n, t in saved.items() if ".trainable_tokens_delta" in n)
    assert coord == 2 * 1000 * hidden and lora + coord == sum(t.numel() for t in saved.values())
    size = (out / "adapter_model.safetensors").stat().st_size
    assert size < 4 * (lora + coord) + 64 * 1024  # float32 tensors plus the header
    assert size < 4 * 2 * vocab_rows * hidden  # smaller than the two matrices a modules_to_save run would store


def test_resume_restores_the_coord_rows_and_their_optimizer_state(coord_run):
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    from coordexp.runtime.train.launch import build_trainer
    from coordexp.schema.contract import load_contract

    seen: dict = {}

    class Snapshot(TrainerCallback):
        """The coord rows and optimizer state the loop starts from once HF has restored the checkpoint."""

        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            seen["step"] = state.global_step
            seen["tables"] = {n: p.detach().clone() for n, p in model.named_parameters()
                              if ".trainable_tokens_delta." in n}
            seen["groups"] = {g["part"]: g["lr"] for g in optimizer.param_groups}
            seen["optimizer"] = {i: {k: v.clone() for k, v in s.items() if torch.is_tensor(v)}
                                 for i, s in optimizer.state_dict()["state"].items()}

    config, out = coord_run
    checkpoint = out / "checkpoint-2"
    trainer = build_trainer(load_contract(config), callbacks=[Snapshot()], args_overrides={
        "output_dir": str(out.parent / "resume_probe"), "save_steps": 1000})
    trainer.train(resume_from_checkpoint=str(checkpoint))
    assert seen["step"] == 2 and trainer.state.global_step == STEPS
    assert seen["groups"]["coord_embed"] == seen["groups"]["coord_head"] == 1e-2  # null rates: learning_rate
    saved = load_file(checkpoint / "adapter_model.safetensors")
    restored = {n.removeprefix("base_model.model.").replace(".default", ""): t for n, t in seen["tables"].items()}
    expected = {n.removeprefix("base_model.model."): t for n, t in saved.items() if ".trainable_tokens_delta" in n}
    assert set(restored) == set(expected) and len(expected) == 2
    for name, tensor in expected.items():
        assert torch.equal(restored[name], tensor), name
    optimizer_saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)["state"]
    assert set(seen["optimizer"]) == set(optimizer_saved)
    for index, state in optimizer_saved.items():
        assert torch.equal(seen["optimizer"][index]["exp_avg"], state["exp_avg"]), index
    # the resumed run ends where the uninterrupted one did
    final = _tables(out)
    resumed = {n.removeprefix("base_model.model.").split(".token_adapter.")[0]: p.detach()
               for n, p in trainer.model.named_parameters() if ".trainable_tokens_delta." in n}
    assert set(resumed) == set(final)
    for name in final:
        torch.testing.assert_close(resumed[name], final[name], rtol=1e-5, atol=1e-6)


def test_export_merged_writes_the_trained_rows_and_the_full_export_carries_them(coord_run, mean_rows_dir, tmp_path):
    from coordexp.runtime.model.policy import load_policy
    from coordexp.runtime.rollout.weight_export import named_tensors
    from coordexp.schema.contract import load_contract

    config, out = coord_run
    merged_dir = tmp_path / "merged"
    result = _cli("export-merged", out, merged_dir)
    assert result.exit_code == 0, result.output
    merged, base, tables = _matrices(merged_dir), _matrices(mean_rows_dir), _tables(out)
    ids = _coord_ids(mean_rows_dir)
    others = torch.ones(base[EMBED].shape[0], dtype=torch.bool)
    others[ids] = False
    for name in (EMBED, HEAD):
        torch.testing.assert_close(merged[name][ids], tables[name], rtol=0, atol=1e-6)
        assert (merged[name][ids] - base[name][ids]).abs().max() > 1e-3, name
        assert torch.equal(merged[name][others], base[name][others]), name  # only the coord rows moved

    policy, _ = load_policy(load_contract(config), adapter=out)
    exported = dict(named_tensors(policy))
    for name in (EMBED, HEAD):
        torch.testing.assert_close(exported[f"{name}.weight"], merged[name], rtol=1e-6, atol=1e-6)


def test_eval_of_the_adapter_equals_eval_of_its_merged_export(coord_run, tmp_path):
    config, out = coord_run
    merged = tmp_path / "merged"
    assert _cli("export-merged", out, merged).exit_code == 0
    reports = {}
    for name, checkpoint in (("merged", merged), ("adapter", out)):
        result = _cli("eval", config, "--checkpoint", checkpoint, "--json", "--pngs", "0", "--out",
                      tmp_path / f"eval_{name}")
        assert result.exit_code == 0, result.output
        reports[name] = _json(result)
    assert reports["adapter"]["adapter"] == str(out)
    assert reports["merged"]["counters"] == reports["adapter"]["counters"]
