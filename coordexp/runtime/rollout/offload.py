"""Offload context for colocated vLLM rollouts (``rollout_matching.offload.*``, docs/design.md, offload).

While the colocated engine starts, receives weights and generates, the training model's parameters (and buffers)
and the optimizer state can leave the accelerator so the engine has the memory; they come back, bit-identical and
as the same ``Parameter`` / state objects (the optimizer keeps its references), before the teacher-forced forward.

Moves are ``tensor.data`` swaps, never copies of modules, so autograd leaves, DDP buckets and optimizer param groups
keep pointing at the same objects. Sharded setups (DeepSpeed ZeRO, FSDP) own their storage and cannot be moved
this way: :func:`check_offloadable` fails fast for them with the mitigations.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from coordexp.errors import ExternalSystemError
from coordexp.runtime.rollout.weight_export import unwrap_model
from coordexp.schema.rollout import OffloadConfig

__all__ = ["OffloadError", "OffloadReport", "check_offloadable", "offload_context"]

_MITIGATIONS = (
    "set rollout_matching.offload.enabled: false (and lower rollout_matching.vllm.gpu_memory_utilization if the "
    "engine does not fit), or run the engine out of process with rollout_matching.vllm.mode: server"
)


class OffloadError(ExternalSystemError, RuntimeError):
    """The training state cannot be offloaded safely; the message names the reason and the mitigations."""


@dataclass
class OffloadReport:
    """What one offload round trip moved (tests and telemetry read it)."""

    tensors_moved: int = 0
    bytes_moved: int = 0
    devices: set[str] = field(default_factory=set)


def check_offloadable(model: Any, optimizer: Any = None) -> None:
    """Raise :class:`OffloadError` when ``model`` / ``optimizer`` are sharded by DeepSpeed ZeRO or FSDP."""
    inner = unwrap_model(model)
    kinds = {type(model).__name__, type(inner).__name__, type(optimizer).__name__ if optimizer is not None else ""}
    if any(name.startswith(("DeepSpeed", "FullyShardedDataParallel", "FSDP")) for name in kinds):
        raise OffloadError(f"rollout_matching.offload cannot move a sharded model/optimizer ({sorted(kinds - {''})}): "
                           f"DeepSpeed ZeRO and FSDP manage their own storage; {_MITIGATIONS}")
    for name, parameter in inner.named_parameters():
        if hasattr(parameter, "ds_id") or hasattr(parameter, "ds_status"):
            raise OffloadError(f"rollout_matching.offload: parameter {name} is managed by DeepSpeed ZeRO "
                               f"(it has ds_id); ZeRO partitions parameters itself, use its own offload_param / "
                               f"offload_optimizer settings instead, or {_MITIGATIONS}")
        if type(parameter.data).__name__ == "DTensor":
            raise OffloadError(f"rollout_matching.offload: parameter {name} is a DTensor (FSDP2 / tensor parallel); "
                               f"{_MITIGATIONS}")


def _model_tensors(model: Any) -> list[torch.Tensor]:
    inner = unwrap_model(model)
    seen: dict[int, torch.Tensor] = {}
    for tensor in list(inner.parameters()) + list(inner.buffers()):
        seen.setdefault(id(tensor), tensor)
    return list(seen.values())


def _optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    tensors = []
    for state in getattr(optimizer, "state", {}).values():
        tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return tensors


def _move(tensors: list[torch.Tensor], target: torch.device, report: OffloadReport) -> list[tuple[torch.Tensor, torch.device]]:
    moved = []
    for tensor in tensors:
        if tensor.device == target:
            continue
        source = tensor.device
        report.devices.add(str(source))
        report.tensors_moved += 1
        report.bytes_moved += tensor.numel() * tensor.element_size()
        tensor.data = tensor.data.to(target, non_blocking=False)
        grad = tensor.grad if isinstance(tensor, torch.nn.Parameter) else None
        if grad is not None:
            tensor.grad = grad.to(target)
        moved.append((tensor, source))
    return moved


@contextlib.contextmanager
def offload_context(model: Any, optimizer: Any, config: OffloadConfig | None, *, active: bool,
                    target: str | torch.device = "cpu") -> Iterator[OffloadReport]:
    """Inside the block the selected training state lives on ``target``; on exit (also on error) it is back.

    ``active`` is the contract's ``offload_active`` (offload requested AND the backend is vLLM colocate): for the
    HF and server backends the context moves nothing. Tensors already on ``target`` (a CPU run) stay put.
    """
    report = OffloadReport()
    if not active or config is None or not config.enabled:
        yield report
        return
    check_offloadable(model, optimizer)
    device = torch.device(target)
    moved: list[tuple[torch.Tensor, torch.device]] = []
    try:
        if config.offload_model:
            moved += _move(_model_tensors(model), device, report)
        if config.offload_optimizer and optimizer is not None:
            moved += _move(_optimizer_tensors(optimizer), device, report)
        if moved and any(torch.device(d).type == "cuda" for d in report.devices):
            torch.cuda.empty_cache()
        yield report
    finally:
        for tensor, source in moved:
            tensor.data = tensor.data.to(source)
            if isinstance(tensor, torch.nn.Parameter) and tensor.grad is not None:
                tensor.grad = tensor.grad.to(source)
