"""The rollout server's FastAPI app: the ms-swift v3.10 endpoints over a :class:`RolloutEngine`.

Every engine and weight-sync operation runs on ONE worker thread, first in first out: the event loop only parses,
queues and answers, so ``GET /health/`` answers while an ``/infer/`` runs, and a weight update acknowledged before
an ``/infer/`` is applied before it (docs/design.md#ms310). Weight-sync endpoints acknowledge first and execute in the
queue (swift clients broadcast right after the reply); anything that can be checked before the broadcast
(metadata, a missing communicator, no LoRA support) is a 4xx instead, so the client never blocks on a receive that
will not happen. A failure after the acknowledgement is reported to the sender by the transport and listed by
``GET /coordexp/sync_status/``; it is never only logged.
"""

from __future__ import annotations

import asyncio
import logging
import random
import tempfile
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Callable, Sequence

from fastapi import FastAPI, HTTPException
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from fastapi.responses import JSONResponse

from coordexp.runtime.rollout.base import RolloutOutput, RolloutRequest
from coordexp.runtime.rollout import protocol as p
from coordexp.runtime.rollout.repeat_guard_check import repeat_guard_reply
from coordexp.runtime.server.engine import EngineError, GenerationParams, RolloutEngine, TokenLogprob
from coordexp.runtime.server.inputs import InferInputError, encode_served, request_to_prompt, scrub_paths
from coordexp.runtime.rollout import swift_sync
from coordexp.runtime.rollout.weight_sync import DEFAULT_TIMEOUT_S, WeightSyncError, WeightSyncReceiver
from coordexp.runtime.server.limits import (DEFAULT_MAX_BODY_BYTES, BodyGuard, max_token_chars, request_limits,
                                            validation_error_detail)
from coordexp.runtime.server.rendezvous import RendezvousBusy, RendezvousPolicy, RendezvousRunner, SyncTokenGuard
from coordexp.runtime.server.worker import FifoWorker, WorkerStopped
from coordexp.schema.rollout import DecodingConfig
from coordexp.schema.template import TemplateConfig

__all__ = ["create_app", "RolloutService", "END_OF_TURN_TOKEN"]

log = logging.getLogger("coordexp.serve")
END_OF_TURN_TOKEN = "<|im_end|>"
_SEED_MASK = 0x7FFFFFFF
MAX_TOP_LOGPROBS = 20  # vLLM's default max_logprobs: what a swift server answers at most
_RECENT_OPS = 16
RECEIVERS = 1  # this server process is the only weight-sync receiver (the engine fans weights out itself)
DEFAULT_MAX_MODEL_LEN = 4096  # an engine that states no max_model_len (the vLLM engine's own default)
SHUTDOWN_WAIT_S = 2.0  # how long shutdown waits for a running engine call before abandoning it


class RolloutService:
    """The server state: engine, encoder inputs, the FIFO worker, the weight-sync receiver and its status."""

    def __init__(self, engine: RolloutEngine, processor: Any, template: TemplateConfig, *,
                 image_root: str | Path | None, defaults: GenerationParams, model_name: str = "coordexp",
                 sync_timeout_s: float = DEFAULT_TIMEOUT_S, bind_host: str | None = None,
                 policy: RendezvousPolicy | None = None, max_model_len: int | None = None,
                 swift_planes: swift_sync.PlaneFactory | None = None):
        self.engine, self.processor, self.template = engine, processor, template
        self.image_root = Path(image_root).resolve() if image_root is not None else None
        if self.image_root is not None and not self.image_root.is_dir():
            raise ValueError(f"--image-root {image_root} is not a directory")
        self.defaults, self.model_name = defaults, model_name
        self.policy = policy or RendezvousPolicy.resolve(http_host=bind_host or "127.0.0.1",
                                                         max_timeout_s=sync_timeout_s)
        self.sync_timeout_s = self.policy.max_timeout_s
        # ms-swift's own wire (an /init_communicator/ without coordexp's fields): NCCL through vLLM's PyNccl
        self.swift_planes = swift_planes or swift_sync.NcclPlaneFactory(self.sync_timeout_s)
        self.worker = FifoWorker()
        self.rendezvous = RendezvousRunner()  # the rendezvous waits here, never on the engine worker
        self._rendezvous: Future | None = None
        self.max_model_len = int(max_model_len or getattr(engine, "max_model_len", 0) or DEFAULT_MAX_MODEL_LEN)
        self.chars_per_token = max_token_chars(processor.tokenizer)
        self.stopping = asyncio.Event()  # set on SIGINT/SIGTERM: waiting requests are answered 503
        self.loop: asyncio.AbstractEventLoop | None = None
        self.receiver: WeightSyncReceiver | swift_sync.SwiftWireReceiver | None = None
        self.communicator = "closed"
        self._lock = threading.Lock()
        self._seq = 0
        self.pending = self.completed = self.failed = self.weights_version = 0
        self.last_error: str | None = None
        self.recent: deque[p.SyncOpRecord] = deque(maxlen=_RECENT_OPS)
        self._requests = 0
        self._unseeded = random.Random(0)  # like vLLM's engine seed 0: unseeded calls still reproduce per process
        tokenizer = processor.tokenizer
        self._stop_strings = {END_OF_TURN_TOKEN, tokenizer.eos_token or END_OF_TURN_TOKEN}

    # ------------------------------------------------------------------------------------------ queue

    def run(self, fn: Callable[[], Any]) -> "Future[Any]":
        return self.worker.submit(fn)

    def queue_sync_op(self, op: str, fn: Callable[[], None],
                      submit: Callable[[Callable[[], None]], Future] | None = None) -> Future:
        """Acknowledge-then-execute: ``fn`` runs in FIFO order (or through ``submit``, e.g. the rendezvous
        runner); its outcome lands in the sync status."""
        with self._lock:
            self.pending += 1
            seq, self._seq = self._seq, self._seq + 1

        def task() -> None:
            started = time.perf_counter()
            error: str | None = None
            try:
                fn()
            except WeightSyncError as exc:
                error = str(exc)
                self.communicator = "broken" if self.receiver is not None else self.communicator
            except Exception as exc:  # noqa: BLE001 - every failure is reported, with its type
                error = f"{type(exc).__name__}: {exc}"
            with self._lock:
                self.pending -= 1
                self.completed += error is None
                self.failed += error is not None
                if error is not None:
                    self.last_error = f"{op} #{seq}: {error}"
                    log.error("weight-sync %s #%d failed: %s", op, seq, error)
                self.recent.append(p.SyncOpRecord(seq=seq, op=op, ok=error is None, error=error,
                                                  seconds=round(time.perf_counter() - started, 4)))

        try:
            return (submit or self.worker.submit)(task)
        except BaseException:
            with self._lock:
                self.pending -= 1
            raise

    def status(self) -> p.SyncStatusResponse:
        receiver = self.receiver
        with self._lock:
            return p.SyncStatusResponse(
                communicator=self.communicator, world_size=receiver.world_size if receiver else None,
                client_rank=(receiver.world_size - 1) if receiver and receiver.world_size else None,
                backend=receiver.backend if receiver else None, pending=self.pending, completed=self.completed,
                failed=self.failed, weights_version=self.weights_version, last_error=self.last_error,
                recent=list(self.recent))

    # ------------------------------------------------------------------------------------------ weight sync

    def init_communicator(self, body: p.InitCommunicatorRequest) -> p.InitCommunicatorResponse:
        world_size = RECEIVERS + 1
        if body.world_size != world_size:
            raise HTTPException(400, f"world_size {body.world_size} does not match this server's weight-sync group: "
                                     f"{RECEIVERS} receiver + the learner = {world_size} (learner rank "
                                     f"{world_size - 1}); send world_size: {world_size}")
        self._refuse_while_waiting()  # whatever the wire: one rendezvous at a time
        if swift_sync.wants_swift_wire(body.model_fields_set):
            return self._init_swift(body, world_size)
        device = self.engine.device
        backend = body.backend or ("nccl" if getattr(device, "type", "cpu") == "cuda" else "gloo")
        if backend == "nccl" and getattr(device, "type", "cpu") != "cuda":
            raise HTTPException(400, "backend 'nccl' needs a CUDA engine; this engine runs on CPU: use 'gloo'")
        # The rendezvous policy decides where it listens (never every interface by accident) and for how long
        # (the client's timeout clamped to the server's cap); the wait runs beside the engine worker, not on it.
        timeout_s = self.policy.timeout_s(body.timeout_s)
        receiver = WeightSyncReceiver(timeout_s=timeout_s, backend=backend,
                                      device=device if backend == "nccl" else "cpu")
        local = self.policy.local_address(body.host)
        self._open_group(receiver, body.port, timeout_s, lambda listener: receiver.init(
            self.policy.bind_host, body.port, world_size, local_address=local, listener=listener))
        return p.InitCommunicatorResponse(world_size=world_size, client_rank=world_size - 1, backend=backend,
                                          timeout_s=timeout_s)

    def _init_swift(self, body: p.InitCommunicatorRequest, world_size: int) -> p.InitCommunicatorResponse:
        """ms-swift's wire (swift's ``VLLMClient``): a StatelessProcessGroup-compatible store at the requested
        port on the policy's interface, NCCL from the learner. Refused at once where it cannot work."""
        device = self.engine.device
        reason = self.swift_planes.unavailable_reason(device) or swift_sync.device_clash(body.client_device_uuid,
                                                                                          device)
        if reason:
            raise HTTPException(400, f"/init_communicator/ without coordexp's 'backend'/'timeout_s' fields asks for "
                                     f"ms-swift's own weight-sync wire, which cannot work here: {reason}. Use "
                                     "coordexp's learner (rollout_matching.vllm.mode: server negotiates gloo on CPU), "
                                     "or serve on a GPU the learner does not use")
        timeout_s = self.policy.timeout_s(None)
        receiver = swift_sync.SwiftWireReceiver(self.swift_planes, device, timeout_s)
        self._open_group(receiver, body.port, timeout_s,
                         lambda listener: receiver.init(listener, body.port, world_size))
        return p.InitCommunicatorResponse(world_size=world_size, client_rank=world_size - 1,
                                          backend=receiver.backend, timeout_s=timeout_s)

    def _refuse_while_waiting(self) -> None:
        if self.rendezvous.waiting:
            raise HTTPException(409, "/init_communicator/: a weight-sync rendezvous is already waiting for its "
                                     "learner; join it, or retry after it ends")

    def _open_group(self, receiver: Any, port: int, timeout_s: float, join: Callable[[Any], None]) -> None:
        """Both wires: one rendezvous at a time, listening per the policy, replacing any previous group, the
        wait (``join(listener)``) on the rendezvous runner; 409 when busy or the port cannot be had."""
        self._refuse_while_waiting()
        try:
            listener = self.policy.listen(port)
        except WeightSyncError as exc:
            raise HTTPException(409, f"/init_communicator/: {exc}") from None
        previous, self.receiver, self.communicator = self.receiver, receiver, "initializing"
        if previous is not None:  # a reconnecting learner replaces the old group (MS310 would hang instead)
            self.queue_sync_op("close_communicator", previous.close)

        def connect() -> None:
            try:
                join(listener)
            except Exception:
                if self.receiver is receiver:
                    self.communicator = "broken"
                raise
            if self.receiver is receiver:
                self.communicator = "ready"
            else:  # closed or replaced while it waited
                receiver.close()

        try:
            self._rendezvous = self.queue_sync_op("init_communicator", connect,
                                                  lambda task: self.rendezvous.start(task, timeout_s))
        except RendezvousBusy as exc:
            listener.close()
            self.receiver, self.communicator = previous, "closed" if previous is None else self.communicator
            raise HTTPException(409, f"/init_communicator/: {exc}") from None

    def _require_communicator(self) -> WeightSyncReceiver | swift_sync.SwiftWireReceiver:
        if self.receiver is None or self.communicator in ("closed", "broken"):
            state = self.communicator
            raise HTTPException(409, f"no usable weight-sync communicator (state: {state}); POST /init_communicator/ "
                                     "and join the group first" + (f" (last error: {self.last_error})"
                                                                   if self.last_error else ""))
        return self.receiver

    def queue_receive(self, op: str, metadatas: Sequence[p.FlattenedTensorMetadata],
                      apply: Callable[[list], None], *, each: bool = False) -> None:
        """Acknowledge one announced transfer and queue its receive (``each``: one broadcast per tensor, ms-swift's
        ``/update_adapter_param/``, which only swift's wire has)."""
        receiver = self._require_communicator()
        take = getattr(receiver, "receive_each", None) if each else receiver.receive
        if take is None:
            raise HTTPException(400, f"/{op}/ is ms-swift's per-tensor adapter push; coordexp's wire sends the "
                                     "adapter as one bucket: POST /update_adapter_flattened_param/")
        rendezvous = self._rendezvous

        def receive() -> None:
            if rendezvous is not None:  # the learner announces right after joining: this wait is short
                self.rendezvous.wait(rendezvous, op)
            error = take(metadatas, apply)
            if error is not None:
                raise EngineError(error)
            with self._lock:
                self.weights_version += 1

        self.queue_sync_op(op, receive)

    def close_communicator(self) -> None:
        receiver, self.receiver, self.communicator = self.receiver, None, "closed"
        if receiver is not None:
            self.queue_sync_op("close_communicator", receiver.close)

    # ------------------------------------------------------------------------------------------ inference

    def refused_fields(self, body: p.InferRequestBody) -> list[str]:
        """``field: reason`` for every request field this server would not honour (never silently ignored)."""
        config = body.request_config
        refused = [f"{name}: not an ms-swift 3.12 /infer/ field" for name in p.unknown_infer_fields(body)]
        checks = (
            ("request_config.stream", config.stream, "streaming is not served; send stream: false"),
            ("request_config.structured_outputs_regex", config.structured_outputs_regex is not None,
             "guided decoding is not served (the learner parses and checks rollouts itself)"),
            ("request_config.logprobs", config.logprobs and not callable(getattr(self.engine, "token_logprobs", None)),
             f"the {self.engine.engine_type} engine does not return logprobs"),
            ("request_config.top_logprobs", config.top_logprobs is not None and not config.logprobs,
             "needs logprobs: true"),
            ("request_config.top_logprobs", config.top_logprobs is not None
             and not 0 <= config.top_logprobs <= MAX_TOP_LOGPROBS, f"must be 0..{MAX_TOP_LOGPROBS}"),
            ("request_config.presence_penalty", config.presence_penalty != 0, "not supported; leave it 0"),
            ("request_config.frequency_penalty", config.frequency_penalty != 0, "not supported; leave it 0"),
            ("request_config.length_penalty", config.length_penalty != 1.0,
             "not supported (beam search ranks with the model's own length_penalty); leave it 1.0"),
            ("request_config.best_of", config.best_of not in (None, 1, config.n), "not supported; leave it unset"),
            ("metrics", body.metrics is not None, "metrics are computed by the client; send null"),
            ("template", body.template is not None, "the server renders with the model's own chat template; send null"),
            ("adapter_request", body.adapter_request is not None,
             "per-request adapters are not served; push weights with the weight-sync endpoints"),
        )
        refused += [f"{name}: {reason}" for name, bad, reason in checks if bad]
        extra_stops = sorted(set(config.stop) - self._stop_strings)
        if extra_stops:
            refused.append(f"request_config.stop {extra_stops}: the server stops at {END_OF_TURN_TOKEN} only (other "
                           "stop strings would cut JSON rollouts); drop them")
        return refused

    def generation_params(self, config: p.RequestConfig) -> GenerationParams:
        base = self.defaults.decoding
        decoding = {
            "temperature": base.temperature if config.temperature is None else config.temperature,
            "top_p": base.top_p if config.top_p is None else config.top_p,
            "top_k": base.top_k if config.top_k is None else (-1 if config.top_k <= 0 else config.top_k),
            "num_beams": config.num_beams if config.num_beams > 1 else base.num_beams,
            "repetition_penalty": base.repetition_penalty if config.repetition_penalty is None
            else config.repetition_penalty,
        }
        try:
            resolved = DecodingConfig.model_validate(decoding)
        except ValidationError as exc:
            raise InferInputError(validation_error_detail(exc.errors(), prefix="request_config")) from None
        max_new = self.defaults.max_new_tokens if config.max_tokens is None else config.max_tokens
        if not 1 <= max_new < self.max_model_len:
            raise InferInputError(f"request_config.max_tokens: {max_new} must be in 1..{self.max_model_len - 1} "
                                  f"(this engine's max_model_len {self.max_model_len} holds prompt and completion)")
        return GenerationParams(max_new_tokens=int(max_new), decoding=resolved,
                                logprobs=(config.top_logprobs or 0) if config.logprobs else None)

    def seeds(self, count: int, n: int, seed: int | None) -> list[int]:
        """Request j, choice k: ``seed + j*n + k`` (MS310's per-request ``seed + j`` when n = 1), in 1..2**31-1;
        an unset seed (None or 0, as in MS310) draws from the server's own seeded RNG."""
        if seed:
            return [((seed + i) & _SEED_MASK) or 1 for i in range(count * n)]
        return [self._unseeded.randint(1, _SEED_MASK) for _ in range(count * n)]

    def infer(self, body: p.InferRequestBody) -> list[dict[str, Any]]:
        """Runs on the worker: refuse what cannot be honoured, encode with the trainer's encoder (any chat the
        template accepts), generate, add logprobs if asked, shape MS310 replies."""
        refused = self.refused_fields(body)
        if refused:
            raise InferInputError("these request fields cannot be honoured: " + "; ".join(refused))
        config = body.request_config
        params = self.generation_params(config)
        n = config.n
        seeds = self.seeds(len(body.infer_requests), n, config.seed)
        requests: list[RolloutRequest] = []
        with tempfile.TemporaryDirectory(prefix="coordexp-infer-") as scratch:
            for j, item in enumerate(body.infer_requests):
                served = request_to_prompt(item, j, self.template, self.image_root, Path(scratch))
                prompt = encode_served(self.processor, served)
                if prompt.prompt_len + params.max_new_tokens > self.max_model_len:
                    raise InferInputError(f"infer_requests[{j}]: the prompt is {prompt.prompt_len} tokens; with "
                                          f"max_tokens {params.max_new_tokens} it exceeds this engine's max_model_len "
                                          f"{self.max_model_len}; shorten the prompt or lower max_tokens")
                requests.extend(RolloutRequest(prompt=prompt, index=j * n + k, seed=seeds[j * n + k],
                                               record=served.record) for k in range(n))
            outputs = self.engine.generate(requests, params) if requests else []
        if len(outputs) != len(requests):
            raise EngineError(f"the engine returned {len(outputs)} outputs for {len(requests)} requests")
        logprobs: list[Any] = [None] * len(outputs)
        if config.logprobs and outputs:
            top = config.top_logprobs or 0
            logprobs = [self._choice_logprobs(tokens, config.top_logprobs is not None)
                        for tokens in self.engine.token_logprobs(requests, outputs, params, top)]  # type: ignore[attr-defined]
        return [self._reply(outputs[j * n:(j + 1) * n], logprobs[j * n:(j + 1) * n], config.return_details)
                for j in range(len(body.infer_requests))]

    def _token_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self.processor.tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    def _choice_logprobs(self, tokens: Sequence[TokenLogprob], with_top: bool) -> p.ChoiceLogprobs:
        """swift's per-choice shape: ``{"content": [{token, logprob, bytes[, top_logprobs]}]}``."""
        content = []
        for entry in tokens:
            item = self._token_entry(entry.token_id, entry.logprob)
            if with_top:
                item["top_logprobs"] = [self._token_entry(i, v) for i, v in entry.top]
            content.append(p.LogprobToken.model_validate(item))
        return p.ChoiceLogprobs(content=content)

    def _reply(self, outputs: Sequence[RolloutOutput], logprobs: Sequence[p.ChoiceLogprobs | None],
               details: bool) -> dict[str, Any]:
        with self._lock:
            self._requests += 1
            request_id = str(self._requests)
        prompt_ids = list(outputs[0].prompt_token_ids)
        choices = [p.ChatCompletionChoice(
            index=k, message=p.ResponseMessage(content=out.text),
            finish_reason="length" if out.finish_reason == "length" else "stop", logprobs=logprobs[k],
            token_ids=list(out.response_token_ids) if details else None) for k, out in enumerate(outputs)]
        completion = sum(len(out.response_token_ids) for out in outputs)
        reasons = [out.finish_reason for out in outputs]
        triggered = int("repeat" in reasons)
        response = p.ChatCompletionResponse(
            model=self.model_name, id=request_id, created=int(time.time()), choices=choices,
            usage=p.UsageInfo(prompt_tokens=len(prompt_ids), completion_tokens=completion,
                              total_tokens=len(prompt_ids) + completion),
            prompt_token_ids=prompt_ids if details else None)
        item = p.RolloutResponseItem(response=response, rollout_infos={"repeat_terminate_triggered": triggered},
                                     coordexp=p.CoordexpInferInfo(repeat_terminate_triggered=triggered,
                                                                  finish_reasons=reasons))
        return item.model_dump(mode="json", exclude_none=False)

    def begin_shutdown(self) -> None:
        """SIGINT/SIGTERM arrived (any thread): every request still waiting for the worker is answered 503."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.stopping.set)

    def shutdown(self) -> None:
        """Stop taking work, drop queued operations, leave the group, free the engine; never waits more than
        :data:`SHUTDOWN_WAIT_S` for a running engine call (it is abandoned with the process)."""
        idle = self.worker.stop(SHUTDOWN_WAIT_S)
        if self.receiver is not None and idle:
            self.receiver.close()
        if idle:
            self.engine.close()


def create_app(engine: RolloutEngine, processor: Any, template: TemplateConfig, *, image_root: str | Path | None,
               defaults: GenerationParams | None = None, model_name: str = "coordexp",
               sync_timeout_s: float = DEFAULT_TIMEOUT_S, bind_host: str | None = None,
               policy: RendezvousPolicy | None = None, max_model_len: int | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               swift_planes: swift_sync.PlaneFactory | None = None) -> FastAPI:
    """The app for ``engine``. ``defaults``: sampling where a request leaves it unset (the config's decoding and
    max_new_tokens; greedy, 256 tokens if None). ``image_root``: the only directory local image paths may name
    (None: no local files, base64 only). ``policy``: the weight-sync rendezvous rules (default: loopback, no
    token, ``sync_timeout_s`` cap). ``max_model_len``: bounds prompt + ``max_tokens`` (default: the engine's).
    ``swift_planes``: the data plane of ms-swift's own weight-sync wire (default: NCCL through vLLM's PyNccl)."""
    service = RolloutService(engine, processor, template, image_root=image_root,
                             defaults=defaults or GenerationParams(256, DecodingConfig()), model_name=model_name,
                             sync_timeout_s=sync_timeout_s, bind_host=bind_host, policy=policy,
                             max_model_len=max_model_len, swift_planes=swift_planes)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        service.loop = asyncio.get_running_loop()
        yield
        service.stopping.set()
        await asyncio.get_running_loop().run_in_executor(None, service.shutdown)

    app = FastAPI(title="coordexp rollout server", lifespan=lifespan)
    app.state.service = service
    app.state.begin_shutdown = service.begin_shutdown  # serve() calls it on SIGINT/SIGTERM

    def refused(path: str, status: int, detail: str) -> None:
        log.warning("refused %s with %d: %s", path, status, detail[:300])

    app.add_middleware(BodyGuard, max_body_bytes=max_body_bytes, on_refusal=refused)
    app.add_middleware(SyncTokenGuard, policy=service.policy, on_refusal=refused)  # outermost: before any read

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Any, exc: RequestValidationError) -> JSONResponse:
        detail = validation_error_detail(exc.errors())  # names the fields, never echoes a value (NaN breaks JSON)
        refused(request.url.path, 422, detail)
        return JSONResponse({"detail": detail}, status_code=422)

    async def on_worker(fn: Callable[[], Any]) -> Any:
        """The worker's result, or 503 as soon as the server starts shutting down (the call is abandoned)."""
        if service.stopping.is_set():
            raise HTTPException(503, "the rollout server is shutting down; send the request to another server")
        try:
            work = asyncio.wrap_future(service.run(fn))
        except WorkerStopped:
            raise HTTPException(503, "the rollout server is shutting down; send the request to another server"
                                ) from None
        stop = asyncio.ensure_future(service.stopping.wait())
        await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            stop.cancel()
            return work.result()
        work.cancel()
        raise HTTPException(503, "the rollout server is shutting down; this request was not completed: send it to "
                                 "another server")

    @app.get("/health/")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/get_world_size/")
    async def get_world_size() -> dict:
        return {"world_size": int(engine.world_size)}

    @app.post("/get_engine_type/")
    async def get_engine_type() -> dict:
        return p.EngineTypeResponse(engine_type=engine.engine_type, enable_lora=bool(engine.supports_adapter)
                                    ).model_dump()

    @app.get("/coordexp/repeat_guard/")
    async def repeat_guard() -> dict:
        """Whether this server's repeat guard is on (the learner fails fast when its config needs it and it is off)."""
        return repeat_guard_reply(engine.repeat_terminate)

    @app.post("/infer/")
    async def infer(body: p.InferRequestBody) -> JSONResponse:
        limits = request_limits(body, max_model_len=service.max_model_len, chars_per_token=service.chars_per_token)
        if limits:  # checked before queueing: an unbounded request never reaches the worker
            refused("/infer/", 400, "; ".join(limits))
            raise HTTPException(400, "/infer/: " + "; ".join(limits))
        try:
            return JSONResponse(await on_worker(lambda: service.infer(body)))
        except HTTPException:
            raise
        except (InferInputError, EngineError) as exc:
            log.info("/infer/ refused: %s", exc)
            raise HTTPException(400, f"/infer/: {scrub_paths(str(exc))}") from None
        except Exception:  # noqa: BLE001 - the log keeps the traceback; the body names no path or exception text
            incident = uuid.uuid4().hex[:12]
            log.exception("/infer/ failed (incident %s)", incident)
            raise HTTPException(500, f"/infer/ failed inside the server (incident {incident}); the server log has "
                                     "the details") from None

    @app.post("/init_communicator/")
    async def init_communicator(body: p.InitCommunicatorRequest) -> dict:
        return service.init_communicator(body).model_dump()

    def load_full(named: list) -> None:
        """Full merged weights replace the policy: an adapter pushed before (a learner that fell back from
        adapter sync) must not stay applied on top of them."""
        clear = getattr(engine, "clear_adapter", None)
        if callable(clear):
            clear()
        engine.load_weights(named)

    @app.post("/update_named_param/")
    async def update_named_param(body: p.UpdateWeightsRequest) -> dict:
        try:
            numel = 1
            for size in body.shape:
                numel *= int(size)
            entry = p.FlattenedTensorMetadata(name=body.name, shape=tuple(body.shape), dtype=body.dtype,
                                              start_idx=0, end_idx=numel, numel=numel)
        except ValidationError as exc:
            raise HTTPException(400, "/update_named_param/: " + validation_error_detail(exc.errors())) from None
        service.queue_receive("update_named_param", [entry], load_full)
        return {"message": p.MESSAGE_UPDATE_NAMED}

    @app.post("/update_flattened_params/")
    async def update_flattened_params(body: p.UpdateFlattenedParamsRequest) -> dict:
        service.queue_receive("update_flattened_params", body.metadatas, load_full)
        return {"message": p.MESSAGE_UPDATE_FLATTENED}

    def require_adapter_support() -> None:
        if not engine.supports_adapter:
            raise HTTPException(400, f"this {engine.engine_type} engine has no LoRA support (enable_lora: false); "
                                     "sync full merged weights instead (/update_flattened_params/)")

    @app.post("/update_adapter_flattened_param/")
    async def update_adapter(body: p.UpdateFlattenedAdapterRequest) -> dict:
        require_adapter_support()
        service.queue_receive("update_adapter_flattened_param", body.metadatas,
                              lambda named: engine.load_adapter(body.lora_int_id, body.peft_config, named))
        return {"message": p.MESSAGE_UPDATE_ADAPTER}

    @app.post("/update_adapter_param/")
    async def update_adapter_param(body: swift_sync.UpdateAdapterParamRequest) -> dict:
        require_adapter_support()
        service.queue_receive("update_adapter_param", body.lora_tensors_metadata,
                              lambda named: engine.load_adapter(body.lora_int_id, body.peft_config, named), each=True)
        return {"message": swift_sync.MESSAGE_UPDATE_ADAPTER_PARAM}

    @app.post("/reset_prefix_cache/")
    async def reset_prefix_cache() -> dict:
        return {"message": p.reset_prefix_cache_message(await on_worker(engine.reset_caches))}

    @app.post("/close_communicator/")
    async def close_communicator() -> dict:
        service.close_communicator()
        return {"message": p.MESSAGE_CLOSE}

    @app.get("/coordexp/sync_status/")
    async def sync_status() -> dict:
        return service.status().model_dump(mode="json")

    return app
