"""Qwen-VL multimodal rope (M-RoPE) positions of ONE sample, computed by the model's own ``get_rope_index``.

Packing needs the positions each sample would get if it were run alone; calling the model's rope-index logic on
each sample separately (rather than re-implementing it) keeps packed positions identical to unpacked ones for
every Qwen-VL family and transformers version that exposes ``get_rope_index``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from coordexp.errors import UserInputError

if TYPE_CHECKING:
    import torch

__all__ = ["MROPE_MODEL_TYPES", "MropeIndex", "PackingError", "model_type_of", "mrope_index_of"]

# Families whose language model takes (4, B, T) position ids: text positions first (they drive the packed
# sequence mask and the flash-attention varlen split), then the three M-RoPE rows (transformers >= 5).
MROPE_MODEL_TYPES: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")

# (input_ids (L,), mm_token_type_ids (L,), image_grid_thw (n_images, 3) or None) -> positions (3, L) int64
MropeIndex = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor | None"], "torch.Tensor"]


class PackingError(UserInputError, ValueError):
    """Samples cannot be laid out in a packed/padded batch, or the model cannot run the packed layout."""


def model_type_of(model: Any) -> str:
    """The ``model_type`` of a Qwen-VL model, after checking it is a family whose packing contract is known."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in MROPE_MODEL_TYPES:
        raise PackingError(
            f"packing supports the Qwen-VL families {list(MROPE_MODEL_TYPES)} (their language model reads text "
            f"positions from (4, B, T) position ids); got model_type {model_type!r}. Use an unpacked (padded) "
            "forward for other models"
        )
    return model_type


def _rope_owner(model: Any) -> Any:
    """The module that implements ``get_rope_index`` (``Qwen2VLModel``; the ForConditionalGeneration wraps it, and a
    PEFT model wraps that: ``get_base_model`` unwraps it)."""
    if callable(getattr(model, "get_base_model", None)):
        model = model.get_base_model()
    for candidate in (model, getattr(model, "model", None)):
        if candidate is not None and callable(getattr(candidate, "get_rope_index", None)):
            return candidate
    raise PackingError(
        f"{type(model).__name__} has no get_rope_index (nor has its .model); M-RoPE positions cannot be computed "
        "with the model's own logic"
    )


def mrope_index_of(model: Any) -> MropeIndex:
    """A function giving one sample's ``(3, L)`` M-RoPE positions exactly as ``model`` computes them for that
    sample alone (batch of one, no padding). Raises :class:`PackingError` for an unsupported model."""
    import torch

    model_type_of(model)
    owner = _rope_owner(model)
    merge = int(model.config.vision_config.spatial_merge_size)
    image_token_id = int(model.config.image_token_id)

    def rope_index(input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor,
                   image_grid_thw: torch.Tensor | None) -> torch.Tensor:
        if input_ids.ndim != 1 or input_ids.shape != mm_token_type_ids.shape:
            raise PackingError(
                f"one sample's input_ids and mm_token_type_ids must be 1-D of equal length (got "
                f"{tuple(input_ids.shape)} and {tuple(mm_token_type_ids.shape)})"
            )
        grid = None if image_grid_thw is None or image_grid_thw.numel() == 0 else image_grid_thw.reshape(-1, 3)
        expected = 0 if grid is None else int((grid.prod(dim=1) // (merge * merge)).sum())
        typed = int((mm_token_type_ids == 1).sum())
        placeholders = int((input_ids == image_token_id).sum())
        if not typed == placeholders == expected:
            raise PackingError(
                f"a sample has {placeholders} image placeholder ids and {typed} image-typed positions but its "
                f"image_grid_thw {None if grid is None else grid.tolist()} needs {expected}; encode it with "
                "coordexp.runtime.model.encoding.encode_teacher_forced (which expands each image to its grid)"
            )
        with torch.no_grad():
            device = input_ids.device
            positions, _ = owner.get_rope_index(
                input_ids[None],
                mm_token_type_ids=mm_token_type_ids[None],
                image_grid_thw=None if grid is None else grid.to(device),
            )
        return positions[:, 0].to(torch.long)

    return rope_index
