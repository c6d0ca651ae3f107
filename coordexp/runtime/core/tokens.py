"""The coordinate vocabulary: the 1000 single tokens ``<|coord_0|>`` .. ``<|coord_999|>`` (bin k = ``<|coord_k|>``).

Every stage that turns token ids into bins (parsing, targets, losses) goes through one :class:`CoordVocab`, built
once per tokenizer, so a missing or colliding coord token fails at start-up instead of training on wrong bins.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

NUM_COORD_BINS = 1000
COORD_TOKEN_RE = re.compile(r"<\|coord_([0-9]{1,4})\|>")


def coord_token(bin_index: int) -> str:
    """The token text of one bin: ``coord_token(7) == "<|coord_7|>"``."""
    if isinstance(bin_index, bool) or not isinstance(bin_index, (int, np.integer)):
        raise TypeError(f"coord bin must be an int in 0..{NUM_COORD_BINS - 1}, got {bin_index!r}")
    if not 0 <= int(bin_index) < NUM_COORD_BINS:
        raise ValueError(f"coord bin {bin_index} is outside 0..{NUM_COORD_BINS - 1} (norm1000 bins)")
    return f"<|coord_{int(bin_index)}|>"


def parse_coord_token(text: str) -> int | None:
    """The bin of an exact coord-token text (``"<|coord_12|>"`` -> 12), or None for anything else."""
    match = COORD_TOKEN_RE.fullmatch(text)
    if match is None:
        return None
    value = int(match.group(1))
    return value if value < NUM_COORD_BINS else None


ALL_COORD_TOKENS: tuple[str, ...] = tuple(f"<|coord_{k}|>" for k in range(NUM_COORD_BINS))


@dataclass(frozen=True)
class CoordVocab:
    """Bin <-> token-id mapping of one tokenizer.

    ``ids[k]`` is the id of ``<|coord_k|>``; ``lookup`` maps any token id below ``len(lookup)`` to its bin or -1,
    so whole id arrays convert at once (``vocab.bins_of(ids)``) without torch.
    """

    ids: tuple[int, ...]
    lookup: np.ndarray = field(repr=False, compare=False)
    id_set: frozenset[int] = field(repr=False, compare=False)

    @classmethod
    def from_ids(cls, ids: Iterable[int], *, special_ids: Iterable[int] = ()) -> "CoordVocab":
        """Build from the 1000 ids in bin order; fails if the count is wrong, an id repeats or is a special token."""
        ids = tuple(int(i) for i in ids)
        if len(ids) != NUM_COORD_BINS:
            raise ValueError(f"expected {NUM_COORD_BINS} coord token ids, got {len(ids)}")
        negative = [k for k, i in enumerate(ids) if i < 0]
        if negative:
            raise ValueError(f"coord token ids must be >= 0; bins {negative[:5]} have negative ids")
        if len(set(ids)) != NUM_COORD_BINS:
            seen: dict[int, int] = {}
            for k, i in enumerate(ids):
                if i in seen:
                    raise ValueError(
                        f"coord tokens collide: {coord_token(seen[i])} and {coord_token(k)} both map to id {i} "
                        "(usually both are unknown to the tokenizer); run coordexp.runtime.core.tokens.add_coord_tokens"
                    )
                seen[i] = k
        clashing = sorted(set(ids) & {int(s) for s in special_ids})
        if clashing:
            bins = [ids.index(i) for i in clashing]
            raise ValueError(
                f"coord tokens {[coord_token(b) for b in bins[:5]]} share ids {clashing[:5]} with special tokens; "
                "the coord vocabulary must be distinct from the chat/special tokens"
            )
        lookup = np.full(max(ids) + 1, -1, dtype=np.int32)
        lookup[np.asarray(ids, dtype=np.int64)] = np.arange(NUM_COORD_BINS, dtype=np.int32)
        lookup.setflags(write=False)
        return cls(ids=ids, lookup=lookup, id_set=frozenset(ids))

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> "CoordVocab":
        """Look up and validate the coord ids of a Hugging Face tokenizer.

        Each ``<|coord_k|>`` must be a known token that encodes to exactly itself as one id; otherwise the error
        says which bins are wrong and how to fix the checkpoint (``add_coord_tokens``).
        """
        vocab = tokenizer.get_vocab()
        missing = [k for k, text in enumerate(ALL_COORD_TOKENS) if text not in vocab]
        if missing:
            raise ValueError(
                f"tokenizer lacks {len(missing)} of the {NUM_COORD_BINS} coord tokens (first missing: "
                f"{[coord_token(k) for k in missing[:3]]}); add them with "
                "coordexp.runtime.core.tokens.add_coord_tokens(tokenizer, model) before training"
            )
        ids = [int(vocab[text]) for text in ALL_COORD_TOKENS]
        encoded = tokenizer(list(ALL_COORD_TOKENS), add_special_tokens=False)["input_ids"]
        split = [k for k, (enc, i) in enumerate(zip(encoded, ids)) if list(enc) != [i]]
        if split:
            k = split[0]
            raise ValueError(
                f"{len(split)} coord tokens do not encode to a single id, e.g. {coord_token(k)} -> {list(encoded[k])} "
                f"(expected [{ids[k]}]); coord tokens must be added tokens (add_coord_tokens) so the text of one "
                "coordinate is always exactly one token"
            )
        return cls.from_ids(ids, special_ids=getattr(tokenizer, "all_special_ids", ()))

    def __len__(self) -> int:
        return NUM_COORD_BINS

    def id_of(self, bin_index: int) -> int:
        """Token id of bin ``bin_index`` (0..999)."""
        if not 0 <= int(bin_index) < NUM_COORD_BINS:
            raise ValueError(f"coord bin {bin_index} is outside 0..{NUM_COORD_BINS - 1}")
        return self.ids[int(bin_index)]

    def bin_of(self, token_id: int) -> int | None:
        """Bin of a coord token id, or None when ``token_id`` is not a coord token."""
        token_id = int(token_id)
        if 0 <= token_id < len(self.lookup):
            value = int(self.lookup[token_id])
            return value if value >= 0 else None
        return None

    def is_coord(self, token_id: int) -> bool:
        return int(token_id) in self.id_set

    def bins_of(self, token_ids: Any) -> np.ndarray:
        """Vectorised :meth:`bin_of`: an int32 array with the bin of each id, -1 where the id is not a coord token."""
        arr = np.asarray(token_ids, dtype=np.int64)
        out = np.full(arr.shape, -1, dtype=np.int32)
        inside = (arr >= 0) & (arr < len(self.lookup))
        out[inside] = self.lookup[arr[inside]]
        return out

    @property
    def id_array(self) -> np.ndarray:
        """The ids as an int64 array (index = bin), e.g. to gather coord logits."""
        return np.asarray(self.ids, dtype=np.int64)


def add_coord_tokens(tokenizer: Any, model: Any = None) -> int:
    """Add the missing coord tokens to ``tokenizer`` (and ``model``'s embeddings); returns how many were added.

    Tokens are added as NON-special added tokens, so they survive ``skip_special_tokens`` and always encode to one
    id. Rows of the input (and untied output) embedding for newly added ids start at the mean of the rows of the
    ids that existed before plus seeded noise (see :func:`new_row_values`): the new logits stay at the average
    scale instead of a random one, yet every coord token starts distinct. The matrices grow only when the tokenizer
    outgrows them (checkpoints often pad their vocabulary). Deterministic for a given checkpoint; idempotent: a
    second call adds nothing and leaves the model untouched.
    """
    from tokenizers import AddedToken

    old_len = len(tokenizer)
    present = tokenizer.get_vocab()
    missing = [text for text in ALL_COORD_TOKENS if text not in present]
    if missing:
        tokenizer.add_tokens(
            [AddedToken(t, special=False, normalized=False, lstrip=False, rstrip=False, single_word=False) for t in missing]
        )
    CoordVocab.from_tokenizer(tokenizer)  # fail now, not mid-run, if the result is still unusable
    if model is None or not missing:
        return len(missing)
    new_ids = sorted({tokenizer.convert_tokens_to_ids(t) for t in missing})
    _grow_embeddings(model, new_len=len(tokenizer), old_len=old_len, new_ids=new_ids)
    return len(missing)


NEW_ROW_SPREAD = 0.1
"""Noise of a new row, per dimension, as a fraction of the old rows' spread in that dimension."""
NEW_ROW_SEED = 1000
"""Seed of the new rows' noise (with the matrix's position, so input and output rows differ)."""
_ROW_CHUNK = 8192


def new_row_values(old_rows: Any, count: int, *, seed: int) -> Any:
    """``count`` starting rows for new tokens: the mean of ``old_rows`` plus Gaussian noise of ``NEW_ROW_SPREAD``
    times the per-dimension standard deviation of ``old_rows``, drawn from ``seed`` (computed in float64, returned
    in the rows' dtype). Why noise: identical rows give identical logits, and a low-precision dtype (bfloat16)
    rounds a tiny spread (transformers' ``mean_resizing`` uses 1e-9 of the covariance) back to identical rows."""
    import torch

    def chunks():  # a whole vocabulary in float64 would take gigabytes
        return (c.detach().to(device="cpu", dtype=torch.float64) for c in old_rows.split(_ROW_CHUNK))

    mean = sum(c.sum(dim=0) for c in chunks()) / len(old_rows)
    std = (sum(((c - mean) ** 2).sum(dim=0) for c in chunks()) / len(old_rows)).sqrt()
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn((count, old_rows.shape[1]), generator=generator, dtype=torch.float64)
    return (mean + NEW_ROW_SPREAD * std * noise).to(old_rows.dtype)


def _grow_embeddings(model: Any, *, new_len: int, old_len: int, new_ids: list[int]) -> None:
    import torch

    rows = model.get_input_embeddings().weight.shape[0]
    if new_len > rows:
        model.resize_token_embeddings(new_len, mean_resizing=False)
    index = torch.as_tensor(new_ids, dtype=torch.long)
    with torch.no_grad():
        matrices = [model.get_input_embeddings().weight]
        output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if output is not None and output.weight.data_ptr() != matrices[0].data_ptr():
            matrices.append(output.weight)
        for position, weight in enumerate(matrices):
            values = new_row_values(weight[:old_len], len(new_ids), seed=NEW_ROW_SEED + position)
            weight[index] = values.to(device=weight.device)
        if output is not None and getattr(output, "bias", None) is not None and output.bias.shape[0] >= new_len:
            output.bias[index] = output.bias[:old_len].mean().to(output.bias.dtype)
