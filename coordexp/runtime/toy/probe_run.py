"""Evaluate one checkpoint on the grid task: the usual rollouts, COCO AP and counters (the evaluation path of
``coordexp eval``), the set figures (:mod:`coordexp.runtime.core.set_figures`), the grid's cell precision, and the
three teacher-forced-then-free probes of :mod:`coordexp.runtime.train.probe` (docs/design.md, decision 17).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coordexp.runtime.toy.probes import cell_precision

if TYPE_CHECKING:
    from coordexp.schema.contract import RunContract

__all__ = ["evaluate_arm"]


def evaluate_arm(run: "RunContract", *, out_dir: str | Path, cells: int, score: str = "logprob",
                 probe_images: int | None = None, png_count: int = 2) -> dict[str, Any]:
    """One checkpoint (``run.model.path``) on the validation split under ``run``'s evaluation settings: COCO AP and
    rollout counters, the free-running figures, the cell precision of its first objects and the three probes (on
    the first ``probe_images`` images; all when None)."""
    from coordexp.runtime.model.data import load_records
    from coordexp.runtime.model.policy import load_policy
    from coordexp.runtime.rollout.registry import create_backend
    from coordexp.runtime.core.dedup import dedup_figures
    from coordexp.runtime.train.evaluate import (detection_metrics, roll_out_and_score, rollout_image_figures,
                                                 scored_images, write_eval_files)
    from coordexp.runtime.train.probe import decode_probes
    from coordexp.runtime.train.rollout_step import HostContext

    started = time.perf_counter()
    records = load_records(run.data.val_jsonl, run.data.image_root, max_samples=run.data.max_val_samples)
    model, processor = load_policy(run)
    host = HostContext.create(processor, run.rollout_matching, run.template)
    backend = create_backend(run, model, processor)
    rm = run.rollout_matching
    try:
        rollouts = roll_out_and_score(model, host, backend, records, decode_batch_size=rm.decode_batch_size,
                                      seed=run.seed, score=score)
    finally:
        backend.close()
    report, gt, results = detection_metrics(rollouts, score=score, image_root=run.data.image_root)
    write_eval_files(report, rollouts, gt, results, out_dir, png_count=png_count)
    preds = [[p.obj for p in r.predictions] for r in rollouts]
    per_image = rollout_image_figures(rollouts)
    figures: dict[str, Any] = dict(report.figures)
    figures["cell_precision"] = cell_precision(preds, [r.record.objects for r in rollouts], cells)
    figures["dedup"] = dedup_figures(scored_images(rollouts, score))  # the zero-training bound (decision 18)
    eval_s = time.perf_counter() - started
    probe_records = records if probe_images is None else records[:probe_images]
    figures.update(decode_probes(model, processor, host, probe_records,
                                 [f.next_correct for f in per_image], seed=run.seed))
    ratios = report.counters.ratios()
    return {"AP": report.bbox["AP"], "AP50": report.bbox["AP50"], "AR100": report.bbox["AR100"],
            **{k: ratios[k] for k in ("parse_valid_rate", "match_rate", "fp_per_image", "fn_per_image",
                                      "truncation_rate")},
            **figures, "dropped": dict(report.counters.dropped_by_reason),
            "valid_objects": report.counters.pred_valid, "gt_objects": report.counters.gt_objects,
            "eval_s": eval_s, "probe_s": time.perf_counter() - started - eval_s}
