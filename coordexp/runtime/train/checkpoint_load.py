"""Resume loads a checkpoint's weights under the model's own parameter names.

transformers 5 saves Qwen-VL checkpoints under their legacy names (``visual.*``, ``model.layers.*``) while the live
model names them ``model.visual.*``, ``model.language_model.*``; ``Trainer._load_from_checkpoint`` loads the file
as is with ``strict=False``, so nothing matched and a resumed run silently trained on from the BASE weights (found by
the resume-reproducibility test). Here the saved names are derived from the model itself (transformers' own
save-time renaming, applied to the live parameters), every saved tensor is copied into its parameter, and a
checkpoint that does not cover the model is an error, never a silent partial load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from coordexp.errors import UserInputError

__all__ = ["CheckpointMismatchError", "saved_name_map", "load_checkpoint_weights"]

_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"


class CheckpointMismatchError(UserInputError, ValueError):
    """The checkpoint's tensors do not cover the model being resumed (another model, or a damaged checkpoint)."""


def saved_name_map(model: Any) -> dict[str, str]:
    """``{name in a saved checkpoint: name in model.state_dict()}`` (the identity when transformers renames nothing)."""
    own = model.state_dict(keep_vars=True)
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: checkpoints use the model's names
        return {k: k for k in own}
    by_identity = {id(tensor): name for name, tensor in own.items()}
    mapping: dict[str, str] = {}
    for saved, tensor in revert_weight_conversion(model, dict(own)).items():
        name = by_identity.get(id(tensor))
        if name is None:  # a converter built a new tensor (fused experts...): not a pure renaming
            raise NotImplementedError(f"saved tensor {saved} is not one of the model's parameters")
        mapping[saved] = name
    return mapping


def _saved_files(checkpoint: Path) -> list[Path] | None:
    if (checkpoint / _SINGLE).is_file():
        return [checkpoint / _SINGLE]
    if (checkpoint / _INDEX).is_file():
        weight_map = json.loads((checkpoint / _INDEX).read_text(encoding="utf-8"))["weight_map"]
        return [checkpoint / f for f in sorted(set(weight_map.values()))]
    return None


def load_checkpoint_weights(model: Any, checkpoint_dir: str | Path) -> bool:
    """Copy the safetensors weights of ``checkpoint_dir`` into ``model`` (in place, no gradient). Returns False when
    this loader does not apply (no full-model safetensors, a PEFT model, a non-renaming conversion): the caller
    then uses transformers' own. Raises :class:`CheckpointMismatchError` when tensors are missing or left over."""
    import torch
    from safetensors import safe_open

    checkpoint = Path(checkpoint_dir)
    files = _saved_files(checkpoint)
    if files is None or hasattr(model, "peft_config"):
        return False
    try:
        names = saved_name_map(model)
    except NotImplementedError:
        return False
    own = model.state_dict(keep_vars=True)
    loaded: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                for saved in handle.keys():
                    name = names.get(saved, saved if saved in own else None)
                    if name is None:
                        unexpected.append(saved)
                        continue
                    target = own[name]
                    value = handle.get_tensor(saved)
                    if tuple(value.shape) != tuple(target.shape):
                        raise CheckpointMismatchError(
                            f"{checkpoint}: tensor {saved} has shape {tuple(value.shape)}, the model's {name} "
                            f"{tuple(target.shape)}", hint="resume from a checkpoint of this run's model")
                    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                        raise CheckpointMismatchError(
                            f"{path}: tensor {saved} holds {int((~torch.isfinite(value)).sum())} non-finite "
                            "value(s) (NaN or Inf); nothing was trained", hint="resume from an earlier checkpoint-N")
                    target.copy_(value.to(dtype=target.dtype))
                    loaded.add(name)
    loaded_ids = {id(own[n]) for n in loaded}
    missing = [n for n, t in own.items() if n not in loaded and id(t) not in loaded_ids]  # tied weights count once
    if missing or unexpected:
        raise CheckpointMismatchError(
            f"{checkpoint} does not match the model: {len(missing)} parameter(s) missing (e.g. {missing[:3]}), "
            f"{len(unexpected)} unknown tensor(s) (e.g. {unexpected[:3]})",
            hint="resume from a checkpoint written by this run's model (training.output_dir/checkpoint-N)")
    return True
