"""The vllm_server backend against REAL `coordexp serve-rollout --engine hf` processes on 127.0.0.1.

Skipped while the server module is not part of this build. Every wait is bounded (health within timeout_s,
process waits with timeouts); servers are terminated at teardown.
"""

from __future__ import annotations

import logging
import time

import pytest

pytest.importorskip("coordexp.runtime.server.app", reason="coordexp serve-rollout is not part of this build yet")

from coordexp.runtime.rollout.base import RolloutRequest  # noqa: E402
from coordexp.runtime.rollout.hf import HfRolloutBackend  # noqa: E402
from coordexp.runtime.rollout.vllm_server import RolloutServerError, VllmServerBackend  # noqa: E402
from coordexp.runtime.model.data import load_records  # noqa: E402
from coordexp.runtime.model.encoding import encode_prompt, load_processor  # noqa: E402
from coordexp.schema.contract import load_contract  # noqa: E402

from testkit import ServeRolloutProcess, free_port, server_rollout  # noqa: E402

pytestmark = pytest.mark.slow
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "num_beams": 1, "repetition_penalty": 1.0}


@pytest.fixture()
def servers(tmp_path, write_config):
    """Start k servers (each on its own port) from one base config; all killed at teardown."""
    started: list[ServeRolloutProcess] = []

    def start(k: int) -> list[ServeRolloutProcess]:
        cfg = write_config({"rollout_matching": {"decoding": SAMPLING, "max_new_tokens": 12}}, name="server.yaml")
        procs = [ServeRolloutProcess(cfg, tmp_path / f"server{i}.log") for i in range(k)]
        started.extend(procs)
        for p in procs:
            p.wait_healthy(timeout=90.0)
        return procs

    yield start
    for p in started:
        p.kill()


def learner_setup(write_config, procs, **extra):
    group_ports = [free_port() for _ in procs]
    extra = {"decoding": SAMPLING, "max_new_tokens": 12, **extra}
    cfg = write_config({"rollout_matching": server_rollout([(p.base_url, g) for p, g in zip(procs, group_ports)],
                                                           **extra)},
                       name="learner.yaml")
    run = load_contract(cfg)
    processor = load_processor(run.model.path)
    records = load_records(run.data.train_jsonl, run.data.image_root)
    return run, processor, records


def make_requests(run, processor, records, seed0=1000):
    return [RolloutRequest(encode_prompt(processor, r, run.template), i, seed0 + i, r) for i, r in enumerate(records)]


def backend_for(run, processor):
    return VllmServerBackend.from_run(run, None, processor)


def test_one_and_two_servers_same_outputs_in_request_order_and_none_for_n0(servers, write_config):
    procs = servers(2)
    run, processor, records = learner_setup(write_config, procs[:1])
    requests = make_requests(run, processor, records[:5])
    with backend_for(run, processor) as one:
        single = one.generate(requests)
        assert one.generate(requests) == single  # deterministic (seeded sampling)
    for request, output in zip(requests, single):
        assert list(output.prompt_token_ids) == list(request.prompt.input_ids.reshape(-1).tolist())  # alignment
    run2, _, _ = learner_setup(write_config, procs)
    with backend_for(run2, processor) as two:
        assert two.world_sizes == [1, 1] and two.chunk == 4  # decode_batch_size 2 * S 2 / W 1
        assert two.generate(requests) == single  # split over 2 servers, reassembled in order, same seeds
        assert two.generate([]) == []
    assert len({o.response_token_ids for o in single}) > 1  # really different samples per request


def test_weight_sync_makes_server_outputs_match_the_learner(servers, write_config):
    import torch
    from transformers import AutoModelForImageTextToText

    procs = servers(1)
    run, processor, records = learner_setup(write_config, procs, decoding={**SAMPLING, "temperature": 0.0})
    model = AutoModelForImageTextToText.from_pretrained(run.model.path, torch_dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05, alpha=1.0)
    local = HfRolloutBackend(model, processor.tokenizer, decode_batch_size=2, max_new_tokens=12,
                             decoding=run.rollout_matching.decoding, repeat_terminate=run.rollout_matching.repeat_terminate)
    requests = make_requests(run, processor, records[:4])
    expected = local.generate(requests)
    with backend_for(run, processor) as remote:
        before = remote.generate(requests)
        remote.sync_weights(model)
        after = remote.generate(requests)
    assert [o.response_token_ids for o in after] == [o.response_token_ids for o in expected]
    assert [o.response_token_ids for o in before] != [o.response_token_ids for o in expected]


def test_lora_policy_full_sync_through_a_server_never_touches_the_training_model(servers, write_config):
    """Regression: the server path used to merge_adapter()/unmerge_adapter() the live model (in place, not bit-exact).
    The weights now leave through weight_export: the server serves the merged policy, the learner keeps its
    parameters bit for bit and its adapter unmerged."""
    import torch
    from transformers import AutoModelForImageTextToText

    peft = pytest.importorskip("peft", reason="needs peft (pip install peft)")
    from peft.tuners.lora import LoraLayer

    procs = servers(1)
    run, processor, records = learner_setup(write_config, procs, decoding={**SAMPLING, "temperature": 0.0})
    base = AutoModelForImageTextToText.from_pretrained(run.model.path, torch_dtype=torch.float32)
    policy = peft.get_peft_model(base, peft.LoraConfig(
        r=4, lora_alpha=16, lora_dropout=0.0, target_modules=r".*language_model.*\.(q|k|v|o|gate|up|down)_proj"))
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    requests = make_requests(run, processor, records[:4])
    local = HfRolloutBackend(policy, processor.tokenizer, decode_batch_size=2, max_new_tokens=12,
                             decoding=run.rollout_matching.decoding, repeat_terminate=run.rollout_matching.repeat_terminate)
    expected = local.generate(requests)
    with backend_for(run, processor) as remote:
        remote.sync_weights(policy)
        after = remote.generate(requests)
    now = dict(policy.named_parameters())
    assert all(torch.equal(now[n].detach(), value) for n, value in before.items())
    assert not any(m.merged for m in policy.modules() if isinstance(m, LoraLayer))
    assert [o.response_token_ids for o in after] == [o.response_token_ids for o in expected]


def test_adapter_sync_on_a_server_without_lora_falls_back_to_full_once(servers, write_config, caplog):
    import torch
    from transformers import AutoModelForImageTextToText

    procs = servers(1)
    run, processor, _ = learner_setup(write_config, procs, vllm={"enable_lora": True,
                                                                  "sync": {"mode": "adapter", "fallback_to_full": True}})
    assert run.rollout_matching.backend.sync.mode == "adapter"
    model = AutoModelForImageTextToText.from_pretrained(run.model.path, torch_dtype=torch.float32)
    with backend_for(run, processor) as backend, caplog.at_level(logging.WARNING, "coordexp.rollout.server"):
        backend.sync_weights(model)
        with torch.no_grad():
            next(model.parameters()).add_(0.01)
        backend.sync_weights(model)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "falling back to full" in warnings[0].getMessage()
    assert backend.sync_mode == "full"


def test_server_killed_mid_run_is_a_clear_error(servers, write_config):
    procs = servers(1)
    run, processor, records = learner_setup(write_config, procs)
    requests = make_requests(run, processor, records[:2])
    with backend_for(run, processor) as backend:
        backend.generate(requests)
        procs[0].kill()
        start = time.monotonic()
        with pytest.raises(RolloutServerError, match=rf"rollout step 2: server {procs[0].base_url}"):
            backend.generate(requests)
        assert time.monotonic() - start < 10
