"""``data.*``: where the JSONL records and their images live, and in which order a record's objects are trained."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from coordexp.schema.base import Count, PathStr, StrictModel, path_extra

__all__ = ["DataConfig", "ObjectOrder", "OBJECT_ORDERS"]

ObjectOrder = Literal["keep", "sorted", "random"]
OBJECT_ORDERS: tuple[str, ...] = ("keep", "sorted", "random")


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
    object_order: ObjectOrder = Field(
        "keep",
        description="Order of a record's objects in the trained serialization. keep: as the record lists them; "
        "sorted: the record must already list them in top-left order (by the top edge y1, then the left edge x1 of "
        "each object's box; a polygon's box spans its points), else loading fails with file:line (exit 2); "
        "random: each training record's objects are shuffled per epoch, a pure function of (training.seed, epoch, "
        "record index), so a resumed run sees the same order (evaluation keeps the record's order).",
    )
