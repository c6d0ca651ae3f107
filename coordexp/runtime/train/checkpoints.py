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
        problem = checkpoint_problem(path)
        if path.is_symlink():  # a link into another run's folder is no checkpoint this run wrote
            problem = f"a link to {os.path.realpath(path)}, not a checkpoint this run wrote (pass --resume PATH)"
        if problem is None:
            return ResumeChoice(path, tuple(skipped))
        skipped.append((path, problem))
    return ResumeChoice(None, tuple(skipped))


_RESUME_STATE_FILES = ("optimizer.pt", "scheduler.pt", "scaler.pt")
"""What HF loads with ``weights_only`` on resume (its RNG states go through its own allowlist instead)."""


def resume_files_problem(path: str | Path) -> str | None:
    """Why HF could not resume from the checkpoint's optimizer, scheduler or adapter files (named), else None:
    each state file must load as plain tensors (``weights_only``: a pickle with code, a truncated or foreign-format
    file is refused here, before the model loads, instead of failing inside HF); an adapter's files are checked as
    ``eval`` checks them. The files are memory-mapped, not read whole."""
    import torch

    from coordexp.runtime.model.adapters import is_adapter_dir
    from coordexp.runtime.model.checkpoint_files import check_adapter_dir

    root = Path(path)
    for name in _RESUME_STATE_FILES:
        file = root / name
        if not os.path.lexists(file):
            continue
        if not file.is_file():
            return f"{file} is not a regular file"
        try:
            torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # noqa: BLE001 - torch raises many kinds for an unloadable file
            return f"{file} cannot be loaded ({type(exc).__name__}: {' '.join(str(exc).split())[:160]})"
    if is_adapter_dir(root):
        try:
            check_adapter_dir(root)
        except CheckpointFileError as exc:
            return exc.message
    return None


_TRAINING_STATE_FILES = _RESUME_STATE_FILES
"""What a checkpoint holds only to continue training (with ``rng_state*.pth``): not copied to a finished run's top."""


def finish_from_checkpoint(run_dir: str | Path, checkpoint: str | Path) -> list[str]:
    """Write a finished run's final model into ``run_dir`` from its last checkpoint (it reached ``max_steps``, but
    the run stopped before its own final save): the checkpoint's model, processor and ``trainer_state.json`` files,
    each copied to a temp file and renamed into place (a link there is replaced, never written through). The model
    is checked first (:class:`CheckpointFileError` names a broken file). Returns the names written."""
    from coordexp.runtime.model.adapters import is_adapter_dir
    from coordexp.runtime.model.checkpoint_files import check_adapter_dir, check_model_dir

    source = Path(checkpoint)
    if is_adapter_dir(source):
        check_adapter_dir(source)
    else:
        check_model_dir(source)
    names = sorted(child.name for child in source.iterdir()
                   if child.is_file() and not child.is_symlink() and child.name not in _TRAINING_STATE_FILES
                   and not child.name.startswith("rng_state"))
    for name in names:
        fd, staged = tempfile.mkstemp(dir=run_dir, prefix=f".{name}.", suffix=".finishing")
        try:
            with os.fdopen(fd, "wb") as handle, (source / name).open("rb") as original:
                shutil.copyfileobj(original, handle)
            os.replace(staged, Path(run_dir) / name)
        except BaseException:
            if os.path.lexists(staged):
                os.unlink(staged)
            raise
    return names
