"""Saved PEFT adapters (``train_type: lora`` output and checkpoints): recognising an adapter directory, finding its
base model and loading base + adapter (``merge_export.export_merged`` writes the merged plain checkpoint).

An adapter is read as hostile input: ``adapter_config.json`` through the bounded JSON reader and checked field by
field (a rank of 401 digits, a NaN ``lora_alpha`` or ``target_modules: 5`` is a :class:`AdapterDirError` naming the
file, exit 2), the weights through safetensors' header check and then for non-finite values. Loading is offline by
construction: the config and the weights are read from the directory here and handed to PEFT as objects, so PEFT
never gets a name it could resolve on the Hub (its ``from_pretrained`` downloads when a weights file is missing).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
from pathlib import Path
from typing import Any, Iterator

from coordexp.errors import UserInputError

logger = logging.getLogger("coordexp.adapters")

__all__ = ["ADAPTER_CONFIG", "MAX_ADAPTER_RANK", "AdapterDirError", "is_adapter_dir", "read_adapter_config",
           "local_base", "adapter_base", "adapter_peft_config", "load_adapter_weights", "attach_adapter", "hub_offline"]

ADAPTER_CONFIG = "adapter_config.json"
MAX_ADAPTER_RANK = 1 << 16
_MAX_ALPHA = 1e6
_MAX_TOKEN_INDICES = 1 << 20  # row ids of trainable_token_indices (a vocabulary has about 152k rows)
_HINT = "pass a directory written by a train_type: lora run (or re-save the adapter with save_pretrained)"


class AdapterDirError(UserInputError, RuntimeError):
    """A saved adapter cannot be used: unreadable or invalid config or weights, not LoRA, no usable base."""


def is_adapter_dir(path: str | Path) -> bool:
    """Whether ``path`` holds a saved PEFT adapter (``adapter_config.json``) rather than a full checkpoint."""
    path = Path(path)
    return (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").is_file()


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _names_problem(key: str, value: Any, *, regex_ok: bool) -> str | None:
    if value is None:
        return None
    if isinstance(value, str) and regex_ok:
        from coordexp.schema.regex_guard import RegexCostError, compile_bounded

        try:
            compile_bounded(value)
        except RegexCostError as exc:
            return f'"{key}" is a regex that {exc}'
        return None
    if isinstance(value, list) and len(value) <= 100_000 and all(isinstance(v, str) and v for v in value):
        return None
    return f'"{key}" must be {"a regex or " if regex_ok else ""}a list of module names, got {_short(value)}'


def _fields_problem(config: dict[str, Any]) -> str | None:
    """What is wrong with the LoRA fields PEFT reads (None when they are usable)."""
    r = config.get("r", 8)
    if type(r) is not int or not 1 <= r <= MAX_ADAPTER_RANK:
        return f'"r" (the rank) must be an integer from 1 to {MAX_ADAPTER_RANK}, got {_short(r)}'
    alpha = config.get("lora_alpha", 8)
    if not _finite(alpha) or not 0 < alpha <= _MAX_ALPHA:
        return f'"lora_alpha" must be a finite number in (0, {_MAX_ALPHA:g}], got {_short(alpha)}'
    dropout = config.get("lora_dropout", 0.0)
    if not _finite(dropout) or not 0 <= dropout < 1:
        return f'"lora_dropout" must be a number in [0, 1), got {_short(dropout)}'
    for key, regex_ok in (("target_modules", True), ("modules_to_save", False), ("exclude_modules", True)):
        problem = _names_problem(key, config.get(key), regex_ok=regex_ok)
        if problem:
            return problem
    for key, valid in (("rank_pattern", lambda v: type(v) is int and 1 <= v <= MAX_ADAPTER_RANK),
                       ("alpha_pattern", lambda v: _finite(v) and 0 < v <= _MAX_ALPHA)):
        pattern = config.get(key) or {}
        if not isinstance(pattern, dict) or not all(isinstance(k, str) and valid(v) for k, v in pattern.items()):
            return f'"{key}" must map module names to {"ranks" if key == "rank_pattern" else "alphas"}, got ' \
                   f"{_short(pattern)}"
    for key in ("use_dora", "use_rslora", "fan_in_fan_out", "inference_mode"):
        if key in config and not isinstance(config[key], bool):
            return f'"{key}" must be true or false, got {_short(config[key])}'
    if config.get("bias", "none") not in ("none", "all", "lora_only"):
        return f'"bias" must be none, all or lora_only, got {_short(config.get("bias"))}'
    problem = _token_indices_problem(config.get("trainable_token_indices"))
    if problem:
        return problem
    base = config.get("base_model_name_or_path")
    if base is not None and (not isinstance(base, str) or "\x00" in base or len(base) > 4096):
        return f'"base_model_name_or_path" must be a path or a model id, got {_short(base)}'
    return None


def _index_list(value: Any) -> bool:
    return isinstance(value, list) and len(value) <= _MAX_TOKEN_INDICES and all(
        type(v) is int and v >= 0 for v in value)


def _token_indices_problem(value: Any) -> str | None:
    """``trainable_token_indices``: row ids (for the input embedding), or module names mapped to row ids."""
    if value is None or _index_list(value) or (isinstance(value, dict) and all(
            isinstance(k, str) and k and _index_list(v) for k, v in value.items())):
        return None
    return ('"trainable_token_indices" must be a list of row ids (integers >= 0) or map module names to such '
            f"lists, got {_short(value)}")


def _token_rows_problem(model: Any, config: Any) -> str | None:
    """A ``trainable_token_indices`` row past the base's vocabulary (PEFT would raise IndexError mid-load)."""
    value = getattr(config, "trainable_token_indices", None)
    embeddings = model.get_input_embeddings() if value else None
    if embeddings is None:
        return None
    rows = int(embeddings.weight.shape[0])
    lists = value.values() if isinstance(value, dict) else [value]
    beyond = max((i for ids in lists for i in ids), default=-1)
    if beyond >= rows:
        return f'"trainable_token_indices" names row {beyond}, but the base\'s vocabulary has {rows} rows'
    return None


def read_adapter_config(adapter_dir: str | Path) -> dict[str, Any]:
    """``adapter_config.json`` of ``adapter_dir``: a bounded read (any nesting depth refused without a
    ``RecursionError``), a PEFT LoRA config whose fields PEFT can use; an :class:`AdapterDirError` naming the file
    and what is wrong otherwise."""
    from coordexp.runtime.model.checkpoint_files import CheckpointFileError, read_json_object

    path = Path(adapter_dir) / ADAPTER_CONFIG
    try:
        config = read_json_object(path)
    except CheckpointFileError as exc:
        raise AdapterDirError(f"{exc.message} (the adapter config)", hint=_HINT) from None
    if config.get("peft_type") != "LORA":
        raise AdapterDirError(f"{path}: not a PEFT LoRA adapter config (peft_type {_short(config.get('peft_type'))})",
                              hint=_HINT)
    problem = _fields_problem(config)
    if problem:
        raise AdapterDirError(f"{path}: {problem}", hint=_HINT)
    return config


def local_base(candidate: str, adapter_dir: Path) -> bool:
    """Whether ``candidate`` is a local checkpoint (its config.json exists); a path that exists but cannot be read
    is an :class:`AdapterDirError` saying so, never "not found"."""
    try:
        os.stat(Path(candidate).expanduser() / "config.json")
    except (FileNotFoundError, NotADirectoryError):
        return False
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        if getattr(exc, "errno", None) == errno.ENAMETOOLONG:
            return False  # a hub id never is this long; treated as no local checkpoint
        raise AdapterDirError(f"{adapter_dir}: its base checkpoint {candidate} cannot be read ({reason})",
                              hint="make the base checkpoint readable, or point at a copy you may read") from None
    return True


def adapter_base(adapter_dir: str | Path, fallback: str | Path | None = None) -> str:
    """The base checkpoint of ``adapter_dir``: its ``base_model_name_or_path`` when that is a local checkpoint,
    else ``fallback`` (the config's ``model.path``); a :class:`AdapterDirError` naming both when neither is usable."""
    adapter_dir = Path(adapter_dir)
    recorded = read_adapter_config(adapter_dir).get("base_model_name_or_path")
    for candidate in (recorded, fallback):
        if candidate and local_base(str(candidate), adapter_dir):
            if candidate is fallback and isinstance(recorded, str) and recorded.startswith(("/", ".", "~")):
                logger.warning("%s records its base model as %s, which is not a local checkpoint (moved or deleted); "
                               "using %s (model.path) instead: an adapter on another base than it was trained on "
                               "gives other figures", adapter_dir, recorded, fallback)
            return str(candidate)
    if fallback is not None and not str(fallback).startswith(("/", ".", "~")) and not is_adapter_dir(fallback):
        return str(fallback)  # a hub id: from_pretrained resolves it
    raise AdapterDirError(
        f"{adapter_dir} is a LoRA adapter, but its base model {recorded!r} is not a local checkpoint"
        + (f" and neither is {fallback}" if fallback is not None else ""),
        hint="point model.path at the base checkpoint the adapter was trained on")


def adapter_peft_config(adapter_dir: str | Path, *, trainable: bool = False) -> Any:
    """The PEFT ``LoraConfig`` of ``adapter_dir`` (built from the checked file, never looked up by name)."""
    from peft import LoraConfig

    config = dict(read_adapter_config(adapter_dir))
    config.pop("runtime_config", None)  # PEFT's own reader drops it too
    try:
        peft_config = LoraConfig.from_peft_type(**LoraConfig.check_kwargs(**config))
    except (TypeError, ValueError, KeyError) as exc:
        raise AdapterDirError(f"{Path(adapter_dir) / ADAPTER_CONFIG}: PEFT refuses it ({str(exc)[:200]})",
                              hint=_HINT) from None
    peft_config.inference_mode = not trainable
    return peft_config


def load_adapter_weights(adapter_dir: str | Path) -> dict[str, Any]:
    """The adapter's tensors: the safetensors file (header and size checked first) or ``adapter_model.bin``
    (``weights_only``); every floating tensor finite. An :class:`AdapterDirError` naming the file (and the tensor)
    otherwise."""
    import torch

    from coordexp.runtime.model.checkpoint_files import ADAPTER_WEIGHT_FILES, CheckpointFileError, check_safetensors

    folder = Path(adapter_dir)
    present = [name for name in ADAPTER_WEIGHT_FILES if os.path.lexists(folder / name)]
    if not present:
        raise AdapterDirError(f"{folder}: no adapter weights ({', '.join(ADAPTER_WEIGHT_FILES)})", hint=_HINT)
    path = folder / present[0]
    try:
        if path.suffix == ".safetensors":
            check_safetensors(path)
            from safetensors.torch import load_file

            weights = load_file(str(path))
        else:
            weights = torch.load(path, map_location="cpu", weights_only=True)
    except CheckpointFileError as exc:
        raise AdapterDirError(exc.message, hint=_HINT) from None
    except Exception as exc:  # noqa: BLE001 - safetensors/pickle raise many kinds for a corrupt file
        raise AdapterDirError(f"{path}: cannot read the adapter weights ({type(exc).__name__}: {str(exc)[:160]})",
                              hint=_HINT) from None
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise AdapterDirError(f"{path}: not a mapping of tensor names to tensors", hint=_HINT)
    for name, tensor in weights.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise AdapterDirError(f"{path}: tensor {name} holds {bad} non-finite value(s) (NaN or Inf)",
                                  hint="the adapter diverged or was corrupted: use an earlier checkpoint-N")
    return weights


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """The Hugging Face Hub client refuses every request inside (``HF_HUB_OFFLINE`` whatever the environment says):
    a local load that would fall back to a download fails instead of reaching the network."""
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover - transformers depends on it
        yield
        return
    before = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = before


def _bounded_patterns(model: Any, config: Any, folder: Path) -> None:
    """A regex ``target_modules`` / ``exclude_modules`` matched against the base's module names within the time
    budget before PEFT runs it unbounded (schema/regex_guard.py)."""
    from coordexp.schema.regex_guard import RegexCostError, compile_bounded, fullmatching

    names = [name for name, _ in model.named_modules()]
    for key in ("target_modules", "exclude_modules"):
        pattern = getattr(config, key, None)
        if isinstance(pattern, str):
            try:
                fullmatching(compile_bounded(pattern), names)
            except RegexCostError as exc:
                raise AdapterDirError(f'{folder / ADAPTER_CONFIG}: "{key}" is a regex that {exc}', hint=_HINT) from None


def attach_adapter(model: Any, adapter_dir: str | Path, *, trainable: bool = False,
                   peft_kwargs: dict[str, Any] | None = None) -> Any:
    """``model`` (the base) wrapped in the PEFT adapter saved in ``adapter_dir``: config and weights read and
    checked here, then loaded into a fresh ``PeftModel`` (``peft_kwargs``: e.g. the adapter dtype of
    :func:`~coordexp.runtime.model.adapter_speed.peft_model_kwargs`); an adapter that does not fit the base
    (targets it lacks, tensors of other shapes, missing or extra tensors) is an :class:`AdapterDirError`."""
    from peft import PeftModel
    from peft.utils import set_peft_model_state_dict

    folder = Path(adapter_dir)
    config = adapter_peft_config(folder, trainable=trainable)
    weights = load_adapter_weights(folder)
    _bounded_patterns(model, config, folder)
    fit = "the adapter does not belong to this base model"
    problem = _token_rows_problem(model, config)
    if problem:
        raise AdapterDirError(f"{folder / ADAPTER_CONFIG}: {problem}", hint=fit)
    try:
        peft_model = PeftModel(model, config, **(peft_kwargs or {}))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise AdapterDirError(f"{folder / ADAPTER_CONFIG}: its targets do not fit the base model "
                              f"({' '.join(str(exc).split())[:200]})", hint=fit) from None
    try:
        result = set_peft_model_state_dict(peft_model, weights)
    except (RuntimeError, ValueError, KeyError) as exc:  # torch's "size mismatch for ..." is a RuntimeError
        raise AdapterDirError(f"{folder}: the adapter weights do not fit the base model "
                              f"({' '.join(str(exc).split())[:300]})", hint=fit) from None
    missing = [k for k in result.missing_keys if "lora_" in k and ".default" in k]
    if missing or result.unexpected_keys:
        what = (f"{len(missing)} adapter tensor(s) missing (e.g. {missing[0]})" if missing else
                f"{len(result.unexpected_keys)} tensor(s) with no place in the base (e.g. {result.unexpected_keys[0]})")
        raise AdapterDirError(f"{folder}: the adapter weights do not match its config: {what}", hint=fit)
    if not trainable:
        peft_model.eval()
    return peft_model
