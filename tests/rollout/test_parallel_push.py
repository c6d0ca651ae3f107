"""Weight pushes to several servers: all at once, from ONE export of the policy (LoRA merged once), every failed
server named by URL; :class:`SharedExport` gives every reader the same tensors with bounded memory."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import coordexp.runtime.rollout.vllm_server as vllm_server
from coordexp.runtime.rollout.client import RolloutServerClient
from coordexp.runtime.rollout.server_push import SharedExport
from coordexp.runtime.rollout.vllm_server import ServerWeightChannel, VllmServerBackend
from coordexp.runtime.rollout.weight_sync import SyncReport, WeightSyncError
from coordexp.schema.rollout import DecodingConfig

from testkit import stub_server


def backend_for(stubs, **kwargs) -> VllmServerBackend:
    clients = [RolloutServerClient(s.base_url, group_port=1, timeout_s=10) for s in stubs]
    return VllmServerBackend(clients, decode_batch_size=2, max_new_tokens=4, decoding=DecodingConfig(),
                             topology=lambda: (0, 1), **kwargs)


def lora_policy():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = torch.nn.Sequential()
    base.add_module("q_proj", torch.nn.Linear(6, 6))
    base.add_module("head", torch.nn.Linear(6, 3))
    policy = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], init_lora_weights=False))
    return policy


class BarrierSender:
    """Stands in for one server's transport: consumes what it is given, and waits at a barrier shared by all the
    servers' senders, which only opens when every push runs at the same time."""

    def __init__(self, barrier: threading.Barrier, fail: bool = False):
        self.barrier, self.fail, self.sent = barrier, fail, {}

    def send_full(self, tensors, *, announce, **options):
        self.barrier.wait()
        for name, tensor in tensors:
            if self.fail:
                raise WeightSyncError("receiver rank 0 could not apply model.weight")
            self.sent[name] = tensor.clone()
        announce([])
        return SyncReport(1, len(self.sent), 0, 1e-3)


def channel_with(senders: dict) -> ServerWeightChannel:
    channel = ServerWeightChannel(timeout_s=10)
    channel._sender = lambda client: senders[client.base_url]  # the transport is tested in test_weight_sync.py
    return channel


def test_three_servers_are_pushed_at_once_from_one_merge_of_the_policy(monkeypatch):
    exports: list[int] = []
    real = vllm_server.named_tensors

    def counted(model):
        exports.append(1)
        yield from real(model)

    monkeypatch.setattr(vllm_server, "named_tensors", counted)
    policy = lora_policy()
    reference = {n: p.detach().clone() for n, p in __import__("copy").deepcopy(policy).merge_and_unload()
                 .named_parameters()}
    with stub_server() as a, stub_server() as b, stub_server() as c:
        barrier = threading.Barrier(3, timeout=60)  # sequential pushes would break it: the first waits alone
        senders = {s.base_url: BarrierSender(barrier) for s in (a, b, c)}
        backend = backend_for([a, b, c], weight_pusher=channel_with(senders))
        backend.sync_weights(policy)
        assert len(exports) == 1  # merged once, read by the three transports
        for stub, sender in zip((a, b, c), senders.values()):
            assert set(sender.sent) == set(reference)
            assert all(torch.equal(sender.sent[n], reference[n]) for n in reference)
            assert [p for _, p, _ in stub.calls].count("/reset_prefix_cache/") == 1
        backend.close()


def test_a_failing_server_is_named_by_url_and_the_others_still_get_the_weights():
    policy = lora_policy()
    with stub_server() as a, stub_server() as b, stub_server() as c:
        barrier = threading.Barrier(3, timeout=60)
        senders = {a.base_url: BarrierSender(barrier), b.base_url: BarrierSender(barrier, fail=True),
                   c.base_url: BarrierSender(barrier)}
        backend = backend_for([a, b, c], weight_pusher=channel_with(senders))
        with pytest.raises(WeightSyncError) as caught:
            backend.sync_weights(policy)
        message = str(caught.value)
        assert "1 of 3" in message and f"{b.base_url}: WeightSyncError" in message
        assert a.base_url not in message and c.base_url not in message
        assert senders[a.base_url].sent and senders[c.base_url].sent
        senders[b.base_url].fail = False
        barrier.reset()
        backend.sync_weights(policy)  # not marked pushed: the next sync pushes again, to every server
        assert senders[b.base_url].sent
        backend.close()


def test_plain_pushers_run_in_parallel_too_and_report_each_failure():
    with stub_server() as a, stub_server() as b, stub_server() as c:
        barrier = threading.Barrier(3, timeout=60)
        pushed: list[str] = []

        def pusher(client, model, mode):
            barrier.wait()
            if client.base_url != a.base_url:
                raise ConnectionError("store unreachable")
            pushed.append(client.base_url)

        backend = backend_for([a, b, c], weight_pusher=pusher)
        with pytest.raises(WeightSyncError) as caught:
            backend.sync_weights(torch.nn.Linear(2, 2))
        assert "2 of 3" in str(caught.value) and b.base_url in str(caught.value) and c.base_url in str(caught.value)
        assert pushed == [a.base_url]
        backend.close()


def test_one_server_keeps_the_original_error():
    with stub_server() as a:
        def pusher(client, model, mode):
            raise WeightSyncError("rendezvous timed out")

        backend = backend_for([a], weight_pusher=pusher)
        with pytest.raises(WeightSyncError, match="^rendezvous timed out"):
            backend.sync_weights(torch.nn.Linear(2, 2))
        backend.close()


def test_adapter_mode_exports_the_adapter_once_for_every_server(monkeypatch):
    states: list[int] = []
    real = vllm_server.adapter_state

    def counted(model):
        states.append(1)
        return real(model)

    monkeypatch.setattr(vllm_server, "adapter_state", counted)
    policy = lora_policy()
    with stub_server() as a, stub_server() as b:
        received: dict[str, object] = {}
        channel = ServerWeightChannel(timeout_s=10)
        channel.push = lambda client, exported, mode: received.setdefault(client.base_url, (exported, mode))
        backend = backend_for([a, b], weight_pusher=channel, sync_mode="adapter")
        backend.sync_weights(policy)
        assert len(states) == 1
        (first, mode_a), (second, mode_b) = received.values()
        assert first is second and mode_a == mode_b == "adapter"
        backend.close()


# -- SharedExport ------------------------------------------------------------------------------------------------


def tensors(sizes):
    return [(f"t{i}", torch.full((n,), float(i))) for i, n in enumerate(sizes)]


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(1, 64), min_size=0, max_size=30), readers=st.integers(1, 4),
       window=st.integers(1, 512))
def test_every_reader_gets_every_tensor_once_in_order_and_memory_stays_within_the_window(sizes, readers, window):
    items = tensors(sizes)
    made: list[int] = []

    def source():
        for item in items:
            made.append(1)
            yield item

    shared = SharedExport(source(), readers, window_bytes=window)
    largest = max((t.numel() * t.element_size() for _, t in items), default=0)
    peaks: list[int] = []
    results: list[list[str]] = [[] for _ in range(readers)]

    def read(k):
        for name, _ in shared.reader(k):
            peaks.append(shared._buffered)
            results[k].append(name)

    threads = [threading.Thread(target=read, args=(k,)) for k in range(readers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert all(r == [n for n, _ in items] for r in results)
    assert len(made) == shared.produced == len(items)
    assert max(peaks, default=0) <= window + largest
    assert shared._items == {} and shared._buffered == 0


def test_a_reader_that_stops_early_never_blocks_the_others():
    shared = SharedExport(iter(tensors([8] * 20)), 2, window_bytes=64)
    stopped = shared.reader(0)
    next(stopped)
    shared.release(0)  # its push failed
    assert len(list(shared.reader(1))) == 20


def test_a_failing_export_reaches_every_reader():
    def source():
        yield from tensors([4, 4])
        raise RuntimeError("merge failed")

    shared = SharedExport(source(), 2, window_bytes=1 << 20)
    for k in range(2):
        with pytest.raises(RuntimeError, match="merge failed"):
            list(shared.reader(k))
