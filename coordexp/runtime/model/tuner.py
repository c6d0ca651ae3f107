"""``tuner.*`` applied to a loaded policy: freeze parts (full fine-tuning) or wrap the model in a PEFT LoRA/DoRA
adapter (docs/design.md, decision 12).

LoRA targets are resolved here, to full module names, before PEFT sees them (as ms-swift does): ``target_regex``
(matched by PEFT with ``re.fullmatch``) overrides everything; otherwise ``all-linear`` is every ``nn.Linear`` of the
unfrozen parts except ``lm_head``, and any other ``target_modules`` entry is a PEFT suffix name restricted to the
unfrozen parts. A pattern that matches nothing, or a ``modules_to_save`` entry that is no module, fails at load time
naming real module names, never as a silent adapter on nothing.

Coord rows: under ``lora`` the 1000 coord-token rows of the input embeddings and of ``lm_head`` train too (unless
``train_coord_rows: false``), through PEFT's trainable tokens (``trainable_token_indices``): only those rows are
trainable and saved with the adapter, ``merge_and_unload`` writes them into the base matrices. A checkpoint whose
``lm_head`` IS its input embedding (tied) trains one shared table (docs/design.md, decision 12).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Iterable

from coordexp.runtime.model.parts import model_part
from coordexp.errors import UserInputError

if TYPE_CHECKING:
    from coordexp.schema.tuner import TunerConfig

__all__ = ["TunerError", "frozen_parts", "apply_freeze", "adaptable_module", "resolve_targets",
           "resolve_modules_to_save", "embeddings_tied", "align_tie_flag", "coord_row_layers", "lora_config", "apply_tuner"]

_SHOWN = 10  # module names quoted in an error


class TunerError(UserInputError, RuntimeError):
    """``tuner.*`` does not fit the model (a target or module name matches nothing); the text names real modules."""


def frozen_parts(tuner: "TunerConfig") -> set[str]:
    """The parts (``llm``, ``vision``, ``aligner``) whose freeze switch is on."""
    return {part for part, off in (("llm", tuner.freeze_llm), ("vision", tuner.freeze_vit),
                                   ("aligner", tuner.freeze_aligner)) if off}


def apply_freeze(model: Any, tuner: "TunerConfig") -> Any:
    """Full fine-tuning: parameters of frozen parts stop requiring gradients; the others are left as loaded."""
    frozen = frozen_parts(tuner)
    for name, parameter in model.named_parameters():
        if model_part(name) in frozen:
            parameter.requires_grad_(False)
    return model


def adaptable_module(module: Any) -> bool:
    """Layer types PEFT's LoRA wraps (Linear, Embedding, Conv1d/2d/3d, GPT-2 style Conv1D)."""
    return _adaptable(module)


def _adaptable(module: Any) -> bool:
    """Layer types PEFT's LoRA wraps (Linear, Embedding, Conv1d/2d/3d, GPT-2 style Conv1D)."""
    import torch.nn as nn

    if isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return True
    return type(module).__name__ == "Conv1D"


def _examples(names: Iterable[str]) -> str:
    names = list(names)
    shown = ", ".join(names[:_SHOWN])
    return shown + (f", ... ({len(names)} in all)" if len(names) > _SHOWN else "")


def _per_part(names: Iterable[str], each: int = 3) -> str:
    """A few names of every part (the language model's alone would hide the visual names a regex may want)."""
    picked: dict[str, list[str]] = {}
    for name in sorted(names):
        bucket = picked.setdefault(model_part(name), [])
        if len(bucket) < each:
            bucket.append(name)
    return ", ".join(n for part in ("llm", "vision", "aligner") for n in picked.get(part, []))


def _output_head_names(model: Any) -> set[str]:
    """Names of the output projection (``lm_head``): never an ``all-linear`` target (ms-swift and PEFT agree)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {name for name, module in model.named_modules() if module is head or name.split(".")[-1] == "lm_head"}


def _inside(name: str, roots: Iterable[str]) -> bool:
    return any(name == root or name.startswith(root + ".") for root in roots)


def resolve_modules_to_save(model: Any, tuner: "TunerConfig") -> list[str]:
    """``modules_to_save`` as full module names. Each entry must name exactly one real module (full name or a
    unique dotted suffix) that PEFT can wrap: a ``ModuleList``/``ModuleDict`` is indexed, not called, so its entries
    must be listed one by one (Qwen3-VL: ``model.visual.deepstack_merger_list.0``, ...)."""
    import torch.nn as nn

    modules = dict(model.named_modules())
    resolved: list[str] = []
    for entry in tuner.modules_to_save:
        hits = [n for n in modules if n == entry or n.endswith("." + entry)]
        if not hits:
            near = [n for n in modules if entry.split(".")[-1] in n.split(".")] or list(modules)[1:]
            raise TunerError(f"tuner.modules_to_save entry {entry!r} names no module of the model; modules "
                             f"like it: {_examples(near)}", hint="use full module names (named_modules())")
        if len(hits) > 1:
            raise TunerError(f"tuner.modules_to_save entry {entry!r} names {len(hits)} modules ({_examples(hits)})",
                             hint="give the full module name of the one to train and save")
        module = modules[hits[0]]
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            children = [f"{hits[0]}.{child}" for child, _ in module.named_children()]
            raise TunerError(f"tuner.modules_to_save entry {entry!r} is a {type(module).__name__}, which the model "
                             "indexes instead of calling, so PEFT cannot wrap it",
                             hint=f"list its entries one by one: {_examples(children)}")
        resolved.append(hits[0])
    return resolved


def _check_target_regex(model: Any, regex: str, candidates: dict[str, Any], saved: list[str]) -> None:
    """What PEFT would do with ``regex``, before it runs: matching every module name within a time budget (a
    backtracking pattern fails here instead of hanging), at least one adaptable match, and no match PEFT cannot
    adapt (it raises "Target module ... is not supported" for a norm, an activation or a container)."""
    from coordexp.schema.regex_guard import RegexCostError, compile_bounded, fullmatching

    modules = dict(model.named_modules())
    try:
        matched = fullmatching(compile_bounded(regex), [n for n in modules if n and not _inside(n, saved)])
    except RegexCostError as exc:
        raise TunerError(f"tuner.target_regex {regex[:200]!r}: {exc}",
                         hint="write one quantifier per run of characters, e.g. .*\\.(q_proj|v_proj) or "
                              "model\\.language_model\\.layers\\.\\d+\\.mlp\\..*_proj") from None
    unsupported = [n for n in matched if n not in candidates]
    if unsupported:
        shown = ", ".join(f"{n} ({type(modules[n]).__name__})" for n in unsupported[:_SHOWN])
        more = f", ... ({len(unsupported)} in all)" if len(unsupported) > _SHOWN else ""
        raise TunerError(
            f"tuner.target_regex {regex[:200]!r} also matches modules PEFT's LoRA cannot adapt: {shown}{more}; "
            "LoRA wraps only Linear, Embedding and Conv layers",
            hint="anchor the pattern on the layers to adapt, e.g. .*\\.(q_proj|k_proj|v_proj|o_proj) (adaptable "
                 f"names: {_per_part(candidates)})")
    if not matched:
        raise TunerError(
            f"tuner.target_regex {regex[:200]!r} matches no Linear/Embedding/Conv module of the model "
            f"(PEFT applies it with re.fullmatch to full module names such as {_per_part(candidates)})",
            hint="anchor the regex on full names (model.language_model.layers.N..., model.visual...)")


def resolve_targets(model: Any, tuner: "TunerConfig", modules_to_save: Iterable[str] = ()) -> str | list[str]:
    """What PEFT's ``target_modules`` gets: ``target_regex`` itself (after checking it fullmatches at least one
    adaptable module), or the sorted full names that ``target_modules`` selects in the unfrozen parts."""
    saved = list(modules_to_save)
    candidates = {name: module for name, module in model.named_modules()
                  if name and _adaptable(module) and not _inside(name, saved)}
    if tuner.target_regex is not None:
        _check_target_regex(model, tuner.target_regex, candidates, saved)
        return tuner.target_regex
    frozen = frozen_parts(tuner)
    open_parts = {name: m for name, m in candidates.items() if model_part(name) not in frozen}
    heads = _output_head_names(model)
    chosen: set[str] = set()
    import torch.nn as nn

    for entry in tuner.target_modules:
        if entry == "all-linear":
            hits = {n for n, m in open_parts.items() if isinstance(m, nn.Linear) and n not in heads}
            if not hits:
                raise TunerError(
                    "tuner.target_modules all-linear selects no Linear layer: every part that has one is frozen "
                    f"(frozen: {sorted(frozen)})", hint="unfreeze a part (freeze_llm/freeze_vit/freeze_aligner: "
                    "false) or name the targets with tuner.target_regex")
        else:
            hits = {n for n in open_parts if n == entry or n.endswith("." + entry)}
            if not hits:
                in_frozen = [n for n in candidates if n == entry or n.endswith("." + entry)]
                if in_frozen:
                    parts = sorted({model_part(n) for n in in_frozen})
                    raise TunerError(f"tuner.target_modules entry {entry!r} matches only modules of frozen parts "
                                     f"({', '.join(parts)}): {_examples(in_frozen)}",
                                     hint="unfreeze that part, or select modules with tuner.target_regex")
                suffixes = sorted({n.rsplit(".", 1)[-1] for n in open_parts})
                raise TunerError(f"tuner.target_modules entry {entry!r} matches no module of the unfrozen parts; "
                                 f"their layer names: {_examples(suffixes)}",
                                 hint="use a module name suffix (q_proj, mlp.down_proj, ...) or all-linear")
        chosen |= hits
    return sorted(chosen)


def embeddings_tied(model: Any) -> bool:
    """Whether ``lm_head`` is the input embedding matrix itself (one tensor), whatever config.json claims."""
    head = model.get_output_embeddings()
    return head is not None and head.weight is model.get_input_embeddings().weight


def align_tie_flag(model: Any) -> None:
    """Make ``config.tie_word_embeddings`` say what the weights are, before PEFT reads it: PEFT ties the coord-row
    tables of embedding and head on that flag alone, and a checkpoint saved with untied weights under a tied flag
    (transformers then loads them untied) would otherwise train the head on the embedding's rows."""
    tied = embeddings_tied(model)
    if bool(getattr(model.config, "tie_word_embeddings", False)) != tied:
        model.config.tie_word_embeddings = tied


def _module_name(model: Any, module: Any) -> str:
    return next(name for name, candidate in model.named_modules() if candidate is module)


def _covered(name: str, targets: str | list[str], saved: Iterable[str]) -> bool:
    """Whether the LoRA targets or ``modules_to_save`` already train module ``name`` (PEFT wraps a layer once)."""
    if _inside(name, saved):
        return True
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return name in targets


def coord_row_layers(model: Any, tuner: "TunerConfig", coord_ids: Iterable[int], targets: str | list[str] = (),
                     saved: Iterable[str] = ()) -> dict[str, list[int]]:
    """PEFT's ``trainable_token_indices``: ``{input embedding: ids, lm_head: ids}`` (the embedding only when the
    head is tied to it), leaving out a layer the LoRA targets or ``modules_to_save`` already train; empty when
    the coord rows do not train (``train_coord_rows: false``, a frozen language model, no coord ids)."""
    ids = sorted(int(i) for i in coord_ids)
    if not ids or not tuner.trains_coord_rows:
        return {}
    embedding = model.get_input_embeddings()
    rows = embedding.weight.shape[0]
    if ids[-1] >= rows:
        raise TunerError(f"coord token id {ids[-1]} is outside the input embeddings ({rows} rows): the tokenizer does "
                         "not belong to these weights", hint="run `coordexp expand-vocab` on the base checkpoint")
    layers = [embedding] if embeddings_tied(model) else [embedding, model.get_output_embeddings()]
    saved = list(saved)
    chosen = {}
    for layer in layers:
        if layer is None:
            continue
        name = _module_name(model, layer)
        if not _covered(name, targets, saved):
            chosen[name] = ids
    return chosen


def _check_coord_rates(model: Any, tuner: "TunerConfig", layers: dict[str, list[int]]) -> None:
    if layers and embeddings_tied(model) and tuner.coord_head_lr is not None \
            and tuner.coord_head_lr != tuner.coord_embed_lr:
        raise TunerError(
            f"tuner.coord_head_lr ({tuner.coord_head_lr:g}) differs from coord_embed_lr "
            f"({'null: training.learning_rate' if tuner.coord_embed_lr is None else f'{tuner.coord_embed_lr:g}'}), "
            "but this checkpoint ties lm_head to the input embeddings: their coord rows are one table",
            hint="remove tuner.coord_head_lr (coord_embed_lr sets the shared table's rate) or make them equal")


def lora_config(model: Any, tuner: "TunerConfig", coord_ids: Iterable[int] = ()) -> Any:
    """The PEFT ``LoraConfig`` of ``tuner`` for ``model`` (targets and modules_to_save resolved to real names;
    the coord rows ``coord_ids`` of the embeddings and head as trainable tokens when they train)."""
    from peft import LoraConfig

    saved = resolve_modules_to_save(model, tuner)
    targets = resolve_targets(model, tuner, saved)
    layers = coord_row_layers(model, tuner, coord_ids, targets, saved)
    _check_coord_rates(model, tuner, layers)
    return LoraConfig(
        r=tuner.lora_rank, lora_alpha=tuner.lora_alpha, lora_dropout=tuner.lora_dropout, bias=tuner.lora_bias,
        use_dora=tuner.use_dora, target_modules=targets, modules_to_save=saved or None,
        trainable_token_indices=layers or None)


def apply_tuner(model: Any, tuner: "TunerConfig", coord_ids: Iterable[int] = ()) -> Any:
    """``model`` ready to train under ``tuner``: frozen parts for ``full``; a PEFT model for ``lora`` (base weights
    frozen, adapters on the resolved targets, ``modules_to_save`` trained in full, the rows of ``coord_ids`` in the
    embeddings and head trainable unless ``train_coord_rows`` is off)."""
    if tuner.train_type == "full":
        return apply_freeze(model, tuner)
    from peft import get_peft_model

    from coordexp.runtime.model.adapter_speed import peft_model_kwargs, prepare_adapter

    align_tie_flag(model)
    return prepare_adapter(get_peft_model(model, lora_config(model, tuner, coord_ids), **peft_model_kwargs(tuner)))
