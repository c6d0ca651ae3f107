"""bench_learning.py's grid arms are a matched comparison: built by the bench's own config builder, the control
(``stage1_continued``) and each stage 2 differ only in the treatment keys (and their output directory); every arm
is evaluated under one config."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_learning_under_test", ROOT / "benchmarks" / "bench_learning.py")
    module = importlib.util.module_from_spec(spec)
    argv, sys.argv = sys.argv, ["bench_learning.py"]
    try:
        spec.loader.exec_module(module)
    finally:
        sys.argv = argv
    return module


def _flat(value: Any, path: str = "") -> dict[str, Any]:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    elif hasattr(value, "model_dump"):
        value = value.model_dump()
    if isinstance(value, (list, tuple)) and value and not isinstance(value[0], (int, float, str)):
        value = dict(enumerate(value))
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flat(item, f"{path}.{key}" if path else str(key)))
        return out
    return {path: value}


def _args(bench, tmp_path: Path, *extra: str) -> argparse.Namespace:
    argv, sys.argv = sys.argv, ["bench_learning.py", "--task", "grid", "--workdir", str(tmp_path), *extra]
    try:
        args = bench._args()
    finally:
        sys.argv = argv
    args.max_new_tokens = 400
    args.sized = [(["rollout_matching", "repeat_terminate", "max_object_keys"], 18)]
    return args


def test_grid_arms_differ_only_in_the_treatment(bench, tmp_path):
    from coordexp.schema.contract import load_contract

    args = _args(bench, tmp_path, "--variant", "hot=rollout_matching.pipeline.objective.0.config.rollout_fn_desc_weight:0")
    for name in ("train.jsonl", "val.jsonl"):
        (tmp_path / name).write_text("")
    model, train, val = tmp_path / "model", tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    continued = {"max_steps": 5, "learning_rate": 2e-5, "lr_scheduler_type": "constant", "warmup_ratio": 0.0,
                 "per_device_train_batch_size": 4}
    plan = bench.continuation_plan(args)
    assert [name for name, _ in plan] == ["stage1_continued", "stage1_gap", "stage2", "stage2_drop", "stage2_recipe",
                                          "hot"]
    runs = {name: load_contract(bench._config(args, tmp_path, name, "demo_stage2.yaml", model, train, val, 3,
                                              continued, overrides))
            for name, overrides in plan}
    control = _flat(runs["stage1_continued"])
    assert runs["stage1_continued"].rollout_matching.gt_step_share == 1.0  # the schema accepts 1.0
    ce = "rollout_matching.pipeline.objective.0.config."
    gap = {f"{where}.gt_prefix_mix.{k}" for k in ("none", "random_subset", "leave_one_out", "all")
           for where in ("data", "rollout_matching")}  # the contract carries data's key where targets are built
    treatments = {"stage1_gap": gap,  # the second control: the control's steps, gap-augmented ground truth
                  # the spec as written: every step rolls out, the tail is kept, both recipe CE weights at 0
                  "stage2": {"rollout_matching.gt_step_share", "rollout_matching.trailing_unmatched",
                             ce + "rollout_fn_desc_weight", ce + "rollout_matched_prefix_struct_weight"},
                  "stage2_drop": {"rollout_matching.gt_step_share"},  # drop is the recipe's own trailing setting
                  "stage2_recipe": {"rollout_matching.gt_step_share"},
                  "hot": {"rollout_matching.gt_step_share", "rollout_matching.pipeline.objective.0.config.rollout_fn_desc_weight"}}
    for name, keys in treatments.items():
        other = _flat(runs[name])
        differ = {k for k in control.keys() | other.keys() if control.get(k) != other.get(k)}
        assert differ - {"training.output_dir"} == keys, name
    assert runs["stage2"].rollout_matching.gt_step_share == 0.0
    assert runs["stage2"].rollout_matching.trailing_unmatched == "keep"
    assert runs["stage2_drop"].rollout_matching.trailing_unmatched == "drop"
    assert runs["stage1_gap"].rollout_matching.gt_prefix_mix.leave_one_out == 0.2
    assert runs["stage1_continued"].rollout_matching.repeat_terminate.max_object_keys == 18


def test_the_control_never_rolls_out_for_training():
    from coordexp.runtime.train.pipeline import PipelineSettings

    settings = PipelineSettings(seed=0, stage2=True, gt_step_share=1.0)
    assert not any(settings.rolls_out(step) for step in range(500))
    assert all(PipelineSettings(seed=0, stage2=True, gt_step_share=0.0).rolls_out(step) for step in range(50))


def test_one_evaluation_config_for_every_arm(bench, tmp_path, monkeypatch):
    """A --variant changes training only: every arm's checkpoint is evaluated under eval.yaml."""
    args = _args(bench, tmp_path, "--variant", "hot=rollout_matching.pipeline.objective.0.config.rollout_fn_desc_weight:0")
    seen: list[tuple[Path, str]] = []

    def fake_train(config):
        return {"steps": 1, "wall_s": 0.1, "trained_tokens": 1, "final_loss": 0.0}

    def fake_evaluate(a, work, eval_config, name):
        seen.append((eval_config, name))
        report = sys.modules["_learning_report"]  # imported by the bench: every figure it reads of a grid arm
        return {k: 0.5 for k in report.FIGURES + report.GRID_FIGURES}

    monkeypatch.setattr(bench, "_assets", lambda a, w, s: (tmp_path / "m", tmp_path / "t", tmp_path / "v"))
    monkeypatch.setattr(bench, "_size_decoding", lambda a, m: None)
    monkeypatch.setattr(bench, "_train", fake_train)
    monkeypatch.setattr(bench, "_evaluate", fake_evaluate)
    out = bench.run_seed(args, 3)
    assert [n for _, n in seen] == ["stage1", "stage1_continued", "stage1_gap", "stage2", "stage2_drop",
                                    "stage2_recipe", "hot"]
    assert len({c for c, _ in seen}) == 1 and seen[0][0].name == "eval.yaml"
    import yaml

    evaluation = yaml.safe_load(seen[0][0].read_text())
    assert "rollout_fn_desc_weight" not in str(evaluation) and evaluation["extends"].endswith("demo_stage2.yaml")
    assert "gate" in out and out["gate"]["passed"] is False  # exposure gap 0.5 passes, cell precision 0.5 does not


@pytest.mark.parametrize("cell_precision", [0.5, 0.9])
def test_stop_at_failed_gate_trains_no_continuation_of_a_failed_seed(bench, tmp_path, monkeypatch, capsys,
                                                                    cell_precision):
    """A seed whose stage 1 fails the gate trains nothing more and is left out of the comparison, named; a seed that
    passes trains every arm."""
    args = _args(bench, tmp_path, "--stop-at-failed-gate")
    trained: list[str] = []

    def fake_evaluate(a, work, eval_config, name):
        trained.append(name)
        report = sys.modules["_learning_report"]
        return {**{k: 0.5 for k in report.FIGURES + report.GRID_FIGURES}, "cell_precision": cell_precision}

    monkeypatch.setattr(bench, "_assets", lambda a, w, s: (tmp_path / "m", tmp_path / "t", tmp_path / "v"))
    monkeypatch.setattr(bench, "_size_decoding", lambda a, m: None)
    monkeypatch.setattr(bench, "_train", lambda c: {"steps": 1, "wall_s": 0.1, "trained_tokens": 1, "final_loss": 0})
    monkeypatch.setattr(bench, "_evaluate", fake_evaluate)
    monkeypatch.setattr(bench, "_data_order", lambda work, names: {"equal": True, "steps": 1, "differ": []})
    out = bench.run_seed(args, 3)
    if cell_precision < 0.8:
        assert trained == ["stage1"] and out["stopped"] == "gate failed" and not out["gate"]["passed"]
        return
    assert "stopped" not in out and out["gate"]["passed"] and len(trained) == 6
    failed = {**out, "seed": 4, "runs": {"stage1": out["runs"]["stage1"]}, "stopped": "gate failed"}
    summary = bench._report([out, failed], bench._printable(args), tmp_path)
    assert summary["stopped_at_gate"] == [4] and "seeds stopped at a failed gate" in capsys.readouterr().out
    assert summary["stage2 - stage1_continued"]["AP50"]["n"] == 1  # the stopped seed is in no comparison
    trained.clear()
    args.variant, args.add_arms = [bench._variant("extra=rollout_matching.repeats:drop")], True
    saved = {"args": bench._printable(args), "seeds": [failed]}
    bench.add_arms(args, saved)  # regression: it trained the arm on a seed the report leaves out
    assert trained == [] and set(failed["runs"]) == {"stage1"} and "no arm added" in capsys.readouterr().out


def test_the_report_recomputes_the_zero_training_bound_from_the_committed_seeds():
    """The dedup figures every arm's evaluation saved become the bound's table: each kind's mean over seeds and its
    paired gain over the raw predictions, recomputed from the committed per-seed JSON (not from a stored summary)."""
    import json
    import statistics

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _learning_report import summarize

    files = [ROOT / "benchmarks" / "results" / f"issue41_screen_seed{s}.json" for s in (111, 112)]
    seeds = [json.loads(f.read_text(encoding="utf-8"))["seeds"][0] for f in files]
    bound = summarize(seeds)["dedup_bound"]
    saved = [s["runs"]["stage2"]["eval"]["dedup"] for s in seeds]
    assert bound["stage2"]["label_free"]["AP50"]["mean"] == pytest.approx(
        statistics.fmean(d["label_free"]["AP50"] for d in saved))
    gain = bound["stage2"]["gain"]["label_free"]["precision"]
    assert gain["n"] == 2 and gain["mean"] == pytest.approx(
        statistics.fmean(d["label_free"]["precision"] - d["raw"]["precision"] for d in saved))
    assert gain["mean"] > 0  # removing certified repeats raised the spec arm's mean precision
    assert set(bound) == set(seeds[0]["runs"])  # every arm saved its dedup figures


def test_a_reward_arm_trains_with_sampling_and_its_own_decoding_overrides_win(bench, tmp_path):
    """``--variant NAME=rollout_matching.objective:reward`` (issue 52) validates as it stands: the arm trains with
    the policy's own distribution (temperature 1, no coordinate-group greedy), the control arm keeps the recipe's
    decoding, and a decoding key the variant sets itself wins."""
    from coordexp.schema.contract import load_contract

    args = _args(bench, tmp_path, "--variant", "reward=rollout_matching.objective:reward",
                 "--variant", "reward_hot=rollout_matching.objective:reward;rollout_matching.decoding.top_k:50")
    for name in ("train.jsonl", "val.jsonl"):
        (tmp_path / name).write_text("")
    model, train, val = tmp_path / "model", tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    plan = dict(bench.continuation_plan(args))

    def contract(name):
        return load_contract(bench._config(args, tmp_path, name, "demo_stage2.yaml", model, train, val, 3,
                                           {"max_steps": 2}, plan[name]))

    reward, control = contract("reward"), contract("stage2_recipe")
    assert reward.rollout_matching.objective == "reward" and control.rollout_matching.objective == "sft"
    assert (reward.rollout_matching.decoding.temperature, reward.rollout_matching.decoding.coord_group_greedy) == (1.0,
                                                                                                                  False)
    assert control.rollout_matching.decoding.coord_group_greedy is True
    with pytest.raises(Exception, match="top_k"):  # the variant's own top_k comes after the sampling defaults
        contract("reward_hot")


def test_dense_and_the_long_control_are_options_of_the_grid_task(bench, tmp_path):
    """Issue 53: --dense picks the dense grid, --long-multiple K adds stage1_long (the control for K x --k steps)."""
    args = _args(bench, tmp_path, "--dense", "--long-multiple", "3", "--k", "50", "--grid-arms", "stage2_recipe")
    assert args.grid == bench.DENSE_GRID
    plan = dict(bench.continuation_plan(args))
    assert list(plan) == ["stage1_continued", "stage1_long", "stage2_recipe"]
    long_keys = dict((tuple(k), v) for k, v in plan["stage1_long"])
    assert long_keys[("training", "max_steps")] == 150 and long_keys[("rollout_matching", "gt_step_share")] == 1.0
    with pytest.raises(SystemExit):
        _args(bench, tmp_path, "--long-multiple", "0.5")


# what may differ between a bench arm and `coordexp init --stage 2`'s file without changing the objective: sizes,
# paths, logging and the tiny model's setup (its random vision tower trains; init freezes a pretrained one)
NOT_THE_RECIPE = ("global_max_length", "seed", "template.", "tuner.", "training.eval_steps", "training.logging_steps",
                  "training.max_steps", "training.output_dir", "training.packing_buffer",
                  "training.per_device_train_batch_size", "training.save_steps", "training.save_total_limit",
                  "training.seed", "rollout_matching.decode_batch_size", "rollout_matching.max_new_tokens",
                  "rollout_matching.packing.", "rollout_matching.pipeline.diagnostics",
                  "rollout_matching.repeat_terminate.", "rollout_matching.serving.engine.max_model_len")


def test_stage2_shipped_is_the_arm_init_writes(bench, tmp_path):
    """Issue 53, item 6: the report names SHIPPED_ARM ``stage2_shipped``; built by the bench's own config builder, it
    is the only grid arm whose contract agrees with ``coordexp init --stage 2``'s file on every key of the objective
    (so changing what init writes without changing SHIPPED_ARM fails here)."""
    from _campaign_report import SHIPPED_ARM

    from coordexp.cli.init import InitChoices, render_config
    from coordexp.schema.contract import load_contract

    args = _args(bench, tmp_path)
    for name in ("train.jsonl", "val.jsonl"):
        (tmp_path / name).write_text("")
    model, train, val = tmp_path / "model", tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    written = tmp_path / "init.yaml"
    written.write_text(render_config(InitChoices(model=str(model), train_jsonl=str(train), val_jsonl=str(val),
                                                 output_dir=str(tmp_path / "out"), stage=2, device="cpu",
                                                 family="qwen2_vl")))
    init = _flat(load_contract(written))
    matching = []
    for name, overrides in bench.continuation_plan(args):
        arm = _flat(load_contract(bench._config(args, tmp_path, name, "demo_stage2.yaml", model, train, val, 3,
                                                bench._continued(args), overrides)))
        differ = [k for k in set(arm) | set(init) if arm.get(k, "-") != init.get(k, "-")
                  and not k.startswith(NOT_THE_RECIPE)]
        if not differ:
            matching.append(name)
    assert matching == [SHIPPED_ARM]


def test_every_arm_reports_its_reward_and_cut_off_in_the_first_and_last_quarter(bench):
    """Issue 52 asks whether the reward rises and the rollouts run on over a run: each arm's train figures carry the
    mean of the first and of the last quarter of the windows that logged each, None where fewer than 4 did."""
    history = [{"step": s, "reward/mean": 0.1 * s, "rollout/cut_off_rate": 0.5} for s in range(1, 9)]
    history.insert(3, {"step": 3, "eval/AP50": 0.3})  # an evaluation line logs neither
    assert bench._quarters(history, "reward/mean") == pytest.approx([0.15, 0.75])
    assert bench._quarters(history, "rollout/cut_off_rate") == pytest.approx([0.5, 0.5])
    assert bench._quarters(history[:3], "reward/mean") is None
    assert bench._quarters([{"loss": 1.0}] * 8, "reward/mean") is None


def test_a_report_rewrites_its_file_by_rename_never_through_a_link(bench, tmp_path):
    """``--report FILE`` rewrites FILE in place (a committed result): through a temp file and a rename, so a link
    there is replaced, never written through, and the file it pointed to keeps its bytes."""
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text('{"mine": true}\n')
    summary = tmp_path / "summary.json"
    summary.symlink_to(elsewhere)
    bench._write_json(summary, {"seeds": []})
    assert not summary.is_symlink() and summary.read_text() == '{\n  "seeds": []\n}\n'
    assert elsewhere.read_text() == '{"mine": true}\n'
