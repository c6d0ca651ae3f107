"""Rank-aware server load (issue 12 item 1): every learner rank sends its requests to the server slots it owns, so
no server ever holds more than ``decode_batch_size x`` its world size, whatever the ranks do at the same time."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from coordexp.runtime.core.distribution import per_rank_chunk
from coordexp.runtime.model.data import DetectionRecord
from coordexp.runtime.rollout.base import RolloutRequest
from coordexp.runtime.rollout.client import RolloutServerClient
from coordexp.runtime.rollout.vllm_server import VllmServerBackend
from coordexp.schema.rollout import DecodingConfig

from testkit import echo_output, stub_server

RECORD = DetectionRecord(image_paths=(Path("/data/img.png"),), width=8, height=8, objects=(), source="t:1")


def tagged_requests(n: int, rank: int) -> list[RolloutRequest]:
    """Requests whose index encodes (rank, position), seeds consecutive per rank."""
    return [RolloutRequest(prompt=None, index=100 * rank + i, seed=1000 * (rank + 1) + i, record=RECORD)
            for i in range(n)]


def tag_of(request: dict) -> dict:
    return {**request, "data_dict": {"tag": request["data_dict"]["coordexp_index"]}}


class ConcurrencyMeter:
    """An ``/infer/`` behaviour that holds each call for ``delay_s`` and records the most requests in flight."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s
        self.lock = threading.Lock()
        self.in_flight = 0
        self.peak = 0
        self.served = 0

    def __call__(self, handler, body):
        count = len(body["infer_requests"])
        with self.lock:
            self.in_flight += count
            self.peak = max(self.peak, self.in_flight)
        time.sleep(self.delay_s)
        with self.lock:
            self.in_flight -= count
            self.served += count
        seed = body["request_config"]["seed"]
        return 200, [echo_output(tag_of(r), seed + j) for j, r in enumerate(body["infer_requests"])]


def test_two_ranks_two_servers_never_exceed_one_request_per_server():
    # the reproducer: servers [1, 1], decode_batch_size 1, two learner ranks (two threads with distinct ranks)
    with stub_server(world_size=1) as a, stub_server(world_size=1) as b:
        meters = [ConcurrencyMeter(0.15), ConcurrencyMeter(0.15)]
        a.behaviour["/infer/"], b.behaviour["/infer/"] = meters
        backends = [
            VllmServerBackend([RolloutServerClient(s.base_url, group_port=1, timeout_s=5) for s in (a, b)],
                              decode_batch_size=1, max_new_tokens=8, decoding=DecodingConfig(),
                              topology=lambda rank=rank: (rank, 2))
            for rank in range(2)
        ]
        assert [be.allotment for be in backends] == [[1, 0], [0, 1]]
        start = threading.Barrier(2)
        results: dict[int, list] = {}

        def learner(rank: int) -> None:
            start.wait(timeout=10)
            results[rank] = backends[rank].generate(tagged_requests(3, rank))

        threads = [threading.Thread(target=learner, args=(rank,)) for rank in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        for backend in backends:
            backend.close()
    assert [meter.peak for meter in meters] == [1, 1]  # each server busy, never over its cap of 1
    assert [meter.served for meter in meters] == [3, 3]
    for rank in range(2):  # order restored, each request with its own seed
        assert [o.response_token_ids[0] for o in results[rank]] == [100 * rank + i for i in range(3)]
        assert [o.response_token_ids[1] for o in results[rank]] == [1000 * (rank + 1) + i for i in range(3)]
    metadata = backends[1].run_metadata()
    assert [s["rank_slots"] for s in metadata["servers"]] == [0, 1]
    assert {c["server"] for c in metadata["calls"]} == {b.base_url}


class RecordingClient:
    """A client double: answers ``/infer/`` at once and records the size of every call."""

    def __init__(self, name: str, world_size: int):
        self.base_url = f"http://{name}"
        self.group_port = 1
        self.timeout_s = 1.0
        self._world_size = world_size
        self.call_sizes: list[int] = []
        self.lock = threading.Lock()

    def wait_until_healthy(self) -> float:
        return 0.0

    def world_size(self) -> int:
        return self._world_size

    def infer(self, infer_requests, request_config):
        with self.lock:
            self.call_sizes.append(len(infer_requests))
        seed = request_config["seed"]
        return [echo_output(tag_of(r), seed + j) for j, r in enumerate(infer_requests)]


@settings(max_examples=60, deadline=None)
@given(dbs=st.integers(1, 4), sizes=st.lists(st.integers(1, 3), min_size=1, max_size=4), world=st.integers(1, 8),
       counts=st.lists(st.integers(0, 12), min_size=8, max_size=8))
def test_any_feasible_topology_keeps_every_server_within_its_cap(dbs, sizes, world, counts):
    assume(dbs * sum(sizes) >= world)
    per_rank_clients = []
    for rank in range(world):
        clients = [RecordingClient(f"s{i}", w) for i, w in enumerate(sizes)]
        backend = VllmServerBackend(clients, decode_batch_size=dbs, max_new_tokens=8, decoding=DecodingConfig(),
                                    topology=lambda rank=rank: (rank, world))
        assert backend.chunk == per_rank_chunk(dbs, sizes, world)
        n = counts[rank]
        outputs = backend.generate(tagged_requests(n, rank))
        backend.close()
        assert [o.response_token_ids[0] for o in outputs] == [100 * rank + i for i in range(n)]  # order restored
        per_rank_clients.append(clients)
    for server, size in enumerate(sizes):
        # one call per server per round (consecutive seeds), rounds of one rank never overlap: the worst moment is
        # every rank's largest call on this server in flight together
        worst = sum(max(clients[server].call_sizes, default=0) for clients in per_rank_clients)
        assert worst <= dbs * size, (server, [c[server].call_sizes for c in per_rank_clients])
