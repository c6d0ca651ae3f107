"""Teacher-forced token figures per token type (token_types.py): accuracy is the full-vocabulary argmax against the
label, loss the full-vocabulary cross-entropy, on hand-built logits; sums add up over chunks, batches and ranks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coordexp.runtime.core.objects import TokenSupervision
from coordexp.runtime.model.losses import SupervisionBatch, SupervisionSegment
from coordexp.runtime.model.token_types import TokenTypeSums, token_type_sums

NUM_TEXT = 20
VOCAB = NUM_TEXT + 1000
COORD_IDS = torch.arange(NUM_TEXT, VOCAB, dtype=torch.long)  # coord bin k -> id 20 + k


def _batch(assistant_ids, ce_positions, coord_positions, coord_targets, *, prompt=2, seq_len=None):
    """One segment in row 0 whose assistant span starts after ``prompt`` tokens."""
    sup = TokenSupervision(
        ce_positions=np.asarray(ce_positions, np.int64), ce_weights=np.ones(len(ce_positions), np.float32),
        coord_positions=np.asarray(coord_positions, np.int64),
        coord_targets=np.asarray(coord_targets, np.float32), bbox_slots=np.zeros((0, 4), np.int64))
    seq_len = seq_len or prompt + len(assistant_ids)
    return SupervisionBatch.from_segments([SupervisionSegment(sup, list(assistant_ids), 0, prompt)], seq_len)


def _row_logits(seq_len: int, rows: dict[int, dict[int, float]]) -> torch.Tensor:
    """``(1, seq_len, V)`` zeros with ``rows[p][token] = value`` set at logit position ``p``."""
    logits = torch.zeros(1, seq_len, VOCAB)
    for position, values in rows.items():
        for token, value in values.items():
            logits[0, position, token] = value
    return logits


def _ce(row: torch.Tensor, label: int) -> float:
    return float(-torch.log_softmax(row.double(), dim=0)[label])


def test_hand_built_rows_give_the_accuracy_and_loss_of_each_type():
    # assistant ids: text 3, coord bin 5, coord bin 7, text 4 -> labels at absolute positions 2..5, logits at 1..4
    ids = [3, 20 + 5, 20 + 7, 4]
    batch = _batch(ids, ce_positions=[0, 3], coord_positions=[1, 2], coord_targets=[5.0, 7.0])
    logits = _row_logits(6, {
        1: {3: 4.0},  # text label 3 is the argmax: correct
        2: {20 + 5: 2.0, 9: 3.0},  # coord label's logit is below a text token's: wrong
        3: {20 + 7: 6.0},  # coord label is the argmax: correct
        4: {4: 1.0, 11: 1.0},  # text label 4 ties with 11: the first id (4) wins -> correct
    })
    sums = token_type_sums(logits, batch, COORD_IDS)
    assert (sums.text_tokens, sums.text_correct, sums.coord_tokens, sums.coord_correct) == (2, 2, 2, 1)
    text_loss = _ce(logits[0, 1], 3) + _ce(logits[0, 4], 4)
    coord_loss = _ce(logits[0, 2], 25) + _ce(logits[0, 3], 27)
    assert sums.text_loss == pytest.approx(text_loss, rel=1e-5)
    assert sums.coord_loss == pytest.approx(coord_loss, rel=1e-5)
    figures = sums.figures()
    assert figures["token_acc"] == pytest.approx(3 / 4) and figures["coord_token_acc"] == pytest.approx(1 / 2)
    assert figures["text_token_acc"] == 1.0
    assert figures["token_loss"] == pytest.approx((text_loss + coord_loss) / 4, rel=1e-5)
    assert figures["text_token_loss"] == pytest.approx(text_loss / 2, rel=1e-5)


def test_a_tie_below_the_label_is_not_a_hit():
    batch = _batch([7], ce_positions=[0], coord_positions=[], coord_targets=[])
    logits = _row_logits(3, {1: {2: 5.0, 7: 5.0}})  # id 2 comes first among the maxima
    assert token_type_sums(logits, batch, COORD_IDS).text_correct == 0


@pytest.mark.parametrize(("target", "hit_bin"), [(5.4, 5), (5.6, 6), (999.0, 999), (0.2, 0)])
def test_a_coord_slot_is_scored_against_the_token_of_its_rounded_target_bin(target, hit_bin):
    batch = _batch([20 + 5], ce_positions=[], coord_positions=[0], coord_targets=[target])
    logits = _row_logits(3, {1: {20 + hit_bin: 3.0}})
    sums = token_type_sums(logits, batch, COORD_IDS)
    assert sums.coord_correct == 1 and sums.coord_loss == pytest.approx(_ce(logits[0, 1], 20 + hit_bin), rel=1e-5)


def test_non_finite_logits_are_fenced_like_the_objective():
    batch = _batch([3, 4], ce_positions=[0, 1], coord_positions=[], coord_targets=[])
    logits = _row_logits(4, {1: {3: float("nan"), 5: 1.0}, 2: {4: float("inf")}})
    sums = token_type_sums(logits, batch, COORD_IDS)
    assert math.isfinite(sums.text_loss) and sums.text_correct == 1  # +inf clamps to the top: the label wins


def test_no_supervised_tokens_gives_no_figure():
    batch = _batch([3], ce_positions=[], coord_positions=[], coord_targets=[])
    sums = token_type_sums(torch.randn(1, 3, VOCAB), batch, COORD_IDS)
    assert sums == TokenTypeSums() and sums.figures() == {}
    text_only = TokenTypeSums(text_tokens=2, text_correct=1, text_loss=3.0)
    assert set(text_only.figures()) == {"token_acc", "token_loss", "text_token_acc", "text_token_loss"}


def test_the_figures_read_only_the_supervised_rows():
    """Padding and prompt logits may hold anything: the figures do not move."""
    batch = _batch([3, 20 + 9], ce_positions=[0], coord_positions=[1], coord_targets=[9.0], seq_len=8)
    logits = torch.randn(1, 8, VOCAB, generator=torch.Generator().manual_seed(0))
    before = token_type_sums(logits, batch, COORD_IDS)
    logits[0, [0, 4, 5, 6, 7]] = torch.randn(5, VOCAB) * 100
    assert token_type_sums(logits, batch, COORD_IDS) == before


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), n_text=st.integers(0, 6), n_coord=st.integers(0, 6), chunk=st.integers(1, 9),
       half=st.booleans())
def test_sums_do_not_depend_on_chunking_dtype_or_how_positions_are_split(seed, n_text, n_coord, chunk, half):
    gen = torch.Generator().manual_seed(seed)
    n = n_text + n_coord
    ids = torch.randint(0, VOCAB, (max(n, 1),), generator=gen).tolist()
    order = torch.randperm(max(n, 1), generator=gen).tolist()
    text_pos, coord_pos = sorted(order[:n_text]), sorted(order[n_text:n])
    targets = (torch.rand(n_coord, generator=gen) * 999).tolist()
    logits = torch.randn(1, 2 + max(n, 1), VOCAB, generator=gen) * 3
    if half:
        logits = logits.bfloat16()
    whole = _batch(ids, text_pos, coord_pos, targets)
    reference = token_type_sums(logits, whole, COORD_IDS)
    assert token_type_sums(logits, whole, COORD_IDS, chunk_rows=chunk).to_list() == pytest.approx(reference.to_list())
    # the same positions as two batches (text alone, coord alone): the sums add up to the whole
    text_only = _batch(ids, text_pos, [], [])
    coord_only = _batch(ids, [], coord_pos, targets)
    added = token_type_sums(logits, text_only, COORD_IDS) + token_type_sums(logits, coord_only, COORD_IDS)
    assert added.to_list() == pytest.approx(reference.to_list())
    assert TokenTypeSums.from_list(reference.to_list()) == reference
    # an independent reference: argmax and log-softmax of every supervised row
    flat = logits.float().reshape(-1, VOCAB)
    hits = 0
    for position, label in [(p, ids[p]) for p in text_pos]:
        hits += int(int(flat[1 + position].argmax()) == label)
    assert reference.text_correct == hits and reference.text_tokens == n_text
    bins = [int(np.clip(np.rint(np.float32(t)), 0, 999)) for t in targets]
    expected = sum(_ce(flat[1 + p], 20 + b) for p, b in zip(coord_pos, bins))
    assert reference.coord_loss == pytest.approx(expected, rel=1e-4, abs=1e-4)


def test_mismatched_layout_is_refused():
    batch = _batch([3], ce_positions=[0], coord_positions=[], coord_targets=[])
    with pytest.raises(ValueError, match="does not match the supervision batch"):
        token_type_sums(torch.zeros(1, 5, VOCAB), batch, COORD_IDS)


def test_training_rows_queue_their_sums_on_the_device_and_the_window_reads_them_once(monkeypatch):
    """Issue 36 item 7: each trained row's figures used to be six host reads (``float`` per sum); now a row adds a
    device tensor and the logging window reads the six sums once."""
    from coordexp.runtime.model.token_types import TokenTypeWindow, token_type_totals

    ids = [3, 20 + 5, 20 + 7, 4]
    batch = _batch(ids, ce_positions=[0, 3], coord_positions=[1, 2], coord_targets=[5.0, 7.0])
    logits = torch.randn(1, 6, VOCAB, generator=torch.Generator().manual_seed(3))
    expected = token_type_sums(logits, batch, COORD_IDS)

    def host_read(self, *args, **kwargs):
        raise AssertionError("a host read of a device value inside a training row's token figures")

    for name in ("__float__", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    window = TokenTypeWindow()
    for _ in range(3):
        window += token_type_totals(logits, batch, COORD_IDS)
    monkeypatch.undo()
    assert window.to_list() == pytest.approx((expected + expected + expected).to_list())
    assert TokenTypeWindow().to_list() == TokenTypeSums().to_list()
