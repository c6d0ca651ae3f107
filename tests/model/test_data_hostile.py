"""Hostile and careless data (issue 15 item 3): every reproducer fails at load time as the dataset error (exit 2)
with ``file:line`` and the field path, never as another exception; images are checked header-only with a pixel cap."""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import pytest

from coordexp.errors import EXIT_INVALID, exit_code_for
from coordexp.runtime.model import data as data_module
from coordexp.runtime.model.data import (
    MAX_IMAGE_PIXELS,
    MAX_IMAGE_SIDE,
    DatasetError,
    DetectionRecord,
    load_records,
)
from coordexp.runtime.model.encoding import EncodingError, load_images


def _png(path: Path, size=(8, 8)) -> Path:
    from PIL import Image

    Image.new("RGB", size).save(path)
    return path


def _png_header_only(path: Path, width: int, height: int) -> Path:
    """A PNG claiming ``width x height`` with one tiny IDAT chunk (a decompression bomb's header: 100 bytes)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))
    return path


def _record(**overrides):
    record = {"images": ["img.png"], "width": 8, "height": 8,
              "objects": [{"desc": "cat", "bbox_2d": [1, 2, 30, 40]}]}
    record.update(overrides)
    return record


def _jsonl(tmp_path: Path, lines: list[bytes | str | dict]) -> Path:
    if not (tmp_path / "img.png").exists():
        _png(tmp_path / "img.png")
    encoded = [line if isinstance(line, bytes) else
               (line if isinstance(line, str) else json.dumps(line)).encode("utf-8") for line in lines]
    path = tmp_path / "train.jsonl"
    path.write_bytes(b"\n".join(encoded) + b"\n")
    return path


def _problem(path: Path, lines, **kwargs) -> str:
    """The single problem load_records reports for ``lines`` (valid line 1 first, so the bad one is line 2)."""
    file = _jsonl(path, [_record(), *lines])
    with pytest.raises(DatasetError) as info:
        load_records(file, **kwargs)
    assert exit_code_for(info.value) == EXIT_INVALID
    assert len(info.value.problems) == 1, info.value.problems
    problem = info.value.problems[0]
    assert problem.startswith(f"{file}:2: "), problem
    return problem[len(f"{file}:2: "):]


def test_latin1_byte_names_the_byte_and_its_offsets(tmp_path):
    good = json.dumps(_record()).encode()
    bad = json.dumps(_record(objects=[{"desc": "caf_", "bbox_2d": [1, 2, 3, 4]}])).encode().replace(b"caf_", b"caf\xe9")
    problem = _problem(tmp_path, [bad])
    column = bad.index(b"\xe9") + 1
    offset = len(good) + 1 + column - 1
    assert problem == (f"not valid UTF-8: byte 0xe9 at byte {column} of the line (file offset {offset}); "
                       "save the file as UTF-8")
    assert (tmp_path / "train.jsonl").read_bytes()[offset] == 0xE9


@pytest.mark.parametrize("token", ["<|coord_5|>", "<|im_end|>", "<|vision_start|>", "<|endoftext|>", "<|x\ny|>"])
def test_desc_with_a_special_token_form_is_refused_at_load_time(tmp_path, token):
    bad = _record(objects=[{"desc": "cat", "bbox_2d": [1, 2, 3, 4]}, {"desc": f"a {token} b", "poly": [1, 1, 9, 1, 5, 9]}])
    problem = _problem(tmp_path, [bad])
    assert problem.startswith("objects[1].desc: contains the special-token form ")
    assert "plain text" in problem


def test_desc_with_lone_brackets_or_pipes_is_fine(tmp_path):
    ok = _record(objects=[{"desc": "a <b> | c |> <| d", "bbox_2d": [1, 2, 3, 4]}])
    (record,) = load_records(_jsonl(tmp_path, [ok]))
    assert record.objects[0].desc == "a <b> | c |> <| d"


def test_a_line_of_100000_brackets_is_a_problem_of_its_line(tmp_path):
    assert _problem(tmp_path, ["[" * 100_000]).startswith("JSON nested too deeply to read")


def test_deep_but_parseable_nesting_in_a_field_is_reported_with_the_field(tmp_path):
    deep = json.loads("[" * 900 + "]" * 900)
    problem = _problem(tmp_path, [_record(objects=[{"desc": "a", "bbox_2d": deep}])])
    assert problem.startswith("objects[0].bbox_2d: expected a list of 4 coordinates")


@pytest.mark.parametrize("field, line", [
    ("objects[0].bbox_2d[0]", '{"images": ["img.png"], "width": 8, "height": 8, '
                              '"objects": [{"desc": "a", "bbox_2d": [%s, 2, 3, 4]}]}' % ("9" * 5000)),
    ("width", '{"images": ["img.png"], "width": %s, "height": 8, "objects": []}' % ("1" * 5000)),
    ("objects[0].poly[2]", '{"images": ["img.png"], "width": 8, "height": 8, '
                           '"objects": [{"desc": "a", "poly": [1, 2, -%s, 4, 5, 6]}]}' % ("7" * 5000)),
])
def test_a_5000_digit_number_is_refused_before_int_conversion(tmp_path, field, line):
    problem = _problem(tmp_path, [line])
    assert problem.startswith(f"{field}: ") and "<a 5000-digit number>" in problem


def test_a_huge_number_in_ignored_metadata_does_not_fail(tmp_path):
    line = json.dumps(_record())[:-1] + ', "id": %s}' % ("3" * 5000)
    (_, record) = load_records(_jsonl(tmp_path, [_record(), line]))
    assert record.width == 8


@pytest.mark.parametrize("height", ["1e30", str(10**30), str(MAX_IMAGE_SIDE + 1), "-5", "NaN", "Infinity"])
def test_width_and_height_are_bounded_positive_integers(tmp_path, height):
    line = json.dumps(_record())[:-1].replace('"height": 8', f'"height": {height}') + "}"
    assert _problem(tmp_path, [line]).startswith(f"height: expected a positive integer up to {MAX_IMAGE_SIDE}")


def test_tilde_of_an_unknown_user(tmp_path):
    problem = _problem(tmp_path, [_record(images=["img.png", "~nosuchuser_coordexp/x.png"])])
    assert problem.startswith("images[1]: '~nosuchuser_coordexp/x.png': cannot expand '~nosuchuser_coordexp'")


def test_nul_byte_in_an_image_name(tmp_path):
    problem = _problem(tmp_path, [_record(images=["img\x00.png"])])
    assert problem == "images[0]: 'img\\x00.png' contains a NUL byte; write the plain file path"


@pytest.mark.parametrize("name", ["x" * 300 + ".png", "d/" * 2100 + "x.png"])
def test_overlong_image_names(tmp_path, name):
    assert " is too long (a file name may have 255 bytes, a path 4096)" in _problem(tmp_path, [_record(images=[name])])


def test_control_characters_in_a_missing_path_are_escaped(tmp_path):
    problem = _problem(tmp_path, [_record(images=["\x1b[2Jevil.png"])])
    assert "\x1b" not in problem and "\\x1b[2Jevil.png" in problem


def test_decompression_bomb_header_is_refused_without_decoding(tmp_path):
    _png_header_only(tmp_path / "bomb.png", 30_000, 30_000)
    problem = _problem(tmp_path, [_record(images=["bomb.png"])])
    assert problem.startswith("images[0]: ")
    assert "30000 x 30000 = 900000000 pixels, over the limit of" in problem or "too many pixels" in problem
    assert str(MAX_IMAGE_PIXELS) in problem


def test_just_under_the_cap_is_accepted_header_only(tmp_path):
    side = int(MAX_IMAGE_PIXELS**0.5)
    _png_header_only(tmp_path / "big.png", side, side)  # no pixel data: only the header is read at load time
    (record,) = load_records(_jsonl(tmp_path, [_record(images=["big.png"])]))
    with pytest.raises(EncodingError, match=rf"{record.source}: images\[0\]: cannot decode image .*big.png"):
        load_images(record)  # the train-time decode finds the missing pixels, with file:line and path


def test_extreme_aspect_ratio_is_refused(tmp_path):
    _png(tmp_path / "strip.png", size=(402, 2))
    assert "an aspect ratio over 200" in _problem(tmp_path, [_record(images=["strip.png"])])


@pytest.mark.parametrize("content", [b"not an image at all", b"\x89PNG\r\n\x1a\n", b""])
def test_non_images_are_refused(tmp_path, content):
    (tmp_path / "fake.png").write_bytes(content)
    assert "not a readable image" in _problem(tmp_path, [_record(images=["fake.png"])])


def test_unreadable_image_file(tmp_path, monkeypatch):
    from PIL import Image

    real_open = Image.open

    def refuse(path, *args, **kwargs):
        if str(path).endswith("locked.png"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    _png(tmp_path / "locked.png")
    monkeypatch.setattr(Image, "open", refuse)
    assert "cannot read image (Permission denied)" in _problem(tmp_path, [_record(images=["locked.png"])])


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_files_by_mode(tmp_path):
    locked = _png(tmp_path / "locked.png")
    locked.chmod(0)
    assert "cannot read image" in _problem(tmp_path, [_record(images=["locked.png"])])
    jsonl = _jsonl(tmp_path, [_record()])
    jsonl.chmod(0)
    with pytest.raises(DatasetError, match="cannot read"):
        load_records(jsonl)


def test_unreadable_jsonl(tmp_path, monkeypatch):
    jsonl = _jsonl(tmp_path, [_record()])
    real_open = Path.open

    def refuse(self, *args, **kwargs):
        if self == jsonl:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", refuse)
    with pytest.raises(DatasetError) as info:
        load_records(jsonl)
    assert info.value.problems == (f"{jsonl}: cannot read (Permission denied); check the file's permissions",)


@pytest.mark.parametrize("name", ["x" * 300 + ".jsonl", "a\x00b.jsonl"])
def test_hostile_jsonl_paths(tmp_path, name):
    with pytest.raises(DatasetError) as info:
        load_records(tmp_path / name)
    assert exit_code_for(info.value) == EXIT_INVALID
    assert "\x00" not in str(info.value)


def test_utf8_bom_is_accepted_and_line_numbers_hold(tmp_path):
    path = _jsonl(tmp_path, [b"\xef\xbb\xbf" + json.dumps(_record()).encode(), _record(width=0)])
    with pytest.raises(DatasetError) as info:
        load_records(path)
    assert info.value.problems[0].startswith(f"{path}:2: width: ")


def test_load_images_failures_are_encoding_errors_with_file_line(tmp_path):
    _png_header_only(tmp_path / "bomb.png", 30_000, 30_000)
    record = DetectionRecord((tmp_path / "bomb.png",), 8, 8, (), "train.jsonl:7")
    with pytest.raises(EncodingError) as info:
        load_images(record)
    assert str(info.value).startswith("train.jsonl:7: images[0]: ")
    assert exit_code_for(info.value) == EXIT_INVALID
    missing = DetectionRecord((tmp_path / "gone.png",), 8, 8, (), "train.jsonl:8")
    with pytest.raises(EncodingError, match=r"^train.jsonl:8: images\[0\]: .*gone.png: cannot read image"):
        load_images(missing)


def test_open_image_returns_a_lazy_image(tmp_path):
    image = data_module.open_image(_png(tmp_path / "ok.png", size=(20, 10)))
    with image:
        assert image.size == (20, 10)


@pytest.mark.parametrize("field, record", [
    ("objects[0].desc", _record(objects=[{"desc": "\ud800", "bbox_2d": [1, 2, 3, 4]}])),
    ("images[0]", _record(images=["a\udfffb.png"])),
])
def test_lone_surrogates_are_refused(tmp_path, field, record):
    """Regression (found by the fuzz test): a ``"\\ud800"`` desc loaded fine and crashed target building."""
    problem = _problem(tmp_path, [json.dumps(record)])
    assert problem.startswith(f"{field}: ") and "lone surrogate" in problem
