"""Teacher-forced token figures per token type: accuracy and cross-entropy of the supervised text and coord tokens.

Monitors, never part of the objective. A supervised position's label is its text token (``ce_labels``) or, at a
coord slot, the coord token of its target bin (``coord_targets`` rounded to the nearest bin: the ground-truth token
itself in stage 1). Accuracy counts a position when the argmax over the FULL vocabulary (the first id on a tie) is
the label; loss is the full-vocabulary cross-entropy ``logsumexp(logits) - logit[label]``, unweighted. Both read the
logit rows through the objective's numeric fence (float32, NaN -> 0, clamped to +/-1e4: coord_losses.py), a chunk of
rows at a time, so no ``(N, V)`` copy is ever held and nothing waits on the device until the sums are read
(:class:`TokenTypeWindow`: once per logging window in training).

:class:`TokenTypeSums` holds sums, not means: chunks, micro-steps and ranks add up first and the figures are taken
once from the totals, so they are means over the pooled positions whatever the batching, packing or sharding.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields

import torch

from coordexp.runtime.model.coord_losses import NUM_COORD_BINS, _fence_, check_coord_ids
from coordexp.runtime.model.losses import SupervisionBatch

__all__ = ["TOKEN_FIGURES", "TokenTypeSums", "TokenTypeWindow", "coord_labels", "token_type_sums",
           "token_type_totals"]

# About 32 MiB of float32 rows per chunk, whatever the vocabulary size (fewer, larger kernels on a GPU).
_CHUNK_ELEMENTS = 1 << 23

TOKEN_FIGURES: tuple[str, ...] = (
    "token_acc", "text_token_acc", "coord_token_acc", "token_loss", "text_token_loss", "coord_token_loss",
)
"""The figure names :meth:`TokenTypeSums.figures` can report (a type without supervised tokens is left out)."""


@dataclass(frozen=True)
class TokenTypeSums:
    """Per token type: supervised positions, argmax hits, and summed cross-entropy (nats)."""

    text_tokens: float = 0.0
    text_correct: float = 0.0
    text_loss: float = 0.0
    coord_tokens: float = 0.0
    coord_correct: float = 0.0
    coord_loss: float = 0.0

    def __add__(self, other: "TokenTypeSums") -> "TokenTypeSums":
        return TokenTypeSums(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def to_list(self) -> list[float]:
        """The sums in field order (what a rank all-reduces)."""
        return [float(v) for v in astuple(self)]

    @classmethod
    def from_list(cls, values: list[float]) -> "TokenTypeSums":
        if len(values) != len(fields(cls)):
            raise ValueError(f"expected {len(fields(cls))} sums, got {len(values)}")
        return cls(*(float(v) for v in values))

    def figures(self) -> dict[str, float]:
        """Means over the pooled positions: ``token_acc`` / ``token_loss`` over every supervised token, and the
        ``text_`` / ``coord_`` figures of each type that has tokens."""
        out: dict[str, float] = {}
        total = self.text_tokens + self.coord_tokens
        if total:
            out["token_acc"] = (self.text_correct + self.coord_correct) / total
            out["token_loss"] = (self.text_loss + self.coord_loss) / total
        for kind, count, correct, loss in (("text", self.text_tokens, self.text_correct, self.text_loss),
                                           ("coord", self.coord_tokens, self.coord_correct, self.coord_loss)):
            if count:
                out[f"{kind}_token_acc"] = correct / count
                out[f"{kind}_token_loss"] = loss / count
        return out


def coord_labels(batch: SupervisionBatch, coord_ids: torch.Tensor) -> torch.Tensor:
    """The coord token id of each coord slot's target bin (rounded to the nearest bin)."""
    bins = batch.coord_targets.round().clamp(0, NUM_COORD_BINS - 1).long()
    return coord_ids.to(bins.device).index_select(0, bins)


class TokenTypeWindow:
    """A logging window's sums, kept where they were computed: adding a forward's :func:`token_type_totals` queues
    one device addition and nothing waits; :meth:`to_list` copies the six sums to the host once per window."""

    def __init__(self) -> None:
        self._sums: torch.Tensor | None = None

    def __iadd__(self, other: "torch.Tensor | TokenTypeSums") -> "TokenTypeWindow":
        value = torch.tensor(other.to_list(), dtype=torch.float64) if isinstance(other, TokenTypeSums) else other
        self._sums = value if self._sums is None else self._sums + value.to(self._sums.device)
        return self

    def to_list(self) -> list[float]:
        """The window's sums in :class:`TokenTypeSums` field order (the one host read)."""
        return [0.0] * len(fields(TokenTypeSums)) if self._sums is None else self._sums.tolist()


def token_type_sums(
    logits: torch.Tensor, batch: SupervisionBatch, coord_ids: torch.Tensor, *, chunk_rows: int | None = None
) -> TokenTypeSums:
    """:func:`token_type_totals` read back to the host (one copy) as a :class:`TokenTypeSums`."""
    return TokenTypeSums.from_list(token_type_totals(logits, batch, coord_ids, chunk_rows=chunk_rows).tolist())


@torch.no_grad()
def token_type_totals(
    logits: torch.Tensor, batch: SupervisionBatch, coord_ids: torch.Tensor, *, chunk_rows: int | None = None
) -> torch.Tensor:
    """Accuracy and cross-entropy sums of the supervised positions of ``batch`` (text rows, then coord slots), as
    a float64 tensor of six sums in :class:`TokenTypeSums` field order on the logits' device (nothing is read back).

    Args:
        logits: ``(R, T, V)`` logits the supervision batch was built for (any float dtype).
        batch: supervision in flattened logit coordinates (:class:`SupervisionBatch`).
        coord_ids: ``(1000,)`` LongTensor of the coord token ids in bin order.
        chunk_rows: rows fenced at a time (default: about 32 MiB of float32 per chunk).
    """
    if logits.ndim != 3 or logits.shape[1] != batch.seq_len:
        raise ValueError(f"logits shape {tuple(logits.shape)} does not match the supervision batch "
                         f"(seq_len={batch.seq_len}); build the SupervisionBatch for the same layout")
    vocab = logits.shape[-1]
    check_coord_ids(coord_ids, vocab)
    device = logits.device
    num_text = int(batch.ce_logit_index.numel())
    index = torch.cat([batch.ce_logit_index, batch.coord_logit_index]).to(device)
    labels = torch.cat([batch.ce_labels.to(device), coord_labels(batch.to(device), coord_ids)])
    flat = logits.reshape(-1, vocab)
    step = max(1, chunk_rows if chunk_rows is not None else _CHUNK_ELEMENTS // max(vocab, 1))
    correct = torch.zeros(index.numel(), dtype=torch.float64, device=device)
    loss = torch.zeros(index.numel(), dtype=torch.float64, device=device)
    for lo in range(0, index.numel(), step):
        rows = _fence_(flat.index_select(0, index[lo:lo + step]).float())  # a fresh copy: fenced in place
        label = labels[lo:lo + step]
        label_logit = rows.gather(1, label[:, None]).squeeze(1)
        loss[lo:lo + step] = (torch.logsumexp(rows, dim=1) - label_logit).double()
        correct[lo:lo + step] = (rows.argmax(dim=1) == label).double()
        del rows
    text, coord = slice(0, num_text), slice(num_text, None)
    return torch.stack([loss.new_full((), float(num_text)), correct[text].sum(), loss[text].sum(),
                        loss.new_full((), float(index.numel() - num_text)), correct[coord].sum(), loss[coord].sum()])
