"""generate_with_metadata: each call's metadata comes back with its own outputs, even while another thread rolls out
on the same backend (the trainer's background prefetch); run_metadata() still reports the latest call."""

from __future__ import annotations

import threading
from pathlib import Path

from coordexp.runtime.model.data import DetectionRecord
from coordexp.runtime.rollout.base import RolloutRequest
from coordexp.runtime.rollout.client import RolloutServerClient
from coordexp.runtime.rollout.vllm_server import VllmServerBackend
from coordexp.schema.rollout import DecodingConfig

from testkit import stub_server


def requests_for(n: int, first_seed: int) -> list[RolloutRequest]:
    record = DetectionRecord(image_paths=(Path("/data/img.png"),), width=8, height=8, objects=(), source="t:1")
    return [RolloutRequest(prompt=None, index=i, seed=first_seed + i, record=record) for i in range(n)]


def test_each_call_gets_its_own_metadata_while_another_thread_rolls_out():
    with stub_server(world_size=2) as a, stub_server(world_size=2) as b:
        clients = [RolloutServerClient(s.base_url, group_port=1, timeout_s=10) for s in (a, b)]
        backend = VllmServerBackend(clients, decode_batch_size=2, max_new_tokens=4, decoding=DecodingConfig(),
                                    topology=lambda: (0, 1))
        steps: list[int] = []
        errors: list[BaseException] = []
        start = threading.Barrier(2, timeout=30)

        def roll(first_seed: int, n: int) -> None:
            try:
                start.wait()
                for round_ in range(15):
                    seed = first_seed + 1000 * round_
                    outputs, metadata = backend.generate_with_metadata(requests_for(n, seed))
                    assert [o.response_token_ids[1] for o in outputs] == [seed + i for i in range(n)]
                    calls = metadata["calls"]
                    assert sorted((c["start"], c["stop"]) for c in calls)[0][0] == 0
                    assert sum(c["stop"] - c["start"] for c in calls) == n
                    assert {c["seed"] - seed for c in calls} == {c["start"] for c in calls}  # this call's seeds
                    steps.append(metadata["rollout_step"])
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=roll, args=(10_000, 5)), threading.Thread(target=roll, args=(90_000, 7))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not errors, errors[0]
        assert sorted(steps) == list(range(1, 31))  # every call numbered once
        latest = backend.run_metadata()
        assert latest["rollout_step"] == 30 and latest["calls"]
        outputs, metadata = backend.generate_with_metadata([])
        assert outputs == [] and metadata["calls"] == [] and metadata["rollout_step"] == 31
        backend.close()
