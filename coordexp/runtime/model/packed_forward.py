"""Padding-free packed teacher-forced forward for Qwen-VL, and the padded (unpacked) forward it must equal.

A packed batch is ONE row: the samples' ids back to back, their images in the same order, and positions that
restart at every segment (the M-RoPE rows from the model's own ``get_rope_index`` per sample, plus plain text
positions). Attention is block-diagonal and causal within each segment, so each segment's logits equal those of
the sample run alone (docs/design.md, decision 8: a packed row's loss equals its segments' loss unpacked):

* ``sdpa`` / ``eager``: an explicit 4-D mask ``(1, 1, T, T)`` (bool for sdpa, additive float for eager), which
  transformers' mask creation passes through unchanged. On CPU the sdpa mask is tagged with its block sizes, and
  the sdpa function of ``segment_attention`` then runs causal sdpa per segment (no cross-segment FLOPs).
* flash attention: no mask; the language model gets ``(4, 1, T)`` position ids whose text row restarts at 0 per
  segment, from which transformers derives ``cu_seqlens`` and calls the varlen kernel (its documented
  padding-free path for Qwen-VL).

The explicit mask costs ``T * T`` bytes (sdpa) or ``4 * T * T`` (eager, float32): 64 MiB / 256 MiB at T = 8192,
fine for CPU rows; long GPU rows use flash attention, which needs no mask.

Usage: ``batch = collate_packed(samples, mrope_index_of(model))``, then ``SupervisionSegment(sup, ids,
*batch.placement(i))`` per sample and ``compute_objective(packed_forward(model, batch), ...)``.

The vision tower already attends within each image only (its ``cu_seqlens`` come from ``image_grid_thw``), so
concatenating the pixel values of several samples changes no image feature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from coordexp.runtime.model.mrope import MropeIndex, PackingError, model_type_of, mrope_index_of
from coordexp.runtime.model.segment_attention import install_segment_sdpa, mark_block_causal

if TYPE_CHECKING:
    import torch

    from coordexp.runtime.model.encoding import EncodedSample

__all__ = [
    "PackingError",
    "PackedBatch",
    "PaddedBatch",
    "mrope_index_of",
    "collate_packed",
    "collate_padded",
    "block_causal_mask",
    "attention_implementation",
    "packed_model_inputs",
    "packed_forward",
    "padded_forward",
]

_EXPLICIT_MASK_IMPLEMENTATIONS = ("sdpa", "eager")


@dataclass(frozen=True)
class PackedBatch:
    """Several samples in one padding-free row. Segment ``i`` occupies ``[segment_offsets[i], +segment_lengths[i])``;
    an optional pad tail (``num_pad`` tokens, its own attention block) follows the last segment."""

    input_ids: "torch.Tensor"  # int64 (1, T)
    mm_token_type_ids: "torch.Tensor"  # int64 (1, T)
    position_ids: "torch.Tensor"  # int64 (3, 1, T): M-RoPE rows, each segment as if alone
    text_position_ids: "torch.Tensor"  # int64 (1, T): 0..len-1 per segment (and per pad tail)
    pixel_values: "torch.Tensor | None"  # (sum of patches, patch_dim), samples in order
    image_grid_thw: "torch.Tensor | None"  # int64 (n_images, 3), samples in order
    segment_offsets: tuple[int, ...]
    segment_lengths: tuple[int, ...]
    prompt_lens: tuple[int, ...]
    assistant_starts: tuple[int, ...]  # within each segment (== prompt_len for teacher-forced samples)
    num_pad: int

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_segments(self) -> int:
        return len(self.segment_offsets)

    @property
    def num_real_tokens(self) -> int:
        return sum(self.segment_lengths)

    @property
    def num_token_slots(self) -> int:
        """Positions the forward computes (real tokens plus the pad tail)."""
        return self.seq_len

    def placement(self, index: int) -> tuple[int, int]:
        """``(row, absolute assistant start)`` of sample ``index``, the last two fields of a ``SupervisionSegment``."""
        return 0, self.segment_offsets[index] + self.assistant_starts[index]

    def block_ids(self) -> "torch.Tensor":
        """``(T,)`` attention block of every position: the segment index, or ``num_segments`` for the pad tail."""
        import torch

        sizes = list(self.segment_lengths) + ([self.num_pad] if self.num_pad else [])
        return torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))


@dataclass(frozen=True)
class PaddedBatch:
    """One right-padded row per sample (the unpacked layout); ``attention_mask`` is 0 on padding."""

    input_ids: "torch.Tensor"  # int64 (B, T)
    attention_mask: "torch.Tensor"  # int64 (B, T)
    mm_token_type_ids: "torch.Tensor"  # int64 (B, T)
    position_ids: "torch.Tensor"  # int64 (3, B, T): per-row M-RoPE, 0 on padding (as get_rope_index does)
    pixel_values: "torch.Tensor | None"
    image_grid_thw: "torch.Tensor | None"
    lengths: tuple[int, ...]
    prompt_lens: tuple[int, ...]
    assistant_starts: tuple[int, ...]

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_real_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def num_token_slots(self) -> int:
        """Positions the forward computes: every row padded to the longest."""
        return int(self.input_ids.numel())

    def placement(self, index: int) -> tuple[int, int]:
        """``(row, absolute assistant start)`` of sample ``index``."""
        return index, self.assistant_starts[index]


def _checked_samples(samples: Sequence["EncodedSample"]) -> list["EncodedSample"]:
    samples = list(samples)
    if not samples:
        raise PackingError("no samples to collate; a micro-batch needs at least one encoded sample")
    for i, sample in enumerate(samples):
        n = sample.input_ids.shape[0] if sample.input_ids.ndim == 1 else -1
        if n < 1 or sample.mm_token_type_ids.shape != sample.input_ids.shape:
            raise PackingError(
                f"sample {i}: input_ids must be 1-D and non-empty with mm_token_type_ids of the same shape (got "
                f"{tuple(sample.input_ids.shape)} and {tuple(sample.mm_token_type_ids.shape)}); pass EncodedSample "
                "objects from encode_teacher_forced"
            )
        if not 0 < sample.assistant_start <= n:
            raise PackingError(f"sample {i}: assistant_start {sample.assistant_start} is outside (0, {n}]")
        grid = sample.image_grid_thw
        patches = 0 if grid is None or grid.numel() == 0 else int(grid.reshape(-1, 3).prod(dim=1).sum())
        rows = 0 if sample.pixel_values is None else int(sample.pixel_values.shape[0])
        if rows != patches:
            raise PackingError(
                f"sample {i}: pixel_values has {rows} patch rows but image_grid_thw "
                f"{None if grid is None else grid.tolist()} describes {patches}; they must come from the same "
                "image processor call"
            )
    return samples


def _vision_inputs(samples: list["EncodedSample"]) -> tuple["torch.Tensor | None", "torch.Tensor | None"]:
    import torch

    with_images = [s for s in samples if s.image_grid_thw is not None and s.image_grid_thw.numel()]
    if not with_images:
        return None, None
    pixels = torch.cat([s.pixel_values for s in with_images], dim=0)
    grids = torch.cat([s.image_grid_thw.reshape(-1, 3).long() for s in with_images], dim=0)
    return pixels, grids


def _sample_positions(rope_index: MropeIndex, sample: "EncodedSample") -> "torch.Tensor":
    positions = rope_index(sample.input_ids, sample.mm_token_type_ids, sample.image_grid_thw)
    if tuple(positions.shape) != (3, sample.input_ids.shape[0]):
        raise PackingError(
            f"the rope index returned positions of shape {tuple(positions.shape)}, expected (3, "
            f"{sample.input_ids.shape[0]}); pass mrope_index_of(model)"
        )
    return positions


def collate_packed(
    samples: Sequence["EncodedSample"],
    rope_index: MropeIndex,
    *,
    pad_to: int | None = None,
    pad_token_id: int = 0,
) -> PackedBatch:
    """Concatenate ``samples`` into one padding-free row with per-segment positions.

    Args:
        samples: teacher-forced samples (``encode_teacher_forced``), in the order their segments take.
        rope_index: ``mrope_index_of(model)``; positions of each sample are computed for that sample alone.
        pad_to: optional fixed row length (e.g. the packing length); the tail is its own attention block and
            its logits are never supervised. Must be >= the total length.
        pad_token_id: id of the tail tokens; any non-vision id (it is never attended to by real tokens).
    """
    import torch

    samples = _checked_samples(samples)
    lengths = [int(s.input_ids.shape[0]) for s in samples]
    total = sum(lengths)
    if pad_to is not None and pad_to < total:
        raise PackingError(
            f"pad_to={pad_to} is shorter than the {total} tokens of the {len(samples)} segments; raise the packing "
            "length or select fewer segments"
        )
    num_pad = 0 if pad_to is None else pad_to - total
    ids = [s.input_ids.long() for s in samples]
    types = [s.mm_token_type_ids.long() for s in samples]
    mrope = [_sample_positions(rope_index, s) for s in samples]
    text = [torch.arange(n) for n in lengths]
    if num_pad:
        ids.append(torch.full((num_pad,), int(pad_token_id), dtype=torch.long))
        types.append(torch.zeros(num_pad, dtype=torch.long))
        mrope.append(torch.arange(num_pad).expand(3, -1))
        text.append(torch.arange(num_pad))
    offsets = [0]
    for n in lengths[:-1]:
        offsets.append(offsets[-1] + n)
    pixels, grids = _vision_inputs(samples)
    return PackedBatch(
        input_ids=torch.cat(ids)[None],
        mm_token_type_ids=torch.cat(types)[None],
        position_ids=torch.cat(mrope, dim=1)[:, None],
        text_position_ids=torch.cat(text)[None],
        pixel_values=pixels,
        image_grid_thw=grids,
        segment_offsets=tuple(offsets),
        segment_lengths=tuple(lengths),
        prompt_lens=tuple(int(s.prompt_len) for s in samples),
        assistant_starts=tuple(int(s.assistant_start) for s in samples),
        num_pad=num_pad,
    )


def collate_padded(
    samples: Sequence["EncodedSample"],
    rope_index: MropeIndex,
    *,
    pad_to: int | None = None,
    pad_token_id: int = 0,
) -> PaddedBatch:
    """One right-padded row per sample (unpacked mode); ``pad_to`` fixes the row length (>= the longest)."""
    import torch

    samples = _checked_samples(samples)
    lengths = [int(s.input_ids.shape[0]) for s in samples]
    width = max(lengths) if pad_to is None else int(pad_to)
    if width < max(lengths):
        raise PackingError(f"pad_to={pad_to} is shorter than the longest sample ({max(lengths)} tokens)")
    batch = len(samples)
    input_ids = torch.full((batch, width), int(pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    types = torch.zeros((batch, width), dtype=torch.long)
    positions = torch.zeros((3, batch, width), dtype=torch.long)
    for row, (sample, n) in enumerate(zip(samples, lengths, strict=True)):
        input_ids[row, :n] = sample.input_ids
        attention_mask[row, :n] = 1
        types[row, :n] = sample.mm_token_type_ids
        positions[:, row, :n] = _sample_positions(rope_index, sample)
    pixels, grids = _vision_inputs(samples)
    return PaddedBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        mm_token_type_ids=types,
        position_ids=positions,
        pixel_values=pixels,
        image_grid_thw=grids,
        lengths=tuple(lengths),
        prompt_lens=tuple(int(s.prompt_len) for s in samples),
        assistant_starts=tuple(int(s.assistant_start) for s in samples),
    )


def block_causal_mask(block_ids: "torch.Tensor") -> "torch.Tensor":
    """``(1, 1, T, T)`` bool mask, True where query ``q`` may attend key ``k``: ``k <= q`` in the same block."""
    import torch

    same_block = block_ids[:, None] == block_ids[None, :]
    causal = torch.ones(same_block.shape, dtype=torch.bool, device=block_ids.device).tril()
    return (same_block & causal)[None, None]


def attention_implementation(model: Any) -> str:
    """The attention implementation of ``model``'s language model (the one the packed mask is built for)."""
    config = getattr(model.config, "text_config", None) or model.config
    return str(getattr(config, "_attn_implementation", None) or getattr(model.config, "_attn_implementation", ""))


def _check_flash_available(implementation: str) -> None:
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

    available = {"flash_attention_2": is_flash_attn_2_available, "flash_attention_3": is_flash_attn_3_available}
    check = available.get(implementation)
    if check is not None and not check():
        raise PackingError(
            f"the model is set to attn_implementation={implementation!r} but that flash-attention package is not "
            "installed (or no CUDA device is visible); install flash-attn on a GPU machine, or load the model with "
            "attn_implementation='sdpa'"
        )


def _model_device_dtype(model: Any) -> tuple["torch.device", "torch.dtype"]:
    parameter = next(model.parameters())
    return parameter.device, parameter.dtype


def packed_model_inputs(model: Any, batch: PackedBatch) -> dict[str, Any]:
    """The keyword arguments of the ONE packed forward of ``batch`` through ``model`` (see the module docstring)."""
    import torch
    from transformers.utils.generic import is_flash_attention_requested

    model_type_of(model)
    implementation = attention_implementation(model)
    device, dtype = _model_device_dtype(model)
    inputs: dict[str, Any] = {
        "input_ids": batch.input_ids.to(device),
        "mm_token_type_ids": batch.mm_token_type_ids.to(device),
        # text row first: it marks the segment boundaries for transformers' packed-sequence / varlen handling
        "position_ids": torch.cat([batch.text_position_ids[None], batch.position_ids], dim=0).to(device),
        "use_cache": False,
    }
    if batch.pixel_values is not None:
        inputs["pixel_values"] = batch.pixel_values.to(device)
        inputs["image_grid_thw"] = batch.image_grid_thw.to(device)
    if implementation in _EXPLICIT_MASK_IMPLEMENTATIONS:
        allowed = block_causal_mask(batch.block_ids().to(device))
        if implementation == "eager":  # eager adds the mask to the scores
            zero = torch.zeros((), dtype=dtype, device=device)
            allowed = torch.where(allowed, zero, torch.finfo(dtype).min)
        elif device.type == "cpu":  # sdpa runs per segment instead of over the whole row (segment_attention)
            install_segment_sdpa()
            mark_block_causal(allowed, [*batch.segment_lengths, *([batch.num_pad] if batch.num_pad else [])])
        inputs["attention_mask"] = allowed
    elif is_flash_attention_requested(requested_attention_implementation=implementation):
        _check_flash_available(implementation)
        inputs["attention_mask"] = None  # varlen: cu_seqlens from the text position row
    else:
        raise PackingError(
            f"packed forward supports attn_implementation 'sdpa', 'eager' (block-diagonal 4-D mask) or flash "
            f"attention (varlen); the model uses {implementation!r}. Load it with one of those, or train unpacked"
        )
    return inputs


def packed_forward(
    model: Any, batch: PackedBatch, logits_to_keep: "torch.Tensor | None" = None, *, inputs_from: Any = None
) -> "torch.Tensor":
    """Logits ``(1, T, V)`` of the one packed forward; segment ``i``'s logits equal those of the sample alone.
    ``logits_to_keep`` (sorted positions, see ``SupervisionBatch.at_kept_positions``) gives ``(1, K, V)``.
    ``inputs_from``: the model whose config builds the inputs when ``model`` is a wrapper (DDP) without one."""
    inputs = packed_model_inputs(model if inputs_from is None else inputs_from, batch)
    if logits_to_keep is not None:
        inputs["logits_to_keep"] = logits_to_keep.to(inputs["input_ids"].device)
    return model(**inputs).logits


def padded_forward(model: Any, batch: PaddedBatch, logits_to_keep: "torch.Tensor | None" = None) -> "torch.Tensor":
    """Logits ``(B, T, V)`` of the unpacked, right-padded forward (the reference the packed forward must equal);
    ``(B, K, V)`` at the ``logits_to_keep`` positions."""
    device, _ = _model_device_dtype(model)
    inputs: dict[str, Any] = {
        "input_ids": batch.input_ids.to(device),
        "attention_mask": batch.attention_mask.to(device),
        "mm_token_type_ids": batch.mm_token_type_ids.to(device),
        "position_ids": batch.position_ids.to(device),
        "use_cache": False,
    }
    if batch.pixel_values is not None:
        inputs["pixel_values"] = batch.pixel_values.to(device)
        inputs["image_grid_thw"] = batch.image_grid_thw.to(device)
    if logits_to_keep is not None:
        inputs["logits_to_keep"] = logits_to_keep.to(device)
    return model(**inputs).logits
