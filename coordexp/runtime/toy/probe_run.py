"""Evaluate one checkpoint on the grid task: the usual rollouts, COCO AP and counters (the evaluation path of
``coordexp eval``), the free-running figures of :mod:`coordexp.runtime.toy.probes`, and the three
teacher-forced-then-free probes, decoded with the HF backend from a ground-truth prefix pre-filled in the assistant
turn (docs/design.md, decision 17).

The prefix is cut from the ground truth's own token ids (the serialization stage 1 trains on) at the token that
ends an object's entry, so the model continues from a state it was trained on; a probe's continuation is parsed
together with its prefix (the same strict parser as rollouts) and the objects after the prefix are what it wrote.
"""

from __future__ import annotations

import dataclasses
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from coordexp.runtime.core.matching import aabb_iou_matrix
from coordexp.runtime.core.objects import DetObject
from coordexp.runtime.core.parsing import parse_rollout
from coordexp.runtime.core.serialize import serialize_objects
from coordexp.runtime.toy.probes import IOU, aggregate_figures, cell_precision, greedy_match, image_figures

if TYPE_CHECKING:
    from coordexp.runtime.model.data import DetectionRecord
    from coordexp.runtime.train.rollout_step import HostContext
    from coordexp.schema.contract import RunContract

__all__ = ["prefix_ids", "ProbeCase", "probe_cases", "evaluate_arm"]


def prefix_ids(host: "HostContext", objects: Sequence[DetObject], n_prefix: int) -> list[int]:
    """The token ids of the ground-truth serialization of ``objects`` up to and including the token that ends the
    ``n_prefix``-th entry (for 0, the first token, which opens the object). The serialization gets one more entry
    so the cut never falls on the fused closing ``}}`` of the last one."""
    if not 0 <= n_prefix <= len(objects):
        raise ValueError(f"n_prefix {n_prefix} must lie in [0, {len(objects)}]")
    padded = list(objects) + [objects[-1] if objects else DetObject("box", "bbox_2d", (0, 0, 1, 1))]
    ids = host.tokenizer.encode(serialize_objects(padded, host.rollout.object_field_order), add_special_tokens=False)
    if n_prefix == 0:
        return ids[:1]
    parse = parse_rollout(ids, host.tokenizer, host.vocab, piece_table=host.pieces)
    if len(parse.objects) < len(padded):
        raise ValueError(f"the ground-truth serialization parsed into {len(parse.objects)} entries, not "
                         f"{len(padded)}; the tokenizer and the serializer disagree")
    return ids[:parse.objects[n_prefix - 1].token_span[1]]


@dataclasses.dataclass(frozen=True)
class ProbeCase:
    """One probe decode: the image, the objects serialized in the prefix, how many of them, what is scored."""

    image: int
    kind: str  # "tf" | "deletion" | "duplicate"
    objects: tuple[DetObject, ...]
    n_prefix: int
    rank: int  # tf: the rank whose next object is asked; deletion: the rank left out; duplicate: the repeated rank


def probe_cases(records: Sequence["DetectionRecord"], seed: int = 0) -> list[ProbeCase]:
    """Per image: one teacher-forced next-object case at a rank drawn in 1..n-1 (seeded), one deletion case (the
    middle object left out of a prefix that runs one object past it; n >= 3) and one duplicate case (the prefix's
    last object, rank n//2 - 1, written twice; n >= 2)."""
    cases = []
    for k, record in enumerate(records):
        gts = tuple(record.objects)
        n = len(gts)
        if n >= 2:
            rank = random.Random(f"coordexp-probe:{seed}:{k}").randint(1, n - 1)
            cases.append(ProbeCase(k, "tf", gts, rank, rank))
            r = n // 2
            cases.append(ProbeCase(k, "duplicate", gts[:r] + (gts[r - 1],) + gts[r:], r + 1, r - 1))
        if n >= 3:
            i = n // 2
            cases.append(ProbeCase(k, "deletion", gts[:i] + gts[i + 1:], i + 1, i))
    return cases


def _prefilled(prompt: Any, ids: Sequence[int]) -> Any:
    """``prompt`` with ``ids`` appended to its assistant turn (a longer prompt: generation continues after them)."""
    import torch

    extra = torch.tensor(list(ids), dtype=torch.long)
    input_ids = torch.cat([prompt.input_ids, extra])
    return dataclasses.replace(prompt, input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                               mm_token_type_ids=torch.cat([prompt.mm_token_type_ids, torch.zeros_like(extra)]),
                               prompt_len=int(input_ids.shape[0]))


def _continuations(host: "HostContext", backend: Any, records: Sequence["DetectionRecord"],
                   cases: Sequence[ProbeCase]) -> list[list[DetObject]]:
    """Per case, the valid objects the model wrote after the prefix (before EOS, the guard or the length limit)."""
    from coordexp.runtime.rollout.base import RolloutRequest
    from coordexp.runtime.train.pipeline import encode_prompts

    prompts = encode_prompts(host, list(records))
    out: list[list[DetObject]] = []
    chunk = backend.decode_batch_size
    for lo in range(0, len(cases), chunk):
        part = cases[lo:lo + chunk]
        prefixes = [prefix_ids(host, c.objects, c.n_prefix) for c in part]
        requests = [RolloutRequest(_prefilled(prompts[c.image], ids), index=j, seed=0, record=records[c.image])
                    for j, (c, ids) in enumerate(zip(part, prefixes))]
        for c, ids, output in zip(part, prefixes, backend.generate(requests)):
            parse = parse_rollout(list(ids) + list(output.response_token_ids), host.tokenizer, host.vocab,
                                  piece_table=host.pieces)
            out.append([o.to_det_object() for o in parse.objects[c.n_prefix:] if o.valid])
    return out


def _probe_figures(records: Sequence["DetectionRecord"], cases: Sequence[ProbeCase], written: Sequence[list[DetObject]],
                   free_next: Sequence[tuple[bool, ...]]) -> dict[str, Any]:
    tf, free, recovered, dup_hits, dup_total = [], [], [], 0, 0
    for case, objs in zip(cases, written, strict=True):
        gts = records[case.image].objects
        if case.kind == "tf":
            tf.append(bool(objs) and float(aabb_iou_matrix(objs[:1], [gts[case.rank]])[0, 0]) >= IOU)
            free.append(free_next[case.image][case.rank])
        elif case.kind == "deletion":
            recovered.append(bool(objs) and bool((aabb_iou_matrix(objs, [gts[case.rank]]) >= IOU).any()))
        else:
            rest = list(gts[case.rank + 1:])
            taken, _ = greedy_match(objs, rest)
            dup_hits += len({g for g in taken if g is not None})
            dup_total += len(rest)
    mean = (lambda xs: sum(xs) / len(xs) if xs else None)
    tf_acc, free_acc = mean(tf), mean(free)
    return {"next_object_tf": tf_acc, "next_object_free": free_acc,
            "exposure_gap": None if tf_acc is None else tf_acc - free_acc,
            "deletion_recovery": mean(recovered), "duplicate_probe": dup_hits / dup_total if dup_total else None,
            "probe_cases": {"tf": len(tf), "deletion": len(recovered), "duplicate": sum(c.kind == "duplicate" for c in cases)}}


def evaluate_arm(run: "RunContract", *, out_dir: str | Path, cells: int, score: str = "logprob",
                 probe_images: int | None = None, png_count: int = 2) -> dict[str, Any]:
    """One checkpoint (``run.model.path``) on the validation split under ``run``'s evaluation settings: COCO AP and
    rollout counters, the free-running figures, the cell precision of its first objects and the three probes (on
    the first ``probe_images`` images; all when None)."""
    from coordexp.runtime.model.data import load_records
    from coordexp.runtime.model.policy import load_policy
    from coordexp.runtime.rollout.hf import HfRolloutBackend
    from coordexp.runtime.rollout.registry import create_backend
    from coordexp.runtime.train.evaluate import detection_metrics, roll_out_and_score, write_eval_files
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
    per_image = [image_figures(p, r.record.objects, eos_stopped=r.counters.eos_stopped > 0,
                               tokens=r.counters.rollout_tokens) for p, r in zip(preds, rollouts)]
    figures = aggregate_figures(per_image)
    figures["cell_precision"] = cell_precision(preds, [r.record.objects for r in rollouts], cells)
    eval_s = time.perf_counter() - started
    probe_records = records if probe_images is None else records[:probe_images]
    cases = probe_cases(probe_records, seed=run.seed)
    probe_backend = HfRolloutBackend(model, processor.tokenizer, decode_batch_size=rm.decode_batch_size,
                                     max_new_tokens=rm.max_new_tokens, decoding=rm.decoding,
                                     repeat_terminate=rm.repeat_terminate, hf_generate=rm.hf_generate)
    # the teacher-forced cases need one object: a short decode (the longest entry plus a margin) keeps them cheap
    entry = max((len(prefix_ids(host, c.objects, c.n_prefix + 1)) - len(prefix_ids(host, c.objects, c.n_prefix))
                 for c in cases if c.kind == "tf"), default=1)
    one_object = HfRolloutBackend(model, processor.tokenizer, decode_batch_size=rm.decode_batch_size,
                                  max_new_tokens=entry + 8, decoding=rm.decoding,
                                  repeat_terminate=rm.repeat_terminate, hf_generate=rm.hf_generate)
    written: dict[int, list[DetObject]] = {}
    try:
        for which, kinds in ((one_object, ("tf",)), (probe_backend, ("deletion", "duplicate"))):
            todo = [k for k, c in enumerate(cases) if c.kind in kinds]
            written.update(zip(todo, _continuations(host, which, probe_records, [cases[k] for k in todo])))
    finally:
        probe_backend.close()
        one_object.close()
    written = [written[k] for k in range(len(cases))]
    figures.update(_probe_figures(probe_records, cases, written, [f.next_correct for f in per_image]))
    ratios = report.counters.ratios()
    return {"AP": report.bbox["AP"], "AP50": report.bbox["AP50"], "AR100": report.bbox["AR100"],
            **{k: ratios[k] for k in ("parse_valid_rate", "match_rate", "fp_per_image", "fn_per_image",
                                      "truncation_rate")},
            **figures, "dropped": dict(report.counters.dropped_by_reason),
            "valid_objects": report.counters.pred_valid, "gt_objects": report.counters.gt_objects,
            "eval_s": eval_s, "probe_s": time.perf_counter() - started - eval_s}
