"""Does stage 2 make the detector better? Per seed: stage 1 to a fixed budget, then from that one checkpoint K steps
of stage 2 and, for comparison, K steps of stage 1 continued (same batch, optimizer, learning rate and schedule:
the budget is K optimizer steps of the same records; trained tokens and wall time are reported next to it), and
any ``--variant`` continuations; COCO AP/AP50 and the rollout counters of every run on held-out images. Several
seeds (data, model and training seed together); per-seed rows, the mean and spread over seeds, and every run's
paired differences against the control (stage 1 continued) with standard error, 95% t interval and sign counts.

The control, ``stage1_continued``, is the stage-2 config with ``rollout_matching.gt_step_share: 1.0``: the same
trainer, packing, decode batch and data order, only the rollouts replaced by the ground truth (each step's record
hash in the run's ``run_metadata.jsonl`` is checked equal across continuations). Every checkpoint is evaluated with
ONE evaluation config (``eval.yaml``: the stage-2 config and ``--set``; a ``--variant`` changes training only).

It reports what it measures, whichever way it goes. Defaults: the documented recipe of docs/design.md (decision 15):
the ``shapes`` task (2,048 position-coded synthetic images of 1-2 rectangles/triangles, decision 10), the demo's tiny
model and configs (examples/demo_stage*.yaml), stage 1 for 1,500 steps at lr 1e-3, continuations at lr 2e-5 for 200
steps (stage 2 as demo_stage2.yaml says: every other step trains the ground truth), 256 held-out images, 3 seeds;
``stage2_rollout_only`` is the same stage 2 with rollouts at every step (the spec's). ``--task dense`` holds 3-6
objects per image (long outputs where stage 1's rollouts miss and repeat). ``--task grid`` (docs/design.md,
decision 17): one class of boxes on a grid of 28 px cells (``--grid CELLS:MIN-MAX``, default 4:4-12; 6:8-20 on a
GPU), ground truth in row-major order; arms ``stage1_continued`` (control), ``stage1_gap`` (the second control:
gap-augmented ground truth, data.gt_prefix_mix), ``stage2`` (the spec as written: gt_step_share 0,
trailing_unmatched keep, both recipe CE weights 0), ``stage2_drop`` (decision 17's) and ``stage2_recipe``
(demo_stage2.yaml, what ``coordexp init --stage 2`` writes); every ``eval`` adds the set figures and probes
(:mod:`coordexp.runtime.core.set_figures`, :mod:`coordexp.runtime.train.probe`), stage 1 is held to a pilot gate,
paired differences are taken against both controls and ``stage2_drop`` with decision 18's rule, and
``recall_by_rank.png`` is written.
Issue 53's campaign: ``--dense`` (the grid at 5:10-20), ``--long-multiple K`` (``stage1_long``, the control at K x
the steps) and ``--tune-decoding N``: every arm's repetition_penalty (1.0 / 1.05 / 1.1) and near-repeat removal
chosen on N held-out tuning images generated apart from the test images, its ``tuned`` figures on the test images
beside the default decoding's (docs/figures.md). Every evaluation carries recall and premature EOS per ground-truth
object count (``count_buckets``: 1-6, 7-10, 11+). The report names the arm ``coordexp init --stage 2`` writes
``stage2_shipped`` (``stage2_recipe``; an alias, not another run) and applies the part of issue 53's rule its setting
decides (``beats_detector``; ``benchmarks/_campaign_report.py``).
``--train-jsonl/--val-jsonl`` run it on any converted COCO-style set (then ``--model`` must name a checkpoint whose
processor fits those images). Everything is written under ``--workdir``.

    python benchmarks/bench_learning.py                       # the documented recipe (CPU, about 25 minutes)
    python benchmarks/bench_learning.py --seed 10             # seeds 10, 11, 12
    python benchmarks/bench_learning.py --variant sampled=rollout_matching.decoding.temperature:0.7
    python benchmarks/bench_learning.py --variant reward=rollout_matching.objective:reward  # decision 19's objective
    python benchmarks/bench_learning.py --stage1-steps 4 --k 2 --n-train 16 --n-val 4 --max-new-tokens 48  # smoke
    python benchmarks/bench_learning.py --task grid --seed 100 --n-seeds 1      # one grid seed (~16 min, 2 cores)
    python benchmarks/bench_learning.py --report WORKDIR/summary.json            # re-summarize a finished run
    python benchmarks/bench_learning.py --report A/summary.json B/summary.json --workdir AB   # two runs' seeds as one
    python benchmarks/bench_learning.py --task grid --workdir W --add-arms --variant NAME=KEY:VALUE  # one more arm
    python benchmarks/bench_learning.py --task grid --dense --tune-decoding 64   # dense scenes, decoding tuned per arm
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _decoding_tuning as decoding_tuning  # noqa: E402
from _campaign_report import DENSE_GRID, extend_summary, print_campaign  # noqa: E402
from _learning_options import SAME_FOR_ADDED, merge_runs, override  # noqa: E402
from _learning_options import parse_setting as _setting, parse_variant as _variant, reward_decoding  # noqa: E402
from _learning_report import CONTROL, FIGURES, print_tables, summarize, write_png  # noqa: E402

# (min objects, max objects, image side, max new tokens) per task; grid: from --grid and the tokenizer
TASKS = {"shapes": (1, 2, 112, 128), "dense": (3, 6, 112, 384), "grid": (4, 12, 112, None)}
# the treatment of each continuation: overrides of the stage-2 config (demo_stage2.yaml)
CONTROL_KEYS = [(["rollout_matching", "gt_step_share"], 1.0)]
# the second control (docs/design.md, decision 18): the same steps of stage 1 with gap-augmented ground truth at
# upstream's ET-RMP-CE mixture (empty / random subset / leave-one-out / full prefix = 30 / 45 / 20 / 5)
GAP_KEYS = CONTROL_KEYS + [(["data", "gt_prefix_mix"], {"none": 0.3, "random_subset": 0.45, "leave_one_out": 0.2,
                                                         "all": 0.05})]
# the spec as written: rollouts at every step, the rollout's tail kept, both recipe CE weights at the spec's 0
_SPEC_CE = [(["rollout_matching", "pipeline", "objective", "0", "config", "rollout_fn_desc_weight"], 0.0),
            (["rollout_matching", "pipeline", "objective", "0", "config", "rollout_matched_prefix_struct_weight"], 0.0)]
SPEC_STAGE2 = [(["rollout_matching", "gt_step_share"], 0.0), (["rollout_matching", "trailing_unmatched"], "keep"),
               *_SPEC_CE]
# decision 17's stage2_drop: rollouts at every step, the prefix cut after the last match (recipe CE weights)
DROP_STAGE2 = [(["rollout_matching", "gt_step_share"], 0.0), (["rollout_matching", "trailing_unmatched"], "drop")]


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options (``argv``: given by another benchmark, e.g. bench_rollout.py --drafts; None: the command line)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=ROOT / ".coordexp" / "bench_learning")
    p.add_argument("--seed", type=int, default=0, help="first seed; the run uses --n-seeds consecutive seeds")
    p.add_argument("--n-seeds", type=int, default=3)
    p.add_argument("--task", default="shapes", choices=tuple(TASKS),
                   help="shapes: 1-2 objects per image; dense: 3-6 (sets --min/--max-objects, --max-new-tokens); "
                   "grid: one class of boxes on a grid of cells (--grid)")
    p.add_argument("--grid", default="4:4-12", metavar="CELLS:MIN-MAX",
                   help="grid task: CELLS x CELLS cells of 28 px (32 for qwen3_vl), MIN-MAX of them occupied; "
                   "4:4-12 on CPU, 6:8-20 on a GPU")
    p.add_argument("--object-order", default="keep", choices=("keep", "random"),
                   help="data.object_order of training: keep = the reading order (row-major on the grid task)")
    p.add_argument("--probe-images", type=int, default=None,
                   help="grid task: held-out images the probes decode (default: all --n-val)")
    p.add_argument("--eval-batch", type=int, default=16, help="decode batch of the shared evaluation config")
    p.add_argument("--report", type=Path, nargs="+",
                   help="only re-summarize this summary.json (tables, paired CIs, PNG); several: their seeds as one "
                   "run, written to WORKDIR/summary.json (runs made with the same options, seeds apart)")
    p.add_argument("--n-train", type=int, default=2048)
    p.add_argument("--n-val", type=int, default=256, help="held-out images every checkpoint is evaluated on")
    p.add_argument("--image-size", type=int, default=None)
    p.add_argument("--min-objects", type=int, default=None)
    p.add_argument("--max-objects", type=int, default=None)
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
    p.add_argument("--k", type=int, default=200, help="optimizer steps of every continuation")
    p.add_argument("--continue-lr", type=float, default=2e-5, help="constant lr of every continuation")
    p.add_argument("--continue-batch", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--decode-batch", type=int, default=None,
                   help="rollout_matching.decode_batch_size of every run (evaluation decodes in chunks of it; on a GPU "
                   "raise it: a chunk's decode time hardly grows with its rows); default: the example configs'")
    p.add_argument("--score", default="logprob", choices=("logprob", "mean_logprob", "constant"))
    p.add_argument("--variant", type=_variant, action="append", default=[], metavar="NAME=KEY:VALUE[;KEY:VALUE]",
                   help="one more stage-2 continuation with these config overrides (dotted keys), e.g. "
                   "sampled=rollout_matching.decoding.temperature:0.7; repeatable")
    p.add_argument("--set", type=_setting, action="append", default=[], metavar="KEY:VALUE", dest="settings",
                   help="a config override for every run, stage 1 included (dotted key), e.g. "
                   "rollout_matching.hf_generate.compile:false; repeatable")
    p.add_argument("--passed-gate-only", action="store_true",
                   help="with --report: summarize only the seeds whose stage 1 passed the pilot gate (the others' "
                   "comparisons are no result); the seeds left out are named")
    p.add_argument("--stop-at-failed-gate", action="store_true",
                   help="grid task: when a seed's stage 1 fails the pilot gate, train none of its continuations (the "
                   "seed is reported with its gate and left out of every comparison)")
    p.add_argument("--add-arms", action="store_true",
                   help="the workdir holds a finished run (summary.json): train and evaluate only the --variant arms "
                   "of each of its seeds from the saved stage-1 checkpoint, add them and re-summarize (the other "
                   "options must equal the run's)")
    p.add_argument("--dense", action="store_true",
                   help="grid task, the dense setting (issue 53): --grid " + DENSE_GRID + " (more objects per image, "
                   "where stage 1 stops early: on calibration seeds 200-201 it passed the gate with premature EOS 10.5%% "
                   "and 24.6%%; the default arms took about 30 minutes per seed, two side by side on 2 cores)")
    p.add_argument("--long-multiple", type=float, default=None, metavar="K",
                   help="grid task: also train stage1_long, stage 1 continued for K x --k steps (the control at the "
                   "treatment's compute: K from the screen's wall-time multiple of the best treatment)")
    p.add_argument("--grid-arms", default=None, metavar="NAME,NAME",
                   help="grid task: the default arms to train besides the control (stage1_continued, always), e.g. "
                   "stage2_recipe; default: stage1_gap, stage2, stage2_drop, stage2_recipe (a screen of --variant "
                   "arms can leave the others out)")
    p.add_argument("--tune-decoding", type=int, default=None, metavar="N",
                   help="issue 53: choose every arm's decoding (repetition_penalty 1.0 / 1.05 / 1.1, near repeats "
                   "removed or not) on N held-out tuning images apart from the test images (a split generated with "
                   "seed -(seed+1); --tune-jsonl with --val-jsonl), and report the test figures at it under 'tuned', "
                   "beside the default decoding's (benchmarks/_decoding_tuning.py)")
    p.add_argument("--tune-jsonl", type=Path, default=None,
                   help="with --val-jsonl and --tune-decoding N: the tuning split (its first N records), used neither "
                   "for training nor as --val-jsonl; its image paths resolve as --val-jsonl's do")
    p.add_argument("--no-stage1-continued", action="store_true", help="skip the stage-1 continuation")
    p.add_argument("--no-rollout-only", action="store_true",
                   help="skip stage2_rollout_only (the recipe's stage 2 with rollouts at every step, gt_step_share 0)")
    p.add_argument("--train-jsonl", type=Path, help="a converted COCO-style train set (instead of synthetic shapes)")
    p.add_argument("--val-jsonl", type=Path, help="its held-out split")
    p.add_argument("--model", type=Path, help="starting checkpoint (default: build the demo's tiny model)")
    args = p.parse_args(argv)
    if args.dense:
        if args.task != "grid":
            p.error("--dense is the grid task's dense setting: add --task grid")
        args.grid = DENSE_GRID
    if args.long_multiple is not None and not 1.0 < args.long_multiple <= 100.0:
        p.error(f"--long-multiple {args.long_multiple}: give a multiple of --k above 1 (at most 100)")
    decoding_tuning.check_args(args, p.error)
    args.max_new_tokens_given = args.max_new_tokens is not None
    low, high, side, tokens = TASKS[args.task]
    if args.task == "grid":
        try:
            cells, _, span = args.grid.partition(":")
            low, high = (int(x) for x in span.split("-"))
            args.cells = int(cells)
        except ValueError:
            p.error(f"--grid {args.grid!r}: write CELLS:MIN-MAX, e.g. 4:4-12")
        args.cell_px = 32 if args.family == "qwen3_vl" else 28
        side = args.cells * args.cell_px
    args.min_objects = low if args.min_objects is None else args.min_objects
    args.max_objects = high if args.max_objects is None else args.max_objects
    args.image_size = side if args.image_size is None else args.image_size
    args.max_new_tokens = tokens if args.max_new_tokens is None else args.max_new_tokens
    return args


def _assets(args: argparse.Namespace, work: Path, seed: int) -> tuple[Path, Path, Path]:
    """(model dir, train jsonl, val jsonl): the given ones, or the tiny model and synthetic shapes of ``seed``."""
    from coordexp.runtime.toy.synthetic import write_synthetic_dataset
    from coordexp.runtime.toy.tiny_model import build_tiny_model

    model = args.model
    if model is None:
        model = work / "model"
        if not (model / "config.json").is_file():
            build_tiny_model(model, family=args.family, seed=seed, hidden_size=args.hidden, num_layers=args.layers,
                             init_std=0.02, vision_init_std=args.vision_init_std, smooth_coord_embeddings=True,
                             rope_theta=args.rope_theta, vision_depth=args.vision_depth,
                             vision_width=args.vision_width)
    if args.train_jsonl is not None:
        if args.val_jsonl is None:
            raise SystemExit("--train-jsonl needs --val-jsonl (held-out images)")
        return model, args.train_jsonl.resolve(), args.val_jsonl.resolve()
    data = work / "data"
    if args.task == "grid" and not (data / "val.jsonl").is_file():
        from coordexp.runtime.toy.grid import GridLayout, write_grid_dataset

        write_grid_dataset(data, n_train=args.n_train, n_val=args.n_val, seed=seed, position_code=args.position_code,
                           layout=GridLayout(args.cells, args.cell_px, args.min_objects, args.max_objects))
    elif not (data / "val.jsonl").is_file():
        write_synthetic_dataset(data, n_train=args.n_train, n_val=args.n_val, seed=seed,
                                image_size=(args.image_size, args.image_size), min_objects=args.min_objects,
                                max_objects=args.max_objects, shapes=tuple(args.shapes.split(",")),
                                position_code=args.position_code)
    return model, data / "train.jsonl", data / "val.jsonl"


def _config(args: argparse.Namespace, work: Path, name: str, base: str, model: Path, train: Path, val: Path,
            seed: int, training: dict[str, Any], overrides: list[tuple[list[str], Any]] = ()) -> Path:
    # the whole image at the family's resolution: its side rounded up to whole merged tokens (28 px, Qwen3-VL 32 px)
    merged = 32 if args.family == "qwen3_vl" else 28
    pixels = (-(-args.image_size // merged) * merged) ** 2
    config = {
        "extends": str(EXAMPLES / base),
        "model": {"path": str(model)},
        "template": {"max_pixels": pixels, "min_pixels": min(3136, pixels)},
        "data": {"train_jsonl": str(train), "val_jsonl": str(val), "image_root": None},
        "training": {"output_dir": str(work / name), "seed": seed, "save_steps": 1_000_000, "logging_steps": 1,
                     "eval_steps": None, **training},
        "rollout_matching": {"max_new_tokens": args.max_new_tokens},
    }
    if args.object_order != "keep":
        config["data"]["object_order"] = args.object_order
    if args.decode_batch is not None:
        config["rollout_matching"]["decode_batch_size"] = args.decode_batch
    overrides = [*getattr(args, "sized", []), *args.settings, *reward_decoding(overrides), *overrides]
    if overrides:
        from coordexp.schema.loader import load_merged

        merged = load_merged(EXAMPLES / base).data
        for keys, value in overrides:
            override(config, merged, keys, value)
    path = work / f"{name}.yaml"
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
    rewards = [h["reward/mean"] for h in history if "reward/mean" in h]  # the reward objective's arms only
    return {"steps": outcome.global_step, "wall_s": time.perf_counter() - started,
            "trained_tokens": int(sum(h.get("tokens/trained", 0) for h in history)),
            "final_loss": next((h["loss"] for h in reversed(history) if "loss" in h), None),
            "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            # does the reward rise, do the rollouts run on: the first and last quarter of the logged windows
            "reward_quarters": _quarters(history, "reward/mean"),
            "cut_off_quarters": _quarters(history, "rollout/cut_off_rate")}


def _quarters(history: list[dict[str, Any]], key: str) -> list[float] | None:
    """[mean of the first quarter, mean of the last quarter] of the windows that logged ``key`` (None: under 4)."""
    values = [float(h[key]) for h in history if isinstance(h.get(key), (int, float))]
    if len(values) < 4:
        return None
    quarter = len(values) // 4
    return [sum(values[:quarter]) / quarter, sum(values[-quarter:]) / quarter]


def _evaluate(args: argparse.Namespace, work: Path, eval_config: Path, name: str) -> dict[str, Any]:
    """Checkpoint ``work/name`` under the ONE evaluation config of the seed (``eval.yaml``), whatever the arm."""
    from coordexp.runtime.train.evaluate import run_evaluation
    from coordexp.schema.contract import load_contract

    run = load_contract(eval_config)
    run = dataclasses.replace(run, model=run.model.model_copy(update={"path": str(work / name)}))
    started = time.perf_counter()
    if args.task == "grid":
        from coordexp.runtime.toy.probe_run import evaluate_arm

        return evaluate_arm(run, out_dir=work / f"eval_{name}", cells=args.cells, score=args.score,
                            probe_images=args.probe_images)
    report = run_evaluation(run, split="val", score=args.score, out_dir=work / f"eval_{name}", png_count=2,
                            dedup=True)
    ratios = report.counters.ratios()
    return {"AP": report.bbox["AP"], "AP50": report.bbox["AP50"], "AR100": report.bbox["AR100"],
            "mask_AP50": None if report.segm is None else report.segm["AP50"],
            **{k: ratios[k] for k in FIGURES[2:]}, "dedup": report.dedup,
            **{k: v for k, v in report.figures.items() if k != "recall_by_rank"},  # count_buckets included
            "dropped": dict(report.counters.dropped_by_reason),
            "valid_objects": report.counters.pred_valid, "gt_objects": report.counters.gt_objects,
            "eval_s": time.perf_counter() - started}


def _size_decoding(args: argparse.Namespace, model: Path) -> None:
    """Grid task: the repeat guard's object cap (the most objects plus half again, at least 4 more: duplicates and
    run-ons stay visible) and ``max_new_tokens`` from the token count of that many entries plus 16, so neither the
    guard nor the length limit hides an object the image holds."""
    from transformers import AutoTokenizer

    from coordexp.runtime.core.objects import DetObject
    from coordexp.runtime.core.serialize import serialize_objects

    keys = args.max_objects + max(4, args.max_objects // 2)
    box = DetObject("box", "bbox_2d", (990, 990, 999, 999))
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    longest = len(tokenizer.encode(serialize_objects([box] * (keys + 1)), add_special_tokens=False))
    if not args.max_new_tokens_given:
        args.max_new_tokens = longest + 16
    args.sized = [(["rollout_matching", "repeat_terminate", "max_object_keys"], keys)]


def continuation_plan(args: argparse.Namespace) -> list[tuple[str, list[tuple[list[str], Any]]]]:
    """(name, overrides of demo_stage2.yaml) of every continuation; the control first on the grid task."""
    if args.task == "grid":
        plan = [(CONTROL, CONTROL_KEYS), ("stage1_gap", GAP_KEYS), ("stage2", SPEC_STAGE2),
                ("stage2_drop", DROP_STAGE2), ("stage2_recipe", [])]
        if getattr(args, "grid_arms", None):
            wanted = {name.strip() for name in args.grid_arms.split(",") if name.strip()}
            unknown = wanted - {name for name, _ in plan}
            if unknown:
                raise SystemExit(f"--grid-arms: no default arm {', '.join(sorted(unknown))}; the grid task's are "
                                 + ", ".join(name for name, _ in plan[1:]))
            plan = [(name, keys) for name, keys in plan if name == CONTROL or name in wanted]
        if getattr(args, "long_multiple", None):  # the control at the treatment's compute: K x the steps
            plan.insert(1, ("stage1_long", CONTROL_KEYS + [(["training", "max_steps"],
                                                            int(round(args.long_multiple * args.k)))]))
    else:
        plan = [("stage2", [])]
        if not args.no_rollout_only:  # the spec's stage 2: every step trains rollouts
            plan.append(("stage2_rollout_only", [(["rollout_matching", "gt_step_share"], 0.0)]))
        if not args.no_stage1_continued:
            plan.append((CONTROL, CONTROL_KEYS))
    return plan + [(name, list(overrides)) for name, overrides in args.variant]


def _data_order(work: Path, names: list[str]) -> dict[str, Any]:
    """Whether every continuation trained the control's records step for step (``step_records`` of the run logs)."""
    from coordexp.runtime.train.run_log import read_run_log

    steps = {n: [(r["global_step"], r["hash"]) for r in read_run_log(work / n, event="step_records")] for n in names}
    reference = steps.get(CONTROL) or next(iter(steps.values()), [])
    differ = [n for n, s in steps.items() if s != reference]
    return {"equal": not differ and bool(reference), "steps": len(reference), "differ": differ}


def add_arms(args: argparse.Namespace, saved: dict[str, Any]) -> None:
    """Train and evaluate the ``--variant`` arms on every seed of a finished run (``saved``, its summary.json) from
    that seed's stage-1 checkpoint, under the seed's one evaluation config; the seed's data order is checked again
    over every continuation on disk. A seed stopped at its gate gets no arm: the report leaves it out anyway."""
    if not args.variant:
        raise SystemExit("--add-arms needs at least one --variant")
    printable = _printable(args)
    same = [k for k in SAME_FOR_ADDED if k != "max_new_tokens" or args.max_new_tokens_given]  # else sized per seed
    differ = [k for k in same + ["max_new_tokens_given"] if printable.get(k) != saved["args"].get(k)]
    if differ:
        raise SystemExit("--add-arms: these options differ from the run's (pass the run's own): " + ", ".join(
            f"{k} {printable.get(k)!r} != {saved['args'].get(k)!r}" for k in differ))
    for out in saved["seeds"]:
        seed, runs = out["seed"], out["runs"]
        if out.get("stopped"):
            print(f"[bench_learning] seed {seed}: {out['stopped']}, no arm added (it is in no comparison)", flush=True)
            continue
        clash = [name for name, _ in args.variant if name in runs]
        if clash:
            raise SystemExit(f"--add-arms: seed {seed} already has {', '.join(clash)}")
        work = args.workdir / f"seed{seed}"
        stage1_dir = work / "stage1"
        if not (stage1_dir / "config.json").is_file():
            raise SystemExit(f"--add-arms: {stage1_dir} holds no saved stage-1 checkpoint")
        _, train, val, eval_config = _seed_inputs(args, work, seed)
        tuning = decoding_tuning.prepare(args, work, seed, eval_config)
        for name, overrides in args.variant:
            config = _config(args, work, name, "demo_stage2.yaml", stage1_dir, train, val, seed, _continued(args),
                             list(overrides))
            runs[name] = _train_and_evaluate(args, work, seed, name, config, eval_config, added=True, tuning=tuning)
        out["data_order"] = _data_order(work, [n for n in runs if n != "stage1"])
    saved["args"]["variant"] = saved["args"].get("variant", []) + printable["variant"]


def _seed_inputs(args: argparse.Namespace, work: Path, seed: int) -> tuple[Path, Path, Path, Path]:
    """(model dir, train jsonl, val jsonl, the seed's one evaluation config); on the grid task decoding is sized
    from the model's tokenizer first."""
    model, train, val = _assets(args, work, seed)
    if args.task == "grid":
        _size_decoding(args, model)
    eval_config = _config(args, work, "eval", "demo_stage2.yaml", model, train, val, seed, {},
                          [(["rollout_matching", "decode_batch_size"], args.eval_batch)])
    return model, train, val, eval_config


def _train_and_evaluate(args: argparse.Namespace, work: Path, seed: int, name: str, config: Path, eval_config: Path,
                        *, added: bool = False, tuning: decoding_tuning.Tuning | None = None) -> dict[str, Any]:
    """One arm: trained from ``config``, evaluated under the seed's ``eval_config``, its figures printed; with
    ``tuning`` (``--tune-decoding``) also its decoding chosen on the tuning split and its test figures there."""
    print(f"[bench_learning] seed {seed}: training {name}{' (added)' if added else ''} ...", flush=True)
    run = {"train": _train(config)}
    run["eval"] = e = _evaluate(args, work, eval_config, name)
    print(f"[bench_learning] seed {seed} {name}: AP {_pct(e['AP'])} AP50 {_pct(e['AP50'])} "
          f"parse {_pct(e['parse_valid_rate'])} match {_pct(e['match_rate'])}", flush=True)
    if args.task == "grid":
        print(f"[bench_learning] seed {seed} {name}: " + ", ".join(
            f"{k} {e[k] if e[k] is None else round(e[k], 3)}" for k in (
                "recall", "precision", "f1", "duplicates_per_image", "premature_eos_rate", "count_error",
                "exposure_gap", "deletion_recovery", "duplicate_probe", "backtracks_per_image",
                "backtrack_recovery_rate")), flush=True)
    if tuning is not None:
        run["tuned"] = decoding_tuning.tune_arm(tuning, work, name, e, args.score)
        print(decoding_tuning.line(seed, name, run["tuned"]), flush=True)
    return run


def _continued(args: argparse.Namespace) -> dict[str, Any]:
    """The training settings every continuation shares (the budget: K optimizer steps of the same records)."""
    return {"max_steps": args.k, "learning_rate": args.continue_lr, "lr_scheduler_type": "constant",
            "warmup_ratio": 0.0, "per_device_train_batch_size": args.continue_batch}


def _printable(args: argparse.Namespace) -> dict[str, Any]:
    """The options as the summary's ``args`` holds them (JSON)."""
    printable = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "sized"}
    printable["variant"] = [[name, [[".".join(k), v] for k, v in overrides]] for name, overrides in args.variant]
    printable["settings"] = [[".".join(k), v] for k, v in args.settings]
    return printable


def run_seed(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Stage 1, then every continuation from its checkpoint, each trained and evaluated under one evaluation
    config; the seed's figures (and, on the grid task, the pilot gate on stage 1)."""
    from coordexp.runtime.toy.probes import gate

    work = args.workdir / f"seed{seed}"
    work.mkdir(parents=True, exist_ok=True)
    model, train, val, eval_config = _seed_inputs(args, work, seed)
    tuning = decoding_tuning.prepare(args, work, seed, eval_config)
    if args.task == "grid":
        print(f"[bench_learning] grid {args.grid}: max_new_tokens {args.max_new_tokens}, repeat guard "
              f"max_object_keys {args.sized[0][1]}", flush=True)
    stage1_dir = work / "stage1"
    plan = [("stage1", _config(args, work, "stage1", "demo_stage1.yaml", model, train, val, seed, {
        "max_steps": args.stage1_steps, "learning_rate": args.stage1_lr,
        "per_device_train_batch_size": args.stage1_batch}))]
    continued = _continued(args)
    for name, overrides in continuation_plan(args):
        plan.append((name, _config(args, work, name, "demo_stage2.yaml", stage1_dir, train, val, seed, continued,
                                   overrides)))
    runs: dict[str, dict[str, Any]] = {}
    out: dict[str, Any] = {"seed": seed, "runs": runs}
    if tuning is not None:
        out["tuning_split"] = {"jsonl": str(tuning.split), "images": tuning.images,
                               "seed": None if args.tune_jsonl else decoding_tuning.tuning_seed(seed)}
    for name, config in plan:
        runs[name] = _train_and_evaluate(args, work, seed, name, config, eval_config, tuning=tuning)
        if name == "stage1" and args.task == "grid":
            out["gate"] = g = gate(runs[name]["eval"])
            print(f"[bench_learning] seed {seed} {g.line()}", flush=True)
            out["gate"] = g.to_dict()
            if args.stop_at_failed_gate and not g.passed:
                print(f"[bench_learning] seed {seed}: gate failed, no continuation trained (--stop-at-failed-gate)",
                      flush=True)
                out["stopped"] = "gate failed"
                return out
    out["data_order"] = _data_order(work, [n for n, _ in plan[1:]])
    return out


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def _report(per_seed: list[dict[str, Any]], args: Any, workdir: Path) -> dict[str, Any]:
    stopped = [s["seed"] for s in per_seed if s.get("stopped")]
    if stopped:
        print(f"seeds stopped at a failed gate, left out of every comparison: {stopped}")
        per_seed = [s for s in per_seed if not s.get("stopped")]
        if not per_seed:
            return {"gate": {"passed": False, "failed_seeds": stopped}}
    summary = summarize(per_seed)
    if stopped:
        summary["stopped_at_gate"] = stopped
    print_tables(per_seed, summary, f"task {args['task']}; held-out images per seed: {args['n_val']}; box AP in "
                 f"percent (COCO); continuations: {args['k']} optimizer steps of {args['continue_batch']} records at "
                 f"lr {args['continue_lr']:g} (constant) each; one evaluation config for every run")
    extend_summary(per_seed, summary, args)
    print_campaign(per_seed, summary)
    png = write_png(per_seed, workdir / "recall_by_rank.png")
    if png is not None:
        print(f"figure: {png}")
    return summary


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """A run's summary through a temp file and a rename: ``--report`` rewrites a committed result file in place,
    and an interrupted write must leave the old file whole."""
    from coordexp.runtime.train.run_folder import write_result_file

    write_result_file(path, (json.dumps(data, indent=2) + "\n").encode("utf-8"))


def main() -> None:
    args = _args()
    if args.report is not None:
        saved = merge_runs([json.loads(path.read_text(encoding="utf-8")) for path in args.report])
        out = args.report[0] if len(args.report) == 1 else args.workdir.resolve() / "summary.json"
        if args.passed_gate_only:
            if any("gate" not in s for s in saved["seeds"]):
                raise SystemExit("--passed-gate-only: these seeds have no pilot gate (only --task grid runs one)")
            failed = [s["seed"] for s in saved["seeds"] if not s["gate"]["passed"]]
            saved = {**saved, "seeds": [s for s in saved["seeds"] if s["seed"] not in failed],
                     "left_out_by_gate": failed}
            print(f"seeds whose stage 1 failed the pilot gate, left out: {failed or 'none'}")
            if not saved["seeds"]:
                raise SystemExit("--passed-gate-only: no seed passed the gate")
            if len(args.report) == 1:
                out = args.workdir.resolve() / "summary.json"  # never overwrite the whole run with a part of it
        out.parent.mkdir(parents=True, exist_ok=True)
        saved["summary"] = _report(saved["seeds"], saved["args"], out.parent)
        _write_json(out, saved)
        return
    args.workdir = args.workdir.resolve()
    if args.add_arms:
        path = args.workdir / "summary.json"
        if not path.is_file():
            raise SystemExit(f"--add-arms: no finished run in {args.workdir} (summary.json)")
        saved = json.loads(path.read_text(encoding="utf-8"))
        add_arms(args, saved)
        saved["summary"] = _report(saved["seeds"], saved["args"], args.workdir)
        _write_json(path, saved)
        print("JSON " + json.dumps(saved))
        return
    args.workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    per_seed = [run_seed(args, seed) for seed in range(args.seed, args.seed + max(1, args.n_seeds))]
    printable = _printable(args)
    summary = _report(per_seed, printable, args.workdir)
    result = {"args": printable, "seeds": per_seed, "summary": summary, "total_s": time.perf_counter() - started}
    _write_json(args.workdir / "summary.json", result)
    print("JSON " + json.dumps(result))


if __name__ == "__main__":
    main()
