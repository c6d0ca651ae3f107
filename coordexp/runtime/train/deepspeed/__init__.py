"""The shipped DeepSpeed presets (``training.deepspeed: zero2 | zero3``): JSON files beside this module whose
``"auto"`` values transformers fills from ``TrainingArguments``. They leave out ``optimizer`` and ``scheduler`` so
coordexp's per-part parameter groups and the configured schedule are the ones DeepSpeed wraps."""

from __future__ import annotations

from pathlib import Path

from coordexp.errors import UserInputError

__all__ = ["PRESET_DIR", "preset_names", "resolve_deepspeed"]

PRESET_DIR = Path(__file__).resolve().parent


def preset_names() -> tuple[str, ...]:
    """The presets shipped in the package (the schema's ``DEEPSPEED_PRESETS`` must list the same)."""
    return tuple(sorted(p.stem for p in PRESET_DIR.glob("*.json")))


def resolve_deepspeed(value: str | None) -> str | None:
    """A preset name becomes its packaged JSON path; a path must name an existing file (exit 2 otherwise)."""
    if value is None:
        return None
    if value in preset_names():
        return str(PRESET_DIR / f"{value}.json")
    path = Path(value).expanduser()
    if not path.is_file():
        raise UserInputError(f"training.deepspeed: {value} is not a file",
                             hint=f"Point it at a DeepSpeed JSON config, or use a preset: {', '.join(preset_names())}.")
    return str(path)
