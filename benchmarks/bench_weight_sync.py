"""Server-mode costs: weight-sync throughput over gloo on loopback, and the HTTP /infer/ overhead of a server.

Run: ``.venv-test/bin/python benchmarks/bench_weight_sync.py [--sizes-gb 0.1 0.25 0.5 1.0] [--reps 5]``

1. Weight sync: a receiver process (:class:`~coordexp.runtime.rollout.weight_sync.WeightSyncReceiver`, rank 0) and this
   process as the sender (last rank), fp32 parameter sets of the given sizes exported by
   :func:`~coordexp.runtime.rollout.weight_export.named_tensors` in 512 MiB single-dtype buckets.
   Printed: GB/s of ``send_full`` (broadcast + the receiver's verdict), best of 3.
2. /infer/ overhead: ``coordexp serve-rollout --engine hf`` on 127.0.0.1 with the tiny offline model versus the
   same HF generate in-process, greedy, ``decode_batch_size`` 8 (8 requests per call). Printed: median latency
   of each and the added latency (target: under 10%). With a tiny model the fixed HTTP + JSON + image-path cost is
   a LARGER share than with a real model, so this is an upper bound.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _receiver(port: int, queue, done) -> None:
    from coordexp.runtime.rollout.weight_sync import WeightSyncReceiver

    receiver = WeightSyncReceiver(timeout_s=120, backend="gloo")
    receiver.init("127.0.0.1", port, 2, 0)
    while True:
        metadatas = queue.get()
        if metadatas is None:
            break
        receiver.receive(metadatas, lambda named: None)
    receiver.close()
    done.set()


def bench_sync(sizes_gb: list[float]) -> None:
    import torch

    from coordexp.runtime.rollout.weight_export import named_tensors
    from coordexp.runtime.rollout.weight_sync import WeightSyncSender

    ctx = mp.get_context("spawn")
    for size in sizes_gb:
        numel = int(size * 1e9 / 4)
        per = numel // 16
        # a stand-in policy: 16 fp32 parameters, exported exactly like the training policy is
        policy = torch.nn.ParameterDict({f"layer{i}": torch.nn.Parameter(torch.randn(per)) for i in range(16)})
        port = _free_port()
        queue, done = ctx.Queue(), ctx.Event()
        proc = ctx.Process(target=_receiver, args=(port, queue, done), daemon=True)
        proc.start()
        sender = WeightSyncSender(timeout_s=120, backend="gloo")
        sender.init("127.0.0.1", port, 2)
        rates = []
        for _ in range(3):
            report = sender.send_full(named_tensors(policy), announce=queue.put)
            rates.append(report.gb_per_s)
        queue.put(None)
        done.wait(60)
        sender.close()
        proc.join(30)
        print(f"weight sync gloo loopback  {report.bytes / 1e9:5.2f} GB in {report.buckets} bucket(s): "
              f"best {max(rates):5.2f} GB/s, median {statistics.median(rates):5.2f} GB/s")
        del policy


def bench_infer(reps: int) -> None:
    import torch

    from coordexp.runtime.rollout.base import RolloutRequest
    from coordexp.runtime.rollout.hf import HfRolloutBackend
    from coordexp.runtime.rollout.vllm_server import VllmServerBackend
    from coordexp.runtime.model.data import load_records
    from coordexp.runtime.model.encoding import encode_prompt, load_processor
    from coordexp.runtime.rollout.client import RolloutServerClient
    from coordexp.runtime.toy.synthetic import write_synthetic_dataset
    from coordexp.runtime.toy.tiny_model import build_tiny_model
    from coordexp.schema.contract import load_contract

    tmp = Path(tempfile.mkdtemp(prefix="bench_sync_"))
    model_dir = build_tiny_model(tmp / "model", family="qwen2_vl", seed=0)
    data = write_synthetic_dataset(tmp / "data", n_train=8, n_val=1, seed=1)
    port, group_port = _free_port(), _free_port()
    decoding = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "num_beams": 1, "repetition_penalty": 1.0}
    config = {"extends": str(ROOT / "examples" / "stage2_cpu_hf.yaml"),
              "model": {"path": str(model_dir), "dtype": "float32", "attn_implementation": "sdpa"},
              "data": {"train_jsonl": str(data.train_jsonl), "val_jsonl": None},
              "training": {"output_dir": str(tmp / "run")},
              "rollout_matching": {"rollout_backend": "vllm", "decode_batch_size": 8, "max_new_tokens": 32,
                                   "decoding": decoding, "repeat_terminate": {"enabled": False},
                                   "vllm": {"mode": "server", "server": {
                                       "servers": [{"base_url": f"http://127.0.0.1:{port}", "group_port": group_port}],
                                       "timeout_s": 120}}}}
    cfg = tmp / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(config), encoding="utf-8")
    server = subprocess.Popen([sys.executable, "-m", "coordexp", "serve-rollout", str(cfg), "--engine", "hf",
                               "--port", str(port), "--log-level", "warning"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        RolloutServerClient(f"http://127.0.0.1:{port}", timeout_s=120).wait_until_healthy()
        run = load_contract(cfg)
        processor = load_processor(run.model.path)
        records = load_records(run.data.train_jsonl, run.data.image_root)[:8]
        requests = [RolloutRequest(encode_prompt(processor, r, run.template), i, 100 + i, r)
                    for i, r in enumerate(records)]
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(run.model.path, torch_dtype=torch.float32).eval()
        rollout = run.rollout_matching
        local = HfRolloutBackend(model, processor.tokenizer, decode_batch_size=8, max_new_tokens=32,
                                 decoding=rollout.decoding, repeat_terminate=rollout.repeat_terminate)
        remote = VllmServerBackend.from_run(run, None, processor)

        def timed(backend, encode: bool) -> list[float]:
            backend.generate(requests)  # warm-up
            out = []
            for _ in range(reps):
                start = time.perf_counter()
                if encode:  # the server loads the images and encodes the prompts itself: count it in-process too
                    batch = [RolloutRequest(encode_prompt(processor, r, run.template), i, 100 + i, r)
                             for i, r in enumerate(records)]
                else:
                    batch = requests
                backend.generate(batch)
                out.append(time.perf_counter() - start)
            return out

        in_process, served = [], []
        for _ in range(2):  # interleave to share any machine noise
            in_process += timed(local, True)
            served += timed(remote, False)
        a, b = statistics.median(in_process), statistics.median(served)
        print(f"/infer/ decode_batch_size 8, 8 requests, 32 new tokens max: in-process {a * 1e3:7.1f} ms, "
              f"server {b * 1e3:7.1f} ms, added {100 * (b - a) / a:+5.1f}% (target < 10%)")
        remote.close()
        bench_infer_logprobs(f"http://127.0.0.1:{port}", records, run.template, reps)
    finally:
        server.terminate()
        server.wait(30)


def bench_infer_logprobs(url: str, records, template, reps: int) -> None:
    """``POST /infer/`` as swift's GRPO trainer sends it (``logprobs: true``) against the same body without."""
    import base64

    import httpx

    from coordexp.runtime.model.encoding import build_messages

    requests = [{"messages": build_messages(r, template),
                 "images": [base64.b64encode(path.read_bytes()).decode() for path in r.image_paths]} for r in records]

    def body(**extra) -> dict:
        return {"infer_requests": requests, "request_config": {"max_tokens": 32, "temperature": 0.0,
                                                               "return_details": True, **extra}}

    def timed(payload: dict) -> float:
        start = time.perf_counter()
        httpx.post(f"{url}/infer/", json=payload, timeout=300).raise_for_status()
        return time.perf_counter() - start

    timed(body(logprobs=True))  # warm-up
    plain, with_logprobs = [], []
    for _ in range(reps):  # interleaved
        plain.append(timed(body()))
        with_logprobs.append(timed(body(logprobs=True, top_logprobs=5)))
    a, b = statistics.median(plain), statistics.median(with_logprobs)
    print(f"/infer/ {len(requests)} requests, 32 new tokens max: without logprobs {a * 1e3:7.1f} ms, with logprobs "
          f"(top_logprobs 5) {b * 1e3:7.1f} ms, added {100 * (b - a) / a:+5.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=[0.1, 0.25, 0.5, 1.0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--skip-infer", action="store_true")
    args = parser.parse_args()
    bench_sync(args.sizes_gb)
    if not args.skip_infer:
        bench_infer(args.reps)


if __name__ == "__main__":
    main()
