"""``/detect/`` findings of round seven (issue 56): an image header over the pixel cap is a 400 naming the field
(item 6), the repeat guard's stop is reported as ``repeat`` (item 11), and a repetition penalty that float32 would
round to 0 is refused by every request model and the config (item 18)."""

from __future__ import annotations

import base64
import struct
import sys
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from coordexp.runtime.rollout.base import RolloutOutput

sys.path.insert(0, str(Path(__file__).parent))
from test_detect import ScriptedEngine, image_arg, record, scripted_client  # noqa: E402,F401


def _png_header(width: int, height: int) -> bytes:
    """A PNG of a few bytes whose header declares ``width`` x ``height`` pixels (no pixel data is needed)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


class RepeatEngine(ScriptedEngine):
    """Answers as the repeat guard does: the list cut by a forced end."""

    def generate(self, requests, params):
        return [RolloutOutput(tuple(r.prompt.input_ids.tolist()), tuple(self.ids), self.text, "repeat")
                for r in requests]


@pytest.mark.parametrize("by", ["path", "base64"])
def test_an_image_header_over_the_pixel_cap_is_a_400_naming_the_field(run_contract, processor, dataset, record, by):
    bomb = _png_header(20_000, 20_000)  # 400 M pixels: over PIL's bomb limit and ours
    on_disk = dataset.root / "round7_bomb.bin"  # not *.png: other tests pick any PNG of the shared dataset
    on_disk.write_bytes(bomb)
    image = on_disk.name if by == "path" else "data:image/png;base64," + base64.b64encode(bomb).decode()
    test_client, _ = scripted_client(run_contract, processor, dataset, record)
    try:
        with test_client:
            reply = test_client.post("/detect/", json={"image": image})
    finally:
        on_disk.unlink()
    assert reply.status_code == 400, reply.text
    detail = reply.json()["detail"]
    assert detail.startswith("/detect/: image:") and "pixels" in detail and str(dataset.root) not in detail


def test_a_repeat_guard_stop_is_reported_as_repeat(run_contract, processor, dataset, record):
    test_client, _ = scripted_client(run_contract, processor, dataset, record, RepeatEngine)
    with test_client:
        body = test_client.post("/detect/", json={"image": image_arg(record, dataset)}).json()
    assert body["parse"]["finish_reason"] == "repeat"


def _request_models():
    from coordexp.runtime.rollout.protocol import RequestConfig
    from coordexp.runtime.server.detect import DetectDecoding
    from coordexp.schema.rollout import DecodingConfig

    return DecodingConfig, DetectDecoding, RequestConfig


@settings(max_examples=60, deadline=None)
@given(penalty=st.one_of(st.floats(min_value=5e-324, max_value=0.0099), st.floats(min_value=100.01, max_value=1e308),
                         st.sampled_from([1e-46, 1e-45, 1e-38, 0.0])))
def test_a_repetition_penalty_outside_the_finite_range_is_refused_everywhere(penalty):
    for model in _request_models():
        with pytest.raises(ValidationError, match="repetition_penalty"):
            model(repetition_penalty=penalty)


@settings(max_examples=30, deadline=None)
@given(penalty=st.floats(min_value=0.01, max_value=100.0))
def test_a_repetition_penalty_inside_the_range_is_accepted_everywhere(penalty):
    for model in _request_models():
        assert model(repetition_penalty=penalty).repetition_penalty == penalty


def test_detect_answers_a_tiny_repetition_penalty_with_a_422_not_a_500(run_contract, processor, dataset, record):
    test_client, _ = scripted_client(run_contract, processor, dataset, record)
    with test_client:
        reply = test_client.post("/detect/", json={"image": image_arg(record, dataset),
                                                   "decoding": {"repetition_penalty": 1e-46}})
    assert reply.status_code == 422 and "repetition_penalty" in reply.text


def test_mean_logprob_scores_and_a_threshold(run_contract, processor, dataset, record):
    """Issue 55, item 5: summed scores of long objects are tiny (1e-6 on COCO); the mean per token is a probability
    a user can threshold, and score_threshold leaves out what is below it, counted."""
    import math

    from test_detect import LOGPROB

    test_client, _ = scripted_client(run_contract, processor, dataset, record)
    with test_client:
        summed = test_client.post("/detect/", json={"image": image_arg(record, dataset)}).json()
        mean = test_client.post("/detect/", json={"image": image_arg(record, dataset), "score": "mean_logprob"}).json()
        cut = test_client.post("/detect/", json={"image": image_arg(record, dataset), "score": "mean_logprob",
                                                 "score_threshold": 0.999}).json()
        bad = test_client.post("/detect/", json={"image": image_arg(record, dataset), "score": "max"})
    assert all(o["score"] == pytest.approx(math.exp(LOGPROB)) for o in mean["objects"])
    assert all(s["score"] < m["score"] for s, m in zip(summed["objects"], mean["objects"]))
    assert cut["objects"] == [] and cut["parse"]["below_threshold"] == len(mean["objects"]) > 0
    assert "mean" in mean["parse"]["score"] and bad.status_code == 422
