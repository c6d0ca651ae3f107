"""Issue 36: after every optimizer step, the model that rolls out (the HF merged decode copy, the vLLM colocate push,
the rollout-server push) and the model that evaluates are the model being trained, whatever the optimizer and tuner.

Each case trains the tiny Qwen2-VL with the optimizer HF builds for ``training.optim`` and after each step calls the
trainer's own :class:`WeightStepRecorder` (HF calls it right after the step, DeepSpeed's included). The expected
weights come from an independent PEFT merge of a deep copy (no coordexp cache or version involved). The fused AdamW
step leaves ``tensor._version`` as it was (torch CPU), which is what hid the update before the recorder existed;
ZeRO-2 (``.data`` writes) is the same case, run for real in tests/e2e/test_weights_follow_the_trainer.py.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml

from coordexp.runtime.core.tokens import CoordVocab
from coordexp.runtime.model.tuner import apply_tuner
from coordexp.runtime.model.weight_version import note_optimizer_step, optimizer_steps, policy_version
from coordexp.runtime.rollout.base import RolloutOutput
from coordexp.runtime.rollout.merged_decode import MergedDecodeModel
from coordexp.runtime.rollout.weight_export import is_peft, named_tensors
from coordexp.runtime.train.trainer import WeightStepRecorder
from coordexp.schema.tuner import TunerConfig

pytest.importorskip("peft", reason="needs peft (pip install peft)")

REPO = Path(__file__).resolve().parents[2]
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd")
TUNERS = {
    "full": dict(train_type="full", freeze_vit=True),
    "lora": dict(train_type="lora", lora_rank=4, lora_alpha=8, train_coord_rows=False),
    "dora": dict(train_type="lora", use_dora=True, lora_rank=4, lora_alpha=8, train_coord_rows=False),
    "lora_bias_coord_rows": dict(train_type="lora", lora_rank=4, lora_alpha=8, lora_bias="all",
                                 train_coord_rows=True),
}
IDS = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11]])


def _policy(model_dir, tuner: dict):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32)
    coord_ids = CoordVocab.from_tokenizer(AutoTokenizer.from_pretrained(str(model_dir))).ids
    return apply_tuner(model, TunerConfig(**tuner), coord_ids)


def _hf_optimizer(policy, optim: str, tmp_path):
    """The optimizer HF's Trainer builds for ``training.optim`` (fused, foreach or plain as HF chooses)."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), optim=optim, learning_rate=0.05, use_cpu=True,
                             report_to="none")
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, policy)
    return cls([p for p in policy.parameters() if p.requires_grad], **kwargs)


def _uncached_copy(policy):
    """A deep copy of the policy that runs PEFT's own DoRA forward (coordexp's norm caches removed)."""
    twin = copy.deepcopy(policy)
    for module in twin.modules():
        for name in ("get_weight_norm", "get_lora_weight", "_coordexp_norm_cache"):
            module.__dict__.pop(name, None)
    return twin


def _reference_weights(policy) -> dict[str, torch.Tensor]:
    """The trained policy's weights by PEFT's own merge of an uncached deep copy."""
    twin = _uncached_copy(policy)
    if is_peft(twin):
        twin = twin.merge_and_unload()
    return {name: p.detach().clone() for name, p in twin.named_parameters()}


def _assert_same_weights(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    shared = set(got) & set(expected)
    assert len(shared) >= len(expected) - 1, f"{what}: names differ"  # tied lm_head may appear once
    for name in sorted(shared):
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} {name}: {m}")


class RecordingEngine:
    """Stands in for the vLLM engine (the engine itself is tested in test_vllm_engine.py): keeps what it was pushed."""

    def __init__(self):
        self.weights: dict[str, torch.Tensor] = {}
        self.pushes = 0

    def generate(self, requests, decoding, max_new_tokens):
        return [RolloutOutput([1], [2], "", False, False) for _ in requests]

    def sleep(self):
        return False

    def wake_up(self):
        return False

    def clear_adapter(self):
        pass

    def load_weights(self, named):
        self.pushes += 1
        self.weights.update({name: t.detach().clone() for name, t in named})


def _colocate_backend(tmp_path, policy, engine):
    from coordexp.runtime.rollout.vllm_colocate import VllmColocateBackend
    from coordexp.runtime.rollout.vllm_engine import EngineSettings
    from coordexp.schema.contract import load_contract

    config = tmp_path / "colocate.yaml"
    config.write_text(yaml.safe_dump({"extends": str(REPO / "examples" / "stage2_colocate_4gpu.yaml"),
                                      "rollout_matching": {"offload": {"enabled": False}}}), encoding="utf-8")
    run = load_contract(config)
    settings = EngineSettings.from_contract(run.rollout_matching.serving.engine, model_path="/m", dtype="float32",
                                            seed=0, repeat_terminate=run.rollout_matching.repeat_terminate)
    backend = VllmColocateBackend(run.rollout_matching, model=policy, tokenizer=None, settings=settings,
                                  engine=engine)
    backend.sync_mode = "full"  # merged weights for every tuner (adapter mode is refused for DoRA and coord rows)
    return backend


@pytest.mark.parametrize("optim", OPTIMIZERS)
@pytest.mark.parametrize("tuner", list(TUNERS))
def test_rollouts_pushes_and_evaluation_read_the_weights_of_every_step(tiny_model_dir, tmp_path, optim, tuner):
    from coordexp.runtime.rollout.client import RolloutServerClient
    from coordexp.runtime.rollout.vllm_server import VllmServerBackend
    from coordexp.schema.rollout import DecodingConfig

    from testkit import stub_server

    policy = _policy(tiny_model_dir, TUNERS[tuner])
    trainable = sorted(n for n, p in policy.named_parameters() if p.requires_grad)
    optimizer = _hf_optimizer(policy, optim, tmp_path)
    recorder = WeightStepRecorder()
    merged = MergedDecodeModel()
    engine = RecordingEngine()
    colocate = _colocate_backend(tmp_path, policy, engine)
    server_pushes: list[dict[str, torch.Tensor]] = []

    def server_push(client, model, mode):
        server_pushes.append({name: t.detach().clone() for name, t in named_tensors(model)})

    with stub_server() as stub:
        server = VllmServerBackend([RolloutServerClient(stub.base_url, group_port=1, timeout_s=10)],
                                   decode_batch_size=1, max_new_tokens=4, decoding=DecodingConfig(),
                                   topology=lambda: (0, 1), weight_pusher=server_push)
        try:
            for step in range(1, 3):
                policy.train()
                before = policy_version(policy)
                loss = policy(input_ids=IDS).logits.float().pow(2).mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                recorder.on_optimizer_step(None, None, None, model=policy)
                assert optimizer_steps(policy) == step and policy_version(policy) != before

                expected = _reference_weights(policy)
                decode = merged.model_for(policy)  # what HF rollouts and the in-training evaluation decode
                _assert_same_weights(dict(decode.named_parameters()), expected, f"{optim}/{tuner} decode copy")
                assert sorted(n for n, p in policy.named_parameters() if p.requires_grad) == trainable
                policy.eval()
                with torch.no_grad():  # the policy's own forward (DoRA norm cache) is the trained model too
                    reference = _uncached_copy(policy)
                    torch.testing.assert_close(policy(input_ids=IDS).logits, reference(input_ids=IDS).logits,
                                               rtol=1e-5, atol=1e-5)
                    torch.testing.assert_close(decode(input_ids=IDS).logits, reference(input_ids=IDS).logits,
                                               rtol=1e-4, atol=1e-4)

                colocate.generate([0])  # vLLM colocate pushes before generating
                assert engine.pushes == step
                _assert_same_weights(engine.weights, expected, f"{optim}/{tuner} colocate push")
                server.sync_weights(policy)
                assert len(server_pushes) == step
                _assert_same_weights(server_pushes[-1], expected, f"{optim}/{tuner} server push")
            colocate.generate([0])
            server.sync_weights(policy)
            assert (engine.pushes, len(server_pushes)) == (2, 2)  # no step since: nothing pushed again
        finally:
            server.close()
            colocate.close()


def test_a_fused_adamw_step_is_invisible_to_version_counters_without_the_recorder():
    """The torch behaviour that made every consumer stale (kept so a torch change that fixes it is noticed)."""
    layer = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1, fused=True)
    before = policy_version(layer)
    layer(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    assert policy_version(layer) == before
    note_optimizer_step(layer)
    assert policy_version(layer) != before and optimizer_steps(layer) == 1


def test_the_decode_copy_leaves_the_policys_flags_and_storage_alone(tiny_model_dir):
    """``lora_bias: all``: the first sync point used to turn off requires_grad on the policy's biases."""
    policy = _policy(tiny_model_dir, TUNERS["lora_bias_coord_rows"])
    before = {n: (p.requires_grad, p.data_ptr()) for n, p in policy.named_parameters()}
    assert any(n.endswith(".bias") and flag for n, (flag, _) in before.items())
    MergedDecodeModel().model_for(policy)
    assert {n: (p.requires_grad, p.data_ptr()) for n, p in policy.named_parameters()} == before


def test_the_dora_cache_holds_norms_only(tiny_model_dir):
    """The cache keeps one norm vector per layer; PEFT's dense ``B @ A`` (the norm's input) is neither kept nor
    built while the norm is cached."""
    from coordexp.runtime.model.adapter_speed import cache_dora_weight_norms

    policy = _policy(tiny_model_dir, TUNERS["dora"])
    caches = cache_dora_weight_norms(policy)
    policy.eval()
    with torch.no_grad():
        policy(input_ids=IDS)
        computed = [c.computed for c in caches]
        policy(input_ids=IDS)
    assert [c.computed for c in caches] == computed and all(c == 1 for c in computed)
    for cache in caches:
        held = [v for v in vars(cache).values() if isinstance(v, torch.Tensor)]
        held += [t for v in vars(cache).values() if isinstance(v, tuple) for t in v if isinstance(t, torch.Tensor)]
        assert all(t.ndim <= 1 for t in held), [tuple(t.shape) for t in held]
