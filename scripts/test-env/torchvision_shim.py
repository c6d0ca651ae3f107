"""TEST ENVIRONMENT ONLY (never product code): make the registry's CUDA torchvision wheel importable on CPU torch.

The package registries reachable here carry only CUDA builds of torchvision, whose C extension cannot load against
torch+cpu. ``import torchvision`` then fails in two fake-kernel registrations that assume the extension defined
the ``torchvision::nms`` and ``torchvision::qnms`` operator schemas. Defining those two schemas with
``torch.library`` before torchvision is first imported makes the import succeed (the compiled ops stay absent;
the pure-Python transforms vLLM's Qwen-VL processing needs work).

``scripts/install_vllm_cpu.sh`` copies this file into the venv's site-packages and adds a ``.pth`` line that calls
:func:`install`. That only registers a meta-path hook (no torch import at interpreter start-up); the schemas are
defined the first time anything imports torchvision, in every process of the venv (vLLM's helper subprocesses too).
"""

from __future__ import annotations

import sys

_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIBRARY = None  # keeps the torch.library.Library alive for the life of the process


def define_torchvision_schemas() -> None:
    """Define ``torchvision::nms`` / ``torchvision::qnms`` unless torchvision's extension already did."""
    global _LIBRARY
    import torch

    missing = {}
    for name, schema in _SCHEMAS.items():
        try:
            torch._C._dispatch_find_schema_or_throw(f"torchvision::{name}", "")
        except RuntimeError:
            missing[name] = schema
    if not missing:
        return
    _LIBRARY = torch.library.Library("torchvision", "DEF")
    for schema in missing.values():
        _LIBRARY.define(schema)


class _BeforeTorchvision:
    """Meta-path hook: runs :func:`define_torchvision_schemas` once, right before torchvision is imported."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            define_torchvision_schemas()
        return None  # the normal finders import the package


def install() -> None:
    if "torchvision" in sys.modules or any(isinstance(f, _BeforeTorchvision) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _BeforeTorchvision())
