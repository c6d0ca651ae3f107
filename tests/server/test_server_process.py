"""The rollout server as a real process on loopback: SIGINT during a blocking request (issue 12 acceptance), and a
rendezvous with no learner behind it (issue 15 acceptance: nothing listens beyond loopback, /infer/ keeps
answering, the abandoned listener is closed at the cap)."""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from coordexp.runtime.rollout import protocol as p
from coordexp.runtime.server.serve import READY_PREFIX
from testkit import read_until_ready

HERE = Path(__file__).parent
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]


class Server:
    """A started ``_slow_server.py`` process; ``lines`` collects everything it prints (access log included)."""

    def __init__(self, *args: str):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen([sys.executable, str(HERE / "_slow_server.py"), *args], stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, env=env)
        self.url, self.lines = read_until_ready(self.process, READY_PREFIX, 120)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


def wire_request(record) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image", "image": str(record.image_paths[0])},
                                                     {"type": "text", "text": "Detect every object."}]}]}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that process ``pid`` holds (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("tcp", 4), ("tcp6", 16)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            # /proc prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
            found.append((str(ipaddress.ip_address(raw)), int(port, 16)))
    return found


def test_sigint_during_a_blocking_infer_answers_503_and_exits_within_10_s(tiny_model_dir, dataset, records):
    server = Server(str(tiny_model_dir), str(dataset.root), "300", "4096")  # each generate sleeps 5 minutes
    try:
        bad = httpx.post(f"{server.url}/infer/", timeout=10, content=b'{"request_config": {"top_p": NaN}}',
                         headers={"content-type": "application/json"})
        assert bad.status_code == 400
        result: dict = {}

        def call() -> None:
            body = {"infer_requests": [wire_request(records[0])], "request_config": {"max_tokens": 3500}}
            try:
                result["reply"] = httpx.post(f"{server.url}/infer/", json=body, timeout=60)
            except httpx.HTTPError as exc:  # the assertion below says which outcome happened
                result["error"] = exc

        blocking = threading.Thread(target=call)
        blocking.start()
        time.sleep(2.0)  # the request is now inside the engine's generate
        assert blocking.is_alive(), result
        assert httpx.get(f"{server.url}/health/", timeout=5).status_code == 200
        server.process.send_signal(signal.SIGINT)
        started = time.monotonic()
        code = server.process.wait(timeout=10)
        exited_after = time.monotonic() - started
        blocking.join(timeout=10)
        assert code == 0 and exited_after < 10
        # precisely: the in-flight request is ANSWERED 503 (not a dropped connection)
        assert "error" not in result, result.get("error")
        assert result["reply"].status_code == 503 and "shutting down" in result["reply"].json()["detail"]
        time.sleep(0.2)
        log = "".join(server.lines)
        assert '"POST /infer/ HTTP/1.1" 400' in log and '"POST /infer/ HTTP/1.1" 503' in log  # the access log
        assert "refused /infer/ with 400" in log and "request_config.top_p" in log  # and the reason
    finally:
        server.kill()


def test_a_rendezvous_without_learner_listens_on_loopback_only_and_never_blocks_infer(tiny_model_dir, dataset,
                                                                                       records):
    cap = 4.0
    server = Server(str(tiny_model_dir), str(dataset.root), "0", "4096", str(cap))
    try:
        group_port = free_port()
        reply = httpx.post(f"{server.url}/init_communicator/", timeout=10,
                           json={"host": "127.0.0.1", "port": group_port, "world_size": 2, "timeout_s": 1e9})
        assert reply.status_code == 200, reply.text
        assert reply.json()["timeout_s"] == cap  # the client's timeout, clamped to the server's cap
        listening = listening_addresses(server.process.pid)
        assert ("127.0.0.1", group_port) in listening  # the rendezvous is open ...
        assert all(ipaddress.ip_address(a).is_loopback for a, _ in listening), listening  # ... on loopback only
        again = httpx.post(f"{server.url}/init_communicator/", timeout=10,
                           json={"host": "127.0.0.1", "port": free_port(), "world_size": 2})
        assert again.status_code == 409 and "already waiting" in again.json()["detail"]

        started = time.monotonic()
        answer = httpx.post(f"{server.url}/infer/", json={"infer_requests": [wire_request(records[0])]}, timeout=5)
        assert answer.status_code == 200 and time.monotonic() - started < 5  # inference does not wait for it
        assert httpx.get(f"{server.url}/coordexp/sync_status/", timeout=5).json()["communicator"] == "initializing"

        deadline = time.monotonic() + cap + 15
        status = {}
        while time.monotonic() < deadline:
            status = httpx.get(f"{server.url}/coordexp/sync_status/", timeout=5).json()
            if status["communicator"] != "initializing":
                break
            time.sleep(0.5)
        assert status["communicator"] == "broken" and "could not form the group" in status["last_error"]
        assert all(port != group_port for _, port in listening_addresses(server.process.pid))  # listener closed
        assert httpx.post(f"{server.url}/close_communicator/", timeout=5).status_code == 200
        retry = httpx.post(f"{server.url}/init_communicator/", timeout=10,
                           json={"host": "127.0.0.1", "port": group_port, "world_size": 2, "timeout_s": 1})
        assert retry.status_code == 200 and retry.json()["timeout_s"] == 1  # the port is free again
        assert p.MESSAGE_INIT == retry.json()["message"]
    finally:
        server.kill()


@pytest.mark.parametrize("args", [["--host", "0.0.0.0"], ["--sync-host", "0.0.0.0"]])
def test_serving_beyond_loopback_without_a_token_refuses_to_start(server_config, args):
    env = {key: value for key, value in os.environ.items() if key != "COORDEXP_SYNC_TOKEN"}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "coordexp.cli.app", "serve-rollout", str(server_config), "--port", "0",
                           "--engine", "hf", *args], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2, done.stderr
    message = " ".join(done.stderr.split())
    assert "--sync-token" in message and "COORDEXP_SYNC_TOKEN" in message and "'0.0.0.0'" in message
    assert "loading" not in message and time.monotonic() - started < 60  # refused before the model loads


def test_sigint_during_a_long_real_generation_exits_cleanly(server_config, tmp_path):
    """Regression (issue 23): SIGINT while the engine generated ended the server by SIGABRT. A real HF engine on the
    tiny model runs one long call (64 sequences x 400 tokens, no repeat guard); SIGINT lands while it is in the
    engine (the scheduler's readiness counter says so): the exit is 0, never an abort."""
    import yaml

    config = yaml.safe_load(server_config.read_text(encoding="utf-8"))
    config.setdefault("rollout_matching", {})["repeat_terminate"] = {"enabled": False}
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([sys.executable, "-m", "coordexp.cli.app", "serve-rollout", str(path), "--port", "0",
                                "--engine", "hf", "--max-batch-seqs", "64", "--log-level", "warning"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    try:
        url = None
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and url is None:
            line = process.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith(READY_PREFIX):
                url = line[len(READY_PREFIX):].strip()
        assert url, "".join(lines)
        threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True).start()
        body = {"infer_requests": [{"messages": [{"role": "user", "content": f"Tell story {k}."}]} for k in range(64)],
                "request_config": {"max_tokens": 400, "temperature": 1.0, "seed": 3}}
        replies: list = []
        threading.Thread(target=lambda: replies.append(httpx.post(f"{url}/infer/", json=body, timeout=600)),
                         daemon=True).start()
        status: dict = {}
        deadline = time.monotonic() + 120  # a readiness wait: the call is accepted and being generated
        while time.monotonic() < deadline and not status.get("waiting_jobs") and not replies:
            status = httpx.get(f"{url}/coordexp/batch_status/", timeout=10).json()
            time.sleep(0.05)
        assert status.get("waiting_jobs") == 1 and status["jobs_done"] == 0, (status, replies and replies[0].text)
        time.sleep(0.5)  # well inside the engine call (64 x 400 tokens takes tens of seconds on CPU)
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=60)
        assert code in (0, -signal.SIGINT, 128 + signal.SIGINT), (code, "".join(lines)[-3000:])
    finally:
        if process.poll() is None:
            process.kill()
