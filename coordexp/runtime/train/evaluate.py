"""Detection quality of a policy: roll out records, parse and match exactly as stage 2 trains, score every valid
object, and compute COCO AP (faster-coco-eval) next to the rollout counters.

Ranking score (``score``): ``logprob`` (default) is the sequence log-probability of the object's tokens (its whole
``"object_N": {...}`` entry) under the policy, from one teacher-forced forward of the rollout
(:mod:`coordexp.runtime.model.scoring`); the COCO score is its probability ``exp(logprob)``. ``mean_logprob`` uses the
per-token mean (no length penalty for polygons), ``constant`` gives every object 1.0 (AP then depends only on
appearance order within an image, which COCO breaks ties by). Boxes are always scored (polygons as their boxes);
masks (``segm``) too when any ground-truth object is a polygon (boxes count as rectangles there).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Sequence

import numpy as np

from coordexp.runtime.train.run_folder import write_result_file
from coordexp.runtime.core.coco import CocoImage, ScoredObject, build_coco_gt, coco_results, relative_image_name
from coordexp.runtime.core.coco_metrics import CocoMetrics, evaluate_coco
from coordexp.runtime.core.dedup import ScoredImage, dedup_figures
from coordexp.runtime.core.objects import DetObject
from coordexp.runtime.core.set_figures import FIGURE_NAMES, ImageFigures, aggregate_figures, image_figures
from coordexp.runtime.core.telemetry import RolloutCounters, sum_counters
from coordexp.runtime.model.scoring import response_token_logprobs
from coordexp.runtime.core.distribution import eval_rollout_seed
from coordexp.runtime.train.pipeline import iter_rollout_samples
from coordexp.runtime.train.visualize import RolloutLogEntry, render_rollout

if TYPE_CHECKING:
    from coordexp.runtime.model.data import DetectionRecord
    from coordexp.runtime.model.encoding import EncodedSample
    from coordexp.runtime.model.scoring import LogprobTransform
    from coordexp.runtime.rollout.base import RolloutBackend
    from coordexp.runtime.train.rollout_step import HostContext, SampleTarget
    from coordexp.schema.contract import RunContract

__all__ = [
    "ScoreMode",
    "SCORE_MODES",
    "ScoredPrediction",
    "ImageRollout",
    "DetectionEval",
    "roll_out_and_score",
    "score_samples",
    "detection_metrics",
    "rollout_image_figures",
    "scored_images",
    "write_eval_files",
    "evaluate_detection",
    "run_evaluation",
]

ScoreMode = Literal["logprob", "mean_logprob", "constant"]
SCORE_MODES: tuple[str, ...] = ("logprob", "mean_logprob", "constant")
# The figures logged by training evaluation and shown first in tables.
HEADLINE = ("AP", "AP50", "AP75", "AP_small", "AP_medium", "AP_large", "AR100")


@dataclass(frozen=True)
class ScoredPrediction:
    """One valid parsed object with the log-probability of its tokens (``nan`` when not computed)."""

    obj: DetObject
    logprob: float
    n_tokens: int

    def score(self, mode: ScoreMode) -> float:
        if mode == "constant" or math.isnan(self.logprob):
            return 1.0
        value = self.logprob / max(1, self.n_tokens) if mode == "mean_logprob" else self.logprob
        return math.exp(value)


@dataclass(frozen=True)
class ImageRollout:
    """What one image's rollout contributes: its record, scored predictions, counters and the drawable entry."""

    record: "DetectionRecord"
    predictions: tuple[ScoredPrediction, ...]
    counters: RolloutCounters
    entry: RolloutLogEntry


@dataclass
class DetectionEval:
    """AP figures (boxes, and masks where polygon ground truth exists) next to the rollout counters."""

    counters: RolloutCounters
    bbox: CocoMetrics
    segm: Optional[CocoMetrics]
    score: ScoreMode
    images: int
    left_out: dict[str, int] = field(default_factory=dict)  # predictions COCO cannot score, by reason
    figures: dict[str, Any] = field(default_factory=dict)  # set figures (core.set_figures), fractions
    dedup: dict[str, Any] = field(default_factory=dict)  # --dedup: raw vs label-free repeats removed (core.dedup)
    files: dict[str, str] = field(default_factory=dict)
    measured: dict[str, Any] = field(default_factory=dict)  # what was evaluated (model, step, weights, decoding ...)
    seconds: float = 0.0

    def log_dict(self, prefix: str = "eval") -> dict[str, float]:
        """Flat figures for the trainer's log: ``{prefix}/AP`` ..., ``{prefix}/segm_AP`` ..., and the counters."""
        logs = dict(self.counters.to_log_dict(prefix=f"{prefix}/"))
        for name, metrics in (("", self.bbox), ("segm_", self.segm)):
            if metrics is None:
                continue
            for key in HEADLINE:
                value = metrics[key]
                if value is not None:
                    logs[f"{prefix}/{name}{key}"] = value
        logs.update({f"{prefix}/{key}": float(self.figures[key]) for key in FIGURE_NAMES
                     if self.figures.get(key) is not None})
        for name, bucket in (self.figures.get("count_buckets") or {}).items():  # eval/recall_objects_7_10 ...
            suffix = name.replace("-", "_").replace("+", "_plus")
            for key in ("recall", "premature_eos_rate"):
                if bucket.get(key) is not None:
                    logs[f"{prefix}/{key}_objects_{suffix}"] = float(bucket[key])
        return logs

    def to_dict(self) -> dict[str, Any]:
        return {
            "images": self.images, "score": self.score, "bbox": self.bbox.to_dict(),
            "segm": None if self.segm is None else self.segm.to_dict(),
            "figures": dict(self.figures), **({"dedup": dict(self.dedup)} if self.dedup else {}),
            "counters": self.counters.to_log_dict(prefix=""),
            "ratios": self.counters.ratios(),
            "left_out": dict(self.left_out), "files": dict(self.files), "seconds": self.seconds,
            **({"measured": dict(self.measured)} if self.measured else {}),
        }


def _pad_id(host: "HostContext") -> int:
    tokenizer = host.tokenizer
    return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else host.eos_id)


def _rollout_encoding(sample: "SampleTarget") -> "EncodedSample":
    """The sample's prompt followed by the raw rollout ids (not ``Y_train``): what the policy generated."""
    import torch

    encoded = sample.encoded
    start = int(encoded.assistant_start)
    response = torch.tensor(sample.parse.response_ids, dtype=torch.long)
    input_ids = torch.cat([encoded.input_ids[:start], response])
    return dataclasses.replace(
        encoded, input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
        mm_token_type_ids=torch.cat([encoded.mm_token_type_ids[:start], torch.zeros_like(response)]),
    )


def decoder_logprobs(host: "HostContext", model: Any) -> "LogprobTransform":
    """The log-probabilities the evaluation's decoder drew from (:func:`processed_logprobs` with the rollout
    config's decoding, greedy when evaluation decodes greedily, and the never-emit ids), so an object's score is
    the one ``/detect/`` and ``/infer/``'s logprobs report for the same tokens."""
    from coordexp.runtime.rollout.coord_group import coord_id_tensor
    from coordexp.runtime.rollout.logprobs import never_emit_ids, processed_logprobs

    decoding = host.rollout.decoding
    if host.rollout.greedy_evaluation:
        decoding = decoding.model_copy(update={"temperature": 0.0})
    coord_ids = coord_id_tensor(host.tokenizer) if decoding.coord_group_greedy else None
    suppressed = getattr(getattr(model, "generation_config", None), "suppress_tokens", None) or ()

    def transform(logits: Any, ids: Any, first: int) -> Any:
        never = never_emit_ids(host.tokenizer, logits.shape[-1], suppressed)  # the logits' width: ZeRO-3 safe
        return processed_logprobs(logits, ids, first, decoding,
                                  None if coord_ids is None else coord_ids.to(logits.device), never)

    return transform


def score_samples(
    model: Any, host: "HostContext", records: Sequence["DetectionRecord"], samples: Sequence["SampleTarget"], *,
    score: ScoreMode = "logprob", step: int = 0, batch_size: int = 8,
) -> list[ImageRollout]:
    """Each rollout sample's valid objects with the log-probability of their tokens (one teacher-forced forward
    per ``batch_size`` rollouts; skipped for ``score="constant"``)."""
    if score not in SCORE_MODES:
        raise ValueError(f"score must be one of {list(SCORE_MODES)}, got {score!r}")
    logprobs: list[Optional[np.ndarray]] = [None] * len(samples)
    if score != "constant":
        todo = [k for k, s in enumerate(samples) if s.parse is not None and s.parse.response_ids and s.valid_positions]
        transform = decoder_logprobs(host, model)
        was_training = getattr(model, "training", False)
        model.eval()
        try:
            for lo in range(0, len(todo), max(1, batch_size)):
                part = todo[lo : lo + max(1, batch_size)]
                values = response_token_logprobs(model, [_rollout_encoding(samples[k]) for k in part],
                                                 pad_token_id=_pad_id(host), transform=transform)
                for k, v in zip(part, values, strict=True):
                    logprobs[k] = v
        finally:
            model.train(was_training)
    out: list[ImageRollout] = []
    for record, sample, values in zip(records, samples, logprobs, strict=True):
        predictions = []
        for position in sample.valid_positions:
            parsed = sample.parse.objects[position]
            # the span of a final object may end one past the rollout (its closing brace is fused)
            lo, hi = parsed.token_span[0], min(parsed.token_span[1], len(sample.parse.response_ids))
            total = float(values[lo:hi].sum()) if values is not None else float("nan")
            predictions.append(ScoredPrediction(parsed.to_det_object(), total, hi - lo))
        counters = sample.counters if sample.counters is not None else RolloutCounters()
        out.append(ImageRollout(record, tuple(predictions), counters, sample.log_entry(record, step, "eval", host.tokenizer)))
    return out


def roll_out_and_score(
    model: Any,
    host: "HostContext",
    backend: "RolloutBackend",
    records: Sequence["DetectionRecord"],
    *,
    decode_batch_size: int,
    seed: int = 0,
    step: int = 0,
    score: ScoreMode = "logprob",
) -> list[ImageRollout]:
    """Roll out ``records`` in chunks (the backend's weights synced to ``model`` first) through the training
    pipeline's roll-out path, and attach each valid object's token log-probability (unless ``score="constant"``)."""
    if score not in SCORE_MODES:
        raise ValueError(f"score must be one of {list(SCORE_MODES)}, got {score!r}")
    out: list[ImageRollout] = []
    backend.sync_weights(model)
    seeds = [eval_rollout_seed(seed, step, i) for i in range(len(records))]
    chunk = max(1, int(decode_batch_size))
    for part in iter_rollout_samples(backend, host, records, seeds, chunk=chunk, policy_version=step,
                                     greedy=host.rollout.greedy_evaluation):
        out += score_samples(model, host, part.records, part.samples, score=score, step=step, batch_size=chunk)
    return out


def rollout_image_figures(rollouts: Sequence[ImageRollout]) -> list[ImageFigures]:
    """Each image's set figures (:mod:`coordexp.runtime.core.set_figures`): its valid predictions in written order
    against its ground truth, with how the rollout ended."""
    return [image_figures([p.obj for p in r.predictions], r.record.objects, eos_stopped=r.counters.eos_stopped > 0,
                          tokens=r.counters.rollout_tokens, cut_off=r.counters.eos_stopped == 0)
            for r in rollouts]


def scored_images(rollouts: Sequence[ImageRollout], score: ScoreMode = "logprob") -> list[ScoredImage]:
    """The rollouts as :func:`coordexp.runtime.core.dedup.dedup_figures` reads them."""
    return [ScoredImage(r.record.width, r.record.height, tuple(r.record.objects), tuple(p.obj for p in r.predictions),
                        tuple(p.score(score) for p in r.predictions), r.counters.eos_stopped > 0) for r in rollouts]


def detection_metrics(
    rollouts: Sequence[ImageRollout], *, score: ScoreMode = "logprob", image_root: str | Path | None = None
) -> tuple[DetectionEval, dict[str, Any], list[dict[str, Any]]]:
    """``(report, coco_gt, coco_results)``: image ids are 1..N in order, categories the sorted ground-truth descs."""
    images = [
        CocoImage(k + 1, r.record.width, r.record.height,
                  relative_image_name(str(r.record.image_paths[0]), None if image_root is None else str(image_root)),
                  tuple(r.record.objects), tuple(r.record.crowd))
        for k, r in enumerate(rollouts)
    ]
    categories = sorted({obj.desc for image in images for obj in (*image.objects, *image.crowd)})
    gt = build_coco_gt(images, categories)
    scored = [ScoredObject(k + 1, p.obj, p.score(score)) for k, r in enumerate(rollouts) for p in r.predictions]
    sizes = {image.image_id: (image.width, image.height) for image in images}
    results, left_out = coco_results(scored, sizes, {name: k + 1 for k, name in enumerate(categories)})
    has_polygons = any(obj.geometry == "poly" for image in images for obj in image.objects)
    counters = sum_counters([r.counters for r in rollouts]) if rollouts else RolloutCounters()
    report = DetectionEval(
        counters=counters,
        bbox=evaluate_coco(gt, results, "bbox"),
        segm=evaluate_coco(gt, results, "segm") if has_polygons else None,
        score=score,
        images=len(images),
        left_out=dict(left_out),
        figures=aggregate_figures(rollout_image_figures(rollouts)),
    )
    return report, gt, results


def write_eval_files(
    report: DetectionEval, rollouts: Sequence[ImageRollout], gt: dict[str, Any], results: list[dict[str, Any]],
    out_dir: str | Path, *, png_count: int = 4,
) -> DetectionEval:
    """``coco_gt.json``, ``coco_results.json`` (loads in any COCO API), ``predictions.jsonl`` (one line per image,
    norm1000 coords with score and logprob: ``coordexp convert to-results`` maps it onto an original COCO file),
    ``metrics.json`` and up to ``png_count`` PNGs (images with predictions first, then with ground truth)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_result_file(out / "coco_gt.json", (json.dumps(gt) + "\n").encode("utf-8"))
    write_result_file(out / "coco_results.json", (json.dumps(results) + "\n").encode("utf-8"))
    lines = []
    for r in rollouts:
        objects = [{"desc": p.obj.desc, p.obj.geometry: list(p.obj.coords), "score": p.score(report.score),
                    "logprob": None if math.isnan(p.logprob) else p.logprob} for p in r.predictions]
        lines.append(json.dumps({"image": str(r.record.image_paths[0]), "width": r.record.width,
                                 "height": r.record.height, "objects": objects}))
    write_result_file(out / "predictions.jsonl", "".join(line + "\n" for line in lines).encode("utf-8"))
    # images with predictions first (then those with ground truth): the pictures show what the model wrote
    order = sorted(range(len(rollouts)), key=lambda k: (not rollouts[k].predictions,
                                                        len(rollouts[k].record.objects) == 0, k))
    pngs = [render_rollout(rollouts[k].entry, out / "png" / f"eval_{k:04d}.png",
                           scores=[p.score(report.score) for p in rollouts[k].predictions]) for k in order[:png_count]]
    report.files = {"coco_gt": str(out / "coco_gt.json"), "coco_results": str(out / "coco_results.json"),
                    "predictions": str(out / "predictions.jsonl"), "metrics": str(out / "metrics.json"),
                    "pngs": ", ".join(str(p) for p in pngs)}
    write_result_file(out / "metrics.json", (json.dumps(report.to_dict(), indent=2) + "\n").encode("utf-8"))
    return report


def evaluate_detection(
    model: Any,
    host: "HostContext",
    backend: "RolloutBackend",
    records: Sequence["DetectionRecord"],
    *,
    decode_batch_size: int,
    seed: int = 0,
    step: int = 0,
    score: ScoreMode = "logprob",
    image_root: str | Path | None = None,
    out_dir: str | Path | None = None,
    png_count: int = 4,
    dedup: bool = False,
    measured: dict[str, Any] | None = None,
) -> DetectionEval:
    """Roll out, score and evaluate ``records``; with ``out_dir`` also write the results files and PNGs; with
    ``dedup`` also the figures with near repeats (the label-free heuristic) removed, beside the raw ones (never
    instead); ``measured`` (what was evaluated) goes into ``metrics.json``."""
    started = time.perf_counter()
    rollouts = roll_out_and_score(model, host, backend, records, decode_batch_size=decode_batch_size, seed=seed,
                                  step=step, score=score)
    report, gt, results = detection_metrics(rollouts, score=score, image_root=image_root)
    if dedup:
        report.dedup = dedup_figures(scored_images(rollouts, score), ("raw", "label_free"))
    report.seconds = time.perf_counter() - started
    if measured is not None:
        report.measured = {**measured, "images": len(records)}
    if out_dir is not None:
        write_eval_files(report, rollouts, gt, results, out_dir, png_count=png_count)
    return report


def run_evaluation(
    run: "RunContract",
    *,
    split: Literal["val", "train"] = "val",
    limit: Optional[int] = None,
    score: ScoreMode = "logprob",
    out_dir: str | Path | None = None,
    png_count: int = 4,
    log: Any = None,
    adapter: str | Path | None = None,
    dedup: bool = False,
    measured: dict[str, Any] | None = None,
) -> DetectionEval:
    """``coordexp eval``: load ``run.model.path`` (plus the saved LoRA ``adapter``, if any) and the split's records,
    roll out through the configured backend, evaluate, write the files under ``out_dir`` and close the backend.
    Without ``limit`` the split is read as training reads it (``data.max_val_samples`` / ``max_train_samples``), so
    the result equals the run's own evaluation of the same weights."""
    from coordexp.runtime.model.data import load_records
    from coordexp.runtime.model.policy import LaunchError, load_policy
    from coordexp.runtime.rollout.registry import create_backend
    from coordexp.runtime.train.rollout_step import HostContext

    jsonl = run.data.val_jsonl if split == "val" else run.data.train_jsonl
    if jsonl is None:
        raise LaunchError(f"the config has no data.{split}_jsonl to evaluate",
                          hint="set data.val_jsonl, or pass --split train")
    why = "--limit"
    if limit is None:
        limit = run.data.max_val_samples if split == "val" else run.data.max_train_samples
        why = f"data.max_{split}_samples"
    records = load_records(jsonl, run.data.image_root, max_samples=limit)
    model, processor = load_policy(run, adapter=adapter)
    host = HostContext.create(processor, run.rollout_matching, run.template)
    backend = create_backend(run, model, processor)
    if log is not None:
        bound = f", the first {limit} ({why})" if limit is not None else ", all of them"
        log(f"rolling out {len(records)} {split} images from {jsonl}{bound} ({type(backend).__name__})")
    try:
        return evaluate_detection(
            model, host, backend, records, decode_batch_size=run.rollout_matching.decode_batch_size, seed=run.seed,
            score=score, image_root=run.data.image_root, out_dir=out_dir, png_count=png_count, dedup=dedup,
            measured=None if measured is None else {**measured, "split": split, "limit": limit,
                                                    "decoding": run.rollout_matching.decoding.model_dump(),
                                                    "max_new_tokens": run.rollout_matching.max_new_tokens},
        )
    finally:
        backend.close()
