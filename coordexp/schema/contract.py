"""The normalised run contract: every resolved value the runtime needs, frozen, built once from the config.

``RolloutMatchingContract`` is the spec's ``rollout_matching_cfg``: the runtime reads only this, never the YAML
and never the original key paths (``auto`` sync, ``packing_length``, server list and timeouts are resolved).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel

from coordexp.schema.custom import ObjectFieldOrder, TrainerVariant
from coordexp.schema.data import DataConfig
from coordexp.schema.errors import ConfigError, ConfigIssue
from coordexp.schema.loader import load_config
from coordexp.schema.matching import MatchingConfig, OtConfig
from coordexp.schema.model import ModelConfig
from coordexp.schema.pipeline import PipelineConfig
from coordexp.schema.rollout import DecodingConfig, OffloadConfig, RepeatTerminateConfig
from coordexp.schema.root import CoordExpConfig
from coordexp.schema.template import TemplateConfig
from coordexp.schema.training import TrainingConfig

__all__ = [
    "ServerEndpoint",
    "VllmContract",
    "PackingContract",
    "RolloutMatchingContract",
    "RunContract",
    "build_contract",
    "load_contract",
]


@dataclass(frozen=True)
class ServerEndpoint:
    """One rollout server: ``base_url`` without a trailing slash, and its communicator ``group_port``."""

    base_url: str
    group_port: int


@dataclass(frozen=True)
class VllmContract:
    """Resolved vLLM settings (colocate knobs are present in server mode too, and unused there)."""

    mode: Literal["colocate", "server"]
    gpu_memory_utilization: float
    tensor_parallel_size: int
    max_model_len: int  # resolved: vllm.max_model_len or global_max_length
    enable_lora: bool
    enable_prefix_caching: bool
    enforce_eager: bool
    max_num_seqs: Optional[int]
    sync_mode: Literal["full", "adapter"]  # `auto` resolved: adapter iff enable_lora
    sync_mode_requested: Literal["full", "adapter", "auto"]
    fallback_to_full: bool
    servers: tuple[ServerEndpoint, ...]  # empty in colocate mode
    timeout_s: float
    infer_timeout_s: Optional[float]  # None: no /infer/ timeout (null or <= 0 in the YAML)


@dataclass(frozen=True)
class PackingContract:
    """Post-rollout packing knobs; ``packing_length`` = template.max_length or global_max_length."""

    enabled: bool
    packing_length: int
    buffer: int
    min_fill_ratio: float
    drop_last: bool


@dataclass(frozen=True)
class RolloutMatchingContract:
    """The spec's ``rollout_matching_cfg``: what rollout, matching, target and loss code reads."""

    rollout_backend: Literal["vllm", "hf"]
    vllm_mode: Optional[Literal["colocate", "server"]]  # None when rollout_backend is hf
    decode_batch_size: int
    max_new_tokens: int
    decoding: DecodingConfig
    repeat_terminate: RepeatTerminateConfig
    vllm: VllmContract
    offload: OffloadConfig
    offload_active: bool  # offload requested AND the backend is vLLM colocate (otherwise a no-op)
    pipeline: PipelineConfig
    matching: MatchingConfig
    ot: OtConfig
    object_field_order: ObjectFieldOrder
    packing: PackingContract

    @property
    def is_beam_search(self) -> bool:
        return self.decoding.num_beams > 1

    @property
    def is_greedy(self) -> bool:
        return self.decoding.temperature == 0.0 and self.decoding.num_beams == 1

    def require_full_sync_for(self, world_size: int) -> None:
        """Fail with guidance when server-mode weight sync is not ``full`` under a multi-process learner."""
        if world_size > 1 and self.vllm_mode == "server" and self.vllm.sync_mode != "full":
            requested = self.vllm.sync_mode_requested
            how = f"sync.mode: {requested}"
            if requested == "auto":
                how += " (resolves to adapter because enable_lora: true)"
            raise ConfigError(
                [
                    ConfigIssue(
                        "rollout_matching.vllm.sync.mode",
                        f"{how} is not supported with a multi-process learner (world_size={world_size}); "
                        "rank0 pushes full merged weights between barriers",
                        "Set rollout_matching.vllm.sync.mode: full, or run the learner as a single process.",
                    )
                ]
            )


@dataclass(frozen=True)
class RunContract:
    """Everything a run needs, resolved. Paths are absolute (resolved against the YAML that set them)."""

    trainer_variant: TrainerVariant
    global_max_length: int
    seed: int
    model: ModelConfig
    template: TemplateConfig
    data: DataConfig  # image_root resolved (defaults to the directory of train_jsonl)
    training: TrainingConfig
    rollout_matching: RolloutMatchingContract

    def to_dict(self) -> dict:
        """Plain JSON-ready data (for ``coordexp validate --print-contract`` and run metadata)."""
        return _plain(self)


def _plain(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _vllm_contract(cfg: CoordExpConfig) -> VllmContract:
    v = cfg.rollout_matching.vllm
    resolved_sync = v.sync.mode if v.sync.mode != "auto" else ("adapter" if v.enable_lora else "full")
    server = v.server
    servers = (
        tuple(ServerEndpoint(s.base_url.rstrip("/"), s.group_port) for s in server.servers)
        if server is not None and v.mode == "server"
        else ()
    )
    infer_timeout = server.infer_timeout_s if server is not None else None
    return VllmContract(
        mode=v.mode,
        gpu_memory_utilization=v.gpu_memory_utilization,
        tensor_parallel_size=v.tensor_parallel_size,
        max_model_len=v.max_model_len if v.max_model_len is not None else cfg.global_max_length,
        enable_lora=v.enable_lora,
        enable_prefix_caching=v.enable_prefix_caching,
        enforce_eager=v.enforce_eager,
        max_num_seqs=v.max_num_seqs,
        sync_mode=resolved_sync,
        sync_mode_requested=v.sync.mode,
        fallback_to_full=v.sync.fallback_to_full,
        servers=servers,
        timeout_s=server.timeout_s if server is not None else 240.0,
        infer_timeout_s=infer_timeout if infer_timeout is not None and infer_timeout > 0 else None,
    )


def build_contract(cfg: CoordExpConfig) -> RunContract:
    """Normalise a validated config into the frozen :class:`RunContract`."""
    rm = cfg.rollout_matching
    if rm.pipeline is None:  # unreachable for a validated config; kept for configs built by hand
        raise ConfigError([ConfigIssue("rollout_matching.pipeline", "rollout_matching.pipeline is required")])
    t = cfg.training
    packing = PackingContract(
        enabled=t.packing,
        packing_length=cfg.template.max_length or cfg.global_max_length,
        buffer=t.packing_buffer,
        min_fill_ratio=t.packing_min_fill_ratio,
        drop_last=t.packing_drop_last,
    )
    vllm = _vllm_contract(cfg)
    rollout = RolloutMatchingContract(
        rollout_backend=rm.rollout_backend,
        vllm_mode=vllm.mode if rm.rollout_backend == "vllm" else None,
        decode_batch_size=rm.decode_batch_size,
        max_new_tokens=rm.max_new_tokens,
        decoding=rm.decoding,
        repeat_terminate=rm.repeat_terminate,
        vllm=vllm,
        offload=rm.offload,
        offload_active=rm.offload.enabled and rm.rollout_backend == "vllm" and vllm.mode == "colocate",
        pipeline=rm.pipeline,
        matching=rm.matching,
        ot=rm.ot,
        object_field_order=cfg.custom.object_field_order,
        packing=packing,
    )
    data = cfg.data
    if data.image_root is None:
        data = data.model_copy(update={"image_root": str(Path(data.train_jsonl).parent)})
    return RunContract(
        trainer_variant=cfg.custom.trainer_variant,
        global_max_length=cfg.global_max_length,
        seed=t.seed,
        model=cfg.model,
        template=cfg.template,
        data=data,
        training=t,
        rollout_matching=rollout,
    )


def load_contract(path: Union[str, Path]) -> RunContract:
    """Load, validate and normalise ``path``; raises :class:`ConfigError` listing every problem."""
    return build_contract(load_config(path))

