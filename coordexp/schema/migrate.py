"""Mechanical rewrite of legacy keys into canonical YAML (``coordexp migrate``).

Works on one file's own mapping (its ``extends`` stay as they are). A key that cannot be moved without a
decision (a conflicting value, a beam width that is not given) stays in place and is reported with the reason,
so the migrated file still fails validation at exactly that key. Migrating a migrated file changes nothing.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

from coordexp.schema.dotted import ABSENT as _ABSENT, get as _get, pop as _pop, split as _split
from coordexp.schema.errors import ConfigError, ConfigIssue, format_path
from coordexp.schema.legacy import find_legacy_keys
from coordexp.schema.loader import deep_merge, load_merged
from coordexp.schema.migrate_upstream import upstream_pre
from coordexp.schema.root import CoordExpConfig
from coordexp.schema.yaml_io import dump_yaml, parse_yaml_text

__all__ = ["Migration", "migrate_mapping", "migrate_text", "OLD_COORD_DEFAULTS"]

HEADER = "# Canonical config written by `coordexp migrate` (comments of the original file are not kept).\n"
_RM = "rollout_matching"

# What the old rollout trainer used when custom.coord_soft_ce_w1 / overrides were absent (upstream F.2, D.2).
OLD_COORD_DEFAULTS = {
    "coord_ce_weight": 0.0,
    "soft_ce_weight": 1.0,
    "w1_weight": 1.0,
    "coord_gate_weight": 1.0,
    "text_gate_weight": 0.0,
    "temperature": 1.0,
    "target_sigma": 2.0,
    "target_truncate": None,
}
_COORD_SOFT_CE_W1 = {
    "ce_weight": "coord_ce_weight",
    "soft_ce_weight": "soft_ce_weight",
    "w1_weight": "w1_weight",
    "gate_weight": "coord_gate_weight",
    "text_gate_weight": "text_gate_weight",
    "temperature": "temperature",
    "target_sigma": "target_sigma",
    "target_truncate": "target_truncate",
}
_RM_COORD_OVERRIDES = {
    "target_sigma": "target_sigma",
    "target_truncate": "target_truncate",
    "temperature_coord": "temperature",
    "soft_ce_weight": "soft_ce_weight",
    "w1_weight": "w1_weight",
    "gate_weight": "coord_gate_weight",
}
_ALIASES = {
    "bbox_smoothl1_weight": "smoothl1_weight",
    "coord_soft_ce_weight": "soft_ce_weight",
    "coord_w1_weight": "w1_weight",
}
_REMOVED = {
    f"{_RM}.num_return_sequences": "beam search always trains on the single best beam",
    f"{_RM}.eval_decode_batch_size": f"{_RM}.decode_batch_size also governs evaluation decoding",
    f"{_RM}.rollout_buffer": "the E/M-step rollout buffer was removed; rollouts are fresh every step",
    f"{_RM}.post_rollout_pack_scope": "packing always uses micro-scope dynamic packing",
    f"{_RM}.coord_decode_mode": "decoded-coordinate modes are unsupported",
    "training.packing_allow_single_long": "an oversized segment always fails fast",
    "training.eval_packing": "packing applies to the post-rollout training forward only",
    "training.packing_avg_samples": "packing is dynamic on the actual Y_train lengths",
    "custom.coord_soft_ce_w1.enabled": "the coord_reg module's own `enabled` now decides",
}


# upstream's top-level blocks that migrate moves or leaves out, besides coordexp's own sections
_UPSTREAM_TOP_LEVEL = {"extends", "inherit", "deepspeed", "stage2_ab", "rlhf", "debug"}


@dataclass
class Migration:
    """The rewritten mapping, what was done, and what was left in place (with why)."""

    data: dict
    changes: list[str] = field(default_factory=list)
    unresolved: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)  # upstream features coordexp lacks: removed, with why

    @property
    def changed(self) -> bool:
        return bool(self.changes or self.left_out)


class _Rewriter:
    def __init__(self, data: dict, base_view: dict, raw_base_view: dict):
        self.data = data
        self.base_view = base_view
        self.raw_base_view = raw_base_view
        self.m = Migration(data)

    def view(self, dotted: str) -> Any:
        own = _get(self.data, dotted)
        return own if own is not _ABSENT else _get(self.base_view, dotted)

    def view_as_written(self, dotted: str) -> Any:
        """``dotted`` in this file, else in its bases as written (before their migration)."""
        own = _get(self.data, dotted)
        return own if own is not _ABSENT else _get(self.raw_base_view, dotted)

    def put(self, source: str, target: str, value: Any) -> bool:
        """Set ``target`` (dotted) to ``value``; a different existing value is a conflict (nothing moves)."""
        node = self.data
        parts = _split(target)
        for part in parts[:-1]:
            child = node.get(part, _ABSENT)
            if child is _ABSENT or child is None:  # an empty (null) section takes the moved key
                child = node[part] = {}
            if not isinstance(child, dict):
                self.m.unresolved.append(f"{source}: cannot move to {target}: {part} is not a mapping")
                return False
            node = child
        existing = node.get(parts[-1], _ABSENT)
        if isinstance(existing, dict) and isinstance(value, dict):
            return all([self.put(f"{source}.{k}", f"{target}.{k}", v) for k, v in value.items()])
        if existing is not _ABSENT and existing != value:
            self.m.unresolved.append(
                f"{source}: not moved, {target} is already set to {existing!r} (legacy value {value!r}); "
                "keep one value by hand"
            )
            return False
        node[parts[-1]] = copy.deepcopy(value)
        return True

    def move(self, source: str, target: str) -> None:
        value = _get(self.data, source)
        if value is _ABSENT:
            return
        if self.put(source, target, value):
            _pop(self.data, source)
            self.m.changes.append(f"{source} -> {target}")

    def remove(self, source: str, why: str) -> None:
        if _pop(self.data, source) is not _ABSENT:
            self.m.changes.append(f"removed {source} ({why})")


def _relocate_namespace(rw: _Rewriter) -> None:
    old = _get(rw.data, "custom.extra.rollout_matching")
    if old is _ABSENT:
        return
    if not isinstance(old, dict):
        if old is None:
            _pop(rw.data, "custom.extra.rollout_matching")
            rw.m.changes.append("removed empty custom.extra.rollout_matching")
        else:
            rw.m.unresolved.append("custom.extra.rollout_matching: not a mapping; move its content by hand")
        return
    for key in list(old):
        rw.move(f"custom.extra.rollout_matching.{key}", f"{_RM}.{key}")


def _decoding_and_batching(rw: _Rewriter) -> None:
    for key in ("temperature", "top_p", "top_k", "num_beams", "repetition_penalty"):
        rw.move(f"{_RM}.{key}", f"{_RM}.decoding.{key}")
    mode = _get(rw.data, f"{_RM}.decode_mode")
    if mode is not _ABSENT:
        beams = rw.view(f"{_RM}.decoding.num_beams")
        if mode == "greedy" and (beams is _ABSENT or beams == 1):
            _pop(rw.data, f"{_RM}.decode_mode")
            if beams is _ABSENT:
                rw.put(f"{_RM}.decode_mode", f"{_RM}.decoding.num_beams", 1)
            rw.m.changes.append(f"{_RM}.decode_mode: greedy -> {_RM}.decoding.num_beams: 1")
        elif mode == "beam" and isinstance(beams, int) and beams > 1:
            _pop(rw.data, f"{_RM}.decode_mode")
            rw.m.changes.append(f"removed {_RM}.decode_mode: beam (decoding.num_beams: {beams} selects beam search)")
        else:
            rw.m.unresolved.append(
                f"{_RM}.decode_mode: {mode!r} with decoding.num_beams {beams if beams is not _ABSENT else 'unset'}: "
                "set decoding.num_beams yourself (1 = greedy, N > 1 = beam search) and delete decode_mode"
            )
    for key in ("channel_b_decode_batch_size", "rollout_generate_batch_size", "rollout_infer_batch_size"):
        rw.move(f"{_RM}.{key}", f"{_RM}.decode_batch_size")


def _servers(rw: _Rewriter) -> None:
    server = _get(rw.data, f"{_RM}.vllm.server")
    if not isinstance(server, dict) or ("base_url" not in server and "group_port" not in server):
        return
    urls, ports = server.get("base_url"), server.get("group_port")
    where = f"{_RM}.vllm.server.base_url, {_RM}.vllm.server.group_port"
    entries: Optional[list] = None
    if isinstance(urls, str) and isinstance(ports, int):
        entries = [{"base_url": urls, "group_port": ports}]
    elif isinstance(urls, list) and isinstance(ports, int):
        entries = [{"base_url": u, "group_port": ports + i} for i, u in enumerate(urls)]  # the 000 rule
    elif isinstance(urls, list) and isinstance(ports, list) and len(urls) == len(ports):
        entries = [{"base_url": u, "group_port": p} for u, p in zip(urls, ports)]
    if entries is None:
        rw.m.unresolved.append(
            f"{where}: cannot pair base_url {urls!r} with group_port {ports!r} (lists must have equal length; a "
            "single URL needs a single port); write servers: [{base_url, group_port}] by hand"
        )
        return
    if "servers" in server and server["servers"] != entries:
        rw.m.unresolved.append(f"{where}: servers[] is already set; delete the paired-list keys by hand")
        return
    server.pop("base_url", None)
    server.pop("group_port", None)
    server["servers"] = entries
    rw.m.changes.append(
        f"{_RM}.vllm.server.base_url/group_port -> {_RM}.vllm.server.servers[] ({len(entries)} server(s))"
    )


def _grouped_knobs(rw: _Rewriter) -> None:
    for key in ("candidate_top_k", "maskiou_gate", "maskiou_resolution", "fp_cost", "fn_cost"):
        rw.move(f"{_RM}.{key}", f"{_RM}.matching.{key}")
    for key in ("cost", "epsilon", "iters"):
        rw.move(f"{_RM}.ot_{key}", f"{_RM}.ot.{key}")


def _baseline_pipeline(coord: dict) -> dict:
    return {
        "objective": [
            {
                "name": "token_ce",
                "enabled": True,
                "weight": 1.0,
                "channels": ["B"],
                "config": {"rollout_fn_desc_weight": 0.0, "rollout_matched_prefix_struct_weight": 0.0},
            },
            {"name": "coord_reg", "enabled": True, "weight": 1.0, "channels": ["B"], "config": coord},
        ]
    }


def _coord_sources(rw: _Rewriter) -> list[tuple[str, str, Any]]:
    """(legacy path, coord_reg key, value) in precedence order: later entries win (overrides last)."""
    found = []
    section = _get(rw.data, "custom.coord_soft_ce_w1")
    if isinstance(section, dict):
        found += [
            (f"custom.coord_soft_ce_w1.{old}", new, section[old]) for old, new in _COORD_SOFT_CE_W1.items() if old in section
        ]
    for old, new in _RM_COORD_OVERRIDES.items():  # per-run overrides won over coord_soft_ce_w1 upstream
        value = _get(rw.data, f"{_RM}.{old}")
        if value is not _ABSENT:
            found.append((f"{_RM}.{old}", new, value))
    return found


def _coord_losses(rw: _Rewriter, old_variant: bool) -> None:
    found = _coord_sources(rw)
    values = {key: value for _, key, value in found}
    section = _get(rw.data, "custom.coord_soft_ce_w1")
    has_pipeline = rw.view(f"{_RM}.pipeline") is not _ABSENT
    if not found and not (old_variant and not has_pipeline):
        return
    objective = _get(rw.data, f"{_RM}.pipeline.objective")
    sources = [s for s, _, _ in found]
    if isinstance(objective, list):
        names = [m.get("name") if isinstance(m, dict) else None for m in objective]
        index = names.index("coord_reg") if "coord_reg" in names else None
        if index is None:
            rw.m.unresolved.append(
                f"{', '.join(sources)}: the pipeline has no coord_reg entry; add one and move these weights into it"
            )
            return
        config = objective[index].setdefault("config", {})
        ok_keys = {k for k, v in values.items() if _set_unique(rw, config, k, v, index, found)}
        moved = [s for s, k, _ in found if k in ok_keys]
        target = f"{_RM}.pipeline.objective[{index}].config"
    elif has_pipeline:
        rw.m.unresolved.append(
            f"{', '.join(sources)}: rollout_matching.pipeline comes from an extended base file; move these weights "
            "into its coord_reg config by hand"
        )
        return
    else:
        enabled = not (isinstance(section, dict) and section.get("enabled") is False)
        pipeline = _baseline_pipeline({**OLD_COORD_DEFAULTS, **values})
        pipeline["objective"][1]["enabled"] = enabled
        if not isinstance(rw.data.get(_RM), dict):
            rw.data[_RM] = {}  # absent or null (the shape check refused anything else)
        rw.data[_RM]["pipeline"] = pipeline
        moved = sources
        target = f"{_RM}.pipeline (new: token_ce baseline + coord_reg with the old trainer's defaults)"
    for source in moved:
        _pop(rw.data, source)
    if isinstance(section, dict):
        _pop(rw.data, "custom.coord_soft_ce_w1.enabled")
        if not _get(rw.data, "custom.coord_soft_ce_w1", {}):
            _pop(rw.data, "custom.coord_soft_ce_w1")
    if moved or not found:
        rw.m.changes.append(f"{', '.join(moved) or 'implicit loss of the old trainer'} -> {target}")


def _set_unique(rw: _Rewriter, config: dict, key: str, value: Any, index: int, found: list) -> bool:
    if key in config and config[key] != value:
        sources = ", ".join(s for s, k, _ in found if k == key)
        rw.m.unresolved.append(
            f"{sources}: not moved, {_RM}.pipeline.objective[{index}].config.{key} is already {config[key]!r} "
            f"(legacy value {value!r}); keep one value by hand"
        )
        return False
    config[key] = value
    return True


def _aliases(rw: _Rewriter) -> None:
    for section in ("objective", "diagnostics"):
        modules = _get(rw.data, f"{_RM}.pipeline.{section}")
        if not isinstance(modules, list):
            continue
        for i, module in enumerate(modules):
            config = module.get("config") if isinstance(module, dict) else None
            if not isinstance(config, dict):
                continue
            for old, new in _ALIASES.items():
                if old not in config:
                    continue
                where = f"{_RM}.pipeline.{section}[{i}].config"
                if new in config and config[new] != config[old]:
                    rw.m.unresolved.append(f"{where}.{old}: not renamed, {new} is already {config[new]!r}")
                    continue
                config[new] = config.pop(old)
                rw.m.changes.append(f"{where}.{old} -> {where}.{new}")


def _training(rw: _Rewriter) -> None:
    frozen = _get(rw.data, "model.freeze_vision_tower")
    if frozen is not _ABSENT and rw.put("model.freeze_vision_tower", "tuner.freeze_aligner", frozen):
        rw.move("model.freeze_vision_tower", "tuner.freeze_vit")  # it froze the merger too
    length = _get(rw.data, "training.packing_length")
    if length is not _ABSENT:
        current = rw.view("global_max_length")
        _pop(rw.data, "training.packing_length")
        if current is _ABSENT:
            rw.data["global_max_length"] = length
            rw.m.changes.append("training.packing_length -> global_max_length")
        elif current == length:
            rw.m.changes.append("removed training.packing_length (equal to global_max_length)")
        else:
            rw.m.changes.append(
                f"removed training.packing_length ({length}); packing now uses global_max_length ({current}). "
                f"Set global_max_length: {length} if that was intended"
            )


# Sections the rewrites read into or write under: each must be a mapping where present (``None`` means empty).
_MAPPING_SECTIONS = ("custom", "custom.extra", "custom.coord_soft_ce_w1", "training")
_RM_SECTIONS = ("", "decoding", "vllm", "vllm.server", "matching", "ot", "pipeline")


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _shape_issues(raw: dict) -> list[ConfigIssue]:
    """Where ``raw`` holds a scalar or list in place of a section migrate edits: one issue per dotted path."""
    hint = "migrate edits keys inside this section; write it as `key: value` lines (or remove it)"
    issues = []
    rm_roots = (_RM, "custom.extra.rollout_matching")
    sections = [*_MAPPING_SECTIONS, *(f"{root}.{s}".rstrip(".") for root in rm_roots for s in _RM_SECTIONS)]
    for dotted in sections:
        value = _get(raw, dotted)
        if value is not _ABSENT and value is not None and not isinstance(value, dict):
            issues.append(ConfigIssue(dotted, f"expected a mapping of keys (got a {_kind(value)})", hint))
    for root in rm_roots:
        for part in ("objective", "diagnostics"):
            modules = _get(raw, f"{root}.pipeline.{part}")
            where = f"{root}.pipeline.{part}"
            if modules is _ABSENT or modules is None:
                continue
            if not isinstance(modules, list):
                issues.append(ConfigIssue(where, f"expected a list of modules (got a {_kind(modules)})",
                                          "Write one `- name: ...` entry per loss module."))
                continue
            for i, module in enumerate(modules):
                config = module.get("config") if isinstance(module, dict) else None
                if not isinstance(module, dict):
                    issues.append(ConfigIssue(format_path((*where.split("."), i)),
                                              f"expected a module mapping (got a {_kind(module)})",
                                              "Each entry has name, enabled, weight, channels, config."))
                elif config is not None and not isinstance(config, dict):
                    issues.append(ConfigIssue(format_path((*where.split("."), i, "config")),
                                              f"expected a mapping of keys (got a {_kind(config)})", hint))
    return issues


def migrate_mapping(raw: dict, base_view: Optional[dict] = None, *,
                    post: Optional[Callable[[Any], None]] = None, raw_base_view: Optional[dict] = None) -> Migration:
    """Rewrite every mechanical legacy move of ``raw`` (a copy is returned; ``raw`` is not modified).

    ``base_view`` is the merged mapping of the file's ``extends`` bases, consulted (never edited) to decide
    whether a pipeline already exists; ``raw_base_view`` the same bases as written, for an upstream key that the
    bases' own migration left out but this file completes (``artifact_subdir`` joins a base's ``output_root``).
    A section of the wrong shape raises :class:`ConfigError` naming its path. Upstream spellings
    (migrate_upstream.py) are rewritten first; ``post`` runs on the rewriter at the end.
    """
    if not isinstance(raw, dict):
        raise ConfigError([ConfigIssue("", f"top level must be a mapping of sections (got a {_kind(raw)})",
                                       "Pass a coordexp YAML config.")])
    issues = _shape_issues(raw)
    if issues:
        raise ConfigError(issues)
    rw = _Rewriter(copy.deepcopy(raw), base_view or {}, raw_base_view or {})
    upstream_pre(rw)
    old_variant = _get(rw.data, "custom.trainer_variant") == "rollout_matching_sft"
    if old_variant:
        rw.data["custom"]["trainer_variant"] = "stage2_rollout_aligned"
        rw.m.changes.append("custom.trainer_variant: rollout_matching_sft -> stage2_rollout_aligned")
    _relocate_namespace(rw)
    _decoding_and_batching(rw)
    _servers(rw)
    _grouped_knobs(rw)
    _coord_losses(rw, old_variant)
    _aliases(rw)
    _training(rw)
    for dotted, why in _REMOVED.items():
        rw.remove(dotted, why)
    custom = rw.data.get("custom")
    if isinstance(custom, dict):
        for key in ("extra", "coord_soft_ce_w1"):
            if key in custom and custom[key] in ({}, None):
                del custom[key]
                rw.m.changes.append(f"removed empty custom.{key}")
    if post is not None:
        post(rw)
    reported = " ".join(rw.m.unresolved)
    for hit in find_legacy_keys(rw.data):
        if hit.dotted not in reported:
            rw.m.unresolved.append(f"{hit.dotted}: no mechanical rewrite; {hit.entry.guidance}")
    return rw.m


def require_training_config(path: Union[str, Path], mapping: dict) -> None:
    """A file none of whose top-level keys a training config of coordexp or of upstream's trainer has (upstream's
    inference, evaluation and analysis configs) is refused whole, not answered with one unknown key per line."""
    known = set(CoordExpConfig.model_fields) | _UPSTREAM_TOP_LEVEL
    if not mapping or set(mapping) & known:
        return
    keys = ", ".join(sorted(map(str, mapping))[:8]) + (", ..." if len(mapping) > 8 else "")
    raise ConfigError([ConfigIssue("", f"{path} is not a training config: none of its top-level keys ({keys}) is one "
                                   "that a training config has",
                                   "coordexp migrate rewrites training configs (stage 1 and stage 2). Evaluate a "
                                   "model with `coordexp eval`, serve one with `coordexp serve-rollout` "
                                   "(docs/commands.md).")])


def migrate_text(
    text: str, source: Union[str, Path], output: Optional[Union[str, Path]] = None
) -> tuple[str, Migration]:
    """Migrate YAML ``text`` read from ``source``; returns the new text (unchanged text if nothing moved).

    ``extends`` paths are rewritten relative to ``output`` when it lives in another directory.
    """
    raw = parse_yaml_text(text)
    if not isinstance(raw, dict):
        raise ConfigError([ConfigIssue("", f"top level must be a mapping of sections (got a {_kind(raw)})",
                                       "Pass a coordexp YAML config.")])
    source = Path(source).absolute()
    require_training_config(source, raw)
    bases = raw.get("extends")
    base_list = [bases] if isinstance(bases, str) else bases if isinstance(bases, list) else []
    if bases is not None and not all(isinstance(b, str) and b and "\x00" not in b for b in base_list or [None]):
        raise ConfigError([ConfigIssue("extends", "extends must be a path or a list of paths (non-empty, no NUL)",
                                       "e.g. extends: base.yaml")])
    base_view: dict = {}
    for base in base_list:
        try:
            base_view = deep_merge(base_view, load_merged(source.parent / os.path.expanduser(str(base))).data)
        except Exception:  # noqa: BLE001 - a broken base is reported by `validate`, not here
            continue
    migration = migrate_mapping(raw, base_view)
    if output is not None and base_list:
        out_dir = Path(output).absolute().parent
        if out_dir != source.parent:
            moved = [os.path.relpath((source.parent / b).resolve(), out_dir) for b in base_list]
            migration.data["extends"] = moved[0] if isinstance(bases, str) else moved
            migration.changes.append("extends paths rewritten relative to the output file")
    if not migration.changed:
        return text, migration
    return HEADER + dump_yaml(migration.data), migration
