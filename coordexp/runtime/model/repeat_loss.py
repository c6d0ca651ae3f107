"""The unlikelihood term of certified repeats (``rollout_matching.repeats: unlikelihood``; docs/design.md,
decision 18): ``-log(1 - p)`` at each negative, ``p`` the probability of the repeat's token there or, for a
coordinate, the mass of the bins within ``band`` of the repeat's that lie further than ``band`` from the position's
own target (so the target's neighbourhood is never pushed down).

Read from a second fence of only the negative rows (:func:`gathered_row_stats`), so the other terms and their memory
are untouched when no repeat was removed.
"""

from __future__ import annotations

import torch

from coordexp.runtime.model.coord_losses import NUM_COORD_BINS, gathered_row_stats

__all__ = ["repeat_unlikelihood", "negative_band_mask"]

_MAX_P = 1.0 - 1e-6  # -log(1 - p) stays finite (13.8) when the model is certain of the repeat
_FLOOR = -1e30


def negative_band_mask(bins: torch.Tensor, exclude: torch.Tensor, band: int) -> torch.Tensor:
    """``(N, 1000)`` bool: per coordinate negative, the bins within ``band`` of ``bins[i]`` and further than ``band``
    from ``exclude[i]`` (-1: nothing excluded)."""
    grid = torch.arange(NUM_COORD_BINS, device=bins.device)
    near = (grid[None, :] - bins[:, None]).abs() <= band
    kept_apart = (exclude[:, None] < 0) | ((grid[None, :] - exclude[:, None]).abs() > band)
    return near & kept_apart


def repeat_unlikelihood(logits: torch.Tensor, index: torch.Tensor, tokens: torch.Tensor, bins: torch.Tensor,
                        exclude: torch.Tensor, coord_ids: torch.Tensor, band: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(term, mass)`` summed over the negatives (the caller divides): the unlikelihood losses, and the pushed-down
    probability (detached). ``index`` addresses rows of ``logits.view(-1, V)``; ``tokens`` are the negative ids,
    ``bins`` their coordinate bins (-1: a text token), ``exclude`` the bins whose band is spared."""
    device = logits.device
    stats = gathered_row_stats(logits, index.to(device), coord_ids, [1.0], labels=tokens.to(device))
    lse = stats.lse[1.0]
    bins, exclude = bins.to(device), exclude.to(device)
    log_p = stats.label_logit - lse
    is_coord = bins >= 0
    if bool(is_coord.any()):
        mask = negative_band_mask(bins[is_coord], exclude[is_coord], band)
        # a finite floor, not -inf: a band wholly inside the spared one then has mass ~0 and a finite gradient
        band_logits = stats.coord[is_coord].masked_fill(~mask, _FLOOR)
        log_p = log_p.clone()
        log_p[is_coord] = torch.logsumexp(band_logits, dim=1) - lse[is_coord]
    p = log_p.exp().clamp(max=_MAX_P)
    return -torch.log1p(-p).sum(), p.detach().sum()
