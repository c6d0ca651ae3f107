"""Hungarian matching of predictions to ground truth with AABB candidates and maskIoU gating (docs/design.md, matching).

Pipeline per sample: clamp every coordinate to [0, 999] -> AABB IoU -> top-k GT candidates per prediction ->
rasterise every shape once on an ``R x R`` canvas -> maskIoU of candidate pairs -> gate (``maskIoU < gate`` is
infeasible) -> Hungarian on a dummy-augmented square matrix -> pairs, FN GT indices, FP pred indices.

Raster convention (decision 9): a norm1000 value ``v`` maps to canvas units ``v * R / 1000``; pixel ``(row, col)``
is inside a shape when its centre ``(col + 0.5, row + 0.5)`` is inside the polygon under the **even-odd** rule
(a ``bbox_2d`` is its 4-corner quadrilateral, a ``poly`` one ring). Edges are half-open, so two shapes that only
touch share no pixel and a zero-area shape rasterises to an empty mask. The maskIoU of two empty masks is 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment

from coordexp.runtime.core.objects import DetObject
from coordexp.schema.matching import MatchingConfig

__all__ = [
    "MatchCosts",
    "MatchResult",
    "aabb_iou_matrix",
    "assignment_matrix",
    "candidate_mask",
    "compute_match_costs",
    "mask_iou_matrix",
    "match_objects",
    "rasterize",
]

COORD_MAX = 999


# --------------------------------------------------------------------------------------------------- geometry


def _check_coords(obj: DetObject) -> None:
    n = len(obj.coords)
    if obj.geometry == "bbox_2d":
        if n != 4:
            raise ValueError(f"bbox_2d of object {obj.desc!r} has {n} coords; expected exactly 4 (x1, y1, x2, y2).")
    elif obj.geometry == "poly":
        if n < 6 or n % 2:
            raise ValueError(
                f"poly of object {obj.desc!r} has {n} coords; expected an even count >= 6 (at least 3 x, y vertices)."
            )
    else:
        raise ValueError(f"object {obj.desc!r} has unknown geometry {obj.geometry!r}; expected 'bbox_2d' or 'poly'.")


@dataclass(frozen=True)
class _Rings:
    """All shapes of a list as one ring table: clamped vertices ``(V, 2)`` and each ring's first vertex and size."""

    points: np.ndarray
    starts: np.ndarray
    counts: np.ndarray
    is_rect: np.ndarray  # bool (n,): a bbox_2d, whose raster is one column range on every row it covers

    @classmethod
    def of(cls, objects: Sequence[DetObject]) -> _Rings:
        flat: list[int] = []
        counts: list[int] = []
        is_rect: list[bool] = []
        for obj in objects:
            c = obj.coords
            if obj.geometry == "bbox_2d" and len(c) == 4:
                x1, y1, x2, y2 = c
                flat += (x1, y1, x2, y1, x2, y2, x1, y2)
                counts.append(4)
                is_rect.append(True)
            else:
                _check_coords(obj)
                flat += c
                counts.append(len(c) // 2)
                is_rect.append(False)
        points = np.array(flat, dtype=np.int64).reshape(-1, 2)
        np.minimum(np.maximum(points, 0, out=points), COORD_MAX, out=points)  # np.clip without its overhead
        n = np.array(counts, dtype=np.int64)
        return cls(points=points, starts=np.cumsum(n) - n, counts=n, is_rect=np.array(is_rect, dtype=bool))

    def aabbs(self) -> np.ndarray:
        """``(n, 4)`` as ``x_min, y_min, x_max, y_max``; swapped bbox corners are canonicalised."""
        if len(self.counts) == 0:
            return np.zeros((0, 4), dtype=np.int64)
        lo = np.minimum.reduceat(self.points, self.starts, axis=0)
        hi = np.maximum.reduceat(self.points, self.starts, axis=0)
        return np.concatenate([lo, hi], axis=1)


def _aabbs(objects: Sequence[DetObject]) -> np.ndarray:
    return _Rings.of(objects).aabbs()


def _pairwise_aabb_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    ax0, ay0, ax1, ay1 = np.ascontiguousarray(a.T, dtype=np.float64)
    bx0, by0, bx1, by1 = np.ascontiguousarray(b.T, dtype=np.float64)
    iw = np.maximum(np.minimum(ax1[:, None], bx1[None, :]) - np.maximum(ax0[:, None], bx0[None, :]), 0.0)
    ih = np.maximum(np.minimum(ay1[:, None], by1[None, :]) - np.maximum(ay0[:, None], by0[None, :]), 0.0)
    inter = iw * ih
    union = ((ax1 - ax0) * (ay1 - ay0))[:, None] + ((bx1 - bx0) * (by1 - by0))[None, :] - inter
    return np.divide(inter, union, out=np.zeros(inter.shape), where=union > 0)


def aabb_iou_matrix(preds: Sequence[DetObject], gts: Sequence[DetObject]) -> np.ndarray:
    """Continuous IoU ``(P, G)`` of the clamped axis-aligned bounding boxes; 0 where the union is empty."""
    return _pairwise_aabb_iou(_aabbs(preds), _aabbs(gts))


def candidate_mask(
    pred_aabbs: np.ndarray, gt_aabbs: np.ndarray, top_k: int, aabb_iou: np.ndarray | None = None
) -> np.ndarray:
    """Boolean ``(P, G)``: the ``top_k`` GT candidates of each prediction.

    GTs are ranked by (AABB IoU descending, squared centre distance ascending, GT index ascending), so positive-IoU
    GTs come first and, when fewer than ``top_k`` overlap (or none does), the rest is filled by the nearest centres.
    """
    n_pred, n_gt = len(pred_aabbs), len(gt_aabbs)
    if top_k >= n_gt:
        return np.ones((n_pred, n_gt), dtype=bool)
    if n_pred == 0:
        return np.zeros((0, n_gt), dtype=bool)
    iou = _pairwise_aabb_iou(pred_aabbs, gt_aabbs) if aabb_iou is None else aabb_iou
    # A partition instead of two full sorts: every GT above the top_k-th largest IoU is in; GTs tied with it are
    # in when they all fit, else the nearest centres among them (then the lowest index) fill the remaining places.
    kth = np.partition(iou, n_gt - top_k, axis=1)[:, n_gt - top_k, None]
    above = iou > kth
    tied = iou == kth
    need = top_k - above.sum(axis=1)
    mask = above | tied
    over = np.flatnonzero(tied.sum(axis=1) > need)
    if len(over):
        pa, ga = pred_aabbs[over], gt_aabbs
        pc = (pa[:, :2] + pa[:, 2:]).T.astype(np.float64)  # doubled centres: same order, exact
        gc = (ga[:, :2] + ga[:, 2:]).T.astype(np.float64)
        dist2 = (pc[0][:, None] - gc[0][None, :]) ** 2 + (pc[1][:, None] - gc[1][None, :]) ** 2
        exact = pred_aabbs.dtype.kind in "iu" and gt_aabbs.dtype.kind in "iu" and dist2.max() * n_gt < 2.0**52
        if exact:  # integer distances: (distance, index) as one exact float key
            key = np.where(tied[over], dist2 * n_gt + np.arange(n_gt), np.inf)
            cut = np.sort(key, axis=1)[np.arange(len(over)), need[over] - 1]
            mask[over] = above[over] | (key <= cut[:, None])
        else:
            order = np.lexsort((dist2, ~tied[over]), axis=-1)  # tied first, by distance, then index (stable)
            rank = np.empty_like(order)
            np.put_along_axis(rank, order, np.broadcast_to(np.arange(n_gt), order.shape), axis=1)
            mask[over] = above[over] | (rank < need[over, None])
    return mask


# ------------------------------------------------------------------------------------------------ rasterising


@dataclass(frozen=True)
class _RowSpans:
    """Rasterised shapes as runs of set pixels per canvas row (no ``n x R x R`` canvas is ever built).

    Shape ``s`` owns canvas rows ``first[s] .. end[s] - 1``, numbered ``base[s] + row - first[s]`` in a global
    row table; global row ``g`` holds spans ``ptr[g] .. ptr[g + 1] - 1`` (``count[g]`` of them), each the pixel
    columns ``[start, stop)``, sorted and disjoint.
    """

    base: np.ndarray  # int64 (n,)
    first: np.ndarray  # int64 (n,)
    end: np.ndarray  # int64 (n,)
    ptr: np.ndarray  # int64 (rows + 1,)
    count: np.ndarray  # int64 (rows,)
    start: np.ndarray  # int64 (spans,)
    stop: np.ndarray  # int64 (spans,)
    areas: np.ndarray  # int64 (n,), set pixels per shape
    covered: np.ndarray  # int64 (rows + 1,), set pixels in the global rows before each row

    def dense(self, resolution: int) -> np.ndarray:
        """Boolean canvas ``(n, R, R)`` via a difference array over the spans."""
        n = len(self.base)
        span_row = np.repeat(np.arange(len(self.count)), self.count)
        shape = np.searchsorted(self.base, span_row, side="right") - 1
        canvas_row = span_row - self.base[shape] + self.first[shape]
        diff = np.zeros((n, resolution, resolution + 1), dtype=np.int32)
        np.add.at(diff, (shape, canvas_row, self.start), 1)
        np.add.at(diff, (shape, canvas_row, self.stop), -1)
        return np.cumsum(diff, axis=-1)[..., :resolution] > 0


def _row_range(y_lo: np.ndarray, y_hi: np.ndarray, resolution: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel rows ``[first, end)`` whose centre ``r + 0.5`` lies in ``[y_lo, y_hi)`` (norm1000 ints), exactly."""
    first = -((1000 - 2 * resolution * y_lo) // 2000)  # ceil((2 R y_lo - 1000) / 2000)
    end = -((1000 - 2 * resolution * y_hi) // 2000)
    return first, end


def _ragged_arange(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For counts ``[2, 3]``: owners ``[0, 0, 1, 1, 1]`` and positions within each owner ``[0, 1, 0, 1, 2]``."""
    owner = np.repeat(np.arange(len(counts)), counts)
    position = np.arange(len(owner)) - (np.cumsum(counts) - counts)[owner]
    return owner, position


def _first_col(x: np.ndarray, resolution: int) -> np.ndarray:
    """First pixel column right of a vertical edge at norm1000 ``x``: centre ``(2c + 1) * 1000 > 2 R x``, exactly."""
    col = (2 * resolution * x - 1000) // 2000 + 1
    return np.minimum(np.maximum(col, 0, out=col), resolution, out=col)  # np.clip, without its Python overhead


def _poly_spans(
    rings: _Rings, polys: np.ndarray, row_offset: np.ndarray, resolution: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Global row, start and stop of the spans of rings ``polys`` (even-odd scanline), sorted by row then column.

    Ring ``polys[i]``'s canvas row ``r`` is global row ``row_offset[i] + r``. The crossings of every edge with the
    pixel-row centres it spans are sorted and paired (even-odd rule; the half-open edge rule makes every count
    even): each pair covers the pixel centres between them.
    """
    counts = rings.counts[polys]
    ring_of, k = _ragged_arange(counts)
    vertex = rings.starts[polys][ring_of] + k
    following = np.where(k == counts[ring_of] - 1, vertex - k, vertex + 1)  # the last vertex closes the ring
    x0, y0 = rings.points[vertex].T
    x1, y1 = rings.points[following].T
    # Rows whose centre lies in [y_lo, y_hi): half-open, so a vertex shared by two edges counts once.
    row_first, row_end = _row_range(np.minimum(y0, y1), np.maximum(y0, y1), resolution)
    n_rows = np.maximum(row_end - row_first, 0)
    # Pixel c lies right of the crossing at row r when (2c + 1) * 1000 * |dy| > s * num(r) (s = sign(dy)), where
    # num(r) / dy is 2R times the crossing's x in norm1000 units at the row centre, linear in r: the first such c is
    # (const + slope * k) // (2000 |dy|) + 1 at the edge's k-th row, with both terms per edge (exact integers).
    dx, dy = x1 - x0, y1 - y0
    sign = np.sign(dy)
    slope = sign * 2000 * dx
    const = sign * (2 * resolution * x0 * dy + (1000 - 2 * resolution * y0) * dx) - 1000 * np.abs(dy)
    const += slope * row_first
    stride = resolution + 1
    row_key = (row_offset[ring_of] + row_first) * stride  # the sort key of the edge's first row, column 0
    offset = np.arange(int(n_rows.sum())) - np.repeat(np.cumsum(n_rows) - n_rows, n_rows)  # k, per edge row
    first_col = np.repeat(const, n_rows)
    first_col += np.repeat(slope, n_rows) * offset
    first_col //= np.repeat(2000 * np.abs(dy), n_rows)
    first_col += 1
    np.minimum(np.maximum(first_col, 0, out=first_col), resolution, out=first_col)
    first_col += np.repeat(row_key, n_rows) + offset * stride
    # Sorting values (not an argsort), so the kind cannot change the result; timsort runs on the per-edge runs.
    events = np.sort(first_col, kind="stable")
    span_row, start = np.divmod(events[0::2], stride)
    stop = events[1::2] - span_row * stride
    nonempty = stop > start
    return span_row[nonempty], start[nonempty], stop[nonempty]


def _rasterize_rings(
    rings: _Rings, resolution: int, selected: np.ndarray | None = None, aabbs: np.ndarray | None = None
) -> _RowSpans:
    """Row spans of the rings in ``selected`` (all when None), in that order; ``aabbs`` are ``rings.aabbs()``.

    Scanline fill (:func:`_poly_spans`), vectorised over all edges of all shapes. Integer arithmetic throughout:
    canvas x = v * R / 1000 and pixel centres sit at odd halves, so scaling by 2000 makes every comparison exact
    (no float ties on a centre). A bbox is an axis-aligned rectangle: its two vertical edges give the same column
    range on every row, so its spans are written directly instead of being sorted out of crossings.
    """
    if resolution < 1:
        raise ValueError(f"raster resolution must be >= 1, got {resolution}.")
    if selected is None:
        selected = np.arange(len(rings.counts))
    aabbs = (rings.aabbs() if aabbs is None else aabbs)[selected]
    shape_first, shape_end = _row_range(aabbs[:, 1], aabbs[:, 3], resolution)
    height = np.maximum(shape_end - shape_first, 0)
    base = np.cumsum(height) - height
    is_rect = rings.is_rect[selected]
    poly_slots = np.flatnonzero(~is_rect)
    span_row, start, stop = _poly_spans(
        rings, selected[poly_slots], (base - shape_first)[poly_slots], resolution
    )
    rect_slots = np.flatnonzero(is_rect)
    if len(rect_slots):  # one span [left, right) on each row of a rectangle (none when the column range is empty)
        left = _first_col(aabbs[rect_slots, 0], resolution)
        right = _first_col(aabbs[rect_slots, 2], resolution)
        rect_height = np.where(right > left, height[rect_slots], 0)
        rect_of, rect_offset = _ragged_arange(rect_height)
        rect_row = base[rect_slots][rect_of] + rect_offset
        # Shapes own disjoint global rows, so the two row-sorted span lists merge by counting (no second sort).
        poly_row, poly_start, poly_stop = span_row, start, stop
        total = len(poly_row) + len(rect_row)
        span_row = np.empty(total, dtype=np.int64)
        start = np.empty(total, dtype=np.int64)
        stop = np.empty(total, dtype=np.int64)
        at_poly = np.arange(len(poly_row)) + np.searchsorted(rect_row, poly_row)
        at_rect = np.arange(len(rect_row)) + np.searchsorted(poly_row, rect_row)
        span_row[at_poly], start[at_poly], stop[at_poly] = poly_row, poly_start, poly_stop
        span_row[at_rect], start[at_rect], stop[at_rect] = rect_row, left[rect_of], right[rect_of]
    n_rows = int(height.sum())
    count = np.bincount(span_row, minlength=n_rows)
    ptr = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(count, out=ptr[1:])
    covered = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(span_row, weights=stop - start, minlength=n_rows).astype(np.int64), out=covered[1:])
    return _RowSpans(
        base=base, first=shape_first, end=shape_end, ptr=ptr, count=count, start=start, stop=stop,
        areas=covered[base + height] - covered[base], covered=covered,
    )


def rasterize(objects: Sequence[DetObject], resolution: int) -> np.ndarray:
    """Boolean masks ``(n, R, R)``, indexed ``[shape, row (y), column (x)]``; see the module doc for the convention."""
    return _rasterize_rings(_Rings.of(objects), resolution).dense(resolution)


def _pair_mask_iou(spans: _RowSpans, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """maskIoU of shape pairs ``(left[i], right[i])``: span overlaps summed over the rows both shapes cover."""
    first = np.maximum(spans.first[left], spans.first[right])
    n_rows = np.maximum(np.minimum(spans.end[left], spans.end[right]) - first, 0)
    pair_of_row, offset = _ragged_arange(n_rows)
    canvas_row = first[pair_of_row] + offset
    lo, ro = left[pair_of_row], right[pair_of_row]
    row_a = spans.base[lo] - spans.first[lo] + canvas_row
    row_b = spans.base[ro] - spans.first[ro] + canvas_row
    count_a, count_b = spans.count[row_a], spans.count[row_b]
    if count_a.max(initial=0) <= 1 and count_b.max(initial=0) <= 1:  # convex shapes: at most one span per row
        both = (count_a * count_b).astype(bool)
        ia, ib, owner = spans.ptr[row_a][both], spans.ptr[row_b][both], pair_of_row[both]
    else:  # every span of row a against every span of row b
        combo_row, k = _ragged_arange(count_a * count_b)
        ia = spans.ptr[row_a][combo_row] + k // count_b[combo_row]
        ib = spans.ptr[row_b][combo_row] + k % count_b[combo_row]
        owner = pair_of_row[combo_row]
    overlap = np.minimum(spans.stop[ia], spans.stop[ib]) - np.maximum(spans.start[ia], spans.start[ib])
    inter = np.bincount(owner, weights=np.maximum(overlap, 0), minlength=len(left))
    union = spans.areas[left] + spans.areas[right] - inter
    return np.divide(inter, union, out=np.zeros(len(left)), where=union > 0)


def _rect_pair_iou(rows: np.ndarray, cols: np.ndarray, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """maskIoU of bbox pairs in closed form: each raster is the product of a row range and a column range."""
    rows_lo, rows_hi, cols_lo, cols_hi = rows[:, 0], rows[:, 1], cols[:, 0], cols[:, 1]
    area = np.maximum(rows_hi - rows_lo, 0) * np.maximum(cols_hi - cols_lo, 0)
    inter_rows = np.minimum(rows_hi[left], rows_hi[right]) - np.maximum(rows_lo[left], rows_lo[right])
    inter_cols = np.minimum(cols_hi[left], cols_hi[right]) - np.maximum(cols_lo[left], cols_lo[right])
    inter = np.maximum(inter_rows, 0) * np.maximum(inter_cols, 0)
    union = area[left] + area[right] - inter
    return np.divide(inter, union, out=np.zeros(len(left)), where=union > 0)


def _candidate_mask_iou(
    rings: _Rings, aabbs: np.ndarray, left: np.ndarray, right: np.ndarray, resolution: int
) -> np.ndarray:
    """maskIoU of ring pairs ``(left[i], right[i])``: bbox pairs in closed form, the rest from polygon row spans.

    Only polygons are rasterised: a box's raster is a row range times a column range, so a box-polygon overlap is
    the polygon's spans clipped to that rectangle (rasterising a large box would cost one span per row).
    """
    out = np.zeros(len(left))
    rows = -((1000 - 2 * resolution * aabbs[:, 1::2]) // 2000)  # (n, 2): pixel rows [first, end), as _row_range
    cols = _first_col(aabbs[:, 0::2], resolution)  # (n, 2): pixel columns [first, end)
    rect_left, rect_right = rings.is_rect[left], rings.is_rect[right]
    rect_pair = rect_left & rect_right
    if rect_pair.any():
        out[rect_pair] = _rect_pair_iou(rows, cols, left[rect_pair], right[rect_pair])
    if rect_pair.all():
        return out
    local = np.zeros(len(rings.counts), dtype=np.int64)
    local[left[~rect_left]] = 1
    local[right[~rect_right]] = 1
    used = np.flatnonzero(local)
    local[used] = np.arange(len(used))
    spans = _rasterize_rings(rings, resolution, used, aabbs)
    poly_pair = ~(rect_left | rect_right)
    if poly_pair.any():
        out[poly_pair] = _pair_mask_iou(spans, local[left[poly_pair]], local[right[poly_pair]])
    mixed = rect_left != rect_right
    if mixed.any():
        box_left = rect_left[mixed]
        boxes = np.where(box_left, left[mixed], right[mixed])
        polys = np.where(box_left, right[mixed], left[mixed])
        out[mixed] = _box_poly_iou(spans, local[polys], cols[polys], rows[boxes], cols[boxes])
    return out


def _box_poly_iou(
    spans: _RowSpans, polys: np.ndarray, poly_cols: np.ndarray, rows: np.ndarray, cols: np.ndarray
) -> np.ndarray:
    """maskIoU of rasterised shapes ``polys[i]`` (pixel columns within ``poly_cols[i]``) and the boxes of pixel
    ``rows[i]`` x ``cols[i]``: the shape's spans clipped to the box, or on the shared rows all of them when the
    box spans every column of the shape (a difference of cumulative row counts, no per-row work)."""
    rows_lo, rows_hi, cols_lo, cols_hi = rows[:, 0], rows[:, 1], cols[:, 0], cols[:, 1]
    box_area = np.maximum(rows_hi - rows_lo, 0) * np.maximum(cols_hi - cols_lo, 0)
    first = spans.first[polys]
    lo = np.maximum(first, rows_lo)
    n_rows = np.maximum(np.minimum(spans.end[polys], rows_hi) - lo, 0)
    row_lo = np.where(n_rows > 0, spans.base[polys] + lo - first, 0)  # global rows [row_lo, row_lo + n_rows)
    whole = (cols_lo <= poly_cols[:, 0]) & (cols_hi >= poly_cols[:, 1])
    inter = np.where(whole, spans.covered[row_lo + n_rows] - spans.covered[row_lo], 0).astype(np.float64)
    n_rows[whole] = 0
    span_lo = spans.ptr[row_lo]
    owner, offset = _ragged_arange(spans.ptr[row_lo + n_rows] - span_lo)  # a shape's rows hold consecutive spans
    span = span_lo[owner] + offset
    overlap = np.minimum(spans.stop[span], cols_hi[owner]) - np.maximum(spans.start[span], cols_lo[owner])
    inter += np.bincount(owner, weights=np.maximum(overlap, 0), minlength=len(polys))
    union = box_area + spans.areas[polys] - inter
    return np.divide(inter, union, out=np.zeros(len(polys)), where=union > 0)


def mask_iou_matrix(pred_masks: np.ndarray, gt_masks: np.ndarray) -> np.ndarray:
    """maskIoU ``(P, G)`` of boolean ``(P, R, R)`` and ``(G, R, R)`` masks via one count matmul; 0 for an empty union."""
    p = pred_masks.reshape(len(pred_masks), -1).astype(np.float32)
    g = gt_masks.reshape(len(gt_masks), -1).astype(np.float32)
    inter = p @ g.T
    union = p.sum(axis=1)[:, None] + g.sum(axis=1)[None, :] - inter
    return np.divide(inter, union, out=np.zeros_like(inter), where=union > 0).astype(np.float64)


# --------------------------------------------------------------------------------------------------- matching


@dataclass(frozen=True)
class MatchCosts:
    """Everything the assignment sees for one sample, kept for telemetry and tests.

    ``mask_iou`` is computed for candidate pairs only (0 elsewhere); ``feasible = candidate & mask_iou >= gate``.
    """

    aabb_iou: np.ndarray  # float (P, G)
    candidate: np.ndarray  # bool (P, G)
    mask_iou: np.ndarray  # float (P, G)
    feasible: np.ndarray  # bool (P, G)

    @property
    def gating_rejections(self) -> int:
        """Candidate pairs whose maskIoU fell below the gate (counted per pair, not per prediction)."""
        return int((self.candidate & ~self.feasible).sum())


@dataclass(frozen=True)
class MatchResult:
    """Outcome of matching one sample; every GT is in exactly one pair or in ``fn_gt_indices``, every pred likewise with FP."""

    pairs: tuple[tuple[int, int], ...]  # (pred_idx, gt_idx), sorted by pred_idx
    fn_gt_indices: tuple[int, ...]  # sorted; appended as the FN tail
    fp_pred_indices: tuple[int, ...]  # sorted
    gating_rejections: int  # candidate pairs with maskIoU < gate
    n_candidates: int  # candidate pairs considered (P * min(top_k, G))


def compute_match_costs(preds: Sequence[DetObject], gts: Sequence[DetObject], cfg: MatchingConfig) -> MatchCosts:
    """AABB IoU, top-k candidates, maskIoU of candidates (one raster per shape) and the gate, for one sample."""
    rings = _Rings.of([*preds, *gts])
    all_aabbs = rings.aabbs()
    pred_aabbs, gt_aabbs = all_aabbs[: len(preds)], all_aabbs[len(preds) :]
    aabb_iou = _pairwise_aabb_iou(pred_aabbs, gt_aabbs)
    candidate = candidate_mask(pred_aabbs, gt_aabbs, cfg.candidate_top_k, aabb_iou)
    mask_iou = np.zeros(aabb_iou.shape, dtype=np.float64)
    # Shapes whose AABBs share no area share no pixel (half-open raster), so only those pairs are rasterised.
    pred_idx, gt_idx = np.nonzero(candidate & (aabb_iou > 0))
    if len(pred_idx):
        mask_iou[pred_idx, gt_idx] = _candidate_mask_iou(
            rings, all_aabbs, pred_idx, gt_idx + len(preds), cfg.maskiou_resolution
        )
    feasible = candidate & (mask_iou >= cfg.maskiou_gate)
    return MatchCosts(aabb_iou=aabb_iou, candidate=candidate, mask_iou=mask_iou, feasible=feasible)


def assignment_matrix(pair_cost: np.ndarray, feasible: np.ndarray, fp_cost: float, fn_cost: float) -> np.ndarray:
    """Square ``(P + G)`` dummy-augmented cost matrix ``[[pair, fp], [fn, 0]]`` for ``linear_sum_assignment``.

    Any complete assignment with ``k`` real pairs costs ``sum(pair costs) + (P - k) * fp_cost + (G - k) * fn_cost``.
    An infeasible pair costs ``2 * (fp_cost + fn_cost) + 1``, so dropping it lowers the total by more than
    ``fp_cost + fn_cost``: no optimal assignment contains one. Finite because scipy rejects rows of ``inf``.
    """
    n_pred, n_gt = pair_cost.shape
    infeasible_cost = 2.0 * (fp_cost + fn_cost) + 1.0
    matrix = np.zeros((n_pred + n_gt, n_pred + n_gt), dtype=np.float64)
    matrix[:n_pred, :n_gt] = np.where(feasible, pair_cost, infeasible_cost)
    matrix[:n_pred, n_gt:] = fp_cost
    matrix[n_pred:, :n_gt] = fn_cost
    return matrix


def match_objects(preds: Sequence[DetObject], gts: Sequence[DetObject], cfg: MatchingConfig) -> MatchResult:
    """Match predictions to GT: gate by maskIoU, then Hungarian with dummy FP/FN slots; deterministic.

    Only predictions and GTs with at least one feasible pair enter the assignment (the others are FP/FN whatever
    the assignment does), which keeps the matrix small without changing the optimum.
    """
    n_pred, n_gt = len(preds), len(gts)
    costs = compute_match_costs(preds, gts, cfg)
    pairs: list[tuple[int, int]] = []
    live_preds = np.flatnonzero(costs.feasible.any(axis=1))
    live_gts = np.flatnonzero(costs.feasible.any(axis=0))
    if len(live_preds) and len(live_gts):
        sub_feasible = costs.feasible[np.ix_(live_preds, live_gts)]
        sub_cost = 1.0 - costs.mask_iou[np.ix_(live_preds, live_gts)]
        matrix = assignment_matrix(sub_cost, sub_feasible, cfg.fp_cost, cfg.fn_cost)
        rows, cols = linear_sum_assignment(matrix)
        real = (rows < len(live_preds)) & (cols < len(live_gts))
        rows, cols = rows[real], cols[real]
        kept = sub_feasible[rows, cols]
        pairs = list(zip(live_preds[rows[kept]].tolist(), live_gts[cols[kept]].tolist()))
    pairs.sort()
    matched_preds = {p for p, _ in pairs}
    matched_gts = {g for _, g in pairs}
    return MatchResult(
        pairs=tuple(pairs),
        fn_gt_indices=tuple(j for j in range(n_gt) if j not in matched_gts),
        fp_pred_indices=tuple(i for i in range(n_pred) if i not in matched_preds),
        gating_rejections=costs.gating_rejections,
        n_candidates=int(costs.candidate.sum()),
    )
