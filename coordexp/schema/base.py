"""Base model shared by every config section (strict, closed, frozen) and the constrained-number vocabulary.

Every number in the schema is finite and bounded by what the runtime can hold; the caps below are the documented
limits (``coordexp schema`` shows them as ``minimum``/``maximum``). Bounds live in one place, here, instead of
per-field validators, so a new field picks a type from this vocabulary and is bounded by construction.
"""

from __future__ import annotations

import os
from typing import Annotated, Optional

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

__all__ = [
    "StrictModel",
    "PATH_MARKER",
    "path_extra",
    "MAX_SEED",
    "MAX_TOKENS",
    "MAX_BATCH",
    "MAX_COUNT",
    "MAX_PIXELS",
    "MAX_WEIGHT",
    "MAX_SECONDS",
    "MAX_BEAMS",
    "MIN_REPETITION_PENALTY",
    "MAX_REPETITION_PENALTY",
    "MAX_DEVICES",
    "MAX_WORKERS",
    "int_in",
    "float_in",
    "FiniteFloat",
    "NonNegFloat",
    "Probability",
    "Weight",
    "Seed",
    "TokenLength",
    "BatchSize",
    "Count",
    "PathStr",
]


class StrictModel(BaseModel):
    """A config section: YAML ``"1"`` is not an int and ``yes`` is not a bool; unknown keys fail; frozen."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, validate_default=True)


PATH_MARKER = "x-coordexp-path"
"""JSON-schema extra on string fields that hold filesystem paths. The loader resolves a relative value against
the directory of the YAML file that set it (``"hub-or-path"``: only values starting with ``.``, ``/`` or ``~``)."""


def path_extra(kind: str = "path") -> dict:
    """``json_schema_extra`` marking a field as a config-relative path (``kind``: ``path`` or ``hub-or-path``)."""
    return {PATH_MARKER: kind}


# --- documented caps ------------------------------------------------------------------------------------------
MAX_SEED = 2**32 - 1
"""Seeds: ``numpy.random.seed`` takes 0..2**32-1 (``random`` and ``torch.manual_seed`` take more)."""
MAX_TOKENS = 1_048_576
"""Any token length or token count (2**20): beyond every model's context, and int32 positions stay exact."""
MAX_BATCH = 65_536
"""Batch-like sizes (samples, sequences, segments, accumulation steps): far beyond any device's memory."""
MAX_COUNT = 2**53
"""Step and record counters: exact as float64 (JSON, logged metrics) and as int64 (torch)."""
MAX_PIXELS = 16_384 * 16_384
"""Image pixel budgets (a 16384 x 16384 image, 268M pixels)."""
MAX_WEIGHT = 1e6
"""Loss weights and matching costs: weighted sums of per-token losses stay far from float32 overflow."""
MAX_SECONDS = 7 * 24 * 3600.0
"""Timeouts (one week); socket and thread waits overflow on values near 2**63 nanoseconds."""
MAX_BEAMS = 64
"""Beam width: every beam is a full sequence in memory per rollout."""
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
"""``repetition_penalty`` divides or multiplies a seen token's logit by the penalty: within [0.01, 100] a logit
stays finite in float16 (|logit| up to 655) and the penalty itself never rounds to 0 in float32 (at 1e-46 it did:
every seen logit became inf or nan and the model wrote image placeholder tokens)."""
MAX_DEVICES = 1024
"""Devices per engine (``tensor_parallel_size``)."""
MAX_WORKERS = 256
"""Data-loader worker processes per rank."""


def int_in(ge: int, le: int):
    """An int in ``[ge, le]`` (both bounds in one place: pydantic keeps only one ``ge`` when two are stacked)."""
    return Annotated[int, Field(ge=ge, le=le)]


def float_in(
    ge: Optional[float] = None, le: Optional[float] = None, *, gt: Optional[float] = None, lt: Optional[float] = None
):
    """A finite float (inf and nan refused) within the given bounds."""
    return Annotated[float, Field(ge=ge, le=le, gt=gt, lt=lt, allow_inf_nan=False)]


FiniteFloat = float_in()
NonNegFloat = float_in(ge=0.0)
Probability = float_in(ge=0.0, le=1.0)
Weight = float_in(ge=0.0, le=MAX_WEIGHT)
Seed = int_in(0, MAX_SEED)
TokenLength = int_in(1, MAX_TOKENS)
BatchSize = int_in(1, MAX_BATCH)
Count = int_in(1, MAX_COUNT)


MAX_NAME_BYTES, MAX_PATH_BYTES = 255, 4096
"""Linux NAME_MAX / PATH_MAX: the limits used where the file system cannot be asked (``os.pathconf``)."""


def _name_limits(value: str) -> tuple[int, int]:
    """NAME_MAX / PATH_MAX of the file system holding the nearest existing ancestor of ``value``."""
    probe = os.path.abspath(value)
    for _ in range(MAX_PATH_BYTES):
        try:
            if os.path.isdir(probe):
                return os.pathconf(probe, "PC_NAME_MAX"), os.pathconf(probe, "PC_PATH_MAX")
        except (OSError, ValueError):
            break
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    return MAX_NAME_BYTES, MAX_PATH_BYTES


def _no_nul(value: str) -> str:
    """No NUL byte, encodable for the file system, and no name or whole path longer than it allows (checked here
    so ``validate`` says it, rather than ``train`` failing on the first system call)."""
    if "\x00" in value:
        raise ValueError("a path cannot contain a NUL byte (\\x00); the operating system refuses it")
    try:
        encoded = os.fsencode(value)
    except UnicodeEncodeError:
        raise ValueError("a path cannot hold a lone surrogate (a \\uD800-\\uDFFF escape); write the whole "
                         "character") from None
    name_max, path_max = _name_limits(value)
    longest = max(len(part) for part in encoded.split(b"/"))
    if longest > name_max:
        raise ValueError(f"a path component is {longest} bytes long; the file system allows {name_max} bytes per "
                         "file or folder name: shorten it")
    if len(encoded) >= path_max:
        raise ValueError(f"the path is {len(encoded)} bytes long; the file system allows {path_max - 1}: shorten "
                         "it")
    return value


PathStr = Annotated[str, Field(min_length=1), AfterValidator(_no_nul)]
"""A filesystem path (or hub id) as written: non-empty, no NUL byte, each name within the file system's NAME_MAX
(``os.pathconf``, 255 bytes where it cannot be asked) and the whole path within PATH_MAX."""
