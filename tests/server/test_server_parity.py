"""Serving parity with ``swift rollout`` and hostile text, in process (HF engine on the tiny model): the chat
template's default system prompt, ``--system``, custom stop strings, lone surrogates, the per-request budget, and
the NaN guard that looks only at numbers outside strings, off the event loop."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from coordexp.runtime.rollout import protocol as p
from coordexp.runtime.server import limits
from coordexp.schema.rollout import DecodingConfig
from testkit import json_leaves

MAX_TOKENS = 12


def load_model(path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa")


def make_client(run_contract, processor, tiny_model_dir, dataset, **kwargs):
    from fastapi.testclient import TestClient

    from coordexp.runtime.server.app import create_app
    from coordexp.runtime.server.engine import GenerationParams, HfEngine

    engine = HfEngine.from_contract(run_contract, model=load_model(tiny_model_dir), processor=processor)
    app = create_app(engine, processor, run_contract.template, image_root=dataset.root,
                     defaults=GenerationParams(run_contract.rollout_matching.max_new_tokens, DecodingConfig()), **kwargs)
    return TestClient(app)


@pytest.fixture(scope="module")
def client(run_contract, processor, tiny_model_dir, dataset):
    with make_client(run_contract, processor, tiny_model_dir, dataset) as test_client:
        yield test_client


def body(messages, **config) -> dict:
    return {"infer_requests": [{"messages": messages}],
            "request_config": {"max_tokens": MAX_TOKENS, "temperature": 0.0, "return_details": True, **config}}


def only(reply) -> p.RolloutResponseItem:
    assert reply.status_code == 200, reply.text
    return p.parse_infer_response(reply.json(), expected=1)[0]


def prompt_text(processor, item) -> str:
    return processor.tokenizer.decode(item.response.prompt_token_ids, skip_special_tokens=False)


def test_no_system_message_gets_the_chat_templates_default(client, processor, run_contract):
    """Regression (issue 22): the server inserted the config's detector prompt; swift's server renders the chat
    template's own default (Qwen2-VL: "You are a helpful assistant.")."""
    messages = [{"role": "user", "content": "Name one shape."}]
    item = only(client.post("/infer/", json=body(messages)))
    expected = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt_text(processor, item) == expected
    assert run_contract.template.system_prompt not in prompt_text(processor, item)


def test_an_explicit_server_system_prompt_fills_requests_without_one(run_contract, processor, tiny_model_dir,
                                                                     dataset):
    with make_client(run_contract, processor, tiny_model_dir, dataset, system="You count shapes.") as explicit:
        item = only(explicit.post("/infer/", json=body([{"role": "user", "content": "Name one shape."}])))
        assert "<|im_start|>system\nYou count shapes.<|im_end|>" in prompt_text(processor, item)
        own = only(explicit.post("/infer/", json=body([{"role": "system", "content": "Be brief."},
                                                        {"role": "user", "content": "Name one shape."}])))
        assert "You count shapes." not in prompt_text(processor, own)  # a request's own system message wins


def test_custom_stop_strings_are_honoured(client, processor):
    """Regression (issue 22): any stop string other than <|im_end|> was refused with a 400; swift honours them.
    The choice ends with the token that completes the stop string (vLLM keeps it; swift decodes it)."""
    messages = [{"role": "user", "content": "Describe the picture."}]
    free = only(client.post("/infer/", json=body(messages, max_tokens=MAX_TOKENS)))
    ids = free.response.choices[0].token_ids
    decode = lambda part: processor.tokenizer.decode(part, skip_special_tokens=False)  # noqa: E731
    assert len(ids) >= 4
    stop = decode(ids[:3])[-2:] or decode(ids[:3])  # text that first appears within the first three tokens
    first = next(t for t in range(1, len(ids) + 1) if stop in decode(ids[:t]))
    cut = only(client.post("/infer/", json=body(messages, max_tokens=MAX_TOKENS, stop=[stop, "<|im_end|>"],
                                                logprobs=True)))
    choice = cut.response.choices[0]
    assert choice.token_ids == ids[:first] and choice.finish_reason == "stop"
    assert choice.message.content == decode(ids[:first]) and stop in choice.message.content
    assert len(choice.logprobs.content) == first
    assert cut.coordexp.finish_reasons == ["stop"]


@pytest.mark.parametrize("payload, field", [
    ('{"infer_requests": [{"messages": [{"role": "user", "content": "hi \\ud800"}]}]}',
     "infer_requests[0].messages[0].content"),
    ('{"infer_requests": [{"messages": [{"role": "us\\udfffer", "content": "hi"}]}]}',
     "infer_requests[0].messages[0].role"),
    ('{"infer_requests": [{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}]}',
     "infer_requests[0].messages[0].content[0].text"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(client, payload, field):
    """Regression (issue 23): a lone surrogate in a message's content or role was a 500."""
    reply = client.post("/infer/", content=payload.encode(), headers={"content-type": "application/json"})
    assert reply.status_code == 400 and field in reply.json()["detail"], reply.text
    assert client.get("/health/").status_code == 200


def test_one_call_over_the_sequence_token_budget_is_refused_naming_it(client):
    """Regression (issue 23): one call of 4,096 sequences x any max_tokens passed every limit and held the engine
    for minutes (big calls within the budget are now interleaved with others: tests/server/test_batching.py)."""
    requests = [{"messages": [{"role": "user", "content": "hi"}]}] * 4096
    reply = client.post("/infer/", json={"infer_requests": requests, "request_config": {"max_tokens": 1100}})
    assert reply.status_code == 400 and "--max-request-tokens" in reply.json()["detail"], reply.text
    assert client.get("/coordexp/batch_status/").json()["engine_calls"] >= 0  # nothing queued, still serving


def test_batch_status_counts_engine_calls(client):
    before = client.get("/coordexp/batch_status/").json()
    only(client.post("/infer/", json=body([{"role": "user", "content": "hi"}], max_tokens=2)))
    after = client.get("/coordexp/batch_status/").json()
    assert after["engine_calls"] == before["engine_calls"] + 1 and after["jobs_done"] == before["jobs_done"] + 1
    assert after["waiting_jobs"] == 0


def test_nan_inside_strings_costs_no_parse_and_a_real_nan_is_found(monkeypatch):
    """Regression (issue 22): base64 image data holds "NaN" ~4 times per MB and every such body was parsed twice."""
    data = base64.b64encode(b"\x00" * 3000).decode() + "NaNInfinity" + "9" * 40
    document = json.dumps({"infer_requests": [{"images": [data], "messages": []}],
                           "request_config": {"seed": 3, "note": 'say "NaN" 1e999'}}).encode()
    calls = []
    real = json.loads
    monkeypatch.setattr(limits.json, "loads", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert limits.non_finite_paths(document) == [] and calls == []
    bad = document.replace(b'"seed": 3', b'"seed": NaN')
    assert limits.non_finite_paths(bad) == ["request_config.seed = NaN"]


def test_a_large_body_is_scanned_off_the_event_loop(monkeypatch):
    seen: list[bool] = []
    real = limits.non_finite_paths

    def spy(document):
        try:
            asyncio.get_running_loop()
            seen.append(True)
        except RuntimeError:
            seen.append(False)
        return real(document)

    monkeypatch.setattr(limits, "non_finite_paths", spy)
    payload = json.dumps({"images": ["NaN" * (limits.OFF_LOOP_BYTES // 3)]}).encode()
    answered = []

    async def app(scope, receive, send):
        answered.append((await receive())["body"] == payload)

    guard = limits.BodyGuard(app, max_body_bytes=len(payload) * 2)
    messages = [{"type": "http.request", "body": payload, "more_body": False}]

    async def receive():
        return messages.pop(0)

    async def send(message):
        raise AssertionError(f"refused: {message}")

    asyncio.run(guard({"type": "http", "method": "POST", "headers": [], "path": "/infer/"}, receive, send))
    assert seen == [False] and answered == [True]  # scanned on a worker thread, then passed on untouched


_TRICKY_TEXT = st.lists(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "9" * 31, '"', "\\", "\\\"", "x",
                                         " ", "\u00e9", ":", ",", "[", "{"]), max_size=6).map("".join)
_TRICKY = st.recursive(st.none() | st.integers(-5, 5) | st.floats(allow_nan=True, allow_infinity=True) | _TRICKY_TEXT,
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TRICKY_TEXT, inner, max_size=3),
                       max_leaves=10)


@settings(max_examples=200, deadline=None)
@given(document=_TRICKY, ascii_only=st.booleans())
def test_the_outside_strings_scan_agrees_with_a_full_parse(document, ascii_only):
    """Skipping string literals never hides a non-finite number and never invents one, whatever the strings hold
    (quotes, backslashes, NaN/Infinity text, keys included)."""
    text = json.dumps({"root": document}, ensure_ascii=ascii_only).encode()
    expected = []
    if limits._SUSPECT.search(text):
        full = json.loads(text, parse_constant=limits._NonFinite, parse_float=limits._parse_float,
                          parse_int=limits._parse_int)
        expected = ["x" for v in json_leaves(full) if isinstance(v, limits._NonFinite)]
    assert len(limits.non_finite_paths(text)) == min(len(expected), 8)




@pytest.mark.parametrize("args, named", [(["--system", "a", "--system-from-config"], "--system-from-config"),
                                         (["--system", "a", "--no-system-from-config"], "--no-system-from-config"),
                                         (["--system-from-config", "--no-system-from-config"],
                                          "--system-from-config and --no-system-from-config"),
                                         (["--max-batch-seqs", "0"], "--max-batch-seqs"),
                                         (["--batch-window-ms", "5000"], "--batch-window-ms"),
                                         (["--max-request-tokens", "0"], "--max-request-tokens")])
def test_scheduling_options_out_of_range_exit_2_before_loading(server_config, args, named):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "coordexp.cli.app", "serve-rollout", str(server_config), "--port", "0",
                           "--engine", "hf", *args], capture_output=True, text=True, timeout=120)
    message = " ".join(done.stderr.split())
    assert done.returncode == 2 and named in message and "loading" not in message, done.stderr
