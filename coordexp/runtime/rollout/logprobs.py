"""Per-token log-probabilities of a rollout, as ``/infer/`` returns them (swift's per-choice ``logprobs``).

:class:`TokenLogprob` lives in the rollout layer so every engine (the server's HF engine, the vLLM engine shared
with the colocate backend) returns the same type. :func:`from_vllm_steps` turns what vLLM computes while
sampling (one ``{token_id: Logprob(logprob, rank)}`` per generated token) into that shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

__all__ = ["TokenLogprob", "from_vllm_steps"]


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
