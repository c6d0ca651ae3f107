"""Checks on a saved checkpoint's files before any of them is loaded: a broken checkpoint (missing, empty or corrupt
``config.json``, no weights, a truncated or corrupt safetensors file, an index naming a missing shard, unreadable
tokenizer or processor files, a broken adapter) is a :class:`CheckpointFileError` (exit 2) naming the file and what
to do, instead of an exception from deep inside transformers. Reads are bounded and never block: every file must be
a regular file (a FIFO is refused before it is opened) and JSON files are capped at :data:`MAX_JSON_BYTES`.

A safetensors file is ``8-byte little-endian header length N``, ``N`` bytes of JSON header, then the tensor data;
the header's largest ``data_offsets`` end must equal the data size, so a truncated file is caught by its size alone.
``config.json`` must describe the model the weights hold: a config that asks for more layers or parameters than the
safetensors files store (a config from another model size, or transformers' defaults when keys are missing) is
refused before the model is built, since building it would allocate the larger model (tens of GB for the defaults).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
from pathlib import Path
from typing import Any, Optional, Sequence

from coordexp.errors import UserInputError

__all__ = ["share_saved_weights", "CheckpointFileError", "MAX_JSON_BYTES", "WEIGHT_FILES", "ADAPTER_WEIGHT_FILES",
           "check_model_dir", "check_adapter_dir", "check_safetensors", "read_json_object", "load_checked_processor",
           "model_identity"]

MAX_JSON_BYTES = 64 * 2**20  # config, tokenizer and index JSON files (a tokenizer.json is a few MiB)
_MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own reader refuses larger headers
_SAFETENSORS_DTYPES = frozenset({"BOOL", "U8", "I8", "U16", "I16", "F16", "BF16", "U32", "I32", "F32", "U64",
                                 "I64", "F64", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2",
                                 "C64", "I4", "U4"})
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
ADAPTER_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json",
               "generation_config.json", "special_tokens_map.json")
_HINT = "point at a complete checkpoint (saved with save_pretrained); re-save or re-download this one"


class CheckpointFileError(UserInputError, ValueError):
    """A checkpoint directory's files cannot be loaded; the message names the file and what is wrong."""


def _regular(path: Path) -> os.stat_result:
    try:
        info = os.stat(path)
    except OSError as exc:
        raise CheckpointFileError(f"{path}: cannot read ({exc.strerror or exc})", hint=_HINT) from None
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointFileError(f"{path}: not a regular file", hint=_HINT)
    return info


def _read_bounded(path: Path, limit: int) -> bytes:
    info = _regular(path)
    if info.st_size > limit:
        raise CheckpointFileError(f"{path}: {info.st_size} bytes, over the {limit}-byte limit for this file",
                                  hint=_HINT)
    chunks: list[bytes] = []
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        try:
            while sum(map(len, chunks)) <= limit:
                chunk = os.read(fd, 1 << 22)
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            os.close(fd)
    except OSError as exc:
        raise CheckpointFileError(f"{path}: cannot read ({exc.strerror or exc})", hint=_HINT) from None
    data = b"".join(chunks)
    if len(data) > limit:
        raise CheckpointFileError(f"{path}: over the {limit}-byte limit for this file", hint=_HINT)
    return data


def read_json_object(path: Path) -> dict[str, Any]:
    """``path`` parsed as one JSON object: a regular file within :data:`MAX_JSON_BYTES`, any depth of nesting
    refused without a ``RecursionError``; a :class:`CheckpointFileError` naming the file otherwise."""
    return _read_json_object(path)


def _read_json_object(path: Path) -> dict[str, Any]:
    raw = _read_bounded(path, MAX_JSON_BYTES)
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:160]
        raise CheckpointFileError(f"{path}: not valid JSON ({reason})", hint=_HINT) from None
    if not isinstance(value, dict):
        raise CheckpointFileError(f"{path}: expected a JSON object, got {type(value).__name__}", hint=_HINT)
    return value


def check_safetensors(path: Path) -> dict[str, list[int]]:
    """Header readable, every tensor's dtype/shape/offsets consistent, and the file exactly as long as its header
    says (a truncated download or an interrupted save fails here); returns tensor name -> shape."""
    size = _regular(path).st_size
    try:
        with open(path, "rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                raise CheckpointFileError(f"{path}: {size} bytes, too short for a safetensors file", hint=_HINT)
            (length,) = struct.unpack("<Q", head)
            if length > min(_MAX_HEADER_BYTES, size - 8):
                raise CheckpointFileError(f"{path}: corrupt or truncated safetensors file (header of {length} bytes "
                                          f"in a {size}-byte file)", hint=_HINT)
            header_bytes = handle.read(length)
    except OSError as exc:
        raise CheckpointFileError(f"{path}: cannot read ({exc.strerror or exc})", hint=_HINT) from None
    try:
        header = json.loads(header_bytes.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise CheckpointFileError(f"{path}: corrupt safetensors header (not JSON)", hint=_HINT) from None
    if not isinstance(header, dict):
        raise CheckpointFileError(f"{path}: corrupt safetensors header (not an object)", hint=_HINT)
    end = 0
    shapes: dict[str, list[int]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(v) is int for v in offsets)
                or not 0 <= offsets[0] <= offsets[1] or not isinstance(shape, list)
                or not all(type(v) is int and v >= 0 for v in shape)
                or entry.get("dtype") not in _SAFETENSORS_DTYPES):
            raise CheckpointFileError(f"{path}: corrupt safetensors header (tensor {name[:80]!r})", hint=_HINT)
        end = max(end, offsets[1])
        shapes[name] = shape
    if 8 + length + end != size:
        raise CheckpointFileError(
            f"{path}: truncated or corrupt safetensors file ({size} bytes; its header describes {8 + length + end})",
            hint=_HINT)
    return shapes


def _check_weights(folder: Path, index_name: str) -> dict[str, list[int]] | None:
    index = _read_json_object(folder / index_name)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointFileError(f"{folder / index_name}: no \"weight_map\" of tensor -> shard file", hint=_HINT)
    shapes: dict[str, list[int]] | None = {}
    for shard in sorted(set(weight_map.values())):
        if "/" in shard or shard in ("", ".", ".."):
            raise CheckpointFileError(f"{folder / index_name}: shard name {shard[:80]!r} is not a file name",
                                      hint=_HINT)
        if shard.endswith(".safetensors"):
            found = check_safetensors(folder / shard)
            if shapes is not None:
                shapes.update(found)
        else:
            _regular(folder / shard)
            shapes = None  # pickled shards: no header to compare the config with
    return shapes


def _layers(shapes: dict[str, list[int]], vision: bool) -> int:
    pattern = re.compile(r"(?:^|\.)(?:blocks)\.(\d+)\." if vision else r"(?:^|\.)layers\.(\d+)\.")
    found = [int(m.group(1)) for name in shapes if ("visual" in name) == vision for m in [pattern.search(name)] if m]
    return max(found) + 1 if found else 0


def _check_config_matches_weights(folder: Path, shapes: dict[str, list[int]]) -> None:
    """Refuse a ``config.json`` that asks for more text layers, vision blocks or parameters than the weights hold
    (built on the meta device: no memory is allocated)."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForImageTextToText

        config = AutoConfig.from_pretrained(str(folder))
        text = config.get_text_config()
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds for a bad config; all mean "unusable"
        raise CheckpointFileError(f"{folder / 'config.json'}: transformers cannot read it "
                                  f"({type(exc).__name__}: {str(exc)[:160]})", hint=_HINT) from None
    vision = getattr(config, "vision_config", None)
    for what, wanted, held in (
        ("text layers (num_hidden_layers)", getattr(text, "num_hidden_layers", None), _layers(shapes, False)),
        ("vision blocks (vision_config.depth)", getattr(vision, "depth", None), _layers(shapes, True)),
    ):
        if isinstance(wanted, int) and held and wanted > held:
            raise CheckpointFileError(f"{folder / 'config.json'}: asks for {wanted} {what} but the weights hold "
                                      f"{held}; config.json does not belong to these weights", hint=_HINT)
    try:
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(config)
        wanted_params = sum(p.numel() for p in model.parameters())
    except Exception as exc:  # noqa: BLE001 - as above
        raise CheckpointFileError(f"{folder / 'config.json'}: transformers cannot build the model it describes "
                                  f"({type(exc).__name__}: {str(exc)[:160]})", hint=_HINT) from None
    held_params = sum(math.prod(shape) for shape in shapes.values())
    if wanted_params > held_params:
        raise CheckpointFileError(
            f"{folder / 'config.json'}: describes a model of {wanted_params:,} parameters but the weights hold "
            f"{held_params:,}; config.json does not belong to these weights (or keys are missing and transformers' "
            "defaults stand in)", hint=_HINT)


def check_model_dir(folder: str | Path, *, families: Optional[Sequence[str]] = None, model_check: bool = True
                    ) -> None:
    """A full checkpoint directory: ``config.json`` an object whose ``model_type`` is one of ``families`` (when
    given), weights present and intact, tokenizer/processor JSON files (when present) readable, and
    (``model_check``) a config that matches the weights."""
    folder = Path(folder)
    config = _read_json_object(folder / "config.json")
    family = config.get("model_type")
    if not isinstance(family, str):
        raise CheckpointFileError(f"{folder / 'config.json'}: no \"model_type\"", hint=_HINT)
    if families is not None and family not in families:
        raise CheckpointFileError(f"{folder}: model_type {family[:80]!r} is not a supported Qwen-VL family; coordexp "
                                  f"trains {', '.join(families)} (Qwen2-VL, Qwen2.5-VL, Qwen3-VL checkpoints)")
    present = [name for name in WEIGHT_FILES if os.path.lexists(folder / name)]
    if not present:
        raise CheckpointFileError(f"{folder}: no weights ({', '.join(WEIGHT_FILES)})", hint=_HINT)
    name = present[0]
    shapes: dict[str, list[int]] | None = None
    if name.endswith(".index.json"):
        shapes = _check_weights(folder, name)
    elif name.endswith(".safetensors"):
        shapes = check_safetensors(folder / name)
    else:
        _regular(folder / name)
    for json_name in _JSON_FILES:
        if os.path.lexists(folder / json_name):
            _read_json_object(folder / json_name)
    if shapes and model_check:
        _check_config_matches_weights(folder, shapes)


def check_adapter_dir(folder: str | Path) -> None:
    """A saved LoRA adapter: ``adapter_config.json`` an object, adapter weights present and intact."""
    folder = Path(folder)
    _read_json_object(folder / "adapter_config.json")
    present = [name for name in ADAPTER_WEIGHT_FILES if os.path.lexists(folder / name)]
    if not present:
        raise CheckpointFileError(f"{folder}: no adapter weights ({', '.join(ADAPTER_WEIGHT_FILES)})", hint=_HINT)
    if present[0].endswith(".safetensors"):
        check_safetensors(folder / present[0])
    else:
        _regular(folder / present[0])
    for json_name in _JSON_FILES:
        if os.path.lexists(folder / json_name):
            _read_json_object(folder / json_name)


def load_checked_processor(folder: str | Path, *, coord_tokens: bool = True) -> Any:
    """The processor (tokenizer + image processor) saved in ``folder``, loaded from local files only; a tokenizer or
    processor that transformers cannot build (no ``tokenizer.json``, a file of the wrong shape, an unknown class) is
    a :class:`CheckpointFileError` naming the folder, before any model weight is loaded. ``coord_tokens``: the
    tokenizer must hold the 1000 coord tokens (else any vocabulary will do)."""
    from coordexp.runtime.core.tokens import CoordVocab
    from coordexp.runtime.model.encoding import load_processor

    folder = Path(folder)
    hint = ("save the tokenizer and processor with the checkpoint (tokenizer.json, tokenizer_config.json, "
            "preprocessor_config.json; processor.save_pretrained), e.g. copy them from the base model")
    try:
        processor = load_processor(folder)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds for unusable tokenizer files
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise CheckpointFileError(f"{folder}: no usable tokenizer/processor ({type(exc).__name__}: {reason})",
                                  hint=hint) from None
    if not coord_tokens:  # expand-vocab's source: any tokenizer that holds a vocabulary
        if len(processor.tokenizer) < 2:  # without tokenizer files transformers builds an empty one
            raise CheckpointFileError(f"{folder}: the tokenizer loaded from it has no vocabulary", hint=hint)
        return processor
    try:  # without tokenizer files transformers builds an empty tokenizer instead of failing
        CoordVocab.from_tokenizer(processor.tokenizer)
    except ValueError as exc:
        raise CheckpointFileError(f"{folder}: the tokenizer loaded from it is not usable ({exc})",
                                  hint=f"{hint}; add coord tokens with `coordexp expand-vocab`") from None
    return processor


def share_saved_weights(folder: str | Path) -> list[Path]:
    """Widen the ``*.safetensors`` files directly in ``folder`` to what a plain ``open()`` creates (``0o666`` minus
    the umask: 0644 under the usual 022): safetensors (0.8) writes them 0600, which a server run as another user
    on a shared cluster cannot read. Never narrows a mode; the files changed are returned."""
    mask = os.umask(0)
    os.umask(mask)
    changed = []
    for path in Path(folder).glob("*.safetensors"):
        info = path.lstat()
        if not stat.S_ISREG(info.st_mode):
            continue
        wanted = stat.S_IMODE(info.st_mode) | (0o666 & ~mask)
        if wanted != stat.S_IMODE(info.st_mode):
            os.chmod(path, wanted)
            changed.append(path)
    return changed


def model_identity(folder: str | Path) -> dict[str, Any]:
    """What names a saved model or adapter for a result file: its path, the step its ``trainer_state.json`` says
    (None for a model no run saved), and a SHA-256 over its weight files' bytes (streamed; a changed weight, a
    different checkpoint of the same run, gives another)."""
    import hashlib

    root = Path(folder)
    digest = hashlib.sha256()
    names = [name for name in (*WEIGHT_FILES, *ADAPTER_WEIGHT_FILES) if (root / name).is_file()]
    if "model.safetensors.index.json" in names:
        index = _read_json_object(root / "model.safetensors.index.json").get("weight_map") or {}
        names += sorted({str(v) for v in index.values() if isinstance(v, str) and (root / str(v)).is_file()})
    for name in names:
        digest.update(name.encode("utf-8"))
        with (root / name).open("rb") as handle:
            for block in iter(lambda: handle.read(8 << 20), b""):
                digest.update(block)
    step = None
    if (root / "trainer_state.json").is_file():
        try:
            found = read_json_object(root / "trainer_state.json").get("global_step")
            step = found if isinstance(found, int) and not isinstance(found, bool) else None
        except CheckpointFileError:
            step = None
    return {"path": str(root.resolve()), "step": step, "weights_sha256": digest.hexdigest() if names else None}
