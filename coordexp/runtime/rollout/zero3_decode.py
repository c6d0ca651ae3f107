"""HF rollouts of a DeepSpeed ZeRO-3 policy decode on a gathered twin (docs/design.md, decision 14).

Under ZeRO-3 every parameter holds only this rank's shard, and each forward gathers the parameters it needs: a
collective all ranks must run together. Rollouts cannot pair up that way (ranks decode different numbers of tokens,
evaluation shards differ in size, an overlapped prefetch decodes while training runs). So at the weight-sync point,
which every rank reaches at the same call inside :func:`~coordexp.runtime.rollout.weight_export.full_parameters`,
:class:`GatheredDecodeModel` copies the whole weights into a plain twin of the policy (the same module objects'
structure and settings, with DeepSpeed's hooks and attributes left out) and ``generate`` runs on the twin with no
collective. The twin costs one whole copy of the model per rank; its tensors are refreshed in place when the
policy's :func:`~coordexp.runtime.rollout.weight_export.policy_version` changed.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any

import torch

from coordexp.runtime.rollout.weight_export import not_gathered, policy_version, unwrap_model

__all__ = ["GatheredDecodeModel", "plain_twin"]

logger = logging.getLogger("coordexp.rollout.hf")

# What DeepSpeed's ZeRO-3 sets on a module besides its hooks (deepspeed/runtime/zero/parameter_offload.py and
# partition_parameters.py); a twin has none of them.
_DEEPSPEED_ATTRIBUTES = frozenset({"all_parameters", "pre_bwd_fn", "post_bwd_fn", "applied_pre_backward_ref_cnt",
                                   "_original_parameters", "_external_params", "_ds_child_entered"})
# Per-module state a decode builds for the module it ran on (compiled call, static cache), never carried over.
_DECODE_STATE = ("_compiled_call", "_last_compile_config", "_previous_max_cache_length", "_cache")
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_HOOK_SIDE_TABLES = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _from_deepspeed(hook: Any) -> bool:
    function = getattr(hook, "func", hook)  # functools.partial
    function = getattr(function, "__func__", function)  # bound method
    return str(getattr(function, "__module__", "") or "").startswith("deepspeed")


def _plain_module(module: torch.nn.Module, parameters: dict[int, torch.nn.Parameter],
                  copies: dict[int, torch.nn.Module]) -> torch.nn.Module:
    if id(module) in copies:  # a module shared by two parents stays shared
        return copies[id(module)]
    twin = object.__new__(type(module))
    copies[id(module)] = twin
    state = {key: value for key, value in module.__dict__.items()
             if not key.startswith("ds_") and key not in _DEEPSPEED_ATTRIBUTES and key not in _DECODE_STATE}
    state["_parameters"] = {key: None if p is None else parameters[id(p)] for key, p in module._parameters.items()}
    state["_buffers"] = dict(module._buffers)  # buffers are never partitioned: shared, read only
    state["_modules"] = {key: None if child is None else _plain_module(child, parameters, copies)
                         for key, child in module._modules.items()}
    for name in _HOOK_DICTS:
        state[name] = OrderedDict((k, hook) for k, hook in getattr(module, name).items() if not _from_deepspeed(hook))
    kept = set(state["_forward_pre_hooks"]) | set(state["_forward_hooks"])
    for name in _HOOK_SIDE_TABLES:
        state[name] = OrderedDict((k, v) for k, v in getattr(module, name).items() if k in kept)
    twin.__dict__.update(state)
    return twin


def plain_twin(policy: Any) -> tuple[torch.nn.Module, list[tuple[torch.nn.Parameter, torch.nn.Parameter]]]:
    """A module tree like ``policy`` (ZeRO-3, with its parameters gathered) whose parameters are whole copies,
    without gradients, and the ``(policy parameter, twin parameter)`` pairs (tied parameters once)."""
    policy = unwrap_model(policy)
    parameters: dict[int, torch.nn.Parameter] = {}
    pairs = []
    with torch.no_grad():
        for parameter in policy.parameters():
            copy = torch.nn.Parameter(parameter.data.detach().clone(), requires_grad=False)
            parameters[id(parameter)] = copy
            pairs.append((parameter, copy))
    twin = _plain_module(policy, parameters, {})
    return twin.eval(), pairs


class GatheredDecodeModel:
    """The plain twin a ZeRO-3 policy decodes on, built or refreshed while the policy's parameters are gathered
    (the weight-sync point) and used as it is between sync points."""

    def __init__(self) -> None:
        self._twin: Any = None
        self._source: Any = None
        self._pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        self._version: tuple | None = None
        self.copies = 0  # how many times whole weights were copied in (tests read it)

    def model_for(self, policy: Any) -> Any:
        policy = unwrap_model(policy)
        gathered = not not_gathered(policy)
        version = policy_version(policy)
        if self._twin is not None and self._source is policy and (version == self._version or not gathered):
            return self._twin
        if not gathered:
            raise RuntimeError("the ZeRO-3 policy has no gathered copy to decode on: its parameters are partitioned "
                               "and none was copied at a weight-sync point (HF rollouts must follow the pipeline's "
                               "sync point, which gathers the weights on every rank)")
        started = time.perf_counter()
        if self._twin is None or self._source is not policy:
            self._twin, self._pairs = plain_twin(policy)
            self._source = policy
            logger.info("ZeRO-3 rollouts decode on a gathered copy of the policy (%.1f MiB per rank)",
                        sum(copy.nbytes for _, copy in self._pairs) / 2**20)
        else:
            with torch.no_grad():
                for parameter, copy in self._pairs:
                    copy.copy_(parameter.data)
        self._version = version
        self.copies += 1
        logger.debug("ZeRO-3 decode copy refreshed in %.2f s", time.perf_counter() - started)
        return self._twin

    @property
    def twin(self) -> Any:
        """The whole copy now held (None once released)."""
        return self._twin

    def release(self) -> None:
        """Drop the whole copy (one model's weights per rank)."""
        self._twin = self._source = self._version = None
        self._pairs = []
