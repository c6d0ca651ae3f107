"""``tuner.*`` on real tiny Qwen2-VL and Qwen3-VL models: freeze switches pick the trainable parameters by part,
LoRA targets resolve like ms-swift (all-linear over unfrozen parts without lm_head, suffixes, target_regex), and
names that match nothing fail at load time naming real modules."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordexp.errors import UserInputError
from coordexp.runtime.model.parts import model_part
from coordexp.runtime.model.tuner import TunerError, apply_tuner, resolve_targets
from coordexp.schema.tuner import TunerConfig

pytest.importorskip("peft", reason="needs peft (pip install peft)")


@pytest.fixture(scope="module")
def models(tiny_model_dir, qwen3_model_dir):
    """Loader of a fresh float32 tiny model per family (apply_tuner mutates what it gets)."""
    from transformers import AutoModelForImageTextToText

    dirs = {"qwen2_vl": tiny_model_dir, "qwen3_vl": qwen3_model_dir}
    return lambda family: AutoModelForImageTextToText.from_pretrained(str(dirs[family]), dtype=torch.float32)


@pytest.fixture(scope="module")
def qwen3(models):
    return models("qwen3_vl")


@pytest.fixture(scope="module")
def qwen2(models):
    return models("qwen2_vl")


def _linear_names(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


FREEZES = st.tuples(st.booleans(), st.booleans(), st.booleans()).filter(lambda t: not all(t))


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
@given(switches=FREEZES)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_full_training_freezes_exactly_the_switched_off_parts(models, family, switches):
    freeze_llm, freeze_vit, freeze_aligner = switches
    model = apply_tuner(models(family), TunerConfig(freeze_llm=freeze_llm, freeze_vit=freeze_vit,
                                                    freeze_aligner=freeze_aligner))
    frozen = {"llm": freeze_llm, "vision": freeze_vit, "aligner": freeze_aligner}
    by_part: dict[str, set[bool]] = {}
    for name, parameter in model.named_parameters():
        by_part.setdefault(model_part(name), set()).add(parameter.requires_grad)
    assert by_part == {part: {not frozen[part]} for part in ("llm", "vision", "aligner")}
    if family == "qwen3_vl":  # the DeepStack mergers follow the aligner switch
        deepstack = [p.requires_grad for n, p in model.named_parameters() if "deepstack_merger_list" in n]
        assert deepstack and set(deepstack) == {not freeze_aligner}


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
@given(switches=FREEZES)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_all_linear_covers_the_unfrozen_parts_and_never_lm_head(models, family, switches):
    model = models(family)
    freeze_llm, freeze_vit, freeze_aligner = switches
    tuner = TunerConfig(train_type="lora", freeze_llm=freeze_llm, freeze_vit=freeze_vit,
                        freeze_aligner=freeze_aligner)
    frozen = {p for p, off in (("llm", freeze_llm), ("vision", freeze_vit), ("aligner", freeze_aligner)) if off}
    expected = sorted(n for n in _linear_names(model) if model_part(n) not in frozen and n != "lm_head")
    assert resolve_targets(model, tuner) == expected
    policy = apply_tuner(model, tuner)
    adapted = {n.removeprefix("base_model.model.").split(".lora_A.")[0]
               for n, _ in policy.named_parameters() if ".lora_A." in n}
    assert adapted == set(expected)
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)  # LoRA: the base weights are all frozen


def test_default_lora_adapts_only_the_language_model_and_not_lm_head(qwen3):
    targets = resolve_targets(qwen3, TunerConfig(train_type="lora"))
    assert targets and all(n.startswith("model.language_model.layers.") for n in targets)
    assert "lm_head" not in targets
    assert len(targets) == 7 * qwen3.config.text_config.num_hidden_layers  # q k v o gate up down per layer


def test_suffix_targets_stay_inside_unfrozen_parts(qwen3):
    tuner = TunerConfig(train_type="lora", target_modules=["linear_fc1", "q_proj"], freeze_aligner=False)
    targets = resolve_targets(qwen3, tuner)
    # linear_fc1 exists in vision blocks (frozen), the merger and the DeepStack mergers (aligner, unfrozen)
    assert {n for n in targets if n.endswith("linear_fc1")} == {
        "model.visual.merger.linear_fc1", "model.visual.deepstack_merger_list.0.linear_fc1"}
    assert {n for n in targets if n.endswith("q_proj")} == {
        f"model.language_model.layers.{i}.self_attn.q_proj" for i in range(qwen3.config.text_config.num_hidden_layers)}


def test_a_suffix_only_in_frozen_parts_fails_naming_the_part(qwen3):
    with pytest.raises(TunerError, match=r"'qkv' matches only modules of frozen parts \(vision\)") as info:
        resolve_targets(qwen3, TunerConfig(train_type="lora", target_modules=["qkv"]))
    assert "model.visual.blocks.0.attn.qkv" in str(info.value)
    assert isinstance(info.value, UserInputError)


def test_an_unknown_suffix_fails_listing_real_layer_names(qwen2):
    with pytest.raises(TunerError, match="'c_attn' matches no module") as info:
        resolve_targets(qwen2, TunerConfig(train_type="lora", target_modules=["c_attn"]))
    assert "q_proj" in str(info.value)


def _upstream_regex(llm_layers: str, deepstack: str) -> str:
    """The upstream Qwen3-VL regex (merger, DeepStack mergers 0-2, LLM layers 28-35) with the tiny model's indices."""
    return (r"^(model\.visual\.merger\.(linear_fc1|linear_fc2)"
            rf"|model\.visual\.deepstack_merger_list\.({deepstack})\.(linear_fc1|linear_fc2)"
            rf"|model\.language_model\.layers\.({llm_layers})\.(self_attn\.(q_proj|k_proj|v_proj|o_proj)"
            r"|mlp\.(gate_proj|up_proj|down_proj)))$")


def test_upstream_target_regex_adapts_merger_deepstack_and_the_last_llm_layer(qwen3):
    from transformers import AutoModelForImageTextToText

    last = qwen3.config.text_config.num_hidden_layers - 1
    regex = _upstream_regex(str(last), "0")
    model = AutoModelForImageTextToText.from_pretrained(qwen3.config._name_or_path, dtype=torch.float32)
    # the regex overrides the freeze switches' choice of targets: the aligner is frozen by default, yet adapted
    tuner = TunerConfig(train_type="lora", use_dora=True, target_regex=regex)
    assert resolve_targets(model, tuner) == regex
    policy = apply_tuner(model, tuner)
    adapted = {n.removeprefix("base_model.model.").split(".lora_A.")[0]
               for n, _ in policy.named_parameters() if ".lora_A." in n}
    assert adapted == {
        "model.visual.merger.linear_fc1", "model.visual.merger.linear_fc2",
        "model.visual.deepstack_merger_list.0.linear_fc1", "model.visual.deepstack_merger_list.0.linear_fc2",
        *(f"model.language_model.layers.{last}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
        *(f"model.language_model.layers.{last}.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")),
    }
    assert policy.peft_config["default"].use_dora
    assert any("lora_magnitude_vector" in n for n, p in policy.named_parameters() if p.requires_grad)


@given(suffix=st.text(alphabet="xyz_", min_size=1, max_size=8))
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_regex_matching_nothing_fails_naming_the_pattern_and_real_modules(qwen3, suffix):
    regex = rf"model\.language_model\.layers\.0\.self_attn\.q_proj{suffix}"
    with pytest.raises(TunerError) as info:
        resolve_targets(qwen3, TunerConfig(train_type="lora", target_regex=regex))
    message = str(info.value)
    assert repr(regex) in message and "re.fullmatch" in message
    assert "model.visual.blocks.0.attn.qkv" in message  # real names to copy from


def test_regex_is_a_fullmatch_not_a_search(qwen3):
    """``q_proj`` alone finds nothing: PEFT fullmatches the whole module name."""
    with pytest.raises(TunerError):
        resolve_targets(qwen3, TunerConfig(train_type="lora", target_regex="q_proj"))
    assert resolve_targets(qwen3, TunerConfig(train_type="lora", target_regex=r".*\.q_proj")) == r".*\.q_proj"


def test_deepstack_mergers_are_saved_one_by_one_and_a_module_list_is_refused(models):
    with pytest.raises(TunerError, match="ModuleList") as info:
        apply_tuner(models("qwen3_vl"), TunerConfig(train_type="lora",
                                                    modules_to_save=["model.visual.deepstack_merger_list"]))
    assert "model.visual.deepstack_merger_list.0" in info.value.hint
    policy = apply_tuner(models("qwen3_vl"), TunerConfig(
        train_type="lora", modules_to_save=["model.visual.merger", "model.visual.deepstack_merger_list.0"]))
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    for root in ("model.visual.merger", "model.visual.deepstack_merger_list.0"):
        assert any(n.startswith(f"base_model.model.{root}.modules_to_save.default.") for n in trainable), root
    # a module trained in full gets no adapter inside it, even under all-linear with the aligner unfrozen
    assert not any(".lora_" in n and "visual.merger" in n for n in trainable)


def test_modules_to_save_that_names_nothing_fails(qwen2):
    from coordexp.runtime.model.tuner import resolve_modules_to_save

    with pytest.raises(TunerError, match="'model.visual.deepstack_merger_list.0' names no module"):
        resolve_modules_to_save(qwen2, TunerConfig(train_type="lora",
                                                   modules_to_save=["model.visual.deepstack_merger_list.0"]))


def test_all_parts_frozen_under_lora_fails_clearly(qwen2):
    tuner = TunerConfig(train_type="lora", freeze_llm=True, freeze_vit=True, freeze_aligner=True)
    with pytest.raises(TunerError, match="all-linear selects no Linear layer"):
        resolve_targets(qwen2, tuner)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_load_policy_applies_the_tuner_and_a_lora_step_changes_only_the_adapter(tmp_path, tiny_model_dir,
                                                                                 write_yaml, checkpointing):
    from coordexp.runtime.model.policy import load_policy
    from coordexp.schema.contract import load_contract

    config = {"extends": str(_repo() / "examples" / "stage2_cpu_hf.yaml"),
              "model": {"path": str(tiny_model_dir), "dtype": "float32", "attn_implementation": "sdpa",
                        "gradient_checkpointing": checkpointing},
              "data": {"train_jsonl": str(tmp_path / "unused.jsonl")},
              "training": {"output_dir": str(tmp_path / "run")},
              "tuner": {"train_type": "lora", "use_dora": True, "lora_rank": 2}}
    run = load_contract(write_yaml(config))
    model, _ = load_policy(run)
    assert model.peft_config["default"].use_dora and model.peft_config["default"].r == 2
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    adapter = (".lora_", ".trainable_tokens_delta.")  # LoRA tensors and the coord rows (tuner.train_coord_rows)
    grads = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert grads and all(any(a in n for a in adapter) for n in grads)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.grad is not None:
                p.sub_(0.1 * p.grad)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(any(a in n for a in adapter) for n in changed)


def test_saved_adapter_config_records_dora_and_the_resolved_targets(tmp_path, qwen2):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(qwen2.config._name_or_path, dtype=torch.float32)
    policy = apply_tuner(model, TunerConfig(train_type="lora", use_dora=True, target_modules=["q_proj", "v_proj"]))
    policy.save_pretrained(str(tmp_path / "adapter"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["use_dora"] is True and config["peft_type"] == "LORA"
    assert sorted(config["target_modules"]) == sorted(
        f"model.language_model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj"))
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


def _repo():
    from testkit import REPO

    return REPO
