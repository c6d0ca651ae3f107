"""``coordexp preflight``: everything a launch script should know before it starts servers and ``torchrun``.

Checks, in order, stopping at the first class of failure (each has its own exit code, see :data:`EXIT_CODES`):
the config validates (2); the model directory has a config and all 1000 coord tokens (2); the data files exist and
a sample of records and their images load (2); in server mode each server answers ``/health/`` and
``/get_world_size/`` (3) and the topology is feasible, ``decode_batch_size * S >= W`` (4). With ``launch=True``
servers are not running yet: their HTTP and group ports must be free on this host instead (5), and each is assumed
to have ``server_world_size`` replicas. The report carries the launcher wiring: ``server_base_urls`` (projected
from ``servers[]``), per-rank chunk, and a suggested device split (3v1 on 4 GPUs).
No torch import: this runs in a second on a login node.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from coordexp.runtime.core.distribution import InfeasibleTopologyError, per_rank_chunk
from coordexp.runtime.core.tokens import ALL_COORD_TOKENS

__all__ = ["EXIT_CODES", "PreflightCheck", "PreflightReport", "run_preflight", "coord_tokens_missing",
           "suggest_device_split", "port_is_free"]

EXIT_OK, EXIT_INVALID_CONFIG, EXIT_UNREACHABLE, EXIT_INFEASIBLE, EXIT_PORT_BUSY = 0, 2, 3, 4, 5
EXIT_CODES = {
    EXIT_OK: "ready to launch",
    EXIT_INVALID_CONFIG: "invalid config, model directory or data",
    EXIT_UNREACHABLE: "a rollout server is unreachable or answers wrongly",
    EXIT_INFEASIBLE: "infeasible topology: decode_batch_size * server world size < learner world size",
    EXIT_PORT_BUSY: "launch mode: a server or group port is already in use on this host",
}
_LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}


@dataclass(frozen=True)
class PreflightCheck:
    """One line of the report: ``name`` (what), ``ok``, ``detail`` (what was found or what to fix)."""

    name: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class PreflightReport:
    exit_code: int
    checks: tuple[PreflightCheck, ...]
    wiring: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.exit_code == EXIT_OK

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "exit_code": self.exit_code, "meaning": EXIT_CODES[self.exit_code],
                "checks": [asdict(c) for c in self.checks], "wiring": self.wiring}


def coord_tokens_missing(model_dir: Path) -> list[str]:
    """Coord tokens absent from the tokenizer files of ``model_dir`` (read as JSON; no transformers import)."""
    known: set[str] = set()
    tokenizer_json = model_dir / "tokenizer.json"
    if tokenizer_json.is_file():
        data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
        known.update(t.get("content", "") for t in data.get("added_tokens", []))
        vocab = (data.get("model") or {}).get("vocab")
        if isinstance(vocab, dict):
            known.update(vocab)
    config = model_dir / "tokenizer_config.json"
    if config.is_file():
        data = json.loads(config.read_text(encoding="utf-8"))
        known.update(v.get("content", "") for v in (data.get("added_tokens_decoder") or {}).values())
        known.update(t for t in data.get("additional_special_tokens") or [] if isinstance(t, str))
    for name in ("vocab.json", "added_tokens.json"):
        path = model_dir / name
        if path.is_file():
            known.update(json.loads(path.read_text(encoding="utf-8")))
    return [t for t in ALL_COORD_TOKENS if t not in known]


def port_is_free(host: str, port: int) -> bool:
    """True when ``port`` can be bound on ``host`` right now (a launch-time check, racy by nature)."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1" if host in ("localhost", "0.0.0.0") else host, int(port)))
        except OSError:
            return False
    return True


def suggest_device_split(num_gpus: int, learner_world_size: int) -> dict[str, Any]:
    """Learner ranks on the LAST ``W`` GPUs, rollout servers on the rest (4 GPUs, W = 1: the 3v1 layout)."""
    if num_gpus <= learner_world_size:
        return {"num_gpus": num_gpus, "server_devices": [], "learner_devices": list(range(num_gpus)),
                "note": f"{num_gpus} GPU(s) cannot host both servers and {learner_world_size} learner rank(s); "
                        "use vllm.mode: colocate or more GPUs"}
    split = num_gpus - learner_world_size
    servers, learners = list(range(split)), list(range(split, num_gpus))
    return {"num_gpus": num_gpus, "server_devices": servers, "learner_devices": learners,
            "server_cuda_visible_devices": ",".join(map(str, servers)),
            "learner_cuda_visible_devices": ",".join(map(str, learners)),
            "server_data_parallel_size": split}


def _visible_gpus() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return len([d for d in visible.split(",") if d.strip()])
    return 4  # the documented 3v1 node when nothing says otherwise


def run_preflight(config_path: str | Path, *, learner_world_size: int = 1, health_timeout_s: float | None = None,
                  launch: bool = False, server_world_size: int = 1, num_gpus: int | None = None,
                  sample_records: int = 8) -> PreflightReport:
    """Run every check (module docstring); never raises for user problems, the report says what is wrong."""
    from coordexp.schema.contract import load_contract
    from coordexp.schema.errors import ConfigError

    checks: list[PreflightCheck] = []

    def done(code: int, wiring: dict | None = None) -> PreflightReport:
        return PreflightReport(code, tuple(checks), wiring or {})

    try:
        run = load_contract(config_path)
    except (ConfigError, OSError, ValueError) as exc:
        checks.append(PreflightCheck("config", False, str(exc)))
        return done(EXIT_INVALID_CONFIG)
    rollout = run.rollout_matching
    checks.append(PreflightCheck("config", True, f"{config_path}: {run.trainer_variant}, backend "
                                 f"{rollout.rollout_backend}" + (f"/{rollout.vllm_mode}" if rollout.vllm_mode else "")))
    try:
        rollout.require_full_sync_for(learner_world_size)
    except ConfigError as exc:
        checks.append(PreflightCheck("sync mode", False, str(exc)))
        return done(EXIT_INVALID_CONFIG)

    if not _check_model(Path(run.model.path), checks) or not _check_data(run, checks, sample_records):
        return done(EXIT_INVALID_CONFIG)
    if rollout.vllm_mode != "server":
        checks.append(PreflightCheck("servers", True, "not in server mode: no rollout server to check"))
        return done(EXIT_OK)

    servers = rollout.vllm.servers
    wiring: dict[str, Any] = {"server_base_urls": [s.base_url for s in servers],
                              "group_ports": [s.group_port for s in servers],
                              "learner_world_size": learner_world_size,
                              "decode_batch_size": rollout.decode_batch_size}
    if launch:
        busy = []
        for s in servers:
            host = urlsplit(s.base_url).hostname or "127.0.0.1"
            port = urlsplit(s.base_url).port or 80
            if host in _LOCAL_HOSTS:
                busy += [f"{s.base_url} port {p}" for p in (port, s.group_port) if not port_is_free(host, p)]
        checks.append(PreflightCheck("ports free", not busy, "busy: " + ", ".join(busy) + "; stop what holds them "
                                     "or change servers[] (coordexp never moves a port silently)" if busy else
                                     "every local server and group port is free"))
        world_sizes = [server_world_size] * len(servers)
        if busy:
            return done(EXIT_PORT_BUSY, wiring)
    else:
        from coordexp.runtime.rollout.client import RolloutServerClient, ServerError

        timeout = rollout.vllm.timeout_s if health_timeout_s is None else health_timeout_s
        world_sizes = []
        for s in servers:
            client = RolloutServerClient(s.base_url, group_port=s.group_port, timeout_s=timeout)
            try:
                client.wait_until_healthy()
                world_sizes.append(client.world_size())
            except ServerError as exc:
                checks.append(PreflightCheck(f"server {s.base_url}", False, str(exc)))
                return done(EXIT_UNREACHABLE, wiring)
            checks.append(PreflightCheck(f"server {s.base_url}", True, f"healthy, world size {world_sizes[-1]}"))
    wiring["server_world_sizes"] = world_sizes
    wiring["suggested_device_split"] = suggest_device_split(num_gpus or _visible_gpus(), learner_world_size)
    try:
        wiring["per_rank_chunk"] = per_rank_chunk(rollout.decode_batch_size, world_sizes, learner_world_size)
    except InfeasibleTopologyError as exc:
        checks.append(PreflightCheck("topology", False, str(exc)))
        return done(EXIT_INFEASIBLE, wiring)
    checks.append(PreflightCheck("topology", True, f"decode_batch_size {rollout.decode_batch_size} * S "
                                 f"{sum(world_sizes)} >= W {learner_world_size}; per-rank chunk "
                                 f"{wiring['per_rank_chunk']}"))
    return done(EXIT_OK, wiring)


def _check_model(model_dir: Path, checks: list[PreflightCheck]) -> bool:
    if not (model_dir / "config.json").is_file():
        checks.append(PreflightCheck("model", False, f"{model_dir} has no config.json; set model.path to a "
                                     "Hugging Face model directory"))
        return False
    missing = coord_tokens_missing(model_dir)
    if missing:
        checks.append(PreflightCheck("model", False, f"{model_dir}: {len(missing)} of 1000 coord tokens missing "
                                     f"(e.g. {missing[:3]}); add them to the tokenizer (coordexp.runtime.core.tokens."
                                     "add_coord_tokens) and resize the embeddings"))
        return False
    checks.append(PreflightCheck("model", True, f"{model_dir}: config.json and all 1000 coord tokens"))
    return True


def _check_data(run: Any, checks: list[PreflightCheck], sample: int) -> bool:
    from coordexp.runtime.model.data import DatasetError, load_records

    data = run.data
    for label, path in (("train data", data.train_jsonl), ("val data", data.val_jsonl)):
        if path is None:
            continue
        try:
            records = load_records(path, data.image_root, max_samples=sample, check_files=True)
        except (DatasetError, OSError) as exc:
            checks.append(PreflightCheck(label, False, str(exc)))
            return False
        images = [p for r in records for p in r.image_paths]
        for image in images:
            try:
                from PIL import Image

                with Image.open(image) as handle:
                    handle.verify()
            except Exception as exc:  # noqa: BLE001 - PIL raises many types for unreadable files
                checks.append(PreflightCheck(label, False, f"{image}: not a readable image ({exc})"))
                return False
        images = len(images)
        checks.append(PreflightCheck(label, True, f"{path}: first {len(records)} record(s) and {images} image(s) load"))
    return True
