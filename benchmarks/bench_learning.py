"""Does stage 2 make the detector better? Stage 1 to a fixed budget, then from that one checkpoint K steps of
stage 2 and, for comparison, K steps of stage 1 continued (same batch, same learning rate, same schedule); COCO
AP/AP50 and the rollout counters of all three on held-out images, plus trained tokens and wall time.

It reports what it measures, whichever way it goes. Defaults: the measured recipe of docs/design.md (decision 10):
2,048 position-coded synthetic images of 1-2 rectangles/triangles, the demo's tiny model and configs
(examples/demo_stage*.yaml), stage 1 for 1,500 steps at lr 1e-3 (about 5 minutes on 2 CPU cores; measured stage-1
box AP50 15.4% on 64 held-out images, 5.6 minutes for the whole run); ``--train-jsonl/--val-jsonl`` run it on
any converted COCO-style set (then ``--model`` must name a checkpoint whose processor fits those images).
Everything is written under ``--workdir``.

    python benchmarks/bench_learning.py                       # the documented recipe (CPU, about 6 minutes)
    python benchmarks/bench_learning.py --stage1-steps 4 --k 2 --n-train 16 --n-val 4 --max-new-tokens 48  # smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=ROOT / ".coordexp" / "bench_learning")
    p.add_argument("--n-train", type=int, default=2048)
    p.add_argument("--n-val", type=int, default=64, help="held-out images every checkpoint is evaluated on")
    p.add_argument("--image-size", type=int, default=112)
    p.add_argument("--min-objects", type=int, default=1)
    p.add_argument("--max-objects", type=int, default=2)
    p.add_argument("--shapes", default="rectangle,triangle")
    p.add_argument("--position-code", type=float, default=100.0,
                   help="amplitude (8-bit levels) of the synthetic images' pixel position code; 0 = none")
    p.add_argument("--family", default="qwen2_vl", choices=("qwen2_vl", "qwen2_5_vl", "qwen3_vl"),
                   help="tiny model family (ignored with --model); qwen3_vl needs --image-size 128 for the position "
                   "code to survive its 32 px resize (docs/design.md, decision 10)")
    p.add_argument("--hidden", type=int, default=128, help="language model width (multiple of 64)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--vision-depth", type=int, default=1)
    p.add_argument("--vision-width", type=int, default=64)
    p.add_argument("--vision-init-std", type=float, default=0.2)
    p.add_argument("--stage1-steps", type=int, default=1500)
    p.add_argument("--stage1-lr", type=float, default=1e-3)
    p.add_argument("--stage1-batch", type=int, default=8)
    p.add_argument("--k", type=int, default=40, help="steps of stage 2 and of stage 1 continued")
    p.add_argument("--continue-lr", type=float, default=2e-4, help="constant lr of both continuations")
    p.add_argument("--continue-batch", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--score", default="logprob", choices=("logprob", "mean_logprob", "constant"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-jsonl", type=Path, help="a converted COCO-style train set (instead of synthetic shapes)")
    p.add_argument("--val-jsonl", type=Path, help="its held-out split")
    p.add_argument("--model", type=Path, help="starting checkpoint (default: build the demo's tiny model)")
    return p.parse_args()


def _assets(args: argparse.Namespace) -> tuple[Path, Path, Path]:
    """(model dir, train jsonl, val jsonl): the given ones, or the tiny model and synthetic shapes built here."""
    from coordexp.runtime.toy.synthetic import write_synthetic_dataset
    from coordexp.runtime.toy.tiny_model import build_tiny_model

    work = args.workdir
    model = args.model
    if model is None:
        model = work / "model"
        if not (model / "config.json").is_file():
            build_tiny_model(model, family=args.family, seed=args.seed, hidden_size=args.hidden, num_layers=args.layers, init_std=0.02,
                             vision_init_std=args.vision_init_std, smooth_coord_embeddings=True,
                             rope_theta=args.rope_theta, vision_depth=args.vision_depth,
                             vision_width=args.vision_width)
    if args.train_jsonl is not None:
        if args.val_jsonl is None:
            raise SystemExit("--train-jsonl needs --val-jsonl (held-out images)")
        return model, args.train_jsonl.resolve(), args.val_jsonl.resolve()
    data = work / "data"
    if not (data / "val.jsonl").is_file():
        write_synthetic_dataset(data, n_train=args.n_train, n_val=args.n_val, seed=args.seed,
                                image_size=(args.image_size, args.image_size), min_objects=args.min_objects,
                                max_objects=args.max_objects, shapes=tuple(args.shapes.split(",")),
                                position_code=args.position_code)
    return model, data / "train.jsonl", data / "val.jsonl"


def _config(args: argparse.Namespace, name: str, base: str, model: Path, train: Path, val: Path,
            training: dict[str, Any]) -> Path:
    # the whole image at the family's resolution: its side rounded up to whole merged tokens (28 px, Qwen3-VL 32 px)
    merged = 32 if args.family == "qwen3_vl" else 28
    pixels = (-(-args.image_size // merged) * merged) ** 2
    config = {
        "extends": str(EXAMPLES / base),
        "model": {"path": str(model)},
        "template": {"max_pixels": pixels, "min_pixels": min(3136, pixels)},
        "data": {"train_jsonl": str(train), "val_jsonl": str(val), "image_root": None},
        "training": {"output_dir": str(args.workdir / name), "seed": args.seed, "save_steps": 1_000_000, "logging_steps": 1,
                     "eval_steps": None, **training},
        "rollout_matching": {"max_new_tokens": args.max_new_tokens},
    }
    path = args.workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def _progress(every: int = 50) -> Any:
    """A callback printing the step, loss and elapsed time every ``every`` steps (long runs stay observable)."""
    from transformers import TrainerCallback

    class Progress(TrainerCallback):
        started = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs and state.global_step % every == 0:
                print(f"  step {state.global_step}/{state.max_steps} loss {logs['loss']:.4f} "
                      f"({time.perf_counter() - self.started:.0f}s)", flush=True)

    return Progress()


def _train(config: Path) -> dict[str, Any]:
    from coordexp.runtime.train.launch import run_training
    from coordexp.schema.contract import load_contract

    run = load_contract(config)
    shutil.rmtree(run.training.output_dir, ignore_errors=True)
    started = time.perf_counter()
    outcome = run_training(run, callbacks=[_progress()], print_logs=False)
    history = outcome.log_history
    return {"steps": outcome.global_step, "wall_s": time.perf_counter() - started,
            "trained_tokens": int(sum(h.get("tokens/trained", 0) for h in history)),
            "final_loss": next((h["loss"] for h in reversed(history) if "loss" in h), None)}


def _evaluate(args: argparse.Namespace, config: Path, name: str) -> dict[str, Any]:
    from coordexp.runtime.train.evaluate import run_evaluation
    from coordexp.schema.contract import load_contract

    run = load_contract(config)
    run = dataclasses.replace(run, model=run.model.model_copy(update={"path": run.training.output_dir}))
    started = time.perf_counter()
    report = run_evaluation(run, split="val", score=args.score, out_dir=args.workdir / f"eval_{name}", png_count=2)
    ratios = report.counters.ratios()
    return {"AP": report.bbox["AP"], "AP50": report.bbox["AP50"], "AR100": report.bbox["AR100"],
            "mask_AP50": None if report.segm is None else report.segm["AP50"],
            "parse_valid_rate": ratios["parse_valid_rate"], "match_rate": ratios["match_rate"],
            "valid_objects": report.counters.pred_valid, "gt_objects": report.counters.gt_objects,
            "eval_s": time.perf_counter() - started}


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def main() -> None:
    args = _args()
    args.workdir = args.workdir.resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model, train, val = _assets(args)
    stage1 = _config(args, "stage1", "demo_stage1.yaml", model, train, val, {
        "max_steps": args.stage1_steps, "learning_rate": args.stage1_lr,
        "per_device_train_batch_size": args.stage1_batch})
    continued = {"max_steps": args.k, "learning_rate": args.continue_lr, "lr_scheduler_type": "constant",
                 "warmup_ratio": 0.0, "per_device_train_batch_size": args.continue_batch}
    stage1_dir = args.workdir / "stage1"
    stage2 = _config(args, "stage2", "demo_stage2.yaml", stage1_dir, train, val, continued)
    stage1_more = _config(args, "stage1_continued", "demo_stage1.yaml", stage1_dir, train, val, continued)

    runs: dict[str, dict[str, Any]] = {}
    for name, config in (("stage1", stage1), ("stage2", stage2), ("stage1_continued", stage1_more)):
        print(f"[bench_learning] training {name} ...", flush=True)
        runs[name] = {"train": _train(config)}
        runs[name]["eval"] = _evaluate(args, config, name)
        e = runs[name]["eval"]
        print(f"[bench_learning] {name}: AP {_pct(e['AP'])} AP50 {_pct(e['AP50'])} match {_pct(e['match_rate'])}",
              flush=True)

    print(f"\nheld-out images: {args.n_val}; box AP in percent (COCO); continuations: {args.k} steps each")
    header = f"{'run':<18}{'steps':>7}{'AP':>7}{'AP50':>7}{'AR100':>7}{'parse%':>8}{'match%':>8}{'tokens':>10}{'train s':>9}"
    print(header)
    for name, figures in runs.items():
        t, e = figures["train"], figures["eval"]
        print(f"{name:<18}{t['steps']:>7}{_pct(e['AP']):>7}{_pct(e['AP50']):>7}{_pct(e['AR100']):>7}"
              f"{_pct(e['parse_valid_rate']):>8}{_pct(e['match_rate']):>8}{t['trained_tokens']:>10}{t['wall_s']:>9.0f}")
    summary = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "runs": runs,
               "total_s": time.perf_counter() - started}
    (args.workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print("JSON " + json.dumps(summary))


if __name__ == "__main__":
    main()
