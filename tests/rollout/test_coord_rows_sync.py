"""Weight sync of an adapter policy whose coord rows train (PEFT trainable tokens): vLLM's LoRA cannot serve the
rows, so adapter sync falls back to full merged weights once (one warning), and vLLM then rolls out exactly what
HF generates with the policy; the rows reach the engine inside the embedding and head matrices."""

from __future__ import annotations

import pytest
import torch

from coordexp.runtime.core.tokens import CoordVocab
from coordexp.runtime.model.tuner import apply_tuner
from coordexp.schema.tuner import TunerConfig

pytest.importorskip("peft", reason="needs peft (pip install peft)")


def _coord_row_policy(model_dir, processor, seed: int):
    """A float32 tiny LoRA policy with trained-looking coord rows (a fresh adapter would be a no-op)."""
    from .conftest import load_hf_model

    policy = apply_tuner(load_hf_model(model_dir), TunerConfig(train_type="lora", lora_rank=4, lora_alpha=8),
                         CoordVocab.from_tokenizer(processor.tokenizer).ids)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if ".lora_" in name:
                parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
            elif ".trainable_tokens_delta." in name:
                parameter.mul_(4.0).add_(0.5 * torch.randn(parameter.shape, generator=generator))
    return policy


@pytest.mark.vllm
def test_adapter_sync_of_trained_coord_rows_falls_back_to_full_once(write_run_config, restore_engine, model_dir,
                                                                   processor, rollout_requests, caplog):
    from coordexp.runtime.rollout.hf import HfRolloutBackend
    from coordexp.runtime.rollout.vllm_colocate import VllmColocateBackend
    from coordexp.schema.contract import load_contract

    from .conftest import GUARD, MAX_NEW

    run = load_contract(write_run_config({"rollout_matching": {"vllm": {
        "enable_lora": True, "sync": {"mode": "adapter", "fallback_to_full": True}}}}, name="coord_rows.yaml"))
    policy = _coord_row_policy(model_dir, processor, seed=11)
    policy.eval()
    hf = HfRolloutBackend(policy, processor.tokenizer, decode_batch_size=4, max_new_tokens=MAX_NEW,
                          decoding=run.rollout_matching.decoding, repeat_terminate=GUARD)
    expected = [o.response_token_ids for o in hf.generate(rollout_requests)]
    backend = VllmColocateBackend.from_run(run, policy, processor, engine=restore_engine)
    with caplog.at_level("WARNING"):
        got = [o.response_token_ids for o in backend.generate(rollout_requests)]
        with torch.no_grad():
            for name, parameter in policy.named_parameters():
                if ".trainable_tokens_delta." in name:
                    parameter.mul_(-1.0)  # a second update: pushed in full again, no second warning
        again = [o.response_token_ids for o in backend.generate(rollout_requests)]
    assert got == expected
    assert again == [o.response_token_ids for o in hf.generate(rollout_requests)]
    assert backend.sync_mode == "full" and restore_engine.adapter is None
    assert sum("switching to full" in r.getMessage() for r in caplog.records) == 1
    backend.close()
