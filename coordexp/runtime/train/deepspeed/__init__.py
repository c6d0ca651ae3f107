"""The shipped DeepSpeed presets (``training.deepspeed: zero2 | zero3``): JSON files beside this module whose
``"auto"`` values transformers fills from ``TrainingArguments``. They leave out ``optimizer`` and ``scheduler`` so
coordexp's per-part parameter groups and the configured schedule are the ones DeepSpeed wraps."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from coordexp.errors import UserInputError

__all__ = ["PRESET_DIR", "preset_names", "resolve_deepspeed", "skip_cpu_shm_op", "single_process_rendezvous",
           "uses_deepspeed", "backward_row", "padding_rows", "process_state_restored"]

PRESET_DIR = Path(__file__).resolve().parent


def preset_names() -> tuple[str, ...]:
    """The presets shipped in the package (the schema's ``DEEPSPEED_PRESETS`` must list the same)."""
    return tuple(sorted(p.stem for p in PRESET_DIR.glob("*.json")))


def resolve_deepspeed(value: str | None) -> str | None:
    """A preset name becomes its packaged JSON path; a path must name an existing file (exit 2 otherwise)."""
    if value is None:
        return None
    if value in preset_names():
        return str(PRESET_DIR / f"{value}.json")
    path = Path(value).expanduser()
    if not path.is_file():
        raise UserInputError(f"training.deepspeed: {value} is not a file",
                             hint=f"Point it at a DeepSpeed JSON config, or use a preset: {', '.join(preset_names())}.")
    return str(path)


def skip_cpu_shm_op() -> None:
    """DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce op when its comm backend starts (about
    3 minutes on 2 cores, and a C++ toolchain); coordexp's CPU runs reduce over gloo, so the op is marked
    unavailable in DeepSpeed's table of compatible ops (read when the backend starts; DeepSpeed keeps edits to it)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def single_process_rendezvous() -> None:
    """DeepSpeed always starts torch.distributed; a run started without a launcher (no ``RANK`` / ``WORLD_SIZE`` in
    the environment) becomes rank 0 of a world of 1 on a free loopback port, as the ``deepspeed`` launcher would set
    it (DeepSpeed otherwise looks for MPI and fails without mpi4py)."""
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(port))):
        os.environ.setdefault(name, value)


_RUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "ACCELERATE_USE_DEEPSPEED",  # LOCAL_WORLD_SIZE: accelerate sets it for a DeepSpeed run
            "TENSORBOARD_LOGGING_DIR")  # training.logging_dir, for this run's TensorBoardCallback only


@contextmanager
def process_state_restored() -> Iterator[None]:
    """A run leaves process-wide state behind: the launcher variables a single-process DeepSpeed run sets,
    accelerate's ``ACCELERATE_USE_DEEPSPEED`` and shared DeepSpeed state, transformers' global DeepSpeed config, and
    the ``TENSORBOARD_LOGGING_DIR`` that ``training.logging_dir`` sets.
    Restored on exit, so the next run in this process, or a process it starts, inherits none of it (a second
    run in a notebook, a benchmark, the test suite). The process group stays: DeepSpeed's communication layer keeps
    it, and a second DeepSpeed run in the same process joins it again."""
    env = {name: os.environ.get(name) for name in _RUN_ENV}
    try:
        yield
    finally:
        deepspeed_ran = (os.environ.get("ACCELERATE_USE_DEEPSPEED") != env["ACCELERATE_USE_DEEPSPEED"]
                         or _accelerate_state_is_deepspeed())
        for name, value in env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if deepspeed_ran:
            _forget_deepspeed()


def _accelerate_state_is_deepspeed() -> bool:
    state = sys.modules.get("accelerate.state")
    if state is None:
        return False
    return _names_deepspeed(state.AcceleratorState._shared_state.get("distributed_type"))


def _names_deepspeed(distributed_type: Any) -> bool:
    """Whether accelerate's ``DistributedType`` (the enum, or its name) is DeepSpeed."""
    return str(getattr(distributed_type, "name", distributed_type)) == "DEEPSPEED"


def _forget_deepspeed() -> None:
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    AcceleratorState._reset_state(reset_partial_state=True)


def uses_deepspeed(accelerator: Any) -> bool:
    return _names_deepspeed(getattr(accelerator, "distributed_type", None))


def backward_row(accelerator: Any, loss: Any) -> None:
    """The backward of a packed row that is NOT the micro-step's last: its gradient accumulates and nothing steps.
    Under DeepSpeed the engine is told this is no accumulation boundary and never stepped here (the micro-step's
    last backward, which the HF loop runs, is the boundary and the one ``engine.step``), and ``loss`` is already
    divided by the accumulation steps as HF divides the last row's (``scale_wrt_gas=False``); elsewhere this is
    ``accelerator.backward`` (the caller holds ``no_sync``)."""
    if uses_deepspeed(accelerator):
        accelerator.deepspeed_engine_wrapped.backward(loss, sync_gradients=False, scale_wrt_gas=False)
    else:
        accelerator.backward(loss)


def padding_rows(accelerator: Any, rows: int) -> int:
    """How many gradient-free rows this rank adds to a micro-step of ``rows`` rows so that every rank runs as many
    row forwards and backwards: ZeRO-3 gathers parameters in every forward and ZeRO-2/3 reduce gradients in every
    backward, collectives that pair up only when the counts agree (packing gives each rank its own count). Zero
    outside DeepSpeed (DDP rows before the last run under ``no_sync``, with no collective)."""
    if not uses_deepspeed(accelerator) or accelerator.num_processes <= 1:
        return 0
    import torch
    import torch.distributed as dist

    count = torch.tensor([rows], dtype=torch.long, device=accelerator.device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item()) - rows
