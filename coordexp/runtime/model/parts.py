"""Which part of a Qwen-VL model a parameter or module belongs to: the language model, the vision tower or the
aligner (the visual merger, and Qwen3-VL's DeepStack mergers). The freeze switches, the LoRA targets and the
per-part learning rates all read this one map (docs/design.md, decision 12)."""

from __future__ import annotations

import re
from typing import Literal

__all__ = ["Part", "PARTS", "model_part"]

Part = Literal["llm", "vision", "aligner"]
PARTS: tuple[Part, ...] = ("llm", "vision", "aligner")

# transformers 5 names for every supported family (model.visual.*, model.language_model.*, lm_head); a PEFT
# wrapper adds "base_model.model." in front and ".base_layer" / ".lora_A.<adapter>" / "modules_to_save" inside.
_PEFT_PREFIX = re.compile(r"^(base_model\.model\.)+")
_ALIGNER = re.compile(r"(^|\.)visual\.(merger|deepstack_merger_list)(\.|$)")
_VISION = re.compile(r"(^|\.)visual(\.|$)")


def model_part(name: str) -> Part:
    """The part of the parameter or module ``name`` (``named_parameters`` / ``named_modules`` spelling, PEFT
    prefixes allowed): ``aligner`` for the merger and DeepStack mergers, ``vision`` for the rest of ``visual``,
    ``llm`` for everything else (language model, embeddings, lm_head)."""
    bare = _PEFT_PREFIX.sub("", name)
    if _ALIGNER.search(bare):
        return "aligner"
    if _VISION.search(bare):
        return "vision"
    return "llm"
