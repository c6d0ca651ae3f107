"""THE table of legacy keys (history specs 000-003 and upstream), each with the key that replaced it.

Checked on the raw mapping before schema validation, so a legacy key fails with its replacement instead of
"unknown key". Patterns are dotted paths; ``*`` matches any one key and ``[*]`` any list index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional, Union

from coordexp.schema.errors import ConfigIssue, format_path, parse_path

__all__ = ["LegacyKey", "LegacyPrefix", "LEGACY_KEYS", "LEGACY_PREFIXES", "LegacyHit", "find_legacy_keys"]

_ANY = object()
PathTuple = tuple[Union[str, int], ...]


@dataclass(frozen=True)
class LegacyKey:
    """A removed or moved key. ``replacement`` None means removed; ``value`` restricts the match to one value."""

    pattern: str
    replacement: Optional[str]
    guidance: str
    value: Any = _ANY
    migrates: bool = True  # ``coordexp migrate`` rewrites it mechanically
    container: bool = False  # a non-empty mapping here is reported per sub-key instead


@dataclass(frozen=True)
class LegacyPrefix:
    """A whole namespace that moved: every sub-key keeps its name under ``new`` (a path-only move)."""

    old: str
    new: str
    guidance: str


_RM = "rollout_matching"
_COORD_REG = f"{_RM}.pipeline.objective[*].config"

LEGACY_PREFIXES: tuple[LegacyPrefix, ...] = (
    LegacyPrefix(
        "custom.extra.rollout_matching",
        _RM,
        "Rollout settings live under top-level rollout_matching.* with the same sub-key names.",
    ),
)

LEGACY_KEYS: tuple[LegacyKey, ...] = (
    # decoding knobs (001: moved under decoding.*; OLD flat beam knobs)
    *(
        LegacyKey(f"{_RM}.{k}", f"{_RM}.decoding.{k}", f"Sampling knobs live under {_RM}.decoding.")
        for k in ("temperature", "top_p", "top_k", "num_beams", "repetition_penalty")
    ),
    LegacyKey(
        f"{_RM}.decode_mode",
        f"{_RM}.decoding.num_beams",
        "greedy is decoding.num_beams: 1; beam is decoding.num_beams: N > 1 (rollout_backend: hf).",
    ),
    LegacyKey(
        f"{_RM}.num_return_sequences",
        None,
        "Remove it: beam search always trains on the single best beam.",
    ),
    # batch-size knobs (one decode_batch_size: docs/design.md, decode microbatching)
    *(
        LegacyKey(f"{_RM}.{k}", f"{_RM}.decode_batch_size", "One knob controls decode microbatching.")
        for k in ("rollout_generate_batch_size", "rollout_infer_batch_size", "channel_b_decode_batch_size")
    ),
    LegacyKey(
        f"{_RM}.eval_decode_batch_size",
        None,
        f"Remove it: {_RM}.decode_batch_size also governs evaluation decoding.",
    ),
    LegacyKey(
        f"{_RM}.rollout_buffer",
        None,
        "Remove the rollout_buffer section: the E/M-step rollout buffer was removed (no backward compatibility).",
    ),
    LegacyKey(
        f"{_RM}.post_rollout_pack_scope",
        None,
        "Remove it: post-rollout packing always uses micro-scope dynamic packing (window scope is unsupported).",
    ),
    LegacyKey(
        f"{_RM}.coord_decode_mode",
        None,
        "Remove it: decoded-coordinate modes are unsupported; coord losses act on the coord-token distribution.",
    ),
    # server paired lists (000/001) -> servers[]
    *(
        LegacyKey(
            f"{_RM}.vllm.server.{k}",
            f"{_RM}.vllm.server.servers[]",
            "Use rollout_matching.vllm.server.servers: [{base_url, group_port}, ...].",
        )
        for k in ("base_url", "group_port")
    ),
    # flat matching / OT knobs (upstream OLD) -> grouped
    *(
        LegacyKey(f"{_RM}.{k}", f"{_RM}.matching.{k}", "Matching knobs are grouped under rollout_matching.matching.")
        for k in ("candidate_top_k", "maskiou_gate", "maskiou_resolution", "fp_cost", "fn_cost")
    ),
    *(
        LegacyKey(f"{_RM}.ot_{k}", f"{_RM}.ot.{k}", "OT knobs are grouped under rollout_matching.ot.")
        for k in ("cost", "epsilon", "iters")
    ),
    # OLD per-run coord-loss overrides -> coord_reg module config
    *(
        LegacyKey(
            f"{_RM}.{old}",
            f"{_COORD_REG}.{new}",
            "Coord-loss weights are authored in the config of the coord_reg entry of rollout_matching.pipeline."
            "objective.",
        )
        for old, new in (
            ("target_sigma", "target_sigma"),
            ("target_truncate", "target_truncate"),
            ("temperature_coord", "temperature"),
            ("soft_ce_weight", "soft_ce_weight"),
            ("w1_weight", "w1_weight"),
            ("gate_weight", "coord_gate_weight"),
        )
    ),
    *(
        LegacyKey(
            f"custom.coord_soft_ce_w1.{old}",
            None if new is None else f"{_COORD_REG}.{new}",
            "custom.coord_soft_ce_w1 is disallowed: author coord-loss weights in the config of the coord_reg "
            "entry of rollout_matching.pipeline.objective.",
        )
        for old, new in (
            ("enabled", None),
            ("ce_weight", "coord_ce_weight"),
            ("soft_ce_weight", "soft_ce_weight"),
            ("w1_weight", "w1_weight"),
            ("gate_weight", "coord_gate_weight"),
            ("temperature", "temperature"),
            ("target_sigma", "target_sigma"),
            ("target_truncate", "target_truncate"),
        )
    ),
    LegacyKey(
        "custom.coord_soft_ce_w1.*",
        None,
        "custom.coord_soft_ce_w1 is disallowed and this key has no replacement; remove it.",
        migrates=False,
    ),
    LegacyKey(
        "custom.coord_soft_ce_w1",
        _COORD_REG,
        "custom.coord_soft_ce_w1 is disallowed: author coord-loss weights in the config of the coord_reg entry "
        "of rollout_matching.pipeline.objective.",
        container=True,
    ),
    # pipeline config aliases (rejected: docs/design.md, decision 5)
    *(
        LegacyKey(
            f"{_RM}.pipeline.objective[*].config.{old}",
            f"{_RM}.pipeline.objective[{{0}}].config.{new}",
            f"Alias keys are rejected; rename {old} to {new}.",
        )
        for old, new in (
            ("bbox_smoothl1_weight", "smoothl1_weight"),
            ("coord_soft_ce_weight", "soft_ce_weight"),
            ("coord_w1_weight", "w1_weight"),
        )
    ),
    LegacyKey(
        "custom.trainer_variant",
        "custom.trainer_variant: stage2_rollout_aligned",
        "rollout_matching_sft was renamed; use custom.trainer_variant: stage2_rollout_aligned.",
        value="rollout_matching_sft",
    ),
    LegacyKey(
        "model.freeze_vision_tower",
        "tuner.freeze_vit",
        "The freeze switches live under tuner.*: tuner.freeze_vit (vision tower) and tuner.freeze_aligner (merger "
        "and DeepStack mergers; model.freeze_vision_tower froze both).",
    ),
    LegacyKey(
        "training.packing_length",
        "global_max_length",
        "packing_length is derived from global_max_length (or template.max_length); remove training.packing_length "
        "and set global_max_length instead.",
    ),
    # upstream (ms-swift era) spellings: coordexp/schema/migrate_upstream.py moves them
    *(
        LegacyKey(old, new, f"Upstream's {old} is {new} in coordexp.")
        for old, new in (
            ("model.model", "model.path"),
            ("model.torch_dtype", "model.dtype"),
            ("model.attn_impl", "model.attn_implementation"),
            ("custom.train_jsonl", "data.train_jsonl"),
            ("custom.val_jsonl", "data.val_jsonl"),
            ("custom.train_sample_limit", "data.max_train_samples"),
            ("custom.val_sample_limit", "data.max_val_samples"),
        )
    ),
    LegacyKey("custom.object_ordering", "data.object_order",
              "Upstream's custom.object_ordering (sorted or random) is data.object_order (keep, sorted or random)."),
    LegacyKey("custom.token_type_metrics", "training.token_type_metrics",
              "Upstream's custom.token_type_metrics: {enabled: true} is training.token_type_metrics: true."),
    LegacyKey("inherit", "extends", "Upstream's alias of extends; `coordexp migrate` follows it.", migrates=False),
    LegacyKey("template.template", None, "Remove it: the model family comes from the checkpoint's config.json."),
    LegacyKey("deepspeed", "training.deepspeed", "DeepSpeed is training.deepspeed: zero2 (a preset or a JSON path)."),
    *(
        LegacyKey(f"training.{k}", None, why)
        for k, why in (
            ("packing_allow_single_long", "Remove it: a segment longer than packing_length always fails fast."),
            ("eval_packing", "Remove it: packing applies to the post-rollout training forward only."),
            ("packing_avg_samples", "Remove it: packing is dynamic on the actual Y_train lengths."),
        )
    ),
)


def _match(tokens: PathTuple, path: PathTuple) -> Optional[list[str]]:
    """Wildcard captures when ``path`` matches ``tokens`` exactly, else None."""
    if len(tokens) != len(path):
        return None
    captures: list[str] = []
    for token, part in zip(tokens, path):
        if token == "[*]":
            if not isinstance(part, int):
                return None
            captures.append(str(part))
        elif token == "*":
            if not isinstance(part, str):
                return None
            captures.append(part)
        elif token != part:
            return None
    return captures


_COMPILED = tuple((parse_path(k.pattern), k) for k in LEGACY_KEYS)


def _shape(tokens: PathTuple) -> tuple:
    """Index key of a pattern or path: its length and first two parts (a wildcard part indexes as None)."""
    head = tuple(None if t in ("*", "[*]") else t for t in tokens[:2])
    return (len(tokens), *head)


_BY_SHAPE: dict[tuple, list] = {}
for _tokens, _entry in _COMPILED:  # table order kept inside each bucket: the first matching entry wins
    _BY_SHAPE.setdefault(_shape(_tokens), []).append((_tokens, _entry))
_WILDCARD_HEADS = any(None in _shape(tokens)[1:] for tokens, _ in _COMPILED)
_PRUNABLE = frozenset(
    [".".join(p.old.split(".")[:n]) for p in LEGACY_PREFIXES for n in range(2, p.old.count(".") + 2)]
    + [k.pattern for k in LEGACY_KEYS if k.container]
)


@dataclass(frozen=True)
class LegacyHit:
    """A legacy key found at ``path`` in a raw mapping; ``strip`` means it is removed before validation."""

    path: PathTuple
    entry: Union[LegacyKey, LegacyPrefix]
    replacement: Optional[str]

    @property
    def dotted(self) -> str:
        return format_path(self.path)

    def issue(self, file: Optional[str] = None) -> ConfigIssue:
        guidance = self.entry.guidance
        if isinstance(self.entry, LegacyPrefix) or self.entry.migrates:
            guidance += " `coordexp migrate` rewrites this automatically."
        message = "legacy key, removed" if self.replacement is None else f"legacy key, replaced by {self.replacement}"
        return ConfigIssue(self.dotted, message, guidance, file)


def _candidates(path: PathTuple) -> Any:
    """The table entries that can match ``path`` (all of them if a pattern starts with a wildcard), so a mapping
    of many keys is classified in linear time instead of against the whole table per key."""
    if _WILDCARD_HEADS:
        return _COMPILED
    shape = (len(path), *(p if isinstance(p, str) else None for p in path[:2]))
    return _BY_SHAPE.get(shape, ())


def _match_table(path: PathTuple, value: Any) -> Optional[tuple[LegacyKey, Optional[str]]]:
    for tokens, entry in _candidates(path):
        captures = _match(tokens, path)
        if captures is None or (entry.value is not _ANY and value != entry.value):
            continue
        if entry.container and isinstance(value, dict) and value:
            continue
        replacement = entry.replacement.format(*captures) if entry.replacement else None
        return entry, replacement
    return None


def _walk(node: Any, path: PathTuple) -> Iterator[tuple[PathTuple, Any, Any]]:
    """Yield ``(path, value, container)`` for every mapping key and list item below ``node``."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield (*path, key), value, node
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield (*path, i), value, node


def find_legacy_keys(raw: Any) -> list[LegacyHit]:
    """Every legacy key in a raw (merged) mapping, outermost first, in document order."""
    hits: list[LegacyHit] = []
    prefixes = [(tuple(p.old.split(".")), tuple(p.new.split(".")), p) for p in LEGACY_PREFIXES]

    def visit(node: Any, path: PathTuple) -> None:
        for child_path, value, _ in _walk(node, path):
            hit = _classify(child_path, value)
            if hit is not None:
                hits.append(hit)
            if hit is None or isinstance(hit.entry, LegacyPrefix):
                visit(value, child_path)

    def _classify(path: PathTuple, value: Any) -> Optional[LegacyHit]:
        for old, new, prefix in prefixes:
            if path[: len(old)] != old:
                continue
            if len(path) == len(old):
                return LegacyHit(path, prefix, prefix.new) if not isinstance(value, dict) or not value else None
            relocated = (*new, *path[len(old) :])
            inner = _match_table(relocated, value)
            if inner is not None:
                return LegacyHit(path, inner[0], inner[1])
            if len(path) == len(old) + 1:
                return LegacyHit(path, prefix, format_path(relocated))
            return None
        found = _match_table(path, value)
        return LegacyHit(path, found[0], found[1]) if found else None

    visit(raw, ())
    return hits


def strip_legacy_keys(raw: Any, hits: list[LegacyHit]) -> Any:
    """A copy of ``raw`` without the legacy keys (containers they leave empty are removed too)."""
    import copy

    stripped = copy.deepcopy(raw)
    for hit in sorted(hits, key=lambda h: len(h.path), reverse=True):
        _delete(stripped, hit.path)
    return stripped


def _delete(root: Any, path: PathTuple) -> None:
    trail = [root]
    for part in path[:-1]:
        node = trail[-1]
        try:
            trail.append(node[part])
        except (KeyError, IndexError, TypeError):
            return
    parent = trail[-1]
    if isinstance(parent, dict) and path[-1] in parent:
        del parent[path[-1]]
    # drop legacy namespaces emptied by the removal (custom.extra, custom.coord_soft_ce_w1), bottom-up
    for depth in range(len(path) - 1, 0, -1):
        node, container = trail[depth], trail[depth - 1]
        if format_path(path[:depth]) not in _PRUNABLE:
            break
        if isinstance(node, dict) and not node and isinstance(container, dict):
            del container[path[depth - 1]]
        else:
            break
