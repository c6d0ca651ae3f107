"""Whole-step rollout batches against a real vLLM engine (the CPU build, in process): one optimizer step's
``gradient_accumulation_steps x batch`` prompts in ONE engine call (what the learner now sends at each sync point)
against one call per micro-step (before), same prompts, same seeds.

Run: ``VLLM_TARGET_DEVICE=cpu VLLM_CPU_OMP_THREADS_BIND=nobind HF_HUB_OFFLINE=1 \\
      .venv-test/bin/python benchmarks/bench_whole_step_vllm.py [--accumulation 4] [--batch 8] [--new-tokens 48]``

The engine is the one ``coordexp serve-rollout --engine vllm`` and the colocate backend drive
(``coordexp.runtime.rollout.vllm_engine.VllmEngine``), on a random Qwen2-VL widened to ``--hidden`` x
``--layers`` (float32), with synthetic images. Printed: generated tokens/s both ways (best of ``--repeats`` after a
warm-up, interleaved), the gain, and whether the outputs are token-for-token equal (greedy). On a GPU the same script measures
the GPU engine.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timed(engine, groups, decoding, new_tokens, repeats: int) -> tuple[float, list]:
    """Best wall seconds of generating every group (one engine call each) and the last outputs, in order."""
    best, outputs = float("inf"), []
    for _ in range(repeats):
        start = time.perf_counter()
        got = [o for group in groups for o in engine.generate(group, decoding=decoding, max_new_tokens=new_tokens)]
        best = min(best, time.perf_counter() - start)
        outputs = got
    return best, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accumulation", type=int, default=4, help="gradient_accumulation_steps")
    parser.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from coordexp.runtime.core.distribution import train_request_seeds
    from coordexp.runtime.model.data import load_records
    from coordexp.runtime.model.encoding import encode_prompt, load_processor
    from coordexp.runtime.rollout.base import RolloutRequest
    from coordexp.runtime.rollout.vllm_engine import EngineSettings, VllmEngine
    from coordexp.runtime.toy.synthetic import write_synthetic_dataset
    from coordexp.runtime.toy.tiny_model import build_tiny_model
    from coordexp.schema.rollout import DecodingConfig
    from coordexp.schema.template import TemplateConfig

    template = TemplateConfig(system_prompt="Find shapes.", user_prompt="List every shape.", min_pixels=28 * 28 * 4,
                              max_pixels=28 * 28 * 16)
    prompts_per_step = args.accumulation * args.batch
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = build_tiny_model(tmp / "model", seed=0, hidden_size=args.hidden, num_layers=args.layers)
        data = write_synthetic_dataset(tmp / "data", n_train=prompts_per_step, n_val=0, seed=3, min_objects=1,
                                       max_objects=6)
        processor = load_processor(model_dir)
        records = load_records(data.train_jsonl)
        micro_steps = []
        for micro in range(args.accumulation):  # each micro-step's own seeds, as the trainer draws them
            part = records[micro * args.batch:(micro + 1) * args.batch]
            seeds = train_request_seeds(17, 0, micro, 0, 1, args.batch, len(part))
            micro_steps.append([RolloutRequest(prompt=encode_prompt(processor, r, template), index=i, seed=s, record=r)
                                for i, (r, s) in enumerate(zip(part, seeds))])
        whole_step = [[r for part in micro_steps for r in part]]
        settings = EngineSettings(model_path=str(model_dir), dtype="float32", max_model_len=1024,
                                  max_num_seqs=max(256, prompts_per_step), seed=0, min_pixels=template.min_pixels,
                                  max_pixels=template.max_pixels, kv_cache_memory_bytes=512 << 20)
        engine = VllmEngine.start(settings)
        try:
            greedy = DecodingConfig()
            for group in (micro_steps[0], whole_step[0]):  # warm-up at both batch sizes
                engine.generate(group, decoding=greedy, max_new_tokens=args.new_tokens)
            per_micro_s = whole_s = float("inf")
            for _ in range(args.repeats):  # interleaved, so a busy spell of the machine hits both
                seconds, per_micro = timed(engine, micro_steps, greedy, args.new_tokens, 1)
                per_micro_s = min(per_micro_s, seconds)
                seconds, whole = timed(engine, whole_step, greedy, args.new_tokens, 1)
                whole_s = min(whole_s, seconds)
        finally:
            engine.close()
    tokens = sum(len(o.response_token_ids) for o in whole)
    result = {
        "prompts_per_step": prompts_per_step, "new_tokens": args.new_tokens, "tokens": tokens,
        "per_micro_step": {"calls": args.accumulation, "seconds": per_micro_s, "tokens_per_s": tokens / per_micro_s},
        "whole_step": {"calls": 1, "seconds": whole_s, "tokens_per_s": tokens / whole_s},
        "gain": per_micro_s / whole_s,
        "equal_outputs": [o.response_token_ids for o in whole] == [o.response_token_ids for o in per_micro],
    }
    print(f"\nvLLM CPU engine, random Qwen2-VL {args.hidden} x {args.layers} (float32), one optimizer step of "
          f"{args.accumulation} x {args.batch} prompts, {args.new_tokens} new tokens, greedy")
    print(f"  one call per micro-step ({args.accumulation} calls): {result['per_micro_step']['tokens_per_s']:,.0f} tok/s")
    print(f"  one call per optimizer step:        {result['whole_step']['tokens_per_s']:,.0f} tok/s")
    print(f"  gain {result['gain']:.2f}x; outputs token-for-token equal: {result['equal_outputs']}")
    print("JSON " + json.dumps(result))


if __name__ == "__main__":
    main()
