"""Adapter runs decode through merged weights (docs/design.md, Rollout backend interface).

Decoding through unmerged LoRA/DoRA layers costs every token the adapter's extra matmuls and, for DoRA, a weight
norm over each whole adapted matrix (about 3.5x slower at Qwen3-VL-2B's shape). :class:`MergedDecodeModel` keeps a
plain twin of the policy instead: the same modules without the PEFT wrappers, whose parameters are the tensors of
:func:`~coordexp.runtime.rollout.weight_export.named_tensors` (the export every engine loads, so trainable-token
rows and ``modules_to_save`` are merged the same way):

- a weight the adapter does not change is the policy's own tensor (shared storage, no copy, never written);
- a merged weight is a tensor the twin owns (the adapted layers once more in memory), refreshed in place when the
  policy's parameters changed since the last merge (:func:`policy_version`): once per optimizer step in training,
  once in all for a path that never trains. In-place refreshes keep the owned tensors at stable addresses, so a
  compiled decode (and its CUDA graphs) is not rebuilt by a refresh.

The policy is only read (its bits and in-place versions stay as they are) and no LoRA/DoRA layer of it runs while
decoding. A plain (fully fine-tuned) policy is decoded as it is.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any, Iterable

import torch

from coordexp.runtime.rollout.weight_export import is_peft, named_tensors, policy_version, unwrap_model

__all__ = ["MergedDecodeModel", "plain_structure"]

logger = logging.getLogger("coordexp.rollout.hf")


def _peft_wrapper_classes() -> tuple[type, ...]:
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    return AuxiliaryTrainingWrapper, BaseTunerLayer


def _unwrapped(module: Any, aux: type, tuner_layer: type) -> Any:
    """The plain module a PEFT wrapper stands for (``modules_to_save`` / trainable tokens: the original module;
    a LoRA layer: its base layer), or None when ``module`` is no wrapper."""
    if isinstance(module, aux):
        return module.original_module
    if isinstance(module, tuner_layer):
        return module.get_base_layer()
    return None


def plain_structure(policy: Any) -> Any:
    """A module tree like the PEFT policy's base model with every PEFT wrapper replaced by the module it wraps,
    sharing ALL of the policy's parameters and buffers (a structural copy: no tensor is copied). The caller rebinds
    the weights that differ (merged ones) before using it. The shared parameters ARE the policy's: nothing here may
    set their flags (a ``requires_grad_(False)`` on the twin once froze the policy's trainable biases)."""
    base = unwrap_model(policy).get_base_model()
    shared: dict[int, Any] = {id(t): t for t in base.parameters()}
    shared.update({id(t): t for t in base.buffers()})
    twin = copy.deepcopy(base, shared)
    for attribute in ("_compiled_call", "_last_compile_config", "_previous_max_cache_length"):
        twin.__dict__.pop(attribute, None)  # a compiled decode belongs to the module it was compiled for
    twin.__dict__.pop("peft_config", None)  # PEFT's mark on the model it wraps: the twin is a plain model
    aux, tuner_layer = _peft_wrapper_classes()
    while True:  # outermost wrappers first; a wrapper inside a wrapper is found on the next pass
        replaced: list[str] = []
        for name, module in twin.named_modules():
            if name and not any(name.startswith(done + ".") for done in replaced):
                plain = _unwrapped(module, aux, tuner_layer)
                if plain is not None:
                    twin.set_submodule(name, plain)
                    replaced.append(name)
        if not replaced:
            break
    return twin.eval()


def _storages(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


class MergedDecodeModel:
    """The module to decode a policy through: the policy itself when it has no adapter, else its merged twin,
    (re)merged only when the policy's parameters changed since the last merge."""

    def __init__(self) -> None:
        self._twin: Any = None
        self._source: Any = None
        self._version: tuple | None = None
        self._slots: dict[str, list[tuple[Any, str]]] = {}  # HF name -> every (module, leaf) that holds it (ties)
        self._owned: set[str] = set()  # names whose twin tensor is a merged copy (refreshed in place)
        self.merges = 0  # how many times the merged weights were (re)built (tests and logs read it)
        self.last_merge_s = 0.0

    def model_for(self, policy: Any) -> Any:
        """What to run ``generate`` on for ``policy`` now (merging first when its weights changed)."""
        policy = unwrap_model(policy)
        if not is_peft(policy):
            return policy
        version = policy_version(policy)
        if self._twin is None or self._source is not policy:
            self._build(policy)
        elif version != self._version:
            self._refresh(policy)
        else:
            return self._twin
        self._version = version
        return self._twin

    def release(self) -> None:
        """Drop the twin (its merged tensors are freed; the policy's are untouched)."""
        self._twin = self._source = self._version = None
        self._slots, self._owned = {}, set()

    @property
    def twin(self) -> Any:
        return self._twin

    def _build(self, policy: Any) -> None:
        started = time.perf_counter()
        twin = plain_structure(policy)
        by_tensor: dict[int, list[tuple[Any, str]]] = {}
        names_of: dict[int, str] = {}
        for module_name, module in twin.named_modules(remove_duplicate=False):
            for leaf, parameter in module.named_parameters(recurse=False):
                by_tensor.setdefault(id(parameter), []).append((module, leaf))
                names_of.setdefault(id(parameter), f"{module_name}.{leaf}" if module_name else leaf)
        slots = {name: by_tensor[key] for key, name in names_of.items()}
        policy_storages = _storages(policy.parameters())
        bound: set[str] = set()
        for name, tensor in named_tensors(policy):
            if name not in slots:
                raise RuntimeError(f"the merged export names {name!r}, which the plain twin of the policy does not "
                                   "have; decoding through merged weights cannot place it (set "
                                   "rollout_matching.hf_generate.merge_adapter: false to decode unmerged)")
            self._bind(slots[name], tensor)
            bound.add(name)
            if tensor.untyped_storage().data_ptr() not in policy_storages:
                self._owned.add(name)
        missing = sorted(set(slots) - bound)
        if missing:
            raise RuntimeError(f"the merged export left {len(missing)} weight(s) of the plain twin unset (e.g. "
                               f"{missing[0]}); decoding would use unmerged values")
        self._twin, self._source, self._slots = twin, policy, slots
        self.merges += 1
        self.last_merge_s = time.perf_counter() - started
        owned_bytes = sum(slots[n][0][0].get_parameter(slots[n][0][1]).nbytes for n in self._owned)
        logger.info("adapter rollouts decode through merged weights: %d merged tensors (%.1f MiB besides the policy), "
                    "built in %.2f s", len(self._owned), owned_bytes / 2**20, self.last_merge_s)

    def _refresh(self, policy: Any) -> None:
        started = time.perf_counter()
        with torch.no_grad():
            for name, tensor in named_tensors(policy):
                slots = self._slots[name]
                current = slots[0][0].get_parameter(slots[0][1])
                if name in self._owned and current.shape == tensor.shape and current.dtype == tensor.dtype:
                    current.copy_(tensor)  # a merged copy: same address, new values
                elif current.data_ptr() != tensor.data_ptr():
                    self._bind(slots, tensor)  # a shared tensor that moved: point at it, never write into it
        self.merges += 1
        self.last_merge_s = time.perf_counter() - started

    @staticmethod
    def _bind(slots: list[tuple[Any, str]], tensor: torch.Tensor) -> None:
        parameter = torch.nn.Parameter(tensor.detach(), requires_grad=False)
        for module, leaf in slots:
            module._parameters[leaf] = parameter
