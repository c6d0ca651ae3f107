"""``coordexp preflight --nnodes N --nproc-per-node M``: what each node of a multi-node launch needs (issue 55).

One check, ``nodes``: the world size W = N x M; each rank's train batch, the accumulation coordexp derives from
``training.effective_batch_size`` and W (a size that does not divide fails, exit 2, as ``train`` would at launch),
what each node trains per micro-step and the global batch; ``rollout_matching.decode_batch_size`` (per engine: it
does not scale with the nodes); and the paths every node must see at the same place: ``training.output_dir`` (rank 0
writes the checkpoints, every rank reads the one ``--resume`` names) and the data. A path whose nearest existing
folder is on a local file system (ext4, xfs, tmpfs, ...) is named in a second check, ``shared folder``, as a warning:
preflight runs on one node and cannot see the others, so it cannot prove a folder shared, only suspect one is not.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from coordexp.errors import EXIT_INVALID
from coordexp.runtime.train.preflight_machine import PreflightCheck

__all__ = ["node_checks", "file_system_type", "LOCAL_FILE_SYSTEMS"]

LOCAL_FILE_SYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "ramfs", "f2fs", "vfat",
                                "devtmpfs"})


def file_system_type(path: str | Path, mounts: str = "/proc/self/mounts") -> Optional[str]:
    """The type of the file system holding ``path`` (its nearest existing folder), from ``mounts``; None where it
    cannot be read (not Linux)."""
    place = Path(os.path.abspath(path))
    while not place.exists() and place != place.parent:
        place = place.parent
    real = os.path.realpath(place)
    try:
        lines = Path(mounts).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    best: tuple[int, Optional[str]] = (-1, None)
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best[0]:
            best = (len(point), fields[2])
    return best[1]


def node_checks(run: Any, nnodes: int, nproc_per_node: int, *, mounts: str = "/proc/self/mounts"
                ) -> tuple[list[PreflightCheck], dict[str, Any]]:
    """The ``nodes`` check (and a ``shared folder`` warning when a path looks node-local) and their wiring."""
    t = run.training
    world = nnodes * nproc_per_node
    batch = t.per_device_train_batch_size
    wiring: dict[str, Any] = {"nnodes": nnodes, "nproc_per_node": nproc_per_node, "world_size": world,
                              "per_rank_train_batch": batch,
                              "decode_batch_size": run.rollout_matching.decode_batch_size}
    per_step = batch * world
    if t.effective_batch_size is not None and t.effective_batch_size % per_step:
        return [PreflightCheck("nodes", False, (
            f"training.effective_batch_size ({t.effective_batch_size}) is not a multiple of "
            f"per_device_train_batch_size ({batch}) x {nnodes} node(s) x {nproc_per_node} rank(s) = {per_step}: "
            "train would stop at launch; change one of them so it divides"), EXIT_INVALID)], wiring
    accumulation = t.gradient_accumulation_steps if t.effective_batch_size is None else (
        t.effective_batch_size // per_step)
    wiring.update(accumulation=accumulation, global_batch=per_step * accumulation)
    data = run.data
    shared = {"training.output_dir": t.output_dir, "data.train_jsonl": data.train_jsonl,
              "data.val_jsonl": data.val_jsonl, "data.image_root": data.image_root}
    shared = {key: str(value) for key, value in shared.items() if value is not None}
    wiring["shared_paths"] = shared
    stage2 = str(run.trainer_variant).startswith("stage2")
    decode = (f"; rollout_matching.decode_batch_size {run.rollout_matching.decode_batch_size} is per rollout engine "
              "(each colocated rank, each server replica) and does not scale with the nodes") if stage2 else ""
    detail = (f"{nnodes} node(s) x {nproc_per_node} rank(s) = world size {world}. Each rank trains "
              f"per_device_train_batch_size {batch} per micro-step ({nproc_per_node * batch} per node), accumulation "
              f"{accumulation}" + (" from training.effective_batch_size" if t.effective_batch_size is not None
                                   else " (gradient_accumulation_steps)")
              + f": a global batch of {per_step * accumulation}{decode}. Every node must see training.output_dir "
              f"{t.output_dir} at the same path on a shared file system (rank 0 writes the checkpoints; every rank "
              "reads the one --resume names; the ranks agree on it before the model loads), and the data at the "
              "same paths. Launch one torchrun agent per node: torchrun --nnodes "
              f"{nnodes} --nproc_per_node {nproc_per_node} --rdzv_backend c10d --rdzv_endpoint HEAD:PORT "
              "--rdzv_id JOB -m coordexp train CFG")
    checks = [PreflightCheck("nodes", True, detail)]
    local = {key: kind for key, kind in ((key, file_system_type(value, mounts)) for key, value in shared.items())
             if kind in LOCAL_FILE_SYSTEMS}
    if nnodes > 1 and local:
        checks.append(PreflightCheck("shared folder", True, (
            "on a local file system here, so probably not shared across the nodes: " + "; ".join(
                f"{key} {shared[key]} ({kind})" for key, kind in local.items())
            + ". Put them on a file system every node mounts (NFS, Lustre, a cloud volume)"), warning=True))
    return checks, wiring
