"""``coordexp export-merged``: a LoRA adapter merged into its base and saved as a plain checkpoint, checked first.

:func:`plan_export` checks everything it can before any weight loads (exit 2 naming the file): the adapter's config
and weights file, the base (``--base`` or the adapter's record: a local checkpoint, never a hub id), the processor,
and OUT_DIR (a symlink loop, a dangling link, a path under a file, a name longer than the file system takes, a
folder where nothing can be created). :func:`write_merged` then loads, merges, refuses a merged model holding a
non-finite tensor (naming it) and writes into a temporary folder beside OUT_DIR that is renamed into place only
when complete, so a failure leaves nothing behind. All of it runs with the Hub client offline.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from coordexp.runtime.model.policy import first_non_finite
from coordexp.errors import UserInputError
from coordexp.runtime.model.adapters import (ADAPTER_CONFIG, AdapterDirError, hub_offline, load_adapter_weights,
                                             read_adapter_config)

__all__ = ["ExportError", "ExportPlan", "plan_export", "write_merged", "export_merged", "expand_vocab",
           "first_non_finite"]

_OUT_HINT = "choose a new or empty output directory you may write"


class ExportError(UserInputError, RuntimeError):
    """The merged checkpoint cannot be written (OUT_DIR unusable, a non-finite merged tensor); nothing was written."""


@dataclass(frozen=True)
class ExportPlan:
    """What :func:`write_merged` does, every input checked: the adapter, the base, the processor to save, the
    real OUT_DIR (symlinks resolved) and what to tell the user (``notes``)."""

    adapter_dir: Path
    base: Path
    processor: Any
    out_dir: Path
    notes: tuple[str, ...]


def _name_max(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def _check_out_dir(out_dir: Path) -> Path:
    """The directory to write (symlinks resolved); an :class:`ExportError` when OUT_DIR cannot be a new or empty
    directory or nothing can be created beside it. Nothing is left behind."""
    target, above = _out_target(out_dir)
    try:  # the only sure test: create (and remove) a folder where the scratch folder will be created
        os.rmdir(tempfile.mkdtemp(prefix=".coordexp-probe-", dir=above))
    except OSError as exc:
        raise ExportError(f"OUT_DIR {out_dir}: nothing can be created in {above} ({exc.strerror or exc})",
                          hint=_OUT_HINT) from None
    return target


def _out_target(out_dir: Path) -> tuple[Path, Path]:
    """(the directory to write, the nearest existing folder above it); refusals as :func:`_check_out_dir`."""
    try:
        info = os.lstat(out_dir)
    except (FileNotFoundError, NotADirectoryError):  # new, or under a file (said below)
        info = None
    except OSError as exc:  # a name too long, a component that is a file, a loop above it
        raise ExportError(f"OUT_DIR {out_dir}: cannot use this path ({exc.strerror or exc})", hint=_OUT_HINT) from None
    if info is not None and stat.S_ISLNK(info.st_mode):
        try:
            target = out_dir.resolve(strict=True)
        except (OSError, RuntimeError) as exc:  # RuntimeError: Python < 3.13's symlink loop
            loop = isinstance(exc, RuntimeError) or getattr(exc, "errno", None) == errno.ELOOP
            why = "a symlink loop" if loop else f"a dangling symlink (to {os.readlink(out_dir)[:200]!r})"
            raise ExportError(f"OUT_DIR {out_dir} is {why}", hint=_OUT_HINT) from None
        return _out_target(target)
    if info is not None:
        if not stat.S_ISDIR(info.st_mode):
            raise ExportError(f"OUT_DIR {out_dir} exists and is not a directory", hint=_OUT_HINT)
        try:
            with os.scandir(out_dir) as entries:
                empty = not any(entries)
        except OSError as exc:
            raise ExportError(f"OUT_DIR {out_dir}: cannot list it ({exc.strerror or exc})", hint=_OUT_HINT) from None
        if not empty:
            raise ExportError(f"OUT_DIR {out_dir} already exists and is not an empty directory", hint=_OUT_HINT)
        return out_dir.absolute(), out_dir.absolute().parent
    path = out_dir.absolute()
    missing: list[str] = []
    above = path
    while not os.path.lexists(above):
        missing.append(above.name)
        above = above.parent
    try:
        real_above = above.resolve(strict=True)
    except (OSError, RuntimeError) as exc:
        reason = "a symlink loop" if isinstance(exc, RuntimeError) else (getattr(exc, "strerror", None) or str(exc))
        raise ExportError(f"OUT_DIR {out_dir}: {above} cannot be used ({reason})", hint=_OUT_HINT) from None
    if not real_above.is_dir():
        raise ExportError(f"OUT_DIR {out_dir} lies under {above}, which is a file, not a directory", hint=_OUT_HINT)
    limit = _name_max(real_above)
    for name in missing:
        if len(os.fsencode(name)) > limit:
            raise ExportError(f"OUT_DIR {out_dir}: the name {name[:40]!r}... has {len(os.fsencode(name))} bytes; "
                              f"the file system takes at most {limit}", hint=_OUT_HINT)
    return real_above.joinpath(*reversed(missing)), real_above


def _same_path(a: str, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


def _check_base(adapter_dir: Path, base: Optional[Path]) -> tuple[Path, tuple[str, ...]]:
    """The local base checkpoint to merge into and what to say about it: ``--base`` when given (said when it is
    not the adapter's recorded base), else the recorded one. A hub id is refused (the export is offline)."""
    from coordexp.runtime.model.adapters import adapter_base, local_base
    from coordexp.runtime.model.checkpoint_files import check_model_dir
    from coordexp.runtime.model.policy import SUPPORTED_FAMILIES

    recorded = read_adapter_config(adapter_dir).get("base_model_name_or_path")
    notes: tuple[str, ...] = ()
    if base is not None:
        if not local_base(str(base), adapter_dir):
            raise AdapterDirError(f"--base {base} is not a local checkpoint directory (no config.json; export-merged "
                                  "never downloads)", hint="pass the directory of the base checkpoint")
        chosen = Path(base)
        if recorded and not _same_path(str(recorded), chosen):
            notes = (f"using --base {base}, not the base the adapter records ({recorded}); its weights must have the "
                     "shapes the adapter was trained on (checked when it loads)",)
        elif not recorded:
            notes = (f"using --base {base} (the adapter records no base)",)
    else:
        try:
            chosen = Path(adapter_base(adapter_dir))
        except AdapterDirError as exc:
            raise AdapterDirError(exc.message, hint="pass --base DIR, the local base checkpoint (export-merged never "
                                  "downloads)") from None
    check_model_dir(chosen, families=SUPPORTED_FAMILIES)
    return chosen, notes


def plan_export(adapter_dir: str | Path, out_dir: str | Path, *, base: str | Path | None = None) -> ExportPlan:
    """Every check that needs no weights (module docstring); raises :class:`AdapterDirError`, ``CheckpointFileError``
    or :class:`ExportError` (all exit 2) naming the file and what is wrong."""
    from coordexp.runtime.model.checkpoint_files import check_adapter_dir, load_checked_processor

    adapter_dir, out_dir = Path(adapter_dir), Path(out_dir)
    read_adapter_config(adapter_dir)
    check_adapter_dir(adapter_dir)
    load_adapter_weights(adapter_dir)  # readable, finite: before the base loads
    target = _check_out_dir(out_dir)
    if _same_path(str(adapter_dir), target) or target == adapter_dir.absolute():
        raise ExportError("ADAPTER_DIR and OUT_DIR are the same directory", hint="write to a new directory")
    with hub_offline():
        chosen, notes = _check_base(adapter_dir, Path(base) if base is not None else None)
        own = any(os.path.lexists(adapter_dir / name) for name in ("tokenizer.json", "tokenizer_config.json"))
        processor = load_checked_processor(adapter_dir if own else chosen)
    return ExportPlan(adapter_dir, chosen, processor, target, notes)


def _load_local(folder: Path, *, dtype: Any) -> Any:
    """The model saved in ``folder`` (local files only); a load transformers refuses is exit 2 naming it."""
    from transformers import AutoModelForImageTextToText

    from coordexp.runtime.model.checkpoint_files import CheckpointFileError

    try:
        return AutoModelForImageTextToText.from_pretrained(str(folder), dtype=dtype, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds for unloadable weights
        raise CheckpointFileError(f"{folder}: transformers cannot load the model ({type(exc).__name__}: "
                                  f"{' '.join(str(exc).split())[:200]})", hint="re-save the checkpoint") from None


def _load_merged(plan: ExportPlan) -> Any:
    import torch

    from coordexp.runtime.model.adapters import attach_adapter
    from coordexp.runtime.model.tuner import align_tie_flag

    model = _load_local(plan.base, dtype=torch.float32)
    bad = first_non_finite(model.state_dict())
    if bad is not None:
        raise ExportError(f"{plan.base}: tensor {bad[0]} of the base model holds {bad[1]} non-finite value(s); the "
                          "merged model would too, so nothing was written", hint="merge into an intact base (--base)")
    align_tie_flag(model)  # PEFT ties saved coord-row tables on this flag
    merged = attach_adapter(model, plan.adapter_dir).merge_and_unload()
    dtype = _saved_dtype(plan.base)
    if dtype is not None:
        merged = merged.to(dtype)  # merged in float32, saved in the base's own dtype
    bad = first_non_finite(merged.state_dict())
    if bad is not None:
        where = f" after conversion to the base's {dtype}" if dtype is not None else ""
        raise ExportError(
            f"merging {plan.adapter_dir} into {plan.base} gives tensor {bad[0]} {bad[1]} non-finite value(s){where}; "
            "the merged model was not written",
            hint=f"the adapter's scale (lora_alpha / r in {ADAPTER_CONFIG}) or its weights are too large for the "
                 "base; export an earlier checkpoint-N")
    return merged


def write_merged(plan: ExportPlan) -> Path:
    """Load, merge, check every merged tensor is finite, then save model and processor into a temporary folder
    beside OUT_DIR renamed into place when complete; returns OUT_DIR. Nothing is left behind on failure."""
    with hub_offline():
        merged = _load_merged(plan)
    _write_complete(plan.out_dir, lambda scratch: _save(merged, plan.processor, scratch), "merged checkpoint")
    return plan.out_dir


def _save(model: Any, processor: Any, folder: Path) -> None:
    from coordexp.runtime.model.encoding import ImageTextProcessor
    from coordexp.runtime.model.policy import save_processor

    model.save_pretrained(str(folder))
    if isinstance(processor, ImageTextProcessor):
        save_processor(folder, model.config.model_type, processor.tokenizer, processor.image_processor)
    else:
        processor.save_pretrained(str(folder))


def _write_complete(out_dir: Path, save: Callable[[Path], None], what: str) -> None:
    """``save`` into a temporary folder beside ``out_dir`` renamed into place when complete; nothing is left
    behind on failure (folders created above it removed again)."""
    created: list[Path] = []
    parent = out_dir.parent
    scratch: Optional[Path] = None
    try:
        for folder in reversed([parent, *parent.parents]):
            if not folder.exists():
                folder.mkdir()
                created.append(folder)
        scratch = Path(tempfile.mkdtemp(prefix=f".{out_dir.name[:64]}.export-", dir=parent))
        save(scratch)
        from coordexp.runtime.model.checkpoint_files import share_saved_weights

        share_saved_weights(scratch)  # safetensors writes 0600: readable as a plain file would be (umask)
        os.chmod(scratch, 0o777 & ~_umask())
        os.rename(scratch, out_dir)  # replaces OUT_DIR only while it is still an empty directory
        scratch = None
    except OSError as exc:
        raise ExportError(f"OUT_DIR {out_dir}: cannot write the {what} ({exc.strerror or exc}); "
                          "nothing was left there", hint=_OUT_HINT) from None
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
            for folder in reversed(created):
                with contextlib.suppress(OSError):  # a folder someone filled meanwhile stays
                    folder.rmdir()


def expand_vocab(source: str | Path, destination: str | Path) -> int:
    """``coordexp expand-vocab``: SRC (config, weights, tokenizer) and DST checked as :func:`plan_export` checks
    them before any weight loads, the model refused when a tensor is non-finite (before and after the coord rows
    are added), written like :func:`write_merged`; returns the number of coord tokens added."""
    from coordexp.runtime.model.checkpoint_files import check_model_dir, load_checked_processor
    from coordexp.runtime.core.tokens import add_coord_tokens
    from coordexp.runtime.model.policy import SUPPORTED_FAMILIES

    source, destination = Path(source), Path(destination)
    with hub_offline():
        check_model_dir(source, families=SUPPORTED_FAMILIES)
        processor = load_checked_processor(source, coord_tokens=False)
    if _same_path(str(source), destination):
        raise ExportError("SRC and DST are the same directory", hint="write the expanded checkpoint to a new "
                          "directory")
    target = _check_out_dir(destination)
    with hub_offline():
        model = _load_local(source, dtype="auto")
    bad = first_non_finite(model.state_dict())
    if bad is not None:
        raise ExportError(f"{source}: tensor {bad[0]} holds {bad[1]} non-finite value(s); nothing was written",
                          hint="expand an intact checkpoint")
    added = add_coord_tokens(processor.tokenizer, model)
    bad = first_non_finite(model.state_dict())
    if bad is not None:  # the new rows start at the mean of the old ones: overflow in a half dtype
        raise ExportError(f"{source}: adding the coord tokens gives tensor {bad[0]} {bad[1]} non-finite value(s); "
                          "nothing was written", hint="expand a float32 copy of the checkpoint")
    _write_complete(target, lambda scratch: _save(model, processor, scratch), "expanded checkpoint")
    return added


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _saved_dtype(base: Path) -> Any:
    """The dtype the base checkpoint was saved in (config.json's ``dtype``), or None."""
    import torch

    from coordexp.runtime.model.checkpoint_files import read_json_object

    config = read_json_object(base / "config.json")
    name = config.get("dtype") or config.get("torch_dtype")
    value = getattr(torch, name, None) if isinstance(name, str) else None
    return value if isinstance(value, torch.dtype) else None


def export_merged(adapter_dir: str | Path, out_dir: str | Path, *, base: str | Path | None = None) -> Path:
    """:func:`plan_export` then :func:`write_merged`: the merged checkpoint in ``out_dir`` (returned)."""
    return write_merged(plan_export(adapter_dir, out_dir, base=base))
