"""Base model shared by every config section: strict scalars, unknown keys rejected, immutable."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A config section: YAML ``"1"`` is not an int and ``yes`` is not a bool; unknown keys fail; frozen."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, validate_default=True)


PATH_MARKER = "x-coordexp-path"
"""JSON-schema extra on string fields that hold filesystem paths. The loader resolves a relative value against
the directory of the YAML file that set it (``"hub-or-path"``: only values starting with ``.``, ``/`` or ``~``)."""


def path_extra(kind: str = "path") -> dict:
    """``json_schema_extra`` marking a field as a config-relative path (``kind``: ``path`` or ``hub-or-path``)."""
    return {PATH_MARKER: kind}
