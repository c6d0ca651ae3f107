"""Rollout backends by name, imported only when asked for (a vLLM backend must not import vLLM for an HF run).

Names: ``hf`` (transformers ``generate``), ``vllm_colocate`` and ``vllm_server``. The trainer maps its contract to
a name with :func:`backend_name_for` and builds the backend with :func:`create_backend`; it never branches on the
backend itself.
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
    request_seed,
)

if TYPE_CHECKING:
    from coordexp.schema.contract import RolloutMatchingContract

__all__ = [
    "BackendUnavailableError",
    "RolloutBackend",
    "RolloutOutput",
    "RolloutRequest",
    "BACKENDS",
    "backend_name_for",
    "create_backend",
    "finish_output",
    "get_backend_class",
    "request_seed",
]


@dataclass(frozen=True)
class BackendEntry:
    """Where a backend lives: ``module:class``, and the pip requirement its module imports."""

    module: str
    class_name: str
    requirement: str | None = None


BACKENDS: dict[str, BackendEntry] = {
    "hf": BackendEntry("coordexp.runtime.rollout.hf", "HfRolloutBackend"),
    "vllm_colocate": BackendEntry("coordexp.runtime.rollout.vllm_colocate", "VllmColocateBackend", "vllm"),
    "vllm_server": BackendEntry("coordexp.runtime.rollout.vllm_server", "VllmServerBackend", "vllm"),
}
_FALLBACK_HINT = "use rollout_matching.rollout_backend: hf (transformers generate, no extra dependency)"


def backend_name_for(rollout: "RolloutMatchingContract") -> str:
    """The registry name of the contract's backend: ``hf``, ``vllm_colocate`` or ``vllm_server``."""
    if rollout.rollout_backend == "hf":
        return "hf"
    return f"vllm_{rollout.vllm_mode or 'colocate'}"


def get_backend_class(name: str) -> type[RolloutBackend]:
    """Import and return the backend class registered as ``name``.

    Raises :class:`BackendUnavailableError` (never a bare ImportError) when the name is unknown, its module is not
    part of this build yet, or a dependency it imports is not installed.
    """
    entry = BACKENDS.get(name)
    if entry is None:
        raise BackendUnavailableError(
            f"unknown rollout backend {name!r}; known backends: {', '.join(sorted(BACKENDS))}")
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
            "the installation is inconsistent (reinstall coordexp)")
    return backend_class


def create_backend(name: str, rollout: "RolloutMatchingContract", *, model: Any, tokenizer: Any,
                   **options: Any) -> RolloutBackend:
    """Build the backend ``name`` from the resolved contract and the live policy (``options`` go to the backend)."""
    return get_backend_class(name).from_contract(rollout, model=model, tokenizer=tokenizer, **options)
