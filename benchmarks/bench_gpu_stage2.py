"""Stage 2 at Qwen3-VL's published shapes on one GPU: where a step's time goes and how fast the rollouts decode.

Run (one device call, about 4 minutes on an H100 or H200 at 2B):
  ``python benchmarks/bench_gpu_stage2.py [--size 2b|4b|8b] [--steps 2]``
CPU figures at a widened tiny shape: ``python benchmarks/bench_gpu_stage2.py --size wide --device cpu``
Smoke (CPU, toy size, in the test suite): ``python benchmarks/bench_gpu_stage2.py --smoke``

Offline: random weights at the published shapes of Qwen3-VL 2B/4B/8B (Qwen/Qwen3-VL-*-Instruct config.json: the
language model, the vision tower with DeepStack, vocabulary 151,936; tokens past the tiny tokenizer are never
emitted), the tiny tokenizer and Qwen3-VL's image processor; nothing is downloaded. Synthetic 448 px images with
1-8 shapes. bf16 and sdpa on CUDA (float32 on CPU). Printed:
- the card and the copy bandwidth measured on it; the decode limit it implies (weights read once per decode step);
- decode tokens/s at ``--decode-batch`` rows, as at a training step's sync point (an adapter's weights change and
  are merged again inside the timing): plain ``generate`` (dynamic cache), the device's default (``hf_generate``
  unset: a compiled static cache on CUDA, with the first call's cost), a DoRA adapter decoded unmerged and through
  merged weights (the default), and the DoRA/full ratios of a step's rollout time;
- forward + backward of one row: full fine-tuning, DoRA as PEFT builds it by default, coordexp's DoRA defaults
  (``runtime/model/adapter_speed.py``), and model-dtype adapters;
- three stage-2 runs of the project's own trainer (``build_trainer``; HF rollouts; one warm-up step, then
  ``--steps`` timed): full fine-tuning (ViT frozen) packed, DoRA r16 packed, DoRA r16 padded: the step split
  (rollout, host, forward, backward, other), rollout tokens/s, trained tokens/s over forward+backward, fill ratio,
  peak memory; then DoRA/full ratios (forward+backward per trained token, rollout tokens/s) and packed/padded.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

MROPE = {"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [24, 20, 20], "mrope_interleaved": True}


@dataclass(frozen=True)
class Shape:
    """A Qwen3-VL shape: language model (width x layers, heads / KV heads of ``head_dim``) and vision tower."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tie: bool
    vision_depth: int
    vision_hidden: int
    vision_intermediate: int
    vision_heads: int
    deepstack: tuple[int, ...]
    vocab: int = 151_936
    rope: dict | None = None


# Qwen/Qwen3-VL-{2B,4B,8B}-Instruct config.json; "wide" and "toy" are CPU sizes of the same architecture
SHAPES = {
    "2b": Shape(2048, 6144, 28, 16, 8, 128, True, 24, 1024, 4096, 16, (5, 11, 17)),
    "4b": Shape(2560, 9728, 36, 32, 8, 128, True, 24, 1024, 4096, 16, (5, 11, 17)),
    "8b": Shape(4096, 12288, 36, 32, 8, 128, False, 27, 1152, 4304, 16, (8, 16, 24)),
    "wide": Shape(512, 1024, 4, 8, 2, 64, True, 2, 128, 256, 4, (0, 1), vocab=0,
                  rope=dict(MROPE, mrope_section=[12, 10, 10])),
    "toy": Shape(128, 256, 2, 2, 1, 64, True, 1, 64, 128, 2, (0,), vocab=0, rope=dict(MROPE, mrope_section=[12, 10, 10])),
}


def qwen3_vl_config(tokenizer: Any, shape: Shape):
    """The Qwen3-VL config of ``shape`` with the tiny tokenizer's special ids (vocab 0: the tokenizer's, padded)."""
    from transformers import Qwen3VLConfig

    from coordexp.runtime.toy.tiny_model import tiny_model_config

    ids = tiny_model_config(tokenizer, "qwen3_vl")  # the special token ids every Qwen-VL config names
    text = dict(vocab_size=shape.vocab or ids.text_config.vocab_size, hidden_size=shape.hidden,
                intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                max_position_embeddings=262_144, rms_norm_eps=1e-6, initializer_range=0.02,
                rope_parameters=dict(shape.rope or MROPE), bos_token_id=ids.text_config.bos_token_id,
                eos_token_id=ids.text_config.eos_token_id, pad_token_id=ids.text_config.pad_token_id,
                tie_word_embeddings=shape.tie)
    vision = dict(depth=shape.vision_depth, hidden_size=shape.vision_hidden,
                  intermediate_size=shape.vision_intermediate, num_heads=shape.vision_heads, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=shape.hidden,
                  num_position_embeddings=2304, deepstack_visual_indexes=list(shape.deepstack),
                  hidden_act="gelu_pytorch_tanh", initializer_range=0.02)
    return Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=ids.image_token_id,
                         video_token_id=ids.video_token_id, vision_start_token_id=ids.vision_start_token_id,
                         vision_end_token_id=ids.vision_end_token_id, tie_word_embeddings=shape.tie)


def random_model(config: Any, device: str, dtype: Any):
    """Random weights, initialised on the device itself (a 2B model in a few seconds on a GPU)."""
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    with torch.device(device):
        model = Qwen3VLForConditionalGeneration._from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.generation_config.eos_token_id = config.text_config.eos_token_id
    model.generation_config.pad_token_id = config.text_config.pad_token_id
    model.generation_config.do_sample = False
    return model


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str, mib: int) -> float:
    """Bytes per second a device-to-device copy moves (read + write), best of 5."""
    import torch

    source = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    sync(device)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        target.copy_(source)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * source.numel() / best


def weight_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# -- decode ----------------------------------------------------------------------------------------------------
def decode_table(variants: dict[str, tuple[Any, Any]], tokenizer: Any, requests: list, *, new_tokens: int,
                 device: str, rounds: int) -> dict:
    """Generated tokens/s of the HF rollout backend per ``(model, hf_generate)`` variant over ``requests`` in one
    chunk (greedy), as at a training step's sync point: an adapter model's weights are nudged in place before every
    call (an optimizer step) and ``sync_weights`` runs inside the timing (the merge is part of the wait). The first
    call (compilation, the first merge) is timed apart; then ``rounds`` rounds with the variants interleaved in
    rotating order (a busy spell of a shared machine hits them all), best of each."""
    import torch

    from coordexp.runtime.rollout.hf import HfRolloutBackend
    from coordexp.runtime.rollout.weight_export import is_peft
    from coordexp.schema.rollout import DecodingConfig, RepeatTerminateConfig

    backends, figures = {}, {}
    for name, (model, hf_generate) in variants.items():
        backends[name] = HfRolloutBackend(model, tokenizer, decode_batch_size=len(requests), max_new_tokens=new_tokens,
                                          decoding=DecodingConfig(), repeat_terminate=RepeatTerminateConfig(),
                                          hf_generate=hf_generate)
        start = time.perf_counter()
        backends[name].generate(requests)
        sync(device)
        figures[name] = {"first_call_s": time.perf_counter() - start, "seconds": float("inf"), "tokens": 0}
    names = list(variants)
    for attempt in range(rounds):
        for name in names[attempt % len(names):] + names[:attempt % len(names)]:
            model, backend = variants[name][0], backends[name]
            if is_peft(model):
                with torch.no_grad():
                    for parameter_name, parameter in model.named_parameters():
                        if ".lora_B." in parameter_name:
                            parameter.add_(1e-4)
            sync(device)
            start = time.perf_counter()
            backend.sync_weights(model)
            outputs = backend.generate(requests)
            sync(device)
            seconds = time.perf_counter() - start
            if seconds < figures[name]["seconds"]:
                figures[name].update(seconds=seconds, tokens=sum(len(o.response_token_ids) for o in outputs))
    for name, backend in backends.items():
        backend.close()
        figures[name]["tokens_per_s"] = figures[name]["tokens"] / figures[name]["seconds"]
    return figures


# -- DoRA's training cost ----------------------------------------------------------------------------------------
def fwd_bwd_seconds(model: Any, ids: Any, device: str, repeats: int) -> float:
    """Best of ``repeats`` forward + backward passes over one row of ``ids`` (logits at its last quarter only, as
    the trainer keeps the supervised positions only)."""
    model.train()
    keep = max(1, ids.shape[1] // 4)
    best = float("inf")
    for attempt in range(repeats + 1):  # the first is a warm-up
        model.zero_grad(set_to_none=True)
        sync(device)
        start = time.perf_counter()
        logits = model(input_ids=ids, attention_mask=ids.new_ones(ids.shape), logits_to_keep=keep).logits
        logits.float().logsumexp(-1).mean().backward()
        sync(device)
        if attempt:
            best = min(best, time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return best


def dora_cost(model: Any, coord_ids: list[int], device: str, *, tokens: int, repeats: int) -> dict:
    """Forward + backward seconds of one ``tokens``-token row: full fine-tuning (ViT frozen), DoRA r16 as PEFT
    builds it by default (dropout 0.05, float32 adapters, the norm per forward), coordexp's default DoRA (no
    dropout, float32 adapters, the norm once per optimizer step) and the same with model-dtype adapters."""
    import copy

    import torch

    from coordexp.runtime.model.tuner import apply_tuner, lora_config
    from coordexp.schema.tuner import TunerConfig

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (1, tokens), generator=generator).to(device)
    dora = TunerConfig(train_type="lora", use_dora=True, lora_rank=16, lora_alpha=32)
    figures = {"full fine-tuning": fwd_bwd_seconds(apply_tuner(model, TunerConfig()), ids, device, repeats)}
    from peft import get_peft_model

    peft_default = copy.deepcopy(model)
    config = lora_config(peft_default, dora, coord_ids)
    config.lora_dropout = 0.05
    peft_default = get_peft_model(peft_default, config)  # PEFT's defaults, no coordexp cache
    figures["DoRA, PEFT defaults (dropout 0.05)"] = fwd_bwd_seconds(peft_default, ids, device, repeats)
    del peft_default
    for name, tuner in (("DoRA, coordexp default", dora),
                        ("DoRA, coordexp, adapter_dtype: model", dora.model_copy(update={"adapter_dtype": "model"}))):
        policy = apply_tuner(copy.deepcopy(model), tuner, coord_ids)
        figures[name] = fwd_bwd_seconds(policy, ids, device, repeats)
        del policy
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    base = figures["full fine-tuning"]
    return {name: {"seconds": value, "over_full": value / base} for name, value in figures.items()}


# -- trainer runs ----------------------------------------------------------------------------------------------
def run_config(tmp: Path, model_dir: Path, data: Any, name: str, *, packing: bool, dora: bool, args: Any,
               dtype: str) -> Path:
    config = {
        "extends": str(ROOT / "examples" / "base_stage2.yaml"),
        "global_max_length": 4096,
        "model": {"path": str(model_dir), "dtype": dtype, "attn_implementation": "sdpa"},
        "template": {"min_pixels": args.image_px ** 2, "max_pixels": args.image_px ** 2},
        "data": {"train_jsonl": str(data.train_jsonl), "val_jsonl": None},
        "training": {"output_dir": str(tmp / name), "per_device_train_batch_size": args.batch,
                     "gradient_accumulation_steps": 1, "max_steps": args.steps + 1, "logging_steps": 1,
                     "save_steps": 100_000, "packing": packing, "packing_buffer": 256, "learning_rate": 1e-6,
                     "warmup_ratio": 0.0, "lr_scheduler_type": "constant"},
        "rollout_matching": {"rollout_backend": "hf", "decode_batch_size": args.batch,
                             "max_new_tokens": args.new_tokens, "repeat_terminate": {"enabled": False}},
    }
    if dora:
        config["tuner"] = {"train_type": "lora", "use_dora": True, "lora_rank": 16, "lora_alpha": 32}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def train_run(config: Path, model: Any, processor: Any, device: str, backend: Any = None) -> dict:
    """``steps + 1`` optimizer steps of the project's trainer on ``model``; figures of all but the first."""
    import torch

    from _step_clock import StepClock

    from coordexp.runtime.train.launch import build_trainer
    from coordexp.schema.contract import load_contract

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    trainer = build_trainer(load_contract(config), model=model, processor=processor)
    if backend is not None:  # a backend already warmed up (merged twin, compiled decode) on this policy
        trainer.backend.close()
        trainer.backend = backend
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # the figures are printed below
    clock = StepClock()
    trainer.add_callback(clock)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "time/forward_s" in h][1:]
    total = sum(clock.walls[1:])
    split = {k: sum(h.get(f"time/{k}_s", 0.0) for h in logs) for k in ("rollout", "host", "forward", "backward")}
    split["other"] = max(total - sum(split.values()), 0.0)
    trained = sum(h["tokens/trained"] for h in logs)
    generated = sum(h.get("rollout/rollout_tokens", 0.0) for h in logs)
    compute = split["forward"] + split["backward"]
    fills = [h["packing/fill_ratio"] for h in logs if "packing/fill_ratio" in h]
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None
    backend, trainer = trainer.backend, None
    gc.collect()  # the trainer's optimizer state goes before the next run starts
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    result = {
        "step_s": total / max(len(logs), 1), "split_s": split, "rollout_share": split["rollout"] / total if total else 0,
        "rollout_tokens_per_s": generated / split["rollout"] if split["rollout"] else 0.0,
        "trained_tokens": trained, "trained_tokens_per_s": trained / compute if compute else 0.0,
        "compute_s_per_token": compute / trained if trained else 0.0,
        "fill_ratio": sum(fills) / len(fills) if fills else None, "peak_gib": peak,
    }
    return result, backend


def requests_for(processor: Any, records: list, rows: int, template: Any) -> list:
    from coordexp.runtime.model.encoding import encode_prompt
    from coordexp.runtime.rollout.base import RolloutRequest

    return [RolloutRequest(prompt=encode_prompt(processor, records[i % len(records)], template), index=i, seed=i + 1)
            for i in range(rows)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SHAPES), default="2b")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--steps", type=int, default=2, help="timed optimizer steps per run (after one warm-up)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--decode-batch", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds of the decode table")
    parser.add_argument("--threads", type=int, default=None, help="CPU: torch threads (1 steadies shared machines)")
    parser.add_argument("--row-tokens", type=int, default=4096, help="tokens of the DoRA-cost row")
    parser.add_argument("--images", type=int, default=48)
    parser.add_argument("--image-px", type=int, default=448)
    parser.add_argument("--smoke", action="store_true", help="CPU, toy size, a few tokens: the test suite's run")
    args = parser.parse_args()
    if args.smoke:
        args.size, args.device, args.steps, args.batch, args.new_tokens = "toy", "cpu", 1, 2, 8
        args.decode_batch, args.decode_tokens, args.images, args.image_px, args.row_tokens = 2, 6, 4, 64, 64
        args.rounds = 1

    import torch

    from coordexp.runtime.model.encoding import load_processor
    from coordexp.runtime.model.tuner import apply_tuner
    from coordexp.runtime.core.tokens import CoordVocab
    from coordexp.runtime.toy.synthetic import write_synthetic_dataset
    from coordexp.runtime.toy.tiny_model import build_tiny_model
    from coordexp.runtime.model.data import load_records
    from coordexp.schema.contract import load_contract
    from coordexp.schema.rollout import HfGenerateConfig
    from coordexp.schema.tuner import TunerConfig

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    on_cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if on_cuda else torch.float32
    card = torch.cuda.get_device_name(0) if on_cuda else "CPU"
    shape = SHAPES[args.size]
    results: dict[str, Any] = {"size": args.size, "device": card, "date": time.strftime("%Y-%m-%d")}

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = build_tiny_model(tmp / "scaffold", family="qwen3_vl")  # tokenizer, processor, special ids
        processor = load_processor(model_dir)
        tokenizer = processor.tokenizer
        data = write_synthetic_dataset(tmp / "data", n_train=args.images, n_val=0, seed=5,
                                       image_size=(args.image_px, args.image_px), min_objects=1, max_objects=8)
        started = time.perf_counter()
        model = random_model(qwen3_vl_config(tokenizer, shape), device, dtype)
        sync(device)
        results["model"] = {"parameters": sum(p.numel() for p in model.parameters()),
                            "weight_bytes": weight_bytes(model), "init_s": time.perf_counter() - started}
        bandwidth = copy_bandwidth(device, 2048 if on_cuda else 64)
        limit = args.decode_batch * bandwidth / results["model"]["weight_bytes"]
        results["bandwidth"] = {"bytes_per_s": bandwidth, "decode_limit_tokens_per_s": limit}

        packed_run = run_config(tmp, model_dir, data, "full", packing=True, dora=False, args=args,
                                dtype="bfloat16" if on_cuda else "float32")
        run = load_contract(packed_run)
        records = load_records(data.train_jsonl)
        requests = requests_for(processor, records, args.decode_batch, run.template)
        results["prompt_tokens"] = sum(r.prompt.prompt_len for r in requests) / len(requests)
        coord_ids = CoordVocab.from_tokenizer(tokenizer).ids
        adapter = apply_tuner(copy.deepcopy(model), TunerConfig(train_type="lora", use_dora=True, lora_rank=16,
                                                                  lora_alpha=32), coord_ids)
        with torch.no_grad():  # a trained adapter (a fresh lora_B is zero)
            for name, parameter in adapter.named_parameters():
                if ".lora_B." in name:
                    parameter.normal_(0.0, 0.01)
        decode = decode_table({
            "plain generate (dynamic cache)": (model, HfGenerateConfig(static_cache=False, compile=False)),
            "device default (hf_generate unset)": (model, HfGenerateConfig()),
            "DoRA r16 unmerged (dynamic cache)": (adapter, HfGenerateConfig(static_cache=False, compile=False,
                                                                             merge_adapter=False)),
            "DoRA r16 merged (default)": (adapter, HfGenerateConfig()),
        }, tokenizer, requests, new_tokens=args.decode_tokens, device=device, rounds=args.rounds)
        del adapter
        gc.collect()
        results["dora_cost"] = dora_cost(model, coord_ids, device, tokens=args.row_tokens, repeats=3)
        runs: dict[str, dict] = {}
        full = apply_tuner(model, run.tuner)  # full fine-tuning: the vision tower frozen
        runs["full, packed"], _ = train_run(packed_run, full, processor, device)

        dora_run = load_contract(run_config(tmp, model_dir, data, "dora", packing=True, dora=True, args=args,
                                            dtype="bfloat16" if on_cuda else "float32"))
        dora = apply_tuner(full.requires_grad_(False), dora_run.tuner, coord_ids)
        runs["DoRA r16, packed"], backend = train_run(tmp / "dora.yaml", dora, processor, device)
        padded = run_config(tmp, model_dir, data, "dora_padded", packing=False, dora=True, args=args,
                            dtype="bfloat16" if on_cuda else "float32")
        runs["DoRA r16, padded"], backend = train_run(padded, dora, processor, device, backend=backend)
        backend.close()
        results["decode"], results["runs"] = decode, runs

    full_run, dora_packed, dora_padded = runs["full, packed"], runs["DoRA r16, packed"], runs["DoRA r16, padded"]
    plain = decode["plain generate (dynamic cache)"]["tokens_per_s"]
    default = decode["device default (hf_generate unset)"]["tokens_per_s"]
    results["ratios"] = {
        "dora_over_full_compute_per_token": dora_packed["compute_s_per_token"] / full_run["compute_s_per_token"]
        if full_run["compute_s_per_token"] else None,
        "dora_over_full_rollout_s": (dora_packed["split_s"]["rollout"] / full_run["split_s"]["rollout"])
        if full_run["split_s"]["rollout"] else None,
        "dora_rollout_s_over_full_default": default / decode["DoRA r16 merged (default)"]["tokens_per_s"],
        "dora_unmerged_rollout_s_over_full_plain": plain / decode["DoRA r16 unmerged (dynamic cache)"]["tokens_per_s"],
        "default_over_plain_decode": decode["device default (hf_generate unset)"]["tokens_per_s"] / plain,
        "packed_over_padded_trained_tokens_per_s": dora_packed["trained_tokens_per_s"]
        / max(dora_padded["trained_tokens_per_s"], 1e-9),
    }
    report(results, args, shape)
    print("JSON " + json.dumps(results))


def report(results: dict, args: Any, shape: Shape) -> None:
    model, bandwidth = results["model"], results["bandwidth"]
    print(f"\nQwen3-VL {args.size} shape (LM {shape.hidden} x {shape.layers}, vision {shape.vision_hidden} x "
          f"{shape.vision_depth}), random weights: {model['parameters'] / 1e9:.2f} B parameters, "
          f"{model['weight_bytes'] / 2**30:.2f} GiB, on {results['device']} ({results['date']})")
    print(f"copy bandwidth {bandwidth['bytes_per_s'] / 1e12:.2f} TB/s -> decode limit at batch {args.decode_batch}: "
          f"{bandwidth['decode_limit_tokens_per_s']:,.0f} tok/s (weights read once per step)")
    print(f"\nDecode, batch {args.decode_batch}, ~{results['prompt_tokens']:.0f} prompt tokens, "
          f"{args.decode_tokens} new tokens, greedy")
    print(f"  {'variant':<38} {'tok/s':>9} {'of limit':>9} {'first call s':>13}")
    for name, figures in results["decode"].items():
        print(f"  {name:<38} {figures['tokens_per_s']:>9,.0f} "
              f"{figures['tokens_per_s'] / bandwidth['decode_limit_tokens_per_s']:>8.1%} {figures['first_call_s']:>13.1f}")
    print(f"\nForward + backward of one {args.row_tokens}-token row (DoRA r16 on every Linear of the language model)")
    for name, figures in results["dora_cost"].items():
        print(f"  {name:<38} {figures['seconds']:>8.3f} s {figures['over_full']:>6.2f}x full")
    print(f"\nStage-2 steps (batch {args.batch}, {args.new_tokens} new tokens, HF rollouts, {args.steps} timed steps)")
    print(f"  {'run':<18} {'step s':>7} {'rollout':>8} {'host':>6} {'fwd':>6} {'bwd':>6} {'other':>6} "
          f"{'roll tok/s':>10} {'train tok/s':>11} {'fill':>5} {'peak GiB':>8}")
    for name, r in results["runs"].items():
        s, steps = r["split_s"], max(args.steps, 1)
        fill = "-" if r["fill_ratio"] is None else f"{r['fill_ratio']:.2f}"
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        print(f"  {name:<18} {r['step_s']:>7.2f} {r['rollout_share']:>7.0%} {s['host'] / steps:>6.2f} "
              f"{s['forward'] / steps:>6.2f} {s['backward'] / steps:>6.2f} {s['other'] / steps:>6.2f} "
              f"{r['rollout_tokens_per_s']:>10,.0f} {r['trained_tokens_per_s']:>11,.0f} {fill:>5} {peak:>8}")
    ratios = results["ratios"]
    print("\nRatios")
    for key, value in ratios.items():
        print(f"  {key}: {'-' if value is None else f'{value:.2f}'}")


if __name__ == "__main__":
    main()
