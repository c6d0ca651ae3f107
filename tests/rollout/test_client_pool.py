"""RolloutServerClient transport: keep-alive reuse counted on a real loopback HTTP/1.1 server, bounded retries with
exponential backoff for idempotent calls only, never a retried weight push, timeouts that fire on a silent peer."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import coordexp.runtime.rollout.client as client_module
from coordexp.runtime.rollout.client import (
    RolloutServerClient,
    ServerResponseError,
    ServerTimeoutError,
    ServerUnreachableError,
)

WEIGHT_CALLS = {
    "init_communicator": lambda c: c.init_communicator("127.0.0.1", 1, 2),
    "update_flattened_params": lambda c: c.update_flattened_params([]),
    "update_named_param": lambda c: c.update_named_param("w", "torch.float32", [2]),
    "update_adapter_flattened_param": lambda c: c.update_adapter_flattened_param(1, {}, []),
    "reset_prefix_cache": lambda c: c.reset_prefix_cache(),
    "close_communicator": lambda c: c.close_communicator(),
}


class CountingServer:
    """An HTTP/1.1 (keep-alive) server on 127.0.0.1 that counts accepted connections and requests per path.
    ``script[path]`` is a list of actions used in turn (the last repeats): ``("json", status, body)``, ``"drop"``
    (close the connection without answering), ``"hang"`` (never answer), ``"close_after"`` (answer 200, then close
    the connection without saying so, like a keep-alive timeout)."""

    def __init__(self):
        self.connections = 0
        self.calls: list[tuple[str, str, dict]] = []
        self.script: dict[str, list] = {}
        self.closed = threading.Event()  # set when a "close_after" connection was closed by the server
        self.release = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                super().setup()
                with lock:
                    server.connections += 1

            def log_message(self, *args):
                pass

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                path = self.path.strip("/")
                with lock:
                    server.calls.append((self.command, path, dict(self.headers)))
                    seen = sum(1 for _, p, _ in server.calls if p == path)
                actions = server.script.get(path) or [("json", 200, server.default(path, body))]
                action = actions[min(seen, len(actions)) - 1]
                if action == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if action == "hang":
                    server.release.wait(30)
                    self.close_connection = True
                    return
                status, payload = (200, server.default(path, body)) if action == "close_after" else action[1:]
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                self.wfile.flush()
                if action == "close_after":
                    self.close_connection = True

            def finish(self):
                super().finish()
                if self.close_connection:
                    try:  # the FIN is on its way before the test hears of the close
                        self.connection.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    server.closed.set()

            do_GET = do_POST = _handle

        lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @staticmethod
    def default(path: str, body: bytes):
        if path == "get_world_size":
            return {"world_size": 2}
        if path == "infer":
            return [{"n": i} for i, _ in enumerate(json.loads(body)["infer_requests"])]
        return {"status": "ok"}

    def count(self, path: str) -> int:
        return sum(1 for _, p, _ in self.calls if p == path)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    with CountingServer() as running:
        yield running


@pytest.fixture
def sleeps(monkeypatch):
    """The client's backoff sleeps, recorded instead of slept."""
    recorded: list[float] = []
    monkeypatch.setattr(client_module.time, "sleep", recorded.append)
    return recorded


def test_sequential_calls_reuse_one_kept_alive_connection(server):
    client = RolloutServerClient(server.base_url, timeout_s=10)
    for _ in range(5):
        client.request("GET", "health", timeout=10)
        client._world_size = None
        assert client.world_size() == 2
        assert client.infer([{"messages": []}] * 2, {"seed": 1}) == [{"n": 0}, {"n": 1}]
        client.reset_prefix_cache()
    assert len(server.calls) == 20
    # the 15 idempotent calls share one kept-alive connection; each exactly-once call (the cache reset) takes its own
    assert server.connections == 1 + 5 and client.connections_opened == 1 + 5


def test_concurrent_callers_each_get_a_connection_and_reuse_it(server):
    client = RolloutServerClient(server.base_url, timeout_s=10)
    start = threading.Barrier(4, timeout=30)
    errors: list[BaseException] = []

    def caller():
        try:
            start.wait()
            for _ in range(5):
                assert client.infer([{"messages": []}], {"seed": 1}) == [{"n": 0}]
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=caller) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors and server.count("infer") == 20
    assert 1 <= server.connections == client.connections_opened <= 4


def test_a_connection_the_server_closed_while_idle_is_replaced_and_a_push_is_sent_once(server, sleeps):
    server.script["health"] = ["close_after"]
    client = RolloutServerClient(server.base_url, timeout_s=10)
    client.request("GET", "health", timeout=10)
    assert server.closed.wait(30)  # the server closed the kept-alive connection without saying so
    client.request("GET", "health", timeout=10)  # an idempotent call: the dead idle connection is detected, replaced
    assert server.connections == 2 and client.connections_opened == 2 and sleeps == []
    client.update_flattened_params([])
    assert server.count("update_flattened_params") == 1 and sleeps == []


def test_calls_sent_exactly_once_never_ride_a_kept_alive_connection(server):
    """A weight push cannot be resent, so it never reuses an idle connection the server might be closing just then
    (seen as a RemoteDisconnected push on a loaded box); idempotent calls keep reusing theirs."""
    client = RolloutServerClient(server.base_url, timeout_s=10)
    for _ in range(3):
        client.request("GET", "health", timeout=10)
    assert server.connections == 1
    client.update_flattened_params([])
    client.reset_prefix_cache()
    assert server.connections == 3 and server.count("update_flattened_params") == 1
    client.request("GET", "health", timeout=10)
    assert server.connections == 3  # the kept-alive connection is still there for idempotent calls


@pytest.mark.parametrize("call", [
    lambda c: c.request("GET", "health", timeout=10),
    lambda c: c.world_size(),
    lambda c: c.engine_type(),
    lambda c: c.infer([{"messages": []}], {"seed": 3}),
])
def test_idempotent_calls_retry_transient_failures_with_exponential_backoff(server, sleeps, call):
    for path in ("health", "get_world_size", "get_engine_type", "infer"):
        server.script[path] = ["drop", ("json", 503, {"detail": "warming up"})] + [
            ("json", 200, {"world_size": 2} if path == "get_world_size" else
             [{"n": 0}] if path == "infer" else {"status": "ok"})]
    client = RolloutServerClient(server.base_url, timeout_s=10, retries=3, backoff_s=0.25)
    call(client)
    assert len(server.calls) == 3  # a dropped connection, a 503, then the answer
    assert sleeps == [0.25, 0.5]


def test_retries_are_bounded_and_the_last_error_keeps_its_status(server, sleeps):
    server.script["infer"] = [("json", 503, {"detail": "overloaded"})]
    client = RolloutServerClient(server.base_url, timeout_s=10, retries=2, backoff_s=1.0)
    with pytest.raises(ServerResponseError) as caught:
        client.infer([{"messages": []}], {"seed": 1})
    assert caught.value.status == 503 and server.count("infer") == 3 and sleeps == [1.0, 2.0]


@pytest.mark.parametrize("status", [400, 404, 422, 500])
def test_an_answer_other_than_502_503_504_is_not_retried(server, sleeps, status):
    server.script["infer"] = [("json", status, {"detail": "no"})]
    with pytest.raises(ServerResponseError) as caught:
        RolloutServerClient(server.base_url, timeout_s=10).infer([{"messages": []}], {"seed": 1})
    assert caught.value.status == status and server.count("infer") == 1 and sleeps == []


@pytest.mark.parametrize("endpoint", sorted(WEIGHT_CALLS))
@pytest.mark.parametrize("failure", ["drop", "503"])
def test_weight_sync_calls_are_never_retried(server, sleeps, endpoint, failure):
    server.script[endpoint] = ["drop" if failure == "drop" else ("json", 503, {"detail": "busy"})]
    client = RolloutServerClient(server.base_url, timeout_s=10, retries=5, backoff_s=0.01)
    with pytest.raises(ServerUnreachableError if failure == "drop" else ServerResponseError):
        WEIGHT_CALLS[endpoint](client)
    assert server.count(endpoint) == 1 and sleeps == []


def test_a_timed_out_infer_is_not_sent_again(server, sleeps):
    """The server may still be generating the first call; a second copy would queue behind it."""
    server.script["infer"] = ["hang"]
    client = RolloutServerClient(server.base_url, timeout_s=10, infer_timeout_s=0.3, retries=3)
    with pytest.raises(ServerTimeoutError, match=r"/infer/.*0.3 s"):
        client.infer([{"messages": []}], {"seed": 1})
    assert server.count("infer") == 1 and sleeps == []


def test_an_unreachable_server_is_retried_then_named(sleeps):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"  # bound, never listening: connection refused
        client = RolloutServerClient(url, timeout_s=5, retries=2, backoff_s=0.1)
        with pytest.raises(ServerUnreachableError, match=f"{url}/get_world_size/"):
            client.world_size()
    assert sleeps == [0.1, 0.2]
