"""A finished multi-process run ends its process group on every rank (barrier, then destroy): a torchrun process
that exits with its gloo group alive can abort at interpreter shutdown (CI saw SIGABRT, "terminate called without an
active exception", on the two-rank token-figure test). A one-process group stays for the next run in the process."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from coordexp.runtime.train.launch import release_process_group
from testkit import free_port

pytestmark = pytest.mark.slow


def _rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    release_process_group()
    with open(os.path.join(out, f"rank{rank}.txt"), "w", encoding="utf-8") as handle:
        handle.write(f"{float(total)} {dist.is_initialized()}")


def test_two_ranks_end_their_group(tmp_path):
    mp.spawn(_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)] == ["3.0 False", "3.0 False"]


def test_a_one_process_group_stays(tmp_path):
    # in a fresh process: this pytest process may already hold a one-process group of an in-process DeepSpeed run
    mp.spawn(_rank, args=(1, free_port(), str(tmp_path)), nprocs=1, join=True)
    assert (tmp_path / "rank0.txt").read_text() == "1.0 True"
