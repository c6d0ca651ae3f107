"""The rollout backend interface, its lazy registry, and the HF generate backend on the tiny Qwen2-VL model."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from coordexp.runtime.core.distribution import rollout_seed
from coordexp.runtime.rollout.registry import (
    BACKENDS,
    BackendEntry,
    BackendUnavailableError,
    RolloutBackend,
    RolloutRequest,
    create_backend,
    finish_output,
    get_backend_class,
)
from coordexp.runtime.rollout.hf import HfRolloutBackend, PaddingAwareRepetitionPenalty, RepeatGuardProcessor
from coordexp.runtime.model.data import load_records
from coordexp.runtime.model.encoding import encode_prompt
from coordexp.runtime.core.repeat import RepeatGuard
from coordexp.schema.contract import HfBackendContract, VllmColocateContract, VllmServerContract, load_contract
from coordexp.schema.rollout import DecodingConfig, HfGenerateConfig, RepeatTerminateConfig
from coordexp.schema.template import TemplateConfig

REPO = Path(__file__).resolve().parents[2]
MAX_NEW = 10
GUARD_OFF = RepeatTerminateConfig()
# different prompt texts and pixel budgets, so a batch needs left padding and mixes image sizes (4 and 16 tokens)
TEMPLATES = (
    TemplateConfig(system_prompt="Find shapes.", user_prompt="List them.", min_pixels=28 * 28 * 4,
                   max_pixels=28 * 28 * 16),
    TemplateConfig(system_prompt="Find shapes.", user_prompt="List every shape in the picture, in JSON.",
                   min_pixels=28 * 28, max_pixels=28 * 28 * 4),
    TemplateConfig(system_prompt="You detect objects.", user_prompt="Go now, please.", min_pixels=28 * 28,
                   max_pixels=28 * 28 * 4),
)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl"])
def model_dir(request, tiny_model_dir, qwen3_model_dir):
    """Every generation test runs on Qwen2-VL and on Qwen3-VL (DeepStack and interleaved M-RoPE in generate)."""
    return tiny_model_dir if request.param == "qwen2_vl" else qwen3_model_dir


@pytest.fixture(scope="module")
def model(model_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32)


@pytest.fixture(scope="module")
def processor(model_dir):
    from coordexp.runtime.model.encoding import load_processor

    return load_processor(model_dir)


@pytest.fixture(scope="module")
def tokenizer(processor):
    return processor.tokenizer


@pytest.fixture(scope="module")
def requests_(processor, synthetic_dataset):
    records = load_records(synthetic_dataset.train_jsonl)
    scale = (processor.image_processor.patch_size / 14) ** 2  # the same token counts at Qwen3-VL's patch 16
    templates = [t.model_copy(update={"min_pixels": int(t.min_pixels * scale), "max_pixels": int(t.max_pixels * scale)})
                 for t in TEMPLATES]
    prompts = [encode_prompt(processor, record, templates[k % len(templates)])
               for k, record in enumerate(records[:5])]
    assert len({p.prompt_len for p in prompts}) > 1  # the batch really is ragged
    return [RolloutRequest(prompt=p, index=k, seed=100 + k) for k, p in enumerate(prompts)]


def backend(model, tokenizer, *, batch=4, decoding=None, guard=GUARD_OFF, max_new=MAX_NEW, hf_generate=None):
    return HfRolloutBackend(model, tokenizer, decode_batch_size=batch, max_new_tokens=max_new,
                            decoding=decoding or DecodingConfig(), repeat_terminate=guard, hf_generate=hf_generate)


class Bias(torch.nn.Module):
    """A test logits processor: from generated step ``from_step`` on, add ``amount`` to ``token`` in ``rows``."""

    def __init__(self, rows, token, amount=100.0, from_step=0):
        super().__init__()
        self.rows, self.token, self.amount, self.from_step, self.width = list(rows), token, amount, from_step, None

    def __call__(self, input_ids, scores):
        self.width = input_ids.shape[1] if self.width is None else self.width
        if input_ids.shape[1] - self.width < self.from_step:
            return scores
        scores = scores.clone()
        scores[self.rows, self.token] += self.amount
        return scores


@pytest.fixture
def spy(model, monkeypatch):
    """Wraps ``model.generate``: records each call's batch size, mode and grad state; ``spy.inject`` adds a logits
    processor ahead of the backend's own (as the repetition-bias source of the repeat-guard tests)."""
    original = model.generate
    record = SimpleNamespace(batch_sizes=[], training=[], grad=[], inject=[], fail=False)

    def generate(**kwargs):
        record.batch_sizes.append(kwargs["input_ids"].shape[0])
        record.training.append(model.training)
        record.grad.append(torch.is_grad_enabled())
        if record.fail:
            raise RuntimeError("generation failed")
        kwargs["logits_processor"][0:0] = list(record.inject)
        return original(**kwargs)

    monkeypatch.setattr(model, "generate", generate)
    return record


def greedy_reference(model, tokenizer, request, max_new, **generate_kwargs):
    """Plain one-sample HF greedy decoding, trimmed at <|im_end|> (the independent reference)."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    suppress = sorted(set(model.generation_config.suppress_tokens)
                      | {tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>")})
    out = model.generate(**request.prompt.model_inputs(), max_new_tokens=max_new, do_sample=False, num_beams=1,
                         eos_token_id=end, suppress_tokens=suppress, **generate_kwargs)
    ids = out[0, request.prompt.prompt_len:].tolist()
    return ids[:ids.index(end)] if end in ids else ids


def test_batched_greedy_equals_per_sample_generation(model, tokenizer, requests_):
    batched = backend(model, tokenizer, batch=5).generate(requests_)
    single = backend(model, tokenizer, batch=1).generate(requests_)
    assert [o.response_token_ids for o in batched] == [o.response_token_ids for o in single]
    for request, output in zip(requests_, batched):
        assert list(output.response_token_ids) == greedy_reference(model, tokenizer, request, MAX_NEW)
        assert output.prompt_token_ids == tuple(request.prompt.input_ids.tolist())
        assert output.text == tokenizer.decode(list(output.response_token_ids), skip_special_tokens=False)
        assert output.finish_reason in ("stop", "length")
        assert (output.finish_reason == "length") == (len(output.response_token_ids) == MAX_NEW)


def test_repetition_penalty_matches_hf_and_ignores_left_padding(model, tokenizer, requests_):
    penalised = DecodingConfig(repetition_penalty=1.8)
    batched = backend(model, tokenizer, batch=5, decoding=penalised).generate(requests_)
    plain = backend(model, tokenizer, batch=5).generate(requests_)
    assert [o.response_token_ids for o in batched] != [o.response_token_ids for o in plain]  # it does act
    for request, output in zip(requests_, batched):
        assert list(output.response_token_ids) == greedy_reference(model, tokenizer, request, MAX_NEW,
                                                                    repetition_penalty=1.8)


def test_repetition_penalty_ignores_left_padding_row_by_row():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    ids = torch.tensor([[0, 0, 5, 6], [7, 5, 5, 6]])  # row 0 is left-padded with id 0 (twice)
    scores = torch.linspace(-3.0, 3.0, 20).reshape(2, 10)
    penalised = PaddingAwareRepetitionPenalty(2.0, torch.tensor([2, 0]))(ids, scores.clone())
    hf = RepetitionPenaltyLogitsProcessor(2.0)
    assert torch.equal(penalised[0:1], hf(ids[0:1, 2:], scores[0:1].clone()))  # id 0 is not penalised
    assert torch.equal(penalised[1:2], hf(ids[1:2], scores[1:2].clone()))
    beams = PaddingAwareRepetitionPenalty(2.0, torch.tensor([2, 0]), num_beams=2)
    assert torch.equal(beams(ids.repeat_interleave(2, 0), scores.repeat_interleave(2, 0)),
                       penalised.repeat_interleave(2, 0))


def test_requests_are_chunked_by_decode_batch_size_in_order(model, tokenizer, requests_, spy):
    rollouts = backend(model, tokenizer, batch=2)
    outputs = rollouts.generate(requests_)
    assert spy.batch_sizes == [2, 2, 1] and rollouts.decode_calls == 3
    assert [o.prompt_token_ids for o in outputs] == [tuple(r.prompt.input_ids.tolist()) for r in requests_]
    assert backend(model, tokenizer, batch=8).generate([]) == []


def test_eval_and_no_grad_during_generation_and_training_mode_restored(model, tokenizer, requests_, spy):
    model.train()
    try:
        backend(model, tokenizer, batch=5).generate(requests_[:2])
        assert spy.training == [False] and spy.grad == [False]
        assert model.training and all(m.training for m in model.modules())
        spy.fail = True
        with pytest.raises(RuntimeError, match="generation failed"):
            backend(model, tokenizer).generate(requests_[:2])
        assert model.training and all(m.training for m in model.modules())
    finally:
        spy.fail = False
        model.eval()
    backend(model, tokenizer).generate(requests_[:1])
    assert not model.training  # an eval-mode model stays in eval mode


def test_beam_search_returns_only_the_best_beam(model, tokenizer, requests_):
    beams = 3
    outputs = backend(model, tokenizer, batch=2, decoding=DecodingConfig(num_beams=beams)).generate(requests_[:2])
    assert len(outputs) == 2
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    suppress = sorted(set(model.generation_config.suppress_tokens)
                      | {tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>")})
    for request, output in zip(requests_[:2], outputs):
        every = model.generate(**request.prompt.model_inputs(), max_new_tokens=MAX_NEW, num_beams=beams,
                               num_return_sequences=beams, do_sample=False, eos_token_id=end,
                               suppress_tokens=suppress, return_dict_in_generate=True, output_scores=True)
        best = int(every.sequences_scores.argmax())
        ids = every.sequences[best, request.prompt.prompt_len:].tolist()
        ids = ids[:ids.index(end)] if end in ids else [i for i in ids if i != tokenizer.pad_token_id]
        assert list(output.response_token_ids) == ids


def test_sampling_is_seeded_per_request_and_leaves_the_global_rng_alone(model, tokenizer, requests_):
    sampling = DecodingConfig(temperature=1.5, top_k=200, top_p=0.95)
    before = torch.get_rng_state()
    first = backend(model, tokenizer, batch=5, decoding=sampling).generate(requests_)
    assert torch.equal(torch.get_rng_state(), before)
    again = backend(model, tokenizer, batch=2, decoding=sampling).generate(requests_)
    assert [o.response_token_ids for o in first] == [o.response_token_ids for o in again]  # batching-independent
    reseeded = [RolloutRequest(prompt=r.prompt, index=r.index, seed=r.seed + 7) for r in requests_]
    other = backend(model, tokenizer, batch=5, decoding=sampling).generate(reseeded)
    assert [o.response_token_ids for o in other] != [o.response_token_ids for o in first]
    greedy = backend(model, tokenizer, batch=5).generate(requests_)
    assert [o.response_token_ids for o in greedy] != [o.response_token_ids for o in first]


def test_repeat_guard_stops_only_the_offending_sequence(model, tokenizer, requests_, spy):
    coord = tokenizer.convert_tokens_to_ids("<|coord_7|>")
    guard = RepeatTerminateConfig(enabled=True, min_new_tokens=0, max_consecutive_token_repeats=3, ngram_size=4,
                                  ngram_repeats=2)
    free = backend(model, tokenizer, batch=3, max_new=12).generate(requests_[:3])
    assert all(o.finish_reason != "repeat" for o in free)  # the unbiased rows never trip this guard by themselves
    spy.inject = [Bias(rows=[1], token=coord, from_step=2)]
    guarded = backend(model, tokenizer, batch=3, guard=guard, max_new=12).generate(requests_[:3])
    first_two = list(free[1].response_token_ids[:2])
    assert list(guarded[1].response_token_ids) == first_two + [coord] * 3 and guarded[1].finish_reason == "repeat"
    assert [guarded[0], guarded[2]] == [free[0], free[2]]  # the other rows are untouched
    unguarded = backend(model, tokenizer, batch=3, max_new=12).generate(requests_[:3])
    assert unguarded[1].response_token_ids == tuple(first_two + [coord] * 10)
    assert unguarded[1].finish_reason == "length"


def test_stop_token_trims_one_row_and_suppressed_ids_are_never_emitted(model, tokenizer, requests_, spy):
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    free = backend(model, tokenizer, batch=3).generate(requests_[:3])
    spy.inject = [Bias(rows=[0], token=end, from_step=3), Bias(rows=[1, 2], token=image_pad),
                  Bias(rows=[1, 2], token=len(tokenizer) + 3)]  # a padded embedding row: no token at all
    outputs = backend(model, tokenizer, batch=3).generate(requests_[:3])
    assert outputs[0].response_token_ids == free[0].response_token_ids[:3] and outputs[0].finish_reason == "stop"
    assert end not in outputs[0].response_token_ids
    for output in outputs:
        assert image_pad not in output.response_token_ids
        assert all(0 <= i < len(tokenizer) for i in output.response_token_ids)


def test_guard_processor_forces_eos_on_tripped_rows_in_tracker_and_beam_modes():
    guard = RepeatGuard(enabled=True, max_consecutive_token_repeats=2)
    ids = torch.tensor([[0, 0, 5, 6], [0, 9, 5, 5], [0, 0, 6, 6]])  # prompt width 2; rows 1 and 2 end in a run
    for reorder in (False, True):
        processor = RepeatGuardProcessor(guard, prompt_width=2, eos_token_id=3, pieces=None, rows_reorder=reorder)
        processor(ids[:, :3], torch.zeros(3, 8))
        scores = processor(ids, torch.zeros(3, 8))
        assert torch.equal(scores[0], torch.zeros(8))
        for row in (1, 2):
            assert scores[row, 3] == 0 and torch.isinf(scores[row]).sum() == 7
    assert torch.equal(processor(ids[:, :3], torch.zeros(3, 8)), torch.zeros(3, 8))


def test_guard_processor_counts_object_keys_split_across_tokens(tokenizer):
    from coordexp.runtime.core.pieces import PieceTable

    pieces = PieceTable.for_tokenizer(tokenizer).pieces
    one = tokenizer('{"object_1": {"desc": "cat"}', add_special_tokens=False)["input_ids"]
    two = tokenizer(', "object_2": {"desc', add_special_tokens=False)["input_ids"]
    assert b'"object_' not in b"".join(pieces[i] for i in one if b"object" in pieces[i])  # split over ids
    guard = RepeatGuard(enabled=True, max_object_keys=1)
    ids = torch.tensor([[9] + one + two])
    for reorder in (False, True):
        processor = RepeatGuardProcessor(guard, prompt_width=1, eos_token_id=3, pieces=pieces, rows_reorder=reorder)
        for end in range(2, ids.shape[1] + 1):
            scores = processor(ids[:, :end], torch.zeros(1, 8))
            second_opened = end - 1 >= len(one) + len(tokenizer(', "object_', add_special_tokens=False)["input_ids"])
            assert bool(torch.isinf(scores).any()) == second_opened


def test_finish_output_trims_at_the_first_stop_and_names_the_reason():
    decode = lambda ids: ",".join(map(str, ids))  # noqa: E731
    stop = finish_output([1, 2], [7, 8, 99, 0, 0], stop_ids=frozenset({99}), decode=decode)
    assert (stop.prompt_token_ids, stop.response_token_ids, stop.text, stop.finish_reason) == (
        (1, 2), (7, 8), "7,8", "stop")
    assert finish_output([1], [7, 8], stop_ids=frozenset({99}), decode=decode).finish_reason == "length"
    guard = RepeatGuard(enabled=True, max_consecutive_token_repeats=2)
    repeat = finish_output([1], [8, 8, 99], stop_ids=frozenset({99}), decode=decode, guard=guard)
    assert repeat.finish_reason == "repeat" and repeat.response_token_ids == (8, 8)
    # a repeat run that ends by length was not cut by the guard
    assert finish_output([1], [8, 8], stop_ids=frozenset({99}), decode=decode, guard=guard).finish_reason == "length"


def test_rollout_seed_is_deterministic_positive_and_distinct():
    seeds = {rollout_seed(42, step, index) for step in range(4) for index in range(64)}
    assert len(seeds) == 256 and all(1 <= s < 2 ** 31 for s in seeds)
    assert rollout_seed(42, 3, 5) == rollout_seed(42, 3, 5) == 42 + 3 * 1_000_003 + 5
    assert rollout_seed(0, 0, 0) == 2**31 - 1 and rollout_seed(0, 0, 1) == 1  # 0 is never a seed, no collision


def test_registry_builds_hf_from_the_run_contract(model, tokenizer):
    run = load_contract(REPO / "examples" / "stage2_cpu_hf.yaml")
    rollout = run.rollout_matching
    assert get_backend_class(rollout.backend) is get_backend_class(HfBackendContract) is HfRolloutBackend
    with create_backend(run, model, SimpleNamespace(tokenizer=tokenizer)) as built:
        assert (built.decode_batch_size, built.max_new_tokens) == (rollout.decode_batch_size, rollout.max_new_tokens)
        assert built.guard == RepeatGuard.from_config(rollout.repeat_terminate) and built.guard.active
    with pytest.raises(RuntimeError, match="closed"):
        built.generate([])


def test_every_backend_contract_has_a_backend_class_keyed_by_its_type():
    assert set(BACKENDS) == {HfBackendContract, VllmColocateContract, VllmServerContract}
    for choice, entry in BACKENDS.items():
        assert entry.class_name.lower().startswith(choice.kind.replace("_", ""))


def test_interface_hooks_are_declared_no_ops():
    """The trainer calls every hook on every backend: a backend that needs none of them implements generate only."""

    class Minimal(RolloutBackend):
        @classmethod
        def from_run(cls, run, model, processor):
            return cls()

        def generate(self, requests):
            return []

    backend = Minimal()
    assert backend.begin_step(3) is None and backend.attach_optimizer(object()) is None
    assert backend.sync_weights(object()) is None and backend.close() is None
    with pytest.raises(TypeError, match="abstract"):
        type("NoGenerate", (RolloutBackend,), {"from_run": classmethod(lambda cls, *a: cls())})()


@pytest.mark.parametrize("choice", [VllmColocateContract, VllmServerContract])
def test_backend_whose_module_is_missing_fails_with_guidance(choice, monkeypatch):
    """A registered backend whose module is absent from this install (e.g. a trimmed build) names the fallback."""
    entry = BACKENDS[choice]
    monkeypatch.setitem(BACKENDS, choice, dataclasses.replace(entry, module="coordexp.runtime.rollout.registry._absent"))
    with pytest.raises(BackendUnavailableError, match="not available yet") as info:
        get_backend_class(choice)
    assert "rollout_matching.rollout_backend: hf" in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_missing_dependency_and_unknown_choices_fail_with_guidance(tmp_path, monkeypatch):
    @dataclasses.dataclass(frozen=True)
    class FakeContract:
        kind = "fake"

    @dataclasses.dataclass(frozen=True)
    class HollowContract:
        kind = "hollow"

    @dataclasses.dataclass(frozen=True)
    class TpuContract:
        kind = "tpu"

    (tmp_path / "fake_backend_module.py").write_text("import vllm_not_installed_anywhere\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(BACKENDS, FakeContract, BackendEntry("fake_backend_module", "Backend", "vllm"))
    with pytest.raises(BackendUnavailableError, match=r"needs the Python package 'vllm_not_installed_anywhere'.*"
                                                       r"pip install vllm.*rollout_backend: hf"):
        get_backend_class(FakeContract())
    (tmp_path / "hollow_backend_module.py").write_text("Backend = object\n", encoding="utf-8")
    monkeypatch.setitem(BACKENDS, HollowContract, BackendEntry("hollow_backend_module", "Backend"))
    with pytest.raises(BackendUnavailableError, match="defines no RolloutBackend class") as info:
        get_backend_class(HollowContract)
    assert info.value.hint == "reinstall coordexp" and info.value.exit_code == 3
    with pytest.raises(BackendUnavailableError, match="unknown rollout backend 'tpu'; known backends: .*hf") as info:
        get_backend_class(TpuContract())
    assert "rollout_backend: hf" in info.value.hint


def test_beam_sampling_is_rejected_when_the_backend_is_built(model, tokenizer):
    with pytest.raises(ValueError, match="beam sampling"):
        backend(model, tokenizer, decoding=DecodingConfig(num_beams=2, temperature=0.7))


def test_registry_import_is_light():
    code = ("import sys, coordexp.runtime.rollout.registry as b; b.get_backend_class; "
            "assert not {'torch', 'transformers'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# -- rollout_matching.hf_generate (issue 14 item 3): static KV cache and compiled decode step ----------------------
STATIC = HfGenerateConfig(static_cache=True)
LONG_NEW = 24  # enough decode steps past the first row's stop for the padding and cache positions to matter


class CacheKinds:
    """Forward pre-hook recording the class of the KV cache every forward call receives."""

    def __init__(self, model):
        self.kinds: list[str] = []
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        cache = kwargs.get("past_key_values")
        self.kinds.append(type(cache).__name__ if cache is not None else "none")

    def close(self):
        self.handle.remove()


@pytest.mark.parametrize("decoding", [DecodingConfig(), DecodingConfig(num_beams=3),
                                      DecodingConfig(temperature=1.2, top_k=300, repetition_penalty=1.3)],
                         ids=["greedy", "beam", "seeded-sampling"])
def test_static_cache_outputs_equal_the_dynamic_cache_token_for_token(model, tokenizer, requests_, decoding):
    batch = 2 if decoding.num_beams > 1 else 5  # a ragged, left-padded batch of mixed image sizes
    kinds = CacheKinds(model)
    try:
        dynamic = backend(model, tokenizer, batch=batch, decoding=decoding, max_new=LONG_NEW).generate(requests_)
        dynamic_kinds, kinds.kinds = kinds.kinds, []
        static = backend(model, tokenizer, batch=batch, decoding=decoding, max_new=LONG_NEW,
                         hf_generate=STATIC).generate(requests_)
    finally:
        kinds.close()
    assert "StaticCache" not in dynamic_kinds and "StaticCache" in kinds.kinds  # the switch really changed the cache
    assert [o.response_token_ids for o in static] == [o.response_token_ids for o in dynamic]
    assert [o.finish_reason for o in static] == [o.finish_reason for o in dynamic]
    if decoding.temperature == 0 and decoding.num_beams == 1:
        assert len({len(o.response_token_ids) for o in dynamic}) > 1 or dynamic[0].finish_reason == "length"


@pytest.mark.slow
def test_compiled_decode_step_outputs_equal_the_eager_dynamic_cache(model, tokenizer, requests_):
    """torch.compile on CPU (inductor): the first call compiles (tens of seconds), later calls reuse the graph."""
    import torch._dynamo

    torch._dynamo.reset()
    eager = backend(model, tokenizer, batch=5, max_new=LONG_NEW).generate(requests_)
    compiled_backend = backend(model, tokenizer, batch=5, max_new=LONG_NEW,
                               hf_generate=HfGenerateConfig(static_cache=True, compile=True))
    try:
        assert not hasattr(model, "_compiled_call")
        first = compiled_backend.generate(requests_)
        assert hasattr(model, "_compiled_call")  # transformers compiled the decode-step forward
        again = compiled_backend.generate(requests_[1:4])  # another batch width reuses (or re-traces) it
    finally:
        for name in ("_compiled_call", "_last_compile_config"):
            model.__dict__.pop(name, None)
        torch._dynamo.reset()
    assert [o.response_token_ids for o in first] == [o.response_token_ids for o in eager]
    assert [o.response_token_ids for o in again] == [o.response_token_ids for o in eager[1:4]]


def test_hf_generate_compile_without_static_cache_is_refused_naming_the_fix(tmp_path):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="hf_generate.compile: true needs hf_generate.static_cache: true"):
        HfGenerateConfig(compile=True, static_cache=False)
    with pytest.raises(ValidationError):
        HfGenerateConfig(static_cache=True, cuda_graphs=True)  # strict: unknown keys are refused
    # unset: decided by the device (tests/rollout/test_hf_decode_speed.py); compile alone implies the static cache
    assert HfGenerateConfig(compile=True).resolved(on_cuda=False, beam_search=False) == (True, True)
    assert HfGenerateConfig().resolved(on_cuda=False, beam_search=False) == (False, False)  # off on CPU


def test_hf_generate_reaches_the_backend_from_the_config(model, tokenizer, tmp_path):
    import yaml

    from coordexp.runtime.rollout.registry import create_backend

    config = {"extends": str(REPO / "examples" / "stage2_cpu_hf.yaml"),
              "rollout_matching": {"hf_generate": {"static_cache": True}}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    run = load_contract(path)
    assert run.rollout_matching.hf_generate == STATIC
    built = create_backend(run, model, SimpleNamespace(tokenizer=tokenizer))
    assert isinstance(built, HfRolloutBackend) and built.hf_generate == STATIC
    # `serve-rollout --engine hf` generates through the same backend with the same setting
    from coordexp.runtime.server.engine import GenerationParams, HfEngine

    was_training = model.training
    try:
        engine = HfEngine.from_contract(run, model=model, processor=SimpleNamespace(tokenizer=tokenizer))
        served = engine._backend(GenerationParams(max_new_tokens=4, decoding=DecodingConfig()))
    finally:
        model.train(was_training)
        model.requires_grad_(True)
    assert served.hf_generate == STATIC


def test_a_request_flagged_greedy_decodes_greedily_among_sampled_ones(model, tokenizer, requests_):
    """The reward objective's greedy group member (``reward.include_greedy``): in a sampling run, the flagged rows
    equal a greedy run's and the others are the sampled rows they would be without the flag."""
    sampling = DecodingConfig(temperature=1.0)
    flagged = [dataclasses.replace(r, greedy=k % 2 == 1) for k, r in enumerate(requests_)]
    mixed = backend(model, tokenizer, batch=5, decoding=sampling).generate(flagged)
    sampled = backend(model, tokenizer, batch=5, decoding=sampling).generate(requests_)
    greedy = backend(model, tokenizer, batch=5).generate(requests_)
    for k, out in enumerate(mixed):
        expected = greedy[k] if k % 2 == 1 else sampled[k]
        assert out.response_token_ids == expected.response_token_ids, k
    assert any(s.response_token_ids != g.response_token_ids for s, g in zip(sampled, greedy))
