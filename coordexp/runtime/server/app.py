"""The rollout server's FastAPI app: the ms-swift v3.10 endpoints over a :class:`RolloutEngine`.

Every engine and weight-sync operation runs on ONE worker thread, first in first out: the event loop only parses,
queues and answers, so ``GET /health/`` answers while an ``/infer/`` runs, and a weight update acknowledged before
an ``/infer/`` is applied before it (docs/design.md#ms310). Concurrent ``/infer/`` calls are merged into shared
engine calls under a sequence budget and served round-robin (``batching.py``; ``GET /coordexp/batch_status/``
counts engine calls and merged ones); weights never change inside one. Weight-sync endpoints acknowledge first and execute in the
queue (swift clients broadcast right after the reply); anything that can be checked before the broadcast
(metadata, a missing communicator, no LoRA support) is a 4xx instead, so the client never blocks on a receive that
will not happen. A failure after the acknowledgement is reported to the sender by the transport and listed by
``GET /coordexp/sync_status/``; it is never only logged. ``POST /detect/`` (``detect.py``) answers one image with
the detector's objects in pixels and their scores, through the same queue as ``/infer/``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Callable, Sequence

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from fastapi.responses import JSONResponse

from coordexp.runtime.rollout import protocol as p
from coordexp.runtime.rollout.repeat_guard_check import repeat_guard_reply
from coordexp.runtime.server.batching import BatchPolicy, Scheduler
from coordexp.runtime.server.detect import Detector, add_detect_route
from coordexp.runtime.server.engine import EngineError, GenerationParams, RolloutEngine
from coordexp.runtime.server.infer import END_OF_TURN_TOKEN, MAX_TOP_LOGPROBS, InferPlanner
from coordexp.runtime.server.inputs import InferInputError, scrub_paths
from coordexp.runtime.rollout import swift_sync
from coordexp.runtime.rollout.store_guard import new_rendezvous_key
from coordexp.runtime.rollout.weight_sync import DEFAULT_TIMEOUT_S, WeightSyncError, WeightSyncReceiver
from coordexp.runtime.server.limits import (DEFAULT_MAX_BODY_BYTES, MAX_REQUEST_TOKENS, BodyGuard, max_token_chars,
                                            request_limits, validation_error_detail)
from coordexp.runtime.server.rendezvous import (ListenerGate, RendezvousBusy, RendezvousPolicy, RendezvousRunner,
                                                SyncTokenGuard)
from coordexp.runtime.server.worker import FifoWorker, WorkerStopped
from coordexp.schema.rollout import DecodingConfig
from coordexp.schema.template import TemplateConfig

__all__ = ["create_app", "RolloutService", "END_OF_TURN_TOKEN", "MAX_TOP_LOGPROBS"]

log = logging.getLogger("coordexp.serve")
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
                 swift_planes: swift_sync.PlaneFactory | None = None, system: str | None = None,
                 batch: BatchPolicy | None = None, max_request_tokens: int = MAX_REQUEST_TOKENS):
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
        self.max_request_tokens = int(max_request_tokens)
        self.planner = InferPlanner(engine, processor, template, image_root=self.image_root, defaults=defaults,
                                    max_model_len=self.max_model_len, model_name=model_name, system=system)
        self.scheduler = Scheduler(engine, self.worker, batch or default_batch_policy(engine))
        self.abandoned = False  # shutdown left an engine call running (serve() then exits without finalizers)
        self.stopping = asyncio.Event()  # set on SIGINT/SIGTERM: waiting requests are answered 503
        self.loop: asyncio.AbstractEventLoop | None = None
        self.receiver: WeightSyncReceiver | swift_sync.SwiftWireReceiver | None = None
        self.communicator = "closed"
        self._lock = threading.Lock()
        self._seq = 0
        self.pending = self.completed = self.failed = self.weights_version = 0
        self.last_error: str | None = None
        self.recent: deque[p.SyncOpRecord] = deque(maxlen=_RECENT_OPS)

    # ------------------------------------------------------------------------------------------ queue

    def run(self, fn: Callable[[], Any]) -> "Future[Any]":
        return self.worker.submit(fn)

    def queue_sync_op(self, op: str, fn: Callable[[], None],
                      submit: Callable[[Callable[[], None]], Future] | None = None,
                      breaks: Callable[[], bool] | None = None) -> Future:
        """Acknowledge-then-execute: ``fn`` runs in FIFO order (or through ``submit``, e.g. the rendezvous
        runner); its outcome lands in the sync status. The communicator turns "broken" on a failure that
        ``breaks()`` says breaks it (default: a weight-sync error while a group exists), in the same locked update
        as ``last_error``, so a status never shows "broken" without its reason."""
        with self._lock:
            self.pending += 1
            seq, self._seq = self._seq, self._seq + 1

        def task() -> None:
            started = time.perf_counter()
            error: str | None = None
            broken = False
            try:
                fn()
            except WeightSyncError as exc:
                error = str(exc)
                broken = breaks() if breaks is not None else self.receiver is not None
            except Exception as exc:  # noqa: BLE001 - every failure is reported, with its type
                error = f"{type(exc).__name__}: {exc}"
                broken = breaks() if breaks is not None else False
            with self._lock:
                self.pending -= 1
                self.completed += error is None
                self.failed += error is not None
                if error is not None:
                    self.last_error = f"{op} #{seq}: {error}"
                    if broken:
                        self.communicator = "broken"
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

    def init_communicator(self, body: p.InitCommunicatorRequest, peer: str | None = None
                          ) -> p.InitCommunicatorResponse:
        """Open the group ``body`` asks for; ``peer``: the authorized caller's address (swift's wire admits only it
        while the group forms)."""
        world_size = RECEIVERS + 1
        if body.world_size != world_size:
            raise HTTPException(400, f"world_size {body.world_size} does not match this server's weight-sync group: "
                                     f"{RECEIVERS} receiver + the learner = {world_size} (learner rank "
                                     f"{world_size - 1}); send world_size: {world_size}")
        self._refuse_while_waiting()  # whatever the wire: one rendezvous at a time
        if swift_sync.wants_swift_wire(body.model_fields_set):
            return self._init_swift(body, world_size, peer)
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
        # A fresh secret per authorized init, answered to this caller only: every store key lives under it, so a
        # client that did not pass the HTTP guard cannot read or write what the group reads (store_guard).
        key = new_rendezvous_key()
        self._open_group(receiver, body.port, timeout_s, lambda listener: receiver.init(
            self.policy.bind_host, body.port, world_size, local_address=local, listener=listener,
            rendezvous_key=key))
        return p.InitCommunicatorResponse(world_size=world_size, client_rank=world_size - 1, backend=backend,
                                          timeout_s=timeout_s, rendezvous_key=key)

    def _init_swift(self, body: p.InitCommunicatorRequest, world_size: int, peer: str | None
                    ) -> p.InitCommunicatorResponse:
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
        # swift's client dictates the handshake (no secret can be added): only the caller's address may connect
        # while the group forms (where it is not loopback), and nobody once it has formed
        self._open_group(receiver, body.port, timeout_s,
                         lambda listener: receiver.init(listener, body.port, world_size),
                         admit=self.policy.admitted(peer))
        return p.InitCommunicatorResponse(world_size=world_size, client_rank=world_size - 1,
                                          backend=receiver.backend, timeout_s=timeout_s)

    def _refuse_while_waiting(self) -> None:
        if self.rendezvous.waiting:
            raise HTTPException(409, "/init_communicator/: a weight-sync rendezvous is already waiting for its "
                                     "learner; join it, or retry after it ends")

    def _open_group(self, receiver: Any, port: int, timeout_s: float, join: Callable[[Any], None], *,
                    admit: set[str] | None = None) -> None:
        """Both wires: one rendezvous at a time, listening per the policy (only ``admit`` addresses may connect
        while it forms, where given; nobody after), replacing any previous group, the wait (``join(listener)``) on
        the rendezvous runner; 409 when busy or the port cannot be had."""
        self._refuse_while_waiting()
        try:
            listener = self.policy.listen(port)
        except WeightSyncError as exc:
            raise HTTPException(409, f"/init_communicator/: {exc}") from None
        gate = ListenerGate(listener)
        gate.admit(admit)
        previous, self.receiver, self.communicator = self.receiver, receiver, "initializing"
        if previous is not None:  # a reconnecting learner replaces the old group (MS310 would hang instead)
            self.queue_sync_op("close_communicator", previous.close)

        def connect() -> None:
            try:
                join(listener)
                gate.seal()  # the group has formed: its members stay connected, nobody new gets in
            finally:
                gate.close()
            if self.receiver is receiver:
                self.communicator = "ready"
            else:  # closed or replaced while it waited
                receiver.close()

        try:
            self._rendezvous = self.queue_sync_op("init_communicator", connect,
                                                  lambda task: self.rendezvous.start(task, timeout_s),
                                                  breaks=lambda: self.receiver is receiver)
        except RendezvousBusy as exc:
            listener.close()
            gate.close()
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

    def submit_infer(self, body: p.InferRequestBody) -> Future:
        """Queue one ``/infer/`` as a scheduler job (merged with concurrent calls, batching.py); refusals that need
        no encoding raise :class:`InferInputError` here, before anything is queued."""
        return self.scheduler.submit(self.planner.job(body))

    def infer(self, body: p.InferRequestBody) -> list[dict[str, Any]]:
        """One call, waiting for its answer (tests and tools that do not serve HTTP)."""
        return self.submit_infer(body).result()

    def begin_shutdown(self) -> None:
        """SIGINT/SIGTERM arrived (any thread): every request still waiting for the worker is answered 503."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.stopping.set)

    def shutdown(self) -> None:
        """Stop taking work, drop queued operations, leave the group, free the engine; never waits more than
        :data:`SHUTDOWN_WAIT_S` for a running engine call (it is abandoned with the process)."""
        self.scheduler.stop()  # no new round starts; the one running ends within one engine call
        idle = self.worker.stop(SHUTDOWN_WAIT_S)
        self.abandoned = not idle
        if self.receiver is not None and idle:
            self.receiver.close()
        if idle:
            self.engine.close()


def create_app(engine: RolloutEngine, processor: Any, template: TemplateConfig, *, image_root: str | Path | None,
               defaults: GenerationParams | None = None, model_name: str = "coordexp",
               sync_timeout_s: float = DEFAULT_TIMEOUT_S, bind_host: str | None = None,
               policy: RendezvousPolicy | None = None, max_model_len: int | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               swift_planes: swift_sync.PlaneFactory | None = None, system: str | None = None,
               batch: BatchPolicy | None = None, max_request_tokens: int = MAX_REQUEST_TOKENS) -> FastAPI:
    """The app for ``engine``. ``defaults``: sampling where a request leaves it unset (the config's decoding and
    max_new_tokens; greedy, 256 tokens if None). ``image_root``: the only directory local image paths may name
    (None: no local files, base64 only). ``policy``: the weight-sync rendezvous rules (default: loopback, no
    token, ``sync_timeout_s`` cap). ``max_model_len``: bounds prompt + ``max_tokens`` (default: the engine's).
    ``swift_planes``: the data plane of ms-swift's own weight-sync wire (default: NCCL through vLLM's PyNccl).
    ``system``: the system prompt of requests without one (None: the chat template's default, as swift's server).
    ``batch``: the budget of one merged engine call (default: the engine's batch size); ``max_request_tokens``:
    the most sequences x max_tokens one call may ask for."""
    service = RolloutService(engine, processor, template, image_root=image_root,
                             defaults=defaults or GenerationParams(256, DecodingConfig()), model_name=model_name,
                             sync_timeout_s=sync_timeout_s, bind_host=bind_host, policy=policy,
                             max_model_len=max_model_len, swift_planes=swift_planes, system=system, batch=batch,
                             max_request_tokens=max_request_tokens)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        service.loop = asyncio.get_running_loop()
        yield
        service.stopping.set()
        await asyncio.get_running_loop().run_in_executor(None, service.shutdown)

    app = FastAPI(title="coordexp rollout server", lifespan=lifespan)
    app.state.service = service
    app.state.begin_shutdown = service.begin_shutdown  # serve() calls it on SIGINT/SIGTERM
    app.state.abandoned = lambda: service.abandoned  # serve() exits without finalizers when an engine call is left

    def refused(path: str, status: int, detail: str) -> None:
        log.warning("refused %s with %d: %s", path, status, detail[:300])

    app.add_middleware(BodyGuard, max_body_bytes=max_body_bytes, on_refusal=refused)
    app.add_middleware(SyncTokenGuard, policy=service.policy, on_refusal=refused)  # outermost: before any read

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Any, exc: RequestValidationError) -> JSONResponse:
        detail = validation_error_detail(exc.errors())  # names the fields, never echoes a value (NaN breaks JSON)
        refused(request.url.path, 422, detail)
        return JSONResponse({"detail": detail}, status_code=422)

    async def on_worker(fn: Callable[[], Any] | None = None, queued: Callable[[], Future] | None = None) -> Any:
        """The worker's result (``fn`` run there, or the future ``queued()`` returns), or 503 as soon as the server
        starts shutting down (the call is abandoned)."""
        if service.stopping.is_set():
            raise HTTPException(503, "the rollout server is shutting down; send the request to another server")
        try:
            work = asyncio.wrap_future(queued() if queued is not None else service.run(fn))  # type: ignore[arg-type]
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

    async def run_infer(body: p.InferRequestBody, path: str) -> list[dict[str, Any]]:
        """One ``/infer/`` body answered (``path``: the route, for messages): limits, queue, 4xx mapping."""
        limits = request_limits(body, max_model_len=service.max_model_len, chars_per_token=service.chars_per_token,
                                default_max_tokens=service.planner.defaults.max_new_tokens,
                                max_request_tokens=service.max_request_tokens)
        if limits:  # checked before queueing: an unbounded request never reaches the worker
            refused(path, 400, "; ".join(limits))
            raise HTTPException(400, f"{path}: " + "; ".join(limits))
        try:
            return await on_worker(queued=lambda: service.submit_infer(body))
        except HTTPException:
            raise
        except (InferInputError, EngineError) as exc:
            log.info("%s refused: %s", path, exc)
            raise HTTPException(400, f"{path}: {scrub_paths(str(exc))}") from None
        except Exception:  # noqa: BLE001 - the log keeps the traceback; the body names no path or exception text
            incident = uuid.uuid4().hex[:12]
            log.exception("%s failed (incident %s)", path, incident)
            raise HTTPException(500, f"{path} failed inside the server (incident {incident}); the server log has "
                                     "the details") from None

    @app.post("/infer/")
    async def infer(body: p.InferRequestBody) -> JSONResponse:
        return JSONResponse(await run_infer(body, "/infer/"))

    add_detect_route(app, Detector(processor.tokenizer, template.user_prompt, service.image_root,
                                   logprobs=callable(getattr(engine, "token_logprobs", None))), run_infer)

    @app.post("/init_communicator/")
    async def init_communicator(body: p.InitCommunicatorRequest, request: Request) -> dict:
        return service.init_communicator(body, peer=request.client.host if request.client else None).model_dump()

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

    @app.get("/coordexp/batch_status/")
    async def batch_status() -> dict:
        """Engine calls made and how many of them merged several /infer/ calls (tests and benchmarks read it)."""
        return service.scheduler.stats()

    @app.get("/coordexp/sync_status/")
    async def sync_status() -> dict:
        return service.status().model_dump(mode="json")

    return app


def default_batch_policy(engine: Any) -> BatchPolicy:
    """One merged engine call holds what the engine runs at once: vLLM's ``max_num_seqs`` (its default 256 when
    unset), the HF engine's ``decode_batch_size`` x 4 (it decodes in chunks of that size anyway)."""
    settings = getattr(engine, "settings", None)
    seqs = getattr(settings, "max_num_seqs", None)
    if seqs is None and getattr(engine, "decode_batch_size", None):
        seqs = 4 * int(engine.decode_batch_size)
    return BatchPolicy(max_batch_seqs=int(seqs or 256))
