"""``coordexp eval CFG``: COCO-style detection quality of a checkpoint (AP, AP50, AP75, AP by size, AR@100,
per-category AP; masks too where polygon ground truth exists) next to the rollout counters.

The work lives in :mod:`coordexp.runtime.train.evaluate`; this module is the command-line glue and the tables.
Everything that can be checked before the model loads is checked first (exit 2): the checkpoint's files
(:mod:`coordexp.runtime.model.checkpoint_files`) and the ``--out`` location, so a bad path never costs a rollout and
no output can overwrite an input (the config, the data files, the checkpoint's files).
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Annotated, Any, Iterable, Optional

import typer

from coordexp.cli.file_guard import check_output_dir, check_output_file, same_file
from coordexp.cli.frame import EXIT_OK, err, guarded, load_run, out, safe, write_result
from coordexp.cli.overrides import SetOption
from coordexp.errors import UserInputError

__all__ = ["register", "evaluate", "resolve_checkpoint", "run_with_checkpoint", "default_out_dir", "input_files",
           "check_checkpoint_files", "check_out_dir", "print_set_figures", "require_packages", "measured_identity"]

SCORES = ("logprob", "mean_logprob", "constant")


def _saved(directory: Path) -> bool:
    """A saved model: a full checkpoint (config.json) or a LoRA adapter (adapter_config.json)."""
    from coordexp.runtime.train.run_folder import RunFolder

    return RunFolder(directory).has_final_model()


def resolve_checkpoint(run: Any, checkpoint: Optional[Path]) -> Path:
    """``--checkpoint`` if given; else the run's ``training.output_dir`` once it holds a saved model or adapter;
    else ``model.path`` (evaluating the starting point) when no run trained there. A run folder without its final
    model (stopped before its end) is refused, naming its newest checkpoint: never the starting model in its place."""
    from coordexp.runtime.train.run_folder import RunFolder

    if checkpoint is not None:
        try:
            saved = _saved(checkpoint)
        except OSError as exc:  # a name too long for the file system, a loop of links, no permission
            raise UserInputError(f"--checkpoint {str(checkpoint)[:200]}: cannot use this path "
                                 f"({exc.strerror or exc})", hint="pass a model or adapter directory") from None
        if not saved:
            raise UserInputError(f"--checkpoint {checkpoint} holds no saved model (neither config.json nor "
                                 "adapter_config.json)", hint="pass a training output_dir or a checkpoint-N directory")
        return checkpoint
    trained = RunFolder(run.training.output_dir)
    if trained.has_final_model():
        return trained.path
    problem = trained.unfinished_problem()
    if problem is not None:
        checkpoints = trained.checkpoints()
        hint = (f"evaluate it with --checkpoint {checkpoints[-1]}, or finish the run (`coordexp train CONFIG "
                "--resume auto` writes the final model)") if checkpoints else \
            "finish the run (`coordexp train CONFIG`), or pass --checkpoint DIR"
        raise UserInputError(f"{problem}; the config's model.path is the model the run started from", hint=hint)
    return Path(run.model.path)


def run_with_checkpoint(run: Any, checkpoint: Optional[Path]) -> tuple[Any, Path, Optional[Path]]:
    """The run with ``model.path`` set to the checkpoint to load (:func:`resolve_checkpoint`), that model directory,
    and the LoRA adapter on top of it (None for a full model); ``eval`` and ``serve-rollout`` load the same way."""
    from coordexp.runtime.model.adapters import adapter_base, is_adapter_dir

    model_dir, adapter = resolve_checkpoint(run, checkpoint), None
    if is_adapter_dir(model_dir):  # base from the adapter's record (or model.path), then the adapter on top
        adapter, model_dir = model_dir, Path(adapter_base(model_dir, run.model.path))
    return dataclasses.replace(run, model=run.model.model_copy(update={"path": str(model_dir)})), model_dir, adapter


def default_out_dir(run: Any, checkpoint: Optional[Path], split: str, kind: str = "eval") -> Path:
    """Where ``eval`` (or ``probe``: ``kind``) writes by default: the run folder's result folder for this
    checkpoint and split (:meth:`coordexp.runtime.train.run_folder.RunFolder.result_dir`)."""
    from coordexp.runtime.train.run_folder import RunFolder

    return RunFolder(run.training.output_dir).result_dir(kind, checkpoint, split)


def require_packages(run: Any, adapter: Optional[Path]) -> None:
    """The optional packages evaluating this model needs (vLLM, flash-attn, peft for an adapter): exit 3 naming
    every missing one before any weight loads."""
    from coordexp.optional_deps import dependency, require_installed

    require_installed(run, "eval")
    peft = dependency("peft")
    if adapter is not None and not peft.installed():
        raise peft.problem(f"the LoRA adapter {adapter}")


def measured_identity(config: Path, model_dir: Path, adapter: Optional[Path],
                      overrides: Iterable[str] = ()) -> dict[str, Any]:
    """What a result file measured: the model (and adapter) with its step and weights hash, the config and the
    ``--set`` overrides applied to it (secrets masked)."""
    from coordexp.cli.overrides import masked_text
    from coordexp.runtime.model.checkpoint_files import model_identity

    return {"model": model_identity(model_dir) if model_dir.is_dir() else {"path": str(model_dir)},
            "adapter": None if adapter is None else model_identity(adapter), "config": str(config.resolve()),
            "overrides": [masked_text(text) for text in overrides]}


def check_checkpoint_files(model_dir: Path, adapter: Optional[Path]) -> None:
    """The checkpoint (and the adapter's) files, before any weight is loaded: exit 2 naming a broken file or a
    tokenizer/processor that cannot be built."""
    from coordexp.runtime.model.checkpoint_files import check_adapter_dir, check_model_dir, load_checked_processor
    from coordexp.runtime.model.policy import SUPPORTED_FAMILIES

    if adapter is not None:
        check_adapter_dir(adapter)
    if model_dir.is_dir():
        check_model_dir(model_dir, families=SUPPORTED_FAMILIES)
        load_checked_processor(model_dir)  # the rollout loads it from here: an unusable tokenizer fails now


def input_files(run: Any, config: Path, model_dir: Path, adapter: Optional[Path]) -> list[Path]:
    """Files eval reads: the config, the data files and every file of the checkpoint (and adapter) directory but
    eval's own result names (results written there by an earlier eval may be replaced by this one)."""
    from coordexp.runtime.train.run_folder import EVAL_RESULT_FILES, PROBE_RESULT_FILES

    files = [config] + [Path(p) for p in (run.data.train_jsonl, run.data.val_jsonl) if p]
    results = {*EVAL_RESULT_FILES, *PROBE_RESULT_FILES}
    for folder in (model_dir, adapter):
        if folder is not None and folder.is_dir():
            files.extend(p for p in folder.iterdir() if p.is_file() and p.name not in results)
    return files


def check_out_dir(target: Path, inputs: Iterable[Path], pngs: int,
                  result_files: Optional[Iterable[str]] = None) -> None:
    """``--out`` before any rollout: a directory (new or existing) that can take files, whose result files
    (``result_files``: eval's by default, probe passes its own) are not inputs, devices, FIFOs, directories or
    read-only; then a probe file is created and removed there."""
    from coordexp.runtime.train.run_folder import EVAL_RESULT_FILES

    inputs = list(inputs)
    real = check_output_dir(target)
    names = [*(EVAL_RESULT_FILES if result_files is None else result_files),
             *(f"png/eval_{k:04d}.png" for k in range(min(pngs, 4096)))]
    for name in names:
        path = real / name
        if os.path.lexists(path):
            check_output_file(path, inputs, what="--out file")
    png = real / "png"
    if pngs and os.path.lexists(png) and not (png.is_dir() and not png.is_symlink()):
        raise UserInputError(f"--out {target}: {png} exists and is not a directory",
                             hint="remove it or choose another --out")
    for source in inputs:
        if same_file(source, real):
            raise UserInputError(f"--out {target} is the input {source}", hint="choose another --out directory")
    try:
        (png if pngs else real).mkdir(parents=True, exist_ok=True)
        for folder in ((real, png) if pngs else (real,)):
            fd, probe = tempfile.mkstemp(dir=folder, prefix=".coordexp-probe-")
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        raise UserInputError(f"--out {target}: cannot write there ({exc.strerror or exc})",
                             hint="choose a writable --out directory; no rollout was run") from None
    mode = os.stat(real).st_mode
    if not stat.S_ISDIR(mode):  # replaced while checking
        raise UserInputError(f"--out {target} is not a directory")


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def _pct(value: Optional[float]) -> str:
    """``97.5%``; ``-`` (not ``-%``) when the rate is undefined."""
    return "-" if value is None else f"{_fmt(value)}%"


def evaluate(
    config: Annotated[Optional[Path], typer.Argument(help="The run's YAML config (not with --compare).",
                                                     show_default=False)] = None,
    checkpoint: Annotated[Optional[Path], typer.Option(
        "--checkpoint", help="Model or LoRA adapter directory to evaluate (default: the config's output_dir if "
                             "trained, else model.path).")] = None,
    split: Annotated[str, typer.Option("--split", help="Which records: val (data.val_jsonl) or train.")] = "val",
    limit: Annotated[Optional[int], typer.Option("--limit", min=1, help="Evaluate the first N records only.")] = None,
    score: Annotated[str, typer.Option(
        "--score", help="Ranking score per object: logprob (sequence log-probability of its tokens), "
                        "mean_logprob (per token) or constant.")] = "logprob",
    out_dir: Annotated[Optional[Path], typer.Option(
        "--out", help="Where results, metrics and PNGs go (default: OUTPUT_DIR/eval_SPLIT; with --checkpoint DIR, "
                      "OUTPUT_DIR/eval_DIRNAME).")] = None,
    pngs: Annotated[int, typer.Option("--pngs", min=0, help="How many rollout PNGs to draw.")] = 4,
    dedup: Annotated[bool, typer.Option(
        "--dedup", help="Also report the figures with near repeats removed (same desc, IoU >= 0.9 with an earlier "
                        "kept prediction: no labels needed, a heuristic that can remove a true positive), beside the "
                        "raw ones.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout.")] = False,
    compare: Annotated[Optional[tuple[Path, Path]], typer.Option(
        "--compare", metavar="RESULTS_A RESULTS_B", show_default=False,
        help="Compare two eval result folders of the same images instead: B minus A, paired per image, with "
             "bootstrap 95% intervals and the noise floor (no model is loaded).")] = None,
    bootstrap: Annotated[int, typer.Option("--bootstrap", min=100, max=100_000,
                                           help="--compare: bootstrap replicates of the set figures (AP50: at most "
                                                "200, a COCO evaluation each).")] = 1000,
    overrides: SetOption = None,
) -> None:
    """Roll out a split through the configured backend, parse and match as training does, and report COCO AP
    (boxes; masks where polygons exist) with the rollout counters; writes a COCO results JSON and PNGs. With
    --compare, compare two such result folders instead."""
    if compare is not None:
        if config is not None or overrides:
            raise UserInputError("pass either a config to evaluate (and its --set overrides) or --compare "
                                 "RESULTS_A RESULTS_B, not both")
        compare_results(*compare, bootstrap=bootstrap, as_json=as_json)
        return
    if config is None:
        raise UserInputError("eval needs the run's config (coordexp eval CFG), or --compare RESULTS_A RESULTS_B")
    if split not in ("val", "train"):
        raise UserInputError(f"--split must be val or train, got {split!r}")
    if score not in SCORES:
        raise UserInputError(f"--score must be one of {', '.join(SCORES)}, got {score!r}")
    given = list(overrides or [])
    run = load_run(config, as_json=as_json, overrides=given)
    run, model_dir, adapter = run_with_checkpoint(run, checkpoint)
    require_packages(run, adapter)
    target = out_dir if out_dir is not None else default_out_dir(run, checkpoint, split)
    check_checkpoint_files(model_dir, adapter)
    check_out_dir(target, input_files(run, config, model_dir, adapter), pngs)

    from coordexp.runtime.train.evaluate import run_evaluation

    console = err if as_json else out
    console.print(f"[cyan]eval[/cyan] model {safe(model_dir)}" + (f" + adapter {safe(adapter)}" if adapter else ""))
    report = run_evaluation(run, split=split, limit=limit, score=score, out_dir=target, png_count=pngs,  # type: ignore[arg-type]
                            adapter=adapter, dedup=dedup,
                            measured=measured_identity(config, model_dir, adapter, given),
                            log=lambda message: console.print(f"[cyan]eval[/cyan] {safe(message)}"))
    if as_json:
        shown_adapter = None if adapter is None else str(adapter)
        write_result(json.dumps({"ok": True, "model": str(model_dir), "adapter": shown_adapter, "split": split,
                                     **report.to_dict()}, indent=2) + "\n")
        raise typer.Exit(EXIT_OK)
    print_report(report)


def compare_results(a: Path, b: Path, *, bootstrap: int, as_json: bool) -> None:
    """``eval --compare``: B minus A with paired bootstrap intervals (:mod:`coordexp.runtime.core.compare`)."""
    from rich.table import Table

    from coordexp.runtime.core.compare import CompareError, compare_eval_folders, read_eval_folder

    try:
        result = compare_eval_folders(read_eval_folder(a), read_eval_folder(b), bootstrap=bootstrap,
                                      ap_bootstrap=min(bootstrap, 200))
    except CompareError as exc:
        raise UserInputError(str(exc), hint="compare two folders `coordexp eval` wrote on the same split") from None
    if as_json:
        write_result(json.dumps({"ok": True, "a": str(a), "b": str(b), **result}, indent=2) + "\n")
        raise typer.Exit(EXIT_OK)
    table = Table(title=f"B minus A on the same {result['images']} images (percent; 95% bootstrap interval over "
                        "images)")
    for name in ("", "A", "B", "B - A", "95% interval"):
        table.add_column(name, justify="right" if name else "left")
    for key, row in result["figures"].items():
        ci = row["ci95"]
        shown = "-" if ci is None else f"[{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]"
        diff = row["difference"]
        table.add_row(key, _fmt(row["A"]), _fmt(row["B"]), "-" if diff is None else f"{100 * diff:+.1f}", shown)
    out.print(f"A: {safe(a)}\nB: {safe(b)}")
    out.print(table)
    if result["one_object_points"] is not None:
        out.print(f"noise floor: {result['gt_objects']} ground-truth objects: one true positive = "
                  f"{result['one_object_points']:.1f} points of recall; an interval across 0 is no difference")


def print_report(report: Any) -> None:
    """The AP table (boxes, masks), the rollout counters, per-category AP and the written files."""
    from rich.table import Table

    table = Table(title=f"detection quality ({report.images} images, score: {report.score}; COCO, percent)")
    table.add_column("")
    for key in ("AP", "AP50", "AP75", "AP_small", "AP_medium", "AP_large", "AR100"):
        table.add_column(key.replace("_", " "), justify="right")
    for name, metrics in (("boxes", report.bbox), ("masks", report.segm)):
        if metrics is not None:
            table.add_row(name, *(_fmt(metrics[k]) for k in
                                  ("AP", "AP50", "AP75", "AP_small", "AP_medium", "AP_large", "AR100")))
    out.print(table)
    print_set_figures(report.figures)
    if report.dedup:
        raw, free = report.dedup["raw"], report.dedup["label_free"]
        out.print(f"with near repeats removed (--dedup, a heuristic; {free['removed']} predictions): AP50 {_pct(free['AP50'])} "
                  f"(raw {_pct(raw['AP50'])}), precision {_pct(free['precision'])} (raw {_pct(raw['precision'])}), "
                  f"recall {_pct(free['recall'])} (raw {_pct(raw['recall'])}), F1 {_pct(free['f1'])} "
                  f"(raw {_pct(raw['f1'])})")
    c, ratios = report.counters, report.counters.ratios()
    out.print(
        f"rollouts: parse valid {_pct(ratios['parse_valid_rate'])}, match rate {_pct(ratios['match_rate'])} "
        f"(the stage-2 matcher: mask-IoU gate, class ignored), {c.pred_valid} valid objects / {c.gt_objects} GT, "
        f"{c.matched} matched, truncated {c.truncated_rollouts}/{c.samples}"
    )
    if c.samples and not c.pred_valid:
        out.print("[yellow]! nothing the model wrote parsed as an object[/yellow]: it has not learned the answer "
                  "format (a model without stage 1, or too few steps); train stage 1 (longer), or start from a "
                  "stage-1 checkpoint such as the demo's; the PNGs and predictions.jsonl show what it wrote")
    if report.left_out:
        out.print(f"[yellow]not scored[/yellow] (desc is no ground-truth category): "
                  f"{sum(report.left_out.values())} predicted objects")
    per_category = [(name, ap) for name, ap in report.bbox.per_category.items()]
    if per_category:
        cats = Table(title="box AP per category (percent)")
        cats.add_column("category")
        cats.add_column("AP", justify="right")
        for name, ap in sorted(per_category, key=lambda item: (-(item[1] if item[1] is not None else -1), item[0])):
            cats.add_row(safe(name), _fmt(ap))
        out.print(cats)
    for key, value in report.files.items():
        out.print(f"{key}: {safe(value)}")


def print_set_figures(figures: dict) -> None:
    """The set figures (docs/figures.md): what the model wrote, judged as a set at box IoU 0.5."""
    from rich.table import Table

    if not figures:
        return
    table = Table(title="the set the model wrote (box IoU >= 0.5, greedy in written order; percent)")
    for name in ("", "precision", "recall", "F1"):
        table.add_column(name, justify="right" if name else "left")
    table.add_row("class-aware", *(_fmt(figures.get(k)) for k in ("precision", "recall", "f1")))
    table.add_row("any class", *(_fmt(figures.get(k)) for k in ("precision_any_class", "recall_any_class",
                                                                 "f1_any_class")))
    out.print(table)

    def number(key: str) -> str:
        value = figures.get(key)
        return "-" if value is None else f"{value:.2f}"

    out.print(f"predictions per GT {number('pred_per_gt')}, certified duplicates per image "
              f"{number('duplicates_per_image')}, count error {number('count_error')} per image, premature EOS "
              f"{_pct(figures.get('premature_eos_rate'))}, cut off before EOS {_pct(figures.get('cut_off_rate'))}")
    buckets = figures.get("count_buckets") or {}
    shown = [f"{name} objects ({b['images']} images): recall {_pct(b['recall'])}, premature EOS "
             f"{_pct(b['premature_eos_rate'])}" for name, b in buckets.items() if b.get("images")]
    if shown:
        out.print("by ground-truth objects per image: " + "; ".join(shown))
    by_rank = [v for v in figures.get("recall_by_rank") or []]
    if by_rank:
        shown = " ".join(_fmt(v) for v in by_rank[:10]) + (" ..." if len(by_rank) > 10 else "")
        out.print(f"recall by reading-order rank (percent): {shown}")


def register(app: typer.Typer) -> None:
    """Add ``eval`` to ``app``."""
    app.command("eval")(guarded(evaluate))
