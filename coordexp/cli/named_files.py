"""The files a config names that ``validate`` notes when absent: ``validate`` checks the file, not the machine (CI
validates without the data), so a missing file is a warning there; ``coordexp preflight`` checks them for real."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["missing_named_files"]


def missing_named_files(config: Any) -> list[tuple[str, str]]:
    """``(dotted key, path)`` of each named local file or directory that does not exist. Paths are the validated,
    absolute ones; a hub model id (not a path) and a DeepSpeed preset name (zero2, zero3) are not files."""
    named: list[tuple[str, Any, bool]] = [
        ("data.train_jsonl", config.data.train_jsonl, False),
        ("data.val_jsonl", config.data.val_jsonl, False),
        ("data.image_root", config.data.image_root, True),
        ("model.path", config.model.path, True),
        ("training.deepspeed", config.training.deepspeed, False),
    ]
    missing = []
    for key, value, is_dir in named:
        if not isinstance(value, str) or not os.path.isabs(value):
            continue  # unset, a hub id, or a preset name
        exists = os.path.isdir(value) if is_dir else os.path.isfile(value)
        if not exists:
            missing.append((key, value))
    return missing
