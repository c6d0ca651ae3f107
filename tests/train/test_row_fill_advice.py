"""Rows that fill: a packed run whose rows stay under ``packing_min_fill_ratio`` is told ONCE (not every step) what
would fill them, from its own sample lengths; a run whose rows fill is told nothing."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from coordexp.runtime.train.metrics import StepStats
from coordexp.runtime.train.pipeline import MicroStepPipeline, PipelineSettings
from coordexp.runtime.train.run_log import RunLog


@dataclass(frozen=True)
class Segment:
    length: int
    policy_version: int | None = 0


def _pipeline(tmp_path, **settings) -> MicroStepPipeline:
    return MicroStepPipeline(None, None, PipelineSettings(seed=1, stage2=False, **settings), stats=StepStats(),
                             run_log=RunLog(tmp_path), policy=lambda: None)


def _advice(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "packing_min_fill_ratio" in r.getMessage()]


def test_underfilled_rows_are_advised_once_with_this_runs_figures(tmp_path, caplog):
    pipe = _pipeline(tmp_path, packing_length=4096, packing_buffer=64, min_fill_ratio=0.65)
    batch = [Segment(n) for n in (250, 300, 350, 280, 320, 300, 310, 290)]  # 2,400 tokens: fill 0.59
    with caplog.at_level(logging.WARNING, logger="coordexp.train"):
        for step in range(5):
            pipe.rows(batch, step)
    assert pipe.stats.underfilled_rows == 5  # every step's row is under the ratio, and is counted
    (advice,) = _advice(caplog)  # but said once
    assert "filled 0.59" in advice and "8 samples hold 2400 tokens" in advice and "the longest 350" in advice
    assert f"per_device_train_batch_size to about {math.ceil(0.65 * 4096 / 300)}" in advice  # 9 samples
    assert "template.max_length) to about 3712" in advice  # 2400 / 0.65 = 3692, in whole 64-token steps


def test_rows_that_fill_are_not_advised_and_other_ranks_stay_quiet(tmp_path, caplog):
    full = _pipeline(tmp_path, packing_length=1000, packing_buffer=64, min_fill_ratio=0.65)
    other_rank = _pipeline(tmp_path / "r1", packing_length=4096, packing_buffer=64, min_fill_ratio=0.65, rank=1)
    with caplog.at_level(logging.WARNING, logger="coordexp.train"):
        full.rows([Segment(300), Segment(400)], 0)  # 0.7 of a row
        other_rank.rows([Segment(300)], 0)
    assert _advice(caplog) == []


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 900), min_size=1, max_size=12), ratio=st.floats(0.05, 1.0))
def test_the_advised_batch_and_row_would_fill_a_row(tmp_path_factory, lengths, ratio):
    """Rows of the advised length hold the micro-step at the asked ratio; the advised batch of average samples fills
    today's rows; the advised row never refuses a sample seen."""
    tmp = tmp_path_factory.mktemp("advice")
    pipe = _pipeline(tmp, packing_length=1024, packing_buffer=64, min_fill_ratio=ratio)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    log = logging.getLogger("coordexp.train.pipeline")
    log.addHandler(handler)
    try:
        pipe.rows([Segment(n) for n in lengths], 0)
    finally:
        log.removeHandler(handler)
    if not records:  # the rows the micro-step trained reached the ratio
        return
    (advice,) = records
    mean, longest, total = sum(lengths) / len(lengths), max(lengths), sum(lengths)
    if total < ratio * 1024:  # too few tokens: a larger batch of such samples, or shorter rows, reach the ratio
        batch = int(advice.split("per_device_train_batch_size to about ")[1].split(",")[0])
        row = int(advice.split("template.max_length) to about ")[1].split(" ")[0])
        assert batch > len(lengths) and batch * mean >= ratio * 1024
        assert longest <= row <= 1024 and (row == longest or row == 1024 or total >= ratio * (row - 64))
    else:  # enough tokens that pack with gaps: longer rows
        row = int(advice.split("global_max_length) to about ")[1].split(",")[0])
        assert row > 1024 and row >= 2 * longest
