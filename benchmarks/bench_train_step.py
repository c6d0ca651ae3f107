"""Stage-2 train step on CPU with a small random Qwen2-VL: where the time goes, and packed vs padded throughput.

Run: ``.venv/bin/python benchmarks/bench_train_step.py [--steps 6] [--batch 8] [--counts long-tail|uniform]``

The model is the tiny offline kit widened (default LM hidden 512 x 4 layers) so that compute, not per-call
Python overhead, dominates the forward, as on a real model. Two short stage-2 runs on the same synthetic data,
one with post-rollout packing and one padded, each for ``--steps`` optimizer steps. Printed per run:
- the time split of the steps: rollout (HF generate), host pipeline (parse + match + targets + encoding),
  forward (+ loss), backward, other (optimizer step, dataloader, logging: the rest of the wall time), and the host
  share (target: under 5%);
- the packing fill ratio and the trained tokens/s over forward + backward (target: packed at least 1.5x padded
  when sample lengths vary 3x).
The first step of each run is a warm-up and is left out of the figures.

Object counts (``--counts``): ``long-tail`` (default) draws 1-8 shapes per image with most images holding one or
two, as in real detection sets (COCO's counts are long-tailed), so ``Y_train`` lengths span ~3x (about 160 to 460
tokens); ``uniform`` draws 0-8 uniformly. Packing can at best remove the padding, so the figure to compare
against is the padded run's ``computed / trained`` tokens (printed as the padding bound): with uniform lengths
and small batches that bound itself is below 1.5x (about 1.4x for uniform 0-8 at batch 4).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# --counts: (min objects, max objects, weight per count)
COUNT_WEIGHTS = {
    "long-tail": (1, 8, (0.35, 0.2, 0.12, 0.08, 0.07, 0.06, 0.06, 0.06)),
    "uniform": (0, 8, None),
}


def _config(tmp: Path, model: Path, data: Path, *, packing: bool, steps: int, batch: int) -> Path:
    config = {
        "extends": str(ROOT / "examples" / "stage2_cpu_hf.yaml"),
        "global_max_length": 4096,
        "model": {"path": str(model), "dtype": "float32", "attn_implementation": "sdpa"},
        "data": {"train_jsonl": str(data / "train.jsonl"), "val_jsonl": None},
        "training": {
            "output_dir": str(tmp / ("packed" if packing else "padded")),
            "per_device_train_batch_size": batch,
            "gradient_accumulation_steps": 1,
            "max_steps": steps + 1,
            "logging_steps": 1,
            "save_steps": 100000,
            "packing": packing,
            "packing_buffer": 256,
            "learning_rate": 1e-4,
        },
        "rollout_matching": {"rollout_backend": "hf", "decode_batch_size": batch, "max_new_tokens": 64},
    }
    path = tmp / f"{'packed' if packing else 'padded'}.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def run_one(config: Path) -> dict:
    from coordexp.runtime.train.launch import build_trainer
    from coordexp.schema.contract import load_contract

    from _step_clock import StepClock

    trainer = build_trainer(load_contract(config))
    started = time.perf_counter()
    clock = StepClock()
    trainer.add_callback(clock)
    trainer.train()
    step_walls = clock.walls
    logs = [h for h in trainer.state.log_history if "time/forward_s" in h][1:]  # drop the warm-up step
    total = sum(step_walls[1:])
    split = {k: sum(h.get(f"time/{k}_s", 0.0) for h in logs) for k in ("rollout", "host", "forward", "backward")}
    split["other"] = max(total - sum(split.values()), 0.0)
    tokens = sum(h["tokens/trained"] for h in logs)
    computed = sum(h["tokens/computed"] for h in logs)
    compute = split["forward"] + split["backward"]
    fills = [h["packing/fill_ratio"] for h in logs if "packing/fill_ratio" in h]
    return {
        "wall_s": total,
        "split_s": split,
        "host_share": split["host"] / total if total else 0.0,
        "trained_tokens": tokens,
        "computed_tokens": computed,
        "tokens_per_s": tokens / compute if compute else 0.0,
        "fill_ratio": sum(fills) / len(fills) if fills else None,
        "setup_s": time.perf_counter() - started - sum(step_walls),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--counts", choices=sorted(COUNT_WEIGHTS), default="long-tail",
                        help="object-count distribution of the synthetic images")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=512, help="language-model width of the random test model")
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()

    from coordexp.runtime.model.data import load_records
    from coordexp.runtime.toy.synthetic import write_synthetic_dataset
    from coordexp.runtime.toy.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = build_tiny_model(tmp / "model", seed=0, hidden_size=args.hidden, num_layers=args.layers)
        low, high, weights = COUNT_WEIGHTS[args.counts]
        dataset = write_synthetic_dataset(tmp / "data", n_train=args.samples, n_val=0, seed=5, min_objects=low,
                                          max_objects=high, count_weights=weights)
        counts = [len(r.objects) for r in load_records(dataset.train_jsonl)]
        histogram = " ".join(f"{k}:{counts.count(k)}" for k in range(low, high + 1))
        print(f"synthetic set: {len(counts)} images, objects per image {args.counts} ({histogram})")
        results = {}
        for packing in (True, False):
            name = "packed" if packing else "padded"
            results[name] = run_one(_config(tmp, model, dataset.root, packing=packing, steps=args.steps, batch=args.batch))

    print(f"\nTime split over {args.steps} steps (batch {args.batch}, random Qwen2-VL, LM hidden {args.hidden} x "
          f"{args.layers} layers, CPU), seconds")
    print(f"  {'run':<7} {'rollout':>8} {'host':>8} {'forward':>8} {'backward':>8} {'other':>8} {'host %':>7}")
    for name, r in results.items():
        s = r["split_s"]
        print(
            f"  {name:<7} {s['rollout']:>8.2f} {s['host']:>8.2f} {s['forward']:>8.2f} {s['backward']:>8.2f} "
            f"{s['other']:>8.2f} {100 * r['host_share']:>6.2f}%"
        )
    packed, padded = results["packed"], results["padded"]
    ratio = packed["tokens_per_s"] / padded["tokens_per_s"] if padded["tokens_per_s"] else float("nan")
    print("\nThroughput (trained tokens / forward+backward seconds)")
    print(f"  packed: {packed['tokens_per_s']:.0f} tok/s, fill ratio {packed['fill_ratio']:.3f}")
    print(f"  padded: {padded['tokens_per_s']:.0f} tok/s")
    bound = padded["computed_tokens"] / padded["trained_tokens"] if padded["trained_tokens"] else float("nan")
    print(f"  padding bound (padded run's computed / trained tokens): {bound:.2f}x")
    print(f"  packed/padded: {ratio:.2f}x (target >= 1.5x) -> {'OK' if ratio >= 1.5 else 'MISSED'}")
    worst_host = max(r["host_share"] for r in results.values())
    print(f"  host share (worst run): {100 * worst_host:.2f}% (target < 5%) -> {'OK' if worst_host < 0.05 else 'MISSED'}")
    print("\nJSON " + json.dumps(results))


if __name__ == "__main__":
    main()
