"""``tuner.target_regex`` checked at validate time, before any model loads: its cost bounded
(:mod:`coordexp.schema.regex_guard`) and its matches over the module names of every supported Qwen-VL family
(:mod:`coordexp.schema.qwen_vl_modules`, generated from transformers) limited to layers PEFT's LoRA can adapt. A
pattern such as ``.*`` would reach PEFT, which stops with "Target module ... is not supported" on the first norm or
container it matches; here it is refused with those module names and the fix. The checkpoint's own names are
checked again when training starts (``runtime.model.tuner.resolve_targets``)."""

from __future__ import annotations

from functools import lru_cache

from coordexp.schema.qwen_vl_modules import QWEN_VL_MODULES
from coordexp.schema.regex_guard import RegexCostError, compile_bounded, fullmatching, representative_names

__all__ = ["TARGET_REGEX_HINT", "target_regex_problem"]

TARGET_REGEX_HINT = ("PEFT fullmatches it against full module names; anchor it on the layers to adapt, e.g. "
                     r".*\.(q_proj|k_proj|v_proj|o_proj) or model\.language_model\.layers\.\d+\.mlp\..*_proj")
_SHOWN = 6


@lru_cache(maxsize=1)
def _names() -> tuple[tuple[str, ...], dict[str, tuple[str, str]]]:
    """Representative module names of all families, and (class, template) of each one LoRA cannot adapt in any
    family (a name adaptable in one family is never refused)."""
    kinds: dict[str, set[tuple[str, bool]]] = {}
    templates: dict[str, str] = {}
    for modules in QWEN_VL_MODULES.values():
        for template, kind in modules.items():
            for name in representative_names([template]):
                kinds.setdefault(name, set()).add(kind)
                templates.setdefault(name, template)
    unsupported = {name: (sorted(k)[0][0], templates[name]) for name, k in kinds.items() if not any(ok for _, ok in k)}
    return tuple(kinds), unsupported


def target_regex_problem(pattern: str) -> str | None:
    """Why ``pattern`` cannot be a ``target_regex`` (too costly, nested too deeply, matching a module LoRA cannot
    adapt in a Qwen-VL model), or None."""
    try:
        hits = fullmatching(compile_bounded(pattern), _names()[0])
    except RegexCostError as exc:
        return f"target_regex {exc}"
    unsupported = _names()[1]
    bad = [name for name in hits if name in unsupported]
    if not bad:
        return None
    one_per_kind = list({unsupported[name][1]: name for name in reversed(bad)}.values())[::-1]  # first of each
    shown = ", ".join(f"{name} ({unsupported[name][0]})" for name in one_per_kind[:_SHOWN])
    more = f", ... ({len(one_per_kind)} kinds in all)" if len(one_per_kind) > _SHOWN else ""
    return (f"target_regex also matches Qwen-VL modules PEFT's LoRA cannot adapt (it wraps only Linear, Embedding "
            f"and Conv layers): {shown}{more}")
