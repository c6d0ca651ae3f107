"""When the policy's weights changed: the one owner of that answer (docs/design.md, "Policy version").

Every reader that keeps something derived from the weights (the merged decode copy, the DoRA norm cache, the vLLM
colocate and server pushes, the ZeRO-3 scoring copy) asks :func:`policy_version` and rebuilds when it differs from
the value it built from. In-place version counters alone cannot answer it: DeepSpeed ZeRO-1/2/3 write the updated
weights through ``.data`` and the fused AdamW step leaves ``_version`` as it was (torch 2.13 CPU), so after those
steps every counter still reads as before. The trainer therefore calls :func:`note_optimizer_step` after EVERY
optimizer step, whatever the optimizer and ZeRO stage: it counts the step on the model and bumps the in-place
version of every trainable parameter (and ZeRO-3 shard), so both the step count and the tensors' own fingerprints
move. Updates outside an optimizer step (``load_state_dict``, a hand edit under ``no_grad``) bump ``_version``
themselves and are seen too.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["unwrap_model", "policy_version", "optimizer_steps", "note_optimizer_step"]

_STEPS_ATTRIBUTE = "_coordexp_optimizer_steps"


def unwrap_model(model: Any) -> Any:
    """The module inside DDP / DeepSpeed / accelerate wrappers (they hold it as ``.module``)."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def optimizer_steps(model: Any) -> int:
    """How many optimizer steps :func:`note_optimizer_step` has recorded on ``model`` (0 for a model never trained)."""
    return int(unwrap_model(model).__dict__.get(_STEPS_ATTRIBUTE, 0))


def note_optimizer_step(model: Any) -> None:
    """Record that an optimizer step just updated ``model``: the step count moves and so does the in-place version
    of every trainable parameter and ZeRO-3 shard (the fingerprints the DoRA cache reads). Call it after every
    optimizer step, on every rank; it costs one counter bump per trainable tensor, no copy."""
    module = unwrap_model(model)
    module.__dict__[_STEPS_ATTRIBUTE] = optimizer_steps(module) + 1
    tensors = [p for p in module.parameters() if p.requires_grad]
    tensors += [p.ds_tensor for p in module.parameters() if getattr(p, "ds_tensor", None) is not None]
    if tensors:
        torch.autograd.graph.increment_version(tensors)


def policy_version(model: Any) -> tuple:
    """``(id(model), optimizer steps, (name, _version, shard _version) per parameter)``: equal values mean nothing
    derived from the weights since then is stale. Cheap: no tensor is read."""
    module = unwrap_model(model)
    return (id(module), optimizer_steps(module)) + tuple(
        (name, p._version, _shard_version(p)) for name, p in module.named_parameters())


def _shard_version(parameter: Any) -> int | None:
    shard = getattr(parameter, "ds_tensor", None)
    return None if shard is None else shard._version
