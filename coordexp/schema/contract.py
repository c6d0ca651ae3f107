"""The normalised run contract: every resolved value the runtime needs, frozen, built once from the config.

``RolloutMatchingContract`` is the spec's ``rollout_matching_cfg``: the runtime reads only this, never the YAML
and never the original key paths (``auto`` sync, ``packing_length``, server list and timeouts are resolved).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, SecretStr

from coordexp.schema.custom import ObjectFieldOrder, TrainerVariant
from coordexp.schema.data import DataConfig, GtPrefixMix
from coordexp.schema.errors import ConfigError, ConfigIssue
from coordexp.schema.loader import load_config
from coordexp.schema.matching import MatchingConfig, OtConfig
from coordexp.schema.model import ModelConfig
from coordexp.schema.pipeline import PipelineConfig
from coordexp.schema.rollout import (CollapseAlarmConfig, DecodingConfig, HfGenerateConfig, OffloadConfig,
                                      OverlapConfig, RepeatTerminateConfig, RepeatUnlikelihoodConfig,
                                      RewardConfig)
from coordexp.schema.root import CoordExpConfig
from coordexp.schema.template import TemplateConfig
from coordexp.schema.training import TrainingConfig
from coordexp.schema.tuner import TunerConfig

__all__ = [
    "ServerEndpoint",
    "VllmEngineContract",
    "WeightSyncContract",
    "HfBackendContract",
    "VllmColocateContract",
    "VllmServerContract",
    "BackendContract",
    "ServingContract",
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
class VllmEngineContract:
    """The resolved vLLM engine knobs (``rollout_matching.vllm.*``): what an engine starts with, in the learner
    (colocate) or in ``coordexp serve-rollout --engine vllm``."""

    gpu_memory_utilization: float
    tensor_parallel_size: int
    max_model_len: int  # resolved: vllm.max_model_len or global_max_length
    enable_lora: bool
    enable_prefix_caching: bool
    enforce_eager: bool
    max_num_seqs: Optional[int]
    # vLLM EngineArgs knobs under their own names; None = not passed (vLLM's default)
    max_num_batched_tokens: Optional[int] = None
    enable_chunked_prefill: Optional[bool] = None
    disable_chunked_mm_input: Optional[bool] = None
    limit_mm_per_prompt: Optional[dict[str, int]] = None  # {"image": N, "video": 0}
    skip_mm_profiling: Optional[bool] = None
    mm_encoder_tp_mode: Optional[Literal["weights", "data"]] = None
    sleep_level: Literal[0, 1, 2] = 0  # colocate only: vLLM sleeps between rollout rounds
    infer_batch_size: Optional[int] = None  # colocate only: prompts per engine generate call


@dataclass(frozen=True)
class WeightSyncContract:
    """How learner weights reach a vLLM engine: ``mode`` is resolved (``auto`` -> adapter iff enable_lora)."""

    mode: Literal["full", "adapter"]
    requested_mode: Literal["full", "adapter", "auto"]
    fallback_to_full: bool


@dataclass(frozen=True)
class HfBackendContract:
    """Rollouts with transformers ``generate`` on the live policy; it needs nothing beyond the shared knobs."""

    kind: Literal["hf"] = field(default="hf", init=False)


@dataclass(frozen=True)
class VllmColocateContract:
    """A vLLM engine inside the training process: its engine knobs, weight sync and offload around rollouts."""

    engine: VllmEngineContract
    sync: WeightSyncContract
    offload: OffloadConfig
    kind: Literal["vllm_colocate"] = field(default="vllm_colocate", init=False)


@dataclass(frozen=True)
class VllmServerContract:
    """Pre-launched rollout servers: where they are, how long to wait, and how weights are pushed to them."""

    servers: tuple[ServerEndpoint, ...]
    timeout_s: float
    infer_timeout_s: Optional[float]  # None: no /infer/ timeout (null or <= 0 in the YAML)
    sync: WeightSyncContract
    sync_token: Optional[SecretStr] = None  # masked in repr and to_dict; None: COORDEXP_SYNC_TOKEN, if set
    kind: Literal["vllm_server"] = field(default="vllm_server", init=False)


BackendContract = Union[HfBackendContract, VllmColocateContract, VllmServerContract]


@dataclass(frozen=True)
class ServingContract:
    """What ``coordexp serve-rollout`` starts for this config, whichever backend the learner uses: the vLLM engine
    knobs and the weight-sync timeout of the receiving end."""

    engine: VllmEngineContract
    sync_timeout_s: float


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

    backend: BackendContract  # the ONE resolved rollout backend, carrying only its own settings
    decode_batch_size: int
    max_new_tokens: int
    decoding: DecodingConfig
    repeat_terminate: RepeatTerminateConfig
    serving: ServingContract
    pipeline: PipelineConfig
    matching: MatchingConfig
    ot: OtConfig
    object_field_order: ObjectFieldOrder
    packing: PackingContract
    overlap: OverlapConfig  # actor-learner overlap (server mode only; validated in the schema)
    hf_generate: HfGenerateConfig = field(default_factory=HfGenerateConfig)  # static KV cache / compiled decode
    gt_step_share: float = 0.0  # share of stage-2 optimizer steps trained on the GT serialization (channel A)
    trailing_unmatched: Literal["keep", "drop"] = "keep"  # the prefix ends after the last matched object when "drop"
    collapse_alarm: CollapseAlarmConfig = field(default_factory=CollapseAlarmConfig)  # stage-2 window checks
    fn_placement: Literal["append", "reading_order", "cut_at_skip"] = "append"  # where a missed object is taught
    repeats: Literal["neutral", "drop", "unlikelihood"] = "neutral"  # certified repeats: context, left out, pushed down
    repeat_unlikelihood: RepeatUnlikelihoodConfig = field(default_factory=RepeatUnlikelihoodConfig)
    gt_prefix_mix: GtPrefixMix = field(default_factory=GtPrefixMix)  # data.gt_prefix_mix: gap-augmented GT samples
    objective: Literal["sft", "reward"] = "sft"  # SFT or the reward objective (docs/design.md, decision 19)
    reward: RewardConfig = field(default_factory=RewardConfig)  # the reward objective's settings

    @property
    def offload_active(self) -> bool:
        """Offload requested AND the backend is vLLM colocate (for any other backend offload is a no-op)."""
        return isinstance(self.backend, VllmColocateContract) and self.backend.offload.enabled

    @property
    def is_beam_search(self) -> bool:
        return self.decoding.num_beams > 1

    @property
    def greedy_evaluation(self) -> bool:
        """Evaluation rollouts decode greedily while training samples: the reward objective with a backend that
        takes the greedy flag per request, HF or vLLM colocate (docs/design.md, decision 19)."""
        return self.objective == "reward" and isinstance(self.backend, (HfBackendContract, VllmColocateContract))

    @property
    def is_greedy(self) -> bool:
        return self.decoding.temperature == 0.0 and self.decoding.num_beams == 1

    def require_full_sync_for(self, world_size: int) -> None:
        """Fail with guidance when server-mode weight sync is not ``full`` under a multi-process learner."""
        backend = self.backend
        if world_size > 1 and isinstance(backend, VllmServerContract) and backend.sync.mode != "full":
            requested = backend.sync.requested_mode
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
    tuner: TunerConfig = field(default_factory=TunerConfig)

    @property
    def sample_max_length(self) -> int:
        """The token cap of one encoded training sample: ``template.max_length``, else ``global_max_length``
        (packing refuses a longer segment; the unpacked paths pass it to ``encode_teacher_forced``)."""
        return self.template.max_length or self.global_max_length

    def to_dict(self) -> dict:
        """Plain JSON-ready data (for ``coordexp validate --print-contract`` and run metadata)."""
        return _plain(self)


def _plain(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, SecretStr):
        return str(value)  # "**********": a secret is never printed
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _engine_contract(cfg: CoordExpConfig) -> VllmEngineContract:
    v = cfg.rollout_matching.vllm
    return VllmEngineContract(
        gpu_memory_utilization=v.gpu_memory_utilization,
        tensor_parallel_size=v.tensor_parallel_size,
        max_model_len=v.max_model_len if v.max_model_len is not None else cfg.global_max_length,
        enable_lora=v.enable_lora,
        enable_prefix_caching=v.enable_prefix_caching,
        enforce_eager=v.enforce_eager,
        max_num_seqs=v.max_num_seqs,
        max_num_batched_tokens=v.max_num_batched_tokens,
        enable_chunked_prefill=v.enable_chunked_prefill,
        disable_chunked_mm_input=v.disable_chunked_mm_input,
        limit_mm_per_prompt=v.limit_mm_per_prompt.model_dump() if v.limit_mm_per_prompt is not None else None,
        skip_mm_profiling=v.skip_mm_profiling,
        mm_encoder_tp_mode=v.mm_encoder_tp_mode,
        sleep_level=v.sleep_level,
        infer_batch_size=v.infer_batch_size,
    )


def _backend_contract(cfg: CoordExpConfig, engine: VllmEngineContract) -> BackendContract:
    """The typed backend choice of ``rollout_backend`` + ``vllm.mode`` (the only place that reads those two keys)."""
    rm = cfg.rollout_matching
    if rm.rollout_backend == "hf":
        return HfBackendContract()
    v = rm.vllm
    sync = WeightSyncContract(
        mode=v.sync.mode if v.sync.mode != "auto" else ("adapter" if v.enable_lora else "full"),
        requested_mode=v.sync.mode,
        fallback_to_full=v.sync.fallback_to_full,
    )
    if v.mode == "colocate":
        return VllmColocateContract(engine=engine, sync=sync, offload=rm.offload)
    server = v.server
    if server is None:  # unreachable for a validated config (server mode requires vllm.server)
        raise ConfigError([ConfigIssue("rollout_matching.vllm.server", "vllm.mode: server needs vllm.server.servers")])
    infer_timeout = server.infer_timeout_s
    return VllmServerContract(
        servers=tuple(ServerEndpoint(s.base_url.rstrip("/"), s.group_port) for s in server.servers),
        timeout_s=server.timeout_s,
        infer_timeout_s=infer_timeout if infer_timeout is not None and infer_timeout > 0 else None,
        sync=sync,
        sync_token=server.sync_token,
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
    engine = _engine_contract(cfg)
    server = rm.vllm.server
    rollout = RolloutMatchingContract(
        backend=_backend_contract(cfg, engine),
        decode_batch_size=rm.decode_batch_size,
        max_new_tokens=rm.max_new_tokens,
        decoding=rm.decoding,
        repeat_terminate=rm.repeat_terminate,
        serving=ServingContract(engine=engine, sync_timeout_s=server.timeout_s if server is not None else 240.0),
        pipeline=rm.pipeline,
        matching=rm.matching,
        ot=rm.ot,
        object_field_order=cfg.custom.object_field_order,
        packing=packing,
        overlap=rm.overlap,
        hf_generate=rm.hf_generate,
        gt_step_share=rm.gt_step_share,
        trailing_unmatched=rm.trailing_unmatched,
        collapse_alarm=rm.collapse_alarm,
        fn_placement=rm.fn_placement,
        repeats=rm.repeats,
        repeat_unlikelihood=rm.repeat_unlikelihood,
        gt_prefix_mix=cfg.data.gt_prefix_mix,
        objective=rm.objective,
        reward=rm.reward,
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
        tuner=cfg.tuner,
    )


def load_contract(path: Union[str, Path]) -> RunContract:
    """Load, validate and normalise ``path``; raises :class:`ConfigError` listing every problem."""
    return build_contract(load_config(path))

