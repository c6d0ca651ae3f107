"""The content of a ``training.deepspeed`` JSON file, checked at ``validate`` (before any model loads) the way
transformers' ``HfTrainerDeepSpeedConfig.trainer_config_process`` and DeepSpeed's own config would refuse it at
launch: a JSON object, ZeRO stage 0..3 read as DeepSpeed reads it (``"3"`` and ``3.0`` are stage 3), batch sizes,
accumulation, clipping and precision equal to the training block (``"auto"`` agrees), and what coordexp refuses
itself: ``optimizer`` / ``scheduler`` blocks (they would replace coordexp's per-part parameter groups and the
configured schedule) and NVMe offload to a path DeepSpeed cannot make a folder (docs/design.md, "Hostile input, round
five"; a folder that does not exist yet is created by DeepSpeed). The shipped presets (``zero2``, ``zero3``) are read
from the package and checked the same way (:func:`preset_json_path`).
tests/schema/test_deepspeed_file.py keeps :func:`transformers_mismatches` equal to transformers' verdict."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any, Optional

from coordexp.schema.errors import RuleViolation
from coordexp.schema.file_read import FileReadError, read_json_file

__all__ = ["read_deepspeed_json", "deepspeed_stage", "transformers_mismatches", "content_violations",
           "preset_json_path"]

_WHERE = "training.deepspeed"
_AUTO_HINT = 'Set it to "auto" (filled from the training block at launch), or make the two equal.'
_OFFLOAD_DEVICES = ("none", "cpu", "nvme")
_INT_TEXT = re.compile(r"([+-]?[0-9]+)(?:\.0+)?", re.ASCII)
_HALF_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def preset_json_path(name: str) -> Path:
    """The JSON file of the shipped preset ``name`` (``zero2``: ``coordexp/runtime/train/deepspeed/zero2.json``), a
    data file read here without importing the runtime (the schema imports nothing from it)."""
    return Path(__file__).resolve().parent.parent / "runtime" / "train" / "deepspeed" / f"{name}.json"


def read_deepspeed_json(path: str) -> Any:
    """The parsed JSON of ``path`` (bounded: :func:`coordexp.schema.file_read.read_json_file`)."""
    return read_json_file(Path(path).expanduser())


def deepspeed_stage(value: Any) -> Optional[int]:
    """``zero_optimization.stage`` as DeepSpeed's pydantic config reads it (lax mode): a bool is 0/1, an integral
    float or numeric string its integer; None when DeepSpeed would refuse it (or it is not 0..3)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, str):  # pydantic's lax str -> int: optional sign, ASCII digits, a ".000" tail
        match = _INT_TEXT.fullmatch(value.strip(" \t\n\r\f\v"))
        value = int(match.group(1)) if match else None
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            return None
        value = int(value)
    return value if isinstance(value, int) and 0 <= value <= 3 else None


def _node(config: dict, dotted: str) -> Any:
    """``config``'s value at ``a.b`` (None when a level is missing), as transformers' ``get_value`` reads it."""
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def transformers_mismatches(config: dict, training: Any, *, world_size: Optional[int]) -> list[tuple[str, Any, Any]]:
    """``(key, ds value, training value)`` for each value transformers' ``trainer_config_process`` calls a mismatch
    (a value other than ``"auto"`` that is ``!=`` the training block's). With ``world_size`` None (``validate`` does
    not know the launch's) ``train_batch_size`` need only be a multiple of micro batch * accumulation."""
    micro, accumulation = training.per_device_train_batch_size, training.gradient_accumulation_steps
    effective = getattr(training, "effective_batch_size", None)
    bf16 = bool(getattr(training, "bf16", False) or getattr(training, "bf16_full_eval", False))
    fp16 = bool(getattr(training, "fp16", False) or getattr(training, "fp16_full_eval", False))
    expected = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation,
                "gradient_clipping": training.max_grad_norm, "fp16.enabled": fp16, "bf16.enabled": bf16}
    if world_size is not None:
        expected["train_batch_size"] = world_size * micro * accumulation
    elif effective is not None:  # accumulation resolves from the world size: the product is the effective size
        expected["train_batch_size"] = effective
        del expected["gradient_accumulation_steps"]  # content_violations asks for "auto"
    out = [(key, _node(config, key), want) for key, want in expected.items()
           if _node(config, key) not in (None, "auto") and _node(config, key) != want]
    batch = config.get("train_batch_size")
    if world_size is None and effective is None and batch not in (None, "auto"):
        if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0 or batch % (micro * accumulation):
            out.append(("train_batch_size", batch, f"a multiple of {micro * accumulation}"))
    return out


def _malformed_sections(config: dict, shown: str) -> list[RuleViolation]:
    """The sections transformers and DeepSpeed read fields of, when one is not an object (nothing inside is read)."""
    return [RuleViolation(_WHERE, f"{shown}: {key} is {type(config[key]).__name__}, not an object (DeepSpeed and "
                          "transformers read its fields)", f"Write {key}: {{...}}.")
            for key in ("zero_optimization", "bf16", "fp16") if key in config and not isinstance(config[key], dict)]


_REPLACED_BLOCKS = (
    ("optimizer", "coordexp's per-part parameter groups (learning_rate, vit_lr, aligner_lr, tuner.coord_embed_lr)"),
    ("scheduler", "the configured schedule (lr_scheduler_type, warmup, min_lr)"),
)


def _replacing_blocks(config: dict, shown: str) -> list[RuleViolation]:
    return [RuleViolation(_WHERE, f"{shown}: the {key} block would replace {why}",
                          f"Remove {key} from the DeepSpeed file; set it in the training block instead.")
            for key, why in _REPLACED_BLOCKS if key in config]


def _offload_violations(zero: dict, shown: str) -> list[RuleViolation]:
    out = []
    for key in ("offload_optimizer", "offload_param"):
        block = zero.get(key)
        if block is None:
            continue
        if not isinstance(block, dict):
            out.append(RuleViolation(_WHERE, f"{shown}: zero_optimization.{key} is not an object",
                                     f"Write {key}: {{device: cpu}}."))
            continue
        device = block.get("device", "none")
        if device not in _OFFLOAD_DEVICES:
            out.append(RuleViolation(_WHERE, f"{shown}: zero_optimization.{key}.device is {device!r}",
                                     f"Use one of {', '.join(_OFFLOAD_DEVICES)}."))
        elif device == "nvme":
            nvme = block.get("nvme_path")
            problem = _nvme_folder_problem(nvme)
            if problem:
                out.append(RuleViolation(_WHERE, f"{shown}: zero_optimization.{key} offloads to NVMe at "
                                         f"{str(nvme)[:200]!r}, {problem}",
                                         "Set nvme_path to a folder on a local NVMe drive, or use device: cpu."))
    return out


def _nvme_folder_problem(nvme: Any) -> str:
    """Why DeepSpeed could not use ``nvme_path`` as its swap folder ("" when it can): it creates the folder (and
    missing parents) itself, so a path that does not exist yet is fine when its nearest existing ancestor is a
    folder; a file there, or on the way, is not."""
    if not isinstance(nvme, str) or not nvme.strip():
        return "which is not a folder path"
    try:
        path = Path(nvme).expanduser().absolute()
        if path.exists():
            return "" if path.is_dir() else "which is not a folder"
        for parent in path.parents:
            if parent.exists():
                if not parent.is_dir():
                    return f"which cannot be created ({str(parent)[:200]} is not a folder)"
                writable = os.access(parent, os.W_OK | os.X_OK)
                return "" if writable else f"which cannot be created ({str(parent)[:200]} is not writable here)"
    except (OSError, ValueError) as exc:
        return f"which cannot be used ({getattr(exc, 'strerror', None) or exc})"
    return ""


def _precision_violations(config: dict, training: Any, model_dtype: str, shown: str) -> list[RuleViolation]:
    enabled = {}
    for key in ("bf16", "fp16"):
        value = _node(config, f"{key}.enabled")
        hf = bool(getattr(training, key, False) or getattr(training, f"{key}_full_eval", False))
        enabled[key] = hf if value == "auto" else (value is True)
    if enabled["bf16"] and enabled["fp16"]:
        return [RuleViolation(_WHERE, f"{shown}: bf16 and fp16 are both enabled (DeepSpeed refuses both)",
                              "Enable one of them.")]
    return [RuleViolation(_WHERE, f"{shown}: {key}.enabled makes DeepSpeed cast the model to {_HALF_DTYPES[key]}, "
                          f"but model.dtype is {model_dtype}", f"Set model.dtype: {_HALF_DTYPES[key]}, or " + (
                              f"training.{key}: false (the DeepSpeed {key}.enabled is \"auto\")"
                              if _node(config, f"{key}.enabled") == "auto" else
                              f"{key}.enabled: false in the DeepSpeed file") + ".")
            for key in ("bf16", "fp16") if enabled[key] and model_dtype != _HALF_DTYPES[key]]


def content_violations(config: Any, training: Any, *, model_dtype: str, shown: str) -> list[RuleViolation]:
    """Every refusal of the DeepSpeed ``config`` (read from the file ``shown``) with this training block."""
    if not isinstance(config, dict):
        return [RuleViolation(_WHERE, f"{shown} holds {type(config).__name__}, not a JSON object",
                              "Write a DeepSpeed config object, e.g. {\"zero_optimization\": {\"stage\": 2}}.")]
    malformed = _malformed_sections(config, shown)
    out = malformed + _replacing_blocks(config, shown)
    if malformed:  # the checks below read inside these sections
        return out
    zero = config.get("zero_optimization", {})
    if "stage" in zero and deepspeed_stage(zero["stage"]) is None:
        out.append(RuleViolation(_WHERE, f"{shown}: zero_optimization.stage is {str(zero['stage'])[:50]!r}; "
                                 "DeepSpeed has stages 0, 1, 2 and 3", "Use stage 2 or 3."))
    elif "stage" in zero and type(zero["stage"]) is not int:  # transformers' is_zero3() compares with the int 3
        out.append(RuleViolation(_WHERE, f"{shown}: zero_optimization.stage is {zero['stage']!r}: DeepSpeed reads it "
                                 f"as stage {deepspeed_stage(zero['stage'])}, transformers only an integer, so the "
                                 "two would disagree (e.g. on ZeRO-3's partitioned loading and saving)",
                                 f"Write the integer: \"stage\": {deepspeed_stage(zero['stage'])}."))
    out += _offload_violations(zero, shown)
    for key, value, want in transformers_mismatches(config, training, world_size=None):
        field = _TRAINING_NAMES.get(key, key)
        out.append(RuleViolation(_WHERE, f"{shown}: {key} is {str(value)[:50]} but {field} is {want} "
                                 "(transformers refuses the mismatch when training starts)", _AUTO_HINT))
    if getattr(training, "effective_batch_size", None) is not None and config.get(
            "gradient_accumulation_steps") not in (None, "auto"):
        out.append(RuleViolation(_WHERE, f"{shown}: gradient_accumulation_steps is set, but "
                                 "training.effective_batch_size resolves it from the world size at launch",
                                 'Set gradient_accumulation_steps: "auto".'))
    return out + _precision_violations(config, training, model_dtype, shown)


_TRAINING_NAMES = {
    "train_micro_batch_size_per_gpu": "training.per_device_train_batch_size",
    "gradient_accumulation_steps": "training.gradient_accumulation_steps",
    "train_batch_size": "per_device_train_batch_size * gradient_accumulation_steps * world size, so it must be",
    "gradient_clipping": "training.max_grad_norm",
    "bf16.enabled": "training.bf16 (or bf16_full_eval)",
    "fp16.enabled": "training.fp16 (or fp16_full_eval)",
}


def load_violations(path: str) -> tuple[Any, Optional[list[RuleViolation]]]:
    """The parsed file and ``[]``, or None and the read problem at ``training.deepspeed``; ``(None, None)`` for a
    path to nothing, no problem here (validate may run where the run's files are not: the launch refuses it, as it
    does a missing data file)."""
    if not os.path.lexists(Path(path).expanduser()):
        return None, None
    try:
        return read_deepspeed_json(path), []
    except FileReadError as exc:
        return None, [RuleViolation(_WHERE, f"{path[:300]}: {exc.message}", exc.hint)]
