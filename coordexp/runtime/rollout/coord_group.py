"""Greedy decoding that chooses the coordinate group by its mass (``decoding.coord_group_greedy``).

The coord losses train a distribution over 1000 bins (soft targets, W1) and a gate on the bins' total mass, so a
trained model can put most of its mass on "a coordinate comes next" spread over neighbouring bins, each bin below a
single text token. Plain greedy then writes the text token and breaks the object (docs/design.md, decision 16).
Here a greedy step is two argmaxes: the group (the coord bins' total against every other token), then the token.
Shared by the HF logits processor and the vLLM one, so both backends decode the same ids.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["choose_coord_group", "coord_id_tensor"]


def coord_id_tensor(tokenizer: Any, device: Any = None) -> torch.Tensor:
    """The 1000 coord token ids of ``tokenizer`` (bin order) as a long tensor; fails if the tokenizer lacks them."""
    from coordexp.runtime.core.tokens import CoordVocab

    return torch.tensor(CoordVocab.from_tokenizer(tokenizer).ids, dtype=torch.long, device=device)


def choose_coord_group(logits: torch.Tensor, coord_ids: torch.Tensor) -> torch.Tensor:
    """``logits`` (rows, vocab) with every non-coord token at ``-inf`` in the rows where the coord tokens' total
    probability is larger than the likeliest other token's; the other rows are returned as they are (their argmax
    is already a text token, which beats every single bin). The argmax of the result is the group-first choice."""
    coord_ids = coord_ids.to(logits.device)
    coords = logits.index_select(1, coord_ids)
    group = torch.logsumexp(coords.float(), dim=-1)
    others = logits.index_fill(1, coord_ids, float("-inf")).amax(dim=-1).float()
    pick = group > others
    # picked rows: all -inf, then the coord logits written back (a no-op for the other rows)
    return logits.masked_fill(pick[:, None], float("-inf")).index_copy_(1, coord_ids, coords)
