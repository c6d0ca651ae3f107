"""Label-drafted decoding (``hf_generate.label_drafts``) returns exactly what plain decoding returns.

The property test decodes random batches of requests on tiny random Qwen2-VL / Qwen2.5-VL / Qwen3-VL models twice,
drafts off and on, under random decoding settings, with drafts that the model follows token for token (its own
plain output, so long accepts happen), follows for a while (a corrupted copy), never follows (garbage), or the
ground truth's serialization, and compares every token and finish reason. One model variant writes EOS early, so
stopping mid-verify is exercised; the repeat guard's forced EOS and ``max_new_tokens`` cut others.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import coordexp.runtime.rollout.label_drafts as label_drafts
from coordexp.runtime.model.data import load_records
from coordexp.runtime.model.encoding import encode_prompt, load_processor
from coordexp.runtime.rollout.base import RolloutRequest
from coordexp.runtime.rollout.hf import HfRolloutBackend
from coordexp.runtime.rollout.label_drafts import DraftCursor, DraftFigures
from coordexp.runtime.train.rollout_step import HostContext, build_gt_sample, label_draft_ids
from coordexp.schema.contract import load_contract
from coordexp.schema.rollout import DecodingConfig, HfGenerateConfig, RepeatTerminateConfig
from coordexp.schema.template import TemplateConfig

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "stage2_cpu_hf.yaml"
END = "<|im_end|>"
GUARD = RepeatTerminateConfig(enabled=True, min_new_tokens=0, max_consecutive_token_repeats=3, ngram_size=6,
                              ngram_repeats=2)
TEMPLATES = (
    TemplateConfig(system_prompt="Find shapes.", user_prompt="List them.", min_pixels=28 * 28 * 4,
                   max_pixels=28 * 28 * 16),
    TemplateConfig(system_prompt="You detect objects.", user_prompt="List every shape in the picture, in JSON.",
                   min_pixels=28 * 28, max_pixels=28 * 28 * 4),
)
DRAFT_KINDS = ("none", "ground_truth", "plain_output", "corrupted_output", "garbage")


def _host(processor, drafts: bool = True) -> HostContext:
    contract = load_contract(EXAMPLE)
    rollout = dataclasses.replace(contract.rollout_matching, hf_generate=HfGenerateConfig(label_drafts=drafts))
    return HostContext.create(processor, rollout, contract.template)


def _load(model_dir: Path, records, end_id: int | None = None):
    """A tiny model with ragged requests (two templates) carrying their ground-truth drafts; with ``end_id``, the
    model is made to write EOS early: EOS's output row becomes a slightly larger copy of the row of a token that
    plain greedy writes mid-rollout, so EOS wins wherever that token would have been likely."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32)
    processor = load_processor(model_dir)
    scale = (processor.image_processor.patch_size / 14) ** 2  # the same token counts at Qwen3-VL's patch 16
    host = _host(processor)
    requests = []
    for k, record in enumerate(records):
        template = TEMPLATES[k % 2]
        template = template.model_copy(update={"min_pixels": int(template.min_pixels * scale),
                                               "max_pixels": int(template.max_pixels * scale)})
        requests.append(RolloutRequest(encode_prompt(processor, record, template), index=k, seed=k,
                                       draft_token_ids=label_draft_ids(record, host)))
    if end_id is not None:
        plain = _backend(model, processor.tokenizer, drafts=False, max_new=12).generate(requests[:1])
        with torch.no_grad():
            head = model.get_output_embeddings().weight
            head[end_id] = head[plain[0].response_token_ids[6]] * 1.05
    return SimpleNamespace(model=model, tokenizer=processor.tokenizer, requests=requests)


def _backend(model, tokenizer, *, drafts: bool | None, batch: int = 4, max_new: int = 16, decoding=None, guard=None,
             draft_tokens: int = 8, **hf_generate) -> HfRolloutBackend:
    return HfRolloutBackend(model, tokenizer, decode_batch_size=batch, max_new_tokens=max_new,
                            decoding=decoding or DecodingConfig(), repeat_terminate=guard or RepeatTerminateConfig(),
                            hf_generate=HfGenerateConfig(label_drafts=drafts, draft_tokens=draft_tokens,
                                                         **hf_generate))


@pytest.fixture(scope="module")
def records(synthetic_dataset):
    return load_records(synthetic_dataset.train_jsonl)[:6]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory, tiny_model_dir, qwen3_model_dir, records):
    """The models the property test draws from (loaded once): three families and an early-EOS variant."""
    from coordexp.runtime.toy.tiny_model import build_tiny_model

    qwen25 = build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2_5_vl_drafts"), family="qwen2_5_vl", seed=3)
    end_id = load_processor(tiny_model_dir).tokenizer.convert_tokens_to_ids(END)
    return {"qwen2_vl": _load(tiny_model_dir, records), "qwen2_5_vl": _load(qwen25, records),
            "qwen3_vl": _load(qwen3_model_dir, records), "qwen2_vl_early_eos": _load(tiny_model_dir, records, end_id)}


@st.composite
def decodings(draw) -> DecodingConfig:
    if draw(st.booleans()):
        return DecodingConfig(coord_group_greedy=draw(st.booleans()),
                              repetition_penalty=draw(st.sampled_from([1.0, 1.3])))
    return DecodingConfig(temperature=1.0, top_k=draw(st.sampled_from([-1, 3, 40])),
                          top_p=draw(st.sampled_from([1.0, 0.7])), repetition_penalty=draw(st.sampled_from([1.0, 1.3])))


def _draft(kind: str, request: RolloutRequest, plain_ids: tuple[int, ...], end_id: int, data) -> tuple | None:
    """One request's draft of ``kind``; a corrupted output gets random substitutions, insertions and deletions."""
    if kind == "none":
        return None
    if kind == "ground_truth":
        return request.draft_token_ids
    own = list(plain_ids) + [end_id]
    if kind == "plain_output":
        return tuple(own)
    if kind == "garbage":
        return tuple(data.draw(st.lists(st.integers(0, end_id), min_size=1, max_size=20), label="garbage"))
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        at = data.draw(st.integers(0, len(own)), label="at")
        token = data.draw(st.integers(0, end_id), label="token")
        edit = data.draw(st.sampled_from(["substitute", "insert", "delete"]), label="edit")
        if edit == "insert" or at == len(own):
            own.insert(at, token)
        elif edit == "substitute":
            own[at] = token
        else:
            del own[at]
    return tuple(own)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(data=st.data())
def test_drafted_decoding_returns_plain_decodings_tokens(zoo, data):
    name = data.draw(st.sampled_from(sorted(zoo)), label="model")
    case = zoo[name]
    end_id = case.tokenizer.convert_tokens_to_ids(END)
    picks = data.draw(st.lists(st.integers(0, len(case.requests) - 1), min_size=1, max_size=4), label="requests")
    seeds = data.draw(st.lists(st.integers(0, 2**31 - 1), min_size=len(picks), max_size=len(picks)), label="seeds")
    greedy = data.draw(st.lists(st.booleans(), min_size=len(picks), max_size=len(picks)), label="greedy members")
    requests = [dataclasses.replace(case.requests[p], index=i, seed=s, greedy=g)  # a reward group's greedy member
                for i, (p, s, g) in enumerate(zip(picks, seeds, greedy))]
    knobs = dict(decoding=data.draw(decodings(), label="decoding"),
                 guard=GUARD if data.draw(st.booleans(), label="guard") else None,
                 max_new=data.draw(st.integers(1, 24), label="max_new_tokens"),
                 batch=data.draw(st.integers(1, 4), label="decode_batch_size"))
    plain = _backend(case.model, case.tokenizer, drafts=False, **knobs).generate(requests)
    kinds = data.draw(st.lists(st.sampled_from(DRAFT_KINDS), min_size=len(picks), max_size=len(picks)), label="kinds")
    drafted_requests = [dataclasses.replace(r, draft_token_ids=_draft(kind, r, out.response_token_ids, end_id, data))
                        for r, out, kind in zip(requests, plain, kinds)]
    k = data.draw(st.integers(1, 8), label="draft_tokens")
    drafted_backend = _backend(case.model, case.tokenizer, drafts=True, draft_tokens=k, **knobs)
    drafted = drafted_backend.generate(drafted_requests)

    assert [o.response_token_ids for o in drafted] == [o.response_token_ids for o in plain]
    assert [o.finish_reason for o in drafted] == [o.finish_reason for o in plain]
    assert [o.text for o in drafted] == [o.text for o in plain]
    followed = [len(o.response_token_ids) for o, kind in zip(plain, kinds) if kind == "plain_output"]
    if any(n >= 2 for n in followed) and knobs["max_new"] >= 3:  # a followed draft is accepted (room for one)
        assert drafted_backend.draft_figures.accepted_tokens >= 1


def test_a_followed_draft_takes_fewer_forwards_and_reports_its_figures(zoo):
    case = zoo["qwen2_vl"]
    plain = _backend(case.model, case.tokenizer, drafts=False, max_new=24).generate(case.requests[:4])
    end_id = case.tokenizer.convert_tokens_to_ids(END)
    requests = [dataclasses.replace(r, draft_token_ids=tuple(o.response_token_ids) + (end_id,))
                for r, o in zip(case.requests, plain)]
    backend = _backend(case.model, case.tokenizer, drafts=True, max_new=24, draft_tokens=8)
    outputs, metadata = backend.generate_with_metadata(requests[:4])
    assert [o.response_token_ids for o in outputs] == [o.response_token_ids for o in plain]
    assert {o.finish_reason for o in plain} == {"length"}  # the random model never stops: 24 tokens a row
    figures = metadata["label_drafts"]
    # the prefill's token, then per verify forward 8 draft tokens and the model's next (the last: 4 + 1): 1 + 3
    # forwards where plain decoding takes 24, every draft token accepted
    assert figures["generated_tokens"] == 4 * 24
    assert figures["forwards"] == 4 and figures["row_forwards"] == 4 * 4
    assert figures["accepted_tokens"] == figures["proposed_tokens"] == 4 * (8 + 8 + 4)
    assert figures["forwards_per_token"] == round(16 / 96, 4) and figures["draft_share"] == round(80 / 96, 4)


def test_a_broken_verify_is_caught(zoo, monkeypatch):
    """The comparison the property test makes fails when verification accepts one token it should not have."""
    case = zoo["qwen2_vl"]
    plain = _backend(case.model, case.tokenizer, drafts=False).generate(case.requests[:2])
    requests = [dataclasses.replace(r, draft_token_ids=tuple(o.response_token_ids[:3]) + (7, 8, 9, 10))
                for r, o in zip(case.requests, plain)]
    exact = _backend(case.model, case.tokenizer, drafts=True).generate(requests[:2])
    assert [o.response_token_ids for o in exact] == [o.response_token_ids for o in plain]
    honest_choose = label_drafts.TokenChooser.choose
    corrupted_rows: set[int] = set()

    def accept_one_more(self, rows, contexts, logits):
        """Writes the draft's token, not the model's, at the first position where they differ (once per row)."""
        chosen = honest_choose(self, rows, contexts, logits)
        for i, (row, context) in enumerate(zip(rows, contexts)):
            draft = requests[row].draft_token_ids
            written = len(context) - len(requests[row].prompt.input_ids)
            if row not in corrupted_rows and written < len(draft) and chosen[i] != draft[written]:
                corrupted_rows.add(row)
                chosen[i] = draft[written]
        return chosen

    monkeypatch.setattr(label_drafts.TokenChooser, "choose", accept_one_more)
    broken = _backend(case.model, case.tokenizer, drafts=True).generate(requests[:2])
    assert [o.response_token_ids for o in broken] != [o.response_token_ids for o in plain]


def test_static_cache_and_beam_search_decode_plainly(zoo, caplog):
    case = zoo["qwen2_vl"]
    requests = case.requests[:2]
    for knobs in (dict(static_cache=True, compile=False), dict(decoding=DecodingConfig(num_beams=2))):
        decoding = knobs.pop("decoding", None)
        plain = _backend(case.model, case.tokenizer, drafts=False, decoding=decoding, **knobs).generate(requests)
        backend = _backend(case.model, case.tokenizer, drafts=True, decoding=decoding, **knobs)
        with caplog.at_level("INFO", logger="coordexp.rollout.hf"):
            outputs, metadata = backend.generate_with_metadata(requests)
        assert [o.response_token_ids for o in outputs] == [o.response_token_ids for o in plain]
        assert metadata == {} and backend.draft_figures == DraftFigures()
    assert sum("label_drafts: decoding plainly" in r.message for r in caplog.records) == 2


def test_the_default_drafts_where_the_dynamic_cache_decodes_and_stays_quiet_elsewhere(zoo, caplog):
    case = zoo["qwen2_vl"]
    requests = case.requests[:3]
    plain = _backend(case.model, case.tokenizer, drafts=False).generate(requests)
    with caplog.at_level("INFO", logger="coordexp.rollout.hf"):
        dynamic, dynamic_metadata = _backend(case.model, case.tokenizer, drafts=None).generate_with_metadata(requests)
        static, static_metadata = _backend(case.model, case.tokenizer, drafts=None, static_cache=True,
                                           compile=False).generate_with_metadata(requests)
    assert [o.response_token_ids for o in dynamic] == [o.response_token_ids for o in static] == [
        o.response_token_ids for o in plain]
    assert dynamic_metadata["label_drafts"]["accepted_tokens"] >= 0 and static_metadata == {}
    assert not any("label_drafts" in r.message for r in caplog.records)


def test_an_unmerged_adapter_policy_decodes_the_same_with_drafts(tiny_model_dir, zoo):
    """``merge_adapter: false`` hands the PEFT model itself to the drafted loop (through its adapter layers)."""
    from transformers import AutoModelForImageTextToText

    from coordexp.runtime.model.tuner import apply_tuner
    from coordexp.schema.tuner import TunerConfig

    policy = apply_tuner(AutoModelForImageTextToText.from_pretrained(str(tiny_model_dir), dtype=torch.float32),
                         TunerConfig(train_type="lora", lora_rank=4, lora_alpha=8))
    with torch.no_grad():  # a fresh adapter is the identity: make it change the decode
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.add_(0.3 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1)))
    case = zoo["qwen2_vl"]
    plain = _backend(policy, case.tokenizer, drafts=False, merge_adapter=False).generate(case.requests[:3])
    drafted = _backend(policy, case.tokenizer, drafts=True, merge_adapter=False)
    outputs = drafted.generate(case.requests[:3])
    assert [o.response_token_ids for o in outputs] == [o.response_token_ids for o in plain]
    assert drafted.draft_figures.forwards > 0 and drafted.merged.twin is None


def test_label_draft_ids_are_the_stage1_target(tiny_processor, records):
    """The draft is what stage 1 teaches (the same serializer and tokenization, EOS included)."""
    host = _host(tiny_processor)
    record = records[0]
    prompt = encode_prompt(tiny_processor, record, host.template)
    assert label_draft_ids(record, host) == build_gt_sample(record, prompt, host).target.ids
    assert label_draft_ids(record, _host(tiny_processor, drafts=False)) is None


def test_cursor_follows_substitutions_and_jumps_by_ngrams():
    draft = [1, 2, 3, 4, 5, 6, 7, 8]
    cursor = DraftCursor(draft)
    cursor.advance(2, 99, [1, 2, 99])  # a substitution: 3 -> 99, then 4 is expected
    assert cursor.proposal(3) == [4, 5, 6]
    cursor.advance(0, 5, [1, 2, 99, 5])  # 4 was skipped: the 2-gram (99, 5) is not in the draft -> substitution
    assert cursor.proposal(2) == [5, 6]
    cursor.advance(0, 7, [1, 2, 99, 5, 6, 7])  # the suffix (6, 7) is found: 8 comes next
    assert cursor.proposal(4) == [8]
    lost = DraftCursor([1, 2])
    lost.advance(0, 9, [9])
    lost.advance(0, 9, [9, 9])
    assert lost.proposal(4) == []  # past the draft's end: the row decodes plainly
