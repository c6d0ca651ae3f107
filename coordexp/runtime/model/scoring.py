"""Per-token log-probabilities of finished rollouts, by one teacher-forced forward (works for every backend).

Detection AP needs a ranking score per object; coordexp uses the sequence log-probability of the object's tokens
under the policy. No backend returns token logprobs through the rollout interface, so they are recomputed here:
the rollout's ids are appended to its prompt and run through the model once, without gradients. ``transform``
turns a sample's logits into the log-probabilities the decoder drew from (evaluation passes the rollout layer's
``processed_logprobs``: penalties, the never-emit mask), so a score is what the engine would report.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import numpy as np

from coordexp.runtime.model.packed_forward import collate_padded, mrope_index_of, padded_forward

if TYPE_CHECKING:
    import torch

    from coordexp.runtime.model.encoding import EncodedSample

LogprobTransform = Callable[["torch.Tensor", "torch.Tensor", int], "torch.Tensor"]
"""``(logits, ids, first) -> log-probabilities``: row s of ``logits`` predicts ``ids[first + s]``."""

__all__ = ["response_token_logprobs"]


def response_token_logprobs(model: Any, samples: Sequence["EncodedSample"], *, pad_token_id: int = 0,
                            transform: Optional[LogprobTransform] = None) -> list[np.ndarray]:
    """For each sample, ``log p(token_t | prompt, tokens_<t)`` of every assistant token, float64 ``(n_assistant,)``
    (under ``transform`` when given, else the plain log-softmax).

    One right-padded forward for the whole list (callers chunk it); the LM head runs only at the positions that
    predict assistant tokens. The model's train/eval mode is left as it was (call it in eval mode).
    """
    import torch

    if not samples:
        return []
    batch = collate_padded(samples, mrope_index_of(model), pad_token_id=pad_token_id)
    first = min(int(s.assistant_start) for s in samples) - 1  # the logit at t predicts token t + 1
    last = max(int(s.input_ids.shape[0]) for s in samples) - 1
    keep = torch.arange(first, last, dtype=torch.long)
    with torch.no_grad():
        logits = padded_forward(model, batch, logits_to_keep=keep)  # (B, K, V)
        out: list[np.ndarray] = []
        for row, sample in enumerate(samples):
            start, end = int(sample.assistant_start), int(sample.input_ids.shape[0])
            rows = logits[row, start - 1 - first : end - 1 - first].float()
            targets = sample.input_ids[start:end].to(rows.device)
            if transform is None:
                picked = rows.gather(-1, targets[:, None])[:, 0] - torch.logsumexp(rows, dim=-1)
            else:
                picked = transform(rows, sample.input_ids.to(rows.device), start).gather(-1, targets[:, None])[:, 0]
            out.append(picked.double().cpu().numpy())
    return out
