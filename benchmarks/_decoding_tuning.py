"""``bench_learning.py --tune-decoding N`` (issue 53, item 2): every arm's decoding chosen on images its figures do
not use.

Per seed, a tuning split of N images is written apart from the test images (``--n-val``, what every figure is
measured on): the grid task's generator (or the synthetic shapes') with the seed ``-(seed + 1)``, in its own folder
``seedS/tune_data``. Every image of a generated split depends only on (seed, split, index), and the bench's seeds are
never negative (``--tune-decoding`` refuses a negative ``--seed``), so no tuning image is a training or test image of
any seed. With ``--train-jsonl/--val-jsonl`` the bench cannot make images: ``--tune-jsonl`` names a held-out split
of the user's own (its first N records are the tuning split), and without it ``--tune-decoding`` is refused rather
than carving the tuning images out of the test split the default figures use.

Every arm's checkpoint, stage 1 included, decodes the tuning split once per ``rollout_matching.decoding.
repetition_penalty`` in :data:`PENALTIES` (the one evaluation config otherwise unchanged); the label-free near-repeat
removal (:func:`coordexp.runtime.core.dedup.dedup_figures`, ``label_free``) is post-processing, judged on the same
decode. Of the six settings, the best AP50 on the tuning split wins; a tie goes to the higher F1, then to the setting
listed first (:func:`settings` order: the default decoding, penalty 1.0 without removal, first; then the lower
penalty, then removal off). The arm's figures on the test images at that setting are its ``tuned`` figures, beside
the default decoding's: the test images are decoded again only when the chosen penalty is not 1.0 (removal needs no
new decode).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, NamedTuple

import yaml

PENALTIES = (1.0, 1.05, 1.1)
PENALTY_KEY = ("rollout_matching", "decoding", "repetition_penalty")
# what the tuned figures report of the test images at the chosen setting (and of the tuning split at every one)
TUNED_FIGURES = ("AP50", "f1", "recall", "precision", "duplicates_per_image", "premature_eos_rate")
# ties within this are ties (AP50 and F1 are fractions; two settings that wrote the same predictions are equal)
TIE = 1e-9


class Tuning(NamedTuple):
    """One seed's tuning: the split's path and size, and per penalty the configs that decode it and the tests."""

    split: Path
    images: int
    tune_configs: dict[float, Path]
    test_configs: dict[float, Path]


def check_args(args: Any, error: Any) -> None:
    """Refuse what ``--tune-decoding`` cannot do (``error``: argparse's ``parser.error``)."""
    if args.tune_decoding is None:
        if args.tune_jsonl is not None:
            error("--tune-jsonl is the tuning split of --tune-decoding N: give both")
        return
    if args.tune_decoding < 1:
        error(f"--tune-decoding {args.tune_decoding}: give the tuning split's image count (at least 1)")
    if args.seed < 0:
        error("--tune-decoding: the tuning split's seed is -(seed + 1), apart from every seed only when seeds are not "
              "negative: give --seed 0 or more")
    if args.val_jsonl is not None and args.tune_jsonl is None:
        error("--tune-decoding with --val-jsonl: the bench cannot generate held-out images of your data; give "
              "--tune-jsonl (a split used neither for training nor as --val-jsonl; its first N records tune)")
    if any(list(keys) == list(PENALTY_KEY) for keys, _ in args.settings):
        error("--tune-decoding chooses rollout_matching.decoding.repetition_penalty itself: drop it from --set")


def tuning_seed(seed: int) -> int:
    """The generator seed of seed ``seed``'s tuning split: negative, so never a bench seed (those are >= 0)."""
    return -(seed + 1)


def write_split(args: Any, work: Path, seed: int) -> Path:
    """The tuning split's jsonl: ``--tune-jsonl``, or N images generated as the task's (its own folder)."""
    if args.tune_jsonl is not None:
        return args.tune_jsonl.resolve()
    folder = work / "tune_data"
    if not (folder / "val.jsonl").is_file():
        if args.task == "grid":
            from coordexp.runtime.toy.grid import GridLayout, write_grid_dataset

            write_grid_dataset(folder, n_train=1, n_val=args.tune_decoding, seed=tuning_seed(seed),
                               position_code=args.position_code,
                               layout=GridLayout(args.cells, args.cell_px, args.min_objects, args.max_objects))
        else:
            from coordexp.runtime.toy.synthetic import write_synthetic_dataset

            write_synthetic_dataset(folder, n_train=1, n_val=args.tune_decoding, seed=tuning_seed(seed),
                                    image_size=(args.image_size, args.image_size), min_objects=args.min_objects,
                                    max_objects=args.max_objects, shapes=tuple(args.shapes.split(",")),
                                    position_code=args.position_code)
    return folder / "val.jsonl"


def _derived(eval_config: Path, path: Path, penalty: float, *, val: Path | None = None, limit: int | None = None,
             image_root: Path | None = None) -> Path:
    """The one evaluation config at ``penalty`` (and, for the tuning split, reading ``val``'s first ``limit``, its
    images under ``image_root`` when given: a config's image root defaults to its TRAINING jsonl's folder, which
    holds the seed's test images under the same names as a generated split's)."""
    config = yaml.safe_load(eval_config.read_text(encoding="utf-8"))
    node = config
    for key in PENALTY_KEY[:-1]:
        node = node.setdefault(key, {})
    node[PENALTY_KEY[-1]] = penalty
    if val is not None:
        config.setdefault("data", {}).update({"val_jsonl": str(val), "max_val_samples": limit})
        if image_root is not None:
            config["data"]["image_root"] = str(image_root)
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def prepare(args: Any, work: Path, seed: int, eval_config: Path) -> Tuning | None:
    """The seed's tuning split and configs (None without ``--tune-decoding``)."""
    if getattr(args, "tune_decoding", None) is None:
        return None
    split = write_split(args, work, seed)
    # a generated split's images sit beside it; --tune-jsonl's resolve as the test split's do (the config's root)
    root = None if args.tune_jsonl is not None else split.parent
    tune = {p: _derived(eval_config, work / f"eval_tune_rp{p:g}.yaml", p, val=split, limit=args.tune_decoding,
                        image_root=root) for p in PENALTIES}
    test = {p: _derived(eval_config, work / f"eval_rp{p:g}.yaml", p) for p in PENALTIES if p != 1.0}
    return Tuning(split, args.tune_decoding, tune, test)


def settings() -> list[tuple[float, bool]]:
    """(repetition_penalty, near-repeat removal) in tie-break order: the default decoding first."""
    return [(p, removal) for p in PENALTIES for removal in (False, True)]


def figures_at(evaluation: dict[str, Any], removal: bool) -> dict[str, Any]:
    """The :data:`TUNED_FIGURES` and recall / premature EOS per object count of one decode, with near repeats
    removed or not (``evaluation``: an arm's ``eval`` dict, or :func:`decode`'s; both hold ``dedup.label_free``)."""
    source = evaluation["dedup"]["label_free"] if removal else evaluation
    return {**{k: source.get(k) for k in TUNED_FIGURES}, "count_buckets": source.get("count_buckets")}


def choose(tuning: list[dict[str, Any]]) -> int:
    """Index of the winning setting: best AP50, then best F1, then the first listed (a missing figure loses)."""

    def key(row: dict[str, Any]) -> list[float]:
        return [float("-inf") if row.get(k) is None else row[k] for k in ("AP50", "f1")]

    best = 0
    for index, row in enumerate(tuning[1:], 1):
        (ap, f1), (best_ap, best_f1) = key(row), key(tuning[best])
        if ap > best_ap + TIE or (abs(ap - best_ap) <= TIE and f1 > best_f1 + TIE):
            best = index
    return best


def decode(config: Path, checkpoint: Path, out_dir: Path, score: str) -> dict[str, Any]:
    """``checkpoint`` on ``config``'s validation split (``coordexp eval``'s path, near repeats removed beside the
    raw figures): AP50, the set figures and their ``dedup`` twins."""
    from coordexp.runtime.train.evaluate import run_evaluation
    from coordexp.schema.contract import load_contract

    run = load_contract(config)
    run = dataclasses.replace(run, model=run.model.model_copy(update={"path": str(checkpoint)}))
    report = run_evaluation(run, split="val", score=score, out_dir=out_dir, png_count=0, dedup=True)
    figures = report.figures
    return {"AP50": report.bbox["AP50"], **{k: figures.get(k) for k in TUNED_FIGURES[1:]},
            "count_buckets": figures.get("count_buckets"), "dedup": report.dedup, "images": report.images}


def tune_arm(tuning: Tuning, work: Path, name: str, test_eval: dict[str, Any], score: str) -> dict[str, Any]:
    """Arm ``name`` (checkpoint ``work/name``): its figures on the tuning split at every setting, the setting chosen
    and its figures on the test images (``test_eval``: the arm's default-decoding evaluation)."""
    checkpoint = work / name
    rows: list[dict[str, Any]] = []
    decoded: dict[float, dict[str, Any]] = {}
    for penalty, removal in settings():
        if penalty not in decoded:
            decoded[penalty] = decode(tuning.tune_configs[penalty], checkpoint,
                                      work / f"tune_{name}" / f"rp{penalty:g}", score)
        rows.append({"repetition_penalty": penalty, "near_repeat_removal": removal,
                     **figures_at(decoded[penalty], removal)})
    chosen = rows[choose(rows)]
    penalty, removal = chosen["repetition_penalty"], chosen["near_repeat_removal"]
    test = test_eval if penalty == 1.0 else decode(tuning.test_configs[penalty], checkpoint,
                                                    work / f"eval_{name}_rp{penalty:g}", score)
    return {"repetition_penalty": penalty, "near_repeat_removal": removal, **figures_at(test, removal),
            "test_decoded_again": penalty != 1.0, "tuning_images": tuning.images, "tuning": rows}


def line(seed: int, name: str, tuned: dict[str, Any]) -> str:
    """The bench's progress line of one arm's tuned figures."""
    return (f"[bench_learning] seed {seed} {name} tuned: repetition_penalty {tuned['repetition_penalty']:g}, near "
            f"repeats {'removed' if tuned['near_repeat_removal'] else 'kept'}: " + ", ".join(
                f"{k} {'-' if tuned[k] is None else round(tuned[k], 3)}" for k in TUNED_FIGURES))
