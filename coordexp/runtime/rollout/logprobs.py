"""Per-token log-probabilities of a rollout, as ``/infer/`` returns them (swift's per-choice ``logprobs``).

:class:`TokenLogprob` lives in the rollout layer so every engine (the server's HF engine, the vLLM engine shared
with the colocate backend) returns the same type. :func:`from_vllm_steps` turns what vLLM computes while
sampling (one ``{token_id: Logprob(logprob, rank)}`` per generated token) into that shape.
:func:`processed_logprobs` is the one rule for what a token's reported log-probability means (the distribution
the decoder drew it from: penalties, the never-emit mask, coord-group greedy, sampling transforms), used by the
HF engine's ``/infer/`` logprobs and by evaluation's scores, so ``/detect/`` and ``coordexp eval`` agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:
    import torch

    from coordexp.schema.rollout import DecodingConfig

__all__ = ["TokenLogprob", "from_vllm_steps", "NEVER_EMIT_TOKENS", "never_emit_ids", "processed_logprobs"]

NEVER_EMIT_TOKENS = ("<|image_pad|>", "<|video_pad|>")


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability under the request's sampling transforms (repetition penalty, then
    temperature, top-k and top-p when sampling: vLLM's ``processed_logprobs``, which swift 3.12 reports), and the
    ``top`` most likely ``(token_id, logprob)`` at that step, best first (empty unless ``top_logprobs`` was asked)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def from_vllm_steps(token_ids: Sequence[int], steps: Sequence[Mapping[int, Any] | None], top: int) -> list[TokenLogprob]:
    """One :class:`TokenLogprob` per id of ``token_ids`` from vLLM's per-step maps (``SamplingParams(logprobs=k)``
    with ``k >= top``: the k best plus the sampled id, each with ``.logprob`` and ``.rank``). ``top`` keeps the
    ``top`` best finite entries, best first; a step without the sampled id is a vLLM contract breach (raises)."""
    if len(steps) < len(token_ids):
        raise ValueError(f"vLLM returned logprobs for {len(steps)} steps but generated {len(token_ids)} tokens; "
                         "request them with SamplingParams(logprobs=k)")
    result = []
    for position, token_id in enumerate(token_ids):
        step = steps[position] or {}
        chosen = step.get(int(token_id))
        if chosen is None:
            raise ValueError(f"vLLM's logprobs at step {position} do not include the sampled token {token_id}")
        best: tuple[tuple[int, float], ...] = ()
        if top > 0:
            ranked = sorted(((int(i), float(entry.logprob)) for i, entry in step.items()
                             if not math.isinf(float(entry.logprob))),
                            key=lambda pair: (-pair[1], _rank(step[pair[0]]), pair[0]))
            best = tuple(ranked[:top])
        result.append(TokenLogprob(token_id=int(token_id), logprob=float(chosen.logprob), top=best))
    return result


def _rank(entry: Any) -> int:
    rank = getattr(entry, "rank", None)
    return rank if rank is not None else 1 << 30


def never_emit_ids(tokenizer: Any, vocab_rows: int, extra: Sequence[int] = ()) -> list[int]:
    """The ids a rollout never emits (every engine masks them, and every reported score leaves them out): the image
    and video pads, the padded vocabulary rows (``>= len(tokenizer)``) and ``extra`` (a checkpoint's
    ``generation_config.suppress_tokens``)."""
    never = {int(tokenizer.convert_tokens_to_ids(t)) for t in NEVER_EMIT_TOKENS
             if tokenizer.convert_tokens_to_ids(t) not in (None, tokenizer.unk_token_id)}
    never.update(range(len(tokenizer), int(vocab_rows)))
    never.update(int(i) for i in extra)
    return sorted(never)


def processed_logprobs(logits: "torch.Tensor", ids: "torch.Tensor", first: int,
                       decoding: "DecodingConfig", coord_ids: "torch.Tensor | None" = None,
                       never_emit: Sequence[int] = ()) -> "torch.Tensor":
    """Log-softmax of ``logits`` (row s predicts ``ids[first + s]``) after the sampling transforms, in vLLM's order:
    repetition penalty on every id in ``ids[:first + s]`` (divide positive logits, multiply negative ones), then
    coordexp's processor (the ``never_emit`` ids at -inf, then ``decoding.coord_group_greedy``'s rule with
    ``coord_ids``), then, when sampling, temperature, top-k and top-p (kept set: the smallest prefix of the sorted distribution whose mass
    reaches ``top_p``; the rest is -inf)."""
    import torch

    scores = logits.float().clone()
    if decoding.repetition_penalty != 1.0:
        penalty = float(decoding.repetition_penalty)
        for s in range(scores.shape[0]):
            seen = torch.unique(ids[:first + s])
            row = scores[s, seen]
            scores[s, seen] = torch.where(row > 0, row / penalty, row * penalty)
    if len(never_emit):
        scores[:, torch.as_tensor(list(never_emit), dtype=torch.long, device=scores.device)] = float("-inf")
    if decoding.coord_group_greedy:
        if coord_ids is None:
            raise ValueError("decoding.coord_group_greedy needs the coord token ids")
        from coordexp.runtime.rollout.coord_group import choose_coord_group

        scores = choose_coord_group(scores, coord_ids)
    if decoding.temperature > 0:
        scores = scores / float(decoding.temperature)
        if decoding.top_k > 0 and decoding.top_k < scores.shape[1]:
            kth = scores.topk(int(decoding.top_k), dim=1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if decoding.top_p < 1.0:
            ordered, order = scores.sort(dim=1, descending=True)
            mass = ordered.softmax(dim=1).cumsum(dim=1)
            drop = (mass - ordered.softmax(dim=1)) >= float(decoding.top_p)  # mass before this token already enough
            scores = scores.scatter(1, order, ordered.masked_fill(drop, float("-inf")))
    return scores.log_softmax(dim=1)
