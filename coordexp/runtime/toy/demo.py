"""The CPU demo: tiny model + synthetic shapes -> stage 1 until rollouts parse -> stage 2 from that checkpoint.

Everything is driven by two YAML files (``examples/demo_stage1.yaml``, ``examples/demo_stage2.yaml``); stage 2's
``model.path`` is stage 1's ``output_dir``. Assets are built where the stage-1 config points and reused when present.
The before/after numbers come from rolling out the same validation records once through the trainer's evaluation
path (:meth:`coordexp.runtime.train.pipeline.MicroStepPipeline.eval_chunks`), not from training logs: the rollout
counters, the stage-2 loss of their ``Y_train`` and COCO box AP/AP50 (objects ranked by the log-probability of their tokens).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback

from coordexp.runtime.train.launch import LaunchError, build_trainer
from coordexp.runtime.core.telemetry import RolloutCounters

if TYPE_CHECKING:
    from coordexp.runtime.model.data import DetectionRecord
    from coordexp.runtime.train.trainer import CoordExpTrainer
    from coordexp.schema.contract import RunContract

__all__ = [
    "DemoPlan",
    "RolloutEval",
    "DemoResult",
    "ensure_assets",
    "Stage1TargetStop",
    "evaluate",
    "run_demo",
]

RUN_MARKER = ".coordexp-demo-run"  # marks an output_dir the demo created and may clear on the next run


@dataclass(frozen=True)
class DemoPlan:
    """What the demo runs; the ``*_max_steps`` overrides cap the configs' ``training.max_steps`` (tests, --quick).

    The model and data fields are the measured recipe that lets a 2-layer model learn the output format, and start
    to learn where the shapes are, on 2 CPU cores in a few minutes: standard init (0.02) for the language model, a
    livelier vision tower (0.2) so images differ at the start, smooth coord-token rows, and 1-2
    rectangles/triangles per image (fixed arities 4 and 6) on images that carry a pixel position code, without
    which a random Qwen2-VL cannot learn where shapes are (docs/design.md, decision 10).
    """

    stage1_config: Path
    stage2_config: Path
    n_train: int = 1024
    n_val: int = 256
    data_seed: int = 0
    min_objects: int = 1
    max_objects: int = 2
    shapes: tuple[str, ...] = ("rectangle", "triangle")
    position_code: float = 100.0
    model_seed: int = 0
    init_std: float = 0.02
    vision_init_std: float = 0.2
    smooth_coord_embeddings: bool = True
    stage1_max_steps: Optional[int] = None
    stage2_max_steps: Optional[int] = None
    stage1_eval_every: int = 100
    stage1_target_parse_rate: float = 0.8
    stage1_target_match_rate: float = 0.5
    eval_records: int = 16  # the stage-1 checks roll these out every stage1_eval_every steps
    # the before/after table, on as many images as bench_learning.py: on 64, one object moved a rate by 1-2 points and
    # one seed's before/after flipped sign against its 256-image figures (docs/design.md, decision 16)
    summary_records: int = 256
    png_count: int = 4

    def model_build(self) -> dict[str, Any]:
        """The arguments of ``build_tiny_model`` (also the model manifest: a change rebuilds the model)."""
        return {"seed": self.model_seed, "init_std": self.init_std, "vision_init_std": self.vision_init_std,
                "smooth_coord_embeddings": self.smooth_coord_embeddings}

    def data_build(self) -> dict[str, Any]:
        """The arguments of ``write_synthetic_dataset`` (also the data manifest: a change rewrites the data)."""
        return {"n_train": self.n_train, "n_val": self.n_val, "seed": self.data_seed, "min_objects": self.min_objects,
                "max_objects": self.max_objects, "shapes": list(self.shapes), "position_code": self.position_code}


@dataclass(frozen=True)
class RolloutEval:
    """Rollout health and detection quality (COCO box AP) of a model on the validation records, plus the stage-2
    objective on those rollouts."""

    counters: RolloutCounters
    loss: Optional[float]
    ap: Optional[float] = None
    ap50: Optional[float] = None
    figures: Mapping[str, Any] = field(default_factory=dict)  # set figures (core.set_figures): P/R/F1, ...

    @property
    def parse_valid_rate(self) -> Optional[float]:
        return self.counters.ratios()["parse_valid_rate"]

    @property
    def match_rate(self) -> Optional[float]:
        return self.counters.ratios()["match_rate"]


@dataclass(frozen=True)
class DemoResult:
    stage1_steps: int
    stage1_reached_target: bool
    stage1_history: tuple[tuple[int, RolloutCounters], ...]  # (step, counters) of each stage-1 check
    before: RolloutEval
    after: RolloutEval
    stage2_steps: int
    stage1_dir: Path
    stage2_dir: Path
    pngs: tuple[Path, ...]
    seconds: dict[str, float]


def _claim_output_dir(output_dir: str) -> None:
    """Start from an empty output_dir: clear one the demo made before, refuse to touch anything else."""
    path = Path(output_dir)
    if path.exists() and any(path.iterdir()):
        if not (path / RUN_MARKER).is_file():
            raise LaunchError(
                f"{path} exists and was not written by the demo; move it away or point training.output_dir elsewhere"
            )
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / RUN_MARKER).write_text("created by `coordexp demo`; the next demo run clears this directory\n")


ASSET_MANIFEST = "coordexp-demo-build.json"  # what the demo built into a directory, with which arguments


def _demo_owns(directory: Path, occupied: bool) -> bool:
    """The demo may (re)build into a directory that is empty, carries its manifest, or lies in a ``.coordexp`` tree."""
    return not occupied or (directory / ASSET_MANIFEST).is_file() or ".coordexp" in directory.resolve().parts


def _manifest_matches(directory: Path, build: dict[str, Any]) -> bool:
    try:
        return json.loads((directory / ASSET_MANIFEST).read_text(encoding="utf-8")) == build
    except (OSError, ValueError):
        return False


def _claim_asset_dir(directory: Path, occupied: bool, what: str, key: str) -> None:
    if not _demo_owns(directory, occupied):
        raise LaunchError(
            f"{directory} holds a {what} the demo did not build ({ASSET_MANIFEST} is missing); the demo would "
            f"overwrite it. Move it away or point {key} of the stage-1 config at a new directory"
        )


def ensure_assets(run: "RunContract", plan: DemoPlan, log: Callable[[str], None] = print) -> None:
    """Build the tiny model at ``model.path`` and the synthetic data next to ``data.train_jsonl``, unless the
    manifest there says they were built with the plan's arguments already."""
    from coordexp.runtime.toy.synthetic import write_synthetic_dataset
    from coordexp.runtime.toy.tiny_model import build_tiny_model

    model_dir = Path(run.model.path)
    model_build = plan.model_build()
    if _manifest_matches(model_dir, model_build):
        log(f"reusing tiny model {model_dir}")
    else:
        _claim_asset_dir(model_dir, (model_dir / "config.json").exists(), "model", "model.path")
        log(f"building tiny model -> {model_dir}")
        build_tiny_model(model_dir, **model_build)
        (model_dir / ASSET_MANIFEST).write_text(json.dumps(model_build) + "\n", encoding="utf-8")
    train_jsonl = Path(run.data.train_jsonl)
    val_jsonl = Path(run.data.val_jsonl) if run.data.val_jsonl else None
    data_dir = train_jsonl.parent
    if val_jsonl is not None and val_jsonl.parent != data_dir:
        raise LaunchError(f"the demo writes train and val JSONL into one directory; got {train_jsonl} and {val_jsonl}")
    names = (train_jsonl.name, val_jsonl.name if val_jsonl else "val.jsonl")
    if names != ("train.jsonl", "val.jsonl"):
        raise LaunchError(f"the demo writes {data_dir}/train.jsonl and val.jsonl; the config names {names}")
    data_build = plan.data_build()
    if _manifest_matches(data_dir, data_build) and train_jsonl.is_file():
        log(f"reusing synthetic data {data_dir}")
        return
    _claim_asset_dir(data_dir, train_jsonl.exists(), "dataset", "data.train_jsonl")
    log(f"writing {plan.n_train} train / {plan.n_val} val synthetic images -> {data_dir}")
    write_synthetic_dataset(data_dir, **{**data_build, "shapes": tuple(plan.shapes)})
    (data_dir / ASSET_MANIFEST).write_text(json.dumps(data_build) + "\n", encoding="utf-8")


def _with_max_steps(run: "RunContract", max_steps: Optional[int]) -> "RunContract":
    if max_steps is None:
        return run
    training = run.training.model_copy(update={"max_steps": max_steps, "save_steps": max(1, max_steps)})
    return dataclasses.replace(run, training=training)


def _val_records(trainer: "CoordExpTrainer", limit: int) -> list["DetectionRecord"]:
    if trainer.eval_dataset is None:
        raise LaunchError("the demo configs need data.val_jsonl: stage 1 stops on, and the summary reports, val rollouts")
    return list(trainer.eval_dataset.records[:limit])


def evaluate(trainer: "CoordExpTrainer", records: Sequence["DetectionRecord"], *, with_loss: bool) -> RolloutEval:
    """Roll out ``records`` once through the trainer's evaluation path; score them for AP and, with ``with_loss``,
    the objective on their ``Y_train`` (no grad, no packing)."""
    from coordexp.runtime.train.evaluate import detection_metrics

    was_training = trainer.model.training
    trainer.model.eval()
    rollouts, losses = [], []
    try:
        for part, scored in trainer.scored_chunks(list(records)):
            rollouts += scored
            if with_loss:
                losses.append((trainer.validation_loss(part.samples), len(part.records)))
    finally:
        trainer.model.train(was_training)
    detection, _, _ = detection_metrics(rollouts, image_root=trainer.run.data.image_root)
    loss = sum(value * n for value, n in losses) / max(1, sum(n for _, n in losses)) if with_loss else None
    return RolloutEval(detection.counters, loss, ap=detection.bbox["AP"], ap50=detection.bbox["AP50"],
                       figures=dict(detection.figures))


class Stage1TargetStop(TrainerCallback):
    """Every ``every`` steps roll out ``records``; stop training once the parse valid rate reaches ``parse_target``
    and the match rate ``match_target`` (the format alone is learned long before where the shapes are)."""

    def __init__(self, trainer: "CoordExpTrainer", records: Sequence["DetectionRecord"], *, every: int,
                 parse_target: float, match_target: float, log: Callable[[str], None] = print) -> None:
        self.trainer = trainer
        self.records = list(records)
        self.every = max(1, every)
        self.parse_target = parse_target
        self.match_target = match_target
        self.log = log
        self.history: list[tuple[int, RolloutCounters]] = []
        self.reached = False

    def check(self, step: int) -> RolloutCounters:
        result = evaluate(self.trainer, self.records, with_loss=False)
        counters = result.counters
        self.history.append((step, counters))
        ratios = counters.ratios()
        rate, match = ratios["parse_valid_rate"], ratios["match_rate"]
        self.reached = (counters.pred_parsed > 0 and rate is not None and rate >= self.parse_target
                        and match is not None and match >= self.match_target)
        self.log(
            f"stage 1 check at step {step}: parse valid {_pct(rate)} of {counters.pred_parsed} parsed objects, "
            f"match {_pct(match)}, box AP50 {_pct(result.ap50)}, truncated {counters.truncated_rollouts}/{counters.samples}"
        )
        return counters

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0 and state.global_step < state.max_steps:
            self.check(state.global_step)
            if self.reached:
                control.should_training_stop = True
        return control


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _pick_pngs(run_dir: Path, step: int, count: int) -> tuple[Path, ...]:
    """Render the final evaluation's rollouts, images with ground truth first."""
    from coordexp.runtime.train.visualize import read_rollout_log, render_rollout

    entries = [e for e in read_rollout_log(run_dir) if e.tag == "eval" and e.step == step]
    entries.sort(key=lambda e: (len(e.gt) == 0,))
    out_dir = run_dir / "demo_png"
    return tuple(render_rollout(e, out_dir / f"val_{i:02d}.png") for i, e in enumerate(entries[:count]))


def run_demo(
    plan: DemoPlan,
    *,
    callbacks_for: Callable[[str], Sequence[Any]] = lambda stage: (),
    log: Callable[[str], None] = print,
) -> DemoResult:
    """Assets -> stage 1 (stops early at the parse and match targets) -> evaluate -> stage 2 -> evaluate -> PNGs."""
    from coordexp.schema.contract import load_contract

    seconds: dict[str, float] = {}
    clock = time.monotonic()
    run1 = _with_max_steps(load_contract(plan.stage1_config), plan.stage1_max_steps)
    run2 = _with_max_steps(load_contract(plan.stage2_config), plan.stage2_max_steps)
    if run1.trainer_variant != "stage1_sft" or run2.trainer_variant != "stage2_rollout_aligned":
        raise LaunchError("the demo needs a stage1_sft config then a stage2_rollout_aligned config")
    if Path(run2.model.path).resolve() != Path(run1.training.output_dir).resolve():
        raise LaunchError(
            f"stage 2 must start from stage 1: set model.path of {plan.stage2_config} to stage 1's output_dir "
            f"({run1.training.output_dir}); it is {run2.model.path}"
        )
    ensure_assets(run1, plan, log)
    seconds["assets"] = time.monotonic() - clock

    clock = time.monotonic()
    _claim_output_dir(run1.training.output_dir)
    trainer1 = build_trainer(run1, callbacks=callbacks_for("stage 1"))
    stopper = Stage1TargetStop(
        trainer1, _val_records(trainer1, plan.eval_records), every=plan.stage1_eval_every,
        parse_target=plan.stage1_target_parse_rate, match_target=plan.stage1_target_match_rate, log=log,
    )
    trainer1.add_callback(stopper)
    trainer1.remove_callback(PrinterCallback)  # the progress callbacks print; HF's raw log dicts would duplicate
    try:
        trainer1.train()
        trainer1.save_model()
    finally:
        if trainer1.backend is not None:
            trainer1.backend.close()
    stage1_steps = trainer1.state.global_step
    seconds["stage 1"] = time.monotonic() - clock

    clock = time.monotonic()
    _claim_output_dir(run2.training.output_dir)
    trainer2 = build_trainer(run2, callbacks=callbacks_for("stage 2"), rollout_log_every=run2.training.logging_steps)
    trainer2.remove_callback(PrinterCallback)
    records = _val_records(trainer2, plan.summary_records)
    try:
        trainer2.rollout_log_every = 1  # log every evaluation rollout (the PNGs come from the final one)
        before = evaluate(trainer2, records, with_loss=True)
        trainer2.rollout_log_every = run2.training.logging_steps
        trainer2.train()
        trainer2.save_model()
        trainer2.rollout_log_every = 1
        after = evaluate(trainer2, records, with_loss=True)
    finally:
        trainer2.backend.close()
    seconds["stage 2"] = time.monotonic() - clock
    stage2_dir = Path(run2.training.output_dir)
    pngs = _pick_pngs(stage2_dir, trainer2.state.global_step, plan.png_count)
    result = DemoResult(
        stage1_steps=stage1_steps,
        stage1_reached_target=stopper.reached,
        stage1_history=tuple(stopper.history),
        before=before,
        after=after,
        stage2_steps=trainer2.state.global_step,
        stage1_dir=Path(run1.training.output_dir),
        stage2_dir=stage2_dir,
        pngs=pngs,
        seconds=seconds,
    )
    (stage2_dir / "demo_summary.json").write_text(json.dumps(result_to_dict(result), indent=2) + "\n")
    return result


def result_to_dict(result: DemoResult) -> dict[str, Any]:
    """JSON-ready summary (``--json`` and ``demo_summary.json``)."""

    def point(e: RolloutEval) -> dict[str, Any]:
        return {"parse_valid_rate": e.parse_valid_rate, "match_rate": e.match_rate, "loss": e.loss,
                "box_AP": e.ap, "box_AP50": e.ap50, "figures": dict(e.figures),
                "counters": e.counters.to_log_dict(prefix="")}

    return {
        "stage1_steps": result.stage1_steps,
        "stage1_reached_target": result.stage1_reached_target,
        "stage1_checks": [
            {"step": s, "parse_valid_rate": c.ratios()["parse_valid_rate"], "match_rate": c.ratios()["match_rate"]}
            for s, c in result.stage1_history
        ],
        "stage2_steps": result.stage2_steps,
        "before_stage2": point(result.before),
        "after_stage2": point(result.after),
        "stage1_dir": str(result.stage1_dir),
        "stage2_dir": str(result.stage2_dir),
        "pngs": [str(p) for p in result.pngs],
        "seconds": result.seconds,
    }
