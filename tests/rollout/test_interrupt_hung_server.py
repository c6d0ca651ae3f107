"""Ctrl-C during a hung generation ends ``coordexp train`` promptly with exit 130 (docs/design.md, decision 14).

A real ``coordexp serve-rollout --engine hf`` process sits behind a loopback HTTP proxy. Once training runs, the proxy
stops answering ``/infer/`` (the request is accepted and never answered, like a wedged server) while everything
else still passes. With overlap on, a rollout is always in flight on a background thread, so before the fix SIGINT
left ``train()`` waiting for that generation until its HTTP timeout, and interpreter exit joined the worker threads.
"""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest

from testkit import ServeRolloutProcess, free_port, server_rollout

pytestmark = pytest.mark.slow

SINGLE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
INFER_TIMEOUT_S = 400.0  # far longer than the exit bound below: an exit within it was not a timeout
# `python -m coordexp` with SIGINT handled as at a terminal: a test runner started as a background job ignores SIGINT,
# and its children inherit that (CI ran this test so and the learner never saw the Ctrl-C)
AT_A_TERMINAL = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                 "sys.argv[0] = 'coordexp'; runpy.run_module('coordexp', run_name='__main__')")
EXIT_BOUND_S = 90.0  # generous for a loaded 2-core box; the old code waited for the whole INFER_TIMEOUT_S


class HangingProxy:
    """Forwards every request to ``upstream``; after :meth:`hang_infer`, ``/infer/`` requests are held unanswered
    (``held`` is set when the first one arrives)."""

    def __init__(self, upstream: str):
        target = urlsplit(upstream)
        self.hanging = threading.Event()
        self.held = threading.Event()
        self.release = threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _forward(self, method: str) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if proxy.hanging.is_set() and self.path.startswith("/infer/"):
                    proxy.held.set()
                    proxy.release.wait()
                    self.close_connection = True
                    return
                connection = http.client.HTTPConnection(target.hostname, target.port, timeout=600)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                connection.request(method, self.path, body=body or None, headers=headers)
                reply = connection.getresponse()
                data = reply.read()
                self.send_response(reply.status)
                for key, value in reply.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                connection.close()

            def do_GET(self):
                self._forward("GET")

            def do_POST(self):
                self._forward("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def hang_infer(self) -> None:
        self.hanging.set()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()


def test_ctrl_c_during_a_hung_generation_exits_130_promptly(tmp_path, write_config):
    server = ServeRolloutProcess(write_config({"rollout_matching": {"decode_batch_size": 2, "max_new_tokens": 8}},
                                              name="server.yaml"), tmp_path / "server.log", env=SINGLE_THREAD)
    proxy = None
    train = None
    try:
        server.wait_healthy()
        proxy = HangingProxy(server.base_url)
        rollout = server_rollout([(proxy.base_url, free_port())], decode_batch_size=2, max_new_tokens=8,
                                 server={"timeout_s": 60.0, "infer_timeout_s": INFER_TIMEOUT_S},
                                 overlap={"enabled": True})
        config = write_config({"training": {"output_dir": str(tmp_path / "run"), "max_steps": 200, "save_steps": 1000,
                                            "logging_steps": 1, "per_device_train_batch_size": 2, "packing": False},
                               "global_max_length": 1024, "rollout_matching": rollout}, name="learner.yaml")
        log = (tmp_path / "train.log").open("w")
        train = subprocess.Popen([sys.executable, "-c", AT_A_TERMINAL, "train", str(config)], stdout=log,
                                 stderr=subprocess.STDOUT, env={**os.environ, **SINGLE_THREAD})
        run_log = tmp_path / "run" / "run_metadata.jsonl"
        # readiness: training has rolled out through the proxy (a train rollout is logged) ...
        for _ in range(600):
            if run_log.is_file() and '"tag": "train"' in run_log.read_text():
                break
            assert train.poll() is None, (tmp_path / "train.log").read_text()[-3000:]
            threading.Event().wait(0.5)
        else:
            pytest.fail("training never logged a rollout")
        proxy.hang_infer()
        # ... and the next /infer/ is now held unanswered
        assert proxy.held.wait(300), "the learner never sent another /infer/"
        train.send_signal(signal.SIGINT)
        try:
            code = train.wait(timeout=EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"coordexp train was still running {EXIT_BOUND_S:.0f} s after Ctrl-C with a hung /infer/; "
                        f"its log ends:\n{(tmp_path / 'train.log').read_text()[-3000:]}")
        output = (tmp_path / "train.log").read_text()
        assert code == 130, output[-3000:]
        assert "interrupted" in output and "Traceback" not in output
    finally:
        if train is not None and train.poll() is None:
            train.kill()
        if proxy is not None:
            proxy.close()
        server.kill()
