"""Weight export: the one place that turns the training policy into what a rollout engine loads.

Used by the vLLM colocate backend (in-memory reload), the server weight channel (collective broadcast) and the
weight-sync benchmark, so both engines receive the same names and values:

- :func:`named_tensors`: HF checkpoint names; a PEFT LoRA/DoRA policy is merged ON THE FLY, by PEFT's own merge
  on a copy of each adapted layer (so DoRA's magnitude rescaling is included and the result equals
  ``merge_and_unload``). The training model is never merged, unmerged or written (``merge_adapter`` would add and
  subtract the delta in place, in the training dtype, which does not round-trip bit for bit).
- :func:`adapter_state`: the active LoRA adapter as one :class:`AdapterState` (PEFT state-dict names, a JSON-plain
  ``adapter_config`` dict), the shape every caller uses; a DoRA adapter or one with trained coord rows (PEFT
  trainable tokens) is refused (vLLM cannot serve either), which sends adapter sync down its fallback to full
  merged weights. Full weights carry the trained coord rows inside the embedding and head matrices.
- :func:`policy_version` (owned by :mod:`coordexp.runtime.model.weight_version`, re-exported): the fingerprint every
  consumer keys its rebuilds and pushes on; it moves after every optimizer step the trainer records.
- DeepSpeed ZeRO-3 (docs/design.md, decision 14): each parameter holds one rank's shard; reading whole weights
  needs :func:`full_parameters` around the read, entered on every rank at the same point (the pipeline's weight-sync
  point). :func:`named_tensors` refuses partitioned parameters that are not gathered instead of exporting empties.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from coordexp.runtime.model.weight_version import policy_version, unwrap_model
from coordexp.runtime.rollout.weight_sync import WeightSyncError

__all__ = ["AdapterState", "unwrap_model", "is_peft", "policy_version", "named_tensors", "adapter_state",
           "zero3_partitioned", "not_gathered", "full_parameters"]

_PEFT_PREFIX = "base_model.model."


def is_peft(model: Any) -> bool:
    """Whether ``model`` (unwrapped) is a PEFT model (it has adapters and a wrapped base model)."""
    model = unwrap_model(model)
    return bool(getattr(model, "peft_config", None)) and hasattr(model, "base_model")


def zero3_partitioned(model: Any) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions ``model``'s parameters (they carry a ``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in unwrap_model(model).parameters())


def not_gathered(model: Any) -> list[str]:
    """The names of ZeRO-3 parameters that hold only this rank's shard right now (empty outside ZeRO-3)."""
    return [name for name, p in unwrap_model(model).named_parameters()
            if getattr(getattr(p, "ds_status", None), "name", None) == "NOT_AVAILABLE"]


@contextmanager
def full_parameters(model: Any) -> Iterator[Any]:
    """The unwrapped ``model`` with every parameter whole for the block: under ZeRO-3 one DeepSpeed gather of all
    partitioned parameters (a collective every rank must enter at the same point; read only, released on exit),
    elsewhere nothing happens. Peak memory under ZeRO-3: one whole copy of the weights per rank."""
    model = unwrap_model(model)
    partitioned = [p for p in model.parameters() if hasattr(p, "ds_id")] if hasattr(model, "parameters") else []
    if not partitioned:
        yield model
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned):
        yield model


def _active_adapter(model: Any) -> str:
    active = model.active_adapter
    return active if isinstance(active, str) else active[0]


def _merged_copy(module: Any, adapter: str) -> Any:
    """A copy of the LoRA layer ``module`` with ``adapter`` merged by PEFT's own ``merge`` (plain LoRA
    ``W + scale * B @ A``; DoRA rescales by its magnitude vector over the column norm): the live layer is only
    read, so the training weights, gradients and DoRA caches stay as they are."""
    import copy

    # gradients stay behind: a memo entry of None makes deepcopy give every copied parameter grad None
    memo: dict[int, Any] = {id(p.grad): None for p in module.parameters() if p.grad is not None}
    with torch.no_grad():
        clone = copy.deepcopy(module, memo)
        clone.merge(adapter_names=[adapter])
    return clone.get_base_layer()


def named_tensors(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights under HF checkpoint names (each parameter once; tied weights are one tensor).

    A plain model yields its detached parameters (views, no copy). A PEFT LoRA/DoRA model yields the base weights
    with the active adapter merged into NEW tensors (what ``merge_and_unload`` would leave), ``base_model.model.`` /
    ``.base_layer`` / ``modules_to_save`` spellings removed and the adapter tensors themselves skipped; the model is
    only read.
    """
    model = unwrap_model(model)
    partitioned = not_gathered(model)
    if partitioned:
        raise WeightSyncError(
            f"{len(partitioned)} parameter(s) of the policy (e.g. {partitioned[0]}) hold only this rank's DeepSpeed "
            "ZeRO-3 shard: exporting them would send empty tensors",
            hint="read the weights inside weight_export.full_parameters(model), entered on every rank")
    if not is_peft(model):
        yield from ((name, p.detach()) for name, p in model.named_parameters())
        return
    from peft.tuners.lora import LoraLayer

    adapter = _active_adapter(model)
    lora_modules = {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    token_tables = {name: module for name, module in model.named_modules() if hasattr(module, "token_adapter")}
    merged: tuple[str, Any] | None = None  # (owner, merged base layer): weight and bias come from one merge
    for name, parameter in model.named_parameters():
        if ".lora_" in name or ".original_module." in name or ".trainable_tokens_delta." in name:
            continue
        hf_name = name.removeprefix(_PEFT_PREFIX).replace(f".modules_to_save.{adapter}.", ".")
        tensor = parameter.detach()
        if ".token_adapter.base_layer." in name:  # trained coord rows: the matrix with those rows written in
            owner = name.split(".token_adapter.", 1)[0]
            hf_name = hf_name.replace(".token_adapter.base_layer.", ".")
            with torch.no_grad():  # a new tensor (index_copy), the live matrix is only read
                tensor = token_tables[owner].token_adapter.get_merged_weights([adapter]).detach()
            yield hf_name, tensor
            continue
        if ".base_layer." in name:
            owner, leaf = name.split(".base_layer.", 1)
            hf_name = hf_name.replace(".base_layer.", ".")
            module = lora_modules.get(owner)
            if module is not None and not module.merged and adapter in getattr(module, "lora_A", {}):
                if merged is None or merged[0] != owner:
                    merged = (owner, _merged_copy(module, adapter))
                tensor = merged[1].get_parameter(leaf).detach()
        yield hf_name, tensor


@dataclass(frozen=True)
class AdapterState:
    """The active LoRA adapter: its name, its ``adapter_config`` as JSON-plain data (what PEFT's
    ``save_pretrained`` writes) and its tensors under PEFT state-dict names (detached, not copied)."""

    name: str
    config: dict[str, Any]
    tensors: tuple[tuple[str, torch.Tensor], ...]


def _plain_json(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return value.value if hasattr(value, "value") else str(value)


def adapter_state(model: Any) -> AdapterState:
    """The active adapter of a PEFT LoRA policy; raises :class:`WeightSyncError` when the policy has none."""
    model = unwrap_model(model)
    if not is_peft(model):
        raise WeightSyncError(
            f"adapter weight sync needs a PEFT LoRA policy, but the policy is a {type(model).__name__} without an "
            "adapter", hint="set rollout_matching.vllm.sync.mode: full (or auto) for a fully fine-tuned model")
    from peft import get_peft_model_state_dict

    adapter = _active_adapter(model)
    if getattr(model.peft_config[adapter], "use_dora", False):
        raise WeightSyncError(
            "vLLM cannot serve a DoRA adapter (its LoRA kernels have no magnitude vector)",
            hint="DoRA rollouts need merged weights: rollout_matching.vllm.sync.mode: full (adapter mode falls back "
            "to full when sync.fallback_to_full is true)")
    if getattr(model.peft_config[adapter], "trainable_token_indices", None):
        raise WeightSyncError(
            "vLLM's LoRA cannot serve the adapter's trained coord rows (PEFT trainable tokens of the embeddings and "
            "lm_head)", hint="rollouts with trained coord rows need merged weights: rollout_matching.vllm.sync.mode: "
            "full (adapter mode falls back to full when sync.fallback_to_full is true), or tuner.train_coord_rows: "
            "false to push the LoRA adapter alone")
    tensors = get_peft_model_state_dict(model, adapter_name=adapter)
    config = json.loads(json.dumps(model.peft_config[adapter].to_dict(), default=_plain_json))
    return AdapterState(adapter, config, tuple((name, t.detach()) for name, t in tensors.items()))
