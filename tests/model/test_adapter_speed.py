"""An adapter run's training cost: DoRA's weight norm is computed once per optimizer step (bit-identical losses and
gradients), DoRA's dropout defaults to 0 and an explicit one is warned about, and the adapter dtype is a choice."""

from __future__ import annotations

import logging

import pytest
import torch

from coordexp.runtime.model.adapter_speed import cache_dora_weight_norms
from coordexp.runtime.model.tuner import apply_tuner
from coordexp.schema.tuner import TunerConfig

pytest.importorskip("peft", reason="needs peft (pip install peft)")

DORA = dict(train_type="lora", use_dora=True, lora_rank=4, lora_alpha=8)


def _model(model_dir, dtype=torch.float32):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=dtype)


def _uncached_(policy) -> None:
    """Back to PEFT's own per-forward computation (the class methods)."""
    for module in policy.modules():
        for name in ("get_weight_norm", "get_lora_weight", "_coordexp_norm_cache"):
            module.__dict__.pop(name, None)


def _randomise_(policy, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if ".lora_B" in name:
                parameter.add_(0.2 * torch.randn(parameter.shape, generator=generator))


def _micro_step_loss(policy, ids):
    out = policy(input_ids=ids, attention_mask=torch.ones_like(ids))
    return out.logits.float().log_softmax(-1)[:, :-1].gather(2, ids[:, 1:, None]).mean()


def _train(policy, batches, steps=2):
    """``steps`` SGD steps of ``len(batches)`` accumulated micro-steps; every loss, then the final weights."""
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.5)
    losses = []
    for _ in range(steps):
        for ids in batches:
            loss = _micro_step_loss(policy, ids)
            loss.backward()
            losses.append(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
    return losses, {n: p.detach().clone() for n, p in policy.named_parameters()}


def test_doras_norm_is_computed_once_per_optimizer_step_with_bit_identical_training(tiny_model_dir):
    torch.manual_seed(0)  # the same initial adapters (lora_A is drawn at random)
    cached = apply_tuner(_model(tiny_model_dir), TunerConfig(**DORA))
    torch.manual_seed(0)
    reference = apply_tuner(_model(tiny_model_dir), TunerConfig(**DORA))
    _uncached_(reference)
    for policy in (cached, reference):
        _randomise_(policy, seed=4)
    caches = cache_dora_weight_norms(cached)  # idempotent: apply_tuner installed them already
    assert caches and all(c.computed == 0 for c in caches)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 300, (2, 17), generator=generator) for _ in range(3)]
    cached.train()
    reference.train()

    losses, weights = _train(cached, batches)
    expected_losses, expected_weights = _train(reference, batches)

    assert all(c.computed == 2 for c in caches)  # 2 optimizer steps x 3 micro-steps: once per step
    assert [l.item() for l in losses] == [l.item() for l in expected_losses]
    for name, value in expected_weights.items():  # same bits after the updates
        assert torch.equal(weights[name].view(torch.int32), value.view(torch.int32)), name
    assert not torch.equal(losses[0], losses[3])  # the steps really changed the adapter (and so the norms)


def test_dora_defaults_to_no_dropout_and_an_explicit_dropout_is_warned_about(tiny_model_dir, caplog):
    assert TunerConfig(**DORA).lora_dropout == 0.0
    assert TunerConfig(train_type="lora").lora_dropout == 0.05  # plain LoRA keeps ms-swift's default
    assert TunerConfig(**DORA, lora_dropout=0.1).lora_dropout == 0.1  # an explicit value is kept
    with caplog.at_level(logging.WARNING, logger="coordexp.tuner"):
        apply_tuner(_model(tiny_model_dir), TunerConfig(**DORA))
        assert not [r for r in caplog.records if "lora_dropout" in r.getMessage()]
        apply_tuner(_model(tiny_model_dir), TunerConfig(**DORA, lora_dropout=0.1))
    warned = [r.getMessage() for r in caplog.records if "lora_dropout" in r.getMessage()]
    assert len(warned) == 1 and "twice" in warned[0] and "lora_dropout: 0" in warned[0]


@pytest.mark.parametrize("choice, expected", [("float32", torch.float32), ("model", torch.bfloat16)])
def test_the_adapter_dtype_is_float32_unless_the_models_own_is_asked_for(tiny_model_dir, choice, expected):
    policy = apply_tuner(_model(tiny_model_dir, torch.bfloat16), TunerConfig(**DORA, adapter_dtype=choice))
    adapter = {p.dtype for n, p in policy.named_parameters() if ".lora_" in n}
    assert adapter == {expected}
    base = {p.dtype for n, p in policy.named_parameters() if n.endswith("q_proj.base_layer.weight")}
    assert base == {torch.bfloat16}


def test_a_gradient_checkpointed_dora_step_recomputes_consistently_with_the_cache(tiny_model_dir):
    """The first forward fills the cache and the checkpointed recomputation finds it: both must save the same
    tensors for backward (a CheckpointError before the cached values were computed without autograd)."""
    grads = []
    for cached in (True, False):
        torch.manual_seed(0)
        policy = apply_tuner(_model(tiny_model_dir), TunerConfig(**DORA))
        if not cached:
            _uncached_(policy)
        _randomise_(policy, seed=2)
        policy.gradient_checkpointing_enable()
        policy.enable_input_require_grads()
        policy.train()
        _micro_step_loss(policy, torch.arange(3, 20)[None]).backward()
        grads.append({n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, grad in grads[1].items():
        assert torch.equal(grads[0][name], grad), name
