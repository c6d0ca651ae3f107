"""Request coalescing on the rollout server with real engines: /infer/ calls queued together become ONE engine call,
and each caller gets exactly what it gets alone (same tokens, greedy and seeded sampling; logprobs too), on the HF
engine and on the vLLM engine (vLLM's CPU build, slow). Merging is forced deterministically: a barrier operation
holds the worker until every call is queued (the scheduler's waiting count is the readiness signal)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from coordexp.runtime.rollout import protocol as p
from coordexp.runtime.server.batching import BatchPolicy
from coordexp.schema.rollout import DecodingConfig
from .conftest import GUARD, TEMPLATE

WAIT_S = 300.0
MAX_TOKENS = 10

def wire(record) -> dict:
    return {"messages": [{"role": "system", "content": TEMPLATE.system_prompt},
                         {"role": "user", "content": [{"type": "image", "image": str(path)} for path in record.image_paths]
                          + [{"type": "text", "text": TEMPLATE.user_prompt}]}]}

def calls(records) -> list[dict]:
    """Five /infer/ bodies: greedy ones, seeded sampling ones (n = 2 in one), one with logprobs."""
    sampled = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
    config = {"max_tokens": MAX_TOKENS, "return_details": True}
    return [
        {"infer_requests": [wire(records[0]), wire(records[1])], "request_config": {**config, "temperature": 0.0}},
        {"infer_requests": [wire(records[2])], "request_config": {**config, "temperature": 0.0}},
        {"infer_requests": [wire(records[1]), wire(records[3])], "request_config": {**config, **sampled, "seed": 77}},
        {"infer_requests": [wire(records[0])], "request_config": {**config, **sampled, "seed": 5, "n": 2}},
        {"infer_requests": [wire(records[3])], "request_config": {**config, **sampled, "seed": 9, "logprobs": True,
                                                                  "top_logprobs": 2}},
    ]

def tokens(reply: list[dict]) -> list:
    items = p.parse_infer_response(reply, expected=len(reply))
    out = []
    for item in items:
        for choice in item.response.choices:
            logprobs = None
            if choice.logprobs is not None:
                logprobs = [(t.token, round(t.logprob, 4)) for t in choice.logprobs.content]
            out.append((tuple(item.response.prompt_token_ids), tuple(choice.token_ids), choice.finish_reason,
                        logprobs))
    return out

def wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S  # a generous bound on a readiness signal, not a speed assertion
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)

def check_merged_equals_separate(service, bodies) -> None:
    scheduler = service.scheduler
    parsed = [p.InferRequestBody.model_validate(b) for b in bodies]
    alone = [tokens(service.infer(b)) for b in parsed]  # one at a time: separate engine calls
    opened = threading.Event()
    service.run(lambda: opened.wait(WAIT_S))  # hold the worker: every call below queues behind it
    before = scheduler.stats()
    futures = [service.submit_infer(b) for b in parsed]
    wait_for(lambda: scheduler.stats()["waiting_jobs"] == len(bodies), "all calls queued")
    opened.set()
    together = [tokens(f.result(WAIT_S)) for f in futures]
    after = scheduler.stats()
    assert together == alone
    # the greedy calls share ONE engine call, and so do the sampled ones without logprobs (same parameters)
    assert after["engine_calls"] - before["engine_calls"] == 3
    assert after["merged_calls"] - before["merged_calls"] == 2 and after["max_jobs_per_call"] >= 2

def make_service(engine, processor, image_root, defaults):
    from coordexp.runtime.server.app import RolloutService

    return RolloutService(engine, processor, TEMPLATE, image_root=image_root, defaults=defaults,
                          batch=BatchPolicy(max_batch_seqs=64, window_s=0))

def test_hf_engine_merged_calls_equal_separate_calls(model_dir, processor, records, vllm_dataset):
    from transformers import AutoModelForImageTextToText

    from coordexp.runtime.server.engine import GenerationParams, HfEngine

    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32,
                                                        attn_implementation="sdpa")
    model.eval()
    engine = HfEngine(model, processor.tokenizer, decode_batch_size=4, repeat_terminate=GUARD)
    service = make_service(engine, processor, vllm_dataset.root, GenerationParams(MAX_TOKENS, DecodingConfig()))
    try:
        check_merged_equals_separate(service, calls(records))
    finally:
        service.shutdown()

@pytest.mark.slow
def test_vllm_engine_merged_calls_equal_separate_calls(engine, processor, records, vllm_dataset):
    from coordexp.runtime.server.engine import GenerationParams

    service = make_service(engine, processor, vllm_dataset.root, GenerationParams(MAX_TOKENS, DecodingConfig()))
    try:
        check_merged_equals_separate(service, calls(records))
    finally:
        service.scheduler.stop()
        service.worker.stop()  # the session's engine stays open for the other tests
