"""Rollout backends keyed by the contract's typed backend choice, imported only when asked for (a vLLM backend
must not import vLLM for an HF run).

``run.rollout_matching.backend`` is an :class:`~coordexp.schema.contract.HfBackendContract`,
:class:`~coordexp.schema.contract.VllmColocateContract` or :class:`~coordexp.schema.contract.VllmServerContract`;
:func:`create_backend` looks its type up and calls ``from_run(run, model, processor)``. Nobody branches on a name.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from coordexp.runtime.rollout.base import (
    BackendUnavailableError,
    RolloutBackend,
    RolloutOutput,
    RolloutRequest,
    finish_output,
)
from coordexp.schema.contract import HfBackendContract, VllmColocateContract, VllmServerContract

if TYPE_CHECKING:
    from coordexp.schema.contract import RunContract

__all__ = [
    "BackendUnavailableError",
    "RolloutBackend",
    "RolloutOutput",
    "RolloutRequest",
    "BACKENDS",
    "BackendEntry",
    "create_backend",
    "finish_output",
    "get_backend_class",
]


@dataclass(frozen=True)
class BackendEntry:
    """Where a backend lives: ``module:class``, and the pip requirement its module imports."""

    module: str
    class_name: str
    requirement: str | None = None


BACKENDS: dict[type, BackendEntry] = {
    HfBackendContract: BackendEntry("coordexp.runtime.rollout.hf", "HfRolloutBackend"),
    VllmColocateContract: BackendEntry("coordexp.runtime.rollout.vllm_colocate", "VllmColocateBackend", "vllm"),
    VllmServerContract: BackendEntry("coordexp.runtime.rollout.vllm_server", "VllmServerBackend", "vllm"),
}
_FALLBACK_HINT = "use rollout_matching.rollout_backend: hf (transformers generate, no extra dependency)"


def _label(choice: type) -> str:
    kind = getattr(choice, "kind", None)
    return kind if isinstance(kind, str) else choice.__name__


def get_backend_class(choice: Any) -> type[RolloutBackend]:
    """Import and return the backend class of ``choice`` (a backend contract, or its type).

    Raises :class:`BackendUnavailableError` (never a bare ImportError) when the choice is unknown, its module is
    not part of this build, or a dependency it imports is not installed.
    """
    choice_type = choice if isinstance(choice, type) else type(choice)
    entry = BACKENDS.get(choice_type)
    name = _label(choice_type)
    if entry is None:
        known = ", ".join(sorted(_label(t) for t in BACKENDS))
        raise BackendUnavailableError(f"unknown rollout backend {name!r}; known backends: {known}",
                                      hint=_FALLBACK_HINT)
    try:
        module = importlib.import_module(entry.module)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if entry.module == missing or entry.module.startswith(missing + "."):
            raise BackendUnavailableError(
                f"rollout backend {name!r} is not available yet in this version of coordexp (its module "
                f"{entry.module} is missing); {_FALLBACK_HINT}") from None
        install = entry.requirement or missing.split(".")[0]
        raise BackendUnavailableError(
            f"rollout backend {name!r} needs the Python package {missing.split('.')[0]!r}, which is not installed "
            f"({exc}); install it (pip install {install}), or {_FALLBACK_HINT}") from None
    backend_class = getattr(module, entry.class_name, None)
    if not (isinstance(backend_class, type) and issubclass(backend_class, RolloutBackend)):
        raise BackendUnavailableError(
            f"rollout backend {name!r}: {entry.module} defines no RolloutBackend class {entry.class_name!r}; "
            "the installation is inconsistent", hint="reinstall coordexp")
    return backend_class


def create_backend(run: "RunContract", model: Any, processor: Any) -> RolloutBackend:
    """The backend of ``run.rollout_matching.backend``, built for the live policy ``model`` and its processor."""
    return get_backend_class(run.rollout_matching.backend).from_run(run, model, processor)
