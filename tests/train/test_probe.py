"""Oracle-K and the recall-by-rank picture of ``coordexp probe`` (coordexp/runtime/train/probe.py) by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from PIL import Image

from coordexp.runtime.core.objects import DetObject
from coordexp.runtime.train.probe import oracle_k_figures, plot_recall_by_rank


def box(x1, y1, x2, y2, desc="cat"):
    return DetObject(desc, "bbox_2d", (x1, y1, x2, y2))


A, B, C = box(0, 0, 100, 100), box(200, 200, 300, 300), box(500, 500, 600, 600, "dog")


def test_oracle_k_counts_what_samples_found_that_greedy_missed():
    records = [SimpleNamespace(objects=(A, B, C)), SimpleNamespace(objects=(A,))]
    greedy = [[A], [A]]
    sampled = [[[B], [box(500, 500, 600, 600, "cat")]],  # B found; C's box found with the wrong class: not found
               [[], [A, A]]]
    f = oracle_k_figures(records, greedy, sampled)
    assert f["oracle_k"] == 2 and f["greedy_missed"] == 2
    assert f["greedy_recall"] == pytest.approx(2 / 4) and f["oracle_k_recall"] == pytest.approx(3 / 4)
    assert f["oracle_k_recoverable"] == pytest.approx(1 / 2)
    perfect = oracle_k_figures(records[1:], [[A]], [[[]]])
    assert perfect["oracle_k_recoverable"] is None and perfect["greedy_recall"] == 1.0


@pytest.mark.parametrize("values", [[], [0.0, None, 1.0, 0.5], [0.2] * 80])
def test_recall_by_rank_picture(tmp_path, values):
    path = plot_recall_by_rank({"recall_by_rank": values}, tmp_path / "r.png")
    with Image.open(path) as image:
        assert image.size == (640, 360)
