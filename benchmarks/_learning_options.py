"""bench_learning.py's options that are not argparse's: ``--variant`` and ``--set`` parsing, a dotted override of the
stage-2 config, the reward arm's training decoding, and which options runs must share to be added to or summarized
with each other."""

from __future__ import annotations

import argparse
import copy
from typing import Any

import yaml


def parse_variant(text: str) -> tuple[str, list[tuple[list[str], Any]]]:
    """``NAME=dotted.key:value;...`` -> (NAME, [(key path, value)]); values are YAML scalars, a number in the path
    indexes a list (``rollout_matching.pipeline.objective.0.config.rollout_fn_desc_weight:0``)."""
    name, _, spec = text.partition("=")
    if not name or not spec:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: write NAME=dotted.key:value[;dotted.key:value]")
    overrides = []
    for item in spec.split(";"):
        key, sep, value = item.partition(":")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"--variant {text!r}: {item!r} is not dotted.key:value")
        overrides.append((key.strip().split("."), yaml.safe_load(value)))
    return name, overrides


def parse_setting(text: str) -> tuple[list[str], Any]:
    """``dotted.key:value`` -> (key path, YAML value), for ``--set``."""
    return parse_variant(f"set={text}")[1][0]


def override(config: dict[str, Any], base: dict[str, Any], keys: list[str], value: Any) -> None:
    """Set ``keys`` in ``config``; a list on the way is first copied whole from the merged ``base`` (``extends``
    replaces lists), so one entry of the base's pipeline can change."""
    node: Any = config
    ref: Any = base
    for depth, key in enumerate(keys):
        index: Any = int(key) if isinstance(node, list) else key
        if depth == len(keys) - 1:
            node[index] = value
            return
        if isinstance(ref, list):
            ref = ref[index] if isinstance(index, int) and index < len(ref) else None
        else:
            ref = ref.get(index) if isinstance(ref, dict) else None
        if isinstance(node, dict) and index not in node:
            node[index] = copy.deepcopy(ref) if isinstance(ref, list) else {}
        node = node[index]


# what the reward objective samples with (docs/design.md, decision 19): the policy's own distribution
REWARD_DECODING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "num_beams": 1, "repetition_penalty": 1.0,
                   "coord_group_greedy": False}


REWARD_PACKING_BUFFER = 64
"""A reward arm's carry buffer: the continuation batch (4) x group_size (4) new segments a step, and as many carried
(validation refuses less; the recipe's 16 holds one SFT step)."""


def reward_decoding(overrides: Any) -> list[tuple[list[str], Any]]:
    """An arm that sets ``rollout_matching.objective: reward`` trains with sampling decoding and a carry buffer its
    groups fit (its own overrides win, coming after); evaluation keeps the one evaluation config's decoding."""
    if ["rollout_matching", "objective"] not in [keys for keys, value in overrides if value == "reward"]:
        return []
    return [*((["rollout_matching", "decoding", key], value) for key, value in REWARD_DECODING.items()),
            (["training", "packing_buffer"], REWARD_PACKING_BUFFER)]


# options an added arm must share with the run it joins (what its data, stage-1 checkpoint and evaluation came from)
SAME_FOR_ADDED = ("task", "grid", "object_order", "probe_images", "eval_batch", "n_train", "n_val", "image_size",
                  "min_objects", "max_objects", "shapes", "position_code", "family", "hidden", "layers", "rope_theta",
                  "vision_depth", "vision_width", "vision_init_std", "stage1_steps", "stage1_lr", "stage1_batch", "k",
                  "continue_lr", "continue_batch", "max_new_tokens", "decode_batch", "score", "settings",
                  "train_jsonl", "val_jsonl", "model", "tune_decoding", "tune_jsonl")


def merge_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One run of the seeds of several (summary.json contents): their options must agree (``SAME_FOR_ADDED`` and the
    arms) and their seeds must differ; the wall time is the sum."""
    first = runs[0]
    keys = SAME_FOR_ADDED + ("variant",)
    for other in runs[1:]:
        differ = [k for k in keys if other["args"].get(k) != first["args"].get(k)]
        if differ:
            raise SystemExit("--report: runs made with other options cannot be summarized as one: " + ", ".join(differ))
    seeds = [s for run in runs for s in run["seeds"]]
    numbers = [s["seed"] for s in seeds]
    if len(set(numbers)) != len(numbers):
        raise SystemExit(f"--report: a seed appears twice among {numbers}")
    if len(runs) == 1:
        return first
    merged = {**first, "args": {**first["args"], "seed": min(numbers), "n_seeds": len(numbers)}, "seeds": seeds}
    merged["total_s"] = sum(run.get("total_s", 0.0) for run in runs)
    return merged
