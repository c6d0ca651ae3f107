"""Actor-learner overlap against a REAL `coordexp serve-rollout --engine hf` process on 127.0.0.1 (issue 14):
the next micro-step's rollouts are requested before the current optimizer step finishes, every sample is at most
``staleness`` optimizer steps behind, and the weights reach the server after every optimizer step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from transformers import TrainerCallback

pytest.importorskip("coordexp.runtime.server.app", reason="coordexp serve-rollout is not part of this build yet")

from coordexp.runtime.rollout.client import RolloutServerClient, ServerUnreachableError  # noqa: E402
from coordexp.runtime.train.launch import build_trainer  # noqa: E402
from coordexp.schema.contract import load_contract  # noqa: E402
from testkit import free_port, server_rollout  # noqa: E402

pytestmark = pytest.mark.slow
STEPS, ACCUMULATION = 3, 2
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "num_beams": 1, "repetition_penalty": 1.0}


@pytest.fixture()
def server(tmp_path, write_config):
    """A server over a dataset of one epoch's records (tmp_path/data): the lookahead does not cross epochs."""
    from coordexp.runtime.toy.synthetic import write_synthetic_dataset

    data = write_synthetic_dataset(tmp_path / "data", n_train=2 * ACCUMULATION * STEPS, n_val=0, seed=4)
    cfg = write_config({"rollout_matching": {"decoding": SAMPLING, "max_new_tokens": 12},
                        "data": {"train_jsonl": str(data.train_jsonl)}}, name="server.yaml")
    port, log = free_port(), tmp_path / "server.log"
    proc = subprocess.Popen([sys.executable, "-m", "coordexp", "serve-rollout", str(cfg), "--engine", "hf", "--port",
                             str(port), "--log-level", "warning"],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            RolloutServerClient(f"http://127.0.0.1:{port}", timeout_s=90).wait_until_healthy()
        except ServerUnreachableError:
            raise AssertionError(f"server did not start:\n{log.read_text(errors='replace')[-3000:]}") from None
        yield f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


class OptimizerSteps(TrainerCallback):
    """perf_counter() right after each optimizer step, in order."""

    def __init__(self):
        self.times: list[float] = []

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter())


def overlap_run(tmp_path, write_config, base_url, enabled: bool):
    rollout = server_rollout([(base_url, free_port())], decoding=SAMPLING, max_new_tokens=12, decode_batch_size=2,
                             overlap={"enabled": enabled})
    data = tmp_path / "data" / "train.jsonl"
    cfg = write_config({"rollout_matching": rollout, "data": {"train_jsonl": str(data)}, "training": {
        "output_dir": str(tmp_path / f"run_{enabled}"), "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": ACCUMULATION, "max_steps": STEPS, "logging_steps": 1, "save_steps": 1000,
        "packing": True, "packing_buffer": 64, "learning_rate": 1e-3, "warmup_ratio": 0.0}}, name=f"learner_{enabled}.yaml")
    return load_contract(cfg)


def test_overlap_requests_ahead_stays_within_staleness_and_pushes_every_step(tmp_path, write_config, server):
    run = overlap_run(tmp_path, write_config, server, enabled=True)
    steps = OptimizerSteps()
    trainer = build_trainer(run, callbacks=[steps])
    backend = trainer.backend
    pushes: list[tuple[int, float]] = []
    push = backend._push_if_changed

    def recording_push(model):
        before = backend._pushed_version
        push(model)
        if backend._pushed_version != before:
            pushes.append((trainer.state.global_step, time.perf_counter()))

    backend._push_if_changed = recording_push
    try:
        trainer.train()
    finally:
        backend.close()
    assert trainer.state.global_step == STEPS and len(steps.times) == STEPS
    events = trainer.prefetcher.events
    requests = {key: at for kind, key, _, at in events if kind == "request"}
    # step t+1's first micro-step was requested while step t trained, before its optimizer step finished
    for t in range(STEPS - 1):
        assert requests[(t + 1, 0)] < steps.times[t], f"step {t + 1} was not requested during step {t}"
    # every micro-step of every step after the first was prefetched (its rollouts taken, not generated on demand);
    # step 0's micro-steps are rolled out on demand, together
    taken = [key for kind, key, _, _ in events if kind == "take"]
    assert taken == [(t, m) for t in range(1, STEPS) for m in range(ACCUMULATION)]
    # weights reached the server once per optimizer step: version 0 before the first rollout, then after each
    # step that still has rollouts to make, each push after that step's optimizer step and before the next request
    assert [step for step, _ in pushes] == list(range(STEPS))
    for t in range(1, STEPS):
        push_time = pushes[t][1]
        assert steps.times[t - 1] < push_time < requests.get((t + 1, 0), float("inf"))
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == STEPS
    assert all(log["rollout/staleness_max"] <= run.rollout_matching.overlap.staleness for log in logs)
    assert any(log["rollout/staleness_max"] == 1 for log in logs)  # the overlap really used the older policy
    assert logs[0]["rollout/staleness_max"] == 0  # step 0's first rollouts are made on demand with version 0
