"""Test helpers shared by several folders: stub rollout servers (stdlib http.server on 127.0.0.1, in a thread),
a free loopback port, and the server-mode rollout override. Importable as ``testkit`` (pytest's pythonpath)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable



def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def send_json(handler: BaseHTTPRequestHandler, status: int, payload: object) -> None:
    """Answer an ``http.server`` request with ``payload`` (JSON-encoded unless already bytes) and its length."""
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class StubServer:
    """``behaviour[path]`` maps a request (method, path, JSON body) to (status, body bytes) or a callable action.
    Every received call is recorded in ``calls`` as (method, path, body)."""

    def __init__(self, world_size: int = 1):
        self.calls: list[tuple[str, str, object]] = []
        self.behaviour: dict[str, Callable] = {}
        self.world_size = world_size
        self.release = threading.Event()  # set to free a hung handler at teardown
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def _handle(self, method):
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                stub.calls.append((method, self.path, body))
                action = stub.behaviour.get(self.path) or stub.default
                result = action(self, body)
                if result is None:
                    return
                send_json(self, *result)

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def default(self, handler, body):
        path = handler.path
        if path == "/health/":
            return 200, {"status": "ok"}
        if path == "/get_world_size/":
            return 200, {"world_size": self.world_size}
        if path == "/get_engine_type/":
            return 200, {"engine_type": "LLMEngine", "enable_multi_turn": False, "use_gym_env": False,
                         "enable_lora": False}
        if path == "/infer/":
            seed = body["request_config"].get("seed")
            return 200, [echo_output(r, seed + j if seed else None) for j, r in enumerate(body["infer_requests"])]
        return 200, {"message": "ok"}

    def hang(self, handler, body):
        self.release.wait(30)
        return None

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def echo_output(request: dict, seed: int | None) -> dict:
    """A RolloutOutput whose token ids encode the request's tag (data_dict.tag) and the seed it got."""
    tag = int(request.get("data_dict", {}).get("tag", 0))
    token_ids = [tag, seed or 0, 2]
    return {"response": {"model": "stub", "object": "chat.completion", "id": "x", "created": 0,
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": "t"},
                                      "finish_reason": "stop", "logprobs": None, "token_ids": token_ids}],
                         "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4},
                         "prompt_token_ids": [7, 7, tag]},
            "messages": None, "response_token_ids": [], "response_loss_mask": [], "rollout_infos": {}}


@contextmanager
def stub_server(world_size: int = 1):
    with StubServer(world_size) as server:
        yield server

def server_rollout(servers: list[tuple[str, int]], **extra) -> dict:
    """A rollout_matching override for vLLM server mode with the given (base_url, group_port) servers."""
    server = {"servers": [{"base_url": u, "group_port": p} for u, p in servers], "timeout_s": 5.0,
              "infer_timeout_s": None}
    server.update(extra.pop("server", {}))
    return {"rollout_backend": "vllm", "vllm": {"mode": "server", "sync": {"mode": "full", "fallback_to_full": True},
                                                "server": server, **extra.pop("vllm", {})}, **extra}


REPO = Path(__file__).resolve().parents[1]

# A minimal valid stage-2 config (tests deep-copy it: the stage2_config fixture, the schema tests).
STAGE2_CONFIG = {
    "global_max_length": 2048,
    "model": {"path": "Qwen/Qwen2.5-VL-3B-Instruct"},
    "data": {"train_jsonl": "data/train.jsonl"},
    "training": {"output_dir": "runs/test"},
    "custom": {"trainer_variant": "stage2_rollout_aligned"},
    "rollout_matching": {
        "pipeline": {
            "objective": [
                {
                    "name": "token_ce",
                    "enabled": True,
                    "weight": 1.0,
                    "channels": ["B"],
                    "config": {"rollout_fn_desc_weight": 0.0, "rollout_matched_prefix_struct_weight": 0.0},
                },
                {
                    "name": "coord_reg",
                    "enabled": True,
                    "weight": 1.0,
                    "channels": ["B"],
                    "config": {
                        "coord_ce_weight": 0.0,
                        "soft_ce_weight": 1.0,
                        "w1_weight": 1.0,
                        "coord_gate_weight": 1.0,
                        "text_gate_weight": 0.0,
                        "temperature": 1.0,
                        "target_sigma": 2.0,
                        "target_truncate": None,
                    },
                },
                {
                    "name": "bbox_geo",
                    "enabled": True,
                    "weight": 0.5,
                    "channels": ["A", "B"],
                    "config": {"smoothl1_weight": 1.0, "ciou_weight": 1.0},
                },
            ],
            "diagnostics": [{"name": "coord_diag", "enabled": True, "weight": 0.0, "channels": ["B"], "config": {}}],
        }
    },
}


# ms-swift rebinds transformers.trainer's callback globals when imported (swift/trainers/callback.py sets
# PrinterCallback, DEFAULT_CALLBACKS and DEFAULT_PROGRESS_CALLBACK to its own classes, which read swift-only
# TrainingArguments fields): every later coordexp training run in the same pytest process would then crash.
_MODULES_SWIFT_PATCHES = ("transformers.trainer", "transformers.trainer_callback", "transformers.modeling_utils")


def import_swift(*names: str) -> list:
    """Import ms-swift modules for the interop tests and undo what their import rebinds in transformers, so the
    rest of the session trains with transformers' own classes. Raises ImportError like a plain import."""
    import importlib

    modules = [importlib.import_module(name) for name in _MODULES_SWIFT_PATCHES]
    saved = [dict(vars(module)) for module in modules]
    try:
        return [importlib.import_module(name) for name in names]
    finally:
        for module, before in zip(modules, saved):
            for key in [k for k in vars(module) if k not in before]:
                delattr(module, key)
            for key, value in before.items():
                if vars(module).get(key, value) is not value:
                    setattr(module, key, value)


class ServeRolloutProcess:
    """``python -m coordexp serve-rollout CFG --engine ENGINE`` (hf unless told) on a free loopback port, in its own
    process group, its output in ``log`` (shown when it does not come up)."""

    def __init__(self, config: Path, log: Path, env: dict[str, str] | None = None, engine: str = "hf"):
        import os
        import subprocess
        import sys

        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with open(log, "wb") as sink:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "coordexp", "serve-rollout", str(config), "--engine", engine, "--port",
                 str(self.port), "--log-level", "warning"],
                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})})

    def wait_healthy(self, timeout: float = 120.0) -> None:
        from coordexp.runtime.rollout.client import RolloutServerClient, ServerUnreachableError

        try:
            RolloutServerClient(self.base_url, timeout_s=timeout).wait_until_healthy()
        except ServerUnreachableError:
            raise AssertionError(f"server did not start:\n{self.log.read_text(errors='replace')[-3000:]}") from None

    def sync_status(self) -> dict:
        import urllib.request

        with urllib.request.urlopen(f"{self.base_url}/coordexp/sync_status/", timeout=10) as reply:
            return json.loads(reply.read())

    def kill(self) -> None:
        import os
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def hf_greedy_ids(model, processor, requests, run) -> list:
    """Response ids of HF generate on ``model`` for ``requests`` under ``run``'s decoding, guard and token budget:
    the reference a served or pushed policy must equal."""
    from coordexp.runtime.rollout.hf import HfRolloutBackend

    backend = HfRolloutBackend(model, processor.tokenizer, decode_batch_size=2,
                               max_new_tokens=run.rollout_matching.max_new_tokens,
                               decoding=run.rollout_matching.decoding,
                               repeat_terminate=run.rollout_matching.repeat_terminate)
    return [o.response_token_ids for o in backend.generate(requests)]


def perturb_(model, seed: int, scale: float = 0.1) -> None:
    """Add seeded Gaussian noise (std ``scale``) to every parameter in place: a policy that differs from its
    checkpoint, so a weight push must change what an engine serves."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)


def json_leaves(value):
    """Every non-container value of a decoded JSON document, depth first."""
    if isinstance(value, dict):
        for item in value.values():
            yield from json_leaves(item)
    elif isinstance(value, list):
        for item in value:
            yield from json_leaves(item)
    else:
        yield value


def read_until_ready(process: subprocess.Popen, prefix: str, timeout_s: float) -> tuple[str, list[str]]:
    """Read ``process``'s text stdout until a line starts with ``prefix`` (a readiness signal): the rest of that line
    and every line so far, which keeps growing from a daemon thread. Kills the process and fails with its output when
    it exits or stays silent past ``timeout_s``."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith(prefix):
            threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True).start()
            return line[len(prefix):].strip(), lines
    process.kill()
    raise AssertionError("the server did not become ready:\n" + "".join(lines))


SINGLE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def launch_bounded(commands: list[list[str]], guard_s: float) -> list[tuple[int, str]]:
    """Start every command at once (each in its own process group, single-threaded) and return each one's (exit
    code, stdout+stderr); all are killed, and the test fails naming a hang, if one still runs after ``guard_s``."""
    import os
    import signal

    procs = [subprocess.Popen(cmd, env={**os.environ, **SINGLE_THREAD}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True) for cmd in commands]
    results = []
    deadline = time.monotonic() + guard_s
    try:
        for proc in procs:
            output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((proc.returncode, output))
    except subprocess.TimeoutExpired:
        outputs = []
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            outputs.append(proc.communicate(timeout=30)[0][-3000:])
        raise AssertionError(f"a process still ran after {guard_s} s (a hang):\n" + "\n---\n".join(outputs))
    return results


def torchrun_two_agents(target: list[str], per_node: tuple[list[str], list[str]] = ([], []), *,
                        static: bool = False, guard_s: float = 300) -> list[tuple[int, str]]:
    """Two torchrun agents on 127.0.0.1 as two "nodes" (``--nnodes 2 --nproc_per_node 1``) running ``target`` plus
    each node's own arguments: a c10d rendezvous like examples/slurm_2nodes.sbatch, or ``static`` (``--node_rank``
    makes the first agent rank 0). Each agent's (exit code, output)."""
    import sys

    port = free_port()
    commands = []
    for node, extra in enumerate(per_node):
        where = (["--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port)] if static else
                 ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "two-nodes"])
        commands.append([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                         *where, *target, *extra])
    return launch_bounded(commands, guard_s)


DDP_ENTRY = Path(__file__).parent / "e2e" / "ddp_entry.py"


def torchrun_process(entry: Path, config: Path, out_dir: Path, timeout_s: float = 420) -> tuple[int, str, float]:
    """(exit code, stderr, seconds) of a 2-process torchrun of ``entry config out_dir`` (gloo on CPU, one thread per
    rank); the whole process group dies on timeout."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(entry), str(config), str(out_dir)]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env={**os.environ, **SINGLE_THREAD}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=30)
        raise AssertionError(f"torchrun did not finish within {timeout_s} s (deadlock?):\n{stderr[-4000:]}")
    return proc.returncode, stderr, time.monotonic() - start


def torchrun_two_ranks(config: Path, out_dir: Path, timeout_s: float = 420) -> list[dict]:
    """Both ranks' reports (``tests/e2e/ddp_entry.py``) of a 2-process torchrun of ``config``; every rank must end
    with the same whole weights."""
    code, stderr, _ = torchrun_process(DDP_ENTRY, config, out_dir, timeout_s)
    assert code == 0, stderr[-4000:]
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["distributed"] and r["world_size"] == 2 for r in ranks)
    assert ranks[0]["params_sha256"] == ranks[1]["params_sha256"]  # every rank ends with the same whole weights
    return ranks


def rank_shared_logs(logs: list[dict]) -> list[dict]:
    """The logged values every rank shares (all but the wall-clock timings, which are each rank's own)."""
    return [{k: v for k, v in log.items() if not k.startswith("time/") and k != "tokens/trained_per_s"} for log in logs]


def train_in_process(config: Path, out_dir: Path) -> dict:
    """What ``ddp_entry.py`` reports for ``config`` trained in this process (no process group): the one process the
    two-rank runs are compared with."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ddp_entry", DDP_ENTRY)
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    out_dir.mkdir(parents=True, exist_ok=True)
    entry.main(str(config), str(out_dir))
    report = json.loads((out_dir / "rank0.json").read_text())
    # one process: an earlier in-process DeepSpeed test may have left its world-of-1 process group on purpose (see
    # tests/e2e/test_deepspeed_in_process.py), so whether a group exists says nothing here
    assert (report["rank"], report["world_size"]) == (0, 1)
    return report


def assert_ranks_train_like_one_process(single: dict, ranks: list[dict], logged: tuple[str, ...], label: str,
                                        rel: float = 1e-5) -> None:
    """Two ranks' reports against one process's: the same steps, the same shared logs on both ranks (collectives
    called in the same order), the ``logged`` values and every tensor's norm within ``rel``."""
    import pytest

    assert [r["global_step"] for r in ranks] == [single["global_step"]] * 2, label
    assert rank_shared_logs(ranks[0]["logs"]) == rank_shared_logs(ranks[1]["logs"]), label
    for want, have in zip(single["logs"], ranks[0]["logs"], strict=True):
        for key in logged:
            assert have[key] == pytest.approx(want[key], rel=rel, abs=1e-6), (label, key, want["step"])
    assert ranks[0]["param_norms"] == pytest.approx(single["param_norms"], rel=rel, abs=1e-6), label
