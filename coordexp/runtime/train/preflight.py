"""``coordexp preflight``: everything a launch script should know before it starts servers and ``torchrun``.

Checks: the config validates (every problem listed, like ``coordexp validate``); the multi-process sync mode; the
model directory has a config and all 1000 coord tokens; this machine has the packages and CUDA the config needs,
and a stage-2 model.path was trained by coordexp (warnings where it can still run, RAM for a CPU run included;
``preflight_machine.py``); the data files exist and a sample of records and their images load; in server mode each
server answers ``/health/`` and ``/get_world_size/`` (probed in parallel), the topology is feasible, ``decode_batch_size * S >= W``, and, when the config enables ``repeat_terminate``, each
server's repeat guard is on (``GET /coordexp/repeat_guard/``; a ``swift rollout`` server cannot be checked: said so). With ``launch=True`` servers are not running yet: their HTTP
and group ports must be free on this host instead, and each is assumed to have ``server_world_size`` replicas.
Every check runs that can (only an invalid config stops the rest), so one run reports every problem.

Exit code (the error family's, see :data:`EXIT_CODES`): 2 when any problem is the user's to fix (config, model
directory, data), since waiting will not fix it; otherwise 3 when an external system is the problem (a server
unreachable or answering wrongly, an infeasible topology, a busy port); 0 when ready. The report carries the
launcher wiring: ``server_base_urls`` (projected from ``servers[]``), per-rank chunk, and a suggested device split
(3v1 on 4 GPUs). No torch import (this runs in a second on a login node) unless the config sets a field only the
machine can judge (``training.tf32``; bf16/fp16, flash-attn or colocated vLLM: torch counts the CUDA devices): then the real ``TrainingArguments`` are built here, as ``train`` builds them.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

from coordexp.errors import EXIT_EXTERNAL, EXIT_INVALID, EXIT_OK, UserInputError
from coordexp.runtime.core.distribution import InfeasibleTopologyError, per_rank_chunk
from coordexp.runtime.core.tokens import ALL_COORD_TOKENS
from coordexp.runtime.train.preflight_machine import (PreflightCheck, machine_checks, memory_checks,
                                                      stage2_start_checks)

__all__ = ["EXIT_CODES", "PreflightCheck", "PreflightReport", "run_preflight", "exit_code_of",
           "coord_tokens_missing", "suggest_device_split", "port_is_free", "optimizer_groups_detail", "hub_id_hint"]

EXIT_CODES = {
    EXIT_OK: "ready to launch",
    EXIT_INVALID: "invalid config, model directory or data: fix the input",
    EXIT_EXTERNAL: "an external system is not ready: a package the config needs is not installed, no CUDA device "
                   "for flash-attn, a rollout server is unreachable or answers wrongly, the "
                   "topology is infeasible (decode_batch_size * server world size < learner world size), or "
                   "(launch mode) a server or group port is already in use on this host",
}
_LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}


def _failed(name: str, detail: str, code: int) -> PreflightCheck:
    return PreflightCheck(name, False, detail, code)


@dataclass(frozen=True)
class PreflightReport:
    exit_code: int
    checks: tuple[PreflightCheck, ...]
    wiring: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.exit_code == EXIT_OK

    @property
    def problems(self) -> tuple[PreflightCheck, ...]:
        """The failed checks, in the order they ran."""
        return tuple(c for c in self.checks if not c.ok)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "exit_code": self.exit_code, "meaning": EXIT_CODES[self.exit_code],
                "checks": [asdict(c) for c in self.checks], "wiring": self.wiring}


def exit_code_of(checks: list[PreflightCheck] | tuple[PreflightCheck, ...]) -> int:
    """2 if any failed check is the user's to fix, else 3 if any is an external system's, else 0."""
    codes = {c.exit_code for c in checks if not c.ok}
    return EXIT_INVALID if EXIT_INVALID in codes else EXIT_EXTERNAL if codes else EXIT_OK


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
                  sample_records: int = 8, validate: Callable[[Any], Any] | None = None,
                  nnodes: int | None = None) -> PreflightReport:
    """Run every check (module docstring); never raises for user or server problems, the report says what is wrong.
    ``validate`` reads the config into a validation report (default: the file as it is; the CLI's applies --set).
    ``nnodes``: the launch's node count (``learner_world_size`` ranks in all, the same number on each node) adds
    what each node needs (:mod:`coordexp.runtime.train.preflight_nodes`)."""
    from coordexp.schema.contract import VllmServerContract, build_contract
    from coordexp.schema.errors import ConfigError
    from coordexp.schema.loader import validate_config_file

    checks: list[PreflightCheck] = []

    nodes: dict[str, Any] = {}

    def done(wiring: dict | None = None) -> PreflightReport:
        return PreflightReport(exit_code_of(checks), tuple(checks), {**nodes, **(wiring or {})})

    try:
        report = (validate or validate_config_file)(config_path)
        issues = list(report.errors)
        run = None
        if report.ok:
            try:
                run = build_contract(report.config)
            except ConfigError as exc:
                issues = list(exc.issues)
    except (OSError, ValueError) as exc:  # an unreadable path the loader did not turn into an issue
        issues, run = [], None
        checks.append(_failed("config", f"{config_path}: {exc}", EXIT_INVALID))
    for issue in issues:
        where = f" (in {issue.file})" if issue.file and issue.file != report.path else ""
        checks.append(_failed("config", issue.render() + where, EXIT_INVALID))
    if run is None:
        return done()
    rollout = run.rollout_matching
    backend = rollout.backend
    stage2 = str(run.trainer_variant).startswith("stage2")
    checks.append(PreflightCheck("config", True, f"{config_path}: {run.trainer_variant}" + (
        f", backend {backend.kind}" if stage2 else "")))
    overlap = rollout.overlap
    if stage2:  # rollouts, hence overlap and servers, are stage 2's
        checks.append(PreflightCheck("overlap", True, (
            f"actor-learner overlap ON: the next micro-step's rollouts generate while this one trains (samples up "
            f"to {overlap.staleness} optimizer step(s) behind)") if overlap.enabled
            else "actor-learner overlap off (on-policy rollouts)"))
    try:
        rollout.require_full_sync_for(learner_world_size)
    except ConfigError as exc:
        checks.extend(_failed("sync mode", i.render(), EXIT_INVALID) for i in exc.issues)

    if nnodes is not None:
        from coordexp.runtime.train.preflight_nodes import node_checks

        node_report, nodes["nodes"] = node_checks(run, nnodes, learner_world_size // nnodes)
        checks.extend(node_report)
    _check_model(Path(run.model.path), checks)
    if stage2:
        checks.extend(stage2_start_checks(run))
    checks.extend(machine_checks(run))
    checks.extend(memory_checks(run, _part_sizes_or_none(run)))
    _check_training_arguments(run, checks)
    checks.append(PreflightCheck("optimizer groups", True, optimizer_groups_detail(run)))
    _check_data(run, checks, sample_records)
    if not isinstance(backend, VllmServerContract):
        if stage2:
            checks.append(PreflightCheck("servers", True, "not in server mode: no rollout server to check"))
        return done()

    servers = backend.servers
    wiring: dict[str, Any] = {"server_base_urls": [s.base_url for s in servers],
                              "group_ports": [s.group_port for s in servers],
                              "learner_world_size": learner_world_size,
                              "decode_batch_size": rollout.decode_batch_size}
    if launch:
        world_sizes: list[int] | None = _check_ports_free(servers, checks, server_world_size)
    else:
        timeout = backend.timeout_s if health_timeout_s is None else health_timeout_s
        world_sizes = _check_servers(servers, checks, timeout)
    wiring["suggested_device_split"] = suggest_device_split(num_gpus or _visible_gpus(), learner_world_size)
    if world_sizes is None:  # a server did not answer: its world size, hence the topology, is unknown
        return done(wiring)
    wiring["server_world_sizes"] = world_sizes
    if rollout.repeat_terminate.enabled and not launch:
        _check_repeat_guards(servers, checks, timeout, rollout.repeat_terminate)
    try:
        wiring["per_rank_chunk"] = per_rank_chunk(rollout.decode_batch_size, world_sizes, learner_world_size)
    except InfeasibleTopologyError as exc:
        checks.append(_failed("topology", str(exc), EXIT_EXTERNAL))
        return done(wiring)
    checks.append(PreflightCheck("topology", True, f"decode_batch_size {rollout.decode_batch_size} * S "
                                 f"{sum(world_sizes)} >= W {learner_world_size}; per-rank chunk "
                                 f"{wiring['per_rank_chunk']}"))
    return done(wiring)


def _check_ports_free(servers: Any, checks: list[PreflightCheck], server_world_size: int) -> list[int]:
    """Launch mode: every local server's HTTP and group port must be bindable now; world sizes are as announced."""
    busy = []
    for s in servers:
        host = urlsplit(s.base_url).hostname or "127.0.0.1"
        port = urlsplit(s.base_url).port or 80
        if host in _LOCAL_HOSTS:
            busy += [f"{s.base_url} port {p}" for p in (port, s.group_port) if not port_is_free(host, p)]
    if busy:
        checks.append(_failed("ports free", "busy: " + ", ".join(busy) + "; stop what holds them or change "
                              "servers[] (coordexp never moves a port silently)", EXIT_EXTERNAL))
    else:
        checks.append(PreflightCheck("ports free", True, "every local server and group port is free"))
    return [server_world_size] * len(servers)


def _check_servers(servers: Any, checks: list[PreflightCheck], timeout_s: float) -> list[int] | None:
    """Probe every server at once (each within ``timeout_s``); their world sizes, or None if any failed."""
    from coordexp.runtime.rollout.client import RolloutServerClient, ServerError

    def probe(server: Any) -> int | ServerError:
        client = RolloutServerClient(server.base_url, group_port=server.group_port, timeout_s=timeout_s)
        try:
            client.wait_until_healthy()
            return client.world_size()
        except ServerError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=min(16, len(servers)) or 1, thread_name_prefix="preflight") as pool:
        answers = list(pool.map(probe, servers))
    for server, answer in zip(servers, answers):
        if isinstance(answer, ServerError):
            checks.append(_failed(f"server {server.base_url}", str(answer), EXIT_EXTERNAL))
        else:
            checks.append(PreflightCheck(f"server {server.base_url}", True, f"healthy, world size {answer}"))
    if any(isinstance(a, ServerError) for a in answers):
        return None
    return [int(a) for a in answers]  # type: ignore[arg-type]


def _check_repeat_guards(servers: Any, checks: list[PreflightCheck], timeout_s: float, guard: Any) -> None:
    """The config requires the repeat guard: each server must say it is on (``inactive`` fails, exit 3); a server
    without coordexp's endpoint (``swift rollout``) passes with a note that its guard cannot be checked."""
    from coordexp.runtime.rollout.client import RolloutServerClient, ServerError
    from coordexp.runtime.rollout.repeat_guard_check import probe_repeat_guard

    for server in servers:
        name = f"repeat guard {server.base_url}"
        try:
            probe = probe_repeat_guard(RolloutServerClient(server.base_url, timeout_s=timeout_s), guard)
        except ServerError as exc:
            checks.append(_failed(name, str(exc), EXIT_EXTERNAL))
            continue
        if probe.state == "inactive":
            checks.append(_failed(name, "the config requires it (rollout_matching.repeat_terminate.enabled: true) "
                                  "but the server's guard is off; restart the server from a config with the guard "
                                  "on (coordexp serve-rollout CFG), or disable it in this config", EXIT_EXTERNAL))
        else:
            checks.append(PreflightCheck(name, True, probe.detail))


def _checkpoint_part_sizes(model_dir: Path) -> dict[str, int] | None:
    """Parameter counts per model part from the safetensors headers (no torch); None without safetensors files."""
    from coordexp.runtime.model.parts import PARTS, model_part

    files = sorted(model_dir.glob("*.safetensors")) if model_dir.is_dir() else []
    if not files:
        return None
    sizes = dict.fromkeys(PARTS, 0)
    for file in files:
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(min(length, 100 * 2**20)))
        for name, info in header.items():
            if name != "__metadata__":
                count = 1
                for dim in info.get("shape", []):
                    count *= int(dim)
                sizes[model_part(name)] += count
    return sizes


def _part_sizes_or_none(run: Any) -> dict[str, int] | None:
    try:
        return _checkpoint_part_sizes(Path(run.model.path))
    except (OSError, ValueError, struct.error):
        return None


def optimizer_groups_detail(run: Any) -> str:
    """The optimizer groups a launch will build: per part its lr, weight decay and checkpoint parameter count, or
    frozen (biases and norms get weight decay 0 in a group of their own at launch; docs/design.md, decision 13)."""
    from coordexp.runtime.model.tuner import frozen_parts
    from coordexp.runtime.train.optim import describe_coord_rows, part_rates

    t, tuner = run.training, run.tuner
    frozen = frozen_parts(tuner)
    sizes = _part_sizes_or_none(run)
    parts = []
    for part, rate in part_rates(t).items():
        if part in frozen:
            parts.append(f"{part}: frozen")
            continue
        lora = tuner.train_type == "lora"
        count = "" if sizes is None else " (LoRA adapters)" if lora else f", {sizes[part]:,} params"
        parts.append(f"{part}: lr {rate.lr:g}, weight_decay {rate.weight_decay:g}{count}")
    coord_rows = describe_coord_rows(t, tuner)
    parts += [coord_rows] if coord_rows else []
    floor = t.lr_scheduler_kwargs.model_dump(exclude_none=True) if t.lr_scheduler_kwargs else ""
    return "; ".join(parts) + f"; schedule {t.lr_scheduler_type} {floor}".rstrip()


def _check_training_arguments(run: Any, checks: list[PreflightCheck]) -> None:
    """Fields only this machine can judge (``tf32`` needs an Ampere GPU): the real ``TrainingArguments`` are built
    here, as ``train`` builds them (importing torch, which preflight otherwise never does); without such a field
    there is no line: the schema's checks stand (runtime/train/args_check.py)."""
    from coordexp.runtime.train.args_check import needs_machine_check, training_argument_issues

    if not needs_machine_check(run):
        return

    try:
        issues = training_argument_issues(run, machine=True)
    except UserInputError as exc:
        checks.append(_failed("training arguments", f"{exc}; {exc.hint}".rstrip("; "), EXIT_INVALID))
        return
    for issue in issues:
        checks.append(_failed("training arguments", f"{issue.render()} (on this machine)", EXIT_INVALID))
    if not issues:
        checks.append(PreflightCheck("training arguments", True, "transformers accepts them on this machine"))


def _check_model(model_dir: Path, checks: list[PreflightCheck]) -> None:
    from coordexp.runtime.model.adapters import AdapterDirError, adapter_base, is_adapter_dir

    config_dir, adapter = model_dir, ""
    if is_adapter_dir(model_dir):  # a saved adapter: tokenizer here, config (family) in its base checkpoint
        try:
            config_dir = Path(adapter_base(model_dir))
        except AdapterDirError as exc:
            checks.append(_failed("model", f"{exc}; {exc.hint}", EXIT_INVALID))
            return
        adapter = f" (LoRA adapter on {config_dir})"
    if not (config_dir / "config.json").is_file():
        checks.append(_failed("model", f"{model_dir} has no config.json; set model.path to a Hugging Face model "
                              "directory" + hub_id_hint(str(model_dir)), EXIT_INVALID))
        return
    try:
        missing = coord_tokens_missing(model_dir)
    except (OSError, ValueError) as exc:  # unreadable or malformed tokenizer files
        checks.append(_failed("model", f"{model_dir}: cannot read the tokenizer files ({exc}); point model.path at "
                              "a complete checkpoint", EXIT_INVALID))
        return
    if missing:
        checks.append(_failed("model", f"{model_dir}: {len(missing)} of 1000 coord tokens missing (e.g. "
                              f"{missing[:3]}); add them to the tokenizer (coordexp expand-vocab SRC DST, or "
                              "coordexp.runtime.core.tokens.add_coord_tokens) and resize the embeddings", EXIT_INVALID))
        return
    from coordexp.runtime.model.policy import LaunchError, checkpoint_family

    try:
        family = checkpoint_family(config_dir)
    except LaunchError as exc:
        checks.append(_failed("model", str(exc), EXIT_INVALID))
        return
    checks.append(PreflightCheck("model", True, f"{model_dir}{adapter}: {family}, all 1000 coord tokens"))


def hub_id_hint(path: str) -> str:
    """For a ``model.path`` that names a hub model (``ORG/NAME``, no local folder): the commands that make it a
    usable local checkpoint (the download command that exists in current huggingface_hub is ``hf``)."""
    parts = path.split("/")
    if Path(path).expanduser().exists() or path.startswith((".", "/", "~")) or len(parts) != 2 or not all(parts):
        return ""
    name = parts[1]
    return (f"; {path} is a hub id: download it (hf download {path} --local-dir {name}), add the coord tokens "
            f"(coordexp expand-vocab {name} {name}-coord) and set model.path to {name}-coord")


def _check_data(run: Any, checks: list[PreflightCheck], sample: int) -> None:
    """Each data file: its first ``sample`` records parse, every image they name opens, and each record's size is its
    image's as displayed (EXIF orientation applied; each bad one listed, exit 2)."""
    from PIL import Image

    from coordexp.runtime.model.data import DatasetError, load_records, size_mismatch

    data = run.data
    for label, path in (("train data", data.train_jsonl), ("val data", data.val_jsonl)):
        if path is None:
            continue
        try:
            records = load_records(path, data.image_root, max_samples=sample, check_files=True)
        except (DatasetError, OSError) as exc:
            checks.append(_failed(label, str(exc), EXIT_INVALID))
            continue
        images = [p for r in records for p in r.image_paths]
        bad = 0
        for record in records:  # boxes are read in the record's frame: its size must be the displayed image's
            mismatch = size_mismatch(record.image_paths[0], record.width, record.height)
            if mismatch is not None:
                checks.append(_failed(label, f"{record.source}: images[0]: {mismatch}", EXIT_INVALID))
                bad += 1
        for image in images:
            try:
                with Image.open(image) as handle:
                    handle.verify()
            except Exception as exc:  # noqa: BLE001 - PIL raises many types for unreadable files
                checks.append(_failed(label, f"{image}: not a readable image ({exc})", EXIT_INVALID))
                bad += 1
        if not bad:
            checks.append(PreflightCheck(label, True, f"{path}: first {len(records)} record(s) and {len(images)} "
                                         "image(s) load"))
