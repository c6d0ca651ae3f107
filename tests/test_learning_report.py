"""bench_learning's report applies decision 18's pre-registered rule and its third amendment (what ``init --stage 2``
ships) to per-seed figures; the expectations here are computed from the seeds with scipy, not from the report."""

from __future__ import annotations

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
