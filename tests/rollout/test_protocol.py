"""Wire-format tests: recorded ms-swift v3.10 JSON (written from the protocol reference) parses, round-trips, and
bad shapes fail with a reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from coordexp.runtime.rollout import protocol as p

FIXTURES = Path(__file__).parent / "fixtures"


def load(name: str):
    return json.loads((FIXTURES / name).read_text(encoding="utf-8"))


def test_coordexp_infer_request_parses_and_ignores_swift_extras():
    body = p.InferRequestBody.model_validate(load("infer_request_coordexp.json"))
    assert len(body.infer_requests) == 1
    request = body.infer_requests[0]
    assert request.messages[1]["content"][0] == {"type": "image", "image": "coco/000000000139.jpg"}
    assert request.images == []
    config = body.request_config
    assert (config.max_tokens, config.temperature, config.top_k, config.seed, config.return_details) == (
        3084, 0.0, -1, 1000020, True)
    assert config.stop == ["<|im_end|>"]
    dumped = body.model_dump(mode="json")
    assert dumped["metrics"] is None and dumped["adapter_request"] is None  # swift's always-sent keys are fields
    assert p.unknown_infer_fields(body) == []  # everything swift's client sends is a known field
    assert p.InferRequestBody.model_validate(dumped) == body  # round trip


# every RequestConfig field of ms-swift 3.12 (swift/llm/infer/protocol.py), written out from the reference
SWIFT_312_REQUEST_CONFIG = {
    "max_tokens": None, "temperature": None, "top_k": None, "top_p": None, "repetition_penalty": None,
    "num_beams": 1, "stop": [], "seed": None, "stream": False, "logprobs": False, "top_logprobs": None, "n": 1,
    "best_of": None, "presence_penalty": 0.0, "frequency_penalty": 0.0, "length_penalty": 1.0,
    "return_details": False, "structured_outputs_regex": None}


def test_every_swift_312_request_config_field_is_known():
    body = p.InferRequestBody.model_validate({"infer_requests": [], "request_config": SWIFT_312_REQUEST_CONFIG})
    assert p.unknown_infer_fields(body) == []
    assert body.request_config.structured_outputs_regex is None


_names = st.text(st.characters(whitelist_categories=("Ll",)), min_size=3, max_size=12)


@settings(max_examples=60, deadline=None)
@given(top=st.lists(_names, max_size=3, unique=True), config=st.lists(_names, max_size=3, unique=True),
       item=st.lists(_names, max_size=3, unique=True))
def test_unknown_keys_are_kept_and_named_with_their_path(top, config, item):
    """No silent ignore: every key outside swift 3.12's /infer/ models is reported, each with its dotted path."""
    top = [k for k in top if k not in p.InferRequestBody.model_fields]
    config = [k for k in config if k not in p.RequestConfig.model_fields]
    item = [k for k in item if k not in p.RolloutInferRequest.model_fields]
    raw = {"infer_requests": [{"messages": [{"role": "user", "content": "hi"}]},
                              {"messages": [{"role": "user", "content": "hi"}], **{k: 1 for k in item}}],
           "request_config": {"n": 1, **{k: True for k in config}}, **{k: None for k in top}}
    body = p.InferRequestBody.model_validate(raw)
    assert p.unknown_infer_fields(body) == (top + [f"request_config.{k}" for k in config]
                                            + [f"infer_requests[1].{k}" for k in item])


def test_swift_tag_form_wraps_single_image_string_and_defaults_config():
    body = p.InferRequestBody.model_validate(load("infer_request_swift_tags.json"))
    request = body.infer_requests[0]
    assert request.images == ["data:image/png;base64,iVBORw0KGgo="]
    assert request.data_dict == {"id": 7}
    assert body.request_config.max_tokens == 16 and body.request_config.seed is None
    assert body.request_config.n == 1 and body.request_config.return_details is False


def test_null_request_config_means_defaults_not_an_error():
    body = p.InferRequestBody.model_validate({"infer_requests": [], "request_config": None})
    assert body.request_config == p.RequestConfig()


@pytest.mark.parametrize("messages, needle", [
    ([], "messages is empty"),
    ([{"role": "user"}], "needs 'role' and 'content'"),
    ([{"role": "user", "content": 3}], "string or a list"),
])
def test_bad_messages_name_the_problem(messages, needle):
    with pytest.raises(ValidationError, match=needle):
        p.RolloutInferRequest.model_validate({"messages": messages})


def test_ms310_response_parses_and_converts_to_rollout_output():
    items = p.parse_infer_response(load("infer_response_ms310.json"), expected=1)
    item = items[0]
    assert item.response.prompt_token_ids == [151644, 8948, 198, 151655, 151645]
    assert item.response.choices[0].logprobs.content[0].bytes == [123, 34]
    out = p.item_to_rollout_output(item)
    assert out.prompt_token_ids == (151644, 8948, 198, 151655, 151645)
    assert out.response_token_ids == (515, 1700, 62)
    assert out.text == '{"object_1": {"desc": "cat"}}'
    assert out.finish_reason == "stop"
    assert p.parse_infer_response([item.model_dump(mode="json")])[0] == item  # round trip keeps everything


def test_bare_chat_completion_items_are_accepted():
    out = p.item_to_rollout_output(p.parse_infer_response(load("infer_response_bare.json"))[0])
    assert (out.prompt_token_ids, out.response_token_ids, out.finish_reason) == ((1, 2), (90,), "length")


def test_coordexp_extension_carries_the_repeat_finish_reason():
    item = p.parse_infer_response(load("infer_response_coordexp_plugin.json"))[0]
    assert item.response.choices[0].finish_reason == "stop"  # what a swift client sees
    assert p.item_to_rollout_output(item).finish_reason == "repeat"


@pytest.mark.parametrize("payload, needle", [
    ({"detail": "boom"}, "JSON list.*boom"),
    ([{"object": "error", "message": "CUDA OOM"}], "error: CUDA OOM"),
    ([1], "item 0 is a int"),
    ([{"response": {"id": "1"}}], "RolloutOutput shape"),
])
def test_malformed_replies_raise_protocol_error(payload, needle):
    with pytest.raises(p.ProtocolError, match=needle):
        p.parse_infer_response(payload)


def test_wrong_item_count_is_an_error():
    with pytest.raises(p.ProtocolError, match="1 item.*for 2 request"):
        p.parse_infer_response(load("infer_response_bare.json"), expected=2)


def test_missing_ids_ask_for_return_details():
    raw = load("infer_response_bare.json")
    raw[0]["choices"][0]["token_ids"] = None
    with pytest.raises(p.ProtocolError, match="return_details"):
        p.item_to_rollout_output(p.parse_infer_response(raw)[0])


def test_weight_sync_requests_parse():
    init = p.InitCommunicatorRequest.model_validate(load("init_communicator_request.json"))
    assert (init.host, init.port, init.world_size, init.backend) == ("0.0.0.0", 51216, 2, None)
    named = p.UpdateWeightsRequest.model_validate(load("update_named_param_request.json"))
    assert named.shape == [1536, 8960] and named.dtype == "torch.bfloat16"
    flat = p.UpdateFlattenedParamsRequest.model_validate(load("update_flattened_params_request.json"))
    assert [m.end_idx for m in flat.metadatas] == [12, 15] and flat.metadatas[0].shape == (4, 3)
    adapter = p.UpdateFlattenedAdapterRequest.model_validate(load("update_adapter_request.json"))
    assert adapter.peft_config["r"] == 8 and len(adapter.metadatas) == 2


def _entry(name, shape, start, dtype="torch.float32"):
    numel = 1
    for s in shape:
        numel *= s
    return {"name": name, "shape": shape, "dtype": dtype, "start_idx": start, "end_idx": start + numel, "numel": numel}


@pytest.mark.parametrize("metadatas, needle", [
    ([], "empty"),
    ([_entry("a", [2], 0), _entry("b", [2], 3)], "starts at 3, expected 2"),
    ([_entry("a", [2], 0), _entry("b", [2], 2, "torch.bfloat16")], "ONE dtype"),
    ([{"name": "a", "shape": [2, 2], "dtype": "torch.float32", "start_idx": 0, "end_idx": 3, "numel": 3}],
     "disagree"),
    ([_entry("a", [2], 0, "torch.complex_thing")], "not a tensor dtype"),
])
def test_bucket_metadata_is_checked_before_any_broadcast(metadatas, needle):
    with pytest.raises(ValidationError, match=needle):
        p.UpdateFlattenedParamsRequest.model_validate({"metadatas": metadatas})


def test_reply_messages_are_ms310s():
    replies = load("replies_ms310.json")
    assert replies["init_communicator"]["message"] == p.MESSAGE_INIT
    assert replies["update_named_param"]["message"] == p.MESSAGE_UPDATE_NAMED
    assert replies["update_flattened_params"]["message"] == p.MESSAGE_UPDATE_FLATTENED
    assert replies["update_adapter_flattened_param"]["message"] == p.MESSAGE_UPDATE_ADAPTER
    assert replies["close_communicator"]["message"] == p.MESSAGE_CLOSE
    assert replies["reset_prefix_cache"]["message"] == p.reset_prefix_cache_message(True)
    assert p.EngineTypeResponse.model_validate(replies["get_engine_type"]).engine_type == "LLMEngine"
    assert p.WorldSizeResponse.model_validate(replies["get_world_size"]).world_size == 3
    assert {name: path for name, (_, path) in p.ENDPOINTS.items() if name not in ("sync_status", "infer")} == {
        name: f"/{name}/" for name in replies}


@settings(max_examples=40, deadline=None)
@given(
    ids=st.lists(st.lists(st.integers(0, 200_000), max_size=6), min_size=1, max_size=3),
    prompt=st.lists(st.integers(0, 200_000), min_size=1, max_size=8),
    reasons=st.data(),
)
def test_response_round_trip_property(ids, prompt, reasons):
    finish = [reasons.draw(st.sampled_from(["stop", "length", "repeat"])) for _ in ids]
    item = p.RolloutResponseItem(
        response=p.ChatCompletionResponse(
            model="m", id="1", created=0, prompt_token_ids=prompt,
            choices=[p.ChatCompletionChoice(index=k, message=p.ResponseMessage(content="x"),
                                            finish_reason="length" if r == "length" else "stop", token_ids=t)
                     for k, (t, r) in enumerate(zip(ids, finish))]),
        coordexp=p.CoordexpInferInfo(repeat_terminate_triggered=int("repeat" in finish), finish_reasons=finish))
    wire = json.loads(json.dumps([item.model_dump(mode="json")]))
    parsed = p.parse_infer_response(wire, expected=1)[0]
    for k, (t, r) in enumerate(zip(ids, finish)):
        out = p.item_to_rollout_output(parsed, choice=k)
        assert out.response_token_ids == tuple(t) and out.prompt_token_ids == tuple(prompt)
        assert out.finish_reason == r
