"""Loading a policy checkpoint (model + processor with coord tokens) and writing checkpoints back: one path for
the tiny offline model and a real Qwen-VL checkpoint."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coordexp.errors import UserInputError
from coordexp.runtime.core.tokens import CoordVocab
from coordexp.runtime.model.encoding import load_processor

if TYPE_CHECKING:
    from coordexp.schema.contract import RunContract

logger = logging.getLogger("coordexp.tuner")

__all__ = ["LaunchError", "PROCESSOR_CLASS_NAMES", "SUPPORTED_FAMILIES", "checkpoint_family", "load_policy",
           "make_processor", "save_processor", "first_non_finite"]

PROCESSOR_CLASS_NAMES = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor",
                         "qwen3_vl": "Qwen3VLProcessor"}
_VIDEO_PROCESSOR_CLASS_NAMES = {"qwen2_vl": "Qwen2VLVideoProcessor", "qwen2_5_vl": "Qwen2VLVideoProcessor",
                                "qwen3_vl": "Qwen3VLVideoProcessor"}
SUPPORTED_FAMILIES: tuple[str, ...] = tuple(PROCESSOR_CLASS_NAMES)
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


class LaunchError(UserInputError, RuntimeError):
    """The run cannot start (missing model or data, a checkpoint without coord tokens, ...); the text says why."""


def checkpoint_family(model_dir: str | Path) -> str:
    """The ``model_type`` in ``model_dir/config.json`` after checking coordexp supports it (a :class:`LaunchError`
    naming the supported families otherwise): read before any weight is loaded."""
    config_file = Path(model_dir) / "config.json"
    try:
        family = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        raise LaunchError(f"{config_file}: cannot read the model config ({exc}); point model.path at a checkpoint "
                          "saved with save_pretrained") from None
    if family not in SUPPORTED_FAMILIES:
        raise LaunchError(f"{model_dir}: model_type {family!r} is not a supported Qwen-VL family; coordexp trains "
                          f"{', '.join(SUPPORTED_FAMILIES)} (Qwen2-VL, Qwen2.5-VL, Qwen3-VL checkpoints)")
    return family


def load_policy(run: "RunContract", *, adapter: str | Path | None = None) -> tuple[Any, Any]:
    """``(model, processor)`` from ``model.path`` with ``tuner.*`` applied (frozen parts, or a fresh PEFT adapter);
    the tokenizer must already hold the 1000 coord tokens. ``adapter`` (or a ``model.path`` that is a saved
    adapter directory): load its base, then that adapter (trainable under ``train_type: lora``, merged into the
    base under ``full``)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from coordexp.runtime.model.adapters import adapter_base, attach_adapter, is_adapter_dir
    from coordexp.runtime.model.tuner import align_tie_flag, apply_tuner

    cfg = run.model
    if adapter is None and is_adapter_dir(cfg.path):
        adapter = cfg.path
    fallback = None if adapter is None or str(adapter) == cfg.path else cfg.path
    base = cfg.path if adapter is None else adapter_base(adapter, fallback)
    path = Path(base)
    if base.startswith(("/", ".", "~")) and not path.is_dir():
        raise LaunchError(
            f"model.path {base} does not exist; build the tiny model with `coordexp make-tiny-model {base}` "
            "or point model.path at a local checkpoint"
        )
    from coordexp.runtime.model.checkpoint_files import check_adapter_dir, check_model_dir

    if adapter is not None:
        check_adapter_dir(adapter)  # broken files: a clear exit 2 here, not an exception inside transformers
    if path.is_dir():
        check_model_dir(path, families=SUPPORTED_FAMILIES)
        checkpoint_family(path)
    processor = load_processor(base)
    try:
        coord_ids = CoordVocab.from_tokenizer(processor.tokenizer).ids
    except ValueError as exc:
        raise LaunchError(
            f"{base}: {exc}. Add the coord tokens first: `coordexp expand-vocab {base} <new dir>`"
        ) from exc
    try:
        model = AutoModelForImageTextToText.from_pretrained(
            base, dtype=getattr(torch, _DTYPES[cfg.dtype]), attn_implementation=cfg.attn_implementation
        )
    except RuntimeError as exc:  # transformers' only signal for config/weight shape mismatches is this text
        if "ignore_mismatched_sizes" not in str(exc):
            raise
        raise LaunchError(f"{base}: the weights do not have the shapes config.json describes (transformers' "
                          "report above lists them); config.json does not belong to these weights",
                          hint="re-save or re-download the checkpoint") from None
    if adapter is not None:
        align_tie_flag(model)  # PEFT ties saved coord-row tables on this flag
    if adapter is not None and run.tuner.train_type == "lora":
        from coordexp.runtime.model.adapter_speed import peft_model_kwargs, prepare_adapter

        # the saved adapter trains on (its own targets), set up like a new one: adapter dtype, DoRA norm cache
        model = prepare_adapter(attach_adapter(model, adapter, trainable=True,
                                               peft_kwargs=peft_model_kwargs(run.tuner)))
        if run.tuner.trains_coord_rows and not model.peft_config[model.active_adapter].trainable_token_indices:
            logger.warning("%s was saved without trained coord rows, so they stay as in %s (tuner.train_coord_rows "
                           "applies to a new adapter)", adapter, base)
    else:
        if adapter is not None:  # full fine-tuning from an adapter run: start from the merged weights
            model = attach_adapter(model, adapter).merge_and_unload()
        model = apply_tuner(model, run.tuner, coord_ids)
    _refuse_non_finite(model, adapter if adapter is not None else base)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        if hasattr(model, "peft_config"):  # frozen embeddings: checkpointed blocks need an input that wants grad
            model.enable_input_require_grads()
    return model, processor


def first_non_finite(state: dict[str, Any]) -> tuple[str, int] | None:
    """(name, count) of the first floating tensor holding NaN or Inf, else None (every loader's check)."""
    import torch

    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return name, int((~torch.isfinite(tensor)).sum())
    return None


def _refuse_non_finite(model: Any, source: Any) -> None:
    """Every loader refuses NaN or Inf weights (train, eval, probe, serve-rollout): evaluating or serving them would
    report figures of a broken model as a result; a :class:`LaunchError` (exit 2) naming the tensor."""
    bad = first_non_finite(model.state_dict())
    if bad is not None:
        raise LaunchError(f"{source}: tensor {bad[0]} holds {bad[1]} non-finite value(s) (NaN or Inf); nothing was "
                          "trained, evaluated or written", hint="use an intact checkpoint (model.path or --checkpoint)")


def make_processor(family: str, tokenizer: Any, image_processor: Any):
    """The family's processor class around ``tokenizer`` and ``image_processor`` (chat template from the tokenizer)."""
    import transformers

    if family not in PROCESSOR_CLASS_NAMES:
        raise ValueError(f"unknown Qwen-VL family {family!r}; choose one of {sorted(PROCESSOR_CLASS_NAMES)}")
    processor_class = getattr(transformers, PROCESSOR_CLASS_NAMES[family])
    extra = {}
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():  # transformers 5 then requires the video processor too
        video_processor_class = getattr(transformers, _VIDEO_PROCESSOR_CLASS_NAMES[family])
        extra["video_processor"] = video_processor_class(
            size=dict(image_processor.size), patch_size=image_processor.patch_size,
            temporal_patch_size=image_processor.temporal_patch_size, merge_size=image_processor.merge_size)
    return processor_class(image_processor=image_processor, tokenizer=tokenizer,
                           chat_template=tokenizer.chat_template, **extra)


def save_processor(path: Path, family: str, tokenizer: Any, image_processor: Any) -> None:
    """Save the family's processor; without torchvision (which transformers 5 needs to build any Qwen-VL processor)
    save its parts in the transformers-4 layout, which ``AutoProcessor`` reads back once torchvision is present."""
    try:
        processor = make_processor(family, tokenizer, image_processor)
    except (AttributeError, ImportError, TypeError, ValueError):
        from transformers.utils import is_torchvision_available

        if is_torchvision_available():
            raise
        processor = None
    if processor is not None:
        processor.save_pretrained(str(path))
        return
    tokenizer.save_pretrained(str(path))
    image_processor.save_pretrained(str(path))
    config_file = Path(path) / "preprocessor_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["processor_class"] = PROCESSOR_CLASS_NAMES[family]
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
