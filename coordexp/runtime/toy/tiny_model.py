"""A tiny, offline, deterministic Qwen-VL checkpoint (real transformers classes) for tests and the CPU demo.

It is saved with ``save_pretrained`` exactly like a real checkpoint, so the trainer loads it through the same
``AutoProcessor`` / ``AutoModelForImageTextToText.from_pretrained`` code path it uses for a 3B model. The init std
is 0.2 (not Qwen's 0.02): with 0.02 a 2-layer model's logits are nearly uniform and it says the same thing for
every image, which would make image-wiring and parity tests meaningless.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

from coordexp.runtime.toy.tiny import (QWEN2_VL_CHAT_TEMPLATE, QWEN3_VL_CHAT_TEMPLATE, QWEN_SPECIAL_TOKENS,
                                       build_tiny_tokenizer)
from coordexp.runtime.core.tokens import CoordVocab
from coordexp.runtime.model.policy import save_processor

__all__ = [
    "TINY_FAMILIES",
    "TINY_MIN_PIXELS",
    "TINY_MAX_PIXELS",
    "TINY_INIT_STD",
    "build_tiny_model",
    "smooth_coord_init_",
    "coord_fourier_features",
    "tiny_model_config",
    "tiny_image_processor",
]

TINY_FAMILIES: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# At most 16 merged image tokens per image: 28x28 pixels make one merged token (patch 14, merge 2); Qwen3-VL's
# patch 16 makes it 32x32.
TINY_MIN_PIXELS = 28 * 28 * 4
TINY_MAX_PIXELS = 28 * 28 * 16
_PATCH_SIZE = {"qwen2_vl": 14, "qwen2_5_vl": 14, "qwen3_vl": 16}
TINY_INIT_STD = 0.2
_HIDDEN = 128
_VOCAB_MULTIPLE = 64


def _padded_vocab(n_tokens: int) -> int:
    return -(-n_tokens // _VOCAB_MULTIPLE) * _VOCAB_MULTIPLE


def _special_ids(tokenizer: Any) -> dict[str, int]:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    unknown = [t for t, i in ids.items() if i is None or i == tokenizer.unk_token_id]
    if unknown:
        raise ValueError(f"tokenizer lacks the Qwen special tokens {unknown}; it cannot drive a Qwen-VL model")
    return ids


def tiny_model_config(
    tokenizer: Any,
    family: str = "qwen2_vl",
    *,
    hidden_size: int = _HIDDEN,
    num_layers: int = 2,
    init_std: float = TINY_INIT_STD,
    vision_init_std: float | None = None,
    rope_theta: float = 10000.0,
    vision_depth: int | None = None,
    vision_width: int = 64,
):
    """The config of the tiny model for ``tokenizer``: hidden 128, 2 layers, 2 heads, 1 KV head, vision depth 1-2.

    ``hidden_size`` (a multiple of 64: heads of 64 dims) and ``num_layers`` scale the language model up, e.g. for
    benchmarks where compute, not Python overhead, should dominate; ``vision_width`` (a multiple of 32) and
    ``vision_depth`` the vision tower, ``rope_theta`` the language model's rotary base (recipe searches,
    docs/design.md, decision 10). ``init_std`` is the weight init std of both
    towers (``vision_init_std``, when given, overrides it for the vision tower): 0.2 keeps random outputs
    image-dependent (tests); the standard 0.02 trains the language model much better (the demo).
    """
    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; choose one of {list(TINY_FAMILIES)}")
    if hidden_size % 64 or hidden_size < 64 or num_layers < 1:
        raise ValueError(f"hidden_size must be a positive multiple of 64 and num_layers >= 1 (got {hidden_size}, {num_layers})")
    if vision_width % 32 or vision_width < 32 or (vision_depth is not None and vision_depth < 1):
        raise ValueError(f"vision_width must be a positive multiple of 32 (heads of 32 dims) and vision_depth >= 1 "
                         f"(got {vision_width}, {vision_depth})")
    if not (math.isfinite(rope_theta) and rope_theta > 1.0):
        raise ValueError(f"rope_theta must be a finite number > 1 (got {rope_theta}); Qwen2-VL's language model uses 1e6")
    vision_std = init_std if vision_init_std is None else vision_init_std
    if not (init_std > 0 and vision_std > 0):
        raise ValueError(f"init stds must be > 0 (got init_std={init_std}, vision_init_std={vision_init_std}); "
                         "0.02 is the usual value, 0.2 the tests' default")
    ids = _special_ids(tokenizer)
    text = dict(
        vocab_size=_padded_vocab(len(tokenizer)),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // 64,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        initializer_range=init_std,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta, "mrope_section": [8, 12, 12]},
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    shared = dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    if family == "qwen2_vl":
        from transformers import Qwen2VLConfig

        vision = dict(depth=vision_depth or 1, embed_dim=vision_width, hidden_size=hidden_size, num_heads=vision_width // 32, mlp_ratio=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, initializer_range=vision_std)
        return Qwen2VLConfig(text_config=text, vision_config=vision, **shared)
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig

        vision = dict(depth=vision_depth or 2, hidden_size=vision_width, intermediate_size=2 * vision_width,
                      num_heads=vision_width // 32, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                      window_size=112, fullatt_block_indexes=[1], initializer_range=vision_std,
                      out_hidden_size=hidden_size)
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **shared)
    return _qwen3_vl_config(text, shared, hidden_size=hidden_size, num_layers=num_layers, vision_std=vision_std,
                            vision_depth=vision_depth or 2, vision_width=vision_width)


def _qwen3_vl_config(text: dict, shared: dict, *, hidden_size: int, num_layers: int, vision_std: float,
                     vision_depth: int, vision_width: int):
    """Qwen3-VL at toy size: head dim 64 with the interleaved M-RoPE sections scaled from the real 128-dim
    [24, 20, 20], Qwen3's q/k norms, a patch-16 vision tower with a learned 16x16 absolute position table
    (interpolated to each image's grid) and DeepStack mergers feeding the first LLM layers (never the last one,
    whose output at image positions no supervised token reads)."""
    from transformers import Qwen3VLConfig

    text = dict(text, head_dim=64, rope_parameters=dict(
        text["rope_parameters"], mrope_section=[12, 10, 10], mrope_interleaved=True))
    deepstack = list(range(max(1, min(2, vision_depth, num_layers - 1))))
    vision = dict(depth=vision_depth, hidden_size=vision_width, intermediate_size=2 * vision_width,
                  num_heads=vision_width // 32, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                  out_hidden_size=hidden_size, num_position_embeddings=256, deepstack_visual_indexes=deepstack,
                  initializer_range=vision_std)
    return Qwen3VLConfig(text_config=text, vision_config=vision, **shared)


def tiny_image_processor(*, min_pixels: int | None = None, max_pixels: int | None = None, family: str = "qwen2_vl"):
    """The family's image processor (Qwen2-VL's class; Qwen3-VL's settings: patch 16, mean/std 0.5) with a small
    pixel budget of 4..16 merged tokens per image by default (the PIL backend when torchvision is absent)."""
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        from transformers import Qwen2VLImageProcessor as image_processor_class
    else:
        from transformers import Qwen2VLImageProcessorPil as image_processor_class
    patch = _PATCH_SIZE[family]
    merged = (2 * patch) ** 2
    extra = dict(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]) if family == "qwen3_vl" else {}
    return image_processor_class(
        size={"shortest_edge": min_pixels or 4 * merged, "longest_edge": max_pixels or 16 * merged},
        patch_size=patch,
        temporal_patch_size=2,
        merge_size=2,
        **extra,
    )


def _model_class(family: str):
    import transformers

    return getattr(transformers, {"qwen2_vl": "Qwen2VLForConditionalGeneration",
                                  "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                                  "qwen3_vl": "Qwen3VLForConditionalGeneration"}[family])


def build_tiny_model(
    path: str | Path,
    *,
    family: str = "qwen2_vl",
    seed: int = 0,
    hidden_size: int = _HIDDEN,
    num_layers: int = 2,
    init_std: float = TINY_INIT_STD,
    vision_init_std: float | None = None,
    smooth_coord_embeddings: bool = False,
    rope_theta: float = 10000.0,
    vision_depth: int | None = None,
    vision_width: int = 64,
) -> Path:
    """Build and save (``save_pretrained``) the tiny tokenizer, processor and randomly initialised model into ``path``.

    ``smooth_coord_embeddings`` starts the coord-token rows as described in :func:`smooth_coord_init_`. Deterministic
    for given arguments; the global torch RNG state is left as it was. Returns ``path``.
    """
    import torch
    from transformers import AutoTokenizer

    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; choose one of {list(TINY_FAMILIES)}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer(out, chat_template=QWEN3_VL_CHAT_TEMPLATE if family == "qwen3_vl" else QWEN2_VL_CHAT_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    config = tiny_model_config(tokenizer, family, hidden_size=hidden_size, num_layers=num_layers, init_std=init_std,
                               vision_init_std=vision_init_std, rope_theta=rope_theta, vision_depth=vision_depth,
                               vision_width=vision_width)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _model_class(family)(config).to(torch.float32)
        if smooth_coord_embeddings:
            smooth_coord_init_(model, CoordVocab.from_tokenizer(tokenizer).ids, init_std)
    model.generation_config.eos_token_id = config.text_config.eos_token_id
    model.generation_config.pad_token_id = config.text_config.pad_token_id
    model.generation_config.do_sample = False
    # padded embedding rows have no token; never let the random model emit them
    model.generation_config.suppress_tokens = list(range(len(tokenizer), config.text_config.vocab_size))
    model.save_pretrained(str(out))
    save_processor(out, family, tokenizer, tiny_image_processor(family=family))
    return out


def coord_fourier_features(num_bins: int, dim: int):
    """``(num_bins, dim)`` cos/sin features of the bin position, frequencies geometric from 1/2 to 64 cycles.

    Every pair has unit norm, so the elementwise RMS is ``1/sqrt(2)``; nearby bins get nearby rows.
    """
    import torch

    if dim % 2 or dim < 2:
        raise ValueError(f"coord feature dim must be even and >= 2, got {dim}")
    position = torch.arange(num_bins, dtype=torch.float64)[:, None] / max(1, num_bins - 1)
    cycles = torch.logspace(math.log10(0.5), math.log10(64.0), dim // 2, dtype=torch.float64)[None, :]
    angle = 2 * math.pi * position * cycles
    return torch.cat([torch.cos(angle), torch.sin(angle)], dim=1)


def smooth_coord_init_(model: Any, coord_ids: Sequence[int], init_std: float) -> None:
    """Re-initialise the coord-token rows of the input embedding and LM head in place: a shared random vector (so
    "this is a coordinate" is one direction the model can learn once) plus Fourier features of the bin index (so
    bin k and k+1 start alike), each with elementwise RMS ``init_std``.

    Why: a random row per bin gives 1000 unrelated tokens that a tiny model sees a few times each; a pre-trained
    checkpoint's number tokens carry this structure already. Used by the CPU demo's model, never by the tests' one.
    """
    import torch

    ids = torch.as_tensor(list(coord_ids), dtype=torch.long)
    generator = torch.Generator().manual_seed(len(ids))
    with torch.no_grad():
        for matrix in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
            dim = matrix.shape[1]
            features = coord_fourier_features(len(ids), dim).to(matrix.dtype) * (init_std * math.sqrt(2.0))
            shared = torch.randn(dim, generator=generator, dtype=torch.float64).to(matrix.dtype) * init_std
            matrix[ids] = shared[None, :] + features
