"""Upstream CoordExp's later layout for ``coordexp migrate`` (its configs since March 2026): the two-channel stage 2
(``custom.trainer_variant: stage2_two_channel``, its loss pipeline under ``stage2_ab.pipeline``), artifact roots
(``training.output_root`` / ``logging_root`` + ``artifact_subdir``) and the stage-1 coord-loss knobs it added.

Channel A (teacher forcing on the ground truth) and channel B (rollout matching) on a ``b_ratio`` share of the
steps are coordexp's ground-truth steps and rollout steps (``rollout_matching.gt_step_share = 1 - b_ratio``,
docs/design.md, decision 15). The pipeline moves module by module: the modules coordexp has keep their name,
``enabled``, ``weight`` and ``channels`` and the config keys that mean the same; every other module and key is
listed as left out with why (nothing disappears silently), and keys coordexp requires that upstream defaulted are
filled with upstream's defaults and said.
"""

from __future__ import annotations

from typing import Any

from coordexp.schema.dotted import ABSENT as _ABSENT, get as _get, pop as _pop
from coordexp.schema.issues import short_repr as _short

__all__ = ["TWO_CHANNEL_VARIANTS", "artifact_paths", "two_channel_pipeline", "coord_soft_ce_w1_additions",
           "effective_batch_wins", "unsupported_variant", "stage1_bbox_geo"]

TWO_CHANNEL_VARIANTS = ("stage2_ab_training", "stage2_two_channel")
"""Upstream's names for the trainer of ground-truth steps between rollout steps (the first before February 2026)."""

_RM = "rollout_matching"
_COORD_REG_KEYS = ("coord_ce_weight", "soft_ce_weight", "w1_weight", "coord_gate_weight", "text_gate_weight",
                   "temperature", "target_sigma", "target_truncate")
# upstream's CoordSoftCEW1Config defaults, which its coord_reg config fell back to (upstream F.2)
_UPSTREAM_COORD_DEFAULTS = {"coord_ce_weight": 0.0, "soft_ce_weight": 1.0, "w1_weight": 1.0, "coord_gate_weight": 1.0,
                            "text_gate_weight": 0.0, "temperature": 1.0, "target_sigma": 2.0, "target_truncate": None}
# upstream module -> {upstream config key: coordexp config key}
_KEYS = {
    "token_ce": {"rollout_fn_desc_weight": "rollout_fn_desc_weight",
                 # upstream put it on every retained prefix object; without pseudo-positives those are the matched ones
                 "rollout_global_prefix_struct_ce_weight": "rollout_matched_prefix_struct_weight"},
    "coord_reg": {key: key for key in _COORD_REG_KEYS},
    "bbox_geo": {"smoothl1_weight": "smoothl1_weight", "ciou_weight": "ciou_weight"},
    "coord_diag": {},
}
# upstream's module defaults (its bootstrap/pipeline_manifest.py for stage2_ab), for keys a file left out
_DEFAULTS = {"token_ce": {"rollout_fn_desc_weight": 1.0, "rollout_matched_prefix_struct_weight": 1.0},
             "coord_reg": _UPSTREAM_COORD_DEFAULTS, "bbox_geo": {"smoothl1_weight": 1.0, "ciou_weight": 1.0},
             "coord_diag": {}}
_ADJACENT = ("adjacent_repulsion_weight", "adjacent_repulsion_filter_mode", "adjacent_repulsion_margin_ratio",
             "adjacent_repulsion_copy_margin")
_NO_ADJACENT = "no adjacent-repulsion (anti-copy) term"
_KEY_WHY = {
    "desc_ce_weight": "no separate weight on the desc tokens: they train at weight 1",
    **{key: _NO_ADJACENT for key in _ADJACENT},
    "parameterization": "the box terms compare x1, y1, x2, y2 (no center-size parameterization)",
    "center_weight": "the box terms compare x1, y1, x2, y2 (no center-size parameterization)",
    "size_weight": "the box terms compare x1, y1, x2, y2 (no center-size parameterization)",
}
# what a key's value must be for leaving it out to change nothing (upstream's default)
_NEUTRAL = {"desc_ce_weight": 1.0, "adjacent_repulsion_weight": 0.0, "parameterization": "xyxy"}
_MODULE_WHY = {
    "loss_duplicate_burst_unlikelihood": ("no duplicate-burst unlikelihood; coordexp's certified-repeat "
                                          "unlikelihood (rollout_matching.repeats: unlikelihood, decision 18) is "
                                          "another rule and stays off unless you set it"),
    "bbox_size_aux": "no box-size auxiliary loss",
}
_APPLICATION = ("coordexp has no routing presets: token_ce trains the text of the tail, coord_reg and bbox_geo every "
                "supervised coordinate (docs/design.md, Loss)")


def artifact_paths(rw: Any) -> None:
    """``training.output_root`` / ``logging_root`` + ``artifact_subdir`` -> ``training.output_dir`` /
    ``logging_dir``, joined as upstream's loader joined them (its ``add_version`` folder is left out elsewhere)."""
    sub = _get(rw.data, "training.artifact_subdir")
    if not isinstance(sub, str) or not sub.strip():
        return
    moved = False
    for root_key, target in (("output_root", "output_dir"), ("logging_root", "logging_dir")):
        root = rw.view_as_written(f"training.{root_key}")  # a base's root was left out by its own migration
        if not isinstance(root, str) or not root.strip():
            continue
        value = f"{root.strip().rstrip('/')}/{sub.strip().strip('/')}"
        source = f"training.{root_key} + training.artifact_subdir"
        if rw.put(source, f"training.{target}", value):
            _pop(rw.data, f"training.{root_key}")
            rw.m.changes.append(f"{source} -> training.{target}: {value} (joined as upstream joined them)")
            moved = True
    if moved:
        _pop(rw.data, "training.artifact_subdir")


def coord_soft_ce_w1_additions(rw: Any) -> None:
    """Stage 1's ``custom.coord_soft_ce_w1`` keys upstream added after coordexp's mapping of that block:
    ``text_gate_weight`` is coord_reg's; the adjacent-repulsion term is removed when off, else left out."""
    block = _get(rw.data, "custom.coord_soft_ce_w1")
    if not isinstance(block, dict):
        return
    _adjacent(rw, block, "custom.coord_soft_ce_w1")


def _adjacent(rw: Any, config: dict, where: str) -> None:
    present = [key for key in _ADJACENT if key in config]
    if not present:
        return
    weight = config.get("adjacent_repulsion_weight", 0.0)
    if weight == 0:
        values = {key: config.pop(key) for key in present}
        rw.m.changes.append(f"removed {where}.{{{', '.join(present)}}}: {_short(values)} (adjacent_repulsion_weight "
                            f"0: the term was off; coordexp has {_NO_ADJACENT})")
        return
    for key in present:
        rw.m.left_out.append(f"{where}.{key}: {_NO_ADJACENT} (value was {_short(config.pop(key))})")


def two_channel_pipeline(rw: Any) -> None:
    """``stage2_ab.pipeline`` -> ``rollout_matching.pipeline``, module by module (module doc)."""
    source = _get(rw.data, "stage2_ab.pipeline")
    if not isinstance(source, dict):
        return  # absent, or a shape upstream refused too: left out with its value
    if rw.view(f"{_RM}.pipeline") is not _ABSENT:
        rw.m.unresolved.append(f"stage2_ab.pipeline: not moved, {_RM}.pipeline is set as well; keep one by hand")
        return
    pipeline: dict[str, list] = {}
    for part in ("objective", "diagnostics"):
        entries = source.get(part) or []
        if not isinstance(entries, list):
            rw.m.unresolved.append(f"stage2_ab.pipeline.{part}: not a list; write {_RM}.pipeline.{part} by hand")
            return
        pipeline[part] = [m for i, entry in enumerate(entries)
                          if (m := _module(rw, entry, f"stage2_ab.pipeline.{part}[{i}]")) is not None]
    if not pipeline["objective"]:
        rw.m.unresolved.append(f"stage2_ab.pipeline.objective: no module coordexp has; write {_RM}.pipeline by hand")
        return
    if rw.put("stage2_ab.pipeline", f"{_RM}.pipeline", pipeline):
        _pop(rw.data, "stage2_ab.pipeline")
        names = ", ".join(m["name"] for m in pipeline["objective"] + pipeline["diagnostics"])
        rw.m.changes.append(f"stage2_ab.pipeline -> {_RM}.pipeline ({names})")


def _module(rw: Any, entry: Any, where: str) -> dict | None:
    """One pipeline entry in coordexp's shape, or None (left out, with why)."""
    name = entry.get("name") if isinstance(entry, dict) else None
    if not isinstance(name, str) or name not in _KEYS:
        why = _MODULE_WHY.get(name, "not a loss module of coordexp") if isinstance(name, str) else "no module name"
        shown = name if isinstance(name, str) else _short(name)
        rw.m.left_out.append(f"{where} ({shown}): {why} (value was {_short(entry)})")
        return None
    module = {key: entry[key] for key in ("name", "enabled", "weight", "channels") if key in entry}
    channels = entry.get("channels")
    if isinstance(channels, list) and sorted(map(str, channels)) in (["A"], ["B"]):
        rw.m.left_out.append(f"{where}.channels: upstream ran it on channel {channels[0]} alone (its "
                             f"{'ground-truth' if channels[0] == 'A' else 'rollout'} steps); coordexp runs a module on "
                             "its ground-truth and rollout steps alike when its channels include B, and never "
                             f"otherwise (value was {_short(channels)}, kept)")
    if "application" in entry:
        rw.m.left_out.append(f"{where}.application: {_APPLICATION} (value was {_short(entry['application'])})")
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        rw.m.unresolved.append(f"{where}.config: not a mapping ({_short(config)}); write the module's config by hand")
        config = {}
    config = dict(config)
    _adjacent(rw, config, f"{where}.config")
    out, filled = {}, []
    for key, value in config.items():
        target = _KEYS[name].get(key)
        if target is not None:
            out[target] = value
        elif key in _NEUTRAL and value == _NEUTRAL[key]:
            rw.m.changes.append(f"removed {where}.config.{key}: {_short(value)} (upstream's default; "
                                f"{_KEY_WHY[key]})")
        else:
            rw.m.left_out.append(f"{where}.config.{key}: {_KEY_WHY.get(key, 'not a key of coordexp ' + name)} "
                                 f"(value was {_short(value)})")
    for key, value in _DEFAULTS[name].items():
        if key not in out:
            out[key] = value
            filled.append(f"{key}: {value}")
    if filled:
        rw.m.changes.append(f"{where}.config: filled {', '.join(filled)} (upstream's defaults; coordexp authors "
                            "every key)")
    module["config"] = out
    for key in ("enabled", "weight", "channels"):
        if key not in module:
            rw.m.unresolved.append(f"{where}: no {key}; coordexp authors name, enabled, weight, channels and config")
    return module


def effective_batch_wins(rw: Any) -> None:
    """Upstream derived ``gradient_accumulation_steps`` from ``effective_batch_size`` when both were set (its
    loader overwrote the authored value); coordexp resolves it the same way at launch, so the authored one goes."""
    effective = rw.view("training.effective_batch_size")
    steps = _get(rw.data, "training.gradient_accumulation_steps")
    if effective in (_ABSENT, None) or steps is _ABSENT:
        return
    _pop(rw.data, "training.gradient_accumulation_steps")
    rw.m.changes.append(f"removed training.gradient_accumulation_steps: {_short(steps)} (upstream derived it from "
                        f"effective_batch_size: {_short(effective)}, as coordexp does at launch)")


_UNSUPPORTED_VARIANTS = {
    "stage1_set_continuation": ("upstream's set-continuation stage 1 (entry-trie multi-positive CE over object "
                                "orders) has no counterpart in coordexp; custom.trainer_variant: stage1_sft trains "
                                "the plain teacher-forced SFT of the same records"),
    "gkd_monitor": ("upstream's GKD trainer (distillation from a teacher model, with its monitor) has no counterpart "
                    "in coordexp; custom.trainer_variant: stage1_sft trains the same records without a teacher"),
}


def unsupported_variant(rw: Any) -> None:
    """A trainer upstream added that coordexp does not have: said in upstream's words, not as a bad value."""
    variant = _get(rw.data, "custom.trainer_variant")
    if isinstance(variant, str) and variant in _UNSUPPORTED_VARIANTS:
        rw.m.unresolved.append(f"custom.trainer_variant: {variant}: {_UNSUPPORTED_VARIANTS[variant]}")


def stage1_bbox_geo(rw: Any) -> None:
    """Stage 1's ``custom.bbox_geo`` (SmoothL1 and 1 - CIoU on the expected box) -> a ``bbox_geo`` module of
    ``rollout_matching.pipeline``, which stage 1 trains too; run after coordexp's rewrites built that pipeline."""
    block = _get(rw.data, "custom.bbox_geo")
    if not isinstance(block, dict) or not isinstance(block.get("enabled", False), bool):
        return  # absent, or a shape upstream refused too: left out with its value
    if not block.get("enabled", False):
        _pop(rw.data, "custom.bbox_geo")
        rw.m.changes.append(f"removed custom.bbox_geo: {_short(block)} (enabled: false: the box terms were off)")
        return
    if block.get("parameterization", "xyxy") != "xyxy":
        return  # center-size: another loss space, left out by upstream_post with its value
    objective = _get(rw.data, f"{_RM}.pipeline.objective")
    if not isinstance(objective, list):
        rw.m.unresolved.append(f"custom.bbox_geo: no {_RM}.pipeline.objective in this file to add a bbox_geo module "
                               "to; add one by hand (name bbox_geo, channels [B], its smoothl1_weight and ciou_weight)")
        return
    if any(isinstance(m, dict) and m.get("name") == "bbox_geo" for m in objective):
        rw.m.unresolved.append(f"custom.bbox_geo: not moved, {_RM}.pipeline already has a bbox_geo module; keep one "
                               "by hand")
        return
    config = {"smoothl1_weight": block.get("smoothl1_weight", 0.0), "ciou_weight": block.get("ciou_weight", 1.0)}
    objective.append({"name": "bbox_geo", "enabled": True, "weight": 1.0, "channels": ["B"], "config": config})
    for key in ("enabled", "smoothl1_weight", "ciou_weight", "parameterization"):
        block.pop(key, None)
    for key in ("center_weight", "size_weight"):  # read only by the center-size parameterization
        if key in block:
            rw.m.changes.append(f"removed custom.bbox_geo.{key}: {_short(block.pop(key))} (read only with "
                                "parameterization: center_size)")
    if not block:
        _pop(rw.data, "custom.bbox_geo")
    rw.m.changes.append(f"custom.bbox_geo -> {_RM}.pipeline.objective[{len(objective) - 1}] (bbox_geo, {config})")
