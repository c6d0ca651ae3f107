"""Greedy decoding that chooses the token's kind by its mass (``decoding.coord_group_greedy``).

The coord losses train a distribution over 1000 bins (soft targets, W1) and a gate on the bins' total mass, so a
trained model can put most of its mass on "a coordinate comes next" spread over neighbouring bins, each bin below a
single text token. Plain greedy then writes the text token and breaks the object (docs/design.md, decision 16).
Here a greedy step is two argmaxes: the kind (coordinate or text, each by its total probability), then the likeliest
token of that kind. Shared by the HF logits processor and the vLLM one, so both backends decode the same ids.
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
    """``logits`` (rows, vocab) with the tokens of the losing kind at ``-inf``: every non-coord token in the rows
    where the coord tokens hold more than half the probability, every coord token in the others. The argmax of the
    result is the kind-first choice; a kind's own logits are returned unchanged (so are its logprobs' ratios)."""
    coord_ids = coord_ids.to(logits.device)
    coords = logits.index_select(1, coord_ids)
    pick = torch.softmax(logits.float(), dim=-1).index_select(1, coord_ids).sum(dim=-1) > 0.5  # the coords' mass
    text = logits.index_fill(1, coord_ids, float("-inf"))
    # coord rows: all -inf, then the coord logits written back; text rows keep their coord logits at -inf
    kept = coords.masked_fill(~pick[:, None], float("-inf"))
    return text.masked_fill_(pick[:, None], float("-inf")).index_copy_(1, coord_ids, kept)
