"""Actor-learner overlap in server mode, and HF ``generate`` tokens/s with ``rollout_matching.hf_generate`` (issue 14).

Run: ``.venv-test/bin/python benchmarks/bench_rollout_overlap.py [--steps 4] [--batch 4] [--new-tokens 48]``

Part 1, overlap: the same short stage-2 run (random widened tiny Qwen2-VL, synthetic images) trains against a REAL
``coordexp serve-rollout --engine hf`` process on 127.0.0.1, once with ``rollout_matching.overlap`` off and once on
(a fresh server each). On CPU each process gets its own core so the two can really run at once: the server under
``taskset -c 1`` with one thread, the learner pinned to core 0 with one thread. Printed per run: the median step
time, and for the overlap-off run its split into rollout (the blocking ``/infer/`` wait + weight push) and train
(everything else: host pipeline, forward, backward, optimizer); the ideal overlapped step is max(rollout, train),
the serial one their sum. The first step (warm-up, and on-demand even with overlap) is left out.

Part 2, HF generate: the learner-side HF backend on the same model and prompts, greedy, ``--new-tokens`` per
request with the model's own stopping, in chunks of ``--batch``: generated tokens/s with ``hf_generate`` off,
``static_cache`` and ``static_cache + compile`` (median of ``--repeats`` after a warm-up call, which is where
compilation happens), and whether each mode's outputs equal the off mode's token for token.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
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
LEARNER_CORE, SERVER_CORE = 0, 1


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _base_config(model: Path, data: Path, out: Path) -> dict:
    return {
        "extends": str(ROOT / "examples" / "stage2_cpu_hf.yaml"),
        "global_max_length": 4096,
        "model": {"path": str(model), "dtype": "float32", "attn_implementation": "sdpa"},
        "data": {"train_jsonl": str(data / "train.jsonl"), "val_jsonl": None},
        "training": {"output_dir": str(out)},
    }


class RolloutServer:
    """``coordexp serve-rollout --engine hf`` on a free loopback port, on its own core when there is one."""

    def __init__(self, config: Path, log: Path, *, pinned: bool):
        from coordexp.runtime.rollout.client import RolloutServerClient

        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "coordexp", "serve-rollout", str(config), "--engine", "hf", "--port",
                   str(self.port), "--log-level", "warning"]
        if pinned:
            command = ["taskset", "-c", str(SERVER_CORE), *command]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self.log = log
        with open(log, "wb") as sink:
            self.proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True, cwd=ROOT)
        try:
            RolloutServerClient(self.base_url, timeout_s=180.0).wait_until_healthy()
        except Exception:
            self.close()
            raise RuntimeError(f"the rollout server did not start:\n{log.read_text(errors='replace')[-3000:]}")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def _learner_config(base: dict, server_url: str, *, overlap: bool, steps: int, batch: int, new_tokens: int) -> dict:
    server = {"servers": [{"base_url": server_url, "group_port": _free_port()}], "timeout_s": 120.0,
              "infer_timeout_s": 600.0}
    return {**base, "training": {
        **base["training"], "per_device_train_batch_size": batch, "gradient_accumulation_steps": 1,
        "max_steps": steps + 1, "logging_steps": 1, "save_steps": 100000, "packing": True, "packing_buffer": 256,
        "learning_rate": 1e-4,
    }, "rollout_matching": {
        "rollout_backend": "vllm", "decode_batch_size": batch, "max_new_tokens": new_tokens,
        "vllm": {"mode": "server", "sync": {"mode": "full"}, "server": server},
        "overlap": {"enabled": overlap},
    }}


def run_overlap(tmp: Path, base: dict, *, overlap: bool, steps: int, batch: int, new_tokens: int,
                pinned: bool) -> dict:
    """One stage-2 run against a fresh server: median step / rollout-wait / generation seconds after step 0."""
    from _step_clock import StepClock

    from coordexp.runtime.train.launch import build_trainer
    from coordexp.schema.contract import load_contract

    name = "on" if overlap else "off"
    server_cfg = tmp / f"server_{name}.yaml"
    server_cfg.write_text(yaml.safe_dump({**base, "rollout_matching": {
        "decode_batch_size": batch, "max_new_tokens": new_tokens}}), encoding="utf-8")
    server = RolloutServer(server_cfg, tmp / f"server_{name}.log", pinned=pinned)
    clock = StepClock()
    try:
        config = _learner_config({**base, "training": {"output_dir": str(tmp / f"run_{name}")}}, server.base_url,
                                 overlap=overlap, steps=steps, batch=batch, new_tokens=new_tokens)
        path = tmp / f"learner_{name}.yaml"
        path.write_text(yaml.safe_dump(config), encoding="utf-8")
        trainer = build_trainer(load_contract(path), callbacks=[clock])
        try:
            with contextlib.redirect_stdout(sys.stderr):  # the trainer's per-step log dicts; stdout keeps the figures
                trainer.train()
        finally:
            trainer.backend.close()
    finally:
        server.close()
    logs = [h for h in trainer.state.log_history if "loss" in h][1:]
    timed = clock.walls[1:]
    rollout = [h.get("time/rollout_s", 0.0) for h in logs]  # main-thread wait: /infer/ (+ the weight push)
    generate = [h.get("time/rollout_generate_s", 0.0) for h in logs]  # background generation (overlap on)
    step_s = statistics.median(timed)
    rollout_s = statistics.median(rollout)
    return {
        "steps": len(timed),
        "step_s": step_s,
        "rollout_wait_s": rollout_s,
        "rollout_generate_s": statistics.median(generate) if overlap else rollout_s,
        "train_s": step_s - rollout_s,
        "staleness_max": max((h.get("rollout/staleness_max", 0.0) for h in logs), default=0.0),
    }


def run_hf_generate(model_dir: Path, data: Path, *, batch: int, new_tokens: int, prompts: int, repeats: int,
                    modes: list[str]) -> dict:
    """Tokens/s of the HF backend per ``hf_generate`` mode, and output equality with mode ``off``."""
    import torch
    from transformers import AutoModelForImageTextToText

    from coordexp.runtime.model.data import load_records
    from coordexp.runtime.model.encoding import encode_prompt, load_processor
    from coordexp.runtime.rollout.base import RolloutRequest
    from coordexp.runtime.rollout.hf import HfRolloutBackend
    from coordexp.schema.rollout import DecodingConfig, HfGenerateConfig, RepeatTerminateConfig
    from coordexp.schema.template import TemplateConfig

    settings = {"off": HfGenerateConfig(static_cache=False, compile=False),  # unset would follow the device
                "static": HfGenerateConfig(static_cache=True, compile=False),
                "static+compile": HfGenerateConfig(static_cache=True, compile=True)}
    cuda = torch.cuda.is_available()
    processor = load_processor(model_dir)
    template = TemplateConfig(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)
    records = load_records(data / "train.jsonl")[:prompts]
    requests = [RolloutRequest(prompt=encode_prompt(processor, r, template), index=i, seed=i + 1)
                for i, r in enumerate(records)]
    model = AutoModelForImageTextToText.from_pretrained(
        str(model_dir), dtype=torch.bfloat16 if cuda else torch.float32).to("cuda" if cuda else "cpu").eval()
    results: dict[str, dict] = {}
    reference = None
    for mode in modes:
        backend = HfRolloutBackend(model, processor.tokenizer, decode_batch_size=batch, max_new_tokens=new_tokens,
                                   decoding=DecodingConfig(), repeat_terminate=RepeatTerminateConfig(),
                                   hf_generate=settings[mode])
        started = time.perf_counter()
        outputs = backend.generate(requests)  # warm-up (compiles in the compile mode)
        warmup_s = time.perf_counter() - started
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            outputs = backend.generate(requests)
            seconds.append(time.perf_counter() - started)
        ids = [o.response_token_ids for o in outputs]
        reference = ids if reference is None else reference
        tokens = sum(len(i) for i in ids)
        median = statistics.median(seconds)
        results[mode] = {"tokens": tokens, "seconds": median, "tokens_per_s": tokens / median,
                         "warmup_s": warmup_s, "equal_to_off": ids == reference}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="timed optimizer steps (plus one warm-up step)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--hidden", type=int, default=256, help="language-model width of the random test model")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="timed HF generate rounds per mode")
    parser.add_argument("--hf-modes", default="off,static,static+compile")
    parser.add_argument("--skip-overlap", action="store_true")
    args = parser.parse_args()
    modes = args.hf_modes.split(",")
    if modes[0] != "off" or not set(modes) <= {"off", "static", "static+compile"}:
        parser.error("--hf-modes: a comma list starting with off, of off, static, static+compile")

    import torch

    from coordexp.runtime.toy.synthetic import write_synthetic_dataset
    from coordexp.runtime.toy.tiny_model import build_tiny_model

    cores = sorted(os.sched_getaffinity(0))
    pinned = not torch.cuda.is_available() and len(cores) >= 2 and {LEARNER_CORE, SERVER_CORE} <= set(cores)
    if pinned:
        os.sched_setaffinity(0, {LEARNER_CORE})
        torch.set_num_threads(1)
    summary: dict = {"device": "cuda" if torch.cuda.is_available() else "cpu", "pinned": pinned,
                     "hidden": args.hidden, "layers": args.layers, "batch": args.batch,
                     "new_tokens": args.new_tokens}
    with tempfile.TemporaryDirectory(prefix="bench_overlap_") as tmp_name:
        tmp = Path(tmp_name)
        model = build_tiny_model(tmp / "model", seed=0, hidden_size=args.hidden, num_layers=args.layers)
        # exactly one epoch of data: the overlap lookahead never crosses an epoch boundary
        data = write_synthetic_dataset(tmp / "data", n_train=args.batch * (args.steps + 1), n_val=0, seed=5)
        base = _base_config(model, data.root, tmp / "run")
        if not args.skip_overlap:
            runs = {name: run_overlap(tmp, base, overlap=name == "on", steps=args.steps, batch=args.batch,
                                      new_tokens=args.new_tokens, pinned=pinned) for name in ("off", "on")}
            off, on = runs["off"], runs["on"]
            ideal = max(off["rollout_wait_s"], off["train_s"])
            serial = off["rollout_wait_s"] + off["train_s"]
            summary["overlap"] = {**runs, "max_s": ideal, "sum_s": serial,
                                  "speedup": off["step_s"] / on["step_s"] if on["step_s"] else None}
            print(f"\nOverlap: {args.steps} steps, batch {args.batch}, {args.new_tokens} new tokens, LM hidden "
                  f"{args.hidden} x {args.layers}, {summary['device']}, "
                  f"{'server on core 1, learner on core 0' if pinned else 'no core pinning'}")
            print(f"  off: step {off['step_s']:.2f} s = rollout {off['rollout_wait_s']:.2f} s + train "
                  f"{off['train_s']:.2f} s")
            print(f"  on:  step {on['step_s']:.2f} s (waited {on['rollout_wait_s']:.2f} s for rollouts generated in "
                  f"{on['rollout_generate_s']:.2f} s; staleness max {on['staleness_max']:.0f})")
            print(f"  max(rollout, train) {ideal:.2f} s, sum {serial:.2f} s; on/off speedup "
                  f"{summary['overlap']['speedup']:.2f}x")
        hf = run_hf_generate(model, data.root, batch=args.batch, new_tokens=args.new_tokens,
                             prompts=args.batch * 2, repeats=args.repeats, modes=modes)
        summary["hf_generate"] = hf
        print(f"\nHF generate (greedy, batch {args.batch}, up to {args.new_tokens} new tokens, {args.batch * 2} prompts)")
        for mode, r in hf.items():
            print(f"  {mode:<15} {r['tokens_per_s']:>8.1f} tok/s  (warm-up {r['warmup_s']:.1f} s, "
                  f"equal to off: {r['equal_to_off']})")
    print("\nJSON " + json.dumps(summary))


if __name__ == "__main__":
    main()
