"""Saved PEFT adapters (``train_type: lora`` output and checkpoints): recognising an adapter directory, finding its
base model and loading base + adapter (``policy.export_merged`` writes the merged plain checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from coordexp.errors import UserInputError

__all__ = ["ADAPTER_CONFIG", "AdapterDirError", "is_adapter_dir", "adapter_base", "attach_adapter"]

ADAPTER_CONFIG = "adapter_config.json"


class AdapterDirError(UserInputError, RuntimeError):
    """A saved adapter cannot be used: unreadable config, not LoRA, or no usable base checkpoint."""


def is_adapter_dir(path: str | Path) -> bool:
    """Whether ``path`` holds a saved PEFT adapter (``adapter_config.json``) rather than a full checkpoint."""
    path = Path(path)
    return (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").is_file()


def _read_adapter_config(adapter_dir: Path) -> dict[str, Any]:
    try:
        config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise AdapterDirError(f"{adapter_dir / ADAPTER_CONFIG}: cannot read the adapter config ({exc})",
                          hint="pass a directory written by a train_type: lora run") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise AdapterDirError(f"{adapter_dir}: adapter_config.json is not a PEFT LoRA adapter config "
                          f"(peft_type {config.get('peft_type') if isinstance(config, dict) else None!r})")
    return config


def adapter_base(adapter_dir: str | Path, fallback: str | Path | None = None) -> str:
    """The base checkpoint of ``adapter_dir``: its ``base_model_name_or_path`` when that is a local checkpoint,
    else ``fallback`` (the config's ``model.path``); a :class:`AdapterDirError` naming both when neither is usable."""
    adapter_dir = Path(adapter_dir)
    recorded = _read_adapter_config(adapter_dir).get("base_model_name_or_path")
    for candidate in (recorded, fallback):
        if candidate and (Path(candidate) / "config.json").is_file():
            return str(candidate)
    if fallback is not None and not str(fallback).startswith(("/", ".", "~")) and not is_adapter_dir(fallback):
        return str(fallback)  # a hub id: from_pretrained resolves it
    raise AdapterDirError(
        f"{adapter_dir} is a LoRA adapter, but its base model {recorded!r} is not a local checkpoint"
        + (f" and neither is {fallback}" if fallback is not None else ""),
        hint="point model.path at the base checkpoint the adapter was trained on")


def attach_adapter(model: Any, adapter_dir: str | Path, *, trainable: bool = False) -> Any:
    """``model`` (the base) wrapped in the PEFT adapter saved in ``adapter_dir``."""
    from peft import PeftModel

    _read_adapter_config(Path(adapter_dir))
    return PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=trainable)
