"""Every rank of a launch agrees on how the run starts before any collective that could hang (issue 55, item 3).

``coordexp train`` under ``torchrun`` on several nodes: each rank decides on its own what it would start from (a
fresh run, or the checkpoint ``--resume`` names) or why it cannot start. If a rank then stopped alone, the others
went on to load the model and waited in the process group's rendezvous for a rank that had exited: a hang until
killed. Here every rank posts what it decided to the launch's key-value store and reads every other rank's, with a
bound on the wait: the ranks start only when all of them could and all see the same checkpoint; otherwise every
rank stops with the failing ranks' reasons, each prefixed by its rank.

The store is torchrun's own (the agent on node 0 hosts it at ``MASTER_ADDR:MASTER_PORT`` and every worker is a
client of it, ``TORCHELASTIC_USE_AGENT_STORE``); no process group is created here, so the trainer's rendezvous,
backend and timeouts stay HF's. A launch without an agent store (every process started by ``srun`` with
``RANK``/``WORLD_SIZE``/``MASTER_*`` set) is served by rank 0, multi-tenant, the way torch's ``env://`` rendezvous
later shares the same port.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

__all__ = ["AGREE_TIMEOUT_S", "StartView", "Disagreement", "launch_world", "checkpoint_view", "failure_view",
           "exchange_views", "disagreement"]

AGREE_TIMEOUT_S = 300.0
"""How long a rank waits for the others to say how they start (they all reach this point after the config loads,
before the model does; a rank missing past this stopped before it, and its own output says why)."""
_PREFIX = "coordexp/start"
_MAX_REASON = 2000


@dataclass(frozen=True)
class StartView:
    """What one rank would start from: ``checkpoint`` (None: a fresh run) and its identity (step, digest of its
    trainer state), or ``reason`` why it cannot start (``code``: its exit code)."""

    rank: int
    checkpoint: Optional[str] = None
    step: Optional[int] = None
    digest: Optional[str] = None
    reason: Optional[str] = None
    code: int = 0

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, rank: int, text: bytes | str) -> "StartView":
        try:
            data = json.loads(text)
            return cls(rank=rank, checkpoint=data.get("checkpoint"), step=data.get("step"),
                       digest=data.get("digest"), reason=data.get("reason"), code=int(data.get("code") or 0))
        except (ValueError, TypeError, AttributeError):
            return cls(rank=rank, reason="sent an unreadable answer", code=1)

    def shown(self) -> str:
        if self.checkpoint is None:
            return "a fresh run"
        return f"{self.checkpoint} (step {self.step})"


@dataclass(frozen=True)
class Disagreement:
    """Why the ranks cannot start together: one ``rank k: reason`` line per failing rank (``ranks a, b: reason``
    for ranks that failed alike), the exit code, and each rank's own line (``line_of``)."""

    lines: tuple[str, ...]
    code: int
    hint: str
    line_of: dict[int, str]

    def own_line(self, rank: int) -> str:
        """The line naming ``rank`` (else the first reason): what that rank prints."""
        return self.line_of.get(rank, self.lines[0])


def launch_world() -> tuple[int, int]:
    """(rank, world size) of this process (0, 1 outside a distributed launch)."""
    return int(os.environ.get("RANK", "0") or 0), int(os.environ.get("WORLD_SIZE", "1") or 1)


def checkpoint_view(rank: int, checkpoint: Optional[str]) -> StartView:
    """This rank starts from ``checkpoint`` (None: fresh); its identity is its step and its trainer state's digest,
    so two nodes' private copies of a same-named checkpoint are told apart."""
    if checkpoint is None:
        return StartView(rank)
    state = Path(checkpoint) / "trainer_state.json"
    try:
        raw = state.read_bytes()
        step = json.loads(raw).get("global_step")
    except (OSError, ValueError, AttributeError) as exc:
        return StartView(rank, reason=f"cannot read {state} ({exc})", code=2)
    return StartView(rank, checkpoint=str(checkpoint), step=step, digest=hashlib.sha256(raw).hexdigest())


def failure_view(rank: int, reason: str, code: int) -> StartView:
    """This rank cannot start: ``reason`` (one line), exit ``code``."""
    return StartView(rank, reason=" ".join(reason.split())[:_MAX_REASON], code=code)


def _store(rank: int, world_size: int, timeout_s: float) -> Any:
    from torch.distributed import PrefixStore, TCPStore

    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500"))
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = TCPStore(host, port, world_size=None if agent else world_size, is_master=not agent and rank == 0,
                     timeout=timedelta(seconds=timeout_s), multi_tenant=not agent, wait_for_workers=False)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return PrefixStore(f"{_PREFIX}/{run_id}/{attempt}", store), store


_KEEP: list[Any] = []  # rank 0's own store server (no agent store) lives until the process group shares its port


def exchange_views(view: StartView, world_size: int, *, timeout_s: float = AGREE_TIMEOUT_S) -> list[StartView]:
    """Post ``view`` and return every rank's, in rank order. A rank that has not posted within ``timeout_s`` is
    reported as such (exit 3); a store that cannot be reached raises ``ConnectionError``."""
    try:
        prefixed, server = _store(view.rank, world_size, timeout_s)
        prefixed.set(str(view.rank), view.to_json())
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError/DistNetworkError/DistStoreError
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        raise ConnectionError(f"cannot reach the launch's store at {host}:{port} to agree on how the run starts "
                              f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]})") from exc
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and view.rank == 0:
        _KEEP.append(server)
    views: list[StartView] = []
    for rank in range(world_size):
        if rank == view.rank:
            views.append(view)
            continue
        try:
            prefixed.wait([str(rank)], timedelta(seconds=timeout_s))
            views.append(StartView.from_json(rank, prefixed.get(str(rank))))
        except Exception:  # noqa: BLE001 - a timeout is DistStoreError or RuntimeError depending on torch
            views.append(StartView(rank, reason=f"did not say how it starts within {timeout_s:.0f} s (it stopped "
                                   "before; its own output says why)", code=3))
    _read_by_all(prefixed, view.rank, world_size, min(timeout_s, 60.0))
    return views


def _read_by_all(store: Any, rank: int, world_size: int, timeout_s: float) -> None:
    """Rank 0 returns once every rank has read the answers: under torchrun its agent hosts the store and ends it
    when rank 0 exits, which must not happen while another rank is still reading."""
    store.set(f"read/{rank}", "1")
    if rank != 0:
        return
    try:
        store.wait([f"read/{r}" for r in range(world_size)], timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - a rank that stopped meanwhile: nothing more to wait for
        pass


def disagreement(views: list[StartView]) -> Optional[Disagreement]:
    """None when every rank can start and all start the same way; else every failing rank's reason, or the
    checkpoint each rank sees when they differ."""
    failed = [v for v in views if v.reason is not None]
    shared_dir = ("training.output_dir must be one folder every node mounts at the same path (a shared file "
                  "system: docs/training.md, 'Several nodes')")
    if failed:
        alike: dict[str, list[int]] = {}
        for v in failed:
            alike.setdefault(str(v.reason), []).append(v.rank)
        line_of = {rank: f"{_ranks(ranks)}: {reason}" for reason, ranks in alike.items() for rank in ranks}
        code = 2 if any(v.code == 2 for v in failed) else max(v.code for v in failed)
        sees = [v for v in views if v.reason is None and v.checkpoint is not None]
        hint = shared_dir if sees else "Fix what each named rank reports, then launch again"
        return Disagreement(tuple(dict.fromkeys(line_of[v.rank] for v in failed)), code, hint, line_of)
    first = views[0]
    if all((v.checkpoint, v.step, v.digest) == (first.checkpoint, first.step, first.digest) for v in views):
        return None
    line_of = {v.rank: f"rank {v.rank}: sees {v.shown()}" + (
        " (another copy of the same name)" if v.checkpoint == first.checkpoint and v.digest != first.digest
        and v.rank else "") for v in views}
    return Disagreement(("the ranks would not start from the same checkpoint", *line_of.values()), 2, shared_dir,
                        line_of)


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    shown = ", ".join(map(str, ranks[:8]))
    return f"ranks {shown}" + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
