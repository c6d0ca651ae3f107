"""The weight-sync token comes from rollout_matching.vllm.server.sync_token (COORDEXP_SYNC_TOKEN as fallback), reaches
the servers as a Bearer header, and is never printed; the configured /infer/ timeout fires on a silent server."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml
from typer.testing import CliRunner

from coordexp.runtime.rollout.client import ServerTimeoutError
from coordexp.runtime.rollout.vllm_server import VllmServerBackend, clients_for
from coordexp.schema.contract import build_contract
from coordexp.schema.loader import validate_mapping

from testkit import server_rollout

TOKEN = "tok-3f9a7c1e55d2b8"  # a value that appears nowhere else


class HeaderServer:
    """Answers like a rollout server and records each request's Authorization header by path."""

    def __init__(self):
        self.auth: list[tuple[str, str | None]] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"null")
                path = self.path.strip("/")
                recorder.auth.append((path, self.headers.get("Authorization")))
                payload = {"world_size": 1} if path == "get_world_size" else {"status": "ok"}
                if path == "infer":
                    payload = [{"response": None}] * len(body["infer_requests"])
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _handle

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def contract_for(stage2_config, url: str, **server):
    stage2_config["rollout_matching"].update(server_rollout([(url, 51299)], server=server))
    report = validate_mapping(stage2_config)
    assert report.ok, [i.render() for i in report.errors]
    return report.config, build_contract(report.config)


@pytest.fixture
def header_server():
    running = HeaderServer()
    yield running
    running.close()


@pytest.mark.parametrize("configured, env, sent", [
    (TOKEN, "env-token-000000", TOKEN),  # the config wins
    (None, "env-token-000000", "env-token-000000"),  # the environment is the fallback
    (None, None, None),
])
def test_the_token_reaches_the_server_from_config_or_environment(stage2_config, header_server, monkeypatch,
                                                                  configured, env, sent):
    if env is None:
        monkeypatch.delenv("COORDEXP_SYNC_TOKEN", raising=False)
    else:
        monkeypatch.setenv("COORDEXP_SYNC_TOKEN", env)
    _, run = contract_for(stage2_config, header_server.base_url,
                          **({"sync_token": configured} if configured else {}))
    (client,) = clients_for(run.rollout_matching.backend)
    monkeypatch.setenv("COORDEXP_SYNC_TOKEN", "changed-later-0000")  # read once, when the client is made
    client.reset_prefix_cache()
    client.update_flattened_params([])
    expected = None if sent is None else f"Bearer {sent}"
    assert header_server.auth == [("reset_prefix_cache", expected), ("update_flattened_params", expected)]


def test_the_token_is_never_printed(stage2_config, header_server, tmp_path, caplog, monkeypatch):
    monkeypatch.delenv("COORDEXP_SYNC_TOKEN", raising=False)
    config, run = contract_for(stage2_config, header_server.base_url, sync_token=TOKEN)
    assert run.rollout_matching.backend.sync_token.get_secret_value() == TOKEN
    shown = [repr(config), str(config), repr(run), json.dumps(run.to_dict()), config.model_dump_json()]
    assert all(TOKEN not in text for text in shown)

    from coordexp.cli.app import app

    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(stage2_config), encoding="utf-8")
    for flags in (["--print-contract"], ["--print-contract", "--json"]):
        result = CliRunner().invoke(app, ["validate", str(path), *flags])
        assert result.exit_code == 0, result.output
        assert "sync_token" in result.output and TOKEN not in result.output

    caplog.set_level(logging.DEBUG)
    backend = VllmServerBackend(clients_for(run.rollout_matching.backend), decode_batch_size=1, max_new_tokens=4,
                                decoding=run.rollout_matching.decoding, topology=lambda: (0, 1),
                                weight_pusher=lambda client, model, mode: client.update_flattened_params([]))
    backend.sync_weights(__import__("torch").nn.Linear(2, 2))
    backend.close()
    assert ("update_flattened_params", f"Bearer {TOKEN}") in header_server.auth
    assert caplog.records and TOKEN not in caplog.text


@pytest.mark.parametrize("bad", ["short7x", "has space inside", "tab\tinside-1234"])
def test_a_malformed_token_is_refused_without_showing_it(stage2_config, bad):
    stage2_config["rollout_matching"].update(server_rollout([("http://127.0.0.1:1", 51299)],
                                                            server={"sync_token": bad}))
    report = validate_mapping(stage2_config)
    assert not report.ok
    rendered = "\n".join(i.render() for i in report.errors)
    assert "sync_token" in rendered and "8 printable" in rendered and bad not in rendered


def test_the_configured_infer_timeout_fires_on_a_server_that_never_answers(stage2_config):
    """A socket that accepts and never replies: /infer/ fails within the configured timeout, sent once."""
    accepted: list[socket.socket] = []
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)

        def accept():
            while True:
                try:
                    accepted.append(listener.accept()[0])
                except OSError:
                    return

        threading.Thread(target=accept, daemon=True).start()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        _, run = contract_for(stage2_config, url, infer_timeout_s=0.5)
        (client,) = clients_for(run.rollout_matching.backend)
        assert client.infer_timeout_s == 0.5
        started = time.monotonic()
        with pytest.raises(ServerTimeoutError, match=r"/infer/ did not answer within 0.5 s"):
            client.infer([{"messages": []}], {"seed": 1})
        assert time.monotonic() - started < 60  # generous: a loaded box; without a timeout it never returns
        assert len(accepted) == 1  # a timed-out call is not sent again
    for sock in accepted:
        sock.close()
