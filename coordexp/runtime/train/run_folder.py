"""What a run folder (``training.output_dir``) holds, and what ``train`` may do to it (issues 43 and 45).

A folder is a coordexp run when it holds a run record (``coordexp_config.yaml`` headed by :data:`RECORD_MARK`);
a non-empty folder without one is somebody else's (a model download, a repository, a home folder) and a run there
would overwrite files it did not write (``config.json``, ``README.md``, ``tokenizer.json`` ...). ``--overwrite``
never deletes: the entries a run writes (:func:`run_entries`) are moved, as they are (symlinks not followed), into
``OUTPUT_DIR/.previous/<UTC time>``; every other entry stays where it is. Standard library only (the
schema's atomic writer for results).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Iterable, Optional

__all__ = ["RUN_RECORD_NAME", "RECORD_MARK", "PREVIOUS_DIR", "is_run_record", "run_entries", "foreign_entries",
           "used_output_problem", "input_overlap", "move_previous_run", "CHECKPOINT_NAME", "RunFolder",
           "EVAL_RESULT_FILES", "PROBE_RESULT_FILES", "record_problem", "previous_dir_problem",
           "write_result_file", "save_image"]

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
_RESULT_FOLDER = re.compile(r"^(eval|probe)_.+$")
"""``coordexp eval``'s and ``coordexp probe``'s result folders in a run folder (``eval_val``, ``probe_val`` ...)."""
_RUN_PATTERNS = (CHECKPOINT_NAME, re.compile(r"^\.staging-checkpoint-[0-9]+$"),
                 re.compile(r"^model-[0-9]+-of-[0-9]+\.safetensors$"), _RESULT_FOLDER,
                 re.compile(r"^run_metadata\.rank[0-9]+\.jsonl$"))
EVAL_RESULT_FILES = ("coco_gt.json", "coco_results.json", "predictions.jsonl", "metrics.json")
"""What ``coordexp eval`` writes in its result folder (PNGs go to ``png/``)."""
PROBE_RESULT_FILES = ("probe.json", "recall_by_rank.png")
"""What ``coordexp probe`` writes in its result folder."""
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


def _is_result_folder(path: Path) -> bool:
    """An ``eval_*``/``probe_*`` directory (not a link) holding only what eval or probe write: coordexp's own
    results, left by an ``eval`` or ``probe`` of the starting model before the run trained (issue 56, item 24)."""
    if not _RESULT_FOLDER.match(path.name) or path.is_symlink() or not path.is_dir():
        return False
    known = {*EVAL_RESULT_FILES, *PROBE_RESULT_FILES}
    for name in _listing(path):
        entry = path / name
        if entry.is_symlink():
            return False
        if name == "png" and entry.is_dir():
            if any(not re.fullmatch(r"eval_[0-9]{4}\.png", png) for png in _listing(entry)):
                return False
        elif name not in known or not entry.is_file():
            return False
    return True


def foreign_entries(folder: Path) -> list[str]:
    """Every entry of a folder that is no coordexp run (no record); ``[]`` for a run, an empty or absent folder.
    Result folders of an ``eval`` or ``probe`` coordexp ran there are not foreign."""
    if is_run_record(folder / RUN_RECORD_NAME):
        return []
    return [name for name in _listing(folder) if name != PREVIOUS_DIR and not _is_result_folder(folder / name)]


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


def record_problem(folder: str | Path) -> Optional[str]:
    """Why the run record's place in ``folder`` cannot take the record (a link, a FIFO, a folder, a device: a write
    there would follow the link onto a user's file or hang), else None; an absent record is fine."""
    path = Path(folder) / RUN_RECORD_NAME
    if not os.path.lexists(path):
        return None
    if path.is_symlink():
        return f"{path} is a link (to {os.readlink(path)}), not the run record coordexp wrote"
    if not path.is_file():
        return f"{path} is not a regular file"
    return None


def previous_dir_problem(folder: str | Path) -> Optional[str]:
    """Why ``--overwrite`` could not move a run aside into ``OUTPUT_DIR/.previous`` (not a folder of this file
    system: a file, a link, a FIFO), else None; checked before the model loads."""
    path = Path(folder) / PREVIOUS_DIR
    if not os.path.lexists(path):
        return None
    if path.is_symlink():
        return f"{path} is a link; --overwrite moves the old run into a real folder there"
    if not path.is_dir():
        return f"{path} is not a folder; --overwrite moves the old run into it"
    try:
        if os.stat(path).st_dev != os.stat(folder).st_dev:
            return f"{path} is on another file system; --overwrite moves the old run there by renaming"
    except OSError as exc:
        return f"{path} cannot be read ({exc.strerror or exc})"
    return None


def write_result_file(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to a temp file beside ``path`` and rename it over ``path``
    (:func:`coordexp.schema.migrate_io.replace_atomically`, folders created first): a link or FIFO at ``path`` is
    replaced, never written through or blocked on, and a reader never sees half a file."""
    from coordexp.schema.migrate_io import replace_atomically

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    replace_atomically(target, data)
    return target


def save_image(image: object, path: str | Path) -> Path:
    """A PIL image written through :func:`write_result_file` (a link at ``path`` is replaced), in the format its
    suffix names (PIL's ``ValueError`` for one it does not know, before anything is written)."""
    import io

    from PIL import Image

    extension = Path(path).suffix.lower()
    image_format = Image.registered_extensions().get(extension)
    if image_format is None:
        raise ValueError(f"unknown file extension: {extension or '(none)'}")
    buffer = io.BytesIO()
    image.save(buffer, format=image_format)  # type: ignore[attr-defined]
    return write_result_file(path, buffer.getvalue())


class RunFolder:
    """One run folder (``training.output_dir``) and what a run writes there: the final model, the checkpoints, the
    record, and where ``eval`` and ``probe`` put their results. The one place that knows the layout."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @property
    def record(self) -> Path:
        return self.path / RUN_RECORD_NAME

    def has_record(self) -> bool:
        return is_run_record(self.record)

    def has_final_model(self) -> bool:
        """A final model (``config.json``) or adapter (``adapter_config.json``) saved at the folder's top."""
        return any((self.path / name).is_file() for name in ("config.json", "adapter_config.json"))

    def checkpoints(self) -> list[Path]:
        """The ``checkpoint-<digits>`` folders, oldest first (links are no checkpoints of this run)."""
        found = [self.path / name for name in _listing(self.path) if CHECKPOINT_NAME.match(name)]
        found = [path for path in found if path.is_dir() and not path.is_symlink()]
        return sorted(found, key=lambda path: int(path.name.split("-")[1]))

    def unfinished_problem(self) -> Optional[str]:
        """A folder a run trained in (a record or checkpoints) without its final model: the run stopped before its
        end, and evaluating the config's ``model.path`` instead would report the starting model as the run's."""
        if self.has_final_model():
            return None
        checkpoints = self.checkpoints()
        if not checkpoints and not self.has_record():
            return None
        newest = f"; its newest checkpoint is {checkpoints[-1]}" if checkpoints else ""
        return f"training.output_dir {self.path} holds a run without its final model (it did not finish){newest}"

    def result_dir(self, kind: str, checkpoint: Optional[Path], split: str) -> Path:
        """``OUTPUT_DIR/<kind>_SPLIT`` (kind: ``eval`` or ``probe``); with ``--checkpoint DIR``:
        ``<kind>_checkpoint-N`` for this run's own ``checkpoint-N`` (``_train`` for the train split), else
        ``<kind>_<run>_<folder>_<hash of its real path>``, so results of different checkpoints never share a folder;
        names stay well under the file system's 255 bytes."""
        import hashlib

        if checkpoint is None:
            return self.path / f"{kind}_{split}"
        suffix = "" if split == "val" else f"_{split}"
        real = Path(os.path.realpath(checkpoint))
        if re.fullmatch(r"checkpoint-[0-9]{1,18}", real.name) and real.parent == Path(os.path.realpath(self.path)):
            return self.path / f"{kind}_{real.name}{suffix}"
        digest = hashlib.sha256(os.fsencode(str(real))).hexdigest()[:10]

        def short(name: str) -> str:
            return re.sub(r"[^A-Za-z0-9._-]", "_", name)[:60] or "_"

        return self.path / f"{kind}_{short(real.parent.name)}_{short(real.name)}_{digest}{suffix}"
