"""Plain data shared between the pure stages (parsing, matching, targets, losses).

Coordinates are norm1000 integer bins 0..999 everywhere (docs/design.md, decision 9).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

GeometryKind = Literal["bbox_2d", "poly"]


@dataclass(frozen=True)
class DetObject:
    """One detection object: a description and a box ``[x1, y1, x2, y2]`` or a flat polygon ``[x1, y1, ...]``."""

    desc: str
    geometry: GeometryKind
    coords: tuple[int, ...]

    def points(self) -> np.ndarray:
        """Vertices as an ``(N, 2)`` float array; a box becomes its 4 corners (x1,y1),(x2,y1),(x2,y2),(x1,y2)."""
        c = np.asarray(self.coords, dtype=np.float64)
        if self.geometry == "bbox_2d":
            x1, y1, x2, y2 = c
            return np.array([[x1, y1], [x2, y1], [x2, y2], [x1, y2]])
        return c.reshape(-1, 2)


@dataclass(frozen=True)
class TokenSupervision:
    """Per-token supervision of one ``Y_train``; positions index the assistant ids (label positions).

    ``ce_positions`` never contains a coord-token position: coord slots are supervised only through
    ``coord_positions`` (coord_reg / bbox_geo); text positions through hard CE over the full vocabulary.
    """

    ce_positions: np.ndarray  # int64 (Nce,)
    ce_weights: np.ndarray  # float32 (Nce,), all > 0
    coord_positions: np.ndarray  # int64 (Nc,)
    coord_targets: np.ndarray  # float32 (Nc,), continuous target bin in [0, 999] (soft-target centre)
    bbox_slots: np.ndarray  # int64 (K, 4): indices into coord_positions of supervised boxes' x1, y1, x2, y2
    # Unlikelihood negatives of certified repeats (docs/design.md, decision 18): at label position ``ul_positions[i]``
    # push down token ``ul_tokens[i]``, or, when ``ul_bins[i] >= 0`` (a coord token), a band of bins around it that
    # leaves out the band around ``ul_exclude[i]`` (the position's own target bin; -1: none).
    ul_positions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    ul_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    ul_bins: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    ul_exclude: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # Policy-gradient tokens of the reward objective (docs/design.md, decision 19): the loss is
    # ``-pg_advantages[i] * log p(token at pg_positions[i])``; empty for rollout-matching SFT.
    pg_positions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    pg_advantages: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
