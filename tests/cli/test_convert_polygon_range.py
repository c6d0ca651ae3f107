"""A COCO polygon coordinate outside the image is refused the same at every magnitude (issue 30 item 5): 9,000,
10**400 (a literal Python's float cannot hold), 1e400 (which reads as infinity) and their negatives all exit 2 naming
the annotation, nothing written; never converted to the object's box."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from coordexp.cli.app import app

runner = CliRunner()
PLACEHOLDER = 777777.25  # written into the document, then replaced by the literal under test


def _coco_text(literal: str) -> str:
    document = {
        "images": [{"id": 1, "width": 640, "height": 480, "file_name": "one.jpg"}],
        "categories": [{"id": 4, "name": "cat"}],
        "annotations": [{"id": 10, "image_id": 1, "category_id": 4, "bbox": [64, 48, 320, 240], "iscrowd": 0,
                         "segmentation": [[64, 48, 384, PLACEHOLDER, 224, 288]]}],
    }
    return json.dumps(document).replace(str(PLACEHOLDER), literal)


def _convert(folder: Path, literal: str):
    source = folder / "instances.json"
    source.write_text(_coco_text(literal), encoding="utf-8")
    return runner.invoke(app, ["convert", "to-jsonl", str(source), "-o", str(folder / "out.jsonl")])


def _refusal(result, folder: Path) -> str:
    text = " ".join(result.output.split())
    assert result.exit_code == 2, text
    assert "internal error" not in text and not (folder / "out.jsonl").exists(), text
    assert "annotations[0] (id 10)" in text, text
    return text


def test_an_in_range_polygon_converts(tmp_path):
    result = _convert(tmp_path, "100")
    assert result.exit_code == 0, result.output
    (record,) = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert "poly" in record["objects"][0]


LITERALS = ["9000", "-9000", "1" + "0" * 400, "-1" + "0" * 400, "1e400", "-1e400", "9e307", "1" + "0" * 30 + ".5"]


@pytest.mark.parametrize("literal", LITERALS, ids=lambda s: s if len(s) < 12 else f"{len(s)}-chars")
def test_out_of_range_coordinates_are_refused_at_every_magnitude(tmp_path, literal):
    text = _refusal(_convert(tmp_path, literal), tmp_path)
    assert "polygon" in text and "640x480" in text, text


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(digits=st.integers(min_value=4, max_value=600), negative=st.booleans(), as_float=st.booleans())
def test_every_magnitude_gets_the_message_9000_gets(tmp_path_factory, digits, negative, as_float):
    folder = tmp_path_factory.mktemp("poly")
    literal = ("-" if negative else "") + ("1e" + str(digits) if as_float else "1" + "0" * digits)
    reference = _refusal(_convert(folder, "-9000" if negative else "9000"), folder)
    assert _refusal(_convert(folder, literal), folder) == reference
