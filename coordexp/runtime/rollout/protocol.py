"""The rollout-server wire protocol: ms-swift 3.10's ``swift rollout`` JSON (docs/design.md#ms310) as pydantic models.

Clients written for ``swift rollout`` talk to ``coordexp serve-rollout`` unchanged, and the coordexp client
(``vllm_server`` backend) speaks the same JSON. Paths, methods, bodies and the acknowledgement ``message`` strings are
MS310's (see ``ENDPOINTS`` and ``MESSAGE_*``). Weight-sync request models ignore unknown keys; the ``/infer/`` models
(:class:`InferRequestBody`, :class:`RolloutInferRequest`, :class:`RequestConfig`) KEEP them so that the server can
refuse each by name (:func:`unknown_infer_fields`) instead of silently ignoring a setting it would not honour (e.g. a
newer swift's sampling field). Response models allow extras so that a newer server's additions never break an older
client.

coordexp extensions (additive; a swift client never sees a difference):

- every ``/infer/`` item carries ``"coordexp": {"repeat_terminate_triggered": 0|1, "finish_reasons": [...]}``
  (``finish_reasons`` per choice: ``stop``/``length``/``repeat``; swift's own ``finish_reason`` says ``stop`` for a
  repeat-guard stop, as vLLM does) and ``rollout_infos.repeat_terminate_triggered``;
- ``/init_communicator/`` accepts optional ``backend`` (``gloo``/``nccl``) and ``timeout_s``, and its reply adds the
  group's ``world_size`` and ``client_rank``;
- ``GET /coordexp/sync_status/`` reports the FIFO queue of weight-sync operations and the last failure, so a failed
  weight load is REPORTED to the client (the transport also raises on the sender: see
  :mod:`coordexp.runtime.rollout.weight_sync`).

Pure pydantic (no torch): the client imports this without the server's dependencies.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from coordexp.schema.base import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY
from coordexp.runtime.rollout.base import FinishReason, RolloutOutput

__all__ = [
    "ENDPOINTS",
    "MESSAGE_INIT",
    "MESSAGE_UPDATE_NAMED",
    "MESSAGE_UPDATE_FLATTENED",
    "MESSAGE_UPDATE_ADAPTER",
    "MESSAGE_CLOSE",
    "reset_prefix_cache_message",
    "ProtocolError",
    "RolloutInferRequest",
    "RequestConfig",
    "InferRequestBody",
    "unknown_infer_fields",
    "ResponseMessage",
    "LogprobToken",
    "ChoiceLogprobs",
    "ChatCompletionChoice",
    "UsageInfo",
    "ChatCompletionResponse",
    "CoordexpInferInfo",
    "RolloutResponseItem",
    "parse_infer_response",
    "item_to_rollout_output",
    "HealthResponse",
    "WorldSizeResponse",
    "EngineTypeResponse",
    "MessageResponse",
    "InitCommunicatorRequest",
    "InitCommunicatorResponse",
    "UpdateWeightsRequest",
    "FlattenedTensorMetadata",
    "UpdateFlattenedParamsRequest",
    "UpdateFlattenedAdapterRequest",
    "SyncOpRecord",
    "SyncStatusResponse",
    "ErrorResponse",
]

# (method, path) of every endpoint; all paths end with "/" as in MS310.
ENDPOINTS: dict[str, tuple[str, str]] = {
    "health": ("GET", "/health/"),
    "get_world_size": ("GET", "/get_world_size/"),
    "get_engine_type": ("POST", "/get_engine_type/"),
    "infer": ("POST", "/infer/"),
    "init_communicator": ("POST", "/init_communicator/"),
    "update_named_param": ("POST", "/update_named_param/"),
    "update_flattened_params": ("POST", "/update_flattened_params/"),
    "update_adapter_flattened_param": ("POST", "/update_adapter_flattened_param/"),
    "reset_prefix_cache": ("POST", "/reset_prefix_cache/"),
    "close_communicator": ("POST", "/close_communicator/"),
    "sync_status": ("GET", "/coordexp/sync_status/"),  # coordexp extension
}

MESSAGE_INIT = "Request received, initializing communicator"
MESSAGE_UPDATE_NAMED = "Request received, updating named parameter"
MESSAGE_UPDATE_FLATTENED = "Request received, updating flattened parameters"
MESSAGE_UPDATE_ADAPTER = "Request received, updating adapter parameter"
MESSAGE_CLOSE = "Request received, closing communicator"


def reset_prefix_cache_message(success: bool) -> str:
    """MS310's ``/reset_prefix_cache/`` reply text (it embeds the engine's boolean result)."""
    return f"Request received, resetting prefix cache status: {bool(success)}"


class ProtocolError(ValueError):
    """A server reply does not have the ms-swift v3.10 shape (or is an error object); the text says what is off."""


class _Request(BaseModel):
    """Request bodies: unknown keys are ignored (swift clients send extras), values are validated."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class _InferRequest(BaseModel):
    """``/infer/`` request parts: unknown keys are kept (``model_extra``) for the server to refuse by name."""

    model_config = ConfigDict(extra="allow", frozen=True)


class _Response(BaseModel):
    """Response bodies: extras are kept, so additions by a newer server survive a round trip."""

    model_config = ConfigDict(extra="allow")


# --------------------------------------------------------------------------------------------------- /infer/


class RolloutInferRequest(_InferRequest):
    """One request of ``/infer/`` (MS310 ``RolloutInferRequest``).

    ``messages``: ``{"role", "content"}`` dicts; content is a string (``"<image>"`` tags mark where the top-level
    ``images`` go) or a list of ``{"type": "text", "text"}`` / ``{"type": "image", "image": <str>}`` items.
    ``images``: strings, each a server-side path, an http(s) URL or base64 data (``data:image/...;base64,`` or bare).
    Media are given inline OR in ``images``, never both. A trailing assistant message is dropped by the server.
    """

    messages: list[dict[str, Any]]
    images: list[str] = Field(default_factory=list)
    audios: list[str] = Field(default_factory=list)
    videos: list[str] = Field(default_factory=list)
    tools: Optional[list[Any]] = None
    objects: dict[str, Any] = Field(default_factory=dict)
    data_dict: dict[str, Any] = Field(default_factory=dict)
    uuid: Optional[str] = None

    @field_validator("images", "audios", "videos", mode="before")
    @classmethod
    def _wrap_single(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else ([] if value is None else value)

    @field_validator("messages")
    @classmethod
    def _messages_have_roles(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not value:
            raise ValueError("messages is empty; send at least one user message")
        for k, message in enumerate(value):
            if "role" not in message or "content" not in message:
                raise ValueError(f"messages[{k}] needs 'role' and 'content' keys (got {sorted(message)})")
            if not isinstance(message["content"], (str, list)) and message["content"] is not None:
                raise ValueError(f"messages[{k}].content must be a string or a list of content items")
        return value


class RequestConfig(_InferRequest):
    """Sampling settings of one ``/infer/`` call (MS310 ``RequestConfig``). ``None`` means "the server's default"
    (for coordexp: the config's ``rollout_matching.decoding`` / ``max_new_tokens``). ``temperature: 0`` is greedy.
    ``seed`` 0 or ``None`` means unset (MS310 treats 0 as unset; coordexp clients map seeds to 1..2**31-1).
    ``return_details`` must be true to receive ``token_ids`` / ``prompt_token_ids``."""

    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0)
    top_k: Optional[int] = None
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    repetition_penalty: Optional[float] = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    num_beams: int = Field(1, ge=1)
    stop: list[str] = Field(default_factory=list)
    seed: Optional[int] = None
    stream: bool = False
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    n: int = Field(1, ge=1)
    best_of: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    length_penalty: float = 1.0
    return_details: bool = False
    structured_outputs_regex: Optional[str] = None  # swift >= 3.12 (vLLM guided decoding)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else ([] if value is None else value)


class InferRequestBody(_InferRequest):
    """The ``/infer/`` body: ``{"infer_requests": [...], "request_config": {...}}`` plus the keys swift's
    ``VLLMClient.infer`` always sends (``metrics``, ``template``, ``use_tqdm``, ``adapter_request``; null there).
    A missing or null ``request_config`` means all defaults (MS310 answers 500 there; we do not)."""

    infer_requests: list[RolloutInferRequest]
    request_config: RequestConfig = Field(default_factory=RequestConfig)
    metrics: Optional[Any] = None
    template: Optional[Any] = None
    use_tqdm: Optional[bool] = None
    adapter_request: Optional[Any] = None

    @field_validator("request_config", mode="before")
    @classmethod
    def _null_config(cls, value: Any) -> Any:
        return {} if value is None else value


def unknown_infer_fields(body: InferRequestBody) -> list[str]:
    """Dotted names of every key of ``body`` that no ms-swift 3.12 ``/infer/`` model defines, in body order
    (``request_config.foo``, ``infer_requests[2].bar``, ``baz``)."""
    names = [str(k) for k in body.model_extra or {}]
    names += [f"request_config.{k}" for k in body.request_config.model_extra or {}]
    for j, item in enumerate(body.infer_requests):
        names += [f"infer_requests[{j}].{k}" for k in item.model_extra or {}]
    return names


class ResponseMessage(_Response):
    role: str = "assistant"
    content: Optional[str] = None
    tool_calls: Optional[list[Any]] = None
    reasoning_content: Optional[str] = None


class LogprobToken(_Response):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None
    top_logprobs: Optional[list[dict[str, Any]]] = None


class ChoiceLogprobs(_Response):
    content: list[LogprobToken] = Field(default_factory=list)


class ChatCompletionChoice(_Response):
    """One generated sequence. ``token_ids``: generated ids with the trailing stop/EOS stripped (other stop words
    stay), present iff the request had ``return_details``. ``finish_reason``: ``stop`` | ``length`` | None."""

    index: int
    message: ResponseMessage
    finish_reason: Optional[str] = None
    logprobs: Optional[ChoiceLogprobs] = None
    token_ids: Optional[list[int]] = None


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ChatCompletionResponse(_Response):
    """MS310 ``ChatCompletionResponse``. ``prompt_token_ids`` is PER REQUEST (the server-side encoded prompt, image
    placeholders expanded), present iff ``return_details``."""

    model: str
    object: Literal["chat.completion"] = "chat.completion"
    id: str
    created: int
    choices: list[ChatCompletionChoice]
    usage: UsageInfo = Field(default_factory=UsageInfo)
    prompt_token_ids: Optional[list[int]] = None
    images_size: Optional[list[list[int]]] = None


class CoordexpInferInfo(_Response):
    """coordexp extension on each ``/infer/`` item: did the repeat guard fire, and the precise finish reasons."""

    repeat_terminate_triggered: int = 0
    finish_reasons: list[str] = Field(default_factory=list)


class RolloutResponseItem(_Response):
    """One ``/infer/`` reply item (MS310 ``RolloutOutput``): ``response`` plus multi-turn fields (empty here)."""

    response: ChatCompletionResponse
    messages: Optional[list[dict[str, Any]]] = None
    response_token_ids: list[list[int]] = Field(default_factory=list)
    response_loss_mask: list[list[int]] = Field(default_factory=list)
    rollout_infos: dict[str, Any] = Field(default_factory=dict)
    coordexp: Optional[CoordexpInferInfo] = None


def parse_infer_response(payload: Any, *, expected: int | None = None) -> list[RolloutResponseItem]:
    """Validate an ``/infer/`` reply: a JSON list with one item per request, in order. Each item may be the
    wrapped ``{"response": {...}}`` form or a bare ChatCompletionResponse (both exist in the wild); an
    ``{"object": "error"}`` item or a wrong length raises :class:`ProtocolError`."""
    if not isinstance(payload, list):
        kind = type(payload).__name__
        detail = f": {payload.get('detail') or payload.get('message')}" if isinstance(payload, dict) else ""
        raise ProtocolError(f"/infer/ must answer a JSON list (one item per request); got a {kind}{detail}")
    if expected is not None and len(payload) != expected:
        raise ProtocolError(f"/infer/ answered {len(payload)} item(s) for {expected} request(s)")
    items: list[RolloutResponseItem] = []
    for k, raw in enumerate(payload):
        if not isinstance(raw, dict):
            raise ProtocolError(f"/infer/ item {k} is a {type(raw).__name__}, not an object")
        if raw.get("object") == "error":
            raise ProtocolError(f"/infer/ item {k} is an error: {raw.get('message', raw)}")
        wrapped = raw if "response" in raw else {"response": raw}
        try:
            items.append(RolloutResponseItem.model_validate(wrapped))
        except ValueError as exc:
            raise ProtocolError(f"/infer/ item {k} does not have the ms-swift RolloutOutput shape: {exc}") from None
    return items


def item_to_rollout_output(item: RolloutResponseItem, *, choice: int = 0) -> RolloutOutput:
    """The backend-neutral :class:`RolloutOutput` of one reply item (needs ``return_details`` ids); the finish
    reason comes from the coordexp extension when present (``repeat``), else from swift's ``finish_reason``."""
    response = item.response
    if choice >= len(response.choices):
        raise ProtocolError(f"/infer/ item {response.id} has {len(response.choices)} choice(s); wanted {choice}")
    picked = response.choices[choice]
    if picked.token_ids is None or response.prompt_token_ids is None:
        raise ProtocolError("/infer/ reply has no token_ids/prompt_token_ids; send request_config.return_details: "
                            "true (strict token alignment needs the ids)")
    reason: str | None = picked.finish_reason
    if item.coordexp is not None and choice < len(item.coordexp.finish_reasons):
        reason = item.coordexp.finish_reasons[choice]
    if reason not in ("stop", "length", "repeat"):
        reason = "length" if reason is None else "stop"
    finish: FinishReason = reason  # type: ignore[assignment]
    return RolloutOutput(
        prompt_token_ids=tuple(response.prompt_token_ids),
        response_token_ids=tuple(picked.token_ids),
        text=picked.message.content or "",
        finish_reason=finish,
    )


# --------------------------------------------------------------------------------------------------- misc replies


class HealthResponse(_Response):
    status: str = "ok"


class WorldSizeResponse(_Response):
    """``GET /get_world_size/``: the engine's ``tp * dp`` (its request capacity weight for chunking)."""

    world_size: int


class EngineTypeResponse(_Response):
    """``POST /get_engine_type/``; ``enable_lora`` says whether adapter sync can work."""

    engine_type: str
    enable_multi_turn: bool = False
    use_gym_env: bool = False
    enable_lora: bool = False


class MessageResponse(_Response):
    message: str


class ErrorResponse(_Response):
    """A 4xx/5xx body: FastAPI's ``detail`` plus the failing endpoint."""

    detail: Union[str, list[Any], dict[str, Any]]


# --------------------------------------------------------------------------------------------------- weight sync


class InitCommunicatorRequest(_Request):
    """``POST /init_communicator/``. ``host``/``port``: the TCPStore rendezvous (the server's rank 0 hosts it on
    ``port``; clients connect to the server's address). ``world_size``: server receivers + 1 (the client is the
    last rank); the server recomputes it and rejects (400) a value that disagrees instead of hanging.
    coordexp extensions: ``backend`` (default: nccl if the server engine is on CUDA else gloo) and ``timeout_s``
    (rendezvous and per-collective timeout; default 240)."""

    host: str
    port: int = Field(ge=1, le=65535)
    world_size: int = Field(ge=2)
    client_device_uuid: Optional[str] = None
    backend: Optional[Literal["gloo", "nccl"]] = None
    timeout_s: Optional[float] = Field(None, gt=0)


class InitCommunicatorResponse(_Response):
    message: str = MESSAGE_INIT
    world_size: Optional[int] = None
    client_rank: Optional[int] = None
    backend: Optional[str] = None


MAX_TENSOR_DIMS = 64  # torch's own limit; also keeps the shape product cheap (a 20,000-entry shape took 10 s)


class UpdateWeightsRequest(_Request):
    """``POST /update_named_param/``: one tensor (HF checkpoint name) follows as one broadcast from the client."""

    name: str
    dtype: str
    shape: list[int] = Field(max_length=MAX_TENSOR_DIMS)


_DTYPE_NAMES = frozenset({"float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8",
                          "bool", "float8_e4m3fn", "float8_e5m2"})


def _check_dtype(value: str) -> str:
    if value.removeprefix("torch.") not in _DTYPE_NAMES:
        raise ValueError(f"dtype {value!r} is not a tensor dtype name such as 'torch.bfloat16'")
    return value


class FlattenedTensorMetadata(_Request):
    """Where one tensor lives in a flat bucket: ``flat[start_idx:end_idx].view(shape)``, offsets in ELEMENTS
    (MS310 semantics; v4 counts bytes). ``dtype`` like ``"torch.bfloat16"``."""

    name: str
    shape: tuple[int, ...] = Field(max_length=MAX_TENSOR_DIMS)
    dtype: str
    start_idx: int = Field(ge=0)
    end_idx: int = Field(ge=0)
    numel: int = Field(ge=0)

    @field_validator("dtype")
    @classmethod
    def _dtype_name(cls, value: str) -> str:
        return _check_dtype(value)

    @model_validator(mode="after")
    def _consistent(self) -> "FlattenedTensorMetadata":
        if self.end_idx - self.start_idx != self.numel or math.prod(self.shape) != self.numel:
            raise ValueError(f"tensor {self.name!r}: start_idx {self.start_idx}, end_idx {self.end_idx}, numel "
                             f"{self.numel} and shape {list(self.shape)} disagree")
        return self


def _check_bucket(metadatas: Sequence[FlattenedTensorMetadata]) -> None:
    if not metadatas:
        raise ValueError("metadatas is empty; a bucket holds at least one tensor")
    position = 0
    for entry in metadatas:
        if entry.start_idx != position:
            raise ValueError(f"tensor {entry.name!r} starts at {entry.start_idx}, expected {position}: bucket "
                             "entries must be contiguous, in order, from 0")
        position = entry.end_idx
    dtypes = sorted({m.dtype.removeprefix("torch.") for m in metadatas})
    if len(dtypes) > 1:
        raise ValueError(f"a bucket must hold ONE dtype (got {dtypes}); MS310 sizes the receive buffer from the "
                         "last entry's dtype, so mixed buckets corrupt data. Bucket by dtype on the client")


class UpdateFlattenedParamsRequest(_Request):
    """``POST /update_flattened_params/``: one flat, single-dtype bucket follows as one broadcast."""

    metadatas: list[FlattenedTensorMetadata]

    @field_validator("metadatas")
    @classmethod
    def _bucket(cls, value: list[FlattenedTensorMetadata]) -> list[FlattenedTensorMetadata]:
        _check_bucket(value)
        return value


class UpdateFlattenedAdapterRequest(UpdateFlattenedParamsRequest):
    """``POST /update_adapter_flattened_param/``: a LoRA adapter (PEFT state-dict names) as one bucket, plus its
    PEFT ``LoraConfig`` as a dict. Rejected with 400 (before any broadcast) when the engine has no LoRA support."""

    lora_int_id: int
    peft_config: dict[str, Any]


class SyncOpRecord(_Response):
    """One finished weight-sync operation on the server (coordexp extension)."""

    seq: int
    op: str
    ok: bool
    error: Optional[str] = None
    seconds: float = 0.0


class SyncStatusResponse(_Response):
    """``GET /coordexp/sync_status/``. ``communicator``: closed | initializing | ready | broken. ``pending``:
    operations acknowledged but not finished (FIFO, ahead of any later ``/infer/``). ``failed``/``last_error``:
    every failure is reported here (and to the sender through the transport). ``weights_version`` counts applied
    weight loads, so a client can confirm its push landed before sampling."""

    communicator: Literal["closed", "initializing", "ready", "broken"]
    world_size: Optional[int] = None
    client_rank: Optional[int] = None
    backend: Optional[str] = None
    pending: int = 0
    completed: int = 0
    failed: int = 0
    weights_version: int = 0
    last_error: Optional[str] = None
    recent: list[SyncOpRecord] = Field(default_factory=list)
