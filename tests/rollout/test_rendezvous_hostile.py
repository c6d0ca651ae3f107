"""The weight-sync rendezvous store under hostile local clients: a raw ``TCPStore`` client writing an empty or
garbage value where gloo reads a peer's record used to kill ``serve-rollout`` with SIGSEGV, and a client without the
server's token could join the group an authorized learner had opened. Now every store key lives under a per-init
secret answered only to the authorized caller, and every record gloo would parse is checked first."""

from __future__ import annotations

import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from coordexp.runtime.rollout.store_guard import (STORE_PREFIX, GlooRendezvousGuard, StoreRecordError,
                                                  new_rendezvous_key, parse_gloo_rank, store_prefix)
from coordexp.runtime.rollout.weight_sync import WeightSyncError, WeightSyncSender
from coordexp.runtime.server.rendezvous import TOKEN_ENV
from coordexp.runtime.server.serve import READY_PREFIX
from testkit import read_until_ready

HERE = Path(__file__).parent
TOKEN = "hostile-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
_SIZE = struct.Struct("=Q")


# --------------------------------------------------------------------------------------------------- units


def gloo_record(hostname: bytes = b"vm", family: int = socket.AF_INET, address_size: int = 136,
                pair_ids: tuple[int, ...] = (0, 1)) -> bytes:
    """A record in gloo's ``Rank`` layout (what ``ProcessGroupGloo`` writes at ``<context>/<rank>``)."""
    address = struct.pack("=H", family) + bytes(address_size - 2)
    return (_SIZE.pack(len(hostname)) + hostname + _SIZE.pack(address_size) + address
            + b"".join(_SIZE.pack(i) for i in pair_ids))


def test_rendezvous_keys_are_fresh_secrets_and_malformed_ones_are_refused():
    first, second = new_rendezvous_key(), new_rendezvous_key()
    assert first != second and re.fullmatch(r"[0-9a-f]{32}", first)
    assert store_prefix(first) == f"{STORE_PREFIX}/{first}"
    for bad in ("", "0/1", "../" + first, first.upper(), "g" * 32, "0" * 31, 7):
        with pytest.raises(WeightSyncError, match="rendezvous_key is malformed"):
            store_prefix(bad)


def test_a_real_looking_record_parses():
    record = parse_gloo_rank(gloo_record())
    assert (record.hostname, record.address_size, record.family, record.pair_ids) == (b"vm", 136, socket.AF_INET,
                                                                                       (0, 1))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
@example(b"")
@example(gloo_record()[:-1])
@example(_SIZE.pack(2**63) + gloo_record()[8:])  # a host-name length far beyond the record
@example(gloo_record()[:10] + _SIZE.pack(2**40) + gloo_record()[18:])  # an address length beyond it
@example(gloo_record(family=1))  # AF_UNIX: not a peer's network address
def test_any_bytes_parse_to_a_consistent_record_or_a_clean_refusal(value):
    try:
        record = parse_gloo_rank(value)
    except StoreRecordError:
        return
    rebuilt = (_SIZE.pack(len(record.hostname)) + record.hostname + _SIZE.pack(record.address_size))
    assert value.startswith(rebuilt) and record.family in (socket.AF_INET, socket.AF_INET6)
    assert len(value) == len(rebuilt) + record.address_size + 8 * len(record.pair_ids)


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.binary(max_size=300), st.builds(gloo_record, hostname=st.binary(max_size=40),
                                                    family=st.sampled_from([socket.AF_INET, socket.AF_INET6, 0, 1]),
                                                    address_size=st.sampled_from([10, 136, 200]),
                                                    pair_ids=st.lists(st.integers(0, 5), max_size=4).map(tuple))))
def test_the_guard_hands_gloo_only_records_shaped_like_its_own(value):
    guard = GlooRendezvousGuard(torch.distributed.HashStore(), rank=0, world_size=2)
    guard.set("0/0", gloo_record(hostname=b"server"))
    guard.set("0/1", value)
    try:
        assert guard.get("0/1") == value
    except StoreRecordError:
        return
    record = parse_gloo_rank(value)
    assert (record.address_size, record.family, len(record.pair_ids)) == (136, socket.AF_INET, 2)


def test_the_guard_refuses_ranks_outside_the_group_and_passes_other_keys():
    guard = GlooRendezvousGuard(torch.distributed.HashStore(), rank=0, world_size=2)
    guard.set("0/0", gloo_record())
    guard.set("0/5", gloo_record())
    with pytest.raises(StoreRecordError, match="rank 5 of 2"):
        guard.get("0/5")
    guard.set("3/error/0", b"")  # not a gloo record: passed through untouched
    assert guard.get("3/error/0") == b""


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="socket filters are Linux's")


def connects(port: int, source: str) -> bool:
    """Whether a TCP connection from ``source`` (a loopback alias) to the listener at 127.0.0.1:``port`` completes
    (a filtered attempt is dropped, so it times out)."""
    with socket.socket() as sock:
        sock.bind((source, 0))
        sock.settimeout(2.0)
        try:
            sock.connect(("127.0.0.1", port))
        except OSError:
            return False
        return True


@linux_only
def test_the_gate_admits_only_the_authorized_address_then_nobody_and_keeps_accepted_connections():
    from coordexp.runtime.server.rendezvous import ListenerGate

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        gate = ListenerGate(listener)
        gate.admit({"127.0.0.2"})
        assert gate.enforced
        assert connects(port, "127.0.0.3") is False  # another address: dropped
        member = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=("127.0.0.2", 0))
        accepted, _ = listener.accept()
        gate.seal()
        assert connects(port, "127.0.0.2") is False  # the group has formed: nobody new, not even the peer's address
        member.sendall(b"still here")
        accepted.settimeout(5)
        assert accepted.recv(16) == b"still here"  # ... while the member's connection keeps working
        gate.close()
        member.close()
        accepted.close()


def test_swifts_wire_admits_the_callers_address_unless_it_is_loopback_or_ipv6():
    from coordexp.runtime.server.rendezvous import RendezvousPolicy

    policy = RendezvousPolicy.resolve(http_host="127.0.0.1")
    assert policy.admitted("10.1.2.3") == {"10.1.2.3", "127.0.0.1"}  # the caller, and the store's own client
    assert policy.admitted("::ffff:10.1.2.3") == {"10.1.2.3", "127.0.0.1"}
    for peer in ("127.0.0.1", "::1", "fe80::1", "testclient", None):
        assert policy.admitted(peer) is None


class CollectivePlanes:
    """A data plane factory whose init, like PyNccl's, returns on rank 0 only once the learner has read the id."""

    collective_init = True

    def __init__(self):
        self.read = threading.Event()

    def unavailable_reason(self, device):
        return None

    def __call__(self, group, device):
        from types import SimpleNamespace

        uid = group.broadcast_obj("the-unique-id" if group.rank == 0 else None, src=0)
        if group.rank == 0:
            assert self.read.wait(30), "the learner never read the unique id"
        else:
            assert uid == "the-unique-id"
            self.read.set()
        return SimpleNamespace(device=torch.device("cpu"), close=lambda: None)


def test_swifts_unique_id_leaves_the_store_once_the_group_has_formed():
    from coordexp.runtime.rollout.swift_sync import UNIQUE_ID_KEY, SwiftWireReceiver, SwiftWireSender
    from coordexp.runtime.rollout.weight_sync import listening_socket

    listener = listening_socket("127.0.0.1", 0)
    port = listener.getsockname()[1]
    planes = CollectivePlanes()
    sender = SwiftWireSender(planes, device="cpu", timeout_s=30)
    joined = threading.Thread(target=lambda: sender.init("127.0.0.1", port, 2), daemon=True)
    joined.start()
    receiver = SwiftWireReceiver(planes, torch.device("cpu"), 30)
    receiver.init(listener, port, 2)
    joined.join(30)
    try:
        assert sender.is_open and receiver.is_open
        assert not receiver.group.store.check([UNIQUE_ID_KEY])  # a stranger can no longer read it and join NCCL
    finally:
        sender.close()
        receiver.close()


def test_without_a_collective_init_the_unique_id_leaves_the_store_at_the_first_barrier():
    from coordexp.runtime.rollout.swift_sync import UNIQUE_ID_KEY, SwiftStoreGroup
    from coordexp.runtime.rollout.weight_sync import listening_socket

    listener = listening_socket("127.0.0.1", 0)
    port = listener.getsockname()[1]
    box: dict = {}

    def learner_side():
        group = SwiftStoreGroup.join("127.0.0.1", port, 1, 2, 30)
        box["uid"] = group.broadcast_obj(None, src=0)
        group.barrier(10)

    thread = threading.Thread(target=learner_side, daemon=True)
    thread.start()
    host = SwiftStoreGroup.host(listener, port, 2, 30)
    host.broadcast_obj("the-unique-id", src=0)
    host.barrier(10)
    thread.join(30)
    assert box["uid"] == "the-unique-id" and not host.store.check([UNIQUE_ID_KEY])


# --------------------------------------------------------------------------------------------------- a real server


class Server:
    """``_hostile_server.py``: the real app and uvicorn, an instant engine, the token in the environment."""

    def __init__(self, model_dir: Path, image_root: Path, token: str | None):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop(TOKEN_ENV, None)
        if token is not None:
            env[TOKEN_ENV] = token
        self.process = subprocess.Popen([sys.executable, str(HERE / "_hostile_server.py"), str(model_dir),
                                         str(image_root)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, env=env)
        self.url, self.lines = read_until_ready(self.process, READY_PREFIX, 300)

    def assert_alive(self) -> None:
        assert self.process.poll() is None, (f"serve-rollout died with return code {self.process.returncode}:\n"
                                             + "".join(self.lines[-40:]))

    def post(self, path: str, body: dict, *, auth: bool = True) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, headers=AUTH if auth else {}, timeout=60)

    def status(self) -> dict:
        return httpx.get(f"{self.url}/coordexp/sync_status/", timeout=30).json()

    def wait_status(self, done, timeout_s: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            self.assert_alive()
            status = self.status()
            if done(status) or time.monotonic() > deadline:
                return status
            time.sleep(0.2)

    def init(self, port: int, timeout_s: float = 60.0) -> httpx.Response:
        reply = self.post("/init_communicator/", {"host": "127.0.0.1", "port": port, "world_size": 2,
                                                  "backend": "gloo", "timeout_s": timeout_s})
        assert reply.status_code == 200, reply.text
        return reply

    def infer_ok(self, record) -> None:
        body = {"infer_requests": [{"messages": [{"role": "user", "content": [
            {"type": "image", "image": str(record.image_paths[0])}, {"type": "text", "text": "Detect."}]}]}]}
        try:
            answer = httpx.post(f"{self.url}/infer/", json=body, timeout=120)
        except httpx.TransportError:
            self.process.wait(timeout=30)  # a dead server: report how it ended
            self.assert_alive()
            raise
        assert answer.status_code == 200, answer.text

    def push(self, sender: WeightSyncSender) -> None:
        """One full sync through the group (the instant engine loads it), as the learner does it."""
        def announce(metadatas) -> None:
            answer = self.post("/update_flattened_params/",
                               {"metadatas": [m.model_dump(mode="json") for m in metadatas]})
            assert answer.status_code == 200, answer.text

        before = self.status()["weights_version"]
        report = sender.send_full([("w", torch.arange(6.0).reshape(2, 3)), ("b", torch.ones(3))], announce=announce)
        assert report.tensors == 2
        assert self.wait_status(lambda s: s["weights_version"] > before)["weights_version"] == before + 1

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_listening(port: int, timeout_s: float = 120.0) -> None:
    """Readiness: the rendezvous store accepts connections (it opens on the server's rendezvous thread)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise AssertionError(f"the rendezvous store never listened on port {port}") from None
            time.sleep(0.1)


def raw_store(port: int) -> torch.distributed.TCPStore:
    """What any local process can do: connect a plain TCPStore client to the rendezvous port."""
    return torch.distributed.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=30),
                                      wait_for_workers=False)


def learner(reply: httpx.Response, port: int) -> WeightSyncSender:
    sender = WeightSyncSender(timeout_s=60.0, backend="gloo")
    sender.use_init_reply(reply.json())
    sender.init("127.0.0.1", port, 2)
    return sender


@pytest.fixture(scope="module")
def server(tiny_model_dir, vllm_dataset):
    started = Server(tiny_model_dir, vllm_dataset.root, TOKEN)
    yield started
    started.kill()


HOSTILE_VALUES = [b"", b"\x00", b"\xff" * 170, gloo_record()[:-3], _SIZE.pack(2**62) + b"vm", gloo_record(family=1)]


@pytest.mark.slow
def test_garbage_at_the_stores_rank_keys_neither_crashes_the_server_nor_stops_infer(server, records):
    port = free_port()
    reply = server.init(port)
    wait_listening(port)
    intruder = raw_store(port)  # no token, no key: only the port
    for value in HOSTILE_VALUES:  # the first one (empty) was a SIGSEGV
        for rank in (1, 0):
            intruder.set(f"{STORE_PREFIX}/0/{rank}", value)
    server.infer_ok(records[0])
    assert server.status()["communicator"] == "initializing"  # still waiting for the authorized learner
    sender = learner(reply, port)  # ... who joins, and syncs
    try:
        assert server.wait_status(lambda s: s["communicator"] != "initializing")["communicator"] == "ready"
        server.push(sender)
        server.infer_ok(records[1])
    finally:
        sender.close()
    server.assert_alive()


@pytest.mark.slow
def test_a_client_without_the_token_cannot_join_the_authorized_group(server):
    port = free_port()
    reply = server.init(port)
    wait_listening(port)
    for guess in (None, "0" * 32):  # no key (what a client without the reply uses), a guessed one
        intruder = WeightSyncSender(timeout_s=3.0, backend="gloo")
        with pytest.raises(WeightSyncError):
            intruder.init("127.0.0.1", port, 2, **({} if guess is None else {"rendezvous_key": guess}))
        intruder.close()
    assert server.status()["communicator"] == "initializing"
    sender = learner(reply, port)
    try:
        server.push(sender)
        assert server.status()["communicator"] == "ready"
    finally:
        sender.close()


@pytest.mark.slow
def test_once_the_group_has_formed_the_store_takes_no_new_connection(server):
    port = free_port()
    reply = server.init(port)
    wait_listening(port)
    sender = learner(reply, port)
    try:
        assert server.wait_status(lambda s: s["communicator"] != "initializing")["communicator"] == "ready"
        with pytest.raises(OSError):  # dropped by the sealed listener: the attempt times out
            socket.create_connection(("127.0.0.1", port), timeout=3).close()
        server.push(sender)  # the members' own connections keep working
    finally:
        sender.close()


@pytest.mark.slow
def test_a_malformed_record_under_the_key_is_a_clean_error_and_a_fresh_init_works(server, records):
    port = free_port()
    key = server.init(port).json()["rendezvous_key"]
    wait_listening(port)
    raw_store(port).set(f"{STORE_PREFIX}/{key}/0/1", b"")  # even a key holder cannot crash it
    status = server.wait_status(lambda s: s["communicator"] != "initializing")
    assert status["communicator"] == "broken"
    assert "refused the rendezvous" in status["last_error"] and "0 bytes" in status["last_error"]
    server.assert_alive()
    server.infer_ok(records[0])
    reply = server.init(port)  # the same port: the refused store's listener is closed
    assert reply.json()["rendezvous_key"] != key
    sender = learner(reply, port)
    try:
        server.push(sender)
    finally:
        sender.close()
    server.infer_ok(records[1])
    server.assert_alive()


@pytest.mark.slow
def test_without_a_token_the_store_still_never_crashes(tiny_model_dir, vllm_dataset, records):
    server = Server(tiny_model_dir, vllm_dataset.root, None)
    try:
        port = free_port()
        reply = server.init(port)
        wait_listening(port)
        raw_store(port).set(f"{STORE_PREFIX}/0/1", b"")
        server.infer_ok(records[0])
        sender = learner(reply, port)
        try:
            server.push(sender)
        finally:
            sender.close()
        server.assert_alive()
    finally:
        server.kill()
