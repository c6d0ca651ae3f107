"""``data.*``: where the JSONL records and their images live, and in which order a record's objects are trained."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from coordexp.schema.base import Count, PathStr, StrictModel, float_in, path_extra
from coordexp.schema.errors import RuleViolation, raise_violations

__all__ = ["DataConfig", "ObjectOrder", "OBJECT_ORDERS", "GtPrefixMix"]

ObjectOrder = Literal["keep", "sorted", "random"]
OBJECT_ORDERS: tuple[str, ...] = ("keep", "sorted", "random")


class GtPrefixMix(StrictModel):
    """How ground-truth samples (stage 1, and stage 2's ground-truth steps) are cut: relative weights of four prefix
    kinds, drawn per sample. The prefix is given as context without loss, the objects it leaves out are the target, in
    reading order, then the close (docs/design.md, decision 18). The default is plain stage 1."""

    none: float_in(ge=0.0, le=1000.0) = Field(1.0, description="Empty prefix: every object is taught (stage 1).")
    random_subset: float_in(ge=0.0, le=1000.0) = Field(
        0.0, description="A random non-empty proper subset of the objects (in reading order) as the prefix; the "
        "others are taught in order.")
    leave_one_out: float_in(ge=0.0, le=1000.0) = Field(
        0.0, description="Every object but one as the prefix; that one is taught, then the close.")
    all: float_in(ge=0.0, le=1000.0) = Field(0.0, description="Every object as the prefix; only the close is taught.")

    @model_validator(mode="after")
    def _some_weight(self) -> "GtPrefixMix":
        if self.none + self.random_subset + self.leave_one_out + self.all <= 0:
            raise_violations([RuleViolation("none", "data.gt_prefix_mix: every weight is 0; nothing can be drawn",
                                            "Give at least one kind a positive weight (none: 1 is plain stage 1).")])
        return self

    @property
    def is_plain(self) -> bool:
        return self.random_subset == self.leave_one_out == self.all == 0


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
    gt_prefix_mix: GtPrefixMix = Field(default_factory=GtPrefixMix)
