"""Issue 53's campaign in bench_learning's report: the tuned figures (``--tune-decoding``) with their spread and paired
differences, recall and premature EOS per object-count bucket, the arm ``coordexp init --stage 2`` writes named
``stage2_shipped``, and the part of the issue's rule that one run's seeds decide.

The rule (issue 53, item 5, as decision 20 pre-registered it): an arm "beats the detector you have" if its AP50 and
its F1 minus EACH of ``stage1``, ``stage1_continued``, ``stage1_annealed`` and ``stage1_long`` have a 95% t interval
above 0 on at least 12 gated seeds of the dense setting (the first of ``DENSE_GRIDS`` the calibration seeds accept),
and it is not below ``stage1`` on the 4:4-12 setting over 8 gated seeds (the interval of AP50
minus ``stage1`` not entirely below 0). One run holds one setting, so :func:`beats_detector` decides that setting's
part, on the tuned figures when every arm of every gated seed has them, else on the default decoding's (it says
which); the other part is read from a run of the other setting. The paired differences and intervals are
:func:`_learning_report.paired_of`'s.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Sequence

from _decoding_tuning import TUNED_FIGURES
from _learning_report import CONTROL, RECIPE, paired_of, print_paired, spread

DEFAULT_GRID = "4:4-12"
DENSE_GRID = "5:10-20"
"""``--dense``: 5 x 5 cells, 10-20 boxes per image (issue 53's dense scenes; the 4:4-12 default sits near its
ceiling and barely exercises premature stops)."""
SHIPPED = "stage2_shipped"
SHIPPED_ARM = RECIPE
"""The arm whose config is what ``coordexp init --stage 2`` writes (tests/e2e/test_bench_learning_arms.py ties the
two): the report names it ``stage2_shipped`` too, an alias of its figures (nothing is trained twice)."""
DENSE_GRIDS = (DENSE_GRID, "5:8-16", "4:6-14")
"""Decision 20's dense candidates, in the order calibration seeds 200-201 try them."""
BASELINES = ("stage1", CONTROL, "stage1_annealed", "stage1_long")
SCREEN_SEEDS = range(300, 308)
"""Decision 20's screen: a dense run of these seeds chooses the finalists and stage1_long's K (:func:`screen_choice`)."""
# per setting: gated seeds needed, and (baseline, figure, test) checks; "above": the interval's low end above 0,
# "not below": its high end at or above 0
RULE = {"dense": (12, tuple((b, k, "above") for b in BASELINES for k in ("AP50", "f1"))),
        "default": (8, (("stage1", "AP50", "not below"),))}
BUCKET_KEYS = ("recall", "premature_eos_rate")


def setting_of(args: dict[str, Any]) -> str | None:
    """``dense`` or ``default`` for the rule's two grid settings, None for any other run."""
    if args.get("task") != "grid":
        return None
    grid = args.get("grid")
    return "dense" if grid in DENSE_GRIDS else "default" if grid == DEFAULT_GRID else None


def source_of(per_seed: Sequence[dict[str, Any]]) -> str:
    """``tuned`` when every arm of every seed has tuned figures, else ``eval`` (the default decoding)."""
    tuned = all("tuned" in run for s in per_seed for run in s["runs"].values())
    return "tuned" if per_seed and tuned else "eval"


def _gated(per_seed: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [s for s in per_seed if not s.get("stopped") and (s.get("gate") or {}).get("passed") is True]


def _check(per_seed: Sequence[dict[str, Any]], name: str, names: Sequence[str], reference: str, key: str, test: str,
           source: str) -> dict[str, Any]:
    shown = f"{key} - {reference}"
    if reference not in names:
        return {"against": reference, "figure": key, "n": 0, "ci95": None, "ok": False,
                "why": f"{shown}: no {reference} arm in this run"}
    d = paired_of(per_seed, name, reference, key, source)
    ci = d["ci95"]
    ok = ci is not None and (ci[0] > 0 if test == "above" else ci[1] >= 0)
    if ci is None:
        why = f"{shown}: no interval ({d['n']} seed{'s' if d['n'] != 1 else ''})"
    else:
        where = "above 0" if ci[0] > 0 else "entirely below 0" if ci[1] < 0 else "crosses 0"
        why = f"{shown}: {100 * d['mean']:+.2f} [{100 * ci[0]:+.2f}, {100 * ci[1]:+.2f}] points, {where}"
    return {"against": reference, "figure": key, "test": test, "n": d["n"], "mean": d["mean"], "ci95": ci, "ok": ok,
            "why": why}


def beats_detector(per_seed: Sequence[dict[str, Any]], args: dict[str, Any]) -> dict[str, Any]:
    """The part of issue 53's rule this run decides (module doc), per arm that is no stage-1 baseline: every
    check, the gated seeds it needs and has, and the reasons it is not met."""
    setting = setting_of(args)
    if setting is None:
        return {"setting": None, "why": f"the rule reads the grid task at --grid {DENSE_GRID} (dense) and "
                f"{DEFAULT_GRID}; this run is --task {args.get('task')} --grid {args.get('grid')}"}
    need, rule = RULE[setting]
    gated = _gated(per_seed)
    source = source_of(gated or per_seed)
    names = list(per_seed[0]["runs"]) if per_seed else []
    arms: dict[str, Any] = {}
    for name in (n for n in names if not n.startswith("stage1")):
        checks = [_check(gated, name, names, ref, key, test, source) for ref, key, test in rule]
        reasons = [] if len(gated) >= need else [f"needs {need} gated seeds, has {len(gated)}"]
        reasons += [c["why"] for c in checks if not c["ok"]]
        arms[name] = {"met": not reasons, "checks": checks, "reasons": reasons}
    other = "default" if setting == "dense" else "dense"
    return {"setting": setting, "grid": args.get("grid"), "figures": "tuned" if source == "tuned" else
            "default decoding", "gated_seeds": len(gated), "needs_seeds": need, "arms": arms,
            "other_part": f"the {other} setting's part ({RULE[other][0]} gated seeds) is decided by a run of "
                          f"--grid {DENSE_GRID if other == 'dense' else DEFAULT_GRID}"}


def _wall_s(run: dict[str, Any]) -> float | None:
    """An arm's continuation wall time, None where the run has no training figures."""
    return (run.get("train") or {}).get("wall_s")


def screen_choice(per_seed: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Decision 20's screen rule over the gated seeds: the finalists (at most two treatments whose mean AP50 and mean
    F1 minus ``stage1`` are both above 0, the highest mean AP50 first; tuned figures when every arm has them) and
    ``stage1_long``'s K (the median over seeds of the first finalist's continuation wall time over the control's,
    rounded up to a multiple of 0.5, within [1.5, 10]); no finalist: no finals."""
    gated = _gated(per_seed)
    if not gated or "stage1" not in gated[0]["runs"]:
        return {"seeds": len(gated), "finalists": [], "long_multiple": None, "why": "no gated seed with stage1"}
    source = source_of(gated)
    means = {}
    for name in (n for n in gated[0]["runs"] if not n.startswith("stage1")):
        means[name] = {k: statistics.fmean(s["runs"][name][source][k] - s["runs"]["stage1"][source][k]
                                           for s in gated) for k in ("AP50", "f1")}
    finalists = sorted((n for n, m in means.items() if m["AP50"] > 0 and m["f1"] > 0),
                       key=lambda n: -means[n]["AP50"])[:2]
    out: dict[str, Any] = {"seeds": len(gated), "figures": source, "means": means, "finalists": finalists,
                           "long_multiple": None, "wall_multiples": [], "seeds_run": len(per_seed),
                           "complete": len(per_seed) >= len(SCREEN_SEEDS)}
    multiples = []
    for seed in gated if finalists else ():
        arm, control = _wall_s(seed["runs"][finalists[0]]), _wall_s(seed["runs"].get(CONTROL, {}))
        if arm and control:
            multiples.append(arm / control)
    if multiples:
        out["wall_multiples"] = multiples
        out["long_multiple"] = min(10.0, max(1.5, math.ceil(2 * statistics.median(multiples)) / 2))
    return out


def tuned_summary(per_seed: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The tuned figures' spread over seeds per arm, the settings chosen (seeds per setting) and their paired
    differences against the stage-1 baselines and decision 18's references."""
    names = list(per_seed[0]["runs"])
    out: dict[str, Any] = {"arms": {}, "chosen": {}, "paired": {}}
    for name in names:
        rows = [s["runs"][name]["tuned"] for s in per_seed]
        out["arms"][name] = {k: spread([r.get(k) for r in rows]) for k in TUNED_FIGURES}
        chosen: dict[str, int] = {}
        for r in rows:
            label = f"rp {r['repetition_penalty']:g}, near repeats {'removed' if r['near_repeat_removal'] else 'kept'}"
            chosen[label] = chosen.get(label, 0) + 1
        out["chosen"][name] = chosen
    for reference in (r for r in (*BASELINES, "stage1_gap", "stage2_drop") if r in names):
        for name in names:
            if name != reference and (reference == "stage1" or not name.startswith("stage1")):
                out["paired"][f"{name} - {reference}"] = {k: paired_of(per_seed, name, reference, k, "tuned")
                                                          for k in TUNED_FIGURES}
    return out


def bucket_summary(per_seed: Sequence[dict[str, Any]], source: str = "eval") -> dict[str, Any]:
    """Per arm and object-count bucket: recall and premature EOS, mean over the seeds that have the bucket."""
    out: dict[str, Any] = {}
    for name in per_seed[0]["runs"]:
        rows = [(s["runs"][name].get(source) or {}).get("count_buckets") or {} for s in per_seed]
        buckets = list(dict.fromkeys(b for r in rows for b in r))
        out[name] = {b: {k: spread([r[b].get(k) for r in rows if b in r])["mean"] for k in BUCKET_KEYS}
                     for b in buckets}
    return out


def checkpoint_paired(per_seed: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Every arm minus ``stage1`` (the checkpoint every continuation starts from) at the default decoding, the
    figures of :data:`TUNED_FIGURES`: the comparison a user makes, beside the pairs against the continuation."""
    names = list(per_seed[0]["runs"])
    if "stage1" not in names:
        return {}
    return {f"{name} - stage1": {k: paired_of(per_seed, name, "stage1", k) for k in TUNED_FIGURES}
            for name in names if name != "stage1"}


def extend_summary(per_seed: Sequence[dict[str, Any]], summary: dict[str, Any], args: dict[str, Any]) -> None:
    """Add the campaign's keys to ``summary``: ``aliases`` (stage2_shipped), ``count_buckets`` (and
    ``tuned_count_buckets``), ``checkpoint_paired`` (every arm against ``stage1`` at the default decoding),
    ``tuned`` when every arm has tuned figures, and ``beats_detector``."""
    if not per_seed:
        return
    names = list(per_seed[0]["runs"])
    if SHIPPED_ARM in names:
        summary["aliases"] = {SHIPPED: SHIPPED_ARM}
    summary["checkpoint_paired"] = checkpoint_paired(per_seed)
    summary["count_buckets"] = bucket_summary(per_seed)
    if source_of(per_seed) == "tuned":
        summary["tuned"] = tuned_summary(per_seed)
        summary["tuned_count_buckets"] = bucket_summary(per_seed, "tuned")
    summary["beats_detector"] = beats_detector(per_seed, args)
    if setting_of(args) == "dense" and all(s["seed"] in SCREEN_SEEDS for s in per_seed):
        summary["screen"] = screen_choice(per_seed)


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def _cell(key: str, value: Any) -> str:
    """A rate in percent, a count per image as it is."""
    if value is None or key != "duplicates_per_image":
        return _pct(value)
    return f"{value:.2f}"


def _shown(name: str, summary: dict[str, Any]) -> str:
    aliases = {arm: alias for alias, arm in (summary.get("aliases") or {}).items()}
    return f"{name} = {aliases[name]}" if name in aliases else name


def _print_buckets(title: str, buckets: dict[str, Any], summary: dict[str, Any]) -> None:
    order = list(dict.fromkeys(b for arm in buckets.values() for b in arm))
    if not order:
        return
    print(f"\n{title}: recall% / premature EOS% per ground-truth object count, mean over seeds")
    print(f"{'run':<34}" + "".join(f"{b + ' objects':>18}" for b in order))
    for name, arm in buckets.items():
        cells = [f"{_pct(arm[b]['recall'])} / {_pct(arm[b]['premature_eos_rate'])}" if b in arm else "-"
                 for b in order]
        print(f"{_shown(name, summary):<34}" + "".join(f"{c:>18}" for c in cells))


def print_campaign(per_seed: Sequence[dict[str, Any]], summary: dict[str, Any]) -> None:
    """The tables of :func:`extend_summary`'s keys and the rule's verdict per arm with its reasons."""
    if not per_seed:
        return
    for alias, arm in (summary.get("aliases") or {}).items():
        print(f"\n{alias}: {arm} (the arm `coordexp init --stage 2` writes; its figures, not another run)")
    _print_buckets("default decoding", summary.get("count_buckets") or {}, summary)
    if summary.get("checkpoint_paired"):
        print("\nagainst the checkpoint (stage1), default decoding: mean, standard error, 95% t interval, seeds up/down")
        print_paired(summary["checkpoint_paired"])
    tuned = summary.get("tuned")
    if tuned:
        print("\ntuned decoding (chosen per arm and seed on the held-out tuning split; figures on the test images)")
        print(f"{'seed':>5} {'run':<22}{'rp':>6}{'nrr':>5}" + "".join(f"{k[:9]:>10}" for k in TUNED_FIGURES))
        for s in per_seed:
            for name, run in s["runs"].items():
                t = run["tuned"]
                removal = "on" if t["near_repeat_removal"] else "off"
                print(f"{s['seed']:>5} {name:<22}{t['repetition_penalty']:>6g}{removal:>5}"
                      + "".join(f"{_cell(k, t[k]):>10}" for k in TUNED_FIGURES))
        print("\nmean over seeds of the tuned figures (AP50, F1 in percent) and the settings chosen")
        for name, arm in tuned["arms"].items():
            chosen = "; ".join(f"{label}: {n}" for label, n in tuned["chosen"][name].items())
            print(f"  {_shown(name, summary):<34} AP50 {_pct(arm['AP50']['mean'])} F1 {_pct(arm['f1']['mean'])} "
                  f"({chosen})")
        print("\npaired differences of the tuned figures (same seed): mean, standard error, 95% t interval, seeds "
              "up/down")
        print_paired(tuned["paired"])
        _print_buckets("tuned decoding", summary.get("tuned_count_buckets") or {}, summary)
    screen = summary.get("screen")
    if screen:
        shown = "; ".join(f"{n} AP50 {100 * m['AP50']:+.2f}, F1 {100 * m['f1']:+.2f}"
                          for n, m in (screen.get("means") or {}).items())
        print(f"\ndecision 20's screen rule over {screen['seeds']} gated seeds, mean minus stage1 "
              f"({screen.get('figures', '-')} figures): {shown or '-'}")
        if not screen.get("complete", True):
            print(f"  provisional: {screen.get('seeds_run')} of the screen's {len(SCREEN_SEEDS)} seeds have run; "
                  "it chooses nothing until every one has")
        if screen["finalists"]:
            multiples = ", ".join(f"{m:.1f}" for m in screen["wall_multiples"])
            print(f"  finalists: {', '.join(screen['finalists'])}; stage1_long's K = {screen['long_multiple']:g} "
                  f"({screen['finalists'][0]}'s wall time over the control's per seed: {multiples or '-'})")
        else:
            print("  no finalist: no treatment's mean AP50 and F1 minus stage1 are both above 0 (no finals)")
    verdict = summary.get("beats_detector") or {}
    if verdict.get("setting") is None:
        if verdict:
            print(f"\nissue 53's rule: not decided by this run ({verdict['why']})")
        return
    print(f"\nissue 53's rule, the {verdict['setting']} setting's part (--grid {verdict['grid']}), on the "
          f"{verdict['figures']} figures of {verdict['gated_seeds']} gated seeds (needs {verdict['needs_seeds']}); "
          f"{verdict['other_part']}")
    for name, arm in verdict["arms"].items():
        state = "MET" if arm["met"] else "not met"
        print(f"  {_shown(name, summary)}: {state}" + ("" if arm["met"] else f" ({'; '.join(arm['reasons'])})"))


def campaign_verdict(dense: dict[str, Any], sparse: dict[str, Any]) -> dict[str, Any]:
    """Issue 53's whole rule from the finals' two runs (each a merged run: ``args`` and ``seeds``): a treatment
    beats the detector you have when it meets the dense part and the 4:4-12 part; of several, what ships is the
    highest mean dense AP50 minus ``stage1``; of none, ``coordexp init --stage 2`` stays as it is."""
    parts = {"dense": beats_detector(dense["seeds"], dense["args"]),
             "default": beats_detector(sparse["seeds"], sparse["args"])}
    for setting, part in parts.items():
        if part["setting"] != setting:
            grid = DENSE_GRID if setting == "dense" else DEFAULT_GRID
            raise ValueError(f"the {setting} part needs a grid run at --grid {grid}; got {part.get('grid')!r}"
                             f" ({part.get('why', part['setting'])})")
    arms: dict[str, Any] = {}
    for name, on_dense in parts["dense"]["arms"].items():
        on_sparse = parts["default"]["arms"].get(name)
        reasons = [f"dense: {r}" for r in on_dense["reasons"]]
        reasons += ([f"{DEFAULT_GRID}: {r}" for r in on_sparse["reasons"]] if on_sparse is not None
                    else [f"{DEFAULT_GRID}: no {name} arm in that run"])
        gain = next((c.get("mean") for c in on_dense["checks"] if c["against"] == "stage1" and c["figure"] == "AP50"),
                    None)
        arms[name] = {"met": not reasons, "reasons": reasons, "dense_ap50_minus_stage1": gain}
    met = [n for n, a in arms.items() if a["met"]]
    ships = max(met, key=lambda n: arms[n]["dense_ap50_minus_stage1"]) if met else None
    return {"arms": arms, "ships": ships, "gated_seeds": {s: p["gated_seeds"] for s, p in parts.items()},
            "figures": {s: p["figures"] for s, p in parts.items()}}


def _points(a: Any, b: Any) -> str:
    """``a - b`` in points, one decimal; a difference that rounds to zero is ``0.0``, not ``-0.0``."""
    if a is None or b is None:
        return "-"
    shown = f"{100 * (a - b):+.1f}"
    return "0.0" if shown in ("+0.0", "-0.0") else shown


def _first_last(values: Any, percent: bool) -> str:
    if not values:
        return "-"
    return " -> ".join(f"{100 * v:.1f}%" if percent else f"{v:.2f}" for v in (values[0], values[-1]))


def seed_figures(result: dict[str, Any]) -> list[str]:
    """One finished seed's figures as a decision 20 amendment states them, read from its result file (so no figure
    is typed by hand): the gate, ``stage1``'s premature EOS and tuned figures, and per arm the tuned and default
    AP50 / F1 minus ``stage1`` in points, duplicates per image, the continuation wall time over the control's, and
    the training rollouts' cut-off rate and reward, first quarter -> last."""
    lines = []
    for seed in result["seeds"]:
        runs, gate = seed["runs"], seed.get("gate") or {}
        base = runs.get("stage1") or {}
        tuned, default = base.get("tuned") or {}, base.get("eval") or {}
        minutes = f", {result['total_s'] / 60:.0f} minutes" if result.get("total_s") else ""
        lines.append(f"seed {seed['seed']}{minutes}: gate {'passed' if gate.get('passed') else 'FAILED'}; stage1's "
                     f"premature EOS {_pct(default.get('premature_eos_rate'))}% at the default decoding "
                     f"({_pct(tuned.get('premature_eos_rate'))}% tuned); stage1 tuned AP50 / F1 "
                     f"{_pct(tuned.get('AP50'))} / {_pct(tuned.get('f1'))}")
        lines.append("| arm | tuned AP50 / F1 - stage1 | default AP50 / F1 - stage1 | duplicates per image, default "
                     "-> tuned | wall x control | cut off, first -> last quarter | reward, first -> last quarter |")
        lines.append("|---|---|---|---|---|---|---|")
        control = _wall_s(runs.get(CONTROL) or {})
        for name, run in runs.items():
            if name == "stage1":
                continue
            t, e, train = run.get("tuned") or {}, run.get("eval") or {}, run.get("train") or {}
            wall = _wall_s(run)
            multiple = f"{wall / control:.1f}x" if wall and control else "-"
            duplicates = " -> ".join(_cell("duplicates_per_image", x.get("duplicates_per_image")) for x in (e, t))
            lines.append(f"| `{name}` | {_points(t.get('AP50'), tuned.get('AP50'))} / "
                         f"{_points(t.get('f1'), tuned.get('f1'))} | {_points(e.get('AP50'), default.get('AP50'))} / "
                         f"{_points(e.get('f1'), default.get('f1'))} | {duplicates} | {multiple} | "
                         f"{_first_last(train.get('cut_off_quarters'), True)} | "
                         f"{_first_last(train.get('reward_quarters'), False)} |")
    return lines
