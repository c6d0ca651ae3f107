"""Upstream CoordExp (ms-swift era) spellings for ``coordexp migrate``: renames, values, removals and left-outs.

Upstream configs name keys after ms-swift (``model.model``, ``custom.train_jsonl``, a top-level ``deepspeed``
block) and carry features coordexp does not have. Every such key is moved, removed as redundant (with why), or
listed as left out (with why): nothing disappears silently. Relative paths there were relative to the launch
directory, not the YAML file; :func:`resolve_paths` rewrites them (see :mod:`coordexp.schema.migrate_chain`).
"""

from __future__ import annotations

import os
import re
import typing
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel

from coordexp.schema.base import MAX_PIXELS
from coordexp.schema.legacy import find_legacy_keys
from coordexp.schema.loader import _PATH_FIELDS
from coordexp.schema.dotted import ABSENT as _ABSENT, get as _get, pop as _pop
from coordexp.schema.issues import short_repr as _short
from coordexp.schema.root import CoordExpConfig
from coordexp.schema.training import BEST_MODEL_METRICS, TrainingConfig, best_model_metric
from coordexp.schema.migrate_two_channel import (TWO_CHANNEL_VARIANTS, artifact_paths,
                                                 coord_soft_ce_w1_additions, effective_batch_wins,
                                                 stage1_bbox_geo, two_channel_pipeline, unsupported_variant)

__all__ = ["UPSTREAM_MARKERS", "is_upstream", "upstream_pre", "upstream_post", "resolve_paths", "write_paths"]

_RM = "rollout_matching"
UPSTREAM_MARKERS = ("model.model", "model.torch_dtype", "model.attn_impl", "template.template", "custom.train_jsonl",
                    "custom.val_jsonl", "custom.jsonl", "deepspeed", "data.dataset", "data.val_dataset",
                    "tuner.use_swift_lora")
"""Keys only an upstream config has: their presence anywhere in a chain makes its paths launch-relative."""

_RENAMES = {
    "model.model": "model.path",
    "model.torch_dtype": "model.dtype",
    "model.attn_impl": "model.attn_implementation",
    "custom.jsonl": "data.train_jsonl",
    "custom.train_jsonl": "data.train_jsonl",
    "custom.val_jsonl": "data.val_jsonl",
    "custom.train_sample_limit": "data.max_train_samples",
    "custom.val_sample_limit": "data.max_val_samples",
    "custom.user_prompt": "template.user_prompt",
    "template.system": "template.system_prompt",
    "training.gradient_checkpointing": "model.gradient_checkpointing",
    "custom.rollout_matching": "custom.extra.rollout_matching",  # upstream read the flat form the same way
    **{f"data.dataloader_{k}": f"training.dataloader_{k}"
       for k in ("num_workers", "pin_memory", "prefetch_factor", "persistent_workers", "drop_last")},
}

# Removed: coordexp does the same thing another way, so nothing is lost (value None: whatever the value).
_REDUNDANT: dict[str, tuple[Any, str]] = {
    "template.template": (None, "the model family comes from the checkpoint's config.json (model_type)"),
    "data.dataset": (None, "an ms-swift placeholder; coordexp reads data.train_jsonl"),
    "data.val_dataset": (None, "an ms-swift placeholder; coordexp reads data.val_jsonl"),
    "custom.json_format": ("standard", "the only record format"),
    "custom.emit_norm": ("none", "records are read as norm1000 bins as they are"),
    "tuner.use_swift_lora": (False, "coordexp trains adapters with PEFT"),
    "training.optimizer": ("multimodal", "per-part learning rates (learning_rate, vit_lr, aligner_lr) are always on"),
    "training.bf16": (None, "model.dtype sets the parameter and compute dtype"),
    "training.fp16": (None, "model.dtype sets the parameter and compute dtype"),
    "custom.bbox_format": ("xyxy", "boxes are always x1, y1, x2, y2"),
}

_NO_AUG = "coordexp has no image augmentation: records are trained on as they are"
# Left out: a feature coordexp does not have; the run behaves differently without it, so the user decides.
_LEFT_OUT = {
    "custom.augmentation": _NO_AUG,
    "custom.augmentation_curriculum": _NO_AUG,
    "custom.dump_conversation_text": "no conversation-text dump (`coordexp show-rollouts` shows rollouts)",
    "custom.dump_conversation_path": "no conversation-text dump",
    "custom.instability_monitor": "no instability monitor",
    "custom.log_file": "logs go to stdout/stderr (redirect them to a file)",
    "custom.coord_offset": ("no counterpart in coordexp's coord rows (tuner.train_coord_rows, coord_embed_lr, "
                            "coord_head_lr, coord_weight_decay; they train in the model's dtype)"),
    "custom.visual_kd": "no visual knowledge distillation",
    "custom.fusion_config": "no dataset fusion: one train_jsonl",
    "custom.use_summary": "no summary mode",
    "custom.val_sample_with_replacement": "validation takes the first max_val_samples records",
    "custom.coord_tokens": "coordinates are always coord tokens",
    "custom.bbox_geo": "the box terms compare x1, y1, x2, y2 (no center-size parameterization)",
    "custom.bbox_size_aux": "no box-size auxiliary loss (log width and height, oversize penalty)",
    "custom.bbox_format": ("coordexp's boxes are x1, y1, x2, y2 in norm1000 bins: a checkpoint trained to write "
                           "another box format reads its boxes wrongly"),
    "custom.offline_max_pixels": ("upstream resized the images offline to this budget; coordexp resizes with "
                                  "template.max_pixels (at least this large keeps them as they are)"),
    "custom.eval_detection": "training evaluation reports COCO AP of the rollouts (training.eval_steps)",
    "experiment": "upstream's run notes have no owner in coordexp",
    "benchmark": "upstream's run notes have no owner in coordexp",
    "training.packing_mode": "packing is dynamic on the actual lengths (docs/design.md, decision 8)",
    "training.output_root": ("coordexp has no output root: a file that sets training.artifact_subdir gets "
                             "training.output_dir = output_root/artifact_subdir"),
    "training.logging_root": ("coordexp has no logging root: a file that sets training.artifact_subdir gets "
                              "training.logging_dir = logging_root/artifact_subdir"),
    "training.packing_length_precompute_workers": "no precomputed static packing: packing is dynamic",
    "training.static_packing_cache": "no precomputed static packing: packing is dynamic",
    "training.encoded_sample_cache": "no encoded-sample cache: records are encoded as they are read",
    f"{_RM}.eval_rollout_backend": f"one backend ({_RM}.rollout_backend) decodes for training and evaluation",
    f"{_RM}.vllm.mm_processor_kwargs": "vLLM's processor resizes as the HF path does (template.max_pixels)",
    f"{_RM}.train_monitor_dump": "no monitor dumps",
    f"{_RM}.eval_monitor_dump": "no monitor dumps",
    # mapped in upstream_pre when upstream accepted the value; what remains here is a shape upstream refused too
    "custom.object_ordering": "upstream took sorted or random; set data.object_order (keep, sorted or random)",
    "custom.token_type_metrics": "upstream took a mapping with enabled: true/false; set training.token_type_metrics",
    "custom.extra": "upstream's free-form extras have no owner in coordexp",
    "debug": "no debug mode: its output_dir and sample limits are not applied",
    # stage2_ab.schedule.b_ratio is mapped in upstream_pre (rollout_matching.gt_step_share); the rest has no owner
    "stage2_ab.n_softctx_iter": ("the ground-truth steps (rollout_matching.gt_step_share) train with plain teacher "
                                 "forcing: no soft-context iterations"),
    "stage2_ab.bbox_smoothl1_weight": "no box regression loss: coord_reg (soft CE, W1, gate) trains the coordinates",
    "stage2_ab.channel_b": "rollout steps follow rollout_matching.*; no channel-B options",
    "stage2_ab.schedule": "upstream took b_ratio in [0, 1]; set rollout_matching.gt_step_share (1 - b_ratio)",
    "rlhf": "no GKD / RLHF trainer",
    "deepspeed": "deepspeed.enabled must be true or false with a config name",
    "data.dataset_num_proc": "records are read in-process",
    "template.truncation_strategy": "an over-long sample fails fast at global_max_length instead of being truncated",
    "training.save_delay_steps": "checkpoints are saved every save_steps from the start",
    "training.save_delay_epochs": "checkpoints are saved every save_steps from the start",
    "training.save_last_epoch": "no extra end-of-epoch checkpoint",
    "training.add_version": "coordexp writes into training.output_dir as given (no v<N>-<timestamp> folder)",
    "training.optimizer": "only the multimodal optimizer (per-part learning rates) exists",
    "tuner.use_swift_lora": "coordexp trains adapters with PEFT",
    f"{_RM}.desc_monitor": "no desc monitor (semantic matching metrics)",
    f"{_RM}.monitor_dump": "no monitor dumps",
    f"{_RM}.debug_dump_parse_failures": "no parse-failure dumps",
    f"{_RM}.debug_dump_max": "no parse-failure dumps",
    f"{_RM}.eval_detection": "evaluation runs with `coordexp eval`",
    f"{_RM}.eval_prompt_variant": "one prompt (template.*) for training and evaluation",
}
_GENERIC = "not a coordexp key in this version"
_REFUSED = "a TrainingArguments field coordexp refuses (`coordexp validate` on a file setting it says why)"


def _refused() -> set[str]:
    """training.* fields the schema declares only to refuse them (hidden from dumps: ``exclude``)."""
    return {name for name, info in TrainingConfig.model_fields.items() if info.exclude}
# training.* targets of this mapping that the TrainingArguments surface is gaining: kept even while unknown,
# so the migrated file validates once that lands (validate names them until then).
EXPECTED_TRAINING = ("vit_lr", "aligner_lr", "effective_batch_size", "lr_scheduler_kwargs")


def is_upstream(merged: dict) -> bool:
    """Whether a (merged) chain uses upstream spellings, so its relative paths were launch-relative."""
    return any(_get(merged, key) is not _ABSENT for key in UPSTREAM_MARKERS)


def _leave_out(rw: Any, dotted: str, why: str) -> None:
    value = _pop(rw.data, dotted)
    if value is not _ABSENT:
        rw.m.left_out.append(f"{dotted}: {why} (value was {_short(value)})")


def upstream_pre(rw: Any) -> None:
    """Renames and value rewrites of upstream spellings, before coordexp's own legacy rewrites run."""
    if "inherit" in rw.data:  # upstream's alias, read only when extends is absent
        inherited = rw.data.pop("inherit")
        if "extends" not in rw.data:
            rw.data["extends"] = inherited
            rw.m.changes.append("inherit -> extends")
        else:
            rw.m.changes.append("removed inherit (upstream ignored it next to extends)")
    for source, target in _RENAMES.items():
        rw.move(source, target)
    for key in ("instability_monitor", "log_file"):
        _leave_out(rw, f"custom.extra.{key}", _LEFT_OUT[f"custom.{key}"])
    _deepspeed(rw)
    _coord_offset(rw)
    artifact_paths(rw)
    coord_soft_ce_w1_additions(rw)
    effective_batch_wins(rw)
    unsupported_variant(rw)
    if _get(rw.data, "training.lr_scheduler_type") == "cosine_warmup_with_min_lr":
        rw.data["training"]["lr_scheduler_type"] = "cosine_with_min_lr"
        rw.m.changes.append("training.lr_scheduler_type: cosine_warmup_with_min_lr -> cosine_with_min_lr "
                            "(lr_scheduler_kwargs.min_lr kept)")
    pixels = _get(rw.data, "template.max_pixels")
    if isinstance(pixels, int) and not isinstance(pixels, bool) and pixels > MAX_PIXELS:
        rw.data["template"]["max_pixels"] = MAX_PIXELS
        rw.m.changes.append(f"template.max_pixels: {pixels} -> {MAX_PIXELS} (coordexp's cap; as before, images "
                            "up to that size are never resized)")
    _best_model_metric(rw)
    _eval_backend(rw)
    _token_type_metrics(rw)
    _object_ordering(rw)
    _stage2_ab(rw)
    for dotted, (value, why) in _REDUNDANT.items():
        found = _get(rw.data, dotted)
        if found is not _ABSENT and (value is None or found == value):
            _pop(rw.data, dotted)
            rw.m.changes.append(f"removed {dotted}: {_short(found)} ({why})")


_METRIC_ALIASES = ("detection/mAP", "eval/detection/mAP", "eval_detection/mAP", "eval_det_bbox_AP")


def _eval_backend(rw: Any) -> None:
    """Upstream's ``eval_rollout_backend`` equal to the training backend says nothing coordexp does not do."""
    backend = _get(rw.data, f"{_RM}.eval_rollout_backend")
    if backend is not _ABSENT and backend == rw.view(f"{_RM}.rollout_backend"):
        _pop(rw.data, f"{_RM}.eval_rollout_backend")
        rw.m.changes.append(f"removed {_RM}.eval_rollout_backend: {_short(backend)} (the training backend, which "
                            "decodes evaluation rollouts too)")


def _best_model_metric(rw: Any) -> None:
    """Upstream names metrics its own evaluation logged; those coordexp's training evaluation also reports
    (eval_token_acc: teacher-forced token accuracy of the validation split) are kept with their greater_is_better,
    others (rollout/f1, ...) are left out with the direction that goes with them, naming the figures that exist."""
    metric = _get(rw.data, "training.metric_for_best_model")
    if isinstance(metric, str) and metric in _METRIC_ALIASES:
        rw.data["training"]["metric_for_best_model"] = "AP"
        rw.m.changes.append(f"training.metric_for_best_model: {metric} -> AP (upstream's AP of its evaluation "
                            "rollouts, COCO or LVIS; coordexp's AP is their COCO AP)")
        return
    if not isinstance(metric, str) or best_model_metric(metric) is not None:
        return
    why = (f"coordexp's evaluation reports no {metric!r}; set one of {', '.join(BEST_MODEL_METRICS)} to keep the best "
           "checkpoint")
    _leave_out(rw, "training.metric_for_best_model", why)
    _leave_out(rw, "training.greater_is_better", "it ordered the left-out metric_for_best_model")
    if _get(rw.data, "training.save_strategy") == "best":
        _leave_out(rw, "training.save_strategy", "it saved when the left-out metric_for_best_model improved; "
                   "checkpoints are saved every save_steps instead")


_TOKEN_TYPE_ONE_DATASET = ("include", "exclude")  # dataset-name filters: coordexp trains one dataset


def _token_type_metrics(rw: Any) -> None:
    """``custom.token_type_metrics: {enabled: ...}`` -> ``training.token_type_metrics``; its dataset filters are
    moot (one dataset), other knobs (top-5, coord mass monitors) are left out with the reason."""
    block = _get(rw.data, "custom.token_type_metrics")
    if block is None:
        _pop(rw.data, "custom.token_type_metrics")
        rw.m.changes.append("removed custom.token_type_metrics: null (upstream's default: off)")
        return
    enabled = block.get("enabled", False) if isinstance(block, dict) else None
    if not isinstance(enabled, bool):
        return  # a shape upstream refused: upstream_post leaves it out
    if not rw.put("custom.token_type_metrics.enabled", "training.token_type_metrics", enabled):
        return
    block.pop("enabled", None)
    flag = str(enabled).lower()
    rw.m.changes.append(f"custom.token_type_metrics.enabled: {flag} -> training.token_type_metrics: {flag}")
    for key in list(block):
        dotted = f"custom.token_type_metrics.{key}"
        if key in _TOKEN_TYPE_ONE_DATASET:
            rw.m.changes.append(f"removed {dotted}: {_short(block.pop(key))} (a dataset-name filter; coordexp "
                                "trains one dataset, the figures cover every record)")
        else:
            _leave_out(rw, dotted, "coordexp logs accuracy and cross-entropy per token type, no other monitor")
    _pop(rw.data, "custom.token_type_metrics")


def _object_ordering(rw: Any) -> None:
    """``custom.object_ordering`` (sorted | random) -> ``data.object_order``: the same check / per-epoch shuffle."""
    value = _get(rw.data, "custom.object_ordering")
    if isinstance(value, str) and value.strip().lower() in ("sorted", "random"):
        if rw.put("custom.object_ordering", "data.object_order", value.strip().lower()):
            _pop(rw.data, "custom.object_ordering")
            rw.m.changes.append(f"custom.object_ordering: {value} -> data.object_order: {value.strip().lower()}")


def _stage2_ab(rw: Any) -> None:
    """Upstream's ``stage2_ab_training`` (``stage2_two_channel`` since February 2026): channel B (rollout-matching)
    on a ``b_ratio`` share of the optimizer steps, channel A (teacher forcing on the ground truth) on the others ->
    ``stage2_rollout_aligned`` with ``rollout_matching.gt_step_share = 1 - b_ratio`` (docs/design.md, decision 15);
    its ``stage2_ab.pipeline`` -> ``rollout_matching.pipeline`` (:mod:`coordexp.schema.migrate_two_channel`)."""
    variant = _get(rw.data, "custom.trainer_variant")
    if variant in TWO_CHANNEL_VARIANTS:  # then migrated as rollout_matching_sft is
        rw.data["custom"]["trainer_variant"] = "rollout_matching_sft"
        rw.m.changes.append(f"custom.trainer_variant: {variant} is rollout-matching SFT (channel B) with "
                            "ground-truth steps (channel A) between them: rollout_matching_sft + "
                            "rollout_matching.gt_step_share")
    two_channel_pipeline(rw)
    ratio = _get(rw.data, "stage2_ab.schedule.b_ratio")
    if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and 0 <= ratio <= 1:
        share = round(1.0 - float(ratio), 9)
        if rw.put("stage2_ab.schedule.b_ratio", "rollout_matching.gt_step_share", share):
            _pop(rw.data, "stage2_ab.schedule.b_ratio")
            rw.m.changes.append(f"stage2_ab.schedule.b_ratio: {ratio} -> rollout_matching.gt_step_share: {share} "
                                "(the share of steps that train the ground truth instead of rollouts)")
    for dotted in ("stage2_ab.schedule", "stage2_ab"):  # emptied by the mapping: nothing left to report
        if _get(rw.data, dotted) == {}:
            _pop(rw.data, dotted)


_COORD_ROWS = "tuner.train_coord_rows"
_TIES = ("coordexp ties the coord rows exactly when the checkpoint ties lm_head to the input embeddings "
         "(tie_word_embeddings)")


def _coord_offset(rw: Any) -> None:
    """Upstream's coord-offset adapter (trainable coord rows of the embeddings and head, own rates) onto the
    ``tuner.train_coord_rows`` / ``coord_*`` keys; ``optimizer: multimodal_coord_offset`` only switched its rate
    groups on, which coordexp always has."""
    if _get(rw.data, "training.optimizer") == "multimodal_coord_offset":
        _pop(rw.data, "training.optimizer")
        rw.m.changes.append("removed training.optimizer: multimodal_coord_offset (per-part rates are always on; the "
                            "coord rows' rates are tuner.coord_embed_lr / coord_head_lr)")
    block = _get(rw.data, "custom.coord_offset")
    if not isinstance(block, dict) or not isinstance(block.get("enabled", False), bool):
        return  # absent, or malformed: upstream_post leaves it out with its value
    src = "custom.coord_offset"
    if not block.get("enabled", False):
        if rw.put(f"{src}.enabled", _COORD_ROWS, False):
            _pop(rw.data, src)
            rw.m.changes.append(f"{src} (enabled: false) -> {_COORD_ROWS}: false (the coord rows stay as in the "
                                "checkpoint, as upstream kept them)")
        return
    if rw.view("tuner.train_type") == "full":
        _leave_out(rw, src, "under train_type: full the whole embeddings and lm_head train at "
                   "training.learning_rate (no separate coord-row rates)")
        return
    if rw.view("tuner.freeze_llm") is True:
        _leave_out(rw, src, "freeze_llm freezes the language model, its coord rows included")
        return
    if not rw.put(f"{src}.enabled", _COORD_ROWS, True):
        return
    block.pop("enabled")
    rw.m.changes.append(f"{src}.enabled: true -> {_COORD_ROWS}: true")
    _coord_offset_ids(rw, block.pop("ids", None))
    tie_head = block.pop("tie_head", True)
    embed_lr, head_lr = block.pop("embed_lr", None), block.pop("head_lr", None)
    if tie_head is not False:
        if head_lr is not None and head_lr != embed_lr:
            rw.m.changes.append(f"removed {src}.head_lr: {_short(head_lr)} (upstream ignored it with tie_head: true)")
        head_lr = embed_lr  # one table's rate; an untied head's own table trains at the same rate
        rw.m.changes.append(f"removed {src}.tie_head: true ({_TIES}; an untied head gets its own table, at the "
                            "embeddings' rate)")
    else:
        rw.m.left_out.append(f"{src}.tie_head: {_TIES}, so a tied checkpoint cannot train separate embedding and "
                             "head tables (value was False)")
    for key, value in (("coord_embed_lr", embed_lr), ("coord_head_lr", head_lr)):
        if value is not None and rw.put(f"{src}.{key[6:]}", f"tuner.{key}", value):
            rw.m.changes.append(f"{src}.{key[6:]} -> tuner.{key}")
    decay = block.pop("weight_decay", 0.0)  # upstream's default; coordexp's null would be training.weight_decay
    if rw.put(f"{src}.weight_decay", "tuner.coord_weight_decay", decay):
        rw.m.changes.append(f"{src}.weight_decay -> tuner.coord_weight_decay: {_short(decay)} (it decays the rows "
                            "themselves towards 0; upstream decayed its offsets towards the base rows)")
    if not block:
        _pop(rw.data, src)


def _coord_offset_ids(rw: Any, ids: Any) -> None:
    if ids is None:
        return
    if isinstance(ids, dict) and isinstance(ids.get("start"), int) and isinstance(ids.get("end"), int):
        count = ids["end"] - ids["start"] + 1
    else:
        count = len(ids) if isinstance(ids, list) else None
    if count == 1000:
        rw.m.changes.append(f"removed custom.coord_offset.ids: {_short(ids)} (coordexp finds the 1000 coord tokens by "
                            "their text in the tokenizer)")
    else:
        rw.m.left_out.append(f"custom.coord_offset.ids: coordexp trains the rows of all 1000 coord tokens, found by "
                             f"their text (value was {_short(ids)})")


def _deepspeed(rw: Any) -> None:
    block = _get(rw.data, "deepspeed")
    if not isinstance(block, dict) or not isinstance(block.get("enabled"), bool):
        return  # anything else is left out by upstream_post with the reason
    if not block["enabled"]:
        _pop(rw.data, "deepspeed")
        if rw.view("training.deepspeed") not in (_ABSENT, None):  # a base file (migrated in place) enables it
            rw.put("deepspeed.enabled", "training.deepspeed", None)
            rw.m.changes.append("deepspeed: {enabled: false} -> training.deepspeed: null (overrides the base file)")
        else:
            rw.m.changes.append("removed deepspeed (enabled: false)")
        return
    preset = block.get("config")
    if isinstance(preset, str) and preset and set(block) <= {"enabled", "config"}:
        if rw.put("deepspeed.config", "training.deepspeed", preset):
            _pop(rw.data, "deepspeed")
            rw.m.changes.append(f"deepspeed: {{enabled: true, config: {preset}}} -> training.deepspeed: {preset}")


def upstream_post(rw: Any, *, leaf: bool = True) -> None:
    """Fill the upstream defaults a leaf relied on, then list every key without a coordexp owner as left out."""
    stage1_bbox_geo(rw)
    if leaf:
        if rw.view("custom.trainer_variant") is _ABSENT:
            rw.put("custom.trainer_variant", "custom.trainer_variant", "stage1_sft")
            rw.m.changes.append("custom.trainer_variant: stage1_sft (upstream's default trainer, plain SFT)")
        if rw.view("tuner.train_type") is _ABSENT:
            rw.put("tuner.train_type", "tuner.train_type", "lora")
            rw.m.changes.append("tuner.train_type: lora (ms-swift's default, which upstream ran with)")
    for dotted, why in _LEFT_OUT.items():
        if dotted == "training.optimizer" or dotted == "tuner.use_swift_lora":
            why = f"{why}: set it by hand if another value was intended"
        _leave_out(rw, dotted, why)
    legacy = [hit.path for hit in find_legacy_keys(rw.data)]
    refused = _refused()
    for path in list(_unknown_keys(rw.data, CoordExpConfig, ())):
        if any(h[:len(path)] == path or path[:len(h)] == h for h in legacy):
            continue  # a legacy key: coordexp's own rewrite reported it
        if path[0] == "training" and path[1] in EXPECTED_TRAINING:
            continue
        _leave_out(rw, ".".join(path), _REFUSED if path[0] == "training" and path[1] in refused else _GENERIC)


def _model_of(annotation: Any) -> Optional[type]:
    """The BaseModel inside ``annotation`` (through Optional/Annotated), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _unknown_keys(node: Any, model: type, path: tuple) -> list[tuple]:
    """Dotted paths (tuples) of mapping keys ``model`` does not declare, recursing through nested models."""
    if not isinstance(node, dict):
        return []
    found = []
    fields = model.model_fields
    for key, value in node.items():
        if path == () and key == "extends":
            continue
        if key not in fields or (path == ("training",) and fields[key].exclude):
            found.append((*path, key))
            continue
        child = _model_of(fields[key].annotation)
        if child is not None and not typing.get_origin(fields[key].annotation) is list:
            found += _unknown_keys(value, child, (*path, key))
    return found


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_PRESET = re.compile(r"^[\w.-]+$")  # a DeepSpeed preset name such as zero2 (no folder, no .json)


def resolve_paths(data: dict, base: Path, report: list[str], how: str) -> None:
    """Make every relative path value absolute against ``base`` (``how`` says why in the report)."""
    for key_path, kind in _PATH_FIELDS:
        parent = _get(data, ".".join(key_path[:-1])) if len(key_path) > 1 else data
        value = parent.get(key_path[-1]) if isinstance(parent, dict) else None
        if not isinstance(value, str) or not value or "\x00" in value:
            continue
        dotted = ".".join(key_path)
        expanded = Path(os.path.expanduser(value))
        if key_path[-1] == "deepspeed" and _PRESET.match(value) and not value.endswith(".json"):
            continue  # a preset name, not a file
        if expanded.is_absolute():
            continue
        target = os.path.normpath(base / expanded)
        if kind == "hub-or-path" and not value.startswith((".", "~")) and not os.path.exists(target) \
                and _HUB_ID.match(value):
            report.append(f"{dotted}: {value!r} kept as a hub id ({target} does not exist; upstream fell back to "
                          "the hub too)")
            continue
        parent[key_path[-1]] = target
        exists = "" if os.path.exists(target) else " (does not exist yet)"
        report.append(f"{dotted}: {value!r} resolved against {how} -> {target}{exists}")


def write_paths(data: dict, out_dir: Path, *, climb: bool = False) -> None:
    """Absolute path values become ``./``-relative to ``out_dir`` (coordexp's file-relative rule): those under it,
    or all of them with ``climb`` (``../`` allowed); the others stay absolute."""
    for key_path, _ in _PATH_FIELDS:
        parent = _get(data, ".".join(key_path[:-1])) if len(key_path) > 1 else data
        value = parent.get(key_path[-1]) if isinstance(parent, dict) else None
        if not isinstance(value, str) or not os.path.isabs(value):
            continue
        rel = os.path.relpath(value, out_dir)
        if climb and rel.startswith(".."):
            parent[key_path[-1]] = rel
        elif not rel.startswith(".."):
            parent[key_path[-1]] = "./" + rel if rel != "." else "."
