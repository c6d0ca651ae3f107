"""The rollout server: in process (FastAPI TestClient, HF engine on the tiny model) and as real uvicorn processes
on loopback (health during a slow infer, the CLI with a weight push, busy port, graceful shutdown)."""

from __future__ import annotations

import base64
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
import torch

from coordexp.runtime.rollout.base import RolloutRequest
from coordexp.runtime.rollout.hf import HfRolloutBackend
from coordexp.runtime.model.encoding import build_messages, encode_prompt
from coordexp.runtime.rollout import protocol as p
from coordexp.runtime.server.serve import READY_PREFIX
from coordexp.runtime.rollout.weight_sync import RemoteApplyError, WeightSyncSender
from coordexp.schema.rollout import DecodingConfig

HERE = Path(__file__).parent
MAX_TOKENS = 10


def wire_request(record, template, image=str) -> dict:
    """What a client sends for ``record``: the trainer's messages with each image as a string."""
    system, user = build_messages(record, template)
    items = [{"type": "image", "image": image(path)} for path in record.image_paths] + [user["content"][-1]]
    return {"messages": [system, {"role": "user", "content": items}]}


def infer_body(requests, **config) -> dict:
    return {"infer_requests": requests, "request_config": {"max_tokens": MAX_TOKENS, "temperature": 0.0,
                                                          "return_details": True, **config},
            "metrics": None, "template": None, "use_tqdm": None, "adapter_request": None}


def learner_outputs(model, processor, run, records):
    """Greedy rollouts of ``model`` through the trainer's own HF backend."""
    backend = HfRolloutBackend(model, processor.tokenizer, decode_batch_size=2, max_new_tokens=MAX_TOKENS,
                               decoding=DecodingConfig(), repeat_terminate=run.rollout_matching.repeat_terminate)
    prompts = [encode_prompt(processor, r, run.template) for r in records]
    return backend.generate([RolloutRequest(prompt=q, index=k, seed=1) for k, q in enumerate(prompts)]), prompts


def load_model(path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa")


# ------------------------------------------------------------------------------------------------ in process


@pytest.fixture(scope="module")
def client(run_contract, processor, tiny_model_dir, dataset):
    from fastapi.testclient import TestClient

    from coordexp.runtime.server.app import create_app
    from coordexp.runtime.server.engine import GenerationParams, HfEngine

    engine = HfEngine.from_contract(run_contract, model=load_model(tiny_model_dir), processor=processor)
    app = create_app(engine, processor, run_contract.template, image_root=dataset.root,
                     defaults=GenerationParams(run_contract.rollout_matching.max_new_tokens, DecodingConfig()))
    with TestClient(app) as test_client:
        yield test_client


def test_info_endpoints(client):
    assert client.get("/health/").json() == {"status": "ok"}
    assert client.get("/get_world_size/").json() == {"world_size": 1}
    assert client.post("/get_engine_type/").json() == {"engine_type": "HfEngine", "enable_multi_turn": False,
                                                       "use_gym_env": False, "enable_lora": False}
    assert client.get("/coordexp/sync_status/").json()["communicator"] == "closed"


def test_infer_matches_the_learner_prompt_ids_and_greedy_rollouts(client, run_contract, processor, records,
                                                                   tiny_model_dir):
    chosen = [records[2], records[0], records[1]]
    reply = client.post("/infer/", json=infer_body([wire_request(r, run_contract.template) for r in chosen]))
    assert reply.status_code == 200, reply.text
    items = p.parse_infer_response(reply.json(), expected=3)
    expected, prompts = learner_outputs(load_model(tiny_model_dir), processor, run_contract, chosen)
    for item, prompt, want in zip(items, prompts, expected):
        got = p.item_to_rollout_output(item)
        assert list(got.prompt_token_ids) == prompt.input_ids.tolist()  # the trainer's encode_prompt, exactly
        assert got.response_token_ids == want.response_token_ids
        assert got.text == want.text and got.finish_reason == want.finish_reason
        assert item.response.usage.prompt_tokens == prompt.prompt_len
    assert len({i.response.id for i in items}) == 3


def test_base64_image_equals_the_path_and_tag_form_equals_inline(client, run_contract, records):
    record = records[3]
    by_path = wire_request(record, run_contract.template)
    data = base64.b64encode(record.image_paths[0].read_bytes()).decode()
    by_data_uri = wire_request(record, run_contract.template, image=lambda _: f"data:image/png;base64,{data}")
    system, user = by_path["messages"]
    by_tag = {"messages": [system, {"role": "user", "content": "<image>" + user["content"][-1]["text"]}],
              "images": [data]}
    reply = client.post("/infer/", json=infer_body([by_path, by_data_uri, by_tag]))
    assert reply.status_code == 200, reply.text
    outs = [p.item_to_rollout_output(i) for i in p.parse_infer_response(reply.json(), expected=3)]
    assert outs[0] == outs[1] == outs[2]


REFUSED_PATHS = ["/etc/hostname", "../../../../etc/passwd", "images/missing.png", "images", "x" * 5000 + ".png",
                 "bad\x00name.png", "~nosuchuser_coordexp/a.png"]


def test_every_refused_path_gets_one_message_without_server_paths(client, run_contract, records, dataset):
    """Regression (issue 15.4): "outside the root" vs "not found" told a caller which files exist; a 5000-character
    name was a 500 "File name too long"; bodies carried absolute paths."""
    details = set()
    for image in REFUSED_PATHS:
        reply = client.post("/infer/", json=infer_body([wire_request(records[0], run_contract.template,
                                                                     image=lambda _: image)]))
        assert reply.status_code == 400, (image[:40], reply.text)
        details.add(reply.json()["detail"])
        assert str(dataset.root) not in reply.text and "/etc" not in reply.text and "Error" not in reply.text
    assert len(details) == 1 and "infer_requests[0].images[0]" in details.pop()


def test_urls_are_refused(client, run_contract, records):
    reply = client.post("/infer/", json=infer_body([wire_request(records[0], run_contract.template,
                                                                 image=lambda _: "https://example.com/a.png")]))
    assert reply.status_code == 400 and "not fetched" in reply.json()["detail"]


def test_bare_base64_works_with_and_without_image_root(client, run_contract, records, processor, tiny_model_dir):
    """Regression (issue 15.4): bare base64 (swift's own form) was a 500 "File name too long" under --image-root."""
    from fastapi.testclient import TestClient

    from coordexp.runtime.server.app import create_app
    from coordexp.runtime.server.engine import GenerationParams, HfEngine

    record = records[1]
    bare = base64.b64encode(record.image_paths[0].read_bytes()).decode()
    body = infer_body([wire_request(record, run_contract.template), wire_request(record, run_contract.template,
                                                                                  image=lambda _: bare)])
    with_root = client.post("/infer/", json=body)
    assert with_root.status_code == 200, with_root.text
    by_path, by_bare = [p.item_to_rollout_output(i) for i in p.parse_infer_response(with_root.json(), expected=2)]
    assert by_bare == by_path
    engine = HfEngine.from_contract(run_contract, model=load_model(tiny_model_dir), processor=processor)
    app = create_app(engine, processor, run_contract.template, image_root=None,
                     defaults=GenerationParams(run_contract.rollout_matching.max_new_tokens, DecodingConfig()))
    with TestClient(app) as rootless:
        reply = rootless.post("/infer/", json=infer_body([wire_request(record, run_contract.template,
                                                                       image=lambda _: bare)]))
        assert reply.status_code == 200, reply.text
        assert p.item_to_rollout_output(p.parse_infer_response(reply.json())[0]) == by_path
        refused = rootless.post("/infer/", json=infer_body([wire_request(record, run_contract.template)]))
        assert refused.status_code == 400 and "started without --image-root" in refused.json()["detail"]
        assert str(record.image_paths[0]) not in refused.text


def test_a_500_names_no_path_and_no_exception_text(client, run_contract, records, monkeypatch):
    engine = client.app.state.service.engine

    def explode(*_args, **_kwargs):
        raise RuntimeError("/very/secret/place exploded")

    monkeypatch.setattr(engine, "generate", explode)
    reply = client.post("/infer/", json=infer_body([wire_request(records[0], run_contract.template)]))
    assert reply.status_code == 500
    assert "secret" not in reply.text and "exploded" not in reply.text and "RuntimeError" not in reply.text
    assert "incident" in reply.json()["detail"]


@pytest.mark.parametrize("extra, name", [
    ({"request_config": {"structured_outputs_regex": "[0-9]+"}}, "request_config.structured_outputs_regex"),
    ({"request_config": {"stream": True}}, "request_config.stream"),
    ({"request_config": {"top_logprobs": 3}}, "request_config.top_logprobs"),
    ({"request_config": {"logprobs": True, "top_logprobs": 50}}, "request_config.top_logprobs"),
    ({"request_config": {"presence_penalty": 0.5}}, "request_config.presence_penalty"),
    ({"request_config": {"length_penalty": 2.0}}, "request_config.length_penalty"),
    ({"request_config": {"guided_json": {}}}, "request_config.guided_json"),
    ({"request_config": {"stop": ["}"], "num_beams": 2}}, "request_config.stop"),
    ({"adapter_request": {"name": "a", "path": "b"}}, "adapter_request"),
    ({"template": "qwen2_vl"}, "template"),
    ({"metrics": [{}]}, "metrics"),
    ({"sampling": {"x": 1}}, "sampling"),
    ({"request_extra": {"voice": "x"}}, "infer_requests[0].voice"),
    ({"request_extra": {"tools": [{"name": "f"}]}}, "infer_requests[0].tools"),
])
def test_a_field_that_cannot_be_honoured_is_a_400_naming_it(client, run_contract, records, extra, name):
    """Regression (issue 11): structured_outputs_regex (and any unknown key) was silently ignored."""
    request = {**wire_request(records[0], run_contract.template), **extra.get("request_extra", {})}
    body = infer_body([request], **extra.get("request_config", {}))
    body.update({k: v for k, v in extra.items() if k not in ("request_config", "request_extra")})
    reply = client.post("/infer/", json=body)
    assert reply.status_code == 400 and name in reply.json()["detail"], reply.text


def test_out_of_range_values_are_refused(client, run_contract, records):
    reply = client.post("/infer/", json=infer_body([wire_request(records[0], run_contract.template)], top_p=2.0))
    assert reply.status_code in (400, 422) and "top_p" in reply.text


def _rendered_ids(processor, messages) -> list[int]:
    """The chat template's own tokenisation of ``messages`` (image pads not yet expanded)."""
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return processor.tokenizer(text, add_special_tokens=False)["input_ids"]


def _collapse_pads(ids, pad_id) -> list[int]:
    out = []
    for i in ids:
        if not (i == pad_id and out and out[-1] == pad_id):
            out.append(i)
    return out


@pytest.mark.parametrize("shape", ["text_only", "text_before_image", "multi_turn", "two_images_two_turns"])
def test_any_chat_the_template_accepts_is_served(client, run_contract, records, processor, shape):
    """Regression (issue 11): text-only, text-before-image and multi-turn chats were refused with 400."""
    image = str(records[0].image_paths[0])
    system = {"role": "system", "content": "You are terse."}
    chats = {
        "text_only": [system, {"role": "user", "content": "Say hi."}],
        "text_before_image": [{"role": "user", "content": [{"type": "text", "text": "Look:"},
                                                            {"type": "image", "image": image}]}],
        "multi_turn": [system, {"role": "user", "content": [{"type": "image", "image": image},
                                                            {"type": "text", "text": "What is it?"}]},
                       {"role": "assistant", "content": "A shape."}, {"role": "user", "content": "Which colour?"}],
        "two_images_two_turns": [{"role": "user", "content": [{"type": "image", "image": image}]},
                                 {"role": "assistant", "content": "ok"},
                                 {"role": "user", "content": [{"type": "text", "text": "and"},
                                                              {"type": "image", "image": image}]}],
    }
    messages = chats[shape]
    reply = client.post("/infer/", json=infer_body([{"messages": messages}]))
    assert reply.status_code == 200, reply.text
    out = p.item_to_rollout_output(p.parse_infer_response(reply.json(), expected=1)[0])
    expected_messages = [dict(m, content=[{"type": "image"} if i.get("type") == "image" else i for i in m["content"]])
                         if isinstance(m["content"], list) else m for m in messages]
    # no system message: the chat template's own default, as swift's server gives it (not the config's prompt)
    pad_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert _collapse_pads(out.prompt_token_ids, pad_id) == _rendered_ids(processor, expected_messages)
    assert out.prompt_token_ids.count(pad_id) >= sum(str(m).count("'image'") for m in messages)


def test_logprobs_have_swifts_shape_and_greedy_picks_the_best(client, run_contract, records, processor):
    """Regression (issue 11): every /infer/ of a swift >= 3.11 GRPO trainer (logprobs: true) was a 400."""
    body = infer_body([wire_request(r, run_contract.template) for r in records[:2]], logprobs=True, top_logprobs=3)
    reply = client.post("/infer/", json=body)
    assert reply.status_code == 200, reply.text
    end_of_turn = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    for item in reply.json():
        choice = item["response"]["choices"][0]
        content = choice["logprobs"]["content"]
        ids = choice["token_ids"] + ([end_of_turn] if choice["finish_reason"] == "stop" else [])
        assert [e["token"] for e in content] == [processor.tokenizer.decode([i]) for i in ids]
        for entry in content:
            assert entry["bytes"] == list(entry["token"].encode("utf-8")) and entry["logprob"] <= 0
            tops = entry["top_logprobs"]
            assert len(tops) == 3 and tops == sorted(tops, key=lambda t: -t["logprob"])
            assert entry["logprob"] == pytest.approx(tops[0]["logprob"], abs=1e-4)  # greedy took the argmax
    plain = client.post("/infer/", json=infer_body([wire_request(records[0], run_contract.template)], logprobs=True))
    entry = plain.json()[0]["response"]["choices"][0]["logprobs"]["content"][0]
    assert "top_logprobs" not in entry or entry["top_logprobs"] is None


def test_sampled_logprobs_are_after_temperature(client, run_contract, records, processor, tiny_model_dir):
    """The chosen token's logprob is log_softmax(logits / T) of a plain forward (swift 3.12: processed_logprobs)
    over the ids the engine may emit (image/video pads and padded vocabulary rows masked, as vLLM reports)."""
    from coordexp.runtime.model.encoding import encode_teacher_forced

    record, temperature = records[2], 0.7
    reply = client.post("/infer/", json=infer_body([wire_request(record, run_contract.template)], logprobs=True,
                                                   temperature=temperature, seed=11, top_p=1.0, top_k=-1))
    assert reply.status_code == 200, reply.text
    choice = reply.json()[0]["response"]["choices"][0]
    ids = choice["token_ids"]
    sample = encode_teacher_forced(processor, record, run_contract.template, ids)
    with torch.no_grad():
        logits = load_model(tiny_model_dir)(**sample.model_inputs()).logits[0].float()
    start = sample.assistant_start - 1
    rows = logits[start:start + len(ids)] / temperature
    tokenizer = processor.tokenizer
    rows[:, [tokenizer.convert_tokens_to_ids("<|image_pad|>"), tokenizer.convert_tokens_to_ids("<|video_pad|>")]] = \
        float("-inf")
    rows[:, len(tokenizer):] = float("-inf")
    expected = torch.log_softmax(rows, dim=-1)
    got = [e["logprob"] for e in choice["logprobs"]["content"][:len(ids)]]
    want = expected.gather(1, torch.tensor(ids)[:, None])[:, 0].tolist()
    assert got == pytest.approx(want, abs=1e-3)


def test_n_choices_are_returned_per_request(client, run_contract, records):
    reply = client.post("/infer/", json=infer_body([wire_request(records[0], run_contract.template)], n=2,
                                                   temperature=1.0, seed=5))
    assert reply.status_code == 200 and len(reply.json()[0]["response"]["choices"]) == 2


def test_empty_infer_answers_an_empty_list(client):
    assert client.post("/infer/", json=infer_body([])).json() == []


def test_weight_endpoints_refuse_before_any_broadcast(client):
    metadatas = [{"name": "x", "shape": [2], "dtype": "torch.float32", "start_idx": 0, "end_idx": 2, "numel": 2}]
    reply = client.post("/update_flattened_params/", json={"metadatas": metadatas})
    assert reply.status_code == 409 and "/init_communicator/" in reply.json()["detail"]
    reply = client.post("/update_adapter_flattened_param/",
                        json={"lora_int_id": 1, "peft_config": {"r": 8}, "metadatas": metadatas})
    assert reply.status_code == 400 and "no LoRA support" in reply.json()["detail"]
    reply = client.post("/init_communicator/", json={"host": "0.0.0.0", "port": 51216, "world_size": 4})
    assert reply.status_code == 400 and "send world_size: 2" in reply.json()["detail"]
    assert client.post("/reset_prefix_cache/").json() == {"message": p.reset_prefix_cache_message(True)}
    assert client.post("/close_communicator/").json() == {"message": p.MESSAGE_CLOSE}


def test_a_failed_rendezvous_is_never_broken_without_its_reason(run_contract, processor, tiny_model_dir, dataset,
                                                                  monkeypatch):
    """CI saw /coordexp/sync_status/ report "broken" with last_error null: the rendezvous marked the communicator
    broken before the failure was recorded. Every status read while the group fails (here, from the listener's close,
    which runs in between) shows either no failure yet or "broken" with its reason."""
    from fastapi.testclient import TestClient

    from coordexp.runtime.server import app as app_module
    from coordexp.runtime.server.engine import GenerationParams, HfEngine

    engine = HfEngine.from_contract(run_contract, model=load_model(tiny_model_dir), processor=processor)
    app = app_module.create_app(engine, processor, run_contract.template, image_root=dataset.root,
                                defaults=GenerationParams(16, DecodingConfig()), sync_timeout_s=1.0)
    service = app.state.service
    seen = []
    close = app_module.ListenerGate.close

    def close_and_look(self):
        close(self)
        seen.append(service.status())

    monkeypatch.setattr(app_module.ListenerGate, "close", close_and_look)
    with TestClient(app) as client:
        port = _free_port()
        reply = client.post("/init_communicator/", json={"host": "127.0.0.1", "port": port, "world_size": 2,
                                                           "timeout_s": 1.0})
        assert reply.status_code == 200, reply.text
        deadline = time.monotonic() + 120
        while service.status().communicator == "initializing" and time.monotonic() < deadline:
            time.sleep(0.05)
        final = service.status()
    assert final.communicator == "broken" and "could not form the group" in final.last_error
    assert seen, "the listener was never closed"
    for status in seen + [final]:
        assert status.communicator != "broken" or status.last_error, status


# ------------------------------------------------------------------------------------------------ real processes


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(args: list[str], timeout_s: float = 120.0) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen.append(line)
        if line.startswith(READY_PREFIX):
            threading.Thread(target=process.stdout.read, daemon=True).start()  # keep draining the pipe
            return process, line[len(READY_PREFIX):].strip()
    process.kill()
    raise AssertionError("the server did not become ready:\n" + "".join(seen))


def _stop(process: subprocess.Popen) -> int:
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.slow
def test_health_answers_during_a_slow_infer_and_order_is_kept(tiny_model_dir, dataset, records, run_contract):
    process, url = _start([sys.executable, str(HERE / "_slow_server.py"), str(tiny_model_dir), str(dataset.root), "3"])
    try:
        body = infer_body([wire_request(r, run_contract.template) for r in records], seed=500)
        result: dict = {}

        def call() -> None:
            result["reply"] = httpx.post(f"{url}/infer/", json=body, timeout=60)

        worker = threading.Thread(target=call)
        worker.start()
        time.sleep(0.8)  # the infer is now sleeping inside the engine
        started = time.monotonic()
        assert httpx.get(f"{url}/health/", timeout=5).json() == {"status": "ok"}
        assert time.monotonic() - started < 1.0 and worker.is_alive()
        assert httpx.get(f"{url}/get_world_size/", timeout=5).json() == {"world_size": 2}
        worker.join(timeout=60)
        items = p.parse_infer_response(result["reply"].json(), expected=len(records))
        # one item per request, in order; request j sampled with seed 500 + j (MS310's per-request offset)
        assert [i.response.choices[0].token_ids for i in items] == [[j, 500 + j] for j in range(len(records))]
        assert _stop(process) == 0
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.slow
def test_cli_server_weight_push_changes_outputs_to_the_learners(server_config, tiny_model_dir, dataset, records,
                                                                run_contract, processor):
    process, url = _start([sys.executable, "-m", "coordexp.cli.app", "serve-rollout", str(server_config),
                           "--port", "0", "--engine", "hf", "--image-root", str(dataset.root),
                           "--log-level", "warning"])
    try:
        chosen = records[:2]
        body = infer_body([wire_request(r, run_contract.template) for r in chosen])

        def served() -> list:
            reply = httpx.post(f"{url}/infer/", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            return [p.item_to_rollout_output(i).response_token_ids for i in p.parse_infer_response(reply.json())]

        before = served()
        learner = load_model(tiny_model_dir)
        generator = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for param in learner.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.5)
        expected = [o.response_token_ids for o in learner_outputs(learner, processor, run_contract, chosen)[0]]
        assert expected != before  # the push must be visible

        group_port = _free_port()
        reply = httpx.post(f"{url}/init_communicator/", timeout=10,
                           json={"host": "127.0.0.1", "port": group_port, "world_size": 2, "backend": "gloo",
                                 "timeout_s": 30})
        answer = reply.json()
        key = answer.pop("rendezvous_key")  # the per-init secret every store key lives under
        assert len(key) == 32 and int(key, 16) >= 0
        assert answer == {"message": p.MESSAGE_INIT, "world_size": 2, "client_rank": 1, "backend": "gloo",
                          "timeout_s": 30}  # within the server's cap (the config's 240 s): kept
        sender = WeightSyncSender(timeout_s=30, backend="gloo")
        sender.init("127.0.0.1", group_port, 2, rendezvous_key=key)

        def announce(metadatas) -> None:
            answer = httpx.post(f"{url}/update_flattened_params/", timeout=10,
                                json={"metadatas": [m.model_dump(mode="json") for m in metadatas]})
            answer.raise_for_status()
            assert answer.json() == {"message": p.MESSAGE_UPDATE_FLATTENED}

        report = sender.send_full(learner.state_dict().items(), announce=announce, bucket_mb=1)
        assert report.buckets > 1
        httpx.post(f"{url}/reset_prefix_cache/", timeout=30).raise_for_status()
        assert served() == expected

        with pytest.raises(RemoteApplyError, match="not.a.weight"):
            sender.send_full([("not.a.weight", torch.ones(3))], announce=announce)
        status = p.SyncStatusResponse.model_validate(httpx.get(f"{url}/coordexp/sync_status/", timeout=10).json())
        assert status.communicator == "ready" and status.failed == 1 and status.pending == 0
        assert status.weights_version == report.buckets and "not.a.weight" in status.last_error
        assert served() == expected  # a refused bucket changes nothing

        assert httpx.post(f"{url}/close_communicator/", timeout=10).json() == {"message": p.MESSAGE_CLOSE}
        sender.close()
        assert _stop(process) == 0
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.slow
def test_busy_port_is_an_error_not_a_silent_move(server_config):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "coordexp.cli.app", "serve-rollout", str(server_config),
                               "--port", str(port), "--engine", "hf"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3  # a busy port is an external condition (the error family), not bad input
    assert f"port {port} on 127.0.0.1 is already in use" in " ".join(done.stderr.split())
    assert time.monotonic() - started < 30


# ------------------------------------------------------------------------------------------------ processed logprobs


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), vocab=st.integers(2, 40), temperature=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
       top_k=st.integers(-1, 45), top_p=st.floats(0.05, 1.0), penalty=st.sampled_from([1.0, 1.3]))
@example(seed=0, vocab=2, temperature=0.5, top_k=0, top_p=1.0, penalty=1.0)  # regression: top_p = 1 at the edge
def test_processed_logprobs_follow_vllms_order(seed, vocab, temperature, top_k, top_p, penalty):
    """Rows are normalised; greedy is the plain log-softmax (after the penalty); sampling keeps the top-k, then the
    smallest best-first prefix whose mass reaches top_p; a seen id's positive logit is divided by the penalty."""
    from coordexp.runtime.rollout.logprobs import processed_logprobs

    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, vocab, generator=generator) * 3
    ids = torch.randint(0, vocab, (6,), generator=generator)
    decoding = DecodingConfig(temperature=temperature, top_k=top_k if top_k > 0 else -1,
                              top_p=top_p if temperature > 0 else 1.0, repetition_penalty=penalty)
    out = processed_logprobs(logits, ids, 4, decoding)
    assert torch.allclose(torch.logsumexp(out, dim=1), torch.zeros(3), atol=1e-5)
    penalised = logits.clone()
    for s in range(3):
        for i in set(ids[:4 + s].tolist()):
            penalised[s, i] = penalised[s, i] / penalty if penalised[s, i] > 0 else penalised[s, i] * penalty
    if temperature == 0:
        assert torch.allclose(out, torch.log_softmax(penalised, dim=1), atol=1e-5)
        return
    for s in range(3):
        kept = torch.isfinite(out[s])
        scaled = penalised[s] / temperature
        allowed = scaled.argsort(descending=True)[:top_k] if 0 < top_k < vocab else torch.arange(vocab)
        assert set(kept.nonzero()[:, 0].tolist()) <= set(allowed.tolist())
        probs = torch.softmax(scaled[allowed], dim=0).sort(descending=True).values
        # the smallest prefix reaching top_p (within float32 rounding at the boundary); top_p = 1 filters nothing,
        # even when the best token alone holds all but 1e-7 of the mass (found by hypothesis)
        mass = torch.cumsum(probs, 0)
        fewest, most = (int((mass < top_p + eps).sum()) + 1 for eps in (-1e-5, 1e-5))
        if top_p >= 1.0:
            fewest = most = len(allowed)
        assert min(fewest, len(allowed)) <= int(kept.sum()) <= min(most, len(allowed))
