"""``POST /detect/``: one image in, objects in pixels with scores out (in process, a scripted engine that answers a
record's ground truth, so the expected pixels are known), every client error a 4xx."""

from __future__ import annotations

import base64
import math
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordexp.runtime.core.coco import bin_to_pixel
from coordexp.runtime.core.serialize import serialize_objects
from coordexp.runtime.rollout.base import RolloutOutput
from coordexp.runtime.server.engine import GenerationParams, TokenLogprob
from coordexp.schema.rollout import DecodingConfig

sys.path.insert(0, str(Path(__file__).parent))
from _slow_server import SlowEngine  # noqa: E402

LOGPROB = -0.01


class ScriptedEngine(SlowEngine):
    """Answers every request with ``ids`` (the serialized objects of one record) and a fixed token log-probability."""

    engine_type = "ScriptedEngine"
    world_size = 1

    def __init__(self, ids: list[int], text: str, stop_id: int):
        super().__init__(0.0)
        self.ids, self.text, self.stop_id = ids, text, stop_id
        self.prompts: list[list[int]] = []
        self.params: list[GenerationParams] = []

    def generate(self, requests, params):
        self.params.append(params)
        self.prompts += [r.prompt.input_ids.tolist() for r in requests]
        return [RolloutOutput(tuple(r.prompt.input_ids.tolist()), tuple(self.ids), self.text, "stop")
                for r in requests]

    def token_logprobs(self, requests, outputs, params, top):
        return [[TokenLogprob(t, LOGPROB) for t in (*o.response_token_ids, self.stop_id)] for o in outputs]


class NoLogprobEngine(ScriptedEngine):
    token_logprobs = None  # an engine without per-token log-probabilities


@pytest.fixture(scope="module")
def record(records):
    """A record with at least one polygon and one box (the synthetic data draws both)."""
    kinds = [{o.geometry for o in r.objects} for r in records]
    return next((r for r, k in zip(records, kinds) if k == {"bbox_2d", "poly"}), records[0])


def scripted_client(run_contract, processor, dataset, record, engine_class=ScriptedEngine):
    from fastapi.testclient import TestClient

    from coordexp.runtime.server.app import create_app

    tokenizer = processor.tokenizer
    text = serialize_objects(record.objects)
    engine = engine_class(tokenizer.encode(text, add_special_tokens=False), text,
                          int(tokenizer.convert_tokens_to_ids("<|im_end|>")))
    app = create_app(engine, processor, run_contract.template, image_root=dataset.root,
                     defaults=GenerationParams(run_contract.rollout_matching.max_new_tokens, DecodingConfig()),
                     system=run_contract.template.system_prompt)
    return TestClient(app), engine


@pytest.fixture(scope="module")
def client(run_contract, processor, dataset, record):
    test_client, engine = scripted_client(run_contract, processor, dataset, record)
    with test_client:
        yield test_client, engine


def image_arg(record, dataset) -> str:
    return str(record.image_paths[0].relative_to(dataset.root))


def expected_box(obj, width: int, height: int) -> list[float]:
    xs = [bin_to_pixel(v, width) for v in obj.coords[0::2]]
    ys = [bin_to_pixel(v, height) for v in obj.coords[1::2]]
    return [round(min(xs), 2), round(min(ys), 2), round(max(xs), 2), round(max(ys), 2)]


def test_detect_answers_objects_in_pixels_with_scores(client, record, dataset, run_contract, processor):
    test_client, engine = client
    reply = test_client.post("/detect/", json={"image": image_arg(record, dataset)})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["text"] == serialize_objects(record.objects)
    assert body["parse"]["image_size"] == [record.width, record.height]
    assert body["parse"]["valid"] == len(record.objects) and body["parse"]["dropped"] == {}
    assert [o["desc"] for o in body["objects"]] == [o.desc for o in record.objects]
    for got, want in zip(body["objects"], record.objects):
        assert got["bbox_2d"] == pytest.approx(expected_box(want, record.width, record.height), abs=0.01)
        assert ("poly" in got) == (want.geometry == "poly")
        if want.geometry == "poly":
            assert got["poly"][0] == pytest.approx([bin_to_pixel(want.coords[0], record.width),
                                                    bin_to_pixel(want.coords[1], record.height)], abs=0.01)
        assert 0 < got["score"] < 1
    # a score is the probability of the object's own tokens: more tokens, lower score; all from LOGPROB
    spans = [round(math.log(o["score"]) / LOGPROB) for o in body["objects"]]
    assert all(s > 4 for s in spans)
    # the prompt is the learner's: the config's system and user prompts around the image
    prompt = processor.tokenizer.decode(engine.prompts[-1])
    assert run_contract.template.system_prompt in prompt and run_contract.template.user_prompt in prompt


def test_base64_equals_the_path_and_prompt_and_decoding_are_honoured(client, record, dataset, processor):
    test_client, engine = client
    data = base64.b64encode(record.image_paths[0].read_bytes()).decode()
    by_path = test_client.post("/detect/", json={"image": image_arg(record, dataset)}).json()
    by_data = test_client.post("/detect/", json={"image": f"data:image/png;base64,{data}"}).json()
    assert by_path == by_data
    reply = test_client.post("/detect/", json={"image": data, "prompt": "Find the shapes.",
                                               "decoding": {"max_tokens": 64, "temperature": 0.5, "seed": 3}})
    assert reply.status_code == 200, reply.text
    assert "Find the shapes." in processor.tokenizer.decode(engine.prompts[-1])
    assert engine.params[-1].max_new_tokens == 64 and engine.params[-1].decoding.temperature == 0.5


def test_without_engine_logprobs_scores_are_null(run_contract, processor, dataset, record):
    test_client, _ = scripted_client(run_contract, processor, dataset, record, NoLogprobEngine)
    with test_client:
        body = test_client.post("/detect/", json={"image": image_arg(record, dataset)}).json()
    assert body["objects"] and all(o["score"] is None for o in body["objects"])
    assert body["parse"]["score"] is None


def test_client_errors_are_4xx_naming_no_server_path(client, dataset, tmp_path):
    test_client, _ = client
    (dataset.root / "not_an_image.png").write_text("plain text", encoding="utf-8")
    cases = [
        ({"image": "missing.png"}, 400, "--image-root"),
        ({"image": "/etc/hostname"}, 400, "--image-root"),
        ({"image": "not_an_image.png"}, 400, "not a readable image"),
        ({"image": "https://example.com/a.png"}, 400, "not fetched"),
        ({"image": ""}, 422, "image"),
        ({}, 422, "image"),
        ({"image": "a.png", "boxes": True}, 422, "boxes"),
        ({"image": "a.png", "prompt": "<image> twice"}, 422, "prompt"),
        ({"image": "a.png", "decoding": {"temperature": -1}}, 422, "temperature"),
        ({"image": "a.png", "decoding": {"beams": 2}}, 422, "beams"),
    ]
    for body, status, named in cases:
        reply = test_client.post("/detect/", json=body)
        assert reply.status_code == status and named in reply.json()["detail"], (body, reply.text)
        assert str(dataset.root) not in reply.text
    record_image = next(p for p in dataset.root.rglob("*.png") if p.name != "not_an_image.png")
    huge = test_client.post("/detect/", json={"image": str(record_image.relative_to(dataset.root)),
                                               "decoding": {"max_tokens": 10**9}})
    assert huge.status_code == 400 and "max_tokens" in huge.json()["detail"]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(image=st.text(max_size=60), prompt=st.one_of(st.none(), st.text(max_size=20)))
def test_any_image_string_is_answered_below_500(client, image, prompt):
    test_client, _ = client
    reply = test_client.post("/detect/", json={"image": image, "prompt": prompt})
    assert reply.status_code < 500, reply.text


def test_dedup_moves_certified_repeats_out_of_objects(run_contract, processor, dataset, record):
    """A rollout that writes its first object twice: with dedup the repeat is under "repeats", not "objects"."""
    import dataclasses

    repeated = dataclasses.replace(record, objects=(record.objects[0], *record.objects))
    test_client, _ = scripted_client(run_contract, processor, dataset, repeated)
    with test_client:
        plain = test_client.post("/detect/", json={"image": image_arg(record, dataset)}).json()
        deduped = test_client.post("/detect/", json={"image": image_arg(record, dataset), "dedup": True}).json()
    assert len(plain["objects"]) == len(record.objects) + 1 and "repeats" not in plain
    assert [o["bbox_2d"] for o in deduped["objects"]] == [o["bbox_2d"] for o in plain["objects"][1:]]
    assert deduped["repeats"] == [plain["objects"][1]] and deduped["text"] == plain["text"]
