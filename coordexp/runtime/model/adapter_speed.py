"""What an adapter run's training costs beyond the base model's, and coordexp's choices about it (docs/design.md,
decision 12):

- **Adapter dtype** (:func:`peft_model_kwargs`): ``tuner.adapter_dtype: float32`` (default) keeps PEFT's float32
  adapters under a bfloat16 model. In bfloat16 a DoRA magnitude (about 1) moves in steps of 2**-8, 40x an AdamW
  update at lr 1e-4, so it would never train; the price is a float32 copy of each adapted weight per forward,
  which ``model`` (the model's dtype) avoids for runs that accept it.
- **Dropout** (:func:`check_adapter_cost`): DoRA with ``lora_dropout > 0`` runs every adapted base layer a second
  time on the dropped-out input (in the adapter dtype, so a float32 matmul under a bfloat16 model), forward and
  backward; ``lora_dropout`` defaults to 0 for DoRA (schema) and an explicit value is warned about once.
- **DoRA's norm once per optimizer step** (:func:`cache_dora_weight_norms`), below.

PEFT's DoRA forward recomputes, for every adapted layer at every forward, ``||W + s B A||`` over the whole weight
(and ``B A`` through an identity matrix of the input width), then detaches it (DoRA paper, section 4.3): no
gradient flows through it, and its inputs change only when an optimizer step updates ``A``, ``B`` or ``W`` in place.
:func:`cache_dora_weight_norms` makes each DoRA layer reuse the last value while those tensors are unchanged
(their in-place versions and storages, moved after every optimizer step by
:func:`~coordexp.runtime.model.weight_version.note_optimizer_step`, whatever the optimizer or ZeRO stage), so the
micro-steps of one optimizer step, a gradient-checkpointing recomputation and an evaluation compute it once, and the
dense ``B @ A`` PEFT builds only as the norm's input is not built while the norm is cached (nor kept: at
Qwen3-VL-2B all-linear shapes it would be about 5.6 GB). The values are the ones PEFT computes: losses and gradients
are bit-identical with and without the cache. Both are computed without autograd (they are only used detached), so a
gradient-checkpointed recomputation that finds them cached saves the same tensors as the first forward. Merging (``get_weight_norm`` called without an adapter name) and
DeepSpeed ZeRO-3 partitions (gathered tensors may reuse storage) are never cached.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

__all__ = ["peft_model_kwargs", "check_adapter_cost", "prepare_adapter", "cache_dora_weight_norms",
           "DoraNormCache"]

logger = logging.getLogger("coordexp.tuner")


def peft_model_kwargs(tuner: Any) -> dict[str, Any]:
    """``get_peft_model`` keyword arguments of ``tuner`` (the adapter dtype)."""
    return {"autocast_adapter_dtype": getattr(tuner, "adapter_dtype", "float32") == "float32"}


def check_adapter_cost(model: Any) -> None:
    """One warning for a setting that costs a DoRA run a second base matmul per adapted layer, read from the
    adapter that will train (a new one from ``tuner.*``, or a saved one as ``model.path``: its own config)."""
    active = model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapter[0]
    config = model.peft_config[active]
    dropout = float(getattr(config, "lora_dropout", 0.0) or 0.0)
    if getattr(config, "use_dora", False) and dropout > 0:
        logger.warning("tuner.lora_dropout %.3g with DoRA runs every adapted base layer twice per forward and "
                       "backward (PEFT rescales the dropped-out input's base output); set tuner.lora_dropout: 0 "
                       "(the DoRA default) unless the dropout is wanted", dropout)


def prepare_adapter(model: Any) -> Any:
    """A PEFT ``model`` (a fresh adapter or a saved one loaded to train on) ready to train at the least cost: the
    warning above, DoRA norm caches. Every adapter that trains goes through here."""
    check_adapter_cost(model)
    cache_dora_weight_norms(model)
    return model


def _fingerprint(tensors: tuple[torch.Tensor, ...]) -> tuple | None:
    if any(hasattr(t, "ds_id") for t in tensors):  # a ZeRO-3 partition: its storage and version say nothing
        return None
    return tuple((t.untyped_storage().data_ptr(), t._version, t.dtype, t.device) for t in tensors)


def _placeholder_classes() -> tuple[type, ...]:
    """PEFT's DoRA layers whose forward reads the low-rank product only as the norm's input (checked against PEFT's
    dora.py); other kinds (convolutions reshape it) get PEFT's own product."""
    from peft.tuners.lora.dora import DoraEmbeddingLayer, DoraLinearLayer

    return DoraLinearLayer, DoraEmbeddingLayer


class DoraNormCache:
    """The detached norm of one DoRA layer, valid while its tensors are unchanged (their in-place versions, which
    :func:`~coordexp.runtime.model.weight_version.note_optimizer_step` moves after every optimizer step); ``computed``
    counts the real computations (tests read it). It holds the norm only (one vector per layer): the dense
    ``B @ A`` that PEFT's forward builds as the norm's input is not built at all while the norm is cached."""

    def __init__(self, dora_layer: Any, sources: Callable[[], tuple[torch.Tensor, ...]]):
        self.sources = sources
        self.computed = 0
        self._norm: tuple[tuple, torch.Tensor] | None = None
        self._product_args: tuple | None = None  # (lora_A, lora_B, adapter) of the forward in progress
        self._placeholder = type(dora_layer) in _placeholder_classes()
        self._norm_of = dora_layer.get_weight_norm  # the class's (PEFT's) methods, bound to this layer
        self._lora_weight_of = dora_layer.get_lora_weight

    def weight_norm(self, weight, lora_weight, scaling, adapter_name=None):
        if adapter_name is None:  # a merge or an unmerge: always PEFT's own computation
            return self._norm_of(weight, lora_weight, scaling)
        key = _fingerprint(self.sources())
        full_key = None if key is None else (key, weight.dtype, float(scaling))
        if full_key is not None and self._norm is not None and self._norm[0] == full_key:
            return self._norm[1]
        with torch.no_grad():  # used detached only; saving nothing keeps a checkpointed recomputation consistent
            if lora_weight.numel() == 0 and weight.numel() > 0:  # our placeholder: build the product now
                lora_weight = self._lora_weight_of(*self._product_args[:2],
                                                   adapter_name=self._product_args[2]).to(lora_weight.dtype)
            value = self._norm_of(weight, lora_weight, scaling, adapter_name=adapter_name)
        self.computed += 1
        self._norm = None if full_key is None else (full_key, value)
        return value

    def lora_weight(self, lora_A, lora_B, adapter_name=None):
        """DoRA's forward uses this product only as the norm's input: an empty placeholder (no memory, no matmul),
        built for real in :meth:`weight_norm` only when the norm must be computed."""
        if adapter_name is None or not self._placeholder:
            return self._lora_weight_of(lora_A, lora_B, adapter_name=adapter_name)
        self._product_args = (lora_A, lora_B, adapter_name)
        reference = lora_A.weight if isinstance(lora_A, torch.nn.Module) else lora_A
        return reference.new_empty(0)


def cache_dora_weight_norms(model: Any) -> list[DoraNormCache]:
    """Install a :class:`DoraNormCache` on every DoRA linear layer of a PEFT ``model`` (nothing for plain LoRA);
    returns them. Idempotent."""
    from peft.tuners.lora import LoraLayer

    caches: list[DoraNormCache] = []
    for module in model.modules():
        if not isinstance(module, LoraLayer) or not getattr(module, "lora_magnitude_vector", None):
            continue
        for adapter, dora_layer in module.lora_magnitude_vector.items():
            if adapter not in module.lora_A or not hasattr(dora_layer, "get_weight_norm"):
                continue
            existing = dora_layer.__dict__.get("_coordexp_norm_cache")
            if existing is not None:
                caches.append(existing)
                continue

            def sources(module=module, adapter=adapter) -> tuple[torch.Tensor, ...]:
                return (module.get_base_layer().weight, module.lora_A[adapter].weight, module.lora_B[adapter].weight)

            cache = DoraNormCache(dora_layer, sources)
            # instance attributes win over the class's methods; nn.Module keeps plain callables as attributes
            dora_layer.get_weight_norm = cache.weight_norm
            dora_layer.get_lora_weight = cache.lora_weight
            dora_layer._coordexp_norm_cache = cache
            caches.append(cache)
    return caches
