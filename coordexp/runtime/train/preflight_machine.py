"""Preflight's checks of this machine and of stage 2's starting point (``coordexp preflight`` runs them).

- Packages: every optional package the config needs (:mod:`coordexp.optional_deps`, the one table) is importable
  here; a missing one fails with exit 3 and its install line (``train`` refuses the same config before loading).
- CUDA: ``model.attn_implementation: flash_attention_2`` without a CUDA device fails (exit 3: flash-attn has no CPU
  kernels); ``model.dtype`` bfloat16/float16 and stage 2's colocated vLLM without one pass with a warning (they
  run on CPU, slowly, or need vLLM's CPU build). The device count comes from torch, imported only when the config
  names such a setting; ``CUDA_VISIBLE_DEVICES=""`` (or ``-1``) means none.
- Memory, where it can be computed: without a CUDA device, the parameters (safetensors headers) in ``model.dtype``
  plus, for the parts that train in a full fine-tune, their gradients and AdamW's two states, against the RAM
  available here (``MemAvailable``); more than available warns (activations and rollouts come on top).
- Stage 2's ``model.path`` without a coordexp training record (``coordexp_config.yaml`` / ``run_metadata.jsonl``
  in it or its parent, ``trainer_state.json`` for a checkpoint) warns: stage 2 from a model that never saw the task
  rolls out noise.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordexp.errors import EXIT_EXTERNAL, EXIT_OK
from coordexp.optional_deps import installed, missing_for

__all__ = ["PreflightCheck", "machine_checks", "stage2_start_checks", "cuda_device_count", "TRAINING_RECORDS",
           "memory_checks", "available_memory"]

TRAINING_RECORDS = ("coordexp_config.yaml", "run_metadata.jsonl", "trainer_state.json")


@dataclass(frozen=True)
class PreflightCheck:
    """One line of the report: ``name`` (what), ``ok``, ``detail`` (what was found or what to fix), the exit code
    class of a failure (``exit_code``: 2 user input, 3 external system; 0 when ok), and ``warning``: it passes but
    names something that will not run as the config expects on this machine."""

    name: str
    ok: bool
    detail: str
    exit_code: int = EXIT_OK
    warning: bool = False


def cuda_device_count() -> int:
    """CUDA devices torch sees here (0 without torch, or with ``CUDA_VISIBLE_DEVICES`` empty or ``-1``)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return 0
    if not installed("torch"):
        return 0
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def nvidia_driver_loaded() -> bool:
    """Whether this machine may have a CUDA device, asked without importing torch (preflight stays light): the
    NVIDIA kernel driver is loaded and ``CUDA_VISIBLE_DEVICES`` does not hide every device."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return os.path.exists("/proc/driver/nvidia/version")


def machine_checks(run: Any) -> list[PreflightCheck]:
    """Packages and CUDA for ``run`` (module docstring); an empty list when the config needs neither."""
    checks = [PreflightCheck(f"package {dep.package}", False, f"{why} needs {dep.package}, which is not installed "
                             f"here; {dep.install_line}", EXIT_EXTERNAL)
              for dep, why in missing_for(run, "train")]
    hard, soft = [], []
    if run.model.attn_implementation == "flash_attention_2":
        hard.append("model.attn_implementation: flash_attention_2")
    if run.model.dtype in ("bfloat16", "float16"):
        soft.append(f"model.dtype: {run.model.dtype} (runs on CPU, slowly; init --device cpu writes float32)")
    stage2 = str(run.trainer_variant).startswith("stage2")
    if stage2 and run.rollout_matching.backend.kind == "vllm_colocate":
        soft.append("rollout_matching.rollout_backend: vllm colocated (on CPU only with vLLM's CPU build, "
                    "scripts/install_vllm_cpu.sh; rollout_backend: hf otherwise)")
    if not hard and not soft:
        return checks
    devices = cuda_device_count()
    if devices:
        checks.append(PreflightCheck("cuda", True, f"{devices} CUDA device(s) for "
                                     f"{', '.join(w.split(' (')[0] for w in hard + soft)}"))
        return checks
    checks += [PreflightCheck("cuda", False, f"{what} needs a CUDA device and this machine has none; use "
                              "attn_implementation: sdpa here", EXIT_EXTERNAL) for what in hard]
    checks += [PreflightCheck("cuda", True, f"no CUDA device on this machine: {what}", warning=True) for what in soft]
    return checks


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_GIB = 2**30


def available_memory() -> int | None:
    """Bytes of RAM available to a new process (``MemAvailable`` of ``/proc/meminfo``); None where it cannot be read."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def memory_checks(run: Any, part_sizes: dict[str, int] | None) -> list[PreflightCheck]:
    """A warning when training ``run`` on this machine's CPU needs more RAM than is available (module docstring);
    nothing where it cannot be computed: parameter counts unknown (``part_sizes`` None), a CUDA device (its memory,
    not RAM, holds the model), or no ``MemAvailable``."""
    from coordexp.runtime.model.tuner import frozen_parts

    if not part_sizes or nvidia_driver_loaded():
        return []
    available = available_memory()
    if available is None:
        return []
    per = _DTYPE_BYTES.get(str(run.model.dtype), 4)
    frozen = frozen_parts(run.tuner)
    trained = 0 if run.tuner.train_type == "lora" else sum(n for part, n in part_sizes.items() if part not in frozen)
    weights, training = sum(part_sizes.values()) * per, trained * per * 3  # gradients + AdamW's two states
    need = weights + training
    if need <= available:
        return []
    what = (f"weights {weights / _GIB:.1f} GiB in {run.model.dtype}" + (
        f" + gradients and AdamW states of the trained parts {training / _GIB:.1f} GiB" if training else ""))
    return [PreflightCheck("memory", True, f"training on this CPU needs about {need / _GIB:.1f} GiB ({what}; "
                           f"activations and rollouts on top) but {available / _GIB:.1f} GiB of RAM is available; "
                           "use a GPU node, a smaller model, or tuner.train_type: lora", warning=True)]


def stage2_start_checks(run: Any) -> list[PreflightCheck]:
    """A stage-2 ``model.path`` with no coordexp training record warns (module docstring)."""
    model_dir = Path(run.model.path)
    if not model_dir.is_dir():
        return []  # the model check reports it
    places = (model_dir, model_dir.parent)
    if any((place / name).is_file() for place in places for name in TRAINING_RECORDS):
        return [PreflightCheck("stage 2 start", True, f"{model_dir} was trained by coordexp")]
    return [PreflightCheck("stage 2 start", True, (
        f"{model_dir} has no coordexp training record ({', '.join(TRAINING_RECORDS)}): stage 2 from a model that "
        "never learned the task rolls out noise; train stage 1 first and set model.path to its output_dir"),
        warning=True)]
