"""The run's own metadata log: JSON lines in the output directory, written by the trainer (docs/design.md, server mode
MUST log the server list, sync mode with fallbacks and the per-batch rollout seeds; decoding is logged to audit it).

Written to a file, not through ``logging``: nothing configures a root logger in ``coordexp train``, so records sent
there were lost. Rank 0 writes ``run_metadata.jsonl``, rank ``r > 0`` ``run_metadata.rank<r>.jsonl`` (no two
processes append to one file). Files are appended to, so a resumed run continues its log (a ``run_start`` line marks
each start, with the checkpoint it resumed from).

Events: ``run_start`` (seed, world, decoding, repeat guard, backend metadata), ``rollout`` (one per rollout batch:
tag ``train``/``eval``, global step, micro-step within the step, rank, seeds, and the backend's metadata: servers,
sync mode, fallback events, calls with their ``RequestConfig.seed``), ``step_records`` (one per optimizer step: the
global step, how many records it trains and :func:`step_records_hash` of them, so two runs' data order can be
checked step for step).
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coordexp.schema.contract import RunContract

__all__ = ["RUN_LOG_NAME", "RunLog", "run_log_path", "read_run_log", "run_start_fields", "step_records_hash"]

RUN_LOG_NAME = "run_metadata.jsonl"


def run_log_path(output_dir: str | Path, rank: int = 0) -> Path:
    """Where rank ``rank`` of a run writes its metadata (module doc)."""
    name = RUN_LOG_NAME if int(rank) == 0 else f"run_metadata.rank{int(rank)}.jsonl"
    return Path(output_dir) / name


class RunLog:
    """Appends one JSON object per event to :func:`run_log_path` (the folder is created on the first write)."""

    def __init__(self, output_dir: str | Path, rank: int = 0):
        self.path = run_log_path(output_dir, rank)
        self.rank = int(rank)

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"event": event, "time": round(time.time(), 3), "rank": self.rank, **fields}
        line = json.dumps(record, default=str, sort_keys=False)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(line + "\n")
        return record


def step_records_hash(batches: Any) -> str:
    """A short digest of the records of one optimizer step, in order: each record's ``source`` (``file:line``) and
    its objects as the step sees them (``data.object_order`` may permute them), micro-batch by micro-batch."""
    digest = hashlib.sha256()
    for batch in batches:
        for record in batch:
            objects = [(o.desc, o.geometry, tuple(o.coords)) for o in getattr(record, "objects", ())]
            digest.update(repr((getattr(record, "source", repr(record)), objects)).encode("utf-8"))
        digest.update(b"|")
    return digest.hexdigest()[:16]


def read_run_log(output_dir: str | Path, rank: int = 0, event: str | None = None) -> list[dict[str, Any]]:
    """The records of one rank's log (only ``event`` ones when given); ``[]`` when there is no log yet."""
    path = run_log_path(output_dir, rank)
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r for r in records if event is None or r.get("event") == event]


def run_start_fields(run: "RunContract", *, world_size: int, backend_name: str | None,
                     backend_metadata: dict[str, Any], resume_from: Any) -> dict[str, Any]:
    """What a reader needs to reproduce the run's rollouts: seed, topology, decoding, guard, backend."""
    rollout = run.rollout_matching
    return {
        "trainer_variant": run.trainer_variant,
        "seed": int(run.training.seed),
        "world_size": int(world_size),
        "resume_from": None if resume_from in (None, False) else str(resume_from),
        "backend": backend_name,
        "decoding": rollout.decoding.model_dump(mode="json"),
        "max_new_tokens": int(rollout.max_new_tokens),
        "decode_batch_size": int(rollout.decode_batch_size),
        "repeat_terminate": rollout.repeat_terminate.model_dump(mode="json"),
        "backend_metadata": backend_metadata,
        "seed_rule": "train: rollout_seed(seed, global_step, (micro_step * world_size + rank) * "
                     "per_device_train_batch_size + i); eval: rollout_seed(seed, global_step, 2**30 + record index)",
    }
