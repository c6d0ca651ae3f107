"""``data.object_order`` at the data layer: what "top-left" means for boxes and polygons, the ``sorted`` check at load
time (``file:line``, several problems at once), and the ``random`` permutation as a pure function of
(seed, epoch, record index)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordexp.runtime.core.objects import DetObject
from coordexp.runtime.model.data import (
    DatasetError,
    DetectionRecord,
    first_out_of_order,
    load_records,
    object_permutation,
    top_left,
    with_object_permutation,
)

coord = st.integers(0, 999)


@st.composite
def boxes(draw):
    x1, x2 = sorted((draw(coord), draw(coord)))
    y1, y2 = sorted((draw(coord), draw(coord)))
    return DetObject("box", "bbox_2d", (x1, y1, x2, y2))


@st.composite
def polygons(draw):
    points = draw(st.lists(st.tuples(coord, coord), min_size=3, max_size=6))
    return DetObject("poly", "poly", tuple(v for point in points for v in point))


objects = st.lists(st.one_of(boxes(), polygons()), max_size=8)


def _raw(obj: DetObject) -> dict:
    return {"desc": obj.desc, obj.geometry: list(obj.coords)}


def _jsonl(tmp_path: Path, records: list[list[DetObject]]) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"images": ["img.png"], "width": 64, "height": 64,
                                        "objects": [_raw(o) for o in objs]}) + "\n" for objs in records))
    return path


def test_top_left_of_a_box_is_its_first_corner_and_of_a_polygon_the_corner_of_its_box():
    assert top_left(DetObject("a", "bbox_2d", (10, 20, 30, 40))) == (20, 10)
    # the topmost point (50, 5) is right of the leftmost (7, 60): the corner takes y from one and x from the other
    assert top_left(DetObject("b", "poly", (50, 5, 90, 70, 7, 60))) == (5, 7)


def test_rows_come_first_then_columns_and_ties_keep_their_order():
    a, b, c = (DetObject(d, "bbox_2d", box) for d, box in
               (("a", (500, 10, 600, 20)), ("b", (0, 11, 5, 20)), ("c", (500, 10, 510, 15))))
    assert first_out_of_order((a, c, b)) is None  # a and c share their top-left: either order is sorted
    assert first_out_of_order((b, a)) == 1  # b's top edge (11) is below a's (10), however far left b is


@settings(max_examples=200, deadline=None)
@given(objects)
def test_the_check_finds_the_first_step_down_in_top_left_order(objs):
    found = first_out_of_order(objs)
    anchors = [(min(o.coords[1::2]), min(o.coords[0::2])) for o in objs]
    steps_down = [i for i in range(1, len(anchors)) if anchors[i] < anchors[i - 1]]
    assert found == (steps_down[0] if steps_down else None)
    assert first_out_of_order(sorted(objs, key=top_left)) is None


@settings(max_examples=30, deadline=None)
@given(st.lists(objects, min_size=1, max_size=5))
def test_sorted_loads_exactly_the_files_whose_records_are_in_top_left_order(tmp_path_factory, records):
    tmp_path = tmp_path_factory.mktemp("order")
    path = _jsonl(tmp_path, records)
    bad = [line for line, objs in enumerate(records, 1) if first_out_of_order(objs) is not None]
    assert len(load_records(path, check_files=False, object_order="keep")) == len(records)
    if not bad:
        assert [r.objects for r in load_records(path, check_files=False, object_order="sorted")] == [
            tuple(objs) for objs in records]
        return
    with pytest.raises(DatasetError) as caught:
        load_records(path, check_files=False, object_order="sorted")
    assert [p.split(": ", 1)[0] for p in caught.value.problems] == [f"{path}:{line}" for line in bad]


def test_the_refusal_names_the_object_both_corners_and_the_way_out(tmp_path):
    later = DetObject("cat", "bbox_2d", (10, 300, 20, 310))
    earlier = DetObject("dog", "poly", (40, 100, 80, 120, 60, 90))  # its box's corner: y=90, x=40
    path = _jsonl(tmp_path, [[earlier, later], [later, earlier]])
    with pytest.raises(DatasetError) as caught:
        load_records(path, check_files=False, object_order="sorted")
    (problem,) = caught.value.problems
    assert problem.startswith(f"{path}:2: objects[1]:")
    assert "(y=90, x=40)" in problem and "(y=300, x=10)" in problem and "data.object_order: keep" in problem
    assert isinstance(caught.value, ValueError)  # a UserInputError too: the CLI exits 2


def test_an_unknown_order_is_a_programming_error(tmp_path):
    with pytest.raises(ValueError, match="object_order must be one of"):
        load_records(_jsonl(tmp_path, [[]]), check_files=False, object_order="diagonal")


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), epoch=st.integers(0, 10**6), index=st.integers(0, 10**7),
       count=st.integers(0, 40))
def test_the_permutation_is_a_pure_function_of_seed_epoch_and_index(seed, epoch, index, count):
    order = object_permutation(seed, epoch, index, count)
    assert sorted(order) == list(range(count))
    assert object_permutation(seed, epoch, index, count) == order


@pytest.mark.slow  # starts a process
def test_another_process_with_another_hash_seed_draws_the_same_orders():
    """A resumed run is a new process: nothing salted per process (``hash()``, RNG state) may enter the order."""
    import os
    import subprocess
    import sys

    cases = [(17, 0, 0, 6), (17, 1, 0, 6), (0, 3, 12345, 9)]
    code = ("import json, sys; from coordexp.runtime.model.data import object_permutation as p; "
            "print(json.dumps([p(*c) for c in json.loads(sys.argv[1])]))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert [tuple(o) for o in json.loads(out.stdout)] == [object_permutation(*c) for c in cases]


def test_epochs_seeds_and_records_draw_different_orders():
    count = 8  # 8! orders: a repeat across these few draws would mean an input is ignored
    base = object_permutation(17, 0, 3, count)
    assert object_permutation(17, 1, 3, count) != base
    assert object_permutation(18, 0, 3, count) != base
    assert object_permutation(17, 0, 4, count) != base
    firsts = {object_permutation(17, epoch, 3, count)[0] for epoch in range(200)}
    assert firsts == set(range(count))  # every object leads in some epoch


def test_a_permuted_record_keeps_its_objects_and_everything_else():
    objs = tuple(DetObject(f"o{i}", "bbox_2d", (i, i, i + 1, i + 1)) for i in range(5))
    record = DetectionRecord((Path("a.png"),), 64, 64, objs, "train.jsonl:3")
    permuted = with_object_permutation(record, seed=1, epoch=2, index=3)
    assert permuted.objects == tuple(objs[i] for i in object_permutation(1, 2, 3, 5))
    assert sorted(permuted.objects, key=lambda o: o.desc) == list(objs)
    assert (permuted.image_paths, permuted.width, permuted.height, permuted.source) == (
        record.image_paths, 64, 64, record.source)
