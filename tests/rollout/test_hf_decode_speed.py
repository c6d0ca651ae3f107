"""HF rollouts at full speed: adapter policies decode through merged weights (no LoRA/DoRA layer runs, the policy
stays bit-identical, one merge per weight change), the static cache is sized in buckets, the compiled decode pads
chunks to row buckets and gives the dynamic cache's tokens, and the device decides the defaults."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from coordexp.runtime.model.data import load_records
from coordexp.runtime.model.encoding import encode_prompt, load_processor
from coordexp.runtime.model.tuner import apply_tuner
from coordexp.runtime.rollout.base import RolloutRequest
from coordexp.runtime.rollout.hf import CACHE_LENGTH_BUCKET, HfRolloutBackend, row_bucket
from coordexp.runtime.rollout.weight_export import policy_version
from coordexp.schema.rollout import DecodingConfig, HfGenerateConfig, RepeatTerminateConfig
from coordexp.schema.template import TemplateConfig
from coordexp.schema.tuner import TunerConfig

pytest.importorskip("peft", reason="needs peft (pip install peft)")

MAX_NEW = 12
GREEDY = DecodingConfig()
SAMPLING = DecodingConfig(temperature=1.3, top_k=200, top_p=0.95)
TEMPLATES = (TemplateConfig(system_prompt="Find shapes.", user_prompt="List them."),
             TemplateConfig(system_prompt="Find shapes.", user_prompt="List every shape in the picture, as JSON."))


@pytest.fixture(scope="module")
def processor(qwen3_model_dir):
    return load_processor(qwen3_model_dir)


@pytest.fixture(scope="module")
def requests_(processor, synthetic_dataset):
    records = load_records(synthetic_dataset.train_jsonl)[:6]
    prompts = [encode_prompt(processor, r, TEMPLATES[k % 2]) for k, r in enumerate(records)]
    assert len({p.prompt_len for p in prompts}) > 1  # ragged: left padding is exercised
    return [RolloutRequest(prompt=p, index=k, seed=40 + k) for k, p in enumerate(prompts)]


def _plain(model_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32)


def _randomise_adapters_(policy, seed: int) -> None:
    """A fresh lora_B is zero (any merge would look right): give every adapter tensor real values."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_magnitude_vector" in name:
                parameter.mul_(0.5 + torch.rand(parameter.shape, generator=generator))
            elif ".lora_" in name:
                parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))


def _adapter_policy(model_dir, *, use_dora: bool, seed: int = 3):
    policy = apply_tuner(_plain(model_dir), TunerConfig(train_type="lora", use_dora=use_dora, lora_rank=4,
                                                        lora_alpha=8))
    _randomise_adapters_(policy, seed)
    return policy


def _backend(model, processor, *, batch=4, decoding=GREEDY, hf_generate=None, max_new=MAX_NEW):
    return HfRolloutBackend(model, processor.tokenizer, decode_batch_size=batch, max_new_tokens=max_new,
                            decoding=decoding, repeat_terminate=RepeatTerminateConfig(), hf_generate=hf_generate)


class LoraCalls:
    """Counts forward calls of every LoRA/DoRA layer of ``policy`` (hooks; removed by :meth:`close`)."""

    def __init__(self, policy):
        from peft.tuners.lora import LoraLayer

        self.count = 0
        self.layers = [m for m in policy.modules() if isinstance(m, LoraLayer)]
        assert self.layers
        self.handles = [m.register_forward_hook(self._hit) for m in self.layers]

    def _hit(self, *_):
        self.count += 1

    def close(self):
        for handle in self.handles:
            handle.remove()


def _bits(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _tokens(outputs):
    return [o.response_token_ids for o in outputs]


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_adapter_rollouts_run_no_adapter_layer_keep_the_policy_bit_identical_and_equal_the_merged_model(
        qwen3_model_dir, processor, requests_, use_dora):
    policy = _adapter_policy(qwen3_model_dir, use_dora=use_dora)
    policy.train()
    before, version = _bits(policy), policy_version(policy)
    reference = copy.deepcopy(policy).merge_and_unload()
    expected = _tokens(_backend(reference, processor).generate(requests_))
    backend = _backend(policy, processor)
    calls = LoraCalls(policy)
    try:
        got = _tokens(backend.generate(requests_))
        again = _tokens(backend.generate(requests_[:3]))
    finally:
        calls.close()
    assert calls.count == 0  # every token went through the merged twin, none through a LoRA/DoRA layer
    assert got == expected and again == expected[:3]
    assert any(got)
    assert backend.merged.merges == 1  # the weights did not change between the two calls: merged once
    after = dict(policy.named_parameters())
    for name, value in before.items():  # bit for bit, and no in-place write at all
        assert torch.equal(after[name].detach().view(torch.int32), value.view(torch.int32)), name
    assert policy_version(policy) == version and policy.training
    # the adapter is in the merged weights: the base checkpoint decodes otherwise
    assert _tokens(_backend(_plain(qwen3_model_dir), processor).generate(requests_)) != expected


def test_an_update_is_merged_once_at_the_next_sync_point_into_the_same_tensors(qwen3_model_dir, processor,
                                                                               requests_):
    policy = _adapter_policy(qwen3_model_dir, use_dora=True)
    backend = _backend(policy, processor)
    backend.sync_weights(policy)
    assert backend.merged.merges == 1
    twin = backend.merged.twin
    owned = {n: p.data_ptr() for n, p in twin.named_parameters()
             if all(p.data_ptr() != q.data_ptr() for q in policy.parameters())}
    assert owned and any(".q_proj." in n for n in owned)  # the adapted weights are the twin's own merged copies
    backend.generate(requests_[:2])
    assert backend.merged.merges == 1

    _randomise_adapters_(policy, seed=11)  # an optimizer step: in-place updates of the adapter tensors
    backend.sync_weights(policy)
    backend.sync_weights(policy)  # a second sync at the same weights merges nothing
    assert backend.merged.merges == 2
    assert {n: p.data_ptr() for n, p in twin.named_parameters() if n in owned} == owned  # refreshed in place
    expected = _tokens(_backend(copy.deepcopy(policy).merge_and_unload(), processor).generate(requests_))
    assert _tokens(backend.generate(requests_)) == expected


def test_trained_coord_rows_are_in_the_merged_decode(qwen3_model_dir, processor, requests_):
    """Coord rows trained as PEFT trainable tokens (tuner.train_coord_rows) are written into the twin's embedding
    and head: the decode equals merge_and_unload's, the trainable-token wrappers never run, the policy is intact."""
    from coordexp.runtime.core.tokens import CoordVocab

    coord_ids = CoordVocab.from_tokenizer(processor.tokenizer).ids
    policy = apply_tuner(_plain(qwen3_model_dir), TunerConfig(train_type="lora", use_dora=True, lora_rank=4,
                                                              lora_alpha=8), coord_ids)
    _randomise_adapters_(policy, seed=5)
    with torch.no_grad():  # move the coord rows (a fresh delta is zero), strongly enough to change the decode
        for name, parameter in policy.named_parameters():
            if ".trainable_tokens_delta." in name:
                parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(2)))
    wrappers = [m for m in policy.modules() if hasattr(m, "token_adapter")]
    assert wrappers
    before = _bits(policy)
    calls = [0]
    handles = [m.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for m in wrappers]
    lora = LoraCalls(policy)
    try:
        got = _tokens(_backend(policy, processor).generate(requests_))
    finally:
        lora.close()
        for handle in handles:
            handle.remove()
    assert calls[0] == 0 and lora.count == 0
    assert got == _tokens(_backend(copy.deepcopy(policy).merge_and_unload(), processor).generate(requests_))
    for name, value in before.items():
        assert torch.equal(dict(policy.named_parameters())[name].detach(), value), name
    rows_off = copy.deepcopy(policy)
    with torch.no_grad():
        for name, parameter in rows_off.named_parameters():
            if ".trainable_tokens_delta." in name:
                parameter.zero_()
    assert got != _tokens(_backend(rows_off.merge_and_unload(), processor).generate(requests_))  # the rows matter


def test_merge_adapter_false_decodes_through_the_adapter_layers(qwen3_model_dir, processor, requests_):
    policy = _adapter_policy(qwen3_model_dir, use_dora=False)
    backend = _backend(policy, processor, hf_generate=HfGenerateConfig(merge_adapter=False))
    calls = LoraCalls(policy)
    try:
        backend.generate(requests_[:2])
    finally:
        calls.close()
    assert calls.count > 0 and backend.merged.twin is None


def test_a_plain_policy_is_decoded_as_it_is(qwen3_model_dir, processor):
    model = _plain(qwen3_model_dir)
    backend = _backend(model, processor)
    assert backend.decode_model() is model and backend.merged.twin is None


def test_defaults_follow_the_device_and_explicit_values_win():
    auto = HfGenerateConfig()
    assert auto.resolved(on_cuda=True, beam_search=False) == (True, True)
    assert auto.resolved(on_cuda=False, beam_search=False) == (False, False)  # CPU: today's measured default
    assert auto.resolved(on_cuda=True, beam_search=True) == (False, False)
    assert HfGenerateConfig(compile=False).resolved(on_cuda=True, beam_search=False) == (True, False)
    assert HfGenerateConfig(static_cache=False).resolved(on_cuda=True, beam_search=False) == (False, False)
    assert HfGenerateConfig(static_cache=True).resolved(on_cuda=False, beam_search=False) == (True, False)


@given(rows=st.integers(1, 300), cap=st.integers(1, 300))
def test_row_buckets_cover_the_chunk_are_few_and_never_exceed_the_batch(rows, cap):
    rows = min(rows, cap)  # a chunk never holds more than decode_batch_size requests
    bucket = row_bucket(rows, cap)
    assert rows <= bucket <= cap
    assert bucket == cap or bucket & (bucket - 1) == 0  # a power of two, or the batch itself
    assert bucket < 2 * rows  # never more than double the work


class CacheLengths:
    """Forward pre-hook recording the length of every static KV cache the model is given."""

    def __init__(self, model):
        self.lengths: list[int] = []
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        cache = kwargs.get("past_key_values")
        if type(cache).__name__ == "StaticCache":
            self.lengths.append(int(cache.max_cache_len))

    def close(self):
        self.handle.remove()


def test_static_cache_lengths_are_whole_buckets_and_tokens_equal_the_dynamic_cache(qwen3_model_dir, processor,
                                                                                    requests_):
    model = _plain(qwen3_model_dir)
    dynamic = _tokens(_backend(model, processor, batch=2).generate(requests_))
    lengths = CacheLengths(model)
    try:
        static = _tokens(_backend(model, processor, batch=2,
                                  hf_generate=HfGenerateConfig(static_cache=True)).generate(requests_))
    finally:
        lengths.close()
    assert static == dynamic
    widest = max(r.prompt.prompt_len for r in requests_) + MAX_NEW
    assert lengths.lengths and all(n % CACHE_LENGTH_BUCKET == 0 and n >= widest for n in lengths.lengths)
    assert len(set(lengths.lengths)) == 1  # chunks of different widths share one cache size: no recompile


@pytest.mark.slow  # torch.compile on CPU: about a minute on 2 cores
def test_compiled_static_cache_decode_gives_the_dynamic_caches_tokens_greedy_and_seeded_sampling(
        qwen3_model_dir, processor, requests_):
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = _plain(qwen3_model_dir)
    compiled = HfGenerateConfig(static_cache=True, compile=True)
    torch._dynamo.reset()
    counters.clear()
    try:
        for decoding in (GREEDY, SAMPLING):
            dynamic = _tokens(_backend(model, processor, batch=4, decoding=decoding).generate(requests_))
            backend = _backend(model, processor, batch=4, decoding=decoding, hf_generate=compiled)
            got = _tokens(backend.generate(requests_))  # chunks of 4 and 2: the 2 is padded to the 2-row bucket
            assert got == dynamic, decoding
            assert len(got) == len(requests_)
            assert {rows for rows, _ in backend.compiled_shapes} == {4, 2}  # 6 requests: a 4-row and a 2-row chunk
        graphs = counters["stats"]["unique_graphs"]
        again = _backend(model, processor, batch=4, decoding=SAMPLING, hf_generate=compiled)
        assert _tokens(again.generate(requests_[1:4] + requests_[:1])) == _tokens(
            _backend(model, processor, batch=4, decoding=SAMPLING).generate(requests_[1:4] + requests_[:1]))
        assert counters["stats"]["unique_graphs"] == graphs  # a 4-row chunk again: no new compilation
    finally:
        for name in ("_compiled_call", "_last_compile_config", "_previous_max_cache_length"):
            model.__dict__.pop(name, None)
        torch._dynamo.reset()


def test_eval_of_a_saved_adapter_decodes_merged_weights_merged_once(write_config, tiny_model_dir, tmp_path,
                                                                    monkeypatch):
    """``coordexp eval --checkpoint ADAPTER`` never trains: its rollouts decode a plain merged model, merged once
    for every chunk."""
    from coordexp.runtime.rollout.weight_export import is_peft
    from coordexp.runtime.train.evaluate import run_evaluation
    from coordexp.schema.contract import load_contract

    adapter_dir = tmp_path / "adapter"
    _adapter_policy(tiny_model_dir, use_dora=True).save_pretrained(str(adapter_dir))
    run = load_contract(write_config({"tuner": {"train_type": "lora", "use_dora": True, "lora_rank": 4,
                                                "lora_alpha": 8},
                                      "rollout_matching": {"decode_batch_size": 1, "max_new_tokens": 6}}))
    seen = []
    real = HfRolloutBackend._generate_chunk

    def watched(self, chunk):
        model = self.decode_model()
        from peft.tuners.lora import LoraLayer

        adapted = is_peft(model) or any(isinstance(m, LoraLayer) for m in model.modules())
        seen.append((adapted, self.merged.merges))
        return real(self, chunk)

    monkeypatch.setattr(HfRolloutBackend, "_generate_chunk", watched)
    run_evaluation(run, split="train", limit=3, out_dir=tmp_path / "eval", png_count=0, adapter=adapter_dir)
    assert seen == [(False, 1)] * 3  # three chunks, one merge, never the adapter layers
