"""Hostile and careless ``coordexp convert`` input (issue 23 item 3): every malformed input is exit 2 with
``file: record: problem`` and nothing written; ``-o`` never destroys an input, a device, a FIFO or a read-only
file; sources are read bounded (no blocking on a FIFO, no endless read of /dev/zero); every record written is one
``train`` loads (``load_records``)."""

from __future__ import annotations

import copy
import json
import os
import resource
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from coordexp.cli.app import app
from coordexp.runtime.model.data import load_records

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, [str(a) for a in args])


def _coco() -> dict:
    return {
        "images": [{"id": 1, "width": 640, "height": 480, "file_name": "one.jpg"},
                   {"id": 2, "width": 300, "height": 200, "file_name": "two.jpg"}],
        "categories": [{"id": 4, "name": "cat"}, {"id": 8, "name": "dog"}],
        "annotations": [
            {"id": 10, "image_id": 1, "category_id": 4, "bbox": [64, 48, 320, 240], "iscrowd": 0,
             "segmentation": [[64, 48, 384, 48, 224, 288]]},
            {"id": 11, "image_id": 2, "category_id": 8, "bbox": [30, 20, 60, 40], "iscrowd": 0},
        ],
    }


def _odvg_line(**changes) -> str:
    record = {"filename": "x.jpg", "width": 100, "height": 80,
              "detection": {"instances": [{"bbox": [1, 2, 30, 40], "label": 3, "category": "car"}]}}
    record.update(changes)
    return json.dumps(record)


def _listing(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and not p.is_symlink()}


def _assert_refused(result, folder: Path, before: dict[str, bytes], *expected: str) -> None:
    """Exit 2 (never the exit-1 'internal error'), each expected text in the message, and the folder untouched."""
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "internal error" not in text
    for part in expected:
        assert part in text, text
    assert _listing(folder) == before


# ------------------------------------------------------------------------------------- the six causes of exit 1

DEEP = "[" * 100_000 + "]" * 100_000
LONG_INT = "1" * 400


@pytest.mark.parametrize("text, expected", [
    (DEEP, "not valid JSON (nested too deeply"),
    (json.dumps(_coco()).replace('"width": 640', f'"width": {LONG_INT}'), "images[0] (id 1): missing image size"),
    (json.dumps(_coco()).replace('"bbox": [30, 20, 60, 40]', f'"bbox": [30, 20, {LONG_INT}, 40]'),
     "annotations[1] (id 11): expected \"bbox\""),
    (json.dumps(_coco()).replace('"category_id": 8', '"category_id": [8]'), "unknown category_id [8]"),
    (json.dumps(_coco()).replace('"image_id": 2', '"image_id": {"a": 2}'), "image_id {'a': 2} is not in"),
    (json.dumps(_coco()).replace('"id": 2,', '"id": [2],'), "images[1]: expected an object with an integer"),
], ids=["deep-json", "400-digit-width", "400-digit-bbox", "list-category-id", "dict-image-id", "list-image-id"])
def test_malformed_coco_exits_2_naming_the_record(tmp_path, text, expected):
    source = tmp_path / "instances.json"
    source.write_text(text)
    before = _listing(tmp_path)
    result = _run("convert", "to-jsonl", source, "-o", tmp_path / "out.jsonl")
    _assert_refused(result, tmp_path, before, str(source), expected)


@pytest.mark.parametrize("lines, expected", [
    ([DEEP], "line 1: not valid JSON"),
    ([_odvg_line(width=10**400)], "line 1: missing image size"),
    ([_odvg_line(detection={"instances": [{"bbox": [1, 2, 3, 4], "label": [3]}]})],
     "line 1 instances[0]: unknown category (no \"category\" and label [3]"),
    ([_odvg_line(detection={"instances": [{"bbox": [1, 2, 3, 4], "label": {"a": 1}}]})], "label {'a': 1}"),
    ([_odvg_line(detection={"instances": 5})], "line 1: \"detection.instances\" must be a list"),
    ([_odvg_line(detection={"instances": [7]})], "line 1 instances[0]: expected an object, got 7"),
], ids=["deep-line", "huge-width", "list-label", "dict-label", "instances-not-a-list", "instance-not-an-object"])
def test_malformed_odvg_exits_2_naming_the_line(tmp_path, lines, expected):
    source = tmp_path / "train.jsonl"
    source.write_text("\n".join(lines) + "\n")
    label_map = tmp_path / "labels.json"
    label_map.write_text(json.dumps({"3": "car"}))
    before = _listing(tmp_path)
    result = _run("convert", "to-jsonl", source, "-o", tmp_path / "out.jsonl", "--label-map", label_map)
    _assert_refused(result, tmp_path, before, str(source), expected)


@pytest.mark.parametrize("key", ["²", "--1", "٣", "1" * 30])
def test_label_map_keys_that_int_cannot_read_are_plain_labels(tmp_path, key):
    """Old code: ``str(k).lstrip('-').isdigit()`` then ``int(k)``: '²' and '--1' crashed with exit 1."""
    source = tmp_path / "train.jsonl"
    source.write_text(_odvg_line(detection={"instances": [{"bbox": [1, 2, 3, 4], "label": key}]}) + "\n")
    label_map = tmp_path / "labels.json"
    label_map.write_text(json.dumps({key: "thing", "-2": "minus"}))
    output = tmp_path / "out.jsonl"
    result = _run("convert", "to-jsonl", source, "-o", output, "--label-map", label_map)
    assert result.exit_code == 0, result.output
    (record,) = load_records(output, tmp_path, check_files=False)
    assert record.objects[0].desc == "thing"


@pytest.mark.parametrize("value", [None, "", [1], 5])
def test_label_map_values_must_be_names(tmp_path, value):
    source = tmp_path / "train.jsonl"
    source.write_text(_odvg_line() + "\n")
    label_map = tmp_path / "labels.json"
    label_map.write_text(json.dumps({"3": value}))
    before = _listing(tmp_path)
    result = _run("convert", "to-jsonl", source, "-o", tmp_path / "out.jsonl", "--label-map", label_map)
    _assert_refused(result, tmp_path, before, f"{label_map}: key '3': expected a non-empty category name")


@pytest.mark.parametrize("gt_change, pred, expected", [
    (lambda d: d.__setitem__("images", {"id": 1}), None, "expected \"images\" and \"categories\" lists"),
    (lambda d: d["categories"][0].__setitem__("id", [4]), None, "categories[0]: expected {\"id\": int"),
    (lambda d: d["images"][0].__setitem__("width", 10**400), None, "matches no file_name"),
    (None, [1, 2], "line 1: expected a JSON object"),
    (None, {"image": "one.jpg", "objects": 3}, "line 1: \"objects\" must be a list"),
    (None, {"image": ["one.jpg"], "objects": []}, "image ['one.jpg'] matches no file_name"),
    (None, {"image": "one.jpg", "objects": [{"desc": "cat", "bbox_2d": [1, 2, 3, 4], "score": 10**400}]},
     "score <a 401-digit number> is not a finite number"),
], ids=["images-a-dict", "list-category-id", "400-digit-width", "line-a-list", "objects-an-int", "image-a-list",
        "400-digit-score"])
def test_to_results_malformed_files_exit_2(tmp_path, gt_change, pred, expected):
    document = _coco()
    if gt_change is not None:
        gt_change(document)
    gt = tmp_path / "gt.json"
    gt.write_text(json.dumps(document))
    predictions = tmp_path / "predictions.jsonl"
    line = pred if pred is not None else {"image": "one.jpg", "objects": [{"desc": "cat", "bbox_2d": [1, 2, 3, 4]}]}
    predictions.write_text(json.dumps(line) + "\n")
    before = _listing(tmp_path)
    result = _run("convert", "to-results", predictions, "--gt", gt, "-o", tmp_path / "results.json")
    _assert_refused(result, tmp_path, before, expected)


@pytest.mark.parametrize("target, expected", [
    (lambda d: d / "instances.json" / "out.jsonl", "cannot use this path (Not a directory)"),
    (lambda d: d / ("o" * 300 + ".jsonl"), "306-byte path component"),
], ids=["under-a-file", "name-too-long"])
def test_output_path_os_errors_exit_2(tmp_path, target, expected):
    source = tmp_path / "instances.json"
    source.write_text(json.dumps(_coco()))
    before = _listing(tmp_path)
    result = _run("convert", "to-jsonl", source, "-o", target(tmp_path))
    _assert_refused(result, tmp_path, before, expected)


# ------------------------------------------------------------------------------------- -o never destroys anything


def _same(d: Path, src: Path) -> Path:
    return src


def _symlink(d: Path, src: Path) -> Path:
    os.symlink(src, d / "link.json")
    return d / "link.json"


def _hardlink(d: Path, src: Path) -> Path:
    os.link(src, d / "hard.json")
    return d / "hard.json"


def _dotdot(d: Path, src: Path) -> Path:
    (d / "sub").mkdir()
    return d / "sub" / ".." / src.name


@pytest.mark.parametrize("make_output", [_same, _symlink, _hardlink, _dotdot],
                         ids=["same-path", "symlink", "hard-link", "dot-dot"])
def test_output_onto_the_input_is_refused(tmp_path, make_output):
    source = tmp_path / "instances.json"
    original = json.dumps(_coco())
    source.write_text(original)
    output = make_output(tmp_path, source)
    result = _run("convert", "to-jsonl", source, "-o", output)
    assert result.exit_code == 2, result.output
    assert "is the input file" in " ".join(result.output.split())
    assert source.read_text() == original


def test_output_onto_the_label_map_or_the_ground_truth_is_refused(tmp_path):
    source = tmp_path / "train.jsonl"
    source.write_text(_odvg_line() + "\n")
    label_map = tmp_path / "labels.json"
    label_map.write_text(json.dumps({"3": "car"}))
    result = _run("convert", "to-jsonl", source, "-o", label_map, "--label-map", label_map)
    assert result.exit_code == 2 and json.loads(label_map.read_text()) == {"3": "car"}
    gt = tmp_path / "gt.json"
    gt.write_text(json.dumps(_coco()))
    predictions = tmp_path / "p.jsonl"
    predictions.write_text(json.dumps({"image": "one.jpg", "objects": []}) + "\n")
    result = _run("convert", "to-results", predictions, "--gt", gt, "-o", gt)
    assert result.exit_code == 2 and json.loads(gt.read_text()) == _coco()


def _fifo(d: Path) -> Path:
    os.mkfifo(d / "fifo")
    return d / "fifo"


def _read_only(d: Path) -> Path:
    path = d / "keep.jsonl"
    path.write_text("keep\n")
    path.chmod(0o444)
    return path


def _directory(d: Path) -> Path:
    (d / "adir").mkdir()
    return d / "adir"


@pytest.mark.parametrize("make_target, expected", [
    (_fifo, "is a FIFO"), (_read_only, "is read-only"), (_directory, "is a directory"),
], ids=["fifo", "read-only", "directory"])
def test_output_onto_a_special_or_read_only_file_is_refused(tmp_path, make_target, expected):
    source = tmp_path / "instances.json"
    source.write_text(json.dumps(_coco()))
    target = make_target(tmp_path)
    before = os.lstat(target)
    result = _run("convert", "to-jsonl", source, "-o", target)
    assert result.exit_code == 2 and expected in " ".join(result.output.split()), result.output
    after = os.lstat(target)
    assert (after.st_ino, stat.S_IFMT(after.st_mode)) == (before.st_ino, stat.S_IFMT(before.st_mode))
    if target.is_file():
        assert target.read_text() == "keep\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="creating a device node needs root")
def test_output_onto_a_character_device_never_replaces_the_node(tmp_path):
    node = tmp_path / "null"
    os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    source = tmp_path / "instances.json"
    source.write_text(json.dumps(_coco()))
    result = _run("convert", "to-jsonl", source, "-o", node)
    assert result.exit_code == 2 and "is a character device" in " ".join(result.output.split())
    assert stat.S_ISCHR(os.lstat(node).st_mode)


def test_output_through_a_symlink_writes_the_target_and_keeps_the_link(tmp_path):
    source = tmp_path / "instances.json"
    source.write_text(json.dumps(_coco()))
    real = tmp_path / "real.jsonl"
    real.write_text("old\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    assert _run("convert", "to-jsonl", source, "-o", link).exit_code == 0
    assert link.is_symlink() and len(load_records(real, tmp_path, check_files=False)) == 2


# ------------------------------------------------------------------------------------- records train would refuse


@pytest.mark.parametrize("change, expected", [
    (lambda d: d["categories"][0].__setitem__("name", "cat<|coord_5|>"), "desc: contains the special-token form"),
    (lambda d: d["images"][0].__setitem__("width", 1e308), "missing image size"),
    (lambda d: d["images"][0].__setitem__("width", 10**7), "width: expected a positive integer up to 1000000"),
    (lambda d: d["images"][0].__setitem__("file_name", "a\x00b.jpg"), "images[0]: 'a\\x00b.jpg' contains a NUL"),
    (lambda d: d["images"][0].__setitem__("file_name", "n" * 100_000), "is too long"),
    (lambda d: d["categories"][0].__setitem__("name", "\ud800"), "holds a lone surrogate"),
], ids=["special-token-desc", "width-1e308", "width-over-cap", "nul-file-name", "100k-file-name", "surrogate-desc"])
def test_records_train_refuses_are_never_written(tmp_path, change, expected):
    document = _coco()
    change(document)
    source = tmp_path / "instances.json"
    source.write_text(json.dumps(document))
    before = _listing(tmp_path)
    result = _run("convert", "to-jsonl", source, "-o", tmp_path / "out.jsonl")
    _assert_refused(result, tmp_path, before, expected)


def test_an_empty_conversion_is_refused(tmp_path):
    """train refuses a file without records; convert says so instead of writing one."""
    source = tmp_path / "train.jsonl"
    source.write_text(json.dumps({"filename": "x.jpg", "width": 10, "height": 10}) + "\n")  # grounding-only line
    before = _listing(tmp_path)
    result = _run("convert", "to-jsonl", source, "-o", tmp_path / "out.jsonl")
    _assert_refused(result, tmp_path, before, "holds no image to convert")


def test_a_record_problem_names_the_source_record(tmp_path):
    document = _coco()
    document["categories"][1]["name"] = "<|im_end|>"
    source = tmp_path / "instances.json"
    source.write_text(json.dumps(document))
    result = _run("convert", "to-jsonl", source, "-o", tmp_path / "out.jsonl")
    assert result.exit_code == 2
    assert f"{source}: images[1] (id 2): objects[0].desc" in " ".join(result.output.split())


# ------------------------------------------------------------------------------------- bounded reads


def _limited_memory():  # the old code read /dev/zero until the kernel killed it: cap the child at 2 GiB
    resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))


@pytest.mark.parametrize("make_source", [
    lambda d: (os.mkfifo(d / "src.json"), d / "src.json")[1],
    lambda d: Path("/dev/zero"),
    lambda d: d,
], ids=["fifo", "dev-zero", "directory"])
@pytest.mark.slow  # starts a process
def test_sources_that_never_end_are_refused_without_blocking(tmp_path, make_source):
    source = make_source(tmp_path)
    out = tmp_path / "out.jsonl"
    proc = subprocess.run([sys.executable, "-m", "coordexp", "convert", "to-jsonl", str(source), "-o", str(out)],
                          capture_output=True, text=True, timeout=300, preexec_fn=_limited_memory)
    assert proc.returncode == 2, proc.stderr
    assert "not a regular file" in " ".join(proc.stderr.split())
    assert not out.exists()


def test_reads_are_capped(tmp_path, monkeypatch):
    from coordexp.cli import file_guard

    monkeypatch.setattr(file_guard, "MAX_SOURCE_BYTES", 100)
    source = tmp_path / "instances.json"
    source.write_text(json.dumps(_coco()))
    result = _run("convert", "to-jsonl", source, "-o", tmp_path / "out.jsonl")
    assert result.exit_code == 2 and "larger than the 100-byte limit" in " ".join(result.output.split())
    assert not (tmp_path / "out.jsonl").exists()


# ------------------------------------------------------------------------------------- property: exit 2 or loadable

_HOSTILE = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([1e308, -1e308, 2**70, 0.5]),
    st.text(max_size=8), st.sampled_from(["<|coord_5|>", "a\x00b", "\ud800", "<|im_end|>", "n" * 300]),
    st.lists(st.integers(-5, 2000), max_size=5), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


@st.composite
def _hostile_coco(draw):
    document = copy.deepcopy(_coco())
    for _ in range(draw(st.integers(1, 4))):
        paths = [p for p in _paths(document) if p]
        where = draw(st.sampled_from(paths))
        parent = document
        for key in where[:-1]:
            parent = parent[key]
        parent[where[-1]] = draw(_HOSTILE)
    text = json.dumps(document)
    if draw(st.booleans()):  # literals json.dumps cannot write: long integers, NaN, 1e400, deep nesting
        text = text.replace("640", draw(st.sampled_from(["1" * 400, "NaN", "1e400", "-0", "[" * 3000 + "]" * 3000])))
    return text


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_hostile_coco(), geometry=st.sampled_from(["poly", "bbox"]),
       prefix=st.sampled_from(["", "img/", "\x00", "<|coord_1|>"]))
def test_hostile_coco_is_exit_2_with_nothing_written_or_a_file_train_loads(tmp_path_factory, text, geometry, prefix):
    folder = tmp_path_factory.mktemp("hostile")
    source = folder / "instances.json"
    source.write_text(text, encoding="utf-8", errors="surrogatepass")
    output = folder / "out.jsonl"
    result = _run("convert", "to-jsonl", source, "-o", output, "--geometry", geometry, "--image-prefix", prefix)
    assert result.exit_code in (0, 2), result.output
    if result.exit_code == 2:
        assert sorted(p.name for p in folder.iterdir()) == ["instances.json"], "exit 2 must write nothing"
    else:
        assert load_records(output, folder, check_files=False)
