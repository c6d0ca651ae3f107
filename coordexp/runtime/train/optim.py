"""Optimizer parameter groups: a learning rate and weight decay per model part (llm / vision / aligner, the one
map in :mod:`coordexp.runtime.model.parts`), with Hugging Face's no-decay rule for biases and norm weights
(docs/design.md, decision 13). The optimizer class and its kwargs stay HF's, so ``training.optim`` still works.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

from coordexp.runtime.model.parts import PARTS, model_part

if TYPE_CHECKING:
    from coordexp.schema.training import TrainingConfig

__all__ = ["PartRate", "part_rates", "parameter_groups", "describe_groups", "grouped_optimizer"]


@dataclass(frozen=True)
class PartRate:
    """One part's peak learning rate and weight decay (resolved: null config values fall back to the LLM's)."""

    part: str
    lr: float
    weight_decay: float


def part_rates(training: "TrainingConfig") -> dict[str, PartRate]:
    """``llm`` takes learning_rate / weight_decay; vision and aligner their own keys, or the LLM's when null."""
    lr, wd = training.learning_rate, training.weight_decay

    def pick(value: float | None, fallback: float) -> float:
        return fallback if value is None else value

    return {
        "llm": PartRate("llm", lr, wd),
        "vision": PartRate("vision", pick(training.vit_lr, lr), pick(training.vit_weight_decay, wd)),
        "aligner": PartRate("aligner", pick(training.aligner_lr, lr), pick(training.aligner_weight_decay, wd)),
    }


def parameter_groups(model: Any, training: "TrainingConfig", decay_names: Iterable[str]) -> list[dict[str, Any]]:
    """Torch param groups, at most two per part (decayed, and biases/norms at weight decay 0): trainable
    parameters only, empty groups omitted. Each group also carries ``part`` and ``decay`` for the logs."""
    decay = set(decay_names)
    rates = part_rates(training)
    buckets: dict[tuple[str, bool], list[Any]] = {}
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            buckets.setdefault((model_part(name), name in decay), []).append(parameter)
    groups = []
    for part in PARTS:
        for decayed in (True, False):
            params = buckets.get((part, decayed))
            if params:
                rate = rates[part]
                groups.append({"params": params, "lr": rate.lr, "weight_decay": rate.weight_decay if decayed else 0.0,
                               "part": part, "decay": decayed})
    return groups


def describe_groups(groups: list[dict[str, Any]]) -> list[str]:
    """One line per group: ``part[/no_decay]: lr, weight_decay, #tensors, #params``."""
    lines = []
    for g in groups:
        count = sum(p.numel() for p in g["params"])
        name = g["part"] + ("" if g["decay"] else "/no_decay")
        lines.append(f"{name}: lr {g['lr']:g}, weight_decay {g['weight_decay']:g}, {len(g['params'])} tensors, "
                     f"{count:,} params")
    return lines


def grouped_optimizer(trainer: Any, model: Any, training: "TrainingConfig") -> Any:
    """HF's optimizer class and kwargs (``Trainer.get_optimizer_cls_and_kwargs``) over the per-part groups; the
    no-decay names are ``Trainer.get_decay_parameter_names``'s."""
    groups = parameter_groups(model, training, trainer.get_decay_parameter_names(model))
    if not groups:
        raise ValueError("no trainable parameter: every part is frozen (tuner.freeze_*)")
    optimizer_cls, kwargs = trainer.get_optimizer_cls_and_kwargs(trainer.args, model)
    if {"params", "model", "optimizer_dict"} & set(kwargs):  # GaLore / LOMO / layer-wise build their own groups
        raise ValueError(f"optim {trainer.args.optim} builds its own parameter groups; coordexp needs per-part groups")
    return optimizer_cls(groups, **kwargs)
