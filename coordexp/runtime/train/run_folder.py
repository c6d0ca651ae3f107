"""What a run folder (``training.output_dir``) holds, and what ``train`` may do to it (issues 43 and 45).

A folder is a coordexp run when it holds a run record (``coordexp_config.yaml`` headed by :data:`RECORD_MARK`);
a non-empty folder without one is somebody else's (a model download, a repository, a home folder) and a run there
would overwrite files it did not write (``config.json``, ``README.md``, ``tokenizer.json`` ...). ``--overwrite``
never deletes: the entries a run writes (:func:`run_entries`) are moved, as they are (symlinks not followed), into
``OUTPUT_DIR/.previous/<UTC time>``; every other entry stays where it is. Standard library only.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Iterable, Optional

__all__ = ["RUN_RECORD_NAME", "RECORD_MARK", "PREVIOUS_DIR", "is_run_record", "run_entries", "foreign_entries",
           "used_output_problem", "input_overlap", "move_previous_run", "CHECKPOINT_NAME"]

RUN_RECORD_NAME = "coordexp_config.yaml"
RECORD_MARK = "# coordexp run record"
"""First line of every record ``train`` writes; a file without it is a user's config, never replaced."""
_OLD_RECORD_MARK = "# resolved by `coordexp train`"  # records written before this mark existed
PREVIOUS_DIR = ".previous"
CHECKPOINT_NAME = re.compile(r"^checkpoint-[0-9]+$")
"""HF's checkpoint folders: ``checkpoint-<digits>`` only (a user's ``checkpoint-tools`` is not one)."""

_RUN_FILES = frozenset({
    RUN_RECORD_NAME, "run_metadata.jsonl", "rollouts.jsonl", "trainer_state.json", "training_args.bin",
    "config.json", "generation_config.json", "README.md", "adapter_config.json", "adapter_model.safetensors",
    "adapter_model.bin", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
    "pytorch_model.bin.index.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
    "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json", "curves.png",
    "rollout_png", "runs", "all_results.json", "train_results.json", "eval_results.json",
})
_RUN_PATTERNS = (CHECKPOINT_NAME, re.compile(r"^\.staging-checkpoint-[0-9]+$"),
                 re.compile(r"^model-[0-9]+-of-[0-9]+\.safetensors$"), re.compile(r"^eval_.+$"))
SAVED_MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors",
                     "pytorch_model.bin")
_RECORD_PEEK = 256


def is_run_record(path: Path) -> bool:
    """Whether ``path`` is a regular file that ``train`` wrote as a run record (its first line is the mark)."""
    try:
        if not path.is_file() or path.is_symlink():
            return False
        with path.open("rb") as handle:
            first = handle.read(_RECORD_PEEK).decode("utf-8", "replace")
    except OSError:
        return False
    return first.startswith((RECORD_MARK, _OLD_RECORD_MARK))


def _listing(folder: Path) -> list[str]:
    try:
        with os.scandir(folder) as entries:
            return sorted(entry.name for entry in entries)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _is_run_entry(name: str) -> bool:
    return name in _RUN_FILES or any(pattern.match(name) for pattern in _RUN_PATTERNS)


def run_entries(folder: Path) -> list[str]:
    """The entries of ``folder`` whose names a run writes (its final model, checkpoints, logs, record, results)."""
    return [name for name in _listing(folder) if _is_run_entry(name)]


def foreign_entries(folder: Path) -> list[str]:
    """Every entry of a folder that is no coordexp run (no record); ``[]`` for a run, an empty or absent folder."""
    if is_run_record(folder / RUN_RECORD_NAME):
        return []
    return [name for name in _listing(folder) if name != PREVIOUS_DIR]


def used_output_problem(output_dir: str | Path) -> Optional[str]:
    """What makes ``output_dir`` a used run folder (its ``checkpoint-<digits>``, a saved model or a trainer state),
    else None: a fresh run there would mix its checkpoints with the old run's and overwrite its model."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return None
    names = _listing(folder)
    checkpoints = sorted((n for n in names if CHECKPOINT_NAME.match(n) and (folder / n).is_dir()),
                         key=lambda n: int(n.split("-")[1]))
    if checkpoints:
        shown = ", ".join(checkpoints[:3]) + (", ..." if len(checkpoints) > 3 else "")
        return f"holds {len(checkpoints)} checkpoint(s) ({shown})"
    saved = [name for name in (*SAVED_MODEL_FILES, "trainer_state.json") if name in names]
    return f"holds a saved model ({saved[0]})" if saved else None


def _real(path: str | Path) -> Path:
    return Path(os.path.realpath(os.path.expanduser(str(path))))


def _inside(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def input_overlap(output_dir: str | Path, inputs: Iterable[tuple[str, Optional[str]]]) -> Optional[tuple[str, str]]:
    """``(key, relation)`` of the first input (``(key, path)`` pairs; a missing path is skipped) that
    ``output_dir`` is, lies inside or contains (through symlinks); None when they are apart."""
    out = _real(output_dir)
    for key, path in inputs:
        if not path or not os.path.lexists(os.path.expanduser(path)):
            continue
        source = _real(path)
        if out == source:
            return key, "is"
        if _inside(out, source):
            return key, "is inside"
        if _inside(source, out):
            return key, "contains"
    return None


def move_previous_run(output_dir: str | Path, *, now: Optional[float] = None) -> tuple[Path, list[str]] | None:
    """``--overwrite``: rename every run entry of ``output_dir`` (links as links) into a new
    ``OUTPUT_DIR/.previous/<UTC time>`` and return it with the moved names; None when there was nothing to move."""
    folder = Path(output_dir)
    names = run_entries(folder)
    if not names:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    (folder / PREVIOUS_DIR).mkdir(exist_ok=True)
    target = folder / PREVIOUS_DIR / stamp
    suffix = 0
    while True:
        try:
            target.mkdir()
            break
        except FileExistsError:
            suffix += 1
            target = folder / PREVIOUS_DIR / f"{stamp}-{suffix}"
    for name in names:
        os.rename(folder / name, target / name)  # rename(2) moves a symlink itself, never what it points at
    return target, names
