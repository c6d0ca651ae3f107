"""Logprobs from the vLLM engine (``coordexp serve-rollout --engine vllm`` with ``logprobs: true``, issue 11 item 3):
computed in the same generate call, in swift's per-choice shape, equal to a float32 HF forward of the same tokens
after the sampling transforms, and served by ``/infer/``. Regression: the vLLM server answered every swift >= 3.11
GRPO request (which always sends ``logprobs: true``) with a 400."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coordexp.runtime.rollout.logprobs import TokenLogprob, from_vllm_steps
from coordexp.schema.rollout import DecodingConfig

from .conftest import GUARD, MAX_NEW, SKIP_REASON, TEMPLATE, VLLM_MISSING, load_hf_model

needs_vllm = pytest.mark.skipif(VLLM_MISSING, reason=SKIP_REASON)
GREEDY = DecodingConfig()
SAMPLED = DecodingConfig(temperature=0.7, top_p=0.9, top_k=50, repetition_penalty=1.1)
GROUPED = DecodingConfig(coord_group_greedy=True, repetition_penalty=1.1)  # the rule after the penalty
# float32 HF and vLLM's CPU build agree on a logit to a few 1e-5 (vllm_cpu_findings.md); log_softmax keeps that
TOLERANCE = 2e-4


# ------------------------------------------------------------------------------ the vLLM -> TokenLogprob mapping


@st.composite
def vllm_steps(draw):
    """What vLLM returns for ``logprobs=k``: per step the k best ids plus the sampled id, with ranks from 1."""
    vocab = draw(st.integers(2, 12))
    k = draw(st.integers(0, vocab))
    length = draw(st.integers(0, 6))
    finite = st.floats(-30, 0, allow_nan=False, allow_infinity=False)
    ids, steps, dists = [], [], []
    for _ in range(length):
        values = draw(st.lists(st.one_of(finite, st.just(-math.inf)), min_size=vocab, max_size=vocab))
        values[draw(st.integers(0, vocab - 1))] = draw(finite)  # at least one token can be sampled
        sampled = draw(st.sampled_from([i for i, v in enumerate(values) if v != -math.inf]))
        order = sorted(range(vocab), key=lambda i: (-values[i], i))
        kept = set(order[:k]) | {sampled}
        steps.append({i: SimpleNamespace(logprob=values[i], rank=order.index(i) + 1) for i in kept})
        ids.append(sampled)
        dists.append(values)
    return ids, steps, dists, k


@given(vllm_steps(), st.data())
@settings(max_examples=200, deadline=None)
def test_from_vllm_steps_keeps_the_sampled_value_and_the_best_finite_alternatives(case, data):
    ids, steps, dists, k = case
    top = data.draw(st.integers(0, k))
    got = from_vllm_steps(ids, steps, top)
    assert [t.token_id for t in got] == ids
    for entry, values, token_id in zip(got, dists, ids):
        assert entry.logprob == values[token_id]
        finite = sorted((v for v in values if v != -math.inf), reverse=True)
        assert [v for _, v in entry.top] == finite[:top]  # the best values, best first, no -inf
        assert all(values[i] == v for i, v in entry.top)
        assert len({i for i, _ in entry.top}) == len(entry.top)


def test_from_vllm_steps_refuses_steps_without_the_sampled_token_or_too_few_steps():
    step = {3: SimpleNamespace(logprob=-0.5, rank=1)}
    with pytest.raises(ValueError, match="do not include the sampled token 4"):
        from_vllm_steps([4], [step], 1)
    with pytest.raises(ValueError, match="logprobs for 1 steps but generated 2 tokens"):
        from_vllm_steps([3, 3], [step], 1)
    assert from_vllm_steps([3], [step], 0) == [TokenLogprob(3, -0.5, ())]


# ------------------------------------------------------------------------------------------- the real engine


def _params(decoding, logprobs):
    from coordexp.runtime.server.engine import GenerationParams

    return GenerationParams(max_new_tokens=MAX_NEW, decoding=decoding, logprobs=logprobs)


def _never_emit_ids(tokenizer, vocab_rows: int) -> list[int]:
    """The ids coordexp's logits processor sets to -inf (image/video pads, padded vocabulary rows)."""
    pads = [tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>")]
    return sorted({int(i) for i in pads if i is not None and i != tokenizer.unk_token_id}
                  | set(range(len(tokenizer), vocab_rows)))


def _reference_logprobs(model, processor, request, ids, decoding) -> torch.Tensor:
    """log-probabilities a float32 HF forward gives ``ids`` after the prompt, with the never-emit ids masked
    (vLLM samples, and reports, after coordexp's processor) and the sampling transforms in vLLM's order."""
    from coordexp.runtime.model.encoding import encode_teacher_forced
    from coordexp.runtime.rollout.logprobs import processed_logprobs

    sample = encode_teacher_forced(processor, request.record, TEMPLATE, ids, prompt=request.prompt)
    with torch.no_grad():
        logits = model(**sample.model_inputs()).logits[0].float()
    start = sample.assistant_start - 1
    rows = logits[start:start + len(ids)].clone()
    rows[:, _never_emit_ids(processor.tokenizer, rows.shape[1])] = float("-inf")
    from coordexp.runtime.rollout.coord_group import coord_id_tensor

    coords = coord_id_tensor(processor.tokenizer) if decoding.coord_group_greedy else None
    return processed_logprobs(rows, sample.input_ids, start + 1, decoding, coords)


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("decoding", [GREEDY, SAMPLED, GROUPED], ids=["greedy", "sampled", "coord_group_greedy"])
def test_vllm_logprobs_equal_a_float32_forward_after_the_sampling_transforms(engine, model_dir, processor,
                                                                             rollout_requests, decoding):
    params = _params(decoding, 3)
    outputs = engine.generate(rollout_requests, params)
    scored = engine.token_logprobs(rollout_requests, outputs, params, 3)
    model = load_hf_model(model_dir)
    compared = 0
    for request, output, tokens in zip(rollout_requests, outputs, scored):
        stopped = output.finish_reason != "length"
        expected_ids = list(output.response_token_ids) + ([engine.end_of_turn_id] if stopped else [])
        assert [t.token_id for t in tokens] == expected_ids  # response ids, then the stop token it stopped on
        if output.finish_reason == "repeat":  # the guard forced EOS: a point mass after the processor
            assert tokens[-1].logprob == 0.0 and tokens[-1].top == ((engine.end_of_turn_id, 0.0),)
            tokens, expected_ids = tokens[:-1], expected_ids[:-1]
        if not expected_ids:
            continue
        reference = _reference_logprobs(model, processor, request, expected_ids, decoding)
        want = reference.gather(1, torch.tensor(expected_ids)[:, None])[:, 0].tolist()
        assert [t.logprob for t in tokens] == pytest.approx(want, abs=TOLERANCE)
        for row, entry in zip(reference, tokens):
            best = [(i, v) for i, v in zip(*(t.tolist() for t in row.topk(3)[::-1])) if v != float("-inf")]
            assert [i for i, _ in entry.top] == [i for i, _ in best]  # top-k/top-p masked ids are not offered
            assert [v for _, v in entry.top] == pytest.approx([v for _, v in best], abs=TOLERANCE)
            assert entry.top == tuple(sorted(entry.top, key=lambda pair: -pair[1]))
        compared += len(expected_ids)
    assert compared >= 2 * MAX_NEW  # the comparison covered real tokens, not only empty or forced rollouts


@pytest.mark.vllm
@needs_vllm
def test_greedy_logprobs_take_the_argmax_and_have_the_hf_engines_shape(engine, model_dir, processor,
                                                                       rollout_requests):
    from coordexp.runtime.server.engine import HfEngine

    params = _params(GREEDY, 2)
    outputs = engine.generate(rollout_requests, params)
    served = engine.token_logprobs(rollout_requests, outputs, params, 2)
    hf_engine = HfEngine(load_hf_model(model_dir), processor.tokenizer, decode_batch_size=4, repeat_terminate=GUARD)
    hf_outputs = hf_engine.generate(rollout_requests, params)
    assert [o.response_token_ids for o in hf_outputs] == [o.response_token_ids for o in outputs]
    hf_scored = hf_engine.token_logprobs(rollout_requests, hf_outputs, params, 2)
    for output, tokens, hf_tokens in zip(outputs, served, hf_scored):
        assert [t.token_id for t in tokens] == [t.token_id for t in hf_tokens]
        assert [len(t.top) for t in tokens] == [len(t.top) for t in hf_tokens] == [2] * len(tokens)
        for k, entry in enumerate(tokens):
            assert entry.top[0] == (entry.token_id, entry.logprob)  # greedy: the chosen token is the best one
            if output.finish_reason == "repeat" and k == len(tokens) - 1:
                continue
            # both report after the never-emit mask (the HF engine did not, and scored up to 0.25 lower)
            assert entry.logprob == pytest.approx(hf_tokens[k].logprob, abs=TOLERANCE)


@pytest.mark.vllm
@needs_vllm
def test_flat_logits_show_the_never_emit_mask_and_a_forced_eos_is_certain(restore_engine, model_dir, processor,
                                                                          rollout_requests):
    """A zero final norm makes every logit 0: greedy repeats one id until the guard forces EOS. The repeated
    tokens' logprob is -log(allowed ids) (the never-emit ids are masked before vLLM reports), the forced EOS 0."""
    model = load_hf_model(model_dir)
    with torch.no_grad():
        model.get_parameter("model.language_model.norm.weight").zero_()
    restore_engine.load_weights(model.named_parameters())
    params = _params(GREEDY, 2)
    output = restore_engine.generate(rollout_requests[:1], params)[0]
    tokens = restore_engine.token_logprobs(rollout_requests[:1], [output], params, 2)[0]
    assert output.finish_reason == "repeat" and len(set(output.response_token_ids)) == 1
    vocab_rows = model.get_parameter("lm_head.weight").shape[0]
    allowed = vocab_rows - len(_never_emit_ids(processor.tokenizer, vocab_rows))
    assert allowed < vocab_rows
    for entry in tokens[:-1]:
        assert entry.logprob == pytest.approx(-math.log(allowed), abs=1e-5)
        assert [v for _, v in entry.top] == pytest.approx([-math.log(allowed)] * 2, abs=1e-5)
    assert (tokens[-1].token_id, tokens[-1].logprob) == (restore_engine.end_of_turn_id, 0.0)
    assert tokens[-1].top == ((restore_engine.end_of_turn_id, 0.0),)  # every other id is -inf: not offered


@pytest.mark.vllm
@needs_vllm
def test_top_zero_returns_the_chosen_token_only(engine, rollout_requests):
    params = _params(GREEDY, 0)
    outputs = engine.generate(rollout_requests[:1], params)
    tokens = engine.token_logprobs(rollout_requests[:1], outputs, params, 0)[0]
    assert tokens and all(t.top == () and t.logprob <= 0 for t in tokens)


@pytest.mark.vllm
@needs_vllm
def test_token_logprobs_refuses_outputs_generated_without_logprobs(engine, rollout_requests):
    plain = _params(GREEDY, None)
    outputs = engine.generate(rollout_requests[:1], plain)
    with pytest.raises(ValueError, match="while sampling, not afterwards"):
        engine.token_logprobs(rollout_requests[:1], outputs, plain, 0)
    scored = _params(GREEDY, 1)
    with pytest.raises(ValueError, match="did not produce with logprobs"):
        engine.token_logprobs(rollout_requests[:1], outputs, scored, 1)  # an older generate()'s outputs
    with pytest.raises(ValueError, match="0..20"):
        engine.generate(rollout_requests[:1], _params(GREEDY, 21))


@pytest.mark.vllm
@needs_vllm
def test_colocate_rollouts_do_not_pay_for_logprobs(engine, rollout_requests):
    """The colocate backend's calls (no GenerationParams) ask vLLM for no logprobs and keep nothing."""
    engine.generate(rollout_requests[:1], decoding=GREEDY, max_new_tokens=4)
    params = engine.sampling_params(GREEDY, 4, seed=1)
    assert params.logprobs is None
    with pytest.raises(ValueError, match="did not produce with logprobs"):
        engine.token_logprobs(rollout_requests[:1], [object()], _params(GREEDY, 0), 0)


# ------------------------------------------------------------------------------------- /infer/ on the vLLM engine


@pytest.mark.vllm
@needs_vllm
def test_infer_with_logprobs_on_the_vllm_engine(engine, processor, vllm_dataset, records, monkeypatch):
    """Regression (issue 11): serve-rollout --engine vllm refused logprobs: true with a 400."""
    monkeypatch.setattr(engine, "close", lambda: None)  # the app closes its engine at shutdown; this one is shared
    from fastapi.testclient import TestClient

    from coordexp.runtime.model.encoding import build_messages
    from coordexp.runtime.server.app import create_app
    from coordexp.runtime.server.engine import GenerationParams

    def wire(record):
        system, user = build_messages(record, TEMPLATE)
        items = [{"type": "image", "image": str(p)} for p in record.image_paths] + [user["content"][-1]]
        return {"messages": [system, {"role": "user", "content": items}]}

    app = create_app(engine, processor, TEMPLATE, image_root=vllm_dataset.root,
                     defaults=GenerationParams(MAX_NEW, GREEDY))
    body = {"infer_requests": [wire(r) for r in records[:2]],
            "request_config": {"max_tokens": 8, "temperature": 0.0, "return_details": True, "logprobs": True,
                               "top_logprobs": 3}}
    end_of_turn = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    with TestClient(app) as client:
        reply = client.post("/infer/", json=body)
        assert reply.status_code == 200, reply.text
        for item in reply.json():
            choice = item["response"]["choices"][0]
            ids = choice["token_ids"] + ([end_of_turn] if choice["finish_reason"] == "stop" else [])
            content = choice["logprobs"]["content"]
            assert [e["token"] for e in content] == [processor.tokenizer.decode([i]) for i in ids]
            for entry in content:
                assert entry["bytes"] == list(entry["token"].encode("utf-8")) and entry["logprob"] <= 0
                tops = entry["top_logprobs"]
                assert len(tops) == 3 and tops == sorted(tops, key=lambda t: -t["logprob"])
                assert (tops[0]["token"], tops[0]["logprob"]) == (entry["token"], entry["logprob"])  # greedy
        plain = client.post("/infer/", json={**body, "request_config": {**body["request_config"],
                                                                        "top_logprobs": None}})
        assert plain.status_code == 200, plain.text
        entry = plain.json()[0]["response"]["choices"][0]["logprobs"]["content"][0]
        assert entry.get("top_logprobs") is None
        without = client.post("/infer/", json={**body, "request_config": {"max_tokens": 8, "temperature": 0.0}})
        assert without.status_code == 200 and without.json()[0]["response"]["choices"][0]["logprobs"] is None


@pytest.mark.vllm
@needs_vllm
def test_a_request_flagged_greedy_decodes_greedily_among_sampled_ones(engine, rollout_requests):
    """The reward objective's greedy group member on vLLM colocate: in a sampling call, a request flagged
    ``greedy`` gets the greedy output whatever its seed; its unflagged twin samples."""
    import dataclasses

    request = rollout_requests[0]
    greedy = engine.generate([request], _params(GREEDY, None))[0]
    flagged = [dataclasses.replace(request, index=k, seed=1000 + k, greedy=True) for k in range(2)]
    sampled = [dataclasses.replace(request, index=2 + k, seed=2000 + k) for k in range(2)]
    outputs = engine.generate(flagged + sampled, _params(DecodingConfig(temperature=1.0), None))
    assert [o.response_token_ids for o in outputs[:2]] == [greedy.response_token_ids] * 2
    assert outputs[2].response_token_ids != outputs[3].response_token_ids  # sampling went on beside them
