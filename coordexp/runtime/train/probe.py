"""``coordexp probe``: what a checkpoint does when its own answer goes wrong, on any converted dataset
(docs/figures.md).

The teacher-forced-then-free probes pre-fill the assistant turn with a ground-truth prefix cut from the ground
truth's own token ids (the serialization stage 1 trains on) at the token that ends an object's entry, and let
greedy decoding (HF backend) continue; the continuation is parsed together with its prefix (the rollout parser) and
the objects after the prefix are what the model wrote:
- ``exposure_gap``: next-object accuracy teacher-forced (prefix = the first r objects; is the next object written
  ground-truth object r?) minus free running (is the free rollout's r-th prediction object r?), at the same rank.
- ``deletion_recovery``: prefix = the objects up to one past a middle object, that object left out; the share of
  left-out objects the model writes before EOS (a model that only continues in reading order never returns to it).
- ``duplicate_probe``: prefix whose last object is written twice; the recall of the objects after it.
- Oracle-K: ``K`` sampled rollouts per image; ``oracle_k_recall`` is the recall of greedy and samples together,
  ``oracle_k_recoverable`` the share of greedy's misses that some sample found (recoverable by decoding; the rest
  the model does not find at all).
"""

from __future__ import annotations

import dataclasses
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from coordexp.runtime.train.run_folder import save_image, write_result_file
from coordexp.runtime.core.matching import aabb_iou_matrix
from coordexp.runtime.core.objects import DetObject
from coordexp.runtime.core.parsing import parse_rollout
from coordexp.runtime.core.serialize import serialize_objects
from coordexp.runtime.core.set_figures import IOU, greedy_match

if TYPE_CHECKING:
    from coordexp.runtime.model.data import DetectionRecord
    from coordexp.runtime.train.rollout_step import HostContext
    from coordexp.schema.contract import RunContract

__all__ = ["prefix_ids", "ProbeCase", "probe_cases", "probe_figures", "decode_probes", "oracle_k_figures",
           "run_probe", "plot_recall_by_rank"]


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


def _mean(values: Sequence[bool]) -> float | None:
    return sum(values) / len(values) if values else None


def probe_figures(records: Sequence["DetectionRecord"], cases: Sequence[ProbeCase], written: Sequence[list[DetObject]],
                  free_next: Sequence[tuple[bool, ...]]) -> dict[str, Any]:
    """The three probes' figures from what each case wrote (module doc); ``free_next`` is each image's free-running
    ``next_correct`` (:class:`~coordexp.runtime.core.set_figures.ImageFigures`)."""
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
    tf_acc, free_acc = _mean(tf), _mean(free)
    return {"next_object_tf": tf_acc, "next_object_free": free_acc,
            "exposure_gap": None if tf_acc is None else tf_acc - free_acc,
            "deletion_recovery": _mean(recovered), "duplicate_probe": dup_hits / dup_total if dup_total else None,
            "probe_cases": {"tf": len(tf), "deletion": len(recovered),
                            "duplicate": sum(c.kind == "duplicate" for c in cases)}}


def _hf_backend(model: Any, tokenizer: Any, rm: Any, *, max_new_tokens: int, decoding: Any = None) -> Any:
    from coordexp.runtime.rollout.hf import HfRolloutBackend

    return HfRolloutBackend(model, tokenizer, decode_batch_size=rm.decode_batch_size, max_new_tokens=max_new_tokens,
                            decoding=decoding if decoding is not None else rm.decoding,
                            repeat_terminate=rm.repeat_terminate, hf_generate=rm.hf_generate)


def decode_probes(model: Any, processor: Any, host: "HostContext", records: Sequence["DetectionRecord"],
                  free_next: Sequence[tuple[bool, ...]], *, seed: int) -> dict[str, Any]:
    """Build, decode (HF backend, the run's decoding) and score the probe cases of ``records``."""
    rm = host.rollout
    cases = probe_cases(records, seed=seed)
    # the teacher-forced cases need one object: a short decode (the longest entry plus a margin) keeps them cheap
    entry = max((len(prefix_ids(host, c.objects, c.n_prefix + 1)) - len(prefix_ids(host, c.objects, c.n_prefix))
                 for c in cases if c.kind == "tf"), default=1)
    one_object = _hf_backend(model, processor.tokenizer, rm, max_new_tokens=entry + 8)
    whole = _hf_backend(model, processor.tokenizer, rm, max_new_tokens=rm.max_new_tokens)
    written: dict[int, list[DetObject]] = {}
    try:
        for backend, kinds in ((one_object, ("tf",)), (whole, ("deletion", "duplicate"))):
            todo = [k for k, c in enumerate(cases) if c.kind in kinds]
            written.update(zip(todo, _continuations(host, backend, records, [cases[k] for k in todo])))
    finally:
        whole.close()
        one_object.close()
    return probe_figures(records, cases, [written[k] for k in range(len(cases))], free_next)


def oracle_k_figures(records: Sequence["DetectionRecord"], greedy: Sequence[Sequence[DetObject]],
                     sampled: Sequence[Sequence[Sequence[DetObject]]]) -> dict[str, Any]:
    """Class-aware recall of greedy alone and of greedy plus the samples of each image (``sampled[i]`` holds the K
    sampled predictions of image i), and the share of greedy's misses some sample found."""
    gt = found_greedy = found_any = 0
    for record, preds, samples in zip(records, greedy, sampled, strict=True):
        gts = list(record.objects)
        greedy_hit = {g for g in greedy_match(list(preds), gts, class_aware=True)[0] if g is not None}
        any_hit = set(greedy_hit)
        for sample in samples:
            any_hit |= {g for g in greedy_match(list(sample), gts, class_aware=True)[0] if g is not None}
        gt += len(gts)
        found_greedy += len(greedy_hit)
        found_any += len(any_hit)
    missed = gt - found_greedy
    return {"oracle_k": len(sampled[0]) if sampled else 0,
            "greedy_recall": found_greedy / gt if gt else None,
            "oracle_k_recall": found_any / gt if gt else None,
            "oracle_k_recoverable": (found_any - found_greedy) / missed if missed else None,
            "greedy_missed": missed}


def _sample_rollouts(model: Any, processor: Any, host: "HostContext", records: Sequence["DetectionRecord"], *,
                     k: int, temperature: float, seed: int) -> list[list[list[DetObject]]]:
    """``k`` sampled rollouts of every record (HF backend, seeded per record and sample)."""
    from coordexp.runtime.core.distribution import eval_rollout_seed
    from coordexp.runtime.train.pipeline import iter_rollout_samples

    rm = host.rollout
    decoding = rm.decoding.model_copy(update={"temperature": float(temperature), "num_beams": 1,
                                              "coord_group_greedy": False})
    backend = _hf_backend(model, processor.tokenizer, rm, max_new_tokens=rm.max_new_tokens, decoding=decoding)
    out: list[list[list[DetObject]]] = [[] for _ in records]
    try:
        for sample in range(k):
            seeds = [eval_rollout_seed(seed, 1 + sample, i) for i in range(len(records))]
            done = 0
            for part in iter_rollout_samples(backend, host, list(records), seeds, chunk=rm.decode_batch_size):
                for s in part.samples:
                    objs = [] if s.parse is None else [s.parse.objects[i].to_det_object() for i in s.valid_positions]
                    out[done].append(objs)
                    done += 1
    finally:
        backend.close()
    return out


def plot_recall_by_rank(figures: dict[str, Any], path: str | Path) -> Path:
    """A bar chart of free-running recall at each reading-order rank (Pillow: no plotting library needed)."""
    from PIL import Image, ImageDraw, ImageFont

    values = [v for v in figures.get("recall_by_rank") or []]
    width, height, pad = 640, 360, 40
    image = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    draw.text((pad, 8), "free-running recall by reading-order rank (class-aware, IoU 0.5)", fill=(0, 0, 0), font=font)
    draw.line([(pad, height - pad), (width - 10, height - pad)], fill=(0, 0, 0))
    draw.line([(pad, 30), (pad, height - pad)], fill=(0, 0, 0))
    for level in (0.0, 0.5, 1.0):
        y = height - pad - level * (height - pad - 30)
        draw.text((4, y - 6), f"{level:.1f}", fill=(0, 0, 0), font=font)
    slots = max(1, len(values))
    bar = (width - pad - 20) / slots
    for r, value in enumerate(values):
        x0 = pad + 4 + r * bar
        if value is not None:
            y = height - pad - min(1.0, max(0.0, float(value))) * (height - pad - 30)
            draw.rectangle([x0, min(y, height - pad - 1), x0 + max(1.0, bar - 3), height - pad - 1],
                           fill=(30, 100, 255))
        if slots <= 30 or r % max(1, slots // 15) == 0:
            draw.text((x0, height - pad + 4), str(r), fill=(0, 0, 0), font=font)
    draw.text((width // 2 - 20, height - 16), "rank", fill=(0, 0, 0), font=font)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_image(image, out)
    return out


def run_probe(run: "RunContract", *, limit: int | None = None, oracle_k: int = 4, temperature: float = 1.0,
              adapter: str | Path | None = None, out_dir: str | Path | None = None, log: Any = None,
              measured: dict[str, Any] | None = None) -> dict[str, Any]:
    """``coordexp probe``: the free-running set figures of greedy rollouts (the configured backend), the three
    prefix probes and Oracle-K (HF backend) on the first ``limit`` validation records; with ``out_dir``,
    ``probe.json`` and ``recall_by_rank.png`` there."""
    import json

    from coordexp.runtime.model.data import load_records
    from coordexp.runtime.model.policy import LaunchError, load_policy
    from coordexp.runtime.rollout.registry import create_backend
    from coordexp.runtime.train.evaluate import roll_out_and_score, rollout_image_figures
    from coordexp.runtime.core.set_figures import aggregate_figures
    from coordexp.runtime.train.rollout_step import HostContext

    if run.data.val_jsonl is None:
        raise LaunchError("the config has no data.val_jsonl to probe", hint="set data.val_jsonl")
    started = time.perf_counter()
    records = load_records(run.data.val_jsonl, run.data.image_root,
                           max_samples=limit if limit is not None else run.data.max_val_samples)
    model, processor = load_policy(run, adapter=adapter)
    host = HostContext.create(processor, run.rollout_matching, run.template)
    say = log or (lambda message: None)
    say(f"greedy rollouts of {len(records)} images")
    backend = create_backend(run, model, processor)
    try:
        rollouts = roll_out_and_score(model, host, backend, records,
                                      decode_batch_size=run.rollout_matching.decode_batch_size, seed=run.seed,
                                      score="constant")
    finally:
        backend.close()
    per_image = rollout_image_figures(rollouts)
    figures: dict[str, Any] = {"images": len(records), **aggregate_figures(per_image)}
    say(f"prefix probes (exposure gap, deletion, duplicate) on {len(records)} images")
    figures.update(decode_probes(model, processor, host, records, [f.next_correct for f in per_image], seed=run.seed))
    if oracle_k > 0:
        say(f"Oracle-{oracle_k}: {oracle_k} sampled rollouts per image at temperature {temperature}")
        sampled = _sample_rollouts(model, processor, host, records, k=oracle_k, temperature=temperature, seed=run.seed)
        figures.update(oracle_k_figures(records, [[p.obj for p in r.predictions] for r in rollouts], sampled))
        figures["oracle_temperature"] = float(temperature)
    figures["seconds"] = time.perf_counter() - started
    if measured is not None:  # what was probed: the model with its step and weights hash, the config, the images
        figures["measured"] = {**measured, "images": len(records), "limit": limit, "oracle_temperature": temperature,
                               "decoding": run.rollout_matching.decoding.model_dump()}
    if out_dir is not None:
        out = Path(out_dir)
        write_result_file(out / "probe.json", (json.dumps(figures, indent=2) + "\n").encode("utf-8"))
        figures["files"] = {"probe": str(out / "probe.json"),
                            "recall_by_rank": str(plot_recall_by_rank(figures, out / "recall_by_rank.png"))}
    return figures
