"""``data.*``: where the JSONL records and their images live."""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from coordexp.schema.base import Count, PathStr, StrictModel, path_extra

__all__ = ["DataConfig"]


class DataConfig(StrictModel):
    """Dataset files. Relative paths resolve against the directory of the YAML file that sets them."""

    train_jsonl: PathStr = Field(
        description="Training records, one JSON object per line.", json_schema_extra=path_extra()
    )
    val_jsonl: Optional[PathStr] = Field(
        None, description="Optional validation records.", json_schema_extra=path_extra()
    )
    image_root: Optional[PathStr] = Field(
        None,
        description="Directory that relative image paths in the records resolve against; null means the "
        "directory of train_jsonl.",
        json_schema_extra=path_extra(),
    )
    max_train_samples: Optional[Count] = Field(None, description="Use only the first N training records.")
    max_val_samples: Optional[Count] = Field(None, description="Use only the first N validation records.")
