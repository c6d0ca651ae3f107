"""``coordexp migrate`` on upstream CoordExp's later layout (its configs since March 2026): the two-channel stage 2
(``stage2_two_channel``, ``stage2_ab.pipeline``), artifact roots (``output_root`` + ``artifact_subdir``), the
stage-1 coord-loss keys it added, and trainers coordexp does not have. Shapes from upstream's
``configs/stage2_two_channel/lvis_bbox_max60_1024.yaml`` and ``configs/stage1/lvis_bbox_max60_1024.yaml`` chains."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from coordexp.cli.app import app
from coordexp.schema.migrate_chain import migrate_chain

runner = CliRunner()

BASE = {
    "model": {"torch_dtype": "bfloat16", "attn_impl": "sdpa"},
    "template": {"template": "qwen3_vl", "truncation_strategy": "raise"},
    "data": {"dataset": ["dummy"], "val_dataset": ["dummy"]},
    "custom": {"json_format": "standard", "emit_norm": "none", "object_field_order": "desc_first"},
    "training": {"output_root": "./output", "logging_root": "./tb", "add_version": True, "bf16": True,
                 "learning_rate": 2e-5, "per_device_train_batch_size": 1, "save_steps": 200},
}
PIPELINE = {
    "objective": [
        {"name": "token_ce", "enabled": True, "weight": 1.0, "channels": ["A", "B"],
         "application": {"preset": "anchor_text_only"},
         "config": {"desc_ce_weight": 1.5, "rollout_fn_desc_weight": 1.0,
                    "rollout_global_prefix_struct_ce_weight": 1.0}},
        {"name": "loss_duplicate_burst_unlikelihood", "enabled": True, "weight": 1.0, "channels": ["B"],
         "application": {"preset": "rollout_only"}, "config": {}},
        {"name": "bbox_geo", "enabled": True, "weight": 1.0, "channels": ["A", "B"],
         "application": {"preset": "anchor_only"}, "config": {"smoothl1_weight": 0.0, "ciou_weight": 1.0}},
        {"name": "bbox_size_aux", "enabled": True, "weight": 1.0, "channels": ["A", "B"],
         "config": {"log_wh_weight": 0.05}},
        {"name": "coord_reg", "enabled": True, "weight": 1.0, "channels": ["A", "B"],
         "application": {"preset": "anchor_only"},
         "config": {"coord_ce_weight": 1.0, "coord_gate_weight": 5.0, "text_gate_weight": 0.0, "soft_ce_weight": 1.0,
                    "w1_weight": 1.0, "temperature": 0.9, "target_sigma": 1.5, "target_truncate": 8,
                    "adjacent_repulsion_weight": 0.0, "adjacent_repulsion_filter_mode": "same_desc",
                    "adjacent_repulsion_margin_ratio": 0.05, "adjacent_repulsion_copy_margin": 0.8}},
    ],
    "diagnostics": [],
}
STAGE2 = {
    "extends": "../base.yaml",
    "global_max_length": 14000,
    "model": {"model": "output/stage1/ckpt-232-merged"},
    "custom": {"trainer_variant": "stage2_two_channel", "train_jsonl": "public_data/lvis/train.coord.jsonl"},
    "stage2_ab": {"schedule": {"b_ratio": 0.05}, "pipeline": PIPELINE,
                  "channel_b": {"insertion_order": "tail_append"}},
    "rollout_matching": {"rollout_backend": "hf", "channel_b_decode_batch_size": 4, "max_new_tokens": 3084},
    "training": {"artifact_subdir": "stage2_ab/lvis_bbox_max60_1024", "effective_batch_size": 8,
                 "gradient_accumulation_steps": 2, "metric_for_best_model": "rollout/f1",
                 "greater_is_better": True, "save_strategy": "best"},
}
STAGE1 = {
    "extends": "../base.yaml",
    "global_max_length": 4096,
    "model": {"model": "model_cache/Qwen3-VL-2B-Instruct-coordexp"},
    "custom": {"train_jsonl": "public_data/lvis/train.coord.jsonl",
               "coord_soft_ce_w1": {"enabled": True, "soft_ce_weight": 1.0, "w1_weight": 1.0, "gate_weight": 1.0,
                                    "text_gate_weight": 0.2, "adjacent_repulsion_weight": 0.0,
                                    "adjacent_repulsion_filter_mode": "same_desc"},
               "bbox_geo": {"enabled": True, "smoothl1_weight": 0.01, "ciou_weight": 1.0},
               "bbox_size_aux": {"enabled": True, "log_wh_weight": 0.05}},
    "training": {"artifact_subdir": "stage1/lvis_bbox_max60_1024"},
}


def _write(root: Path, leaf: dict, name: str) -> Path:
    (root / "configs" / "stage").mkdir(parents=True, exist_ok=True)
    (root / "configs" / "base.yaml").write_text(yaml.safe_dump(BASE, sort_keys=False))
    path = root / "configs" / "stage" / name
    path.write_text(yaml.safe_dump(leaf, sort_keys=False))
    return path


def _migrate(root: Path, leaf: dict, name: str = "leaf.yaml") -> tuple[str, Path]:
    out = root / f"migrated_{name}"
    result = runner.invoke(app, ["migrate", str(_write(root, leaf, name)), "-o", str(out), "--base-dir", str(root)],
                           catch_exceptions=False)
    return " ".join(result.output.split()), out


def _contract(out: Path) -> dict:
    result = runner.invoke(app, ["validate", str(out), "--print-contract", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)[0]["contract"]


def test_a_two_channel_stage2_becomes_rollout_matching_with_ground_truth_steps_and_its_pipeline(tmp_path):
    text, out = _migrate(tmp_path, STAGE2)
    contract = _contract(out)
    rm, training = contract["rollout_matching"], contract["training"]
    assert contract["trainer_variant"] == "stage2_rollout_aligned"
    assert rm["gt_step_share"] == 0.95 and rm["decode_batch_size"] == 4  # channel A on 1 - b_ratio of the steps
    modules = {m["name"]: m for m in rm["pipeline"]["objective"]}
    assert list(modules) == ["token_ce", "bbox_geo", "coord_reg"]
    assert modules["token_ce"]["config"] == {"rollout_fn_desc_weight": 1.0, "rollout_matched_prefix_struct_weight": 1.0}
    assert modules["bbox_geo"]["config"] == {"smoothl1_weight": 0.0, "ciou_weight": 1.0}
    assert modules["coord_reg"]["config"] == {
        "coord_ce_weight": 1.0, "coord_gate_weight": 5.0, "text_gate_weight": 0.0, "soft_ce_weight": 1.0,
        "w1_weight": 1.0, "temperature": 0.9, "target_sigma": 1.5, "target_truncate": 8.0}
    assert all(m["channels"] == ["A", "B"] and m["weight"] == 1.0 for m in modules.values())
    # upstream's loader joined the roots and the subdirectory, relative to the launch directory
    assert training["output_dir"] == str(tmp_path / "output" / "stage2_ab" / "lvis_bbox_max60_1024")
    assert training["logging_dir"] == str(tmp_path / "tb" / "stage2_ab" / "lvis_bbox_max60_1024")
    # effective_batch_size decided the accumulation steps upstream, and does here
    assert training["effective_batch_size"] == 8 and "removed training.gradient_accumulation_steps: 2" in text
    assert training["save_strategy"] == "steps" and "left out training.save_strategy:" in text
    # what coordexp does not have is named, module by module, never dropped silently
    for said in ("left out stage2_ab.pipeline.objective[1] (loss_duplicate_burst_unlikelihood)",
                 "left out stage2_ab.pipeline.objective[3] (bbox_size_aux): no box-size auxiliary loss",
                 "left out stage2_ab.pipeline.objective[0].config.desc_ce_weight", "(value was 1.5)",
                 "left out stage2_ab.pipeline.objective[0].application: coordexp has no routing presets",
                 "adjacent_repulsion_weight 0: the term was off", "left out stage2_ab.channel_b",
                 "stage2_ab.schedule.b_ratio: 0.05 -> rollout_matching.gt_step_share: 0.95"):
        assert said in text, said


def test_a_stage1_with_the_added_coord_keys_and_artifact_roots_validates(tmp_path):
    text, out = _migrate(tmp_path, STAGE1)
    contract = _contract(out)
    assert contract["trainer_variant"] == "stage1_sft"
    modules = {m["name"]: m for m in contract["rollout_matching"]["pipeline"]["objective"]}
    assert modules["coord_reg"]["config"]["text_gate_weight"] == 0.2
    # stage 1's box terms are the pipeline's bbox_geo module, which stage 1 trains too
    assert modules["bbox_geo"]["config"] == {"smoothl1_weight": 0.01, "ciou_weight": 1.0}
    assert modules["bbox_geo"]["enabled"] and modules["bbox_geo"]["channels"] == ["B"]
    assert "left out custom.bbox_size_aux: no box-size auxiliary loss" in text
    assert contract["training"]["output_dir"] == str(tmp_path / "output" / "stage1" / "lvis_bbox_max60_1024")
    assert "the term was off" in text
    on = copy.deepcopy(STAGE1)
    on["custom"]["coord_soft_ce_w1"]["adjacent_repulsion_weight"] = 0.3  # a term that trained: the user decides
    on["custom"]["bbox_geo"]["parameterization"] = "center_size"  # another loss space: the user decides
    text, out = _migrate(tmp_path, on, "on.yaml")
    assert "left out custom.coord_soft_ce_w1.adjacent_repulsion_weight: no adjacent-repulsion" in text
    assert "(value was 0.3)" in text and "left out custom.bbox_geo: the box terms compare x1, y1, x2, y2" in text
    assert "bbox_geo" not in {m["name"] for m in _contract(out)["rollout_matching"]["pipeline"]["objective"]}
    off = copy.deepcopy(STAGE1)
    off["custom"]["bbox_geo"]["enabled"] = False
    text, out = _migrate(tmp_path, off, "off.yaml")
    assert "removed custom.bbox_geo" in text and "the box terms were off" in text
    assert "bbox_geo" not in {m["name"] for m in _contract(out)["rollout_matching"]["pipeline"]["objective"]}


@pytest.mark.parametrize("variant, said", [
    ("stage1_set_continuation", "upstream's set-continuation stage 1"),
    ("gkd_monitor", "upstream's GKD trainer"),
])
def test_a_trainer_coordexp_lacks_is_named_with_what_it_has_instead(tmp_path, variant, said):
    leaf = copy.deepcopy(STAGE1)
    leaf["custom"]["trainer_variant"] = variant
    result = runner.invoke(app, ["migrate", str(_write(tmp_path, leaf, "sc.yaml")), "-o", str(tmp_path / "o.yaml"),
                                 "--base-dir", str(tmp_path)], catch_exceptions=False)
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert f"custom.trainer_variant: {variant}: {said}" in text and "custom.trainer_variant: stage1_sft" in text


_UPSTREAM_KEYS = {
    "token_ce": ["desc_ce_weight", "rollout_fn_desc_weight", "rollout_global_prefix_struct_ce_weight"],
    "coord_reg": ["coord_ce_weight", "coord_gate_weight", "text_gate_weight", "soft_ce_weight", "w1_weight",
                  "temperature", "target_sigma", "target_truncate", "adjacent_repulsion_weight",
                  "adjacent_repulsion_margin_ratio"],
    "bbox_geo": ["smoothl1_weight", "ciou_weight", "parameterization", "center_weight"],
    "bbox_size_aux": ["log_wh_weight"],
    "loss_duplicate_burst_unlikelihood": [],
}
_VALUES = {"parameterization": st.sampled_from(["xyxy", "center_size"]), "target_truncate": st.sampled_from([None, 8])}


@st.composite
def _pipelines(draw) -> list[dict]:
    names = draw(st.lists(st.sampled_from(sorted(_UPSTREAM_KEYS)), min_size=1, max_size=5, unique=True))
    modules = []
    for name in names:
        keys = draw(st.lists(st.sampled_from(_UPSTREAM_KEYS[name]), unique=True)) if _UPSTREAM_KEYS[name] else []
        config = {k: draw(_VALUES.get(k, st.sampled_from([0.0, 0.5, 1.0, 1.5]))) for k in keys}
        module = {"name": name, "enabled": draw(st.booleans()), "weight": draw(st.sampled_from([0.5, 1.0])),
                  "channels": draw(st.sampled_from([["A"], ["B"], ["A", "B"]])), "config": config}
        if draw(st.booleans()):
            module["application"] = {"preset": "anchor_only"}
        modules.append(module)
    return modules


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_pipelines())
def test_every_key_of_an_upstream_pipeline_is_moved_or_named(tmp_path, objective):
    """Whatever upstream's pipeline holds, each module and each config key is either in the migrated pipeline with
    its value or named in the report: nothing disappears silently."""
    leaf = copy.deepcopy(STAGE2)
    leaf["stage2_ab"]["pipeline"] = {"objective": objective, "diagnostics": []}
    path = _write(tmp_path, leaf, "h.yaml")
    result = migrate_chain(path, output=tmp_path / "h_out.yaml", base_dir=tmp_path)
    migration = result.files[-1].migration
    report = " ".join(migration.changes + migration.left_out + migration.unresolved)
    written = yaml.safe_load((tmp_path / "h_out.yaml").read_text())
    moved = (written.get("rollout_matching") or {}).get("pipeline", {}).get("objective", [])
    kept = {m["name"]: m for m in moved}
    renamed = {"rollout_global_prefix_struct_ce_weight": "rollout_matched_prefix_struct_weight"}
    for index, module in enumerate(objective):
        where = f"stage2_ab.pipeline.objective[{index}]"
        if module["name"] not in kept:
            assert f"{where} ({module['name']})" in report
            continue
        out = kept[module["name"]]
        assert [out[k] for k in ("enabled", "weight", "channels")] == [module[k] for k in ("enabled", "weight",
                                                                                           "channels")]
        if "application" in module:
            assert f"{where}.application" in report
        if module["channels"] != ["A", "B"]:  # coordexp has no per-channel module: said
            assert f"{where}.channels: upstream ran it on channel {module['channels'][0]} alone" in report
        for key, value in module["config"].items():
            if out["config"].get(renamed.get(key, key), object()) == value:
                continue
            assert f"{where}.config.{key}" in report or (key.startswith("adjacent") and "the term was off" in report)


@pytest.mark.parametrize("extends", [False, True])
def test_a_config_of_another_upstream_tool_is_refused_whole(tmp_path, extends):
    """Upstream's evaluation, inference and analysis configs are not training configs: one refusal naming what
    they are not and where to go, not one unknown key per line; nothing is written."""
    evaluation = {"pred_jsonl": "path/to/gt_vs_pred_scored.jsonl", "out_dir": "eval_out", "metrics": "f1ish",
                  "use_segm": True, "overlay": False}
    if extends:
        (tmp_path / "eval_base.yaml").write_text(yaml.safe_dump({"num_workers": 0}))
        evaluation["extends"] = "eval_base.yaml"
    path = tmp_path / "detection.yaml"
    path.write_text(yaml.safe_dump(evaluation, sort_keys=False))
    before = path.read_bytes()
    result = runner.invoke(app, ["migrate", str(path), "-o", str(tmp_path / "out.yaml")], catch_exceptions=False)
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "is not a training config" in text and "coordexp eval" in text
    assert all(key in text for key in ("metrics", "out_dir", "pred_jsonl"))
    assert "unknown key" not in text and not (tmp_path / "out.yaml").exists() and path.read_bytes() == before


_ANY = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=True) | st.text(max_size=6),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                  max_size=3), max_leaves=8)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(["name", "enabled", "weight", "channels", "config", "application"]), _ANY)
       | _ANY, st.booleans(), st.sampled_from(["objective", "diagnostics"]), _ANY)
def test_a_hostile_upstream_pipeline_or_artifact_root_is_reported_never_a_crash(tmp_path, entry, known, part, root):
    """Whatever a hand-edited file holds where upstream's pipeline entries, artifact roots or coord-loss keys go,
    migrate answers with a report (exit 0 or 2), never a traceback (exit 1)."""
    if isinstance(entry, dict) and known:  # a module coordexp has: its config and keys are walked too
        entry["name"] = "coord_reg"
    leaf = copy.deepcopy(STAGE2)
    leaf["stage2_ab"]["pipeline"] = {part: [entry]}
    leaf["training"]["artifact_subdir"] = root
    leaf["custom"]["coord_soft_ce_w1"] = {"adjacent_repulsion_weight": root, "text_gate_weight": 0.1}
    leaf["custom"]["bbox_geo"] = {"enabled": known, "smoothl1_weight": root, "parameterization": entry}
    path = _write(tmp_path, {}, "hostile.yaml")
    path.write_text(json.dumps(leaf))  # JSON is YAML, and keeps NaN and odd keys as they are
    result = runner.invoke(app, ["migrate", str(path), "-o", str(tmp_path / "hostile_out.yaml"),
                                 "--base-dir", str(tmp_path)])
    assert result.exit_code in (0, 2), result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)


def test_upstream_metric_names_backends_and_box_formats_map_or_say_why(tmp_path):
    """Upstream's evaluation AP keeps choosing the best checkpoint (as coordexp's AP); an evaluation backend equal
    to the training one is redundant; a box format other than x1, y1, x2, y2 is left out saying what it breaks."""
    leaf = copy.deepcopy(STAGE2)
    leaf["training"].update(metric_for_best_model="detection/mAP", save_strategy="steps")
    leaf["rollout_matching"]["eval_rollout_backend"] = "hf"
    leaf["custom"]["bbox_format"] = "xyxy"
    text, out = _migrate(tmp_path, leaf)
    training = _contract(out)["training"]
    assert (training["metric_for_best_model"], training["greater_is_better"]) == ("AP", True)
    assert "training.metric_for_best_model: detection/mAP -> AP" in text
    assert "removed rollout_matching.eval_rollout_backend: 'hf'" in text and "removed custom.bbox_format" in text
    leaf["custom"]["bbox_format"] = "cxcywh"
    leaf["rollout_matching"]["eval_rollout_backend"] = "vllm"
    text, _ = _migrate(tmp_path, leaf, "other.yaml")
    assert "left out custom.bbox_format: coordexp's boxes are x1, y1, x2, y2" in text
    assert "left out rollout_matching.eval_rollout_backend: one backend" in text


def test_in_place_the_leaf_joins_the_root_its_base_had(tmp_path):
    """--in-place migrates base first: the base's output_root is left out there (coordexp has no root), and the
    leaf that sets artifact_subdir still gets output_dir = root/subdir from the base as it was written."""
    path = _write(tmp_path, STAGE2, "leaf.yaml")
    result = runner.invoke(app, ["migrate", str(path), "--in-place", "--base-dir", str(tmp_path)],
                           catch_exceptions=False)
    assert result.exit_code == 2, result.output  # left-out features, as with -o
    text = " ".join(result.output.split())
    assert "left out training.output_root: coordexp has no output root" in text
    assert "training.output_root + training.artifact_subdir -> training.output_dir" in text
    assert _contract(path)["training"]["output_dir"] == str(tmp_path / "output" / "stage2_ab" /
                                                             "lvis_bbox_max60_1024")
    assert sorted(p.name for p in (tmp_path / "configs").rglob("*.bak")) == ["base.yaml.bak", "leaf.yaml.bak"]
