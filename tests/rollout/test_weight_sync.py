"""Weight sync over real gloo between two processes on loopback: full bucketed, adapter, a server-side failure
reported to the sender, and timeouts (a missing or dead peer fails within the timeout, never hangs). Plus the
bucket helpers (single dtype, size cap, order, exact round trip)."""

from __future__ import annotations

import multiprocessing
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coordexp.runtime.rollout.weight_sync import (
    RemoteApplyError,
    WeightSyncError,
    WeightSyncReceiver,
    WeightSyncSender,
    WeightSyncTimeout,
    bucket_layout,
    flatten_bucket,
    plan_buckets,
    unflatten_bucket,
)

sys.path.insert(0, str(Path(__file__).parent))  # spawned peers import _sync_peer by name (sys.path is inherited)
from _sync_peer import free_port, receiver_main  # noqa: E402

SPAWN = multiprocessing.get_context("spawn")


# ------------------------------------------------------------------------------------------------ helpers


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 40)), min_size=1, max_size=12),
       st.sampled_from([0.00005, 0.0001, 0.001]))
def test_plan_buckets_single_dtype_capped_and_order_preserving(specs, bucket_mb):
    tensors = [(f"t{k}", torch.arange(n, dtype=torch.float32).to(DTYPES[d])) for k, (d, n) in enumerate(specs)]
    buckets = list(plan_buckets(tensors, bucket_mb))
    limit = bucket_mb * 1024 * 1024
    for bucket in buckets:
        assert len({t.dtype for _, t in bucket}) == 1
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= limit or len(bucket) == 1  # only a lone oversized tensor may exceed the cap
    sent = [name for bucket in buckets for name, _ in bucket]
    assert sorted(sent) == sorted(name for name, t in tensors if t.numel())  # nothing lost, empties skipped
    for dtype in DTYPES:  # within a dtype the original order holds
        assert [n for n in sent if dict(tensors)[n].dtype == dtype] == [
            n for n, t in tensors if t.dtype == dtype and t.numel()]


def test_flatten_unflatten_round_trip_is_exact():
    named = [("a", torch.randn(2, 3)), ("b", torch.randn(4)), ("c", torch.randn(1, 1, 2))]
    flat, metadatas = flatten_bucket(named)
    assert flat.shape == (12,) and [m.start_idx for m in metadatas] == [0, 6, 10]
    assert bucket_layout(metadatas) == (12, torch.float32)
    for (name, original), (back_name, back) in zip(named, unflatten_bucket(flat.clone(), metadatas)):
        assert name == back_name and torch.equal(original, back)


def test_mixed_dtype_bucket_is_refused():
    with pytest.raises(WeightSyncError, match="one dtype"):
        flatten_bucket([("a", torch.zeros(2)), ("b", torch.zeros(2, dtype=torch.bfloat16))])


def test_unflatten_checks_the_buffer_against_metadata():
    _, metadatas = flatten_bucket([("a", torch.zeros(4))])
    with pytest.raises(WeightSyncError, match="describe"):
        unflatten_bucket(torch.zeros(5), metadatas)


# ------------------------------------------------------------------------------------------------ two processes


class Peer:
    """A receiver process and the queues standing in for the HTTP announcements."""

    def __init__(self, timeout_s: float = 20.0):
        self.port = free_port()
        self.commands, self.results = SPAWN.Queue(), SPAWN.Queue()
        self.process = SPAWN.Process(target=receiver_main, args=(self.port, self.commands, self.results, timeout_s),
                                     daemon=True)
        self.process.start()

    def announce(self, fail_names=()):
        def post(metadatas):
            self.commands.put(("bucket", [m.model_dump(mode="json") for m in metadatas], list(fail_names)))
        return post

    def finish(self):
        self.commands.put(("close",))
        kind, applied, errors = self.results.get(timeout=60)
        assert kind == "applied"
        self.process.join(timeout=30)
        return applied, errors

    def wait_listening(self, timeout_s: float = 180.0) -> None:
        """Block until the receiver's rendezvous store accepts connections (its process imports torch first, which
        takes many seconds on a loaded machine), so the sender's own short timeouts measure the sync, not start-up."""
        import socket

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=2):
                    return
            except OSError:
                if not self.process.is_alive() or time.monotonic() > deadline:
                    raise AssertionError(f"the receiver never listened on port {self.port}") from None
                time.sleep(0.1)

    def kill(self):
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=10)


@pytest.fixture()
def connected():
    peer = Peer()
    sender = WeightSyncSender(timeout_s=20.0, backend="gloo")
    try:
        peer.wait_listening()
        sender.init("127.0.0.1", peer.port, 2)
        assert peer.results.get(timeout=30) == ("ready", None)
        yield peer, sender
    finally:
        sender.close()
        peer.kill()


def test_full_sync_bucketed_delivers_every_tensor_exactly(connected):
    peer, sender = connected
    torch.manual_seed(0)
    params = [
        ("model.embed.weight", torch.randn(64, 32)),                       # 8 KiB: a bucket of its own
        ("model.norm.weight", torch.randn(32).to(torch.bfloat16)),
        ("model.layer.weight", torch.randn(16, 16)),
        ("model.layer.bias", torch.randn(16)),
        ("lm_head.weight", torch.randn(8, 32).to(torch.bfloat16)),
        ("empty", torch.zeros(0)),
    ]
    report = sender.send_full(params, announce=peer.announce(), bucket_mb=4096 / 2**20)
    applied, errors = peer.finish()
    assert errors == [None] * report.buckets
    assert report.buckets == 3 and report.tensors == 5  # fp32 (8 KiB) | fp32 (1 KiB + 64 B) | bf16 (both)
    assert report.bytes == sum(t.numel() * t.element_size() for _, t in params)
    for name, tensor in params[:-1]:
        dtype, shape, values = applied[name]
        assert dtype == str(tensor.dtype) and shape == list(tensor.shape)
        assert values == tensor.float().flatten().tolist()
    assert "empty" not in applied


def test_server_side_apply_failure_reaches_the_sender_and_the_group_survives(connected):
    peer, sender = connected
    good = [("a", torch.ones(3))]
    bad = [("not.a.param", torch.ones(2))]
    with pytest.raises(RemoteApplyError, match="not.a.param is not a parameter") as info:
        sender.send_full(bad, announce=peer.announce(fail_names={"not.a.param"}))
    assert list(info.value.errors) == [0]
    assert sender.is_open  # an apply failure is not a transport failure
    sender.send_full(good, announce=peer.announce())
    applied, errors = peer.finish()
    assert set(applied) == {"a"} and errors[0].startswith("KeyError") and errors[1] is None


def test_adapter_sync_is_one_bucket(connected):
    peer, sender = connected
    adapter = [("base_model.model.q.lora_A.weight", torch.randn(4, 8)),
               ("base_model.model.q.lora_B.weight", torch.randn(8, 4))]
    report = sender.send_adapter(adapter, announce=peer.announce())
    applied, errors = peer.finish()
    assert report.buckets == 1 and errors == [None]
    assert applied["base_model.model.q.lora_B.weight"][2] == adapter[1][1].flatten().tolist()


def test_announce_failure_broadcasts_nothing(connected):
    peer, sender = connected

    def refused(_metadatas):
        raise RuntimeError("HTTP 409 from /update_flattened_params/")

    with pytest.raises(RuntimeError, match="409"):
        sender.send_full([("a", torch.ones(2))], announce=refused)
    sender.send_full([("b", torch.ones(2))], announce=peer.announce())  # still in step with the server
    applied, _ = peer.finish()
    assert set(applied) == {"b"}


def test_missing_server_fails_within_the_timeout():
    sender = WeightSyncSender(timeout_s=2.0, backend="gloo")
    started = time.monotonic()
    with pytest.raises(WeightSyncTimeout, match="could not reach the rendezvous store"):
        sender.init("127.0.0.1", free_port(), 2)
    assert time.monotonic() - started < 15


def test_missing_learner_fails_the_receiver_within_the_timeout():
    receiver = WeightSyncReceiver(timeout_s=2.0, backend="gloo")
    started = time.monotonic()
    with pytest.raises(WeightSyncError, match="could not form the group"):
        receiver.init("127.0.0.1", free_port(), 2)
    assert time.monotonic() - started < 15
    receiver.close()


def test_dead_server_mid_sync_raises_instead_of_hanging():
    peer = Peer()
    sender = WeightSyncSender(timeout_s=5.0, backend="gloo")
    try:
        peer.wait_listening()  # a readiness signal, so the 5 s timeout bounds the dead-peer send only
        sender.init("127.0.0.1", peer.port, 2)
        assert peer.results.get(timeout=30) == ("ready", None)
        peer.commands.put(("exit",))  # the server process leaves without receiving
        peer.process.join(timeout=30)
        started = time.monotonic()
        with pytest.raises(WeightSyncError):
            sender.send_full([("a", torch.ones(1000))], announce=lambda m: None)
        assert time.monotonic() - started < 20
        assert not sender.is_open
        with pytest.raises(WeightSyncError, match="broken"):
            sender.send_full([("a", torch.ones(2))], announce=lambda m: None)
    finally:
        sender.close()
        peer.kill()


def test_sender_requires_init():
    with pytest.raises(WeightSyncError, match="call init"):
        WeightSyncSender(backend="gloo").send_full([("a", torch.ones(1))], announce=lambda m: None)
