"""What the teacher-forced token figures cost (issue 28 item 3), as ratios against the work they sit next to.

Run: ``.venv/bin/python benchmarks/bench_token_figures.py [--vocab 152000] [--rows 480] [--val 8]``

1. ``training.token_type_metrics``, per training row: :func:`token_type_sums` on the supervised logit rows (a
   Qwen-sized vocabulary, ``--rows`` supervised positions, 30% of them coord slots) against the objective the step
   already computes on the same rows (``compute_objective`` forward + backward). Target: under 0.5x the objective
   (the forward and backward of the model itself, many times larger on a real model, are not counted).
2. Training evaluation of ``--val`` records on the tiny model (widened by ``--hidden``): the teacher-forced figures
   (one padded no-grad forward per ``per_device_eval_batch_size`` records) against the rollout evaluation the
   figures are reported next to (HF generate + log-probability scoring). Target: under 0.5x the rollout path.
Each figure is the median of ``--repeats`` timed runs after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def row_figures(pipeline, *, vocab: int, rows: int, repeats: int) -> dict:
    """Seconds of the per-type sums and of the objective (forward + backward) on the same supervised rows."""
    import numpy as np
    import torch

    from coordexp.runtime.core.objects import TokenSupervision
    from coordexp.runtime.model.losses import SupervisionBatch, SupervisionSegment, compute_objective
    from coordexp.runtime.model.token_types import token_type_sums

    gen = torch.Generator().manual_seed(0)
    coord_ids = torch.arange(vocab - 1000, vocab, dtype=torch.long)
    n_coord = (int(rows * 0.3) // 4) * 4
    coord_pos = np.arange(rows - n_coord, rows, dtype=np.int64)
    ids = torch.randint(0, vocab - 1000, (rows,), generator=gen)
    targets = torch.randint(0, 1000, (n_coord,), generator=gen)
    ids[coord_pos] = coord_ids[targets]
    sup = TokenSupervision(
        ce_positions=np.arange(rows - n_coord, dtype=np.int64), ce_weights=np.ones(rows - n_coord, np.float32),
        coord_positions=coord_pos, coord_targets=targets.numpy().astype(np.float32),
        bbox_slots=np.arange(n_coord, dtype=np.int64).reshape(-1, 4))
    batch = SupervisionBatch.from_segments([SupervisionSegment(sup, ids.tolist(), 0, 1)], rows + 1)
    keep, batch = batch.at_kept_positions()
    logits = torch.randn(1, int(keep.numel()), vocab, generator=gen, requires_grad=True)

    def objective():
        compute_objective(logits, batch, coord_ids, pipeline).total.backward()
        logits.grad = None

    return {"objective_s": _median_seconds(objective, repeats),
            "token_figures_s": _median_seconds(lambda: token_type_sums(logits, batch, coord_ids), repeats)}


def eval_figures(trainer, records, *, repeats: int) -> dict:
    """Seconds of the teacher-forced figures and of the rollout evaluation of the same records."""
    def rollouts():
        for _ in trainer.scored_chunks(records):
            pass

    return {"rollout_eval_s": _median_seconds(rollouts, repeats),
            "teacher_forced_s": _median_seconds(lambda: trainer.teacher_forced_sums(records), repeats)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=152_000, help="vocabulary of the synthetic logit rows")
    parser.add_argument("--rows", type=int, default=480, help="supervised positions per training row")
    parser.add_argument("--val", type=int, default=8, help="validation records")
    parser.add_argument("--hidden", type=int, default=256, help="language-model width of the random test model")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from coordexp.runtime.model.data import load_records
    from coordexp.runtime.toy.synthetic import write_synthetic_dataset
    from coordexp.runtime.toy.tiny_model import build_tiny_model
    from coordexp.runtime.train.launch import build_trainer
    from coordexp.schema.contract import load_contract

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = build_tiny_model(tmp / "model", seed=0, hidden_size=args.hidden)
        data = write_synthetic_dataset(tmp / "data", n_train=2, n_val=args.val, seed=5)
        config = tmp / "cfg.yaml"
        config.write_text(yaml.safe_dump({
            "extends": str(ROOT / "examples" / "stage2_cpu_hf.yaml"), "global_max_length": 2048,
            "custom": {"trainer_variant": "stage1_sft"},
            "model": {"path": str(model), "dtype": "float32", "attn_implementation": "sdpa"},
            "data": {"train_jsonl": str(data.train_jsonl), "val_jsonl": str(data.val_jsonl)},
            "training": {"output_dir": str(tmp / "run"), "packing": False, "per_device_eval_batch_size": 4},
            "rollout_matching": {"decode_batch_size": 4, "max_new_tokens": args.max_new_tokens},
        }), encoding="utf-8")
        trainer = build_trainer(load_contract(config))
        try:
            records = load_records(data.val_jsonl)
            evaluation = eval_figures(trainer, records, repeats=args.repeats)
            rows = row_figures(trainer.run.rollout_matching.pipeline, vocab=args.vocab, rows=args.rows,
                               repeats=args.repeats)
        finally:
            trainer.backend.close()
    summary = {
        "rows": {**rows, "ratio": rows["token_figures_s"] / rows["objective_s"], "vocab": args.vocab,
                 "supervised": args.rows},
        "eval": {**evaluation, "ratio": evaluation["teacher_forced_s"] / evaluation["rollout_eval_s"],
                 "records": len(records), "max_new_tokens": args.max_new_tokens},
    }
    print(f"per training row: token figures {rows['token_figures_s'] * 1e3:.1f} ms vs objective fwd+bwd "
          f"{rows['objective_s'] * 1e3:.1f} ms -> {summary['rows']['ratio']:.2f}x (target < 0.5x)")
    print(f"evaluation of {len(records)} records: teacher-forced {evaluation['teacher_forced_s']:.2f} s vs rollout "
          f"{evaluation['rollout_eval_s']:.2f} s -> {summary['eval']['ratio']:.2f}x (target < 0.5x)")
    print("JSON " + json.dumps(summary))


if __name__ == "__main__":
    main()
