"""The ``TrainingArguments`` a run will build, checked by transformers, accelerate and torch themselves before any
model loads: every pass-through value (or combination) they refuse becomes a config issue at its dotted path (exit
2), not an exception from inside the Trainer after minutes of loading (docs/design.md, decision 13).

``validate`` stays light (no torch): the schema refuses the combinations it knows (``schema/training.py``,
``schema/hf_surface.py``), and tests/schema/test_training_passthrough.py checks that table against this one. This
module is the authority: ``train`` runs it before the model loads, ``preflight`` runs it where the answer depends on
the machine (``tf32`` needs an Ampere GPU). It builds the real objects: ``launch.training_arguments`` (the very
function the run uses), the Trainer's own argument checks, a ``DataLoader`` with the data-loading fields and the
accelerate ``TorchDynamoPlugin`` the Trainer builds from the compile fields.
"""

from __future__ import annotations

import re
import types
from typing import TYPE_CHECKING, Any, Callable

from coordexp.schema.errors import ConfigError, ConfigIssue
from coordexp.schema.hf_training_fields import HF_TRAINING_FIELDS

if TYPE_CHECKING:
    from coordexp.schema.contract import RunContract

__all__ = ["MACHINE_FIELDS", "needs_machine_check", "training_argument_issues", "check_training_arguments",
           "deepspeed_issues"]

MACHINE_FIELDS = ("tf32",)
"""Pass-through fields whose acceptance depends on the machine (checked at preflight and train, not validate)."""
_HINT = ("transformers refuses it when training starts; fix the field named (coordexp checked the real "
         "TrainingArguments before loading the model)")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LOADER_NAMES = {name: f"dataloader_{name}"  # DataLoader's words for the training fields
                 for name in ("prefetch_factor", "persistent_workers", "multiprocessing_context", "num_workers")}


def needs_machine_check(run: "RunContract") -> bool:
    """Whether the config sets a field only this machine can judge (so preflight must import torch)."""
    return any(getattr(run.training, name, None) for name in MACHINE_FIELDS)


def _issue(run: "RunContract", exc: BaseException, fallback: str) -> ConfigIssue:
    """``exc`` at the dotted path of the first training field its text names (one the config set, when any)."""
    text = " ".join(str(exc).split())[:400] or type(exc).__name__
    words = [_LOADER_NAMES.get(word, word) for word in _WORD.findall(text)]
    named = [word for word in words if word in HF_TRAINING_FIELDS or word in type(run.training).model_fields]
    written = sorted(run.training.model_fields_set)
    exact = [word for word in named if word in written]
    # "At most one of fp16 and bf16 can be True for full eval": the written field the text abbreviates
    partial = [field for word in words for field in written if field != word and field.startswith(word + "_")]
    field = (exact or partial or named or [fallback])[0]
    return ConfigIssue(f"training.{field}", text, _HINT)


def _trainer_checks(args: Any, run: "RunContract") -> None:
    """The Trainer's own argument checks (``Trainer._validate_args``), run on a stand-in holding what coordexp's
    trainer passes: an eval dataset exactly when ``data.val_jsonl`` is set, no custom optimizer or metrics."""
    from transformers import Trainer

    validate: Callable[[Any], None] | None = getattr(Trainer, "_validate_args", None)
    if validate is None:  # another transformers: the Trainer itself checks at train time
        return
    stand_in = types.SimpleNamespace(
        args=args, eval_dataset=object() if run.data.val_jsonl is not None else None, train_dataset=[None],
        compute_metrics=None, optimizer=None, optimizer_cls_and_kwargs=None, lr_scheduler=None, model_init=None,
        model=None, is_fsdp_enabled=False, is_fsdp_xla_enabled=False, data_collator=lambda rows: rows)
    try:
        validate(stand_in)
    except AttributeError:  # the check reads something the stand-in lacks: the Trainer itself checks later
        return


def _loader_checks(args: Any) -> None:
    """torch's DataLoader with the data-loading fields as the Trainer passes them (no worker starts here)."""
    from torch.utils.data import DataLoader

    DataLoader([0], batch_size=1, num_workers=args.dataloader_num_workers, pin_memory=False,
               persistent_workers=args.dataloader_persistent_workers,
               multiprocessing_context=args.dataloader_multiprocessing_context,
               prefetch_factor=args.dataloader_prefetch_factor)


def _compile_checks(args: Any) -> None:
    """accelerate's ``TorchDynamoPlugin``, which the Trainer builds from the compile fields."""
    from accelerate.utils import TorchDynamoPlugin

    TorchDynamoPlugin(backend=args.torch_compile_backend, mode=args.torch_compile_mode)


def deepspeed_issues(run: "RunContract") -> list[ConfigIssue]:
    """What DeepSpeed refuses only once the model is loaded, read from the config's DeepSpeed JSON (bounded): an
    ``amp`` block (refused under the HF Trainer even when disabled) and values transformers calls a mismatch at this
    launch's WORLD_SIZE (``train_batch_size`` = per-device batch x accumulation x WORLD_SIZE; ``validate``, which
    does not know the world size, checks the rest: :func:`coordexp.schema.deepspeed_file.transformers_mismatches`)."""
    import os

    from coordexp.runtime.train.deepspeed import resolve_deepspeed
    from coordexp.runtime.train.launch import accumulation_steps
    from coordexp.schema.deepspeed_file import read_deepspeed_json, transformers_mismatches
    from coordexp.schema.file_read import FileReadError

    t = run.training
    path = resolve_deepspeed(t.deepspeed)
    if path is None:
        return []
    try:
        config = read_deepspeed_json(path)
    except FileReadError:  # validate names the file's own problem
        return []
    if not isinstance(config, dict):
        return []
    issues = []
    if "amp" in config:
        issues.append(ConfigIssue("training.deepspeed", f"{path} has an amp block, which DeepSpeed refuses under the "
                                  "HF Trainer (even with enabled: false)",
                                  "remove the amp block; mixed precision comes from training.bf16 / fp16"))
    world = int(os.environ.get("WORLD_SIZE", "1") or "1")
    resolved = t.model_copy(update={"gradient_accumulation_steps": accumulation_steps(t, world)})
    for key, value, want in transformers_mismatches(config, resolved, world_size=world):
        issues.append(ConfigIssue("training.deepspeed", f"{path}: {key} is {value!r}, but this launch (WORLD_SIZE "
                                  f"{world}) trains with {want!r}",
                                  'write "auto" (coordexp fills it from training.*) or the launch\'s value'))
    return issues


def training_argument_issues(run: "RunContract", *, machine: bool = True) -> list[ConfigIssue]:
    """Every refusal of the run's training arguments, each at its dotted path; ``machine=False`` leaves out what
    depends on this machine (:data:`MACHINE_FIELDS`). The arguments are built exactly as the run builds them
    (DeepSpeed included): building them sets up the process's device and distributed state, which must be the
    run's own. coordexp's own errors (a :class:`~coordexp.errors.CoordexpError` from resolving the arguments)
    pass through unchanged."""
    from coordexp.errors import CoordexpError
    from coordexp.runtime.train.launch import training_arguments

    overrides: dict[str, Any] = {} if machine else {name: None for name in MACHINE_FIELDS}
    refused = deepspeed_issues(run)
    if refused:
        return refused
    try:
        args = training_arguments(run, **overrides)
    except CoordexpError:
        raise
    except (ValueError, TypeError) as exc:
        return [_issue(run, exc, "output_dir")]
    issues = []
    for check, fallback in ((lambda: _trainer_checks(args, run), "eval_strategy"),
                            (lambda: _loader_checks(args), "dataloader_num_workers"),
                            (lambda: _compile_checks(args), "torch_compile_backend")):
        try:
            check()
        except (ValueError, TypeError, RuntimeError) as exc:
            issues.append(_issue(run, exc, fallback))
    return issues


def check_training_arguments(run: "RunContract") -> None:
    """:func:`training_argument_issues` on this machine; a :class:`ConfigError` listing them (exit 2)."""
    issues = training_argument_issues(run, machine=True)
    if issues:
        raise ConfigError(issues)
