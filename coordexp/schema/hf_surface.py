"""Which Hugging Face ``TrainingArguments`` fields a config may set under ``training.*``, typed and bounded from
the generated table of transformers' own dataclass (``hf_training_fields.py``), and which it may not, with why.

Three kinds of field (docs/design.md, decision 13): *owned* (typed by hand in ``training.py``: coordexp reads or
resolves them), *passed through* (every other field of a YAML-writable type, passed to ``TrainingArguments``
unchanged), and *refused* (coordexp must control them, or they do not work with coordexp's trainer): setting one
fails at its dotted path with the reason.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import AfterValidator, BeforeValidator, Field
from pydantic.json_schema import SkipJsonSchema

from coordexp.schema.base import MAX_COUNT, MAX_SECONDS, MAX_SEED, int_in, float_in
from coordexp.schema.errors import ConfigRuleError, RuleViolation
from coordexp.schema.hf_training_fields import COMPILE_BACKENDS, HF_TRAINING_FIELDS

__all__ = ["REFUSED", "passthrough_fields", "refused_fields", "UNSET"]

_FSDP = "FSDP is not supported yet (coordexp's packed forward and weight sync assume whole parameters); use " \
        "training.deepspeed: zero2 or zero3"
_EVAL = "coordexp's evaluation is rollout-based (coordexp eval / eval_steps) and never reads it"
_HUB = "coordexp does not push checkpoints to the Hub (and a token never belongs in a config); upload " \
       "training.output_dir yourself"

REFUSED: dict[str, tuple[str, str]] = {
    # name: (why coordexp refuses it, what to do instead)
    "remove_unused_columns": ("coordexp's collator needs the raw detection records, so columns are never removed",
                              "Remove it."),
    "label_names": ("coordexp builds its own targets; the loss never reads a labels column", "Remove it."),
    "use_cpu": ("coordexp trains on CPU exactly when no CUDA device is visible", "Remove it (hide the GPUs with "
                "CUDA_VISIBLE_DEVICES= to train on CPU)."),
    "ddp_backend": ("coordexp picks nccl on GPU and gloo on CPU", "Remove it."),
    "disable_tqdm": ("coordexp prints its own progress line", "Remove it."),
    "local_rank": ("torchrun sets the rank through the environment", "Remove it."),
    "do_train": ("the command decides (coordexp train / eval); Trainer never reads it", "Remove it."),
    "do_eval": ("the command decides (coordexp train / eval); Trainer never reads it", "Remove it."),
    "do_predict": ("the command decides (coordexp train / eval); Trainer never reads it", "Remove it."),
    "resume_from_checkpoint": ("resuming is a launch choice, not a config value", "Pass --resume to coordexp "
                               "train."),
    "gradient_checkpointing": ("model.gradient_checkpointing owns it (one owner per setting)",
                               "Set model.gradient_checkpointing instead."),
    "gradient_checkpointing_kwargs": ("coordexp enables gradient checkpointing itself "
                                      "(model.gradient_checkpointing)", "Remove it."),
    "fsdp": (_FSDP, "Remove it."),
    "fsdp_config": (_FSDP, "Remove it."),
    "accelerator_config": ("coordexp's dataloader and loss assume accelerate's defaults", "Remove it."),
    "parallelism_config": ("tensor/context parallelism is not supported", "Remove it."),
    "use_liger_kernel": ("Liger patches the model forward, which coordexp replaces with its packed forward and "
                         "supervised-positions LM head", "Remove it."),
    "liger_kernel_config": ("Liger kernels are not supported (see use_liger_kernel)", "Remove it."),
    "label_smoothing_factor": ("coordexp computes its own objective (rollout_matching.pipeline)", "Remove it."),
    "average_tokens_across_devices": ("coordexp normalises its loss by its own denominators across ranks",
                                      "Remove it."),
    "include_num_input_tokens_seen": ("the inputs are detection records, not token tensors; coordexp logs "
                                      "trained tokens itself", "Remove it."),
    "auto_find_batch_size": ("it changes per_device_train_batch_size mid-run, under the carry buffer and the "
                             "rollout seeds", "Remove it."),
    "neftune_noise_alpha": ("noise on the input embeddings is not validated with coordexp's packed forward",
                            "Remove it."),
    "train_sampling_strategy": ("coordexp's dataset has no length column; the order is random from "
                                "training.seed", "Remove it."),
    "length_column_name": ("coordexp's dataset has no length column", "Remove it."),
    "optim_args": ("training.optim is limited to optimizers that take no extra arguments", "Remove it."),
    "optim_target_modules": ("it configures GaLore/APOLLO optimizers, which training.optim does not offer",
                             "Remove it."),
    "prediction_loss_only": (_EVAL, "Remove it."),
    "load_best_model_at_end": ("HF reloads the best checkpoint with its own loader, which does not map a Qwen-VL "
                               "checkpoint's saved names (docs/design.md, decision 14)",
                               "Remove it; training.metric_for_best_model with save_total_limit keeps the best "
                               "checkpoint, and coordexp eval --checkpoint scores any of them."),
    "eval_do_concat_batches": (_EVAL, "Remove it."),
    "eval_use_gather_object": (_EVAL, "Remove it."),
    "eval_accumulation_steps": (_EVAL, "Remove it."),
    "include_for_metrics": (_EVAL, "Remove it."),
    "batch_eval_metrics": (_EVAL, "Remove it."),
    "push_to_hub": (_HUB, "Remove it."),
    "hub_token": (_HUB, "Remove it."),
    "hub_private_repo": (_HUB, "Remove it."),
    "hub_model_id": (_HUB, "Remove it."),
    "hub_strategy": (_HUB, "Remove it."),
    "hub_always_push": (_HUB, "Remove it."),
    "hub_revision": (_HUB, "Remove it."),
    "debug": ("TPU/underflow debugging modes are not supported", "Remove it."),
    "trackio_static_space_id": ("trackio static spaces are not supported", "Remove it."),
}
"""Fields coordexp refuses, each with the reason and a fix; a field of a type YAML cannot write that is neither
here nor owned is refused too, naming its type."""

# tighter caps than the generic ones (ints and floats in [min(0, default), 2**53])
_BOUNDS: dict[str, Any] = {
    "dataloader_prefetch_factor": int_in(1, 1024),
    "ddp_timeout": int_in(1, int(MAX_SECONDS)),
    "ddp_bucket_cap_mb": int_in(1, 1 << 20),
    "torch_empty_cache_steps": int_in(1, MAX_COUNT),
    "data_seed": int_in(0, MAX_SEED),
    # Adam divides by sqrt(v) + eps: eps 0 makes every zero-gradient entry 0/0 = NaN (an unused embedding row
    # is enough), and a subnormal eps can do the same in bf16 optimizer states.
    "adam_epsilon": float_in(ge=1e-20, le=1.0),
    # accelerate's DynamoBackend names (any case, as accelerate upper-cases them); anything else fails when the
    # Trainer builds its accelerator, after the model has loaded
    "torch_compile_backend": Annotated[Literal[COMPILE_BACKENDS], BeforeValidator(  # type: ignore[valid-type]
        lambda value: value.lower() if isinstance(value, str) else value)],
    # the start methods torch's DataLoader accepts (multiprocessing.get_all_start_methods() on Linux and macOS)
    "dataloader_multiprocessing_context": Literal["fork", "spawn", "forkserver"],
}
_MAX_STR = 4096


class _Unset:
    """Default of a refused field: distinguishes "not written" from any written value, null included."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET = _Unset()


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("a value cannot contain a NUL byte (\\x00)")
    return value


def _annotation(name: str, kind: str, optional: bool, default: Any, choices: tuple) -> Any:
    if name in _BOUNDS:
        base = _BOUNDS[name]
    elif kind == "bool":
        base = bool
    elif kind == "int":
        base = int_in(min(0, default or 0), MAX_COUNT)
    elif kind == "float":
        base = float_in(ge=min(0.0, float(default or 0.0)), le=float(MAX_COUNT))
    elif kind == "str":
        base = Annotated[str, Field(min_length=1, max_length=_MAX_STR), AfterValidator(_no_nul)]
    elif kind == "choice":
        base = Literal[choices]  # type: ignore[valid-type]
    elif kind == "str_list":
        base = Annotated[list[Annotated[str, Field(min_length=1, max_length=_MAX_STR)]], Field(max_length=256)]
    else:
        raise ValueError(f"{name}: {kind} is not a YAML-writable kind")
    return Optional[base] if optional else base


def passthrough_fields(owned: set[str]) -> dict[str, tuple[Any, Any]]:
    """``create_model`` field definitions of every HF field that is neither owned nor refused (HF's default)."""
    out: dict[str, tuple[Any, Any]] = {}
    for name, (kind, optional, default, choices, help_text) in HF_TRAINING_FIELDS.items():
        if name in owned or name in REFUSED or kind.startswith("unsupported"):
            continue
        value = list(default) if isinstance(default, list) else default
        out[name] = (_annotation(name, kind, optional, default, choices),
                     Field(value, description=f"transformers TrainingArguments.{name}: {help_text}"))
    return out


def _refuser(name: str, reason: str, hint: str):
    def refuse(value: Any) -> Any:
        if value is UNSET:
            return value
        raise ConfigRuleError([RuleViolation("", f"coordexp does not take this TrainingArguments field: {reason}", hint)])

    return refuse


def refused_fields(owned: set[str]) -> dict[str, tuple[Any, Any]]:
    """Fields that fail when written at all (any value, null included), with the reason; hidden from the JSON
    schema and from dumps (the run contract)."""
    out: dict[str, tuple[Any, Any]] = {}
    for name, (kind, _optional, _default, _choices, _help) in HF_TRAINING_FIELDS.items():
        if name in owned:
            continue
        if name in REFUSED:
            reason, hint = REFUSED[name]
        elif kind.startswith("unsupported"):
            reason, hint = f"its type ({kind.split(': ', 1)[1]}) cannot be written in a coordexp config", "Remove it."
        else:
            continue
        out[name] = (Annotated[SkipJsonSchema[Any], AfterValidator(_refuser(name, reason, hint))],
                     Field(UNSET, exclude=True))
    return out
