"""Detection records as the HF ``Trainer``'s dataset: batches stay lists of records (the trainer builds its own
inputs per micro-step, so nothing is collated into tensors here)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from coordexp.runtime.model.data import DetectionRecord

__all__ = ["RecordDataset", "identity_collator"]


class RecordDataset(torch.utils.data.Dataset):
    """Detection records as a map-style dataset; batches stay lists of records (see :func:`identity_collator`)."""

    def __init__(self, records: Sequence["DetectionRecord"]):
        self.records = list(records)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> "DetectionRecord":
        return self.records[index]


def identity_collator(records: list["DetectionRecord"]) -> list["DetectionRecord"]:
    return records
