"""Checkpoints that are visible only when complete, and the choice of which one to resume (docs/design.md, decision 14).

HF writes ``checkpoint-N`` in place, so a process killed mid-save left a half-written directory that ``--resume auto``
then picked (and crashed on). Here every checkpoint is written under a hidden staging directory
(``.staging-checkpoint-N/checkpoint-N``) and renamed into place by rank 0 once every rank has written its part; a
rename within one directory is atomic on POSIX filesystems. Leftover staging directories are incomplete by
construction. ``--resume auto`` also checks what a complete checkpoint holds (checkpoints written by older versions
or by other tools may be partial) and names every one it skips.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from coordexp.runtime.train.model_card import MODEL_CARD_NAME
from coordexp.runtime.model.checkpoint_files import (ADAPTER_WEIGHT_FILES, WEIGHT_FILES, CheckpointFileError,
                                                     read_json_object)

__all__ = ["STAGING_PREFIX", "staging_dir", "publish_checkpoint", "clear_staging", "checkpoint_problem",
           "ResumeChoice", "choose_resume", "finished_step", "resume_files_problem",
           "finish_from_checkpoint"]

STAGING_PREFIX = ".staging-"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_STATE = "trainer_state.json"
_MAX_STEP = 10 ** 12  # no run takes a trillion optimizer steps: a larger global_step is a damaged state


def staging_dir(run_dir: str | Path, step: int) -> Path:
    """Where HF writes checkpoint ``step`` before it is published (a sibling of the final directory)."""
    return Path(run_dir) / f"{STAGING_PREFIX}checkpoint-{int(step)}"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def publish_checkpoint(run_dir: str | Path, step: int) -> Path:
    """Rename the staged ``checkpoint-step`` into ``run_dir`` (replacing a stale one of the same step) and return it."""
    staged = staging_dir(run_dir, step) / f"checkpoint-{int(step)}"
    final = Path(run_dir) / f"checkpoint-{int(step)}"
    if not staged.is_dir():
        raise FileNotFoundError(f"the staged checkpoint {staged} is missing; was it written by every rank?")
    for path in staged.rglob("*"):
        if path.is_file():
            with path.open("rb") as handle:
                os.fsync(handle.fileno())
    if final.exists():  # a checkpoint of this step from an earlier attempt: the new one replaces it
        old = staging_dir(run_dir, step) / "replaced"
        final.rename(old)
    staged.rename(final)
    _fsync_dir(Path(run_dir))
    shutil.rmtree(staging_dir(run_dir, step), ignore_errors=True)
    return final


def clear_staging(run_dir: str | Path) -> list[Path]:
    """Delete leftover staging directories (saves that never completed) and return what was removed."""
    root = Path(run_dir)
    if not root.is_dir():
        return []
    removed = [p for p in root.iterdir() if p.name.startswith(STAGING_PREFIX) and p.is_dir()]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def checkpoint_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot be resumed from (``None`` when it holds a trainer state and weights)."""
    root = Path(path)
    if not root.is_dir():
        return "not a directory"
    state = root / _STATE
    if not state.is_file():
        return f"no {_STATE} (the save did not finish)"
    try:
        step = read_json_object(state).get("global_step")  # bounded: size, nesting, a regular file
    except CheckpointFileError as exc:
        return f"{_STATE} is unreadable ({exc.message.replace(f'{state}: ', '', 1)[:200]})"
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < _MAX_STEP:
        return f"{_STATE} has no valid global_step"
    weights = (root / name for name in (*WEIGHT_FILES, *ADAPTER_WEIGHT_FILES))
    if not any(path.is_file() and path.stat().st_size > 0 for path in weights):
        return "no model weights"
    return None


def finished_step(path: str | Path) -> int:
    """The optimizer steps a (complete) checkpoint had taken."""
    return int(read_json_object(Path(path) / _STATE)["global_step"])


@dataclass(frozen=True)
class ResumeChoice:
    """The newest complete checkpoint (None when there is none) and every newer one skipped, with the reason."""

    path: Path | None
    skipped: tuple[tuple[Path, str], ...]


def _numbered(run_dir: Path) -> Iterable[tuple[int, Path]]:
    for child in run_dir.iterdir():
        match = _CHECKPOINT.match(child.name)
        if match and child.is_dir():
            yield int(match.group(1)), child


def choose_resume(run_dir: str | Path) -> ResumeChoice:
    """``--resume auto``: the newest ``checkpoint-N`` that :func:`checkpoint_problem` accepts."""
    root = Path(run_dir)
    if not root.is_dir():
        return ResumeChoice(None, ())
    skipped: list[tuple[Path, str]] = []
    for _, path in sorted(_numbered(root), reverse=True):
        if path.is_symlink():  # a link into another run's folder is no checkpoint this run wrote
            problem = f"a link to {os.path.realpath(path)}, not a checkpoint this run wrote (pass --resume PATH)"
        else:
            problem = checkpoint_problem(path)
        if problem is None:
            return ResumeChoice(path, tuple(skipped))
        skipped.append((path, problem))
    return ResumeChoice(None, tuple(skipped))


_RESUME_STATE_FILES = ("optimizer.pt", "scheduler.pt", "scaler.pt")
"""What HF loads with ``weights_only`` on resume (its RNG states go through its own allowlist instead)."""


def resume_files_problem(path: str | Path, train_type: str | None = None) -> str | None:
    """Why HF could not resume from the checkpoint's files (named), else None, checked before the model loads: the
    trainer state must build a ``TrainerState``; each optimizer, scheduler and RNG state file must load as plain
    data (``weights_only``, the RNG files with the numpy types HF allows: a pickle with code, a truncated or
    foreign-format file is refused here instead of failing inside HF); the weights (or adapter) must be intact; and
    a LoRA checkpoint resumes only a LoRA run (``train_type``), a full one only a full run. Files are
    memory-mapped, not read whole."""
    import torch

    from coordexp.runtime.model.adapters import is_adapter_dir
    from coordexp.runtime.model.checkpoint_files import check_adapter_dir, check_model_dir

    root = Path(path)
    adapter = is_adapter_dir(root)
    if train_type is not None and adapter != (train_type == "lora"):
        saved = "a LoRA adapter" if adapter else "a full model"
        return (f"it holds {saved}, and this run trains with tuner.train_type: {train_type}; a resume continues the "
                "same kind of run")
    try:
        check_adapter_dir(root) if adapter else check_model_dir(root, model_check=False)
    except CheckpointFileError as exc:
        return exc.message
    state_problem = _trainer_state_problem(root / _STATE)
    if state_problem is not None:
        return state_problem
    rng_files = sorted(p.name for p in root.glob("rng_state*.pth"))
    for name in (*_RESUME_STATE_FILES, *rng_files):
        file = root / name
        if not os.path.lexists(file):
            continue
        if not file.is_file():
            return f"{file} is not a regular file"
        try:
            with _numpy_allowed(name):
                torch.load(file, map_location="cpu", weights_only=True, mmap=not name.startswith("rng_state"))
        except Exception as exc:  # noqa: BLE001 - torch raises many kinds for an unloadable file
            return f"{file} cannot be loaded ({type(exc).__name__}: {' '.join(str(exc).split())[:160]})"
    return None


def _numpy_allowed(name: str):
    """HF's allowlist of numpy types for RNG state files (``trainer_pt_utils.safe_globals``); nothing else."""
    import contextlib

    if not name.startswith("rng_state"):
        return contextlib.nullcontext()
    from transformers.trainer_pt_utils import safe_globals

    return safe_globals()


def _trainer_state_problem(path: Path) -> str | None:
    """Why HF's ``TrainerState.load_from_json`` would fail on ``path`` (unknown keys, wrong types), else None."""
    from transformers import TrainerState

    try:
        state = TrainerState(**read_json_object(path))
        if not isinstance(state.log_history, list):
            raise TypeError("log_history is not a list")
    except CheckpointFileError as exc:
        return exc.message
    except (TypeError, ValueError) as exc:
        return f"{path} is no trainer state ({' '.join(str(exc).split())[:160]})"
    return None


def finish_from_checkpoint(run_dir: str | Path, checkpoint: str | Path) -> list[str]:
    """Write a finished run's final model into ``run_dir`` from its last checkpoint (it reached ``max_steps``, but
    the run stopped before its own final save): the checkpoint's model, processor and ``trainer_state.json`` files
    (not its ``README.md``: PEFT's template there is no card, and the run folder's may be the user's),
    each copied to a temp file and renamed into place (a link there is replaced, never written through). The model
    is checked first (:class:`CheckpointFileError` names a broken file). Returns the names written."""
    from coordexp.runtime.model.adapters import is_adapter_dir
    from coordexp.runtime.model.checkpoint_files import check_adapter_dir, check_model_dir

    source = Path(checkpoint)
    if is_adapter_dir(source):
        check_adapter_dir(source)
    else:
        check_model_dir(source)
    names = sorted(child.name for child in source.iterdir()  # the training state stays in the checkpoint
                   if child.is_file() and not child.is_symlink() and child.name not in _RESUME_STATE_FILES
                   and not child.name.startswith("rng_state") and child.name != MODEL_CARD_NAME)
    for name in names:  # streamed (weights can be larger than memory), each file's mode kept
        fd, staged = tempfile.mkstemp(dir=run_dir, prefix=f".{name}.", suffix=".finishing")
        os.close(fd)
        try:
            shutil.copy2(source / name, staged)
            os.replace(staged, Path(run_dir) / name)
        finally:
            Path(staged).unlink(missing_ok=True)
    return names
