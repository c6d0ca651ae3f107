"""bench_learning's report applies decision 18's pre-registered rule and its third amendment (what ``init --stage 2``
ships) to per-seed figures; the expectations here are computed from the seeds with scipy, not from the report."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _learning_report import FIGURES, RECIPE, summarize  # noqa: E402

NOISE = (0.002, -0.001, 0.001, -0.002)
CONTROL = {"AP50": 0.85, "f1": 0.89, "precision": 0.89}


def _seeds(offsets: dict[str, dict[str, tuple[float, ...]]]) -> list[dict]:
    """Per-seed runs: every arm is the control plus its offsets (one per seed) for AP50, f1 and precision."""
    n = len(NOISE)
    out = []
    for i in range(n):
        runs = {}
        for name in ("stage1", "stage1_continued", *offsets):
            figures = {k: 0.5 for k in FIGURES}
            for key, base in CONTROL.items():
                figures[key] = base + NOISE[i] + offsets.get(name, {}).get(key, (0.0,) * n)[i]
            runs[name] = {"train": {"steps": 1, "trained_tokens": 1, "wall_s": 1.0}, "eval": figures}
        out.append({"seed": 200 + i, "runs": runs})
    return out


def _arms(recipe_ap: tuple[float, ...], **variants: tuple[float, ...]) -> dict[str, dict[str, tuple[float, ...]]]:
    """The second control below the control, stage2_drop with a lower F1, the recipe and variants as AP50 offsets."""
    low = (-0.05,) * len(NOISE)
    arms = {"stage1_gap": {"AP50": low, "f1": low, "precision": low}, "stage2_drop": {"f1": (-0.02,) * len(NOISE)},
            "stage2": {"AP50": low}, RECIPE: {"AP50": recipe_ap}}
    arms.update({name: {"AP50": ap} for name, ap in variants.items()})
    return arms


PAYS = (0.010, 0.012, 0.009, 0.011)  # +1 point on every seed: the interval above 0
MISSES = (0.010, -0.012, 0.009, -0.011)


def _ships(arms) -> dict:
    return summarize(_seeds(arms))["ships"]


def test_a_variant_that_beats_a_paying_recipe_beyond_noise_ships():
    better = tuple(a + 0.005 + d for a, d in zip(PAYS, (0.001, -0.001, 0.0, 0.0005)))
    shipped = _ships(_arms(PAYS, recipe_reading_order=better))
    assert shipped["arm"] == "recipe_reading_order" and "beats the recipe" in shipped["why"]


def test_a_variant_within_noise_of_a_paying_recipe_does_not_replace_it():
    level = tuple(a + d for a, d in zip(PAYS, (0.003, -0.003, 0.003, -0.003)))
    summary = summarize(_seeds(_arms(PAYS, recipe_reading_order=level)))
    assert summary["rule"]["recipe_reading_order"]["pays"] and summary["rule"][RECIPE]["pays"]
    assert summary["ships"]["arm"] == RECIPE


def test_a_higher_ap50_bought_with_a_lower_f1_does_not_replace_the_recipe():
    arms = _arms(PAYS, recipe_reading_order=tuple(a + 0.005 for a in PAYS))
    arms["recipe_reading_order"]["f1"] = (-0.001,) * len(NOISE)
    assert _ships(arms)["arm"] == RECIPE


def test_a_paying_variant_ships_when_the_recipe_misses_and_of_two_the_higher_ap50():
    shipped = _ships(_arms(MISSES, a=PAYS, b=tuple(a + 0.004 for a in PAYS)))
    assert shipped == {"arm": "b", "why": "it meets the rule and the recipe does not"}


def test_nothing_pays_and_init_keeps_what_it_writes():
    shipped = _ships(_arms(MISSES, a=MISSES))
    assert shipped["arm"] == RECIPE and shipped["why"].startswith("no arm meets the rule")


def test_a_precision_cost_over_3_points_fails_the_rule():
    arms = _arms(PAYS, a=PAYS)
    arms["a"]["precision"] = (-0.04,) * len(NOISE)
    summary = summarize(_seeds(arms))
    assert not summary["rule"]["a"]["pays"] and not summary["rule"]["a"]["passed"]["precision > -3 points"]
    assert summary["rule"][RECIPE]["pays"] and summary["ships"]["arm"] == RECIPE


offsets = st.tuples(*[st.integers(-30, 30).map(lambda x: x / 1000)] * len(NOISE))


def _ci_low(values) -> float:
    """The 95% t interval's low end of the mean of ``values``, from scipy (the mean itself when they are equal)."""
    if len(set(values)) == 1:
        return values[0]
    return stats.ttest_1samp(values, 0.0).confidence_interval(0.95).low


@given(recipe=offsets, a=offsets, b=offsets)
@settings(max_examples=60, deadline=None)
def test_a_shipped_variant_meets_the_rule_and_beats_a_paying_recipe(recipe, a, b):
    summary = summarize(_seeds(_arms(recipe, a=a, b=b)))
    shipped = summary["ships"]["arm"]
    assert shipped in (RECIPE, "a", "b")
    if shipped == RECIPE:
        return
    chosen = {"a": a, "b": b}[shipped]
    assert summary["rule"][shipped]["pays"] and _ci_low(list(chosen)) > -1e-9  # AP50 above the control's
    if summary["rule"][RECIPE]["pays"]:
        assert _ci_low([x - r for x, r in zip(chosen, recipe)]) > -1e-9


def test_variants_are_paired_against_the_recipe_they_change():
    summary = summarize(_seeds(_arms(PAYS, a=tuple(a + 0.003 for a in PAYS))))
    assert summary["a - stage2_recipe"]["AP50"]["mean"] == pytest.approx(0.003)
    assert "stage2 - stage2_recipe" not in summary and "stage1_gap - stage2_recipe" not in summary


def test_the_rule_and_what_ships_never_read_a_seed_that_failed_the_gate():
    """Regression (issue 56, item 14): a seed whose stage 1 failed the gate but ran its arms entered the rule: here
    its large gain would make the variant beat the recipe, while on the gated seeds it does not."""
    level = tuple(a + d for a, d in zip(PAYS, (0.003, -0.003, 0.003, -0.003)))
    seeds = _seeds(_arms(PAYS, recipe_reading_order=level))
    for seed in seeds:
        seed["gate"] = {"passed": True}
    failed = _seeds(_arms(PAYS, recipe_reading_order=tuple(a + 0.2 for a in PAYS)))[0]
    failed["seed"], failed["gate"] = 299, {"passed": False}
    gated_only = summarize(seeds)
    with_failed = summarize([*seeds, failed])
    assert with_failed["rule"] == gated_only["rule"] and with_failed["ships"] == gated_only["ships"]
    assert with_failed["ships"]["arm"] == RECIPE and with_failed["rule_left_out_seeds"] == [299]


# issue 53's rule (benchmarks/_campaign_report.py): hand-built seeds of the dense and the 4:4-12 grid settings
from _campaign_report import DEFAULT_GRID, DENSE_GRID, beats_detector, extend_summary  # noqa: E402

DENSE = {"task": "grid", "grid": DENSE_GRID}
BASE = {"AP50": 0.80, "f1": 0.85}
JITTER = (0.003, -0.002, 0.001, -0.003, 0.002, 0.0, -0.001, 0.003, -0.002, 0.001, 0.002, -0.003)


def _campaign(n: int, gain: dict[str, tuple[float, ...]], *,
              arms=("stage1", "stage1_continued", "stage1_annealed", "stage1_long"),
              source: str = "eval", passed: bool = True) -> list[dict]:
    """``n`` seeds: the stage-1 baselines at BASE (each with its own jitter) and stage2_recipe at stage1_long plus
    ``gain[figure][seed]``, under ``source`` (``eval`` or ``tuned``)."""
    seeds = []
    for i in range(n):
        runs = {}
        for k, name in enumerate(arms):
            runs[name] = {source: {f: v + JITTER[(i + 3 * k) % 12] / 3 for f, v in BASE.items()}}
        reference = runs[arms[-1]][source]
        runs[RECIPE] = {source: {f: reference[f] + gain.get(f, (0.0,) * n)[i] for f in BASE}}
        seeds.append({"seed": 300 + i, "gate": {"passed": passed}, "runs": runs})
    return seeds


UP = tuple(0.01 + j for j in JITTER)  # +1 point, every seed up: every interval above 0


def test_the_rule_needs_12_gated_seeds_of_the_dense_setting():
    verdict = beats_detector(_campaign(3, {"AP50": UP, "f1": UP}), DENSE)
    arm = verdict["arms"][RECIPE]
    assert verdict["setting"] == "dense" and verdict["gated_seeds"] == 3 and verdict["needs_seeds"] == 12
    assert not arm["met"] and arm["reasons"][0] == "needs 12 gated seeds, has 3"
    assert all(c["ok"] for c in arm["checks"]) and len(arm["checks"]) == 8  # AP50 and F1 against each baseline
    # twelve seeds whose stage 1 failed the gate count for nothing
    failed = beats_detector(_campaign(12, {"AP50": UP, "f1": UP}, passed=False), DENSE)
    assert failed["gated_seeds"] == 0 and "needs 12 gated seeds, has 0" in failed["arms"][RECIPE]["reasons"]


def test_the_rule_is_met_on_12_gated_seeds_with_every_interval_above_zero():
    seeds = _campaign(12, {"AP50": UP, "f1": UP})
    arm = beats_detector(seeds, DENSE)["arms"][RECIPE]
    assert arm["met"] and arm["reasons"] == []
    long_ap = next(c for c in arm["checks"] if (c["against"], c["figure"]) == ("stage1_long", "AP50"))
    assert long_ap["n"] == 12 and long_ap["ci95"][0] == pytest.approx(_ci_low(list(UP)))
    assert long_ap["ci95"][0] > 0


def test_an_interval_crossing_zero_against_one_baseline_fails_the_rule():
    crossing = tuple(0.004 if i % 2 else -0.003 for i in range(12))
    seeds = _campaign(12, {"AP50": UP, "f1": crossing})  # the recipe at stage1_long's F1, within noise
    for seed in seeds:  # the other three baselines 2 points lower: above them on every seed
        for name in ("stage1", "stage1_continued", "stage1_annealed"):
            seed["runs"][name]["eval"] = {k: v - 0.02 for k, v in seed["runs"][name]["eval"].items()}
    arm = beats_detector(seeds, DENSE)["arms"][RECIPE]
    failing = [c for c in arm["checks"] if not c["ok"]]
    assert not arm["met"] and [(c["against"], c["figure"]) for c in failing] == [("stage1_long", "f1")]
    assert failing[0]["ci95"][0] < 0 < failing[0]["ci95"][1] and "crosses 0" in arm["reasons"][0]
    assert failing[0]["ci95"][0] == pytest.approx(_ci_low(list(crossing)))


def test_a_missing_baseline_arm_fails_the_rule_and_says_so():
    seeds = _campaign(12, {"AP50": UP, "f1": UP}, arms=("stage1", "stage1_continued", "stage1_annealed"))
    arm = beats_detector(seeds, DENSE)["arms"][RECIPE]
    assert not arm["met"] and "AP50 - stage1_long: no stage1_long arm in this run" in arm["reasons"]


def test_the_default_setting_asks_only_not_below_stage1_on_8_seeds():
    args = {"task": "grid", "grid": DEFAULT_GRID}
    crossing = tuple(0.004 if i % 2 else -0.004 for i in range(8))
    level = beats_detector(_campaign(8, {"AP50": crossing}, arms=("stage1",)), args)
    assert level["needs_seeds"] == 8 and level["arms"][RECIPE]["met"]  # an interval across 0 is not below
    below = beats_detector(_campaign(8, {"AP50": tuple(-u for u in UP)}, arms=("stage1",)), args)
    assert not below["arms"][RECIPE]["met"] and "entirely below 0" in below["arms"][RECIPE]["reasons"][0]
    other = beats_detector(_campaign(8, {"AP50": UP}), {"task": "grid", "grid": "6:8-20"})
    assert other["setting"] is None and "arms" not in other


def test_the_rule_reads_the_tuned_figures_when_every_arm_has_them():
    seeds = _campaign(12, {"AP50": tuple(-u for u in UP), "f1": tuple(-u for u in UP)})  # default decoding: below
    tuned = _campaign(12, {"AP50": UP, "f1": UP}, source="tuned")
    for seed, better in zip(seeds, tuned):
        for name, run in seed["runs"].items():
            run["tuned"] = {**better["runs"][name]["tuned"], "repetition_penalty": 1.05, "near_repeat_removal": True}
    verdict = beats_detector(seeds, DENSE)
    assert verdict["figures"] == "tuned" and verdict["arms"][RECIPE]["met"]
    del seeds[0]["runs"]["stage1"]["tuned"]  # one arm of one seed without tuned figures: the default decoding's
    fallback = beats_detector(seeds, DENSE)
    assert fallback["figures"] == "default decoding" and not fallback["arms"][RECIPE]["met"]


def test_the_summary_names_the_shipped_arm_and_pairs_the_tuned_figures():
    seeds = _campaign(4, {"AP50": UP[:4], "f1": UP[:4]})
    for seed in seeds:
        for run in seed["runs"].values():
            run["eval"]["count_buckets"] = {"1-6": {"recall": 0.9, "premature_eos_rate": 0.1}}
            run["tuned"] = {**run["eval"], "repetition_penalty": 1.0, "near_repeat_removal": False,
                            **{k: 0.5 for k in ("recall", "precision", "duplicates_per_image", "premature_eos_rate")}}
        seed["runs"][RECIPE]["tuned"]["AP50"] += 0.02
    summary: dict = {}
    extend_summary(seeds, summary, DENSE)
    assert summary["aliases"] == {"stage2_shipped": RECIPE}
    assert summary["count_buckets"][RECIPE]["1-6"] == {"recall": pytest.approx(0.9),
                                                       "premature_eos_rate": pytest.approx(0.1)}
    paired = summary["tuned"]["paired"][f"{RECIPE} - stage1_long"]["AP50"]
    assert paired["mean"] == pytest.approx(statistics.fmean(u + 0.02 for u in UP[:4]))
    assert summary["tuned"]["chosen"][RECIPE] == {"rp 1, near repeats kept": 4}
    pairs = summary["tuned"]["paired"]
    assert "stage1_long - stage1" in pairs and "stage1 - stage1_long" not in pairs
    assert summary["beats_detector"]["arms"][RECIPE]["reasons"][0] == "needs 12 gated seeds, has 4"


def test_every_arm_is_paired_against_the_checkpoint_at_the_default_decoding():
    """The brief's comparison: every arm minus ``stage1`` (the checkpoint it started from), seed by seed, with the
    t interval scipy gives for the same differences; the checkpoint itself is no pair."""
    from _campaign_report import checkpoint_paired

    seeds = _campaign(4, {"AP50": UP[:4]})
    pairs = checkpoint_paired(seeds)
    assert set(pairs) == {f"{name} - stage1" for name in seeds[0]["runs"] if name != "stage1"}
    differences = [s["runs"][RECIPE]["eval"]["AP50"] - s["runs"]["stage1"]["eval"]["AP50"] for s in seeds]
    low, high = stats.t.interval(0.95, len(differences) - 1, loc=statistics.fmean(differences),
                                 scale=stats.sem(differences))
    assert pairs[f"{RECIPE} - stage1"]["AP50"]["ci95"] == pytest.approx([low, high])
    assert checkpoint_paired([{"seed": 1, "runs": {RECIPE: seeds[0]["runs"][RECIPE]}}]) == {}


def _screen_seeds() -> list[dict]:
    """Three gated seeds and one failed: stage1, the control, and three treatments (tuned figures): ``good`` up in
    AP50 and F1, ``better`` higher AP50, ``recall_only`` up in AP50 and down in F1."""
    offsets = {"good": (0.01, 0.005), "better": (0.02, 0.001), "recall_only": (0.03, -0.01)}
    walls = {"stage1_continued": 60.0, "good": 300.0, "better": (130.0, 250.0, 260.0), "recall_only": 900.0}
    seeds = []
    for i in range(4):
        runs = {"stage1": {"tuned": {"AP50": 0.8 + JITTER[i], "f1": 0.85}, "train": {"wall_s": 1000.0}}}
        runs["stage1_continued"] = {"tuned": {"AP50": 0.8, "f1": 0.85}, "train": {"wall_s": 60.0}}
        for name, (ap, f1) in offsets.items():
            wall = walls[name][i % 3] if isinstance(walls[name], tuple) else walls[name]
            runs[name] = {"tuned": {"AP50": 0.8 + JITTER[i] + ap, "f1": 0.85 + f1}, "train": {"wall_s": wall}}
        for run in runs.values():
            run["eval"] = dict(run["tuned"])
            run["tuned"].update(repetition_penalty=1.0, near_repeat_removal=False)
        seeds.append({"seed": 300 + i, "gate": {"passed": i != 3}, "runs": runs})
    seeds[3]["runs"]["good"]["tuned"]["AP50"] = 0.0  # a failed seed counts for nothing
    return seeds


def test_the_screen_names_its_finalists_and_stage1_longs_multiple():
    """Decision 20: at most two treatments whose mean tuned AP50 and F1 minus stage1 are above 0, the higher AP50
    first; K is the median of the first finalist's wall time over the control's (130/60, 250/60, 260/60 -> 4.17),
    rounded up to a multiple of 0.5 (4.5) within [1.5, 10]."""
    from _campaign_report import screen_choice

    choice = screen_choice(_screen_seeds())
    assert choice["seeds"] == 3 and choice["figures"] == "tuned"
    assert choice["seeds_run"] == 4 and not choice["complete"]  # 4 of the screen's 8 seeds: provisional
    assert choice["finalists"] == ["better", "good"]  # recall_only's F1 is below stage1's
    assert choice["means"]["better"]["AP50"] == pytest.approx(0.02)
    assert choice["wall_multiples"] == pytest.approx([130 / 60, 250 / 60, 260 / 60])
    assert choice["long_multiple"] == 4.5
    slow = _screen_seeds()
    for seed in slow:
        seed["runs"]["better"]["train"]["wall_s"] = 6000.0
    assert screen_choice(slow)["long_multiple"] == 10.0  # 100x is capped
    fast = _screen_seeds()
    for seed in fast:
        seed["runs"]["better"]["train"]["wall_s"] = 61.0
    assert screen_choice(fast)["long_multiple"] == 1.5
    none = _screen_seeds()
    for seed in none:
        for name in ("good", "better"):
            seed["runs"][name]["tuned"]["f1"] = 0.84
    assert screen_choice(none)["finalists"] == [] and screen_choice(none)["long_multiple"] is None


def test_only_the_screens_seeds_of_the_dense_setting_are_read_as_the_screen():
    seeds = _screen_seeds()
    dense: dict = {}
    extend_summary(seeds, dense, DENSE)
    assert dense["screen"]["finalists"] == ["better", "good"]
    sparse: dict = {}
    extend_summary(seeds, sparse, {"task": "grid", "grid": DEFAULT_GRID})
    assert "screen" not in sparse
    for k, seed in enumerate(seeds):  # calibration (200-201) and the finals (310 on) choose nothing
        seed["seed"] = 200 + k
    calibration: dict = {}
    extend_summary(seeds, calibration, DENSE)
    assert "screen" not in calibration
