"""Host-side cost of stage 2: parse + match + build targets, and the coord-loss memory against a naive baseline.

Run: ``.venv/bin/python benchmarks/bench_host_pipeline.py [--samples 256] [--seq-len 2048] [--vocab 151936]``

Part 1 times each stage per sample on synthetic rollouts with 1-60 objects (bbox/poly mix, jittered GT, dropped
GT, FPs, truncated and malformed cases) tokenized by the tiny tokenizer, and prints median and p99 ms per stage
(match+ot also split into its matching part, DetObjects included, and its OT part), plus the same figures for
60-object samples (target: p99 total under 5 ms).

Part 2 measures, each in a fresh subprocess (``ru_maxrss`` is a process-lifetime peak), the extra peak memory of
the coord loss on given logits ``(1, T, V)``: ours (``compute_objective`` with ``coord_reg`` + ``bbox_geo``) vs a
naive baseline that takes a full-vocab ``log_softmax`` of the whole sequence and gathers the coord slots from it
(target: ours at least 10x lower). Both include what autograd saves for backward; neither includes the logits
gradient, which any loss needs (reported separately for the forward+backward peak).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DESCS = ["red triangle", "blue square", "green pentagon", "yellow circle", "black cat", "traffic sign", "person"]


def _random_object(rng: random.Random):
    from coordexp.runtime.core.objects import DetObject

    if rng.random() < 0.6:
        x1, y1 = rng.randint(0, 900), rng.randint(0, 900)
        return DetObject(rng.choice(DESCS), "bbox_2d", (x1, y1, rng.randint(x1, 999), rng.randint(y1, 999)))
    cx, cy, r = rng.randint(100, 900), rng.randint(100, 900), rng.randint(20, 100)
    n = rng.randint(3, 8)
    pts = []
    for k in range(n):
        ang = 2 * np.pi * k / n
        pts += [int(np.clip(cx + r * np.cos(ang), 0, 999)), int(np.clip(cy + r * np.sin(ang), 0, 999))]
    return DetObject(rng.choice(DESCS), "poly", tuple(pts))


def _jitter(obj, rng: random.Random):
    from coordexp.runtime.core.objects import DetObject

    c = [int(np.clip(v + rng.randint(-15, 15), 0, 999)) for v in obj.coords]
    if obj.geometry == "bbox_2d":
        c = [min(c[0], c[2]), min(c[1], c[3]), max(c[0], c[2]), max(c[1], c[3])]
    return DetObject(obj.desc, obj.geometry, tuple(c))


def make_samples(tokenizer, n_samples: int, seed: int, n_objects: int | None = None):
    """Synthetic (gt objects, rollout ids) pairs: jittered/dropped GT plus FPs, some truncated, malformed or junk-led."""
    from coordexp.runtime.core.serialize import serialize_objects

    rng = random.Random(seed)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    samples = []
    for _ in range(n_samples):
        n = n_objects if n_objects is not None else rng.randint(1, 60)
        gts = [_random_object(rng) for _ in range(n)]
        preds = [_jitter(g, rng) for g in gts if rng.random() > 0.2]
        preds += [_random_object(rng) for _ in range(rng.randint(0, max(1, n // 10)))]
        rng.shuffle(preds)
        text = serialize_objects(preds, "desc_first") if preds else "{}"
        case = rng.random()
        if case < 0.1 and preds:  # malformed: the first geometry array loses its second coordinate (arity)
            text = re.sub(r'(\["<\|coord_\d+\|>"), "<\|coord_\d+\|>"', r"\1", text, count=1)
        elif case < 0.15:
            text = "Sure! " + text
        ids = tokenizer.encode(text, add_special_tokens=False)
        if 0.15 <= case < 0.35 and len(ids) > 4:
            ids = ids[: rng.randint(1, len(ids) - 1)]  # truncated rollout: no stop token
        else:
            ids = ids + [im_end]
        samples.append((gts, ids))
    return samples


def time_pipeline(tokenizer, samples, contract_objects):
    from coordexp.runtime.core.matching import match_objects
    from coordexp.runtime.core.ot import pair_coord_targets
    from coordexp.runtime.core.parsing import parse_rollout
    from coordexp.runtime.core.pieces import PieceTable
    from coordexp.runtime.core.targets import build_train_target
    from coordexp.runtime.core.tokens import CoordVocab

    matching_cfg, ot_cfg, token_ce_cfg = contract_objects
    vocab = CoordVocab.from_tokenizer(tokenizer)
    table = PieceTable.for_tokenizer(tokenizer)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows = []
    for gts, ids in samples:
        t0 = time.perf_counter()
        parse = parse_rollout(ids, tokenizer, vocab, piece_table=table)
        t1 = time.perf_counter()
        valid_pos = [i for i, o in enumerate(parse.objects) if o.valid]
        preds = [parse.objects[i].to_det_object() for i in valid_pos]
        match = match_objects(preds, gts, matching_cfg)
        t_match = time.perf_counter()
        pair_targets = pair_coord_targets(preds, gts, match.pairs, ot_cfg)
        t2 = time.perf_counter()
        pairs = [(valid_pos[p], g) for p, g in match.pairs]
        targets = [pair_targets[(p, g)] for p, g in match.pairs]
        build_train_target(
            parse, gts, pairs, targets, tokenizer, vocab,
            field_order="desc_first", token_ce=token_ce_cfg, eos_id=eos, piece_table=table,
        )
        t3 = time.perf_counter()
        rows.append((
            len(gts), (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3, (t3 - t0) * 1e3,
            (t_match - t1) * 1e3, (t2 - t_match) * 1e3,  # match+ot split: DetObjects + matching, then OT targets
        ))
    return np.array(rows)


def _print_stage_table(title: str, rows: np.ndarray) -> dict:
    print(f"\n{title} ({len(rows)} samples, objects per sample {int(rows[:, 0].min())}-{int(rows[:, 0].max())})")
    print(f"  {'stage':<10} {'median ms':>10} {'p99 ms':>10}")
    out = {}
    for col, name in zip(range(1, 5), ("parse", "match+ot", "targets", "total")):
        med, p99 = float(np.median(rows[:, col])), float(np.percentile(rows[:, col], 99))
        out[name] = {"median_ms": med, "p99_ms": p99}
        print(f"  {name:<10} {med:>10.3f} {p99:>10.3f}")
    for col, name in zip((5, 6), ("match", "ot")):  # finer view of match+ot (not part of the total above)
        med, p99 = float(np.median(rows[:, col])), float(np.percentile(rows[:, col], 99))
        out[name] = {"median_ms": med, "p99_ms": p99}
        print(f"    {name:<8} {med:>10.3f} {p99:>10.3f}")
    return out


MEMORY_CHILD = r"""
import json, resource, sys, torch
mode, T, V, n_coord = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
sys.path.insert(0, sys.argv[5])
torch.manual_seed(0)
torch.set_num_threads(1)
coord_ids = torch.arange(V - 1000, V)
logits = torch.randn(1, T, V, requires_grad=True)
positions = torch.linspace(T // 4, T - 2, n_coord).long()
targets = torch.randint(0, 1000, (n_coord,)).float()
def kib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if mode == "ours":
    from coordexp.runtime.model.losses import SupervisionBatch, compute_objective
    from coordexp.schema.pipeline import PipelineConfig
    pipeline = PipelineConfig.model_validate({"objective": [
        {"name": "coord_reg", "enabled": True, "weight": 1.0, "channels": ["B"], "config": {
            "coord_ce_weight": 0.0, "soft_ce_weight": 1.0, "w1_weight": 1.0, "coord_gate_weight": 1.0,
            "text_gate_weight": 0.0, "temperature": 1.0, "target_sigma": 2.0, "target_truncate": None}},
        {"name": "bbox_geo", "enabled": True, "weight": 1.0, "channels": ["B"],
         "config": {"smoothl1_weight": 1.0, "ciou_weight": 1.0}}]})
    n_box = n_coord // 4
    batch = SupervisionBatch(
        ce_logit_index=torch.zeros(0, dtype=torch.long), ce_labels=torch.zeros(0, dtype=torch.long),
        ce_weights=torch.zeros(0), coord_logit_index=positions, coord_targets=targets,
        bbox_slots=torch.arange(n_box * 4).reshape(n_box, 4), seq_len=T, num_rows=1)
    base = kib()
    loss = compute_objective(logits, batch, coord_ids, pipeline).total
else:
    from coordexp.runtime.model.coord_losses import gaussian_soft_targets
    base = kib()
    logp_full = torch.log_softmax(logits.float(), dim=-1)          # naive: whole sequence, full vocab
    rows = logp_full[0, positions - 1]
    gate = -torch.logsumexp(rows[:, coord_ids], dim=-1)
    logp = torch.log_softmax(rows[:, coord_ids], dim=-1)
    q = gaussian_soft_targets(targets, 2.0, None)
    loss = (-(q * logp).sum(-1)).mean() + gate.mean()
fwd = kib()
loss.backward()
bwd = kib()
print(json.dumps({"forward_extra_mib": (fwd - base) / 1024, "fwd_bwd_extra_mib": (bwd - base) / 1024}))
"""


def measure_memory(seq_len: int, vocab: int, n_coord: int) -> dict:
    results = {}
    for mode in ("naive", "ours"):
        out = subprocess.run(
            [sys.executable, "-c", MEMORY_CHILD, mode, str(seq_len), str(vocab), str(n_coord), str(ROOT)],
            capture_output=True, text=True, check=True,
        )
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151_936, help="Qwen2-VL's vocabulary size by default")
    parser.add_argument("--coord-slots", type=int, default=240, help="supervised coord positions (60 boxes)")
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from coordexp.runtime.toy.tiny import build_tiny_tokenizer
    from coordexp.schema.matching import MatchingConfig, OtConfig
    from coordexp.schema.pipeline import TokenCeConfig

    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_tokenizer(tmp)
        tokenizer = AutoTokenizer.from_pretrained(tmp)
    cfgs = (MatchingConfig(), OtConfig(), TokenCeConfig(rollout_fn_desc_weight=0.0, rollout_matched_prefix_struct_weight=0.0))

    mixed = make_samples(tokenizer, args.samples, args.seed)
    dense = make_samples(tokenizer, 64, args.seed + 1, n_objects=60)
    time_pipeline(tokenizer, mixed[:16], cfgs)  # warm caches (piece table, numpy, scipy)
    summary = {
        "mixed": _print_stage_table("Host pipeline, mixed samples", time_pipeline(tokenizer, mixed, cfgs)),
        "sixty": _print_stage_table("Host pipeline, 60-object samples", time_pipeline(tokenizer, dense, cfgs)),
    }
    p99 = summary["sixty"]["total"]["p99_ms"]
    print(f"\n  target p99 < 5 ms per 60-object sample: {p99:.3f} ms -> {'OK' if p99 < 5 else 'MISSED'}")

    if not args.skip_memory:
        mem = measure_memory(args.seq_len, args.vocab, args.coord_slots)
        print(f"\nCoord-loss extra peak memory, logits (1, {args.seq_len}, {args.vocab}) float32, "
              f"{args.coord_slots} coord slots")
        print(f"  {'':<8} {'forward MiB':>12} {'fwd+bwd MiB':>12}")
        for mode in ("naive", "ours"):
            print(f"  {mode:<8} {mem[mode]['forward_extra_mib']:>12.1f} {mem[mode]['fwd_bwd_extra_mib']:>12.1f}")
        ratio = mem["naive"]["forward_extra_mib"] / max(mem["ours"]["forward_extra_mib"], 1e-3)
        print(f"  forward ratio naive/ours: {ratio:.1f}x (target >= 10x) -> {'OK' if ratio >= 10 else 'MISSED'}")
        summary["memory"] = mem | {"forward_ratio": ratio}
    print("\nJSON " + json.dumps(summary))


if __name__ == "__main__":
    main()
