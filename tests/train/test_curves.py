"""``coordexp plot-run``'s pure parts: which log history is read and which curves a history yields."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordexp.runtime.train.curves import (draw_curves, find_trainer_state, load_log_history, rollout_curves,
                                           run_curves)


def test_the_run_folders_state_wins_else_the_newest_checkpoints(tmp_path):
    for step in (2, 10, 9):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"log_history": []}))
    assert find_trainer_state(tmp_path) == tmp_path / "checkpoint-10" / "trainer_state.json"
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": [{"loss": 1.0, "step": 1}]}))
    assert find_trainer_state(tmp_path) == tmp_path / "trainer_state.json"
    assert load_log_history(tmp_path / "trainer_state.json") == [{"loss": 1.0, "step": 1}]
    with pytest.raises(FileNotFoundError):
        find_trainer_state(tmp_path / "checkpoint-2" / "absent")
    (tmp_path / "trainer_state.json").write_text("{not json")
    with pytest.raises(ValueError):
        load_log_history(tmp_path / "trainer_state.json")


@given(st.lists(st.tuples(st.integers(0, 10**6), st.one_of(st.floats(allow_nan=True, allow_infinity=False),
                                                          st.none(), st.text(max_size=3))), max_size=20))
def test_curves_keep_only_numeric_points_in_log_order(entries):
    history = [{"step": step, "loss": value, "eval/AP50": value} for step, value in entries]
    losses, evals = run_curves(history)
    expected = [(float(s), float(v)) for s, v in entries if isinstance(v, float) and v == v]
    assert [list(c.points) for c in losses] == ([expected] if expected else [])
    assert [c.name for c in evals] == (["eval AP50"] if expected else [])


def test_draw_curves_writes_a_png_with_both_panels(tmp_path):
    from PIL import Image

    history = [{"loss": 2.0 - 0.1 * s, "step": s} for s in range(1, 11)] + [{"eval/AP50": 0.3, "step": 5},
                                                                           {"eval/AP50": 0.5, "step": 10}]
    path = draw_curves(history, tmp_path / "x" / "curves.png", title="t")
    with Image.open(path) as image:
        assert image.mode == "RGB" and image.size == (900, 680)


def test_stage2_runs_get_a_rollout_panel_and_the_set_figures(tmp_path):
    from PIL import Image

    history = [{"loss": 1.0, "step": s, "rollout/pred_per_gt": 1.0 + s / 5, "rollout/duplicates_per_image": s / 10}
               for s in range(1, 6)] + [{"eval/AP50": 0.3, "eval/f1": 0.4, "eval/recall": 0.5, "step": 5}]
    _, evals = run_curves(history)
    assert [c.name for c in evals] == ["eval AP50", "eval recall", "eval f1"]
    assert [c.name for c in rollout_curves(history)] == ["pred_per_gt", "duplicates_per_image"]
    with Image.open(draw_curves(history, tmp_path / "c.png", title="t")) as image:
        assert image.size == (900, 60 + 3 * 310)


def test_plot_run_draws_recall_by_object_count_bucket():
    """Issue 53: the dense-scene figures a user needs on their own data are drawn beside AP."""
    from coordexp.runtime.train.curves import run_curves

    history = [{"step": 5, "eval/AP50": 0.4, "eval/recall_objects_1_6": 0.9, "eval/recall_objects_11_plus": 0.3},
               {"step": 10, "eval/AP50": 0.5, "eval/recall_objects_1_6": 0.95, "eval/recall_objects_11_plus": 0.4}]
    _, evals = run_curves(history)
    names = [curve.name for curve in evals]
    assert "eval recall_objects_11_plus" in names and "eval recall_objects_1_6" in names
    assert "eval recall_objects_7_10" not in names  # not logged: not drawn


def test_plot_run_draws_percent_with_ap_on_its_own_axis():
    """Issue 55: token accuracy (0.83) and AP (0.003) shared one linear axis in fractions, AP a flat line at zero,
    while the CLI prints percent. What is drawn: detection figures in percent on one panel, token accuracy in
    percent on another, each panel scaled to its own values."""
    from coordexp.runtime.train.curves import panels

    history = [{"step": 5, "loss": 1.5, "eval/AP50": 0.003, "eval/AP": 0.001, "eval/token_acc": 0.83},
               {"step": 10, "loss": 1.2, "eval/AP50": 0.006, "eval/AP": 0.002, "eval/token_acc": 0.85}]
    drawn = {panel.title: panel for panel in panels(history)}
    detection = drawn["evaluation: detection (%)"]
    tokens = drawn["evaluation: teacher-forced token accuracy (%)"]
    assert detection.percent and tokens.percent and not drawn["training loss"].percent
    assert {c.name: c.points for c in detection.curves} == {"eval AP50": ((5.0, 0.3), (10.0, 0.6)),
                                                            "eval AP": ((5.0, 0.1), (10.0, 0.2))}
    assert [c.name for c in tokens.curves] == ["eval token_acc"]
    assert tokens.curves[0].points == ((5.0, 83.0), (10.0, 85.0))
    assert drawn["training loss"].curves[0].points == ((5.0, 1.5), (10.0, 1.2))  # a loss is no percentage
    no_tokens = [panel.title for panel in panels([{"step": 1, "eval/AP50": 0.1}])]
    assert no_tokens == ["training loss", "evaluation: detection (%)"]


def test_plot_run_draws_the_reward_objectives_figures():
    """Issue 52: the reward, its spread, the zero-advantage share, the closing credit, and the policy's entropy per
    token type and KL are drawn when a run logged them; an SFT run gets neither panel."""
    from coordexp.runtime.train.curves import panels

    history = [{"step": s, "loss": 0.1, "reward/mean": 0.6 + s / 100, "reward/group_std": 0.1,
                "reward/zero_advantage_group_share": 0.25, "reward/entropy_coord": 2.0, "reward/entropy_text": 0.3}
               for s in (1, 2)]
    drawn = {panel.title: panel for panel in panels(history)}
    assert {c.name: c.points for c in drawn["reward objective"].curves}["mean"] == ((1.0, 0.61), (2.0, 0.62))
    assert [c.name for c in drawn["reward objective"].curves] == ["mean", "group_std", "zero_advantage_group_share"]
    assert [c.name for c in drawn["policy entropy and KL (nats)"].curves] == ["entropy_coord", "entropy_text"]
    sft = [panel.title for panel in panels([{"step": 1, "loss": 1.0}])]
    assert "reward objective" not in sft and "policy entropy and KL (nats)" not in sft
