"""The ``vllm_server`` rollout backend: rollouts from pre-launched servers speaking the ms-swift v3.10 protocol
(``coordexp serve-rollout`` or ``swift rollout``), learner weights pushed in memory after each optimizer step.

- Start-up: every server must answer ``/health/`` within ``timeout_s``; ``/get_world_size/`` is read once per
  server and cached; the feasibility rule ``decode_batch_size * S >= W`` is checked and the per-rank chunk
  ``floor(decode_batch_size * S / W)`` fixed (:mod:`coordexp.runtime.core.distribution`).
- ``generate``: rounds of at most one chunk, each split contiguously over the request slots this learner rank owns
  on each server (:func:`~coordexp.runtime.core.distribution.rank_allotment`: the ranks' slots are disjoint, so no
  server ever holds more than ``decode_batch_size x`` its world size at once), POSTed concurrently, reassembled in
  request order. ``N = 0`` sends nothing. A call's
  ``request_config.seed`` is the seed of its first request (the server gives request ``j`` ``seed + j``); the
  trainer's seeds are a pure function of (training seed, global step, micro-step, request index), never 0.
  The client retries a lost connection or HTTP 502/503/504 with backoff (a seeded ``/infer/`` is idempotent); any
  other failure raises :class:`RolloutServerError` naming the server and the rollout step.
  :meth:`VllmServerBackend.generate_with_metadata` returns each call's metadata WITH its outputs (a background
  rollout can never mix up another call's).
- ``sync_weights``: pushes only when the parameters changed since the last push (optimizer steps bump tensor
  versions, so gradient-accumulation micro-steps push nothing). Under ``torch.distributed`` every rank runs
  ``barrier -> rank0 push -> broadcast(outcome) -> barrier`` and, if rank 0 failed, every rank raises the SAME error.
  Rank 0 pushes to all servers at once (:mod:`~coordexp.runtime.rollout.server_push`: one export of the policy,
  each failed server named by URL). Adapter sync that fails falls back to full with one warning and stays full
  (``sync.fallback_to_full``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Sequence
from urllib.parse import urlsplit

from coordexp.errors import ExternalSystemError
from coordexp.runtime.rollout.base import RolloutBackend, RolloutOutput, RolloutRequest
from coordexp.runtime.core.distribution import consecutive_seed_runs, plan_rounds, rank_allotment
from coordexp.runtime.model.encoding import build_messages
from coordexp.runtime.rollout.client import RolloutServerClient, ServerError, is_not_found
from coordexp.runtime.rollout.protocol import ProtocolError, item_to_rollout_output, parse_infer_response
from coordexp.runtime.rollout.repeat_guard_check import check_repeat_guards
from coordexp.runtime.rollout.server_push import MAX_PARALLEL_PUSHES, SharedExport, push_in_parallel
from coordexp.runtime.rollout.weight_export import adapter_state, named_tensors, policy_version
from coordexp.runtime.rollout.weight_sync import DEFAULT_BUCKET_MB, WeightSyncError
from coordexp.schema.contract import VllmServerContract
from coordexp.schema.rollout import DecodingConfig, RepeatTerminateConfig
from coordexp.schema.template import TemplateConfig

if TYPE_CHECKING:
    from coordexp.schema.contract import RunContract

__all__ = ["VllmServerBackend", "ServerWeightChannel", "RolloutServerError", "WeightSyncError", "learner_topology",
           "clients_for"]

logger = logging.getLogger("coordexp.rollout.server")
ADAPTER_LORA_ID = 1  # the server holds one adapter; every adapter push replaces it under this id


_RANK0_HINT = ("rank 0's log has the full error; fix its cause (a dead server: restart it with coordexp serve-rollout "
               "CFG --port N) and resume from the last checkpoint")


class RolloutServerError(ExternalSystemError, RuntimeError):
    """A rollout server call failed (after the client's retries) or its reply is unusable; the message names the
    server and the step."""


def learner_topology() -> tuple[int, int]:
    """(rank, world size) of the learner: ``torch.distributed`` when initialised, else torchrun's environment."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:  # pragma: no cover - torch is a dependency of the runtime
        pass
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def request_config_for(decoding: DecodingConfig, max_new_tokens: int, seed: int) -> dict[str, Any]:
    """The ms-swift ``RequestConfig`` of one call: the config's decoding, ids returned, one choice."""
    return {
        "max_tokens": int(max_new_tokens),
        "temperature": float(decoding.temperature),
        "top_p": float(decoding.top_p),
        "top_k": int(decoding.top_k),
        "repetition_penalty": float(decoding.repetition_penalty),
        "n": 1,
        "seed": int(seed),
        "stream": False,
        "return_details": True,
    }


def infer_request_for(request: RolloutRequest, template: TemplateConfig) -> dict[str, Any]:
    """A ``RolloutInferRequest``: the record's chat messages with empty image items, images as path strings."""
    if request.record is None:
        raise ValueError(f"request {request.index} has no record; the vllm_server backend sends the record's "
                         "messages and image paths, so RolloutRequest.record is required")
    return {
        "messages": build_messages(request.record, template),
        "images": [str(p) for p in request.record.image_paths],
        "data_dict": {"coordexp_index": int(request.index), "coordexp_seed": int(request.seed)},
    }


class VllmServerBackend(RolloutBackend):
    """Rollouts through one or more rollout servers (see the module docstring for the exact behaviour)."""

    def __init__(
        self,
        clients: Sequence[RolloutServerClient],
        *,
        decode_batch_size: int,
        max_new_tokens: int,
        decoding: DecodingConfig,
        template: TemplateConfig | None = None,
        sync_mode: str = "full",
        fallback_to_full: bool = True,
        timeout_s: float | None = None,
        weight_pusher: "Callable[[RolloutServerClient, Any, str], None] | None" = None,
        topology: Callable[[], tuple[int, int]] = learner_topology,
        repeat_terminate: "RepeatTerminateConfig | None" = None,
    ):
        if not clients:
            raise ValueError("the vllm_server backend needs at least one server in rollout_matching.vllm.server.servers")
        if decoding.num_beams > 1:
            raise ValueError(f"rollout_matching.decoding.num_beams: {decoding.num_beams} (beam search) is not supported "
                             "by rollout servers (vLLM ignores it); use num_beams: 1, or rollout_backend: hf")
        if sync_mode not in ("full", "adapter"):
            raise ValueError(f"sync_mode must be the resolved 'full' or 'adapter', got {sync_mode!r}")
        self.clients = list(clients)
        self.decode_batch_size = int(decode_batch_size)
        self.max_new_tokens = int(max_new_tokens)
        self.decoding = decoding
        self.template = template if template is not None else TemplateConfig()
        self.sync_mode = sync_mode
        self.fallback_to_full = bool(fallback_to_full)
        self.timeout_s = float(timeout_s) if timeout_s is not None else max(c.timeout_s for c in self.clients)
        self._topology = topology
        self._pusher = weight_pusher
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.clients)), thread_name_prefix="rollout-server")
        self.rollout_step = 0
        self.global_step: int | None = None
        self.fallback_events: list[str] = []
        self._pushed_version: tuple | None = None
        self.max_parallel_pushes = MAX_PARALLEL_PUSHES  # servers pushed at once (1: one after another)
        self._closed = False
        self.last_calls: list[dict[str, Any]] = []
        self._state_lock = threading.Lock()  # rollout_step and last_calls: a background rollout updates them
        self._fallback_lock = threading.Lock()
        rank, world = self._topology()
        self._check_health()
        self.world_sizes = [c.world_size() for c in self.clients]
        self.rank, self.learner_world_size = rank, world
        self.allotment = rank_allotment(self.decode_batch_size, self.world_sizes, world, rank)
        self.chunk = sum(self.allotment)  # per_rank_chunk: this rank's slots over all servers
        self.repeat_guard = check_repeat_guards(self.clients, repeat_terminate)
        logger.info("rollout servers %s, world sizes %s, learner rank %d of %d, per-rank chunk %d (per server %s), "
                    "sync mode %s", self.server_list(), self.world_sizes, rank, world, self.chunk, self.allotment,
                    self.sync_mode)

    @classmethod
    def from_run(cls, run: "RunContract", model: Any, processor: Any) -> "VllmServerBackend":
        """Connect to the contract's servers (fails within ``timeout_s`` naming the URL); the run's template
        builds the request messages. The policy is not needed until :meth:`sync_weights`."""
        rollout = run.rollout_matching
        choice = rollout.backend
        if not isinstance(choice, VllmServerContract):
            raise TypeError(f"VllmServerBackend needs a vllm_server backend contract, got {choice.kind}")
        _, world = learner_topology()
        rollout.require_full_sync_for(world)
        return cls(clients_for(choice), decode_batch_size=rollout.decode_batch_size, max_new_tokens=rollout.max_new_tokens,
                   decoding=rollout.decoding, template=run.template, sync_mode=choice.sync.mode,
                   fallback_to_full=choice.sync.fallback_to_full, timeout_s=choice.timeout_s,
                   repeat_terminate=rollout.repeat_terminate)

    def begin_step(self, global_step: int) -> None:
        """The trainer's optimizer step, named in error messages so a failure points at the step to resume from
        (seeds already arrive with the requests)."""
        self.global_step = int(global_step)

    def _at_step(self) -> str:
        return f" (training global step {self.global_step})" if self.global_step is not None else ""

    def server_list(self) -> list[str]:
        return [f"{c.base_url} (group_port {c.group_port})" for c in self.clients]

    def _check_health(self) -> None:
        futures = [self._pool.submit(c.wait_until_healthy) for c in self.clients]  # each within its timeout_s
        errors = []
        for future in futures:
            try:
                future.result()
            except ServerError as exc:
                errors.append(str(exc))
        if errors:
            self._pool.shutdown(wait=False)
            raise RolloutServerError("; ".join(errors))  # each error names its URL and how to start the server

    # -- generation -------------------------------------------------------------------------------------------
    def generate(self, requests: Sequence[RolloutRequest]) -> list[RolloutOutput]:
        return self.generate_with_metadata(requests)[0]

    def generate_with_metadata(self, requests: Sequence[RolloutRequest]
                               ) -> tuple[list[RolloutOutput], dict[str, Any]]:
        """The outputs, in request order, and THIS call's metadata (:meth:`run_metadata`'s shape, its ``calls``
        and ``rollout_step`` this call's own), safe to use while another thread rolls out."""
        if self._closed:
            raise RuntimeError("the vllm_server backend is closed")
        with self._state_lock:
            self.rollout_step += 1
            step = self.rollout_step
        if not requests:
            return [], self._metadata(step, [])
        seeds = [int(r.seed) for r in requests]
        bodies = [infer_request_for(r, self.template) for r in requests]
        calls: list[tuple[int, int, int]] = []  # (server, start, stop)
        outputs: list[RolloutOutput | None] = [None] * len(requests)
        for round_slices in plan_rounds(len(requests), self.chunk, self.allotment):
            calls_in_round = [(s.server, a, b) for s in round_slices for a, b in consecutive_seed_runs(seeds, s.start, s.stop)]
            futures = [self._pool.submit(self._infer_slice, server, bodies[a:b], seeds[a], step)
                       for server, a, b in calls_in_round]
            for (server, a, b), future in zip(calls_in_round, futures):
                outputs[a:b] = future.result()
            calls += calls_in_round
        made = [{"server": self.clients[s].base_url, "start": a, "stop": b, "seed": seeds[a]} for s, a, b in calls]
        with self._state_lock:
            self.last_calls = made
        logger.info("rollout step %d: %d request(s) over %s; calls (server, start, stop, seed): %s; sync mode %s%s",
                    step, len(requests), self.server_list(),
                    [(self.clients[s].base_url, a, b, seeds[a]) for s, a, b in calls], self.sync_mode,
                    f"; fallbacks: {self.fallback_events}" if self.fallback_events else "")
        return [o for o in outputs if o is not None], self._metadata(step, made)

    def run_metadata(self) -> dict[str, Any]:
        """Servers (URL, group port, world size, this rank's slots), effective sync mode, fallback events, the
        repeat-guard check and the last rollout's calls (server, request range, ``RequestConfig.seed``); a caller
        that rolls out on another thread should take :meth:`generate_with_metadata`'s instead."""
        with self._state_lock:
            return self._metadata(self.rollout_step, self.last_calls)

    def _metadata(self, step: int, calls: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "servers": [{"base_url": c.base_url, "group_port": c.group_port, "world_size": w, "rank_slots": a}
                        for c, w, a in zip(self.clients, self.world_sizes, self.allotment)],
            "learner_rank": self.rank, "learner_world_size": self.learner_world_size, "per_rank_chunk": self.chunk,
            "sync_mode": self.sync_mode, "fallback_events": list(self.fallback_events),
            "repeat_guard": self.repeat_guard, "rollout_step": step, "calls": list(calls),
        }

    def _infer_slice(self, server: int, bodies: list[dict], seed: int, step: int) -> list[RolloutOutput]:
        client = self.clients[server]
        config = request_config_for(self.decoding, self.max_new_tokens, seed)
        try:  # the client already retried what can be retried (a lost connection, 502/503/504)
            items = parse_infer_response(client.infer(bodies, config), expected=len(bodies))
            return [item_to_rollout_output(item) for item in items]
        except (ServerError, ProtocolError) as exc:
            raise RolloutServerError(
                f"rollout step {step}: server {client.base_url} failed on /infer/ for {len(bodies)} request(s) "
                f"(seed {seed}){self._at_step()}: {exc}. Check that server's log; if it died, restart it "
                "(coordexp serve-rollout / swift rollout) and resume from the last checkpoint") from exc

    # -- weight sync ------------------------------------------------------------------------------------------
    def sync_weights(self, model: Any) -> None:
        rank, world = self._topology()
        if world <= 1:
            self._push_if_changed(model)
            return
        import torch.distributed as dist

        dist.barrier()
        outcome: list[Any] = [None]
        if rank == 0:
            try:
                self._push_if_changed(model)
            except Exception as exc:  # noqa: BLE001 - every rank must learn about ANY rank-0 failure
                outcome[0] = f"{type(exc).__name__}: {exc}"
        dist.broadcast_object_list(outcome, src=0)
        dist.barrier()
        if outcome[0] is not None:
            raise WeightSyncError(f"weight sync on learner rank 0 failed{self._at_step()} (raised on every rank): "
                                  f"{outcome[0]}", hint=_RANK0_HINT)

    def _push_if_changed(self, model: Any) -> None:
        version = policy_version(model)
        if version == self._pushed_version:
            return
        if self._pusher is None:
            self._pusher = ServerWeightChannel(timeout_s=self.timeout_s)
        push_in_parallel(self.clients, lambda wave: self._wave_tasks(wave, model), max_workers=self.max_parallel_pushes)
        self._pushed_version = version

    def _wave_tasks(self, wave: Sequence[RolloutServerClient], model: Any) -> list[Callable[[], None]]:
        """One push per server of ``wave``; a channel with ``export``/``push`` exports the policy once for all."""
        pusher = self._pusher
        if not (hasattr(pusher, "export") and hasattr(pusher, "push")):
            return [lambda c=client: self._push(c, model) for client in wave]
        mode = self.sync_mode
        if mode == "adapter":
            try:
                state = pusher.export(model, "adapter")
            except Exception as exc:  # noqa: BLE001 - no adapter to send: every server takes the fallback
                return [lambda c=client, e=exc: self._push(c, model, adapter_error=e) for client in wave]
            return [lambda c=client: self._push(c, model, adapter=state) for client in wave]
        window = int(2 * (getattr(pusher, "bucket_mb", None) or DEFAULT_BUCKET_MB) * 1024 * 1024)
        shared = SharedExport(pusher.export(model, "full"), len(wave), window_bytes=window)

        def push_full(k: int, client: RolloutServerClient) -> None:
            try:
                pusher.push(client, shared.reader(k), "full")
            finally:
                shared.release(k)

        return [lambda k=k, c=client: push_full(k, c) for k, client in enumerate(wave)]

    def _push(self, client: RolloutServerClient, model: Any, *, adapter: Any = None,
              adapter_error: Exception | None = None) -> None:
        """One server's push in the current mode; an adapter failure falls back to full (fresh export) or raises."""
        pusher = self._pusher
        exported = hasattr(pusher, "export") and hasattr(pusher, "push")
        if self.sync_mode == "adapter" or adapter is not None or adapter_error is not None:
            try:
                if adapter_error is not None:
                    raise adapter_error
                if exported:
                    pusher.push(client, adapter, "adapter")
                else:
                    pusher(client, model, "adapter")
                return
            except Exception as exc:  # noqa: BLE001 - any adapter failure is the fallback's trigger
                if not self.fallback_to_full:
                    raise WeightSyncError(
                        f"adapter weight sync to {client.base_url} failed ({type(exc).__name__}: {exc}) and "
                        "rollout_matching.vllm.sync.fallback_to_full is false; set sync.mode: full, or "
                        "fallback_to_full: true, or start the server with LoRA enabled") from exc
                event = (f"rollout step {self.rollout_step}: adapter sync to {client.base_url} failed "
                         f"({type(exc).__name__}: {exc}); falling back to full merged-weight sync for the rest of "
                         "the run")
                with self._fallback_lock:
                    self.fallback_events.append(event)
                    self.sync_mode = "full"
                logger.warning(event)
        pusher(client, model, "full")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        closer = getattr(self._pusher, "close", None)
        if callable(closer):
            closer()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for client in self.clients:
            closer = getattr(client, "close", None)  # pooled connections; a stand-in client may have none
            if callable(closer):
                closer()


def clients_for(choice: VllmServerContract) -> list[RolloutServerClient]:
    """One client per configured server with the contract's timeouts and weight-sync token."""
    return [RolloutServerClient(s.base_url, group_port=s.group_port, timeout_s=choice.timeout_s,
                                infer_timeout_s=choice.infer_timeout_s, sync_token=choice.sync_token)
            for s in choice.servers]


class ServerWeightChannel:
    """Learner rank 0's weight-sync state: one sender per server, opened lazily and re-opened after a transport
    failure. The wire is chosen per server by asking it (``GET /coordexp/sync_status/``):

    - coordexp's server answers: coordexp's transport (:class:`~coordexp.runtime.rollout.weight_sync.WeightSyncSender`,
      gloo on CPU or NCCL, a status after every bucket), negotiated with the ``backend``/``timeout_s`` fields;
    - a server without that endpoint (a real ``swift rollout``) gets ms-swift's own wire
      (:class:`~coordexp.runtime.rollout.swift_sync.SwiftWireSender`): ``/close_communicator/`` first as swift's
      trainer does, then swift's ``/init_communicator/`` body, the store handshake and NCCL from this learner's GPU
      (refused at once on a learner without CUDA). Adapters need the server's ``enable_lora``.

    Called as ``channel(client, model, mode)``: ``full`` sends :func:`~coordexp.runtime.rollout.weight_export.named_tensors`
    (LoRA merged into new tensors; the training model is only read) in single-dtype buckets; ``adapter`` sends the
    PEFT adapter (raises if the model has none or the server refuses it). Both end with ``/reset_prefix_cache/``.
    """

    def __init__(self, *, timeout_s: float = 240.0, backend: str | None = None, bucket_mb: float | None = None,
                 swift_planes: Any = None):
        self.timeout_s = float(timeout_s)
        self.backend = backend
        self.bucket_mb = bucket_mb
        self.swift_planes = swift_planes  # the data plane of swift's wire (None: NCCL through vLLM's PyNccl)
        self._senders: dict[str, Any] = {}
        self._wires: dict[str, str] = {}
        self.reports: list[Any] = []

    def wire(self, client: RolloutServerClient) -> str:
        """``"coordexp"`` when the server answers coordexp's sync-status endpoint, ``"swift"`` when it has none
        (404: ``swift rollout``); cached per server."""
        if client.base_url not in self._wires:
            try:
                client.request("GET", "coordexp/sync_status", timeout=client.timeout_s)
                self._wires[client.base_url] = "coordexp"
            except ServerError as exc:
                if not is_not_found(exc):
                    raise
                self._wires[client.base_url] = "swift"
        return self._wires[client.base_url]

    def _sender(self, client: RolloutServerClient) -> Any:
        sender = self._senders.get(client.base_url)
        if sender is not None and sender.is_open:
            return sender
        if sender is not None:
            sender.close()
        if client.group_port is None:
            raise WeightSyncError(f"server {client.base_url} has no group_port",
                                  hint="set rollout_matching.vllm.server.servers[].group_port")
        world_size = client.world_size() + 1  # the server's receivers, then this learner as the last rank
        host = urlsplit(client.base_url).hostname or "127.0.0.1"
        port = int(client.group_port)
        if self.wire(client) == "swift":
            sender = self._swift_sender(client, world_size)
        else:
            from coordexp.runtime.rollout.weight_sync import WeightSyncSender

            sender = WeightSyncSender(timeout_s=self.timeout_s, backend=self.backend)
            sender.use_init_reply(client.request(  # the reply's rendezvous_key: only this learner may join
                "POST", "init_communicator", {"host": host, "port": port, "world_size": world_size,
                                              "client_device_uuid": None, "backend": sender.backend,
                                              "timeout_s": self.timeout_s}, timeout=self.timeout_s))
        sender.init(host, port, world_size)
        self._senders[client.base_url] = sender
        return sender

    def _swift_sender(self, client: RolloutServerClient, world_size: int) -> Any:
        """swift's trainer's sequence up to the join: close any old group, then swift's own init body."""
        from coordexp.runtime.rollout.swift_sync import SwiftWireSender

        sender = SwiftWireSender(self.swift_planes, timeout_s=self.timeout_s)
        reason = sender.unavailable_reason()
        if reason:
            raise WeightSyncError(f"rollout server {client.base_url} speaks ms-swift's own weight-sync wire (it has no "
                                  f"/coordexp/sync_status/), and {reason}",
                                  hint="run the learner on a GPU the server does not use, or serve with coordexp "
                                       "serve-rollout (its gloo transport works on CPU)")
        try:
            client.close_communicator()
        except ServerError as exc:  # swift's trainer only logs this too
            logger.warning("close_communicator before init on %s failed: %s", client.base_url, exc)
        host = urlsplit(client.base_url).hostname or "127.0.0.1"
        client.request("POST", "init_communicator",
                       {"host": "::" if ":" in host else "0.0.0.0", "port": int(client.group_port),
                        "world_size": world_size, "client_device_uuid": _device_uuid(sender.device)},
                       timeout=self.timeout_s)
        return sender

    def export(self, model: Any, mode: str) -> Any:
        """What one push sends, made once for all servers: the :class:`AdapterState` (``adapter``), or the
        one-pass stream of merged named tensors (``full``)."""
        return adapter_state(model) if mode == "adapter" else named_tensors(model)

    def __call__(self, client: RolloutServerClient, model: Any, mode: str) -> None:
        if mode == "adapter":
            self._ready_for(client, mode)  # a server that cannot take an adapter fails before any export
        self.push(client, self.export(model, mode), mode)

    def _ready_for(self, client: RolloutServerClient, mode: str) -> Any:
        """The server's open sender; raises when ``mode`` is adapter and a swift server has LoRA disabled."""
        sender = self._sender(client)
        swift = getattr(sender, "wire", "coordexp") == "swift"
        if mode == "adapter" and swift and not client.engine_type().get("enable_lora", False):
            raise WeightSyncError(f"rollout server {client.base_url} (swift rollout) has LoRA disabled "
                                  "(enable_lora: false); start it with --vllm_enable_lora true, or sync full weights")
        return sender

    def push(self, client: RolloutServerClient, exported: Any, mode: str) -> None:
        """Send ``exported`` (from :meth:`export`) to one server; the transports only read it."""
        sender = self._ready_for(client, mode)
        swift = getattr(sender, "wire", "coordexp") == "swift"
        if mode == "adapter":
            adapter = exported
            lora_id = _fresh_lora_id() if swift else ADAPTER_LORA_ID  # swift's vLLM keeps an id's first load
            report = sender.send_adapter(adapter.tensors, announce=lambda m: client.update_adapter_flattened_param(
                lora_id, adapter.config, [x.model_dump(mode="json") for x in m]))
        else:
            options = {} if self.bucket_mb is None else {"bucket_mb": self.bucket_mb}
            report = sender.send_full(exported, announce=lambda m: client.update_flattened_params(
                [x.model_dump(mode="json") for x in m]), **options)
        self.reports.append(report)
        client.reset_prefix_cache()
        logger.info("weight sync (%s, %s wire) to %s: %d tensor(s), %.1f MB in %.2f s (%.2f GB/s)", mode,
                    "swift" if swift else "coordexp", client.base_url, report.tensors, report.bytes / 1e6,
                    report.seconds, report.gb_per_s)

    def close(self) -> None:
        for sender in self._senders.values():
            sender.close()
        self._senders.clear()


def _device_uuid(device: Any) -> str:
    """What swift's client sends as ``client_device_uuid``: the GPU's uuid, ``"42"`` when unreadable."""
    try:
        import torch

        return str(torch.cuda.get_device_properties(device).uuid)
    except Exception:  # noqa: BLE001 - swift's own fallback value
        return "42"


def _fresh_lora_id() -> int:
    return int(time.time_ns() % 0x7FFFFFFF) or 1
