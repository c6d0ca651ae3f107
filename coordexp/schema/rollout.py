"""``rollout_matching.*``: backend, decoding, repeat guard, vLLM colocate/server, offload, knobs."""

from __future__ import annotations

from typing import Any, Literal, Optional
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator

from coordexp.schema.base import (
    MAX_BEAMS,
    MAX_DEVICES,
    MAX_SECONDS,
    MAX_TOKENS,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    BatchSize,
    Probability,
    StrictModel,
    TokenLength,
    Weight,
    float_in,
    int_in,
)
from coordexp.schema.errors import RuleViolation, raise_violations
from coordexp.schema.matching import MatchingConfig, OtConfig
from coordexp.schema.pipeline import PipelineConfig

__all__ = [
    "DecodingConfig",
    "RepeatTerminateConfig",
    "VllmSyncConfig",
    "VllmServerEntry",
    "VllmServerConfig",
    "VllmMmLimits",
    "VllmConfig",
    "OffloadConfig",
    "OverlapConfig",
    "HfGenerateConfig",
    "CollapseAlarmConfig",
    "RewardConfig",
    "RolloutMatchingConfig",
]


class DecodingConfig(StrictModel):
    """Rollout sampling. ``temperature: 0`` is greedy; ``num_beams > 1`` is beam search (HF only)."""

    temperature: float_in(ge=0.0, le=100.0) = Field(0.0, description="0 = greedy; > 0 samples (at most 100).")
    top_p: float_in(gt=0.0, le=1.0) = Field(1.0, description="Nucleus mass in (0, 1].")
    top_k: int_in(-1, MAX_TOKENS) = Field(-1, description="-1 disables top-k; otherwise >= 1 (at most 2**20).")
    num_beams: int_in(1, MAX_BEAMS) = Field(1, description="> 1 runs beam search and trains on the best beam.")
    repetition_penalty: float_in(ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY) = Field(
        1.0, description="1.0 disables the penalty; in [0.01, 100] (a logit stays finite in float16).")
    coord_group_greedy: bool = Field(
        False, description="Greedy steps pick a coordinate when the coord tokens hold more than half the "
        "probability, then the likeliest token of the chosen kind (docs/design.md, decision 16); needs temperature 0 "
        "and num_beams 1.")

    @field_validator("top_k")
    @classmethod
    def _top_k_range(cls, value: int) -> int:
        if value != -1 and value < 1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1 (got {value})")
        return value

    @model_validator(mode="after")
    def _group_greedy_is_greedy(self) -> "DecodingConfig":
        if self.coord_group_greedy and (self.temperature > 0 or self.num_beams > 1):
            raise ValueError(
                f"coord_group_greedy changes greedy decoding only (temperature 0, num_beams 1; got temperature "
                f"{self.temperature}, num_beams {self.num_beams}): sampling already draws a coordinate with the coord "
                "tokens' total probability, and beam search ranks whole sequences; set it false or decode greedily")
        return self


class RepeatTerminateConfig(StrictModel):
    """Per-sequence repeat guard: an offending sequence is forced to EOS; others in the batch continue."""

    enabled: bool = Field(False, description="Activate the guard for HF and vLLM rollouts alike.")
    min_new_tokens: int_in(0, MAX_TOKENS) = Field(256, description="Never trigger before this many new tokens.")
    max_consecutive_token_repeats: TokenLength = Field(64, description="Trigger on this many identical tokens.")
    ngram_size: TokenLength = Field(64, description="n-gram length watched for repeats.")
    ngram_repeats: int_in(2, MAX_TOKENS) = Field(2, description="Trigger when the last n-gram occurs this many times.")
    max_object_keys: Optional[TokenLength] = Field(None, description="Trigger after this many object_N keys.")


class VllmSyncConfig(StrictModel):
    """How learner weights reach vLLM after each optimizer step."""

    mode: Literal["full", "adapter", "auto"] = Field(
        "full", description="full: merged weights; adapter: LoRA only (needs enable_lora); auto: adapter iff LoRA."
    )
    fallback_to_full: bool = Field(True, description="On adapter-sync failure, warn and switch to full for good.")


class VllmServerEntry(StrictModel):
    """One pre-launched rollout server."""

    base_url: str = Field(description="http(s)://host:port prefix serving /health/, /infer/, /init_communicator/.")
    group_port: int = Field(ge=1, le=65535, description="TCP port of the weight-sync communicator group.")

    @field_validator("base_url")
    @classmethod
    def _http_url_with_host(cls, value: str) -> str:
        if any(ord(c) < 32 or ord(c) == 127 for c in value):
            raise ValueError("base_url must not contain control characters (NUL, newline, tab, ...)")
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base_url must be an http:// or https:// URL with a host (got {value!r})")
        if parts.hostname == "0.0.0.0":
            raise ValueError("base_url host 0.0.0.0 is a bind address, not reachable; use 127.0.0.1 or a hostname")
        try:
            parts.port
        except ValueError as exc:
            raise ValueError(f"base_url has an invalid port (got {value!r})") from exc
        return value


class VllmServerConfig(StrictModel):
    """``vllm.server``: an explicit list of servers (docs/design.md, decision 7; the paired-list form is legacy)."""

    servers: list[VllmServerEntry] = Field(min_length=1, description="Non-empty list of {base_url, group_port}.")
    timeout_s: float_in(gt=0.0, le=MAX_SECONDS) = Field(
        240.0, description="Reachability and communicator-init timeout, seconds (at most a week)."
    )
    infer_timeout_s: Optional[float_in(ge=-MAX_SECONDS, le=MAX_SECONDS)] = Field(
        None, description="HTTP timeout for /infer/; null or <= 0 means no timeout (at most a week)."
    )
    sync_token: Optional[SecretStr] = Field(
        None, description="The servers' weight-sync token (their --sync-token), sent as a Bearer header; never "
        "printed. null: the COORDEXP_SYNC_TOKEN environment variable, if set.")

    @field_validator("sync_token")
    @classmethod
    def _token_shape(cls, value: Optional[SecretStr]) -> Optional[SecretStr]:
        token = value.get_secret_value() if value is not None else None
        if token is not None and (len(token) < 8 or any(ord(c) < 33 or ord(c) > 126 for c in token)):
            raise ValueError("sync_token must be at least 8 printable ASCII characters without spaces, the same "
                             "value as the servers' --sync-token (the value is not shown)")
        return value

    @model_validator(mode="after")
    def _distinct_servers(self) -> "VllmServerConfig":
        violations, seen = [], {}
        for i, entry in enumerate(self.servers):
            key = entry.base_url.rstrip("/")
            if key in seen:
                violations.append(
                    RuleViolation(
                        f"servers[{i}].base_url",
                        f"duplicate server {entry.base_url!r} (already servers[{seen[key]}])",
                        "List each rollout server once.",
                    )
                )
            seen.setdefault(key, i)
        raise_violations(violations)
        return self


class VllmMmLimits(StrictModel):
    """``vllm.limit_mm_per_prompt``: the most multimodal items one prompt may carry (vLLM reserves memory for them)."""

    image: int_in(1, 256) = Field(1, description="Images per prompt.")
    video: int_in(0, 0) = Field(0, description="Videos per prompt (coordexp records hold images only).")


class VllmConfig(StrictModel):
    """``rollout_matching.vllm``: colocate settings (docs/design.md, rollout backend interface) or the server list."""

    mode: Literal["colocate", "server"] = Field("colocate", description="colocate (default) or server.")
    gpu_memory_utilization: float_in(gt=0.0, le=1.0) = Field(0.45, description="Colocate: VRAM share for vLLM.")
    tensor_parallel_size: int_in(1, MAX_DEVICES) = Field(4, description="Colocate: GPUs per engine.")
    max_model_len: Optional[int_in(16, MAX_TOKENS)] = Field(
        None, description="Prompt + generation cap; null means global_max_length."
    )
    enable_lora: bool = Field(False, description="Serve the policy as base + LoRA adapter.")
    enable_prefix_caching: bool = Field(True, description="Colocate: reuse KV cache of shared prompt prefixes.")
    enforce_eager: bool = Field(False, description="Colocate: disable CUDA graphs.")
    max_num_seqs: Optional[BatchSize] = Field(None, description="Colocate: engine batch cap; null = vLLM default.")
    # Engine knobs passed to vLLM's EngineArgs under the same names; null = not passed (vLLM's own default).
    max_num_batched_tokens: Optional[int_in(16, MAX_TOKENS)] = Field(
        None, description="Tokens the scheduler batches per step; null = vLLM default.")
    enable_chunked_prefill: Optional[bool] = Field(None, description="Split long prefills; null = vLLM default.")
    disable_chunked_mm_input: Optional[bool] = Field(
        None, description="Never split one image's tokens across prefill chunks; null = vLLM default.")
    limit_mm_per_prompt: Optional[VllmMmLimits] = Field(
        None, description="Items per prompt, {image: N, video: 0}; null = {image: 1, video: 0}.")
    skip_mm_profiling: Optional[bool] = Field(
        None, description="Skip the multimodal memory profiling at start; null = vLLM default.")
    mm_encoder_tp_mode: Optional[Literal["weights", "data"]] = Field(
        None, description="Vision encoder under tensor parallelism: shard weights or data; null = vLLM default.")
    sleep_level: Literal[0, 1, 2] = Field(
        0, description="Colocate: 0 keeps vLLM awake; 1 offloads its weights and frees its KV cache between rollout "
        "rounds; 2 discards the weights too (the next round pushes them again). Server engines never sleep.")
    infer_batch_size: Optional[BatchSize] = Field(
        None, description="Colocate: at most this many prompts per engine generate call (with decode_batch_size, "
        "the smaller wins); null = decode_batch_size.")
    sync: VllmSyncConfig = Field(default_factory=VllmSyncConfig)
    server: Optional[VllmServerConfig] = Field(None, description="Required when mode is server.")

    @model_validator(mode="after")
    def _mode_rules(self) -> "VllmConfig":
        violations = []
        if self.sync.mode == "adapter" and not self.enable_lora:
            violations.append(
                RuleViolation(
                    "sync.mode",
                    "sync.mode: adapter requires vllm.enable_lora: true (there is no adapter to sync)",
                    "Set rollout_matching.vllm.enable_lora: true, or use sync.mode: full.",
                )
            )
        if self.sleep_level == 2 and self.enable_lora:
            violations.append(
                RuleViolation(
                    "sleep_level",
                    "sleep_level: 2 discards vLLM's base weights, but with enable_lora: true only the adapter is "
                    "pushed after a wake-up",
                    "Use sleep_level: 1 (weights are kept in CPU memory), or enable_lora: false.",
                )
            )
        if self.mode == "server" and self.server is None:
            violations.append(
                RuleViolation(
                    "server",
                    "vllm.mode: server needs vllm.server.servers (the pre-launched rollout servers)",
                    "Add rollout_matching.vllm.server.servers: [{base_url: http://127.0.0.1:8000, group_port: "
                    "51216}], or use vllm.mode: colocate.",
                )
            )
        raise_violations(violations)
        return self


class OffloadConfig(StrictModel):
    """Colocate-only: move model/optimizer to CPU while vLLM generates (a no-op for other backends)."""

    enabled: bool = Field(False)
    offload_model: bool = Field(False)
    offload_optimizer: bool = Field(False)

    @model_validator(mode="after")
    def _offloads_something(self) -> "OffloadConfig":
        violations = []
        if self.enabled and not (self.offload_model or self.offload_optimizer):
            violations.append(
                RuleViolation(
                    "enabled",
                    "offload.enabled: true but neither offload_model nor offload_optimizer is set, so nothing moves",
                    "Set offload_model: true and/or offload_optimizer: true, or offload.enabled: false.",
                )
            )
        raise_violations(violations)
        return self


class OverlapConfig(StrictModel):
    """Actor-learner overlap: the next micro-step's rollouts are generated while this one trains, so a sample may
    come from a policy one optimizer step old. Off by default (on-policy). ``staleness`` bounds the age of every
    trained sample, overlap on or off: carried packing segments older than it are dropped (docs/design.md,
    decision 14)."""

    enabled: bool = Field(False, description="Generate the next micro-step's rollouts while this one trains.")
    staleness: int_in(1, 16) = Field(
        1, description="Max optimizer steps between the policy that generated a sample and the one trained on it; "
        "carried segments older than this are dropped (rollout/stale_dropped). The pipeline runs at most one "
        "micro-step ahead, so fresh samples are never older than 1.",
    )


class HfGenerateConfig(StrictModel):
    """How HF ``generate`` runs (the hf backend and ``serve-rollout --engine hf``); outputs are token-for-token the
    same either way (greedy and seeded sampling). ``null`` (the default) is decided by the device: on CUDA a static
    cache with a compiled decode step (measured at Qwen3-VL-2B's shape, bf16, batch 32: 3.6x plain ``generate``'s
    tokens/s after a compile of about 30 s), elsewhere the dynamic cache, by measurement on CPU
    (benchmarks/bench_rollout_overlap.py, 1 thread: static 0.95-1.22x, static+compile 0.88-1.5x after a 25-30 s
    compile). Beam search keeps the dynamic cache unless asked (docs/design.md, Rollout backend interface)."""

    static_cache: Optional[bool] = Field(
        None, description="Preallocated KV cache (cache_implementation: static); null: on for CUDA, off elsewhere.")
    compile: Optional[bool] = Field(
        None, description="torch.compile the decode step (needs static_cache; each new batch bucket compiles once); "
        "null: on for CUDA, off elsewhere.")
    merge_adapter: bool = Field(
        True, description="An adapter (LoRA/DoRA) run decodes through merged weights, refreshed once per optimizer "
        "step (the adapted layers once more in memory); false decodes through the unmerged adapter layers.")
    label_drafts: Optional[bool] = Field(
        None, description="Speculative decoding with the request's ground-truth serialization as the draft (stage-2 "
        "rollouts, in-training evaluation, coordexp eval / probe; requests without a label decode plainly): one "
        "forward verifies draft_tokens per row; outputs are plain decoding's token for token (greedy and seeded "
        "sampling). null: on wherever the dynamic KV cache decodes (the CPU default; measured on a grid-task "
        "stage-1 model, 2 CPU cores: 3.7x greedy, 1.55x sampling), off with static_cache / compile (the CUDA "
        "default) and beam search, which decode plainly (true: the same, with a log line saying why); see "
        "docs/design.md, Label-drafted decoding.")
    draft_tokens: int_in(1, 64) = Field(
        16, description="label_drafts: draft tokens verified per row and forward (1-64).")

    @model_validator(mode="after")
    def _compile_needs_static_cache(self) -> "HfGenerateConfig":
        if self.compile and self.static_cache is False:
            raise_violations([RuleViolation(
                "compile",
                "hf_generate.compile: true needs hf_generate.static_cache: true (transformers compiles the decode "
                "step only over a static KV cache; with the dynamic cache it would silently not compile)",
                "Set rollout_matching.hf_generate.static_cache: true (or leave it out), or compile: false.",
            )])
        return self

    def resolved(self, *, on_cuda: bool, beam_search: bool) -> tuple[bool, bool]:
        """``(static_cache, compile)`` for a model on CUDA or not: what was set, else the device's default."""
        default = on_cuda and not beam_search
        static = self.static_cache if self.static_cache is not None else (default or bool(self.compile))
        compiled = self.compile if self.compile is not None else (static and default)
        return static, compiled


class CollapseAlarmConfig(StrictModel):
    """A warning (or a stop) when a stage-2 logging window's rollouts look like a repeat collapse (docs/figures.md):
    the upstream project's COCO run went from 1.09 to 3.05 predictions per ground-truth object with precision 0.61
    -> 0.25 and 15.6% truncated, and nothing said so during training. Each bound warns once when first crossed."""

    enabled: bool = Field(True, description="Check every stage-2 logging window's rollouts.")
    pred_per_gt_max: float_in(gt=0.0, le=1000.0) = Field(
        1.5, description="Valid predictions per ground-truth object above this, with the window's match precision "
        "precision_drop below its best earlier window, fires the alarm.")
    precision_drop: Probability = Field(
        0.1, description="How far (a fraction, 0.1 = 10 points) match precision must fall from its best window for "
        "pred_per_gt_max to fire.")
    duplicate_rate_max: Probability = Field(
        0.2, description="Certified duplicates (a repeat of an earlier prediction; docs/figures.md) per valid "
        "prediction above this fires the alarm.")
    cut_off_rate_max: Probability = Field(
        0.15, description="Share of rollouts that ended without EOS (the length limit or the repeat guard stopped "
        "them) above this fires the alarm.")
    parse_valid_min: Probability = Field(
        0.5, description="Share of parsed objects that are valid below this fires the alarm.")
    action: Literal["warn", "stop"] = Field(
        "warn", description="warn: one line per bound crossed; stop: also save a checkpoint and end the run, the "
        "reason in the run summary.")
    min_gt_objects: int_in(0, 1_000_000) = Field(
        20, description="Ground-truth objects a window's rollouts must cover for the window to be judged; a smaller "
        "window is skipped (one object is 14 points of a 7-object window's rates, so noise would fire the alarm). "
        "0: judge every window.")

    @field_validator("min_gt_objects", mode="before")
    @classmethod
    def _min_gt_objects_range(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= 1_000_000:
            raise ValueError("min_gt_objects must be 0..1000000 ground-truth objects per logging window; 20 keeps "
                             "one object under 5 points of a window's rates, 0 judges every window")
        return value


class RepeatUnlikelihoodConfig(StrictModel):
    """The term ``repeats: unlikelihood`` adds: ``-log(1 - p)`` at each certified repeat's first divergent token
    (docs/design.md, decision 18), ``p`` that token's probability, or for a coordinate the mass of a band of bins
    around the repeat's that leaves out the band around the position's own target."""

    weight: Weight = Field(1.0, description="Weight of the mean unlikelihood term in the total loss.")
    band: int_in(0, 100) = Field(
        2, description="Half-width in bins of the coordinate band pushed down (0: the repeat's bin alone).")


# a reward term's size: rewards of found objects are at most 1 each, so 10 is far past any useful penalty
Penalty = float_in(ge=0.0, le=10.0)


class RewardConfig(StrictModel):
    """``objective: reward``: the policy-gradient objective whose rewards come from the matching (docs/design.md,
    decision 19). Each image is rolled out ``group_size`` times at temperature 1 (no top-k, no top-p), every
    rollout scored from its one-to-one match to the ground truth, and each token weighted by its advantage over
    the group's leave-one-out mean."""

    group_size: int_in(2, 64) = Field(
        4, description="Rollouts sampled per image (at least 2: the leave-one-out baseline needs a peer; at most 64).")
    include_greedy: bool = Field(
        False, description="Also roll each image out greedily and train that rollout as one more group member "
        "(rollout_backend: hf, or vllm in colocate mode).")
    credit: Literal["sequence", "object"] = Field(
        "object", description="sequence = one reward for the whole rollout on every token (the peers' form); "
        "object = each object's tokens get that object's advantage and the closing tokens the stop advantage.")
    iou_threshold: float_in(ge=0.05, le=1.0) = Field(
        0.5, description="Box IoU a matched pair needs to count as found (tau), in [0.05, 1].")
    class_aware: bool = Field(
        True, description="A matched pair counts as found only with the ground truth's desc as well.")
    duplicate_penalty: Penalty = Field(
        0.3, description="Subtracted per certified repeat (object credit: the repeat's advantage), in [0, 10]; "
        "Pinto et al.'s duplicate weight.")
    spurious_penalty: Penalty = Field(0.0, description="Subtracted per unmatched object that is no repeat, in "
                                      "[0, 10]; 0 because labels are incomplete (an unlabelled object is no error).")
    stop_penalty: Penalty = Field(
        0.1, description="Object credit: taken off the closing tokens' advantage per ground-truth object still "
        "missing when the list closed, in [0, 10].")
    close_bonus: Penalty = Field(0.1, description="Object credit: the closing tokens' advantage when the list "
                                 "closed with nothing missing, in [0, 10].")
    cutoff_penalty: Penalty = Field(
        0.1, description="Object credit: a rollout cut off before it closed (length limit, repeat guard) carries "
        "-stop_penalty per missing object minus this on its last token, so never closing never beats closing early; "
        "in [0, 10].")
    baseline_closing: bool = Field(
        False, description="Object credit: the closing tokens' advantage minus the leave-one-out mean of the "
        "group's other closings (a rollout that closed with fewer objects missing than its peers gains, one that "
        "closed earlier loses; no push toward closing or running on when every rollout closed alike); false = "
        "the unbaselined stop penalty.")
    scale_by_std: bool = Field(
        False, description="Divide baselined advantages by their group's standard deviation (GRPO's scaling).")
    sft_weight: float_in(ge=0.0, le=100.0) = Field(
        0.0, description="Weight of the rollout-matching SFT target of the same rollouts added to the policy "
        "gradient (0 = policy gradient alone), in [0, 100].")
    kl_weight: float_in(ge=0.0, le=100.0) = Field(
        0.0, description="Weight of the KL penalty to the starting checkpoint (k3 estimator on the rollout tokens, "
        "the reference's log-probabilities without gradients; 0 = off, no reference model loaded), in [0, 100]; "
        "a frozen whole copy of the model is kept for it on every rank (its memory again); not with ZeRO-3.")


class RolloutMatchingConfig(StrictModel):
    """``rollout_matching``: every stage-2 rollout, matching and loss-pipeline key (docs/design.md)."""

    rollout_backend: Literal["vllm", "hf"] = Field("vllm", description="vllm (default) or hf generate().")
    decode_batch_size: BatchSize = Field(1, description="Max sequences per rollout GPU in one decode call.")
    max_new_tokens: TokenLength = Field(512, description="Generation cap per rollout.")
    decoding: DecodingConfig = Field(default_factory=DecodingConfig)
    repeat_terminate: RepeatTerminateConfig = Field(default_factory=RepeatTerminateConfig)
    vllm: VllmConfig = Field(default_factory=VllmConfig)
    offload: OffloadConfig = Field(default_factory=OffloadConfig)
    overlap: OverlapConfig = Field(default_factory=OverlapConfig)
    hf_generate: HfGenerateConfig = Field(default_factory=HfGenerateConfig)
    pipeline: Optional[PipelineConfig] = Field(None, description="Loss modules; required (no implicit default).")
    matching: MatchingConfig = Field(default_factory=MatchingConfig)
    ot: OtConfig = Field(default_factory=OtConfig)
    collapse_alarm: CollapseAlarmConfig = Field(default_factory=CollapseAlarmConfig)
    fn_placement: Literal["append", "reading_order", "cut_at_skip"] = Field(
        "append", description="Where Y_train teaches a missed object: append = the spec (after the rollout's list); "
        "reading_order = spliced before the first matched entry that comes after it in reading order (the prefix "
        "token-identical up to the first splice, canonically serialized after it); cut_at_skip = the prefix ends "
        "before the first entry written past a skipped object and the ground truth completes it (docs/design.md, "
        "decision 18). Not with data.object_order: random (no reading order).")
    repeats: Literal["neutral", "drop", "unlikelihood"] = Field(
        "neutral", description="Certified repeats of the rollout (an unmatched entry with the same desc and IoU >= "
        "0.9 as an earlier kept one, or IoU >= 0.5 with an object an earlier entry took): neutral = the spec "
        "(context, no loss); drop = left out of Y_train; unlikelihood = left out, and pushed down at the first "
        "token where writing it again would leave the target (docs/design.md, decision 18).")
    repeat_unlikelihood: RepeatUnlikelihoodConfig = Field(default_factory=RepeatUnlikelihoodConfig)
    gt_step_share: Probability = Field(
        0.0, description="Share of stage-2 optimizer steps that train the ground-truth serialization (channel A: "
        "stage-1 targets, no rollout) instead of rollouts, spread evenly over the run; 0 = rollouts only, the spec's "
        "stage 2 (docs/design.md, decision 15).")
    trailing_unmatched: Literal["keep", "drop"] = Field(
        "keep", description="The rollout's objects after its last matched one (FPs, invalid entries): keep = the "
        "spec (the prefix ends after the last complete object; FN append or EOS follows them); drop = the prefix ends "
        "after the last matched object ('{' when none matched), so Y_train never teaches going on past objects that "
        "matched nothing (docs/design.md, decision 15).")
    objective: Literal["sft", "reward"] = Field(
        "sft", description="What stage 2 trains on its rollouts: sft = rollout-matching SFT (the teacher-forced "
        "target: rollout prefix + missed objects + EOS); reward = a policy gradient with rewards from the matching "
        "(rollout_matching.reward; docs/design.md, decision 19).")
    reward: RewardConfig = Field(default_factory=RewardConfig)

    @model_validator(mode="after")
    def _backend_rules(self) -> "RolloutMatchingConfig":
        violations = []
        if self.rollout_backend == "vllm" and self.decoding.num_beams > 1:
            violations.append(
                RuleViolation(
                    "decoding.num_beams",
                    f"num_beams: {self.decoding.num_beams} (beam search) is not supported by rollout_backend: vllm",
                    "Use rollout_backend: hf for beam search, or decoding.num_beams: 1.",
                )
            )
        decoding = self.decoding
        if self.rollout_backend == "hf" and decoding.num_beams > 1 and decoding.temperature > 0:
            violations.append(
                RuleViolation(
                    "decoding.num_beams",
                    f"num_beams: {decoding.num_beams} (beam search) with temperature: {decoding.temperature} "
                    "(sampling) is not supported by rollout_backend: hf (beam search here is deterministic)",
                    "Set decoding.temperature: 0 for beam search, or decoding.num_beams: 1 to sample.",
                )
            )
        if self.overlap.enabled and not (self.rollout_backend == "vllm" and self.vllm.mode == "server"):
            where = "vllm colocate (the engine shares the learner's devices)" if self.rollout_backend == "vllm" else (
                "hf (generate() runs the learner's own model on its device)")
            violations.append(
                RuleViolation(
                    "overlap.enabled",
                    f"overlap.enabled: true needs rollouts generated on other devices, but the backend is {where}",
                    "Use rollout_backend: vllm with vllm.mode: server, or set overlap.enabled: false.",
                )
            )
        max_len = self.vllm.max_model_len
        if self.rollout_backend == "vllm" and max_len is not None and self.max_new_tokens >= max_len:
            violations.append(
                RuleViolation(
                    "max_new_tokens",
                    f"max_new_tokens ({self.max_new_tokens}) must be < vllm.max_model_len ({max_len}); the prompt "
                    "needs room too",
                    "Lower rollout_matching.max_new_tokens or raise rollout_matching.vllm.max_model_len.",
                )
            )
        violations.extend(self._reward_rules())
        raise_violations(violations)
        return self

    def _reward_rules(self) -> list[RuleViolation]:
        """``objective: reward`` samples from the policy itself: the policy gradient is unbiased only for tokens
        drawn from the distribution it differentiates (temperature 1, nothing truncated, one beam)."""
        if self.objective != "reward":
            return []
        d = self.decoding
        violations = []
        if (d.temperature, d.top_p, d.top_k, d.num_beams, d.repetition_penalty) != (1.0, 1.0, -1, 1, 1.0):
            violations.append(RuleViolation(
                "decoding",
                f"objective: reward samples the policy's own distribution, but decoding is temperature "
                f"{d.temperature}, top_p {d.top_p}, top_k {d.top_k}, num_beams {d.num_beams}, repetition_penalty "
                f"{d.repetition_penalty}",
                "Set rollout_matching.decoding to temperature: 1.0, top_p: 1.0, top_k: -1, num_beams: 1, "
                "repetition_penalty: 1.0 (the greedy rollout comes from reward.include_greedy)."))
        if self.reward.include_greedy and self.rollout_backend == "vllm" and self.vllm.mode == "server":
            violations.append(RuleViolation(
                "reward.include_greedy",
                "include_greedy: true needs a backend that decodes one request greedily among sampled ones; a "
                "vLLM server request carries one decoding setting for the whole call",
                "Use rollout_backend: hf or vllm.mode: colocate, or set reward.include_greedy: false."))
        if self.overlap.enabled:
            violations.append(RuleViolation(
                "overlap.enabled",
                "objective: reward trains each rollout's own tokens against the policy that drew them; overlap "
                "trains rollouts one step old",
                "Set overlap.enabled: false."))
        return violations
