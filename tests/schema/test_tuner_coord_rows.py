"""``tuner.train_coord_rows`` and the coord rows' rates (``coord_embed_lr``, ``coord_head_lr``,
``coord_weight_decay``): on by default for an adapter, bounded like every rate, and refused with the reason where
they would configure nothing (full fine-tuning, coord rows switched off, a frozen language model)."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordexp.schema.loader import validate_mapping
from coordexp.schema.tuner import TunerConfig

RATES = ("coord_embed_lr", "coord_head_lr")
KEYS = (*RATES, "coord_weight_decay")


def _report(stage2_config: dict, tuner: dict):
    return validate_mapping({**stage2_config, "tuner": tuner})


def test_coord_rows_train_by_default_under_an_adapter_only():
    assert TunerConfig(train_type="lora").trains_coord_rows
    assert not TunerConfig(train_type="lora", train_coord_rows=False).trains_coord_rows
    assert not TunerConfig(train_type="lora", freeze_llm=True, freeze_aligner=False).trains_coord_rows
    assert not TunerConfig().trains_coord_rows  # full fine-tuning trains the whole matrices instead


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(KEYS), value=st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 10.0, 10.000001, -1e-12, 1e308])))
def test_coord_rates_are_finite_and_bounded(stage2_config, key, value):
    report = _report(stage2_config, {"train_type": "lora", key: value})
    low_ok = value >= 0.0 if key == "coord_weight_decay" else value > 0.0
    valid = math.isfinite(value) and low_ok and value <= 10.0
    assert report.ok is valid, (key, value, report.errors)
    if not valid:
        assert [e.path for e in report.errors] == [f"tuner.{key}"]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(KEYS), case=st.sampled_from(["full", "off", "frozen"]))
def test_coord_rates_that_would_configure_nothing_are_refused_naming_the_key(stage2_config, key, case):
    tuner = {"full": {}, "off": {"train_type": "lora", "train_coord_rows": False},
             "frozen": {"train_type": "lora", "freeze_llm": True, "freeze_aligner": False}}[case]
    report = _report(stage2_config, {**tuner, key: 0.001})
    assert not report.ok
    (issue,) = report.errors
    assert issue.path == f"tuner.{key}"
    reason = {"full": "train_type is full", "off": "train_coord_rows is false", "frozen": "freeze_llm"}[case]
    assert reason in issue.message and issue.hint
    assert _report(stage2_config, tuner).ok  # the same tuner without the rate validates
