"""Optimizer parameter groups: a learning rate and weight decay per model part (llm / vision / aligner, the one
map in :mod:`coordexp.runtime.model.parts`), with Hugging Face's no-decay rule for biases and norm weights
(docs/design.md, decision 13). The optimizer class and its kwargs stay HF's, so ``training.optim`` still works.
An adapter run's coord rows (PEFT trainable tokens of the embeddings and head) get groups of their own, at the
``tuner.coord_*`` rates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

from coordexp.runtime.model.parts import PARTS, model_part

if TYPE_CHECKING:
    from coordexp.schema.training import TrainingConfig
    from coordexp.schema.tuner import TunerConfig

__all__ = ["PartRate", "COORD_ROW_GROUPS", "part_rates", "coord_row_rates", "describe_coord_rows", "parameter_groups",
           "describe_groups", "grouped_optimizer"]

COORD_ROW_GROUPS = ("coord_embed", "coord_head", "coord_tied")
"""Groups of the coord rows: the input embeddings', lm_head's, and the one table of a tied checkpoint."""


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


def coord_row_rates(training: "TrainingConfig", tuner: "TunerConfig | None") -> dict[str, PartRate]:
    """The coord rows' rates per group (a tied table takes the embeddings' rate); empty when they do not train."""
    if tuner is None or not tuner.trains_coord_rows:
        return {}
    lr, wd = training.learning_rate, training.weight_decay
    decay = wd if tuner.coord_weight_decay is None else tuner.coord_weight_decay
    embed = lr if tuner.coord_embed_lr is None else tuner.coord_embed_lr
    head = lr if tuner.coord_head_lr is None else tuner.coord_head_lr
    return {"coord_embed": PartRate("coord_embed", embed, decay), "coord_head": PartRate("coord_head", head, decay),
            "coord_tied": PartRate("coord_tied", embed, decay)}


def describe_coord_rows(training: "TrainingConfig", tuner: "TunerConfig") -> str | None:
    """Preflight's line for the coord rows (the model is not loaded yet, so both tied and untied readings)."""
    rates = coord_row_rates(training, tuner)
    if not rates:
        return None
    embed, head = rates["coord_embed"], rates["coord_head"]
    return (f"coord rows: embeddings lr {embed.lr:g}, lm_head lr {head.lr:g} (tied: one table at {embed.lr:g}), "
            f"weight_decay {embed.weight_decay:g}")


def _coord_row_roles(model: Any) -> dict[int, str]:
    """``id(parameter) -> group`` for PEFT's trainable-token tables: the input embeddings', lm_head's, or the one
    table a tied head shares with the embeddings."""
    model = getattr(model, "module", model)
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tables: dict[int, tuple[Any, set[str]]] = {}
    for module in model.modules():
        delta = getattr(getattr(module, "token_adapter", None), "trainable_tokens_delta", None)
        if delta is None:
            continue
        entry = tables.setdefault(id(delta), (delta, set()))
        entry[1].add("coord_embed" if module is embedding else "coord_head")
    roles = {}
    for delta, users in tables.values():
        role = "coord_tied" if len(users) > 1 else next(iter(users))
        roles.update({id(p): role for p in delta.values()})
    return roles


def parameter_groups(model: Any, training: "TrainingConfig", decay_names: Iterable[str],
                     tuner: "TunerConfig | None" = None) -> list[dict[str, Any]]:
    """Torch param groups, at most two per part (decayed, and biases/norms at weight decay 0), then one per coord
    row table (``tuner.coord_*`` rates): trainable parameters only, empty groups omitted. Each group also carries
    ``part`` and ``decay`` for the logs."""
    decay = set(decay_names)
    rates = part_rates(training)
    coord_rates = coord_row_rates(training, tuner)
    roles = _coord_row_roles(model) if coord_rates else {}
    buckets: dict[tuple[str, bool], list[Any]] = {}
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            role = roles.get(id(parameter))
            key = (role, True) if role is not None else (model_part(name), name in decay)
            buckets.setdefault(key, []).append(parameter)
    groups = []
    for part in PARTS:
        for decayed in (True, False):
            params = buckets.get((part, decayed))
            if params:
                rate = rates[part]
                groups.append({"params": params, "lr": rate.lr, "weight_decay": rate.weight_decay if decayed else 0.0,
                               "part": part, "decay": decayed})
    for role in COORD_ROW_GROUPS:
        params = buckets.get((role, True))
        if params:
            rate = coord_rates[role]
            groups.append({"params": params, "lr": rate.lr, "weight_decay": rate.weight_decay, "part": role,
                           "decay": True})
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


def grouped_optimizer(trainer: Any, model: Any, training: "TrainingConfig", tuner: "TunerConfig | None" = None) -> Any:
    """HF's optimizer class and kwargs (``Trainer.get_optimizer_cls_and_kwargs``) over the per-part groups (and the
    coord rows' under ``tuner``); the no-decay names are ``Trainer.get_decay_parameter_names``'s."""
    groups = parameter_groups(model, training, trainer.get_decay_parameter_names(model), tuner)
    if not groups:
        raise ValueError("no trainable parameter: every part is frozen (tuner.freeze_*)")
    optimizer_cls, kwargs = trainer.get_optimizer_cls_and_kwargs(trainer.args, model)
    if {"params", "model", "optimizer_dict"} & set(kwargs):  # GaLore / LOMO / layer-wise build their own groups
        raise ValueError(f"optim {trainer.args.optim} builds its own parameter groups; coordexp needs per-part groups")
    return optimizer_cls(groups, **kwargs)
