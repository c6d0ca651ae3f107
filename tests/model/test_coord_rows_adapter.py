"""Coord rows under an adapter (issue 28 item 1), on the tiny Qwen2-VL / Qwen3-VL models and a tied variant:
``apply_tuner`` makes exactly the 1000 coord rows of the embeddings and head trainable (PEFT trainable tokens,
one shared table when lm_head IS the embedding matrix), a fresh adapter is a no-op even when config.json misstates
the tying, the optimizer gives them their own groups and rates, and the merged weight export carries them."""

from __future__ import annotations

import pytest
import torch

from coordexp.runtime.core.tokens import CoordVocab
from coordexp.runtime.model.tuner import TunerError, apply_tuner, embeddings_tied
from coordexp.schema.tuner import TunerConfig

pytest.importorskip("peft", reason="needs peft (pip install peft)")

LORA = dict(train_type="lora", lora_rank=4, lora_alpha=8, lora_dropout=0.0)


def _load(model_dir, **config_overrides):
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(str(model_dir))
    for key, value in config_overrides.items():
        setattr(config, key, value)
    return AutoModelForImageTextToText.from_pretrained(str(model_dir), config=config, dtype=torch.float32)


@pytest.fixture(scope="module")
def coord_ids(tiny_model_dir):
    from coordexp.runtime.model.encoding import load_processor

    return CoordVocab.from_tokenizer(load_processor(tiny_model_dir).tokenizer).ids


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory, tiny_model_dir):
    """The tiny Qwen2-VL with tie_word_embeddings: lm_head is the input embedding matrix (as in Qwen2-VL-2B,
    Qwen3-VL-2B/4B); saved with one matrix."""
    import shutil

    from transformers import AutoConfig, AutoModelForImageTextToText

    out = tmp_path_factory.mktemp("tied_qwen2_vl")
    config = AutoConfig.from_pretrained(str(tiny_model_dir))
    config.tie_word_embeddings = True
    torch.manual_seed(3)
    model = AutoModelForImageTextToText.from_config(config).to(torch.float32)
    assert embeddings_tied(model)
    model.save_pretrained(str(out))
    for item in tiny_model_dir.iterdir():
        if item.is_file() and item.name not in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(item, out / item.name)
    return out


def _tables(policy) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in policy.named_parameters() if ".trainable_tokens_delta." in n}


def _logits(model, ids) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_lora_trains_exactly_the_coord_rows_of_an_untied_embedding_and_head(family, tiny_model_dir,
                                                                            qwen3_model_dir, coord_ids):
    model = _load(tiny_model_dir if family == "qwen2_vl" else qwen3_model_dir)
    hidden = model.get_input_embeddings().weight.shape[1]
    policy = apply_tuner(model, TunerConfig(**LORA), coord_ids)
    tables = _tables(policy)
    assert {n.split(".token_adapter.")[0].removeprefix("base_model.model.") for n in tables} == {
        "model.language_model.embed_tokens", "lm_head"}
    assert all(t.shape == (1000, hidden) and t.requires_grad for t in tables.values())
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable == {n for n in trainable if ".lora_" in n} | set(tables)  # base matrices stay frozen
    assert policy.peft_config["default"].trainable_token_indices == {
        "model.language_model.embed_tokens": sorted(coord_ids), "lm_head": sorted(coord_ids)}


def test_switching_the_coord_rows_off_or_freezing_the_llm_leaves_them_frozen(tiny_model_dir, coord_ids):
    for tuner in (TunerConfig(**LORA, train_coord_rows=False),
                  TunerConfig(**LORA, freeze_llm=True, freeze_aligner=False)):
        policy = apply_tuner(_load(tiny_model_dir), tuner, coord_ids)
        assert not _tables(policy) and policy.peft_config["default"].trainable_token_indices is None


def test_a_tied_head_shares_one_trainable_table_with_the_embeddings(tied_model_dir, coord_ids):
    policy = apply_tuner(_load(tied_model_dir), TunerConfig(**LORA), coord_ids)
    (table,) = _tables(policy).values()
    with torch.no_grad():
        table.add_(torch.randn(table.shape, generator=torch.Generator().manual_seed(0)))
    embedding, head = policy.get_input_embeddings(), policy.get_output_embeddings()
    ids = torch.as_tensor(coord_ids)
    assert torch.equal(embedding.weight[ids], table) and torch.equal(head.weight[ids], table)
    merged = policy.merge_and_unload()
    assert embeddings_tied(merged) and torch.equal(merged.get_output_embeddings().weight[ids], table)


@pytest.mark.parametrize("tie_flag", [None, True])
def test_a_fresh_adapter_with_coord_rows_is_a_no_op(tiny_model_dir, coord_ids, tie_flag):
    """With tie_flag True, config.json claims tied weights that are saved untied (transformers loads them
    untied): PEFT would tie on the flag and give lm_head the embedding's rows."""
    overrides = {} if tie_flag is None else {"tie_word_embeddings": tie_flag}
    base = _load(tiny_model_dir, **overrides)
    assert not embeddings_tied(base)
    ids = torch.tensor([[coord_ids[3], 11, coord_ids[900], 42, 7]])
    expected = _logits(base, ids)
    policy = apply_tuner(_load(tiny_model_dir, **overrides), TunerConfig(**LORA), coord_ids)
    assert len(_tables(policy)) == 2
    torch.testing.assert_close(_logits(policy, ids), expected, rtol=0, atol=0)


def test_modules_to_save_keeps_its_layer_and_the_other_still_gets_coord_rows(tiny_model_dir, coord_ids):
    policy = apply_tuner(_load(tiny_model_dir), TunerConfig(**LORA, modules_to_save=["lm_head"]), coord_ids)
    assert policy.peft_config["default"].trainable_token_indices == {
        "model.language_model.embed_tokens": sorted(coord_ids)}
    assert any(".modules_to_save." in n and "lm_head" in n for n, p in policy.named_parameters() if p.requires_grad)


def test_a_separate_head_rate_on_a_tied_checkpoint_is_refused(tied_model_dir, coord_ids):
    with pytest.raises(TunerError, match="ties lm_head to the input embeddings") as info:
        apply_tuner(_load(tied_model_dir), TunerConfig(**LORA, coord_embed_lr=1e-4, coord_head_lr=2e-4), coord_ids)
    assert "coord_head_lr" in info.value.hint
    apply_tuner(_load(tied_model_dir), TunerConfig(**LORA, coord_embed_lr=1e-4, coord_head_lr=1e-4), coord_ids)


def test_coord_ids_outside_the_embeddings_are_refused(tiny_model_dir):
    model = _load(tiny_model_dir)
    rows = model.get_input_embeddings().weight.shape[0]
    with pytest.raises(TunerError, match="outside the input embeddings"):
        apply_tuner(model, TunerConfig(**LORA), range(rows - 500, rows + 500))


@pytest.mark.parametrize("tie_flag", [False, True])
def test_export_merged_writes_each_tables_rows_even_under_a_misstated_tie_flag(tmp_path, tiny_model_dir, coord_ids,
                                                                              tie_flag):
    """config.json claiming tied weights that are saved untied: the merged head must get the head's own rows."""
    import json
    import shutil

    from typer.testing import CliRunner

    from coordexp.cli.app import app

    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": tie_flag}))
    policy = apply_tuner(_load(base), TunerConfig(**LORA), coord_ids)
    generator = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for parameter in _tables(policy).values():
            parameter.add_(torch.randn(parameter.shape, generator=generator))
    tables = {n.split(".token_adapter.")[0].removeprefix("base_model.model."): t.detach()
              for n, t in _tables(policy).items()}
    policy.save_pretrained(str(tmp_path / "adapter"))
    result = CliRunner().invoke(app, ["export-merged", str(tmp_path / "adapter"), str(tmp_path / "merged")])
    assert result.exit_code == 0, result.output
    merged = _load(tmp_path / "merged")
    ids = torch.as_tensor(coord_ids)
    assert not embeddings_tied(merged)
    assert torch.equal(merged.get_input_embeddings().weight[ids], tables["model.language_model.embed_tokens"])
    assert torch.equal(merged.get_output_embeddings().weight[ids], tables["lm_head"])


def test_training_on_from_an_adapter_saved_without_coord_rows_says_they_stay_frozen(tmp_path, tiny_model_dir,
                                                                                  coord_ids, write_yaml, caplog):
    from coordexp.runtime.model.policy import load_policy
    from coordexp.schema.contract import load_contract
    from testkit import REPO

    for rows in (False, True):
        policy = apply_tuner(_load(tiny_model_dir), TunerConfig(**LORA, train_coord_rows=rows), coord_ids)
        policy.save_pretrained(str(tmp_path / f"rows_{rows}"))
    run = load_contract(write_yaml({
        "extends": str(REPO / "examples" / "stage2_cpu_hf.yaml"),
        "model": {"path": str(tiny_model_dir), "dtype": "float32", "attn_implementation": "sdpa"},
        "data": {"train_jsonl": str(tmp_path / "unused.jsonl")}, "training": {"output_dir": str(tmp_path / "run")},
        "tuner": LORA}))
    for rows in (False, True):
        caplog.clear()
        with caplog.at_level("WARNING", logger="coordexp.tuner"):
            model, _ = load_policy(run, adapter=tmp_path / f"rows_{rows}")
        warned = [r.getMessage() for r in caplog.records if "without trained coord rows" in r.getMessage()]
        assert len(warned) == (0 if rows else 1) and bool(_tables(model)) is rows


# -- optimizer groups ------------------------------------------------------------------------------------------

def _training(**kw):
    from coordexp.schema.training import TrainingConfig

    return TrainingConfig(output_dir="/tmp/unused", learning_rate=1e-3, weight_decay=0.1, **kw)


@pytest.mark.parametrize("tied", [False, True])
def test_coord_rows_get_their_own_optimizer_groups_and_rates(tiny_model_dir, tied_model_dir, coord_ids, tied):
    from coordexp.runtime.train.optim import describe_groups, parameter_groups

    tuner = TunerConfig(**LORA, coord_embed_lr=3e-2, coord_head_lr=None if tied else 5e-3, coord_weight_decay=0.0)
    policy = apply_tuner(_load(tied_model_dir if tied else tiny_model_dir), tuner, coord_ids)
    names = {id(p): n for n, p in policy.named_parameters()}
    decay = [n for n in names.values() if "norm" not in n and not n.endswith("bias")]
    groups = parameter_groups(policy, _training(), decay, tuner)
    coord = {g["part"]: g for g in groups if g["part"].startswith("coord_")}
    if tied:
        assert set(coord) == {"coord_tied"} and coord["coord_tied"]["lr"] == 3e-2
    else:
        assert {k: g["lr"] for k, g in coord.items()} == {"coord_embed": 3e-2, "coord_head": 5e-3}
        assert "embed_tokens" in names[id(coord["coord_embed"]["params"][0])]
        assert "lm_head" in names[id(coord["coord_head"]["params"][0])]
    assert all(g["weight_decay"] == 0.0 and len(g["params"]) == 1 for g in coord.values())
    llm = [p for g in groups if g["part"] == "llm" for p in g["params"]]
    assert llm and not any(".trainable_tokens_delta." in names[id(p)] for p in llm)
    grouped = [id(p) for g in groups for p in g["params"]]
    assert sorted(grouped) == sorted(id(p) for p in policy.parameters() if p.requires_grad)  # each once
    lines = describe_groups(groups)
    assert sum(line.startswith("coord_") and "1 tensors, 128,000 params" in line for line in lines) == len(coord)


def test_coord_rates_default_to_the_llm_rates():
    from coordexp.runtime.train.optim import coord_row_rates, describe_coord_rows

    rates = coord_row_rates(_training(), TunerConfig(**LORA))
    assert {(r.lr, r.weight_decay) for r in rates.values()} == {(1e-3, 0.1)}
    assert coord_row_rates(_training(), TunerConfig(**LORA, train_coord_rows=False)) == {}
    assert coord_row_rates(_training(), TunerConfig()) == {}
    line = describe_coord_rows(_training(), TunerConfig(**LORA, coord_head_lr=2e-3))
    assert "embeddings lr 0.001" in line and "lm_head lr 0.002" in line and "weight_decay 0.1" in line


def test_preflight_lists_the_coord_row_groups(tiny_model_dir):
    from types import SimpleNamespace

    from coordexp.runtime.train.preflight import optimizer_groups_detail

    def detail(**tuner):
        run = SimpleNamespace(training=_training(), tuner=TunerConfig(**tuner), model=SimpleNamespace(
            path=str(tiny_model_dir)))
        return optimizer_groups_detail(run)

    line = detail(**LORA, coord_embed_lr=5e-3, coord_weight_decay=0.0)
    assert "coord rows: embeddings lr 0.005, lm_head lr 0.001 (tied: one table at 0.005), weight_decay 0" in line
    assert "coord rows" not in detail(**LORA, train_coord_rows=False) and "coord rows" not in detail()


# -- weight export ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True])
def test_full_weight_export_carries_the_trained_coord_rows(tiny_model_dir, tied_model_dir, coord_ids, tied):
    from coordexp.runtime.rollout.weight_export import named_tensors

    model_dir = tied_model_dir if tied else tiny_model_dir
    policy = apply_tuner(_load(model_dir), TunerConfig(**LORA), coord_ids)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if ".lora_" in name or ".trainable_tokens_delta." in name:
                parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    exported = dict(named_tensors(policy))

    plain_names = {n for n, _ in _load(model_dir).named_parameters()}
    assert set(exported) == plain_names  # HF names, no adapter tensors
    ids = torch.as_tensor(coord_ids)
    tables = {n.split(".token_adapter.")[0].removeprefix("base_model.model."): t for n, t in _tables(policy).items()}
    embed = exported["model.language_model.embed_tokens.weight"]
    assert torch.equal(embed[ids], tables["model.language_model.embed_tokens"])
    if not tied:
        assert torch.equal(exported["lm_head.weight"][ids], tables["lm_head"])
    for name, parameter in policy.named_parameters():  # the live policy is only read
        assert torch.equal(parameter.detach(), before[name]), name
    reference = apply_tuner(_load(model_dir), TunerConfig(**LORA), coord_ids)
    reference.load_state_dict(policy.state_dict())
    merged = dict(reference.merge_and_unload().named_parameters())
    assert set(merged) == set(exported)
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, merged[name], rtol=1e-6, atol=1e-6, msg=name)


def test_adapter_sync_refuses_trained_coord_rows_so_it_falls_back_to_full(tiny_model_dir, coord_ids):
    from coordexp.runtime.rollout.weight_export import adapter_state
    from coordexp.runtime.rollout.weight_sync import WeightSyncError

    with pytest.raises(WeightSyncError, match="coord rows") as info:
        adapter_state(apply_tuner(_load(tiny_model_dir), TunerConfig(**LORA), coord_ids))
    assert "sync.mode: full" in info.value.hint and "train_coord_rows: false" in info.value.hint
    state = adapter_state(apply_tuner(_load(tiny_model_dir), TunerConfig(**LORA, train_coord_rows=False), coord_ids))
    assert state.tensors and not any("trainable_tokens" in n for n, _ in state.tensors)
