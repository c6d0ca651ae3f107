"""Per-segment causal sdpa for packed rows: attention FLOPs only within segments, not across the whole row.

A packed sdpa row carries a dense ``(1, 1, T, T)`` block-causal bool mask; sdpa with it computes all ``T * T``
scores and throws most away. ``mark_block_causal`` tags that mask with its block sizes, and the ``"sdpa"``
attention function registered here (through transformers' ``AttentionInterface``) runs causal sdpa once per
block on a tagged mask instead. Untagged masks (padded rows, the vision tower, other models) go to transformers'
own sdpa unchanged, so registering is safe process-wide; an untagged CPU mask that is exactly block-causal over
the runs of consecutive ``position_ids`` (as transformers infers for packed rows) is tagged on first use. The tag
is tensor metadata read per call, so it works for every caller of ``packed_model_inputs`` without switching the
model's attention implementation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import torch

__all__ = ["block_sizes_of", "mark_block_causal", "segment_sdpa_forward", "install_segment_sdpa"]

_BLOCK_SIZES_ATTRIBUTE = "_coordexp_block_sizes"


def mark_block_causal(mask: "torch.Tensor", block_sizes: Sequence[int]) -> "torch.Tensor":
    """Tag ``mask`` (the block-causal mask of consecutive blocks of ``block_sizes``) so sdpa runs per block."""
    sizes = tuple(int(n) for n in block_sizes)
    if any(n < 1 for n in sizes) or sum(sizes) != mask.shape[-1] or mask.shape[-2] != mask.shape[-1]:
        raise ValueError(
            f"block sizes {sizes} must be positive and sum to the mask's square size {tuple(mask.shape[-2:])}; "
            "pass the segment lengths (and the pad tail) of the packed row the mask was built for"
        )
    setattr(mask, _BLOCK_SIZES_ATTRIBUTE, sizes)
    return mask


def block_sizes_of(mask: Any) -> tuple[int, ...] | None:
    """The block sizes a mask was tagged with by ``mark_block_causal``, or None for any other mask."""
    return getattr(mask, _BLOCK_SIZES_ATTRIBUTE, None)


def _verified_block_sizes(mask: Any, position_ids: Any, query: "torch.Tensor") -> tuple[int, ...] | None:
    """Block sizes of an untagged CPU mask that transformers built for a packed row (e.g. from position ids alone),
    accepted only if the mask is exactly block-causal over the runs of consecutive positions; then tagged, so the
    other layers of the same forward skip the ``T * T`` check."""
    import torch

    length = query.shape[2]
    if (
        query.device.type != "cpu"
        or not isinstance(mask, torch.Tensor)
        or mask.dtype != torch.bool
        or tuple(mask.shape) != (1, 1, length, length)
        or not isinstance(position_ids, torch.Tensor)
        or tuple(position_ids.shape) != (1, length)
    ):
        return None
    starts = torch.diff(position_ids[0], prepend=position_ids[0, :1] - 1) != 1
    if not bool(starts.any()):
        return None  # one block: plain causal sdpa over the mask costs the same
    blocks = starts.cumsum(0)
    allowed = (blocks[:, None] == blocks[None, :]) & torch.ones(length, length, dtype=torch.bool).tril()
    if not torch.equal(mask[0, 0], allowed):
        return None
    sizes = tuple(int(n) for n in torch.bincount(blocks))
    mark_block_causal(mask, sizes)
    return sizes


def segment_sdpa_forward(
    module: Any,
    query: "torch.Tensor",
    key: "torch.Tensor",
    value: "torch.Tensor",
    attention_mask: "torch.Tensor | None",
    **kwargs: Any,
) -> tuple["torch.Tensor", None]:
    """Transformers' sdpa, but one causal sdpa call per block when the mask is a tagged block-causal mask."""
    import torch
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    sizes = block_sizes_of(attention_mask)
    if sizes is None:
        sizes = _verified_block_sizes(attention_mask, kwargs.get("position_ids"), query)
    length = query.shape[2]
    if (
        sizes is None
        or key.shape[2] != length
        or sum(sizes) != length
        or not getattr(module, "is_causal", False)
        or kwargs.get("position_bias") is not None
        or kwargs.get("cache") is not None
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    groups = int(getattr(module, "num_key_value_groups", 1) or 1)
    if groups > 1:
        # CPU sdpa's enable_gqa backward is ~2.5x slower per token than on repeated heads (measured on the
        # bench_train_step model); transformers repeats the heads for masked (padded) rows, so both layouts now
        # run the same kernel.
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    dropout, scaling = float(kwargs.get("dropout", 0.0) or 0.0), kwargs.get("scaling")
    outputs, start = [], 0
    for size in sizes:
        block = slice(start, start + size)
        outputs.append(
            torch.nn.functional.scaled_dot_product_attention(
                query[:, :, block], key[:, :, block], value[:, :, block],
                dropout_p=dropout, scale=scaling, is_causal=size > 1,
            )
        )
        start += size
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None  # (batch, len, heads, head_dim)


def install_segment_sdpa() -> None:
    """Register ``segment_sdpa_forward`` as the ``"sdpa"`` attention function (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register("sdpa", segment_sdpa_forward)
