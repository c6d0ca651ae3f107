"""VllmServerBackend against stub servers: distribution, order, seeds, N = 0, retry, errors, sync fallback."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from coordexp.runtime.rollout.base import RolloutRequest
from coordexp.runtime.rollout.vllm_server import RolloutServerError, VllmServerBackend
from coordexp.runtime.rollout.weight_sync import WeightSyncError
from coordexp.runtime.model.data import DetectionRecord
from coordexp.runtime.core.distribution import InfeasibleTopologyError
from coordexp.runtime.rollout.client import RolloutServerClient
from coordexp.schema.rollout import DecodingConfig

from testkit import free_port, stub_server


def requests_for(n: int, first_seed: int = 100) -> list[RolloutRequest]:
    record = DetectionRecord(image_paths=(Path("/data/img.png"),), width=8, height=8, objects=(), source="t:1")
    return [RolloutRequest(prompt=None, index=i, seed=first_seed + i, record=record) for i in range(n)]


def tag_requests(stub, offset=0):
    """Make the stub echo each request's index (data_dict.coordexp_index) as its first generated token."""
    def infer(handler, body):
        out = []
        for j, r in enumerate(body["infer_requests"]):
            from testkit import echo_output
            r = {**r, "data_dict": {"tag": r["data_dict"]["coordexp_index"] + offset}}
            out.append(echo_output(r, body["request_config"]["seed"] + j))
        return 200, out
    stub.behaviour["/infer/"] = infer


def backend_for(stubs, *, dbs=2, world=1, **kwargs):
    infer_timeout_s = kwargs.pop("infer_timeout_s", None)
    clients = [RolloutServerClient(s.base_url, group_port=1, timeout_s=3, infer_timeout_s=infer_timeout_s,
                                   backoff_s=0.01) for s in stubs]
    return VllmServerBackend(clients, decode_batch_size=dbs, max_new_tokens=16, decoding=DecodingConfig(),
                             topology=lambda: (0, world), **kwargs)


def infer_calls(stub):
    return [body for method, path, body in stub.calls if path == "/infer/"]


def test_one_server_rounds_of_the_per_rank_chunk_in_order():
    with stub_server(world_size=1) as a:
        tag_requests(a)
        backend = backend_for([a], dbs=2)
        assert backend.chunk == 2
        outputs = backend.generate(requests_for(5))
        assert [o.response_token_ids[0] for o in outputs] == [0, 1, 2, 3, 4]
        assert [o.response_token_ids[1] for o in outputs] == [100, 101, 102, 103, 104]  # seeds follow the requests
        assert [o.prompt_token_ids for o in outputs] == [(7, 7, i) for i in range(5)]
        calls = infer_calls(a)
        assert [len(c["infer_requests"]) for c in calls] == [2, 2, 1]
        assert [c["request_config"]["seed"] for c in calls] == [100, 102, 104]
        first = calls[0]
        assert first["request_config"]["return_details"] is True and first["request_config"]["max_tokens"] == 16
        assert first["infer_requests"][0]["images"] == ["/data/img.png"]
        assert [m["role"] for m in first["infer_requests"][0]["messages"]] == ["system", "user"]
        backend.close()


def test_two_servers_contiguous_proportional_chunks_reassembled_in_order():
    with stub_server(world_size=3) as a, stub_server(world_size=1) as b:
        tag_requests(a)
        tag_requests(b, offset=1000)  # outputs from server b are recognisable
        backend = backend_for([a, b], dbs=2)  # chunk = floor(2 * 4 / 1) = 8
        assert backend.world_sizes == [3, 1] and backend.chunk == 8
        outputs = backend.generate(requests_for(8))
        # server a may take ceil(8*3/4) = 6 requests: [0:6]; server b the remaining [6:8]
        assert [o.response_token_ids[0] for o in outputs] == [0, 1, 2, 3, 4, 5, 1006, 1007]
        assert [len(c["infer_requests"]) for c in infer_calls(a)] == [6]
        assert [c["request_config"]["seed"] for c in infer_calls(b)] == [106]
        again = backend.generate(requests_for(8))  # deterministic: same chunks to the same servers
        assert again == outputs
        assert [len(c["infer_requests"]) for c in infer_calls(a)] == [6, 6]


def test_zero_requests_send_nothing():
    with stub_server() as a, stub_server() as b:
        backend = backend_for([a, b])
        before = len(a.calls) + len(b.calls)
        assert backend.generate([]) == []
        assert len(a.calls) + len(b.calls) == before
        assert not infer_calls(a) and not infer_calls(b)


def test_seed_wraparound_splits_the_call_so_every_request_keeps_its_seed():
    with stub_server() as a:
        tag_requests(a)
        backend = backend_for([a], dbs=4)
        reqs = requests_for(4)
        seeds = [2**31 - 2, 2**31 - 1, 1, 2]
        reqs = [RolloutRequest(r.prompt, r.index, s, r.record) for r, s in zip(reqs, seeds)]
        outputs = backend.generate(reqs)
        assert [o.response_token_ids[1] for o in outputs] == seeds
        assert [c["request_config"]["seed"] for c in infer_calls(a)] == [2**31 - 2, 1]


def test_infeasible_topology_fails_at_start():
    with stub_server() as a, stub_server() as b:
        with pytest.raises(InfeasibleTopologyError, match="decode_batch_size"):
            backend_for([a, b], dbs=1, world=4)


def test_one_transient_failure_is_retried_transparently():
    with stub_server() as a:
        state = {"n": 0}

        def flaky(handler, body):
            state["n"] += 1
            if state["n"] == 1:
                return 503, {"detail": "transient"}
            return a.default(handler, body)

        a.behaviour["/infer/"] = flaky
        outputs = backend_for([a]).generate(requests_for(1))
        assert len(outputs) == 1 and state["n"] == 2


@pytest.mark.parametrize("failure, sent", [("503", 3), ("500", 1), ("malformed", 1), ("hang", 1)])
def test_persistent_failure_names_server_and_step(failure, sent):
    """Only a lost connection or 502/503/504 is retried (twice, by the client); a 500, a malformed reply and a
    timeout are the server's answer and fail at once (a timed-out call may still be running on the server)."""
    with stub_server() as a:
        actions = {"503": lambda h, b: (503, {"detail": "busy"}), "500": lambda h, b: (500, {"detail": "boom"}),
                   "malformed": lambda h, b: (200, b"{oops"), "hang": a.hang}
        backend = backend_for([a], infer_timeout_s=0.4)
        backend.generate(requests_for(1))  # rollout step 1 works
        a.behaviour["/infer/"] = actions[failure]
        with pytest.raises(RolloutServerError) as info:
            backend.generate(requests_for(1))
        message = str(info.value)
        assert "rollout step 2" in message and a.base_url in message
        assert len(infer_calls(a)) == 1 + sent


def test_server_down_at_start_names_url_and_alternatives():
    url = f"http://127.0.0.1:{free_port()}"
    client = RolloutServerClient(url, group_port=1, timeout_s=1.0)
    with pytest.raises(RolloutServerError, match=r"vllm.mode: colocate.*rollout_backend: hf") as info:
        VllmServerBackend([client], decode_batch_size=1, max_new_tokens=4, decoding=DecodingConfig(),
                          topology=lambda: (0, 1))
    assert url in str(info.value)


def test_beam_search_is_rejected_at_construction():
    with stub_server() as a:
        with pytest.raises(ValueError, match="num_beams"):
            VllmServerBackend([RolloutServerClient(a.base_url, timeout_s=2)], decode_batch_size=1, max_new_tokens=4,
                              decoding=DecodingConfig(num_beams=2), topology=lambda: (0, 1))


class FakeModel(__import__("torch").nn.Module):
    """One parameter whose version counter moves on an in-place update, like an optimizer step."""

    def __init__(self):
        import torch

        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2))

    def step(self):
        import torch

        with torch.no_grad():
            self.weight.add_(1.0)


def test_adapter_failure_falls_back_to_full_once_and_for_good(caplog):
    pushes = []

    def pusher(client, model, mode):
        pushes.append(mode)
        if mode == "adapter":
            raise RuntimeError("server has no LoRA support")

    with stub_server() as a:
        backend = backend_for([a], sync_mode="adapter", weight_pusher=pusher)
        model = FakeModel()
        with caplog.at_level(logging.WARNING, logger="coordexp.rollout.server"):
            backend.sync_weights(model)
            backend.sync_weights(model)  # unchanged weights: nothing is pushed
            model.step()
            backend.sync_weights(model)
        assert pushes == ["adapter", "full", "full"]
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "falling back to full" in warnings[0].getMessage()
        assert backend.sync_mode == "full" and len(backend.fallback_events) == 1


def test_adapter_failure_without_fallback_fails_with_guidance():
    def pusher(client, model, mode):
        raise RuntimeError("no LoRA")

    with stub_server() as a:
        backend = backend_for([a], sync_mode="adapter", fallback_to_full=False, weight_pusher=pusher)
        with pytest.raises(WeightSyncError, match="fallback_to_full is false"):
            backend.sync_weights(FakeModel())
