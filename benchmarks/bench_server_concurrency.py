"""Rollout-server throughput under concurrent learner ranks, and weight-push time to several servers (issue 22).

Run: ``.venv-test/bin/python benchmarks/bench_server_concurrency.py [--prompts 32] [--new-tokens 32] [--repeats 3]``
(``--quick``: a tiny budget, for the test suite).

1. Concurrency: a REAL ``coordexp serve-rollout --engine vllm`` process (vLLM's CPU build on the tiny offline
   Qwen2-VL model, greedy) on 127.0.0.1. W = 1, 2, 4 concurrent clients (threads, each with its own
   :class:`~coordexp.runtime.rollout.client.RolloutServerClient`, as W learner ranks would) together ask for the
   same N prompts, each one ``/infer/`` with its contiguous share; W = 1 is one client asking for all N. Printed per
   W: generated tokens, the median wall time from a common start to the last reply, tokens/s and its ratio to
   W = 1 (the goal: W = 4 within 10 % of one client, i.e. the server batches concurrent ranks into one engine
   call), and whether every W returned the same tokens as W = 1.
2. Weight push: the tiny policy's full weights pushed by the learner's real path (``VllmServerBackend.sync_weights``
   -> :class:`~coordexp.runtime.rollout.vllm_server.ServerWeightChannel`, gloo over loopback) to 1 and to 3 such
   servers; median seconds per push after a warm-up push that opens the groups, and the 3/1 ratio (goal <= 1.5);
   the 3 servers also pushed one after another (``max_parallel_pushes = 1``, each server its own export, as before
   parallel pushes) for comparison.

The last line is ``concurrency ratio W=4: X``. On a small CPU box the server and the clients share the cores, so
the figures say how the server schedules concurrent calls, not what a GPU server reaches.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1"}
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "num_beams": 1, "repetition_penalty": 1.0}
WIDTHS = (1, 2, 4)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class VllmServer:
    """``coordexp serve-rollout CFG --engine vllm`` on a free loopback port, in its own process group."""

    def __init__(self, config: Path, log: Path):
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with open(log, "wb") as sink:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "coordexp", "serve-rollout", str(config), "--engine", "vllm", "--port",
                 str(self.port), "--log-level", "warning", "--no-access-log"],
                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT,
                env={**os.environ, **VLLM_ENV})

    def wait_healthy(self, timeout_s: float = 900.0) -> None:
        from coordexp.runtime.rollout.client import RolloutServerClient, ServerError

        try:
            RolloutServerClient(self.base_url, timeout_s=timeout_s).wait_until_healthy()
        except ServerError:
            self.close()
            raise RuntimeError(f"serve-rollout did not start:\n{self.log.read_text(errors='replace')[-3000:]}")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def _start(config: Path, tmp: Path, count: int, first: int) -> list[VllmServer]:
    servers = [VllmServer(config, tmp / f"server{first + k}.log") for k in range(count)]
    try:
        for server in servers:
            server.wait_healthy()
    except BaseException:
        for server in servers:
            server.close()
        raise
    return servers


def run_concurrency(url: str, bodies: list[dict], *, new_tokens: int, repeats: int) -> dict:
    """Per W: tokens, median seconds, tokens/s, ratio to W = 1, and equality of the tokens with W = 1."""
    from coordexp.runtime.rollout.client import RolloutServerClient
    from coordexp.runtime.rollout.protocol import item_to_rollout_output, parse_infer_response
    from coordexp.runtime.rollout.vllm_server import request_config_for
    from coordexp.schema.rollout import DecodingConfig

    decoding = DecodingConfig(**GREEDY)
    n = len(bodies)

    def once(width: int) -> tuple[float, list[tuple[int, ...]]]:
        bounds = [(k * n // width, (k + 1) * n // width) for k in range(width)]
        clients = [RolloutServerClient(url, timeout_s=120, infer_timeout_s=900) for _ in range(width)]
        start = threading.Barrier(width + 1, timeout=300)

        def ask(k: int) -> list[tuple[int, ...]]:
            a, b = bounds[k]
            clients[k].request("GET", "health", timeout=30)  # connect first: the timed part is the /infer/ only
            start.wait()
            body = clients[k].infer(bodies[a:b], request_config_for(decoding, new_tokens, 1000 + a))
            return [item_to_rollout_output(item).response_token_ids
                    for item in parse_infer_response(body, expected=b - a)]

        with ThreadPoolExecutor(max_workers=width) as pool:
            futures = [pool.submit(ask, k) for k in range(width)]
            start.wait()
            began = time.perf_counter()
            ids = [tokens for future in futures for tokens in future.result()]
            seconds = time.perf_counter() - began
        for client in clients:
            client.close()
        return seconds, ids

    once(1)  # warm-up: first compilation and caches
    times: dict[int, list[float]] = {w: [] for w in WIDTHS}
    outputs: dict[int, list] = {}
    for _ in range(repeats):  # interleaved, so machine noise is shared
        for width in WIDTHS:
            seconds, ids = once(width)
            times[width].append(seconds)
            outputs[width] = ids
    result: dict[str, dict] = {}
    for width in WIDTHS:
        tokens = sum(len(ids) for ids in outputs[width])
        seconds = statistics.median(times[width])
        result[str(width)] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                              "same_tokens_as_w1": outputs[width] == outputs[1]}
    for figures in result.values():
        figures["ratio"] = figures["tokens_per_s"] / result["1"]["tokens_per_s"]
    return result


def run_push(servers: list[VllmServer], model_dir: Path, *, repeats: int) -> dict:
    """Median seconds of a full-weight push to 1 and to 3 servers (after a warm-up push that opens each group),
    and to the 3 one after another."""
    import torch
    from transformers import AutoModelForImageTextToText

    from coordexp.runtime.rollout.client import RolloutServerClient
    from coordexp.runtime.rollout.vllm_server import ServerWeightChannel, VllmServerBackend
    from coordexp.runtime.rollout.weight_export import named_tensors
    from coordexp.schema.rollout import DecodingConfig

    policy = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    size = sum(t.numel() * t.element_size() for _, t in named_tensors(policy))
    channel = ServerWeightChannel(timeout_s=300)  # one channel: each server keeps its group across both backends
    clients = [RolloutServerClient(s.base_url, group_port=_free_port(), timeout_s=300) for s in servers]
    backends = {count: VllmServerBackend(clients[:count], decode_batch_size=1, max_new_tokens=8,
                                         decoding=DecodingConfig(**GREEDY), weight_pusher=channel,
                                         topology=lambda: (0, 1)) for count in (1, len(clients))}
    backends[-1] = VllmServerBackend(clients, decode_batch_size=1, max_new_tokens=8, decoding=DecodingConfig(**GREEDY),
                                     weight_pusher=channel, topology=lambda: (0, 1))
    backends[-1].max_parallel_pushes = 1  # key -1: the same servers, one after another
    first = next(policy.parameters())

    def push(count: int) -> float:
        with torch.no_grad():
            first.add_(0.0)  # a new parameter version: the backend pushes (the values stay the same)
        began = time.perf_counter()
        backends[count].sync_weights(policy)
        return time.perf_counter() - began

    warmup = {count: push(count) for count in backends}
    times: dict[int, list[float]] = {count: [] for count in backends}
    for _ in range(repeats):
        for count in backends:
            times[count].append(push(count))
    for backend in backends.values():
        backend.close()
    medians = {str(count): statistics.median(values) for count, values in times.items() if count > 0}
    sequential = statistics.median(times[-1])
    return {"megabytes": size / 1e6, "seconds": medians, "sequential_seconds": sequential,
            "warmup_seconds": {str(c): s for c, s in warmup.items() if c > 0},
            "ratio": medians[str(len(clients))] / medians["1"], "sequential_ratio": sequential / medians["1"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32, help="N: prompts asked for in each measurement")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per W (and pushes per server count)")
    parser.add_argument("--push-servers", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a tiny budget (the test suite's smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.new_tokens, args.repeats = 8, 8, 1
    if args.prompts < max(WIDTHS) or args.push_servers < 2:
        parser.error(f"--prompts must be >= {max(WIDTHS)} and --push-servers >= 2")

    from coordexp.runtime.model.data import load_records
    from coordexp.runtime.rollout.base import RolloutRequest
    from coordexp.runtime.rollout.vllm_server import infer_request_for
    from coordexp.runtime.toy.synthetic import write_synthetic_dataset
    from coordexp.runtime.toy.tiny_model import build_tiny_model
    from coordexp.schema.contract import load_contract

    summary: dict = {"prompts": args.prompts, "new_tokens": args.new_tokens, "repeats": args.repeats,
                     "cores": len(os.sched_getaffinity(0))}
    with tempfile.TemporaryDirectory(prefix="bench_server_conc_") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = build_tiny_model(tmp / "model", seed=0)
        data = write_synthetic_dataset(tmp / "data", n_train=args.prompts, n_val=0, seed=1)
        config = tmp / "server.yaml"
        config.write_text(yaml.safe_dump({
            "extends": str(ROOT / "examples" / "stage2_cpu_hf.yaml"), "global_max_length": 1024,
            "model": {"path": str(model_dir), "dtype": "float32", "attn_implementation": "sdpa"},
            "data": {"train_jsonl": str(data.train_jsonl), "val_jsonl": None},
            "training": {"output_dir": str(tmp / "run")},
            "rollout_matching": {"rollout_backend": "vllm", "decode_batch_size": 4, "max_new_tokens": args.new_tokens,
                                 "decoding": GREEDY, "repeat_terminate": {"enabled": False},
                                 "vllm": {"mode": "colocate", "tensor_parallel_size": 1, "max_model_len": 1024}},
        }), encoding="utf-8")
        run = load_contract(config)
        records = load_records(run.data.train_jsonl, run.data.image_root)[:args.prompts]
        bodies = [infer_request_for(RolloutRequest(None, i, 1000 + i, r), run.template) for i, r in enumerate(records)]
        started = time.perf_counter()
        servers = _start(config, tmp, 1, 0)
        try:
            summary["server_start_s"] = time.perf_counter() - started
            concurrency = run_concurrency(servers[0].base_url, bodies, new_tokens=args.new_tokens,
                                          repeats=args.repeats)
            summary["concurrency"] = concurrency
            servers += _start(config, tmp, args.push_servers - 1, 1)
            summary["push"] = run_push(servers, model_dir, repeats=args.repeats)
        finally:
            for server in servers:
                server.close()

    print(f"\nConcurrent clients against one serve-rollout --engine vllm (CPU, tiny model, {args.prompts} prompts, "
          f"up to {args.new_tokens} new tokens, greedy, median of {args.repeats}, {summary['cores']} cores)")
    print(f"  {'W':>2} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'vs W=1':>7}  same tokens")
    for width, figures in concurrency.items():
        print(f"  {width:>2} {figures['tokens']:>7} {figures['seconds']:>8.3f} {figures['tokens_per_s']:>8.1f} "
              f"{figures['ratio']:>7.2f}  {figures['same_tokens_as_w1']}")
    push = summary["push"]
    many = str(args.push_servers)
    print(f"\nFull weight push ({push['megabytes']:.1f} MB, gloo over loopback, median of {args.repeats}): "
          f"1 server {push['seconds']['1']:.3f} s, {many} servers {push['seconds'][many]:.3f} s, "
          f"ratio {push['ratio']:.2f} (goal <= 1.5); one after another {push['sequential_seconds']:.3f} s, ratio "
          f"{push['sequential_ratio']:.2f}")
    print("\nJSON " + json.dumps(summary))
    print(f"concurrency ratio W=4: {concurrency['4']['ratio']:.2f}")


if __name__ == "__main__":
    main()
