"""OT: log-domain Sinkhorn marginals and stability, barycentric projection targets in the predicted slot order."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linear_sum_assignment

from coordexp.runtime.core.objects import DetObject
from coordexp.runtime.core.ot import _sinkhorn_batch, barycentric_targets, ground_cost, pair_coord_targets, sinkhorn_plan
from coordexp.schema.matching import OtConfig


def box(x1: int, y1: int, x2: int, y2: int) -> DetObject:
    return DetObject("box", "bbox_2d", (x1, y1, x2, y2))


def poly(*coords: int) -> DetObject:
    return DetObject("poly", "poly", tuple(coords))


# ------------------------------------------------------------------------------------------------- Sinkhorn


def test_plan_marginals_sum_correctly():
    rng = np.random.default_rng(0)
    cost = rng.uniform(0, 50, size=(5, 7))
    plan = sinkhorn_plan(cost, epsilon=10.0, iters=500)
    assert (plan >= 0).all()
    np.testing.assert_allclose(plan.sum(axis=0), 1 / 7, atol=1e-12)  # the column update runs last: exact
    np.testing.assert_allclose(plan.sum(axis=1), 1 / 5, atol=1e-9)  # rows: converged
    assert plan.sum() == pytest.approx(1.0, abs=1e-12)


def test_single_row_plan_is_the_column_marginal():
    plan = sinkhorn_plan(np.array([[3.0, 0.0, 7.0]]), epsilon=1.0, iters=1)
    np.testing.assert_allclose(plan, [[1 / 3, 1 / 3, 1 / 3]], atol=1e-15)


def test_symmetric_two_by_two_hand_computed():
    # Cost [[0, c], [c, 0]]: by symmetry T = [[p, q], [q, p]] / 2 with p / q = exp(c / eps), p + q = 1.
    c, eps = 10.0, 5.0
    plan = sinkhorn_plan(np.array([[0.0, c], [c, 0.0]]), epsilon=eps, iters=5)
    p = 1 / (1 + np.exp(-c / eps))
    np.testing.assert_allclose(plan, np.array([[p, 1 - p], [1 - p, p]]) / 2, atol=1e-12)


def test_tiny_epsilon_is_stable_and_approaches_the_assignment():
    rng = np.random.default_rng(1)
    cost = rng.uniform(0, 1000, size=(6, 6))
    plan = sinkhorn_plan(cost, epsilon=1e-6, iters=50)
    assert np.isfinite(plan).all()
    np.testing.assert_allclose(plan.sum(axis=0), 1 / 6, atol=1e-12)
    # Near eps -> 0 the plan concentrates on the optimal assignment (each row's mass sits on its assigned column).
    rows, cols = linear_sum_assignment(cost)
    np.testing.assert_array_equal(plan.argmax(axis=1)[rows], cols)
    assert (plan[rows, cols] > 0.16).all()


def test_invalid_sinkhorn_arguments_fail_clearly():
    with pytest.raises(ValueError, match=r"epsilon must be a finite number > 0, got 0.0 \(rollout_matching.ot.epsilon\)"):
        sinkhorn_plan(np.ones((2, 2)), epsilon=0.0, iters=3)
    with pytest.raises(ValueError, match=r"iters must be >= 1"):
        sinkhorn_plan(np.ones((2, 2)), epsilon=1.0, iters=0)
    with pytest.raises(ValueError, match=r"finite, non-empty 2-D"):
        sinkhorn_plan(np.array([[np.inf, 1.0]]), epsilon=1.0, iters=3)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6)), min_size=1, max_size=5),
    spread=st.floats(1.0, 90.0),
    iters=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_exp_domain_path_equals_log_domain_path_on_padded_batches(sizes, spread, iters, seed):
    rng = np.random.default_rng(seed)
    n, m = max(s[0] for s in sizes), max(s[1] for s in sizes)
    scaled = rng.uniform(0, spread, size=(len(sizes), n, m))
    n_rows, n_cols = np.array([s[0] for s in sizes]), np.array([s[1] for s in sizes])
    plan_fast, weights_fast = _sinkhorn_batch(scaled, n_rows, n_cols, iters)
    plan_log, weights_log = _sinkhorn_batch(scaled, n_rows, n_cols, iters, force_log=True)
    np.testing.assert_allclose(plan_fast, plan_log, rtol=1e-9, atol=1e-300)
    np.testing.assert_allclose(weights_fast, weights_log, rtol=1e-9, atol=1e-12)
    for b, (rows, cols) in enumerate(sizes):  # padding receives no mass; each item is its own unpadded problem
        assert plan_log[b, rows:].sum() == 0 and plan_log[b, :, cols:].sum() == 0
        alone = sinkhorn_plan(scaled[b, :rows, :cols], epsilon=1.0, iters=iters)
        np.testing.assert_allclose(plan_log[b, :rows, :cols], alone, rtol=1e-12)


# ---------------------------------------------------------------------------------------- barycentric targets


def test_bbox_to_bbox_returns_the_gt_bins():
    targets = barycentric_targets(box(10, 20, 30, 40), box(100, 120, 300, 340), OtConfig())
    assert targets.dtype == np.float64
    np.testing.assert_array_equal(targets, [100.0, 120.0, 300.0, 340.0])


def test_poly_onto_itself_is_identity_for_small_epsilon():
    shape = poly(100, 100, 400, 120, 500, 400, 300, 600, 120, 450)
    targets = barycentric_targets(shape, shape, OtConfig(epsilon=1.0, iters=50))
    np.testing.assert_allclose(targets, shape.coords, atol=1e-6)


def test_square_poly_onto_triangle_matches_the_reference_numbers():
    # Reference (upstream, eps 10, 30 iters): corners project to (100,100), (199.7,100), (133.6,133.6), (100,199.7).
    square = poly(100, 100, 200, 100, 200, 200, 100, 200)
    triangle = poly(100, 100, 200, 100, 100, 200)
    targets = barycentric_targets(square, triangle, OtConfig())
    np.testing.assert_allclose(targets, [100, 100, 199.7, 100, 133.6, 133.6, 100, 199.7], atol=0.1)


def test_bbox_pred_onto_poly_takes_the_box_of_its_projected_corners():
    triangle = poly(100, 100, 200, 100, 100, 200)
    targets = barycentric_targets(box(100, 100, 200, 200), triangle, OtConfig())
    # Same projections as above: min / max over the corners -> the triangle's bounding box.
    np.testing.assert_allclose(targets, [100, 100, 199.7, 199.7], atol=0.1)
    assert targets.shape == (4,)


def test_poly_pred_onto_bbox_gt_has_one_target_per_pred_slot():
    pred = poly(90, 90, 210, 95, 205, 210, 95, 205, 60, 150)
    targets = barycentric_targets(pred, box(100, 100, 200, 200), OtConfig())
    assert targets.shape == (10,)
    assert ((targets >= 100) & (targets <= 200)).all()  # convex combinations of the GT corners


def test_l1_and_l2_ground_costs():
    a, b = np.array([[0.0, 0.0]]), np.array([[3.0, 4.0], [1.0, 0.0]])
    np.testing.assert_array_equal(ground_cost(a, b, "l1"), [[7.0, 1.0]])
    np.testing.assert_array_equal(ground_cost(a, b, "l2"), [[5.0, 1.0]])
    with pytest.raises(ValueError, match="expected 'l1' or 'l2'"):
        ground_cost(a, b, "cosine")


def test_l1_and_l2_give_different_targets():
    pred = poly(0, 0, 600, 0, 300, 500)
    gt = poly(100, 400, 500, 100, 250, 250, 700, 600)
    l1 = barycentric_targets(pred, gt, OtConfig(cost="l1", epsilon=20.0))
    l2 = barycentric_targets(pred, gt, OtConfig(cost="l2", epsilon=20.0))
    assert np.abs(l1 - l2).max() > 1.0


def test_targets_are_clamped_into_the_coord_range():
    targets = barycentric_targets(poly(-40, -40, 1200, 0, 500, 1300), poly(0, 0, 999, 0, 500, 999), OtConfig())
    assert (targets >= 0).all() and (targets <= 999).all()
    np.testing.assert_array_equal(barycentric_targets(box(0, 0, 5, 5), box(-3, 2, 1004, 9), OtConfig()), [0, 2, 999, 9])


def test_tiny_epsilon_targets_have_no_nan():
    pred = poly(0, 0, 999, 0, 999, 999, 0, 999)
    gt = poly(10, 10, 900, 30, 500, 950)
    targets = barycentric_targets(pred, gt, OtConfig(epsilon=1e-4, iters=20))
    assert np.isfinite(targets).all()


def test_malformed_objects_fail_with_the_role_and_the_fix():
    with pytest.raises(ValueError, match=r"predicted poly 'poly' has 4 coords; expected an even count >= 6"):
        barycentric_targets(poly(1, 2, 3, 4), box(1, 1, 2, 2), OtConfig())
    with pytest.raises(ValueError, match=r"ground-truth bbox_2d 'box' has 5 coords"):
        barycentric_targets(poly(1, 2, 3, 4, 5, 6), DetObject("box", "bbox_2d", (1, 2, 3, 4, 5)), OtConfig())

    with pytest.raises(ValueError, match=r"ground-truth bbox_2d 'box' has 3 coords"):  # box<->box pairs are checked too
        pair_coord_targets([box(1, 1, 2, 2)], [DetObject("box", "bbox_2d", (1, 2, 3))], [(0, 0)], OtConfig())


def test_box_pairs_among_poly_pairs_keep_pair_order_and_take_the_clamped_gt_bins():
    preds = [box(0, 0, 5, 5), poly(0, 0, 9, 0, 0, 9), box(7, 7, 9, 9)]
    gts = [box(-3, 2, 1004, 9), poly(0, 0, 9, 0, 0, 9), box(1, 2, 3, 4)]
    targets = pair_coord_targets(preds, gts, [(2, 2), (1, 1), (0, 0)], OtConfig())
    assert list(targets) == [(2, 2), (0, 0), (1, 1)]  # box pairs in pair order, then the OT batch
    np.testing.assert_array_equal(targets[(2, 2)], [1.0, 2.0, 3.0, 4.0])
    np.testing.assert_array_equal(targets[(0, 0)], [0.0, 2.0, 999.0, 9.0])
    assert targets[(0, 0)].dtype == np.float64 and targets[(0, 0)].shape == (4,)


coord = st.integers(0, 999)
objects = st.one_of(
    st.tuples(coord, coord, coord, coord).map(lambda c: box(min(c[0], c[2]), min(c[1], c[3]), max(c[0], c[2]), max(c[1], c[3]))),
    st.lists(st.tuples(coord, coord), min_size=3, max_size=9).map(lambda pts: poly(*(v for p in pts for v in p))),
)


@settings(max_examples=40, deadline=None)
@given(
    pairs=st.lists(st.tuples(objects, objects), min_size=1, max_size=6),
    cost=st.sampled_from(["l1", "l2"]),
    epsilon=st.sampled_from([0.5, 10.0, 200.0]),
)
def test_batched_targets_equal_per_pair_targets_and_stay_in_the_gt_extent(pairs, cost, epsilon):
    cfg = OtConfig(cost=cost, epsilon=epsilon, iters=15)
    preds, gts = [p for p, _ in pairs], [g for _, g in pairs]
    batched = pair_coord_targets(preds, gts, [(i, i) for i in range(len(pairs))], cfg)
    assert sorted(batched) == [(i, i) for i in range(len(pairs))]
    for i, (pred, gt) in enumerate(pairs):
        single = barycentric_targets(pred, gt, cfg)
        np.testing.assert_allclose(batched[(i, i)], single, rtol=1e-9, atol=1e-9)
        assert single.shape == (len(pred.coords),)
        gt_pts = gt.points()
        lo, hi = gt_pts.min(axis=0), gt_pts.max(axis=0)
        xy = single.reshape(-1, 2)
        assert (xy >= lo - 1e-6).all() and (xy <= hi + 1e-6).all()


@settings(max_examples=30, deadline=None)
@given(
    pred=st.lists(st.tuples(st.integers(0, 600), st.integers(0, 600)), min_size=3, max_size=6),
    gt=st.lists(st.tuples(st.integers(0, 600), st.integers(0, 600)), min_size=3, max_size=6),
    dx=st.integers(0, 399),
    dy=st.integers(0, 399),
)
def test_targets_translate_with_the_pair(pred, gt, dx, dy):
    cfg = OtConfig(iters=10)
    flat = lambda pts, ox, oy: poly(*(v for x, y in pts for v in (x + ox, y + oy)))  # noqa: E731
    base = barycentric_targets(flat(pred, 0, 0), flat(gt, 0, 0), cfg)
    moved = barycentric_targets(flat(pred, dx, dy), flat(gt, dx, dy), cfg)
    np.testing.assert_allclose(moved - base, np.tile([dx, dy], len(pred)), atol=1e-7)
