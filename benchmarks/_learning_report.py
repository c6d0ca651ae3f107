"""bench_learning.py's summary: spread over seeds, paired differences against the control with their standard error,
95% t interval and sign counts, the printed tables and the PNG of recall by rank and deletion recovery."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Sequence

CONTROL = "stage1_continued"
RECIPE = "stage2_recipe"
# every arm is also compared with these when present: the second control and decision 17's best arm (decision 18)
REFERENCES = (CONTROL, "stage1_gap", "stage2_drop")
# the arms the bench always trains; any other arm is a --variant, also paired against the recipe it changes
DEFAULT_ARMS = ("stage1", CONTROL, "stage1_gap", "stage2", "stage2_drop", RECIPE)
FIGURES = ("AP", "AP50", "parse_valid_rate", "match_rate", "fp_per_image", "fn_per_image", "truncation_rate")
GRID_FIGURES = ("recall", "precision", "f1", "pred_per_gt", "duplicates_per_image", "premature_eos_rate", "count_error",
                "rollout_tokens_per_image", "cell_precision", "next_object_tf", "next_object_free", "exposure_gap",
                "deletion_recovery", "duplicate_probe", "backtracks_per_image", "backtrack_recovery_rate")


# figures printed as they are (counts per image); every other figure is a rate, printed in percent
PER_IMAGE = ("fp_per_image", "fn_per_image", "duplicates_per_image", "pred_per_gt", "count_error",
             "rollout_tokens_per_image",
             "backtracks_per_image")


def figures_of(per_seed: Sequence[dict[str, Any]]) -> tuple[str, ...]:
    """The scalar figures every run of the first seed reports (the grid task adds :data:`GRID_FIGURES`)."""
    first = next(iter(per_seed[0]["runs"].values()))["eval"]
    return FIGURES + tuple(k for k in GRID_FIGURES if k in first)


def spread(values: Sequence[float | None]) -> dict[str, float | None]:
    values = [v for v in values if v is not None]
    if not values:
        return {"mean": None, "std": None, "min": None, "max": None}
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values)}


def paired(differences: Sequence[float | None]) -> dict[str, Any]:
    """Mean, sample std, standard error, 95% t interval (scipy; None with one seed) and sign counts."""
    from scipy import stats

    values = [d for d in differences if d is not None]
    out: dict[str, Any] = spread(values)
    n = len(values)
    se = out["std"] / math.sqrt(n) if n > 1 else None
    half = None if se is None else float(stats.t.ppf(0.975, n - 1)) * se
    out.update({"n": n, "se": se, "ci95": None if half is None else [out["mean"] - half, out["mean"] + half],
                "up": sum(v > 0 for v in values), "down": sum(v < 0 for v in values),
                "zero": sum(v == 0 for v in values)})
    return out


def _rank_mean(rows: Sequence[dict[str, Any]], key: str = "recall_by_rank") -> list[float | None]:
    curves = [r["eval"].get(key) or [] for r in rows]
    ranks = max((len(c) for c in curves), default=0)
    return [spread([c[k] for c in curves if k < len(c)])["mean"] for k in range(ranks)]


def summarize(per_seed: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Spread over seeds of every figure of every run, and the paired differences of every other run against the
    control (the same seed's checkpoint and data order)."""
    names = list(per_seed[0]["runs"])
    figures = figures_of(per_seed)
    summary: dict[str, Any] = {}
    for name in names:
        rows = [s["runs"][name] for s in per_seed]
        summary[name] = {k: spread([r["eval"].get(k) for r in rows]) for k in figures}
        summary[name]["trained_tokens"] = spread([r["train"]["trained_tokens"] for r in rows])
        summary[name]["wall_s"] = spread([r["train"]["wall_s"] for r in rows])
        if "recall_by_rank" in rows[0]["eval"]:
            summary[name]["recall_by_rank"] = _rank_mean(rows)
    for reference in (r for r in REFERENCES if r in names):
        for name in names:
            if name == reference or name in REFERENCES[:REFERENCES.index(reference) + 1] or (
                    reference != CONTROL and name.startswith("stage1")):
                continue
            summary[f"{name} - {reference}"] = {k: paired_of(per_seed, name, reference, k) for k in figures}
    if RECIPE in names:
        for name in (n for n in names if n not in DEFAULT_ARMS):
            summary[f"{name} - {RECIPE}"] = {k: paired_of(per_seed, name, RECIPE, k) for k in figures}
    bound = _dedup_bound(per_seed, names)
    if bound:
        summary["dedup_bound"] = bound
    gated = [s for s in per_seed if (s.get("gate") or {}).get("passed", True)]
    if all(r in names for r in REFERENCES) and len(gated) == len(per_seed):
        summary["rule"] = {name: pays(summary, name) for name in names
                           if not name.startswith("stage1") and name != "stage2_drop"}
        summary["ships"] = ships(summary)
    elif all(r in names for r in REFERENCES) and gated:  # the rule reads gated seeds only, always
        ruled = summarize(gated)
        summary["rule"], summary["ships"] = ruled["rule"], ruled["ships"]
        summary["rule_left_out_seeds"] = [s["seed"] for s in per_seed if s not in gated]
    gates = [s.get("gate") for s in per_seed if s.get("gate") is not None]
    if gates:
        summary["gate"] = {"passed": all(g["passed"] for g in gates), "failed_seeds": [
            s["seed"] for s in per_seed if s.get("gate") is not None and not s["gate"]["passed"]]}
    orders = [s.get("data_order") for s in per_seed if s.get("data_order") is not None]
    if orders:
        summary["data_order_equal"] = all(o["equal"] for o in orders)
    return summary


def paired_of(per_seed: Sequence[dict[str, Any]], name: str, reference: str, key: str, source: str = "eval"
              ) -> dict[str, Any]:
    """``name`` minus ``reference`` seed by seed, of the figures under ``source`` (``eval``: the default decoding;
    ``tuned``: each arm's tuned decoding); a seed missing either figure is left out."""
    rows = [(s["runs"][name].get(source) or {}, s["runs"][reference].get(source) or {}) for s in per_seed]
    return paired([None if a.get(key) is None or b.get(key) is None else a[key] - b[key] for a, b in rows])


DEDUP_FIGURES = ("AP50", "precision", "f1")
# raw predictions, near repeats removed (the label-free heuristic, a decoding option), certified duplicates removed
# with the ground-truth rule, and those ranked below every other prediction of the image (docs/design.md, decision
# 18). The keys stay as the committed results hold them; the printed names say what each is: the ground-truth rule is
# no bound on AP under COCO's score-order matching (docs/figures.md).
DEDUP_KINDS = ("raw", "label_free", "oracle", "oracle_lowest")
DEDUP_SHOWN = {"raw": "raw", "label_free": "near repeats out", "oracle": "gt rule out", "oracle_lowest": "gt rule last"}


def _dedup_bound(per_seed: Sequence[dict[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    """The zero-training bound of every arm whose evaluation holds the dedup figures: each kind's spread over seeds
    and its paired gain over the raw predictions (what removing or demoting repeats buys with no training)."""
    out: dict[str, Any] = {}
    for name in names:
        rows = [s["runs"][name]["eval"].get("dedup") for s in per_seed]
        if not all(rows):
            continue
        out[name] = {kind: {k: spread([r[kind].get(k) for r in rows]) for k in DEDUP_FIGURES}
                     for kind in DEDUP_KINDS if all(kind in r for r in rows)}
        out[name]["gain"] = {kind: {k: paired([None if r[kind][k] is None or r["raw"][k] is None
                                               else r[kind][k] - r["raw"][k] for r in rows]) for k in DEDUP_FIGURES}
                             for kind in DEDUP_KINDS[1:] if all(kind in r for r in rows)}
    return out


def pays(summary: dict[str, Any], name: str) -> dict[str, Any]:
    """Decision 18's pre-registered rule: AP50 above both controls (95% interval above 0), F1 above stage2_drop's
    (paired mean), precision's interval above -3 points against stage1_continued."""

    def ci_low(reference: str, key: str) -> float | None:
        d = summary.get(f"{name} - {reference}", {}).get(key) or {}
        return None if d.get("ci95") is None else d["ci95"][0]

    def mean(reference: str, key: str) -> float | None:
        return (summary.get(f"{name} - {reference}", {}).get(key) or {}).get("mean")

    checks = {"AP50 > stage1_continued": ci_low(CONTROL, "AP50"), "AP50 > stage1_gap": ci_low("stage1_gap", "AP50"),
              "F1 > stage2_drop": mean("stage2_drop", "f1"), "precision > -3 points": ci_low(CONTROL, "precision")}
    passed = {k: v is not None and (v > -0.03 if k.startswith("precision") else v > 0) for k, v in checks.items()}
    return {"checks": checks, "passed": passed, "pays": all(passed.values())}


def ships(summary: dict[str, Any]) -> dict[str, Any]:
    """Decision 18's third amendment: the arm ``coordexp init --stage 2`` writes, read from the rule over these seeds.
    A variant replaces the recipe only by meeting the rule and, when the recipe meets it too, by beating the recipe's
    AP50 (paired 95% interval above 0) without a lower F1; of several, the higher AP50 over the control."""
    rule = summary["rule"]
    paying = [n for n in rule if n not in DEFAULT_ARMS and rule[n]["pays"]]
    recipe_pays = rule.get(RECIPE, {}).get("pays", False)
    if recipe_pays:
        paying = [n for n in paying if _beats_recipe(summary, n)]
    if not paying:
        why = ("the recipe meets the rule and no variant beats it beyond noise" if recipe_pays
               else "no arm meets the rule: init keeps what it writes")
        return {"arm": RECIPE, "why": why}
    best = max(paying, key=lambda n: summary[f"{n} - {CONTROL}"]["AP50"]["mean"])
    why = ("it meets the rule and beats the recipe's AP50 with an interval above 0" if recipe_pays
           else "it meets the rule and the recipe does not")
    return {"arm": best, "why": why}


def _beats_recipe(summary: dict[str, Any], name: str) -> bool:
    d = summary.get(f"{name} - {RECIPE}")
    if not d or d["AP50"]["ci95"] is None or d["f1"]["mean"] is None:
        return False
    return d["AP50"]["ci95"][0] > 0 and d["f1"]["mean"] >= 0


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def _num(value: Any, scale: float = 1.0) -> str:
    return "-" if value is None else f"{scale * value:.2f}"


_GRID_COLUMNS = (("rec%", "recall", 100), ("prec%", "precision", 100), ("f1%", "f1", 100),
                 ("pred/GT", "pred_per_gt", 1), ("dup/img", "duplicates_per_image", 1),
                 ("pEOS%", "premature_eos_rate", 100), ("cnt err", "count_error", 1),
                 ("tok/img", "rollout_tokens_per_image", 1), ("gap%", "exposure_gap", 100),
                 ("delrec%", "deletion_recovery", 100), ("dupprb%", "duplicate_probe", 100),
                 ("back/img", "backtracks_per_image", 1), ("backrec%", "backtrack_recovery_rate", 100))


def print_tables(per_seed: Sequence[dict[str, Any]], summary: dict[str, Any], header: str) -> None:
    print("\n" + header)
    row = (f"{'seed':>5} {'run':<18}{'steps':>7}{'AP':>7}{'AP50':>7}{'parse%':>8}{'match%':>8}{'FP/img':>8}"
           f"{'FN/img':>8}{'trunc%':>8}{'tokens':>10}{'train s':>9}")
    print("match% is the stage-2 matcher's (mask IoU >= 0.3, class ignored); rec% / prec% / f1% are box IoU 0.5, "
          "class-aware; tokens and train s are each arm's trained tokens and wall time (equal steps, not compute)")
    print(row)
    for s in per_seed:
        for name, figures in s["runs"].items():
            t, e = figures["train"], figures["eval"]
            print(f"{s['seed']:>5} {name:<18}{t['steps']:>7}{_pct(e['AP']):>7}{_pct(e['AP50']):>7}"
                  f"{_pct(e['parse_valid_rate']):>8}{_pct(e['match_rate']):>8}{e['fp_per_image'] or 0:>8.2f}"
                  f"{e['fn_per_image'] or 0:>8.2f}{_pct(e['truncation_rate']):>8}{t['trained_tokens']:>10}"
                  f"{t['wall_s']:>9.0f}")
    grid = "exposure_gap" in next(iter(per_seed[0]["runs"].values()))["eval"]
    if grid:
        print(f"\n{'seed':>5} {'run':<18}" + "".join(f"{c:>9}" for c, _, _ in _GRID_COLUMNS))
        for s in per_seed:
            for name, figures in s["runs"].items():
                e = figures["eval"]
                print(f"{s['seed']:>5} {name:<18}" + "".join(f"{_num(e.get(k), f):>9}" for _, k, f in _GRID_COLUMNS))
    print(f"\nmean +- std over {len(per_seed)} seeds (+- is a standard deviation)")
    print(f"{'run':<20}{'AP':>14}{'AP50':>14}{'parse%':>14}{'match%':>14}")
    for name in per_seed[0]["runs"]:
        figures = summary[name]
        cells = [f"{100 * figures[k]['mean']:.1f}+-{100 * figures[k]['std']:.1f}" if figures[k]["mean"] is not None
                 else "-" for k in FIGURES[:4]]
        print(f"{name:<20}" + "".join(f"{c:>14}" for c in cells))
    print("\npaired differences (same seed): mean, standard error, 95% t interval, seeds up/down")
    print_paired(summary)
    if summary.get("dedup_bound"):
        print("\nrepeats removed without training: AP50 / precision / F1 in percent, mean over seeds; near repeats "
              "removed (the label-free heuristic, a decoding option), certified duplicates removed by the ground-truth "
              "rule or ranked last (no bound on AP: COCO matches in score order)")
        print(f"{'run':<22}" + "".join(f"{DEDUP_SHOWN[kind]:>22}" for kind in DEDUP_KINDS))
        for name, kinds in summary["dedup_bound"].items():
            cells = ["/".join(_pct(kinds[kind][k]["mean"]) for k in DEDUP_FIGURES) if kind in kinds else "-"
                     for kind in DEDUP_KINDS]
            print(f"{name:<22}" + "".join(f"{c:>22}" for c in cells))
    for name, rule in (summary.get("rule") or {}).items():
        shown = ", ".join(f"{k} {'yes' if ok else 'no'}" for k, ok in rule["passed"].items())
        print(f"decision 18's rule, {name}: {'PAYS' if rule['pays'] else 'does not pay'} ({shown})")
    if summary.get("ships"):
        print(f"decision 18's third amendment, over these seeds: init --stage 2 writes {summary['ships']['arm']} "
              f"({summary['ships']['why']})")
    if "gate" in summary:
        verdict = "passed on every seed" if summary["gate"]["passed"] else (
            f"FAILED on seeds {summary['gate']['failed_seeds']}: the comparison is NOT a result")
        print(f"\npilot gate: {verdict}")
    if "data_order_equal" in summary:
        print(f"data order of every continuation equal to the control's step for step: {summary['data_order_equal']}")


def print_paired(pairs: dict[str, Any]) -> None:
    """Every ``"A - B"`` entry of ``pairs``: each figure's mean, standard error, 95% t interval and sign counts."""
    for name, figures in pairs.items():
        if " - " not in name:
            continue
        print(f"  {name}")
        for k, d in figures.items():
            if d["mean"] is None:
                continue
            scale = 1 if k in PER_IMAGE else 100
            ci = "-" if d["ci95"] is None else f"[{scale * d['ci95'][0]:+.2f}, {scale * d['ci95'][1]:+.2f}]"
            se = "-" if d["se"] is None else f"{scale * d['se']:.2f}"
            print(f"    {k:<26}{scale * d['mean']:>+9.2f}  se {se:>6}  CI {ci:<20} {d['up']} up / {d['down']} down")


def write_png(per_seed: Sequence[dict[str, Any]], path: Path, names: Sequence[str] = ("stage1", CONTROL, "stage2")
              ) -> Path | None:
    """Recall by object rank (left) and deletion recovery (right) of ``names``, averaged over seeds (PIL)."""
    from PIL import Image, ImageDraw

    names = [n for n in names if n in per_seed[0]["runs"]]
    if not names or "recall_by_rank" not in per_seed[0]["runs"][names[0]]["eval"]:
        return None
    colours = [(60, 60, 60), (40, 110, 220), (220, 60, 40), (40, 160, 60)]
    width, height, pad = 760, 360, 50
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    panel = (width - 3 * pad) // 2
    curves = {n: _rank_mean([s["runs"][n] for s in per_seed]) for n in names}
    ranks = max(len(c) for c in curves.values())
    left, top, bottom = pad, pad, height - pad
    draw.rectangle([left, top, left + panel, bottom], outline="black")
    draw.text((left, top - 30), "recall by ground-truth rank (reading order)", fill="black")
    for v in (0.0, 0.5, 1.0):
        y = bottom - v * (bottom - top)
        draw.text((left - 28, y - 6), f"{v:.1f}", fill="black")
    for k in range(ranks):
        draw.text((left + k * panel / max(1, ranks - 1) - 3, bottom + 6), str(k), fill="black")
    for colour, (name, curve) in zip(colours, curves.items()):
        points = [(left + k * panel / max(1, ranks - 1), bottom - v * (bottom - top))
                  for k, v in enumerate(curve) if v is not None]
        if len(points) > 1:
            draw.line(points, fill=colour, width=2)
    x0 = 2 * pad + panel
    draw.rectangle([x0, top, x0 + panel, bottom], outline="black")
    draw.text((x0, top - 30), "deletion recovery (left-out object written)", fill="black")
    bar = panel / (2 * len(names) + 1)
    for j, (colour, name) in enumerate(zip(colours, names)):
        value = spread([s["runs"][name]["eval"].get("deletion_recovery") for s in per_seed])["mean"] or 0.0
        xa = x0 + (2 * j + 1) * bar
        draw.rectangle([xa, bottom - value * (bottom - top), xa + bar, bottom], fill=colour)
        draw.text((xa, bottom - value * (bottom - top) - 14), f"{100 * value:.0f}%", fill="black")
        draw.text((pad + j * 200, height - 20), f"-- {name}", fill=colour)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path
