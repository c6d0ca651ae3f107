"""``model.*``: which checkpoint to train and how to load it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from coordexp.schema.base import PathStr, StrictModel, path_extra

__all__ = ["ModelConfig"]


class ModelConfig(StrictModel):
    """The policy model (a Qwen-VL family checkpoint whose vocabulary has the 1000 coord tokens)."""

    path: PathStr = Field(
        description="Hub id (org/name) or local directory. Values starting with '.', '/' or '~' are filesystem "
        "paths, resolved against the directory of the YAML file that sets them.",
        json_schema_extra=path_extra("hub-or-path"),
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="Parameter and compute dtype (float32 on CPU)."
    )
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"] = Field(
        "sdpa", description="Attention kernel passed to from_pretrained."
    )
    gradient_checkpointing: bool = Field(False, description="Trade compute for activation memory.")
