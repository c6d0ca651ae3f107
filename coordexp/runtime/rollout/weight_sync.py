"""In-memory weight sync from the learner to a rollout server through real ``torch.distributed`` collectives.

The group is DEDICATED (never the learner's default/DDP group): ranks ``0..R-1`` are the server's receivers and the
learner (its rank 0) is the LAST rank, ``world_size = R + 1`` (``coordexp serve-rollout`` has one receiver, R = 1).
Server rank 0 hosts a ``TCPStore`` at ``(host, group_port)``; the sender connects to it. Every store key lives under
the server's per-init secret and every peer record is checked before gloo parses it
(:mod:`~coordexp.runtime.rollout.store_guard`). The collectives run on
``ProcessGroupGloo`` (CPU tensors, so the whole path runs in CI) or ``ProcessGroupNCCL`` (CUDA).

One transfer (a "bucket") is, on every rank, in this order:

1. the sender broadcasts one flat 1-D tensor of ONE dtype (its layout was announced over HTTP first:
   :class:`~coordexp.runtime.rollout.protocol.FlattenedTensorMetadata`, element offsets as in docs/design.md#ms310);
2. each receiver rebuilds the named tensors (views) and applies them (``engine.load_weights`` / ``load_adapter``);
3. every rank joins a status all-reduce (a ``world_size``-long int vector, 1 at a failed rank); a failed receiver
   first writes its error text into the store. The sender raises :class:`RemoteApplyError` with that text.

So a server-side failure reaches the sender as an exception (MS310 leaves the client blocked in NCCL), and every
wait has a timeout: rendezvous, broadcast and status (the status wait covers the server's load time). A peer that
dies or never comes fails the other side with :class:`WeightSyncError` / :class:`WeightSyncTimeout`; after a
transport failure the group is unusable (``broken``) and must be re-initialised.
"""

from __future__ import annotations

import math
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterable, Iterator, Literal, Sequence

import torch
import torch.distributed as dist

from coordexp.runtime.rollout.protocol import FlattenedTensorMetadata
from coordexp.runtime.rollout.store_guard import GlooRendezvousGuard, StoreRecordError, store_prefix
from coordexp.runtime.rollout.sync_errors import RemoteApplyError, WeightSyncError, WeightSyncTimeout

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_BUCKET_MB",
    "WeightSyncError",
    "WeightSyncTimeout",
    "RemoteApplyError",
    "SyncReport",
    "BucketPusher",
    "dtype_name",
    "parse_dtype",
    "plan_buckets",
    "flatten_bucket",
    "unflatten_bucket",
    "bucket_layout",
    "default_backend",
    "listening_socket",
    "WeightSyncSender",
    "WeightSyncReceiver",
]

DEFAULT_TIMEOUT_S = 240.0
DEFAULT_BUCKET_MB = 512
Backend = Literal["gloo", "nccl"]
NamedTensors = Iterable[tuple[str, torch.Tensor]]
Announce = Callable[[list[FlattenedTensorMetadata]], None]
_WILDCARD_HOSTS = ("", "0.0.0.0", "::")
_MAX_ERROR_BYTES = 4000  # a receiver's apply error as stored for the sender


@dataclass(frozen=True)
class SyncReport:
    """What one ``send_full`` / ``send_adapter`` moved, for logs and the throughput benchmark."""

    buckets: int
    tensors: int
    bytes: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / self.seconds if self.seconds > 0 else float("inf")


# --------------------------------------------------------------------------------------------------- buckets


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"torch.bfloat16"`` (the wire spelling)."""
    return str(dtype)


def parse_dtype(name: str) -> torch.dtype:
    """``"torch.bfloat16"`` or ``"bfloat16"`` -> ``torch.bfloat16``."""
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise WeightSyncError(f"unknown tensor dtype {name!r} in weight-sync metadata; use e.g. 'torch.bfloat16'")
    return value


def plan_buckets(named_tensors: NamedTensors, bucket_mb: float = DEFAULT_BUCKET_MB
                 ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors into buckets of ONE dtype and at most ``bucket_mb`` MiB (a larger tensor gets a bucket of its
    own). Order within a dtype is preserved; a bucket is emitted as soon as the next tensor of its dtype would not
    fit, the rest at the end in order of first appearance. Empty tensors are skipped (nothing to load)."""
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be > 0 (got {bucket_mb})")
    limit = int(bucket_mb * 1024 * 1024)
    open_buckets: dict[torch.dtype, tuple[list[tuple[str, torch.Tensor]], int]] = {}
    for name, tensor in named_tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weight {name!r} is a {type(tensor).__name__}, not a tensor")
        if tensor.numel() == 0:
            continue
        size = tensor.numel() * tensor.element_size()
        members, used = open_buckets.get(tensor.dtype, ([], 0))
        if members and used + size > limit:
            yield members
            members, used = [], 0
        members.append((name, tensor))
        open_buckets[tensor.dtype] = (members, used + size)
    for members, _ in open_buckets.values():
        if members:
            yield members


def flatten_bucket(named_tensors: Sequence[tuple[str, torch.Tensor]], *, device: torch.device | str | None = None
                   ) -> tuple[torch.Tensor, list[FlattenedTensorMetadata]]:
    """One contiguous 1-D tensor holding every tensor in order, and its metadata (element offsets)."""
    if not named_tensors:
        raise ValueError("flatten_bucket needs at least one tensor")
    dtypes = {t.dtype for _, t in named_tensors}
    if len(dtypes) != 1:
        raise WeightSyncError(f"a bucket must hold one dtype, got {sorted(map(str, dtypes))}; split it with "
                              "plan_buckets (or cast the tensors to one dtype)")
    target = torch.device(device) if device is not None else named_tensors[0][1].device
    metadatas: list[FlattenedTensorMetadata] = []
    start = 0
    for name, tensor in named_tensors:
        numel = tensor.numel()
        metadatas.append(FlattenedTensorMetadata(name=name, shape=tuple(tensor.shape), dtype=dtype_name(tensor.dtype),
                                                 start_idx=start, end_idx=start + numel, numel=numel))
        start += numel
    with torch.no_grad():
        flat = torch.cat([t.detach().reshape(-1).to(target) for _, t in named_tensors])
    return flat, metadatas


def bucket_layout(metadatas: Sequence[FlattenedTensorMetadata]) -> tuple[int, torch.dtype]:
    """``(numel, dtype)`` of the flat tensor the metadata describe; raises :class:`WeightSyncError` unless the
    entries are contiguous from 0 and share one dtype."""
    if not metadatas:
        raise WeightSyncError("empty bucket metadata; a bucket holds at least one tensor")
    position = 0
    for entry in metadatas:
        if entry.start_idx != position or entry.end_idx - entry.start_idx != entry.numel:
            raise WeightSyncError(f"bucket metadata of {entry.name!r} is not contiguous (start {entry.start_idx}, "
                                  f"end {entry.end_idx}, numel {entry.numel}; expected start {position})")
        if math.prod(entry.shape) != entry.numel:
            raise WeightSyncError(f"bucket metadata of {entry.name!r}: shape {list(entry.shape)} has "
                                  f"{math.prod(entry.shape)} elements, numel says {entry.numel}")
        position = entry.end_idx
    dtypes = {parse_dtype(m.dtype) for m in metadatas}
    if len(dtypes) != 1:
        raise WeightSyncError(f"bucket metadata mixes dtypes {sorted(map(str, dtypes))}; one dtype per bucket")
    return position, dtypes.pop()


def unflatten_bucket(flat: torch.Tensor, metadatas: Sequence[FlattenedTensorMetadata]
                     ) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a received bucket, as views of ``flat`` (copy them if you keep them)."""
    numel, dtype = bucket_layout(metadatas)
    if flat.dim() != 1 or flat.numel() != numel or flat.dtype != dtype:
        raise WeightSyncError(f"flat bucket is {tuple(flat.shape)} {flat.dtype}; the metadata describe ({numel},) "
                              f"{dtype}")
    return [(m.name, flat[m.start_idx:m.end_idx].view(m.shape)) for m in metadatas]


# --------------------------------------------------------------------------------------------------- group


def default_backend() -> Backend:
    """``nccl`` when CUDA is usable, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def _route_address(host: str, port: int) -> str:
    """The local IP address this machine uses to reach ``host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP listener on exactly ``(host, port)`` for a rendezvous store (a wildcard host is an explicit choice of
    every interface); raises :class:`WeightSyncError` naming the address when it cannot listen there."""
    try:
        infos = socket.getaddrinfo(host if host not in _WILDCARD_HOSTS else None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise WeightSyncError(f"weight-sync rendezvous host {host!r} does not resolve ({exc})",
                              hint="use an address of this machine (e.g. 127.0.0.1)") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(64)
    except OSError as exc:
        sock.close()
        raise WeightSyncError(f"cannot listen for the weight-sync rendezvous on {host}:{port}: "
                              f"{exc.strerror or exc}",
                              hint="choose another group_port (a free one, >= 1024) for this server") from None
    return sock


class _GroupMember:
    """Shared state of both ends: the store, the process group, this rank, the transfer counter."""

    role = "member"

    def __init__(self, *, timeout_s: float = DEFAULT_TIMEOUT_S, backend: Backend | None = None,
                 device: torch.device | str | None = None):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 (got {timeout_s}); a weight sync without a timeout can hang")
        self.timeout_s = float(timeout_s)
        self.backend: Backend = backend or default_backend()
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"weight-sync backend must be 'gloo' or 'nccl' (got {self.backend!r})")
        if device is None:
            device = f"cuda:{torch.cuda.current_device()}" if self.backend == "nccl" else "cpu"
        self.device = torch.device(device)
        self._store: dist.Store | None = None
        self._group = None
        self.rank = -1
        self.world_size = 0
        self._seq = 0
        self.broken: str | None = None

    @property
    def is_open(self) -> bool:
        return self._group is not None and self.broken is None

    @property
    def _timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)

    def _connect(self, host: str, port: int, world_size: int, rank: int, *, local_address: str | None,
                 listener: socket.socket | None = None, rendezvous_key: str | None = None) -> None:
        try:
            prefix = store_prefix(rendezvous_key)
        except WeightSyncError:
            if listener is not None:
                listener.close()
            raise
        if self._group is not None:
            if listener is not None:
                listener.close()
            raise WeightSyncError(f"the weight-sync {self.role} is already connected; close() it first")
        if world_size < 2 or not 0 <= rank < world_size:
            if listener is not None:
                listener.close()
            raise ValueError(f"weight-sync world_size {world_size} / rank {rank} invalid: need world_size >= 2 "
                             "(server receivers + the learner) and 0 <= rank < world_size")
        if self.backend == "nccl" and not dist.is_nccl_available():
            if listener is not None:
                listener.close()
            raise WeightSyncError("weight-sync backend 'nccl' is not available in this torch build; use gloo (CPU)")
        started = time.monotonic()
        is_master = rank == 0
        # Failures are raised OUTSIDE the except blocks: an exception chained to the torch error would keep the
        # frames, and with them the store and the transport's listener, alive after an abandoned rendezvous.
        failure: WeightSyncError | None = None
        try:
            if is_master:
                # torch's TCPStore master listens on EVERY interface whatever host it is given: hand it a socket
                # bound to exactly one address instead (the store owns the descriptor from here on).
                listener = listener if listener is not None else listening_socket(host, port)
                store = dist.TCPStore(host, port, world_size, True, timeout=self._timeout,
                                      wait_for_workers=False, master_listen_fd=listener.fileno())
                listener.detach()
            else:
                store = dist.TCPStore(host, port, world_size, False, timeout=self._timeout, wait_for_workers=False)
        except WeightSyncError:
            raise
        except Exception as exc:  # noqa: BLE001 - torch raises several types (RuntimeError, DistStoreError, ...)
            what = f"host the rendezvous store on port {port}" if is_master else f"reach the rendezvous store at " \
                f"{host}:{port}"
            failure = _transport_error(exc, f"weight-sync {self.role} could not {what} within {self.timeout_s:.0f} s",
                                       "check that the port is free on the server and reachable from the learner, "
                                       "and that the peer was asked to join (POST /init_communicator/)")
        if failure is not None:
            if listener is not None and listener.fileno() != -1:
                listener.close()
            raise failure
        store = dist.PrefixStore(prefix, store)  # the per-init key: only the authorized learner knows these keys
        try:
            group = self._new_group(store, rank, world_size, local_address)
        except StoreRecordError as exc:  # a checked store value (not the authorized peer's, or corrupt)
            failure = WeightSyncError(f"weight-sync {self.role} (rank {rank} of {world_size}) refused the rendezvous "
                                      f"at {host}:{port}: {exc}",
                                      hint="something other than the authorized peer wrote to the rendezvous store, "
                                           "or the two ends run different torch builds; re-initialise "
                                           "(POST /init_communicator/)")
        except Exception as exc:  # noqa: BLE001
            waited = time.monotonic() - started
            failure = _transport_error(exc, f"weight-sync {self.role} (rank {rank} of {world_size}) could not form "
                                            f"the group at {host}:{port} after {waited:.1f} s",
                                       "the peer never joined: check the other side's log / GET "
                                       "/coordexp/sync_status/, and that world_size agrees on both sides")
        if failure is not None:
            del store  # the last reference: the rendezvous listener closes now, not at some later collection
            raise failure
        self._store, self._group = store, group
        self.rank, self.world_size, self._seq, self.broken = rank, world_size, 0, None

    def _new_group(self, store: dist.Store, rank: int, world_size: int, local_address: str | None):
        if self.backend == "gloo":
            options = dist.ProcessGroupGloo._Options()
            options._timeout = self._timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address or "127.0.0.1")]
            # gloo parses a peer's record unchecked (an empty one was a SIGSEGV): the guard checks it first
            group = dist.ProcessGroupGloo(GlooRendezvousGuard(store, rank, world_size), rank, world_size, options)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self._timeout
            group = dist.ProcessGroupNCCL(store, rank, world_size, options)
        # One tiny collective proves every rank is connected before the caller relies on the group.
        self._wait(group.allreduce([torch.zeros(1, device=self.device)]), "the connection check")
        return group

    def _wait(self, work, what: str) -> None:
        try:
            completed = work.wait(self._timeout)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc, what)
        if completed is False:
            self._fail(TimeoutError("timed out"), what)

    def _fail(self, exc: BaseException, what: str) -> None:
        error = _transport_error(exc, f"weight-sync {self.role} rank {self.rank}: {what} failed",
                                 "the peer died, timed out or diverged; re-initialise the communicator "
                                 "(POST /close_communicator/ then /init_communicator/)")
        self.broken = str(error)
        raise error from None

    def _require_open(self) -> None:
        if self._group is None:
            raise WeightSyncError(f"the weight-sync {self.role} is not connected; call init() first "
                                  "(after POST /init_communicator/)")
        if self.broken is not None:
            raise WeightSyncError(f"the weight-sync group is broken by an earlier failure ({self.broken}); "
                                  "close() and init() again")

    def _transfer(self, flat: torch.Tensor, apply: Callable[[], None] | None) -> dict[int, str]:
        """Steps 1-3 of a bucket on this rank; returns ``{rank: error}`` of receivers that failed to apply."""
        source = self.world_size - 1
        self._wait(self._group.broadcast([flat], _broadcast_options(source)), f"broadcast of transfer {self._seq}")
        error: str | None = None
        if apply is not None:
            try:
                apply()
            except Exception as exc:  # noqa: BLE001 - any load failure is reported to the sender
                error = f"{type(exc).__name__}: {exc}"
        seq = self._seq
        if error is not None:
            self._store.set(f"{seq}/error/{self.rank}", error.encode("utf-8", "replace")[:_MAX_ERROR_BYTES])
        status = torch.zeros(self.world_size, dtype=torch.int32, device=self.device)
        status[self.rank] = 0 if error is None else 1
        self._wait(self._group.allreduce([status]), f"status exchange of transfer {seq}")
        self._seq += 1
        failed = [rank for rank, flag in enumerate(status.tolist()) if flag]
        return {rank: self._store.get(f"{seq}/error/{rank}")[:_MAX_ERROR_BYTES].decode("utf-8", "replace")
                for rank in failed}

    def close(self) -> None:
        """Leave the group (idempotent); a later ``init`` builds a new one."""
        group, self._group, self._store = self._group, None, None
        if group is not None:
            try:
                group.shutdown()
            except Exception:  # noqa: BLE001 - best effort: the peer may already be gone
                pass
        self.rank, self.world_size, self.broken = -1, 0, None


def _broadcast_options(root: int) -> dist.BroadcastOptions:
    options = dist.BroadcastOptions()
    options.rootRank = root
    options.rootTensor = 0
    return options


def _transport_error(exc: BaseException, what: str, hint: str) -> WeightSyncError:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    timed_out = isinstance(exc, TimeoutError) or "timeout" in text.lower() or "timed out" in text.lower()
    kind = WeightSyncTimeout if timed_out else WeightSyncError
    return kind(f"{what}: {text.rstrip('.')}. {hint}")


# --------------------------------------------------------------------------------------------------- ends


class BucketPusher:
    """``send_full`` / ``send_adapter`` for any sender: plan single-dtype buckets, announce each over HTTP, then
    push it over the sender's data plane (``_push_bucket``). Shared by coordexp's wire and swift's."""

    device: torch.device

    def _require_open(self) -> Any:
        raise NotImplementedError

    def _push_bucket(self, flat: torch.Tensor, metadatas: Sequence[FlattenedTensorMetadata]) -> None:
        raise NotImplementedError

    def send_full(self, named_params: NamedTensors, *, announce: Announce,
                  bucket_mb: float = DEFAULT_BUCKET_MB) -> SyncReport:
        """Send every tensor (HF names, LoRA merged) in single-dtype buckets of at most ``bucket_mb`` MiB."""
        self._require_open()
        started = time.perf_counter()
        buckets = tensors = total = 0
        for members in plan_buckets(named_params, bucket_mb):
            flat, metadatas = flatten_bucket(members, device=self.device)
            announce(metadatas)
            self._push_bucket(flat, metadatas)
            buckets, tensors, total = buckets + 1, tensors + len(members), total + flat.numel() * flat.element_size()
        return SyncReport(buckets, tensors, total, time.perf_counter() - started)

    def send_adapter(self, named_tensors: NamedTensors, *, announce: Announce) -> SyncReport:
        """Send a LoRA adapter (PEFT state-dict names) as ONE bucket (the server adds it as one adapter)."""
        self._require_open()
        members = [(name, tensor) for name, tensor in named_tensors if tensor.numel()]
        if not members:
            raise WeightSyncError("the adapter has no tensors to send; is the model a PEFT model?")
        started = time.perf_counter()
        flat, metadatas = flatten_bucket(members, device=self.device)
        announce(metadatas)
        self._push_bucket(flat, metadatas)
        return SyncReport(1, len(members), flat.numel() * flat.element_size(), time.perf_counter() - started)


class WeightSyncSender(_GroupMember, BucketPusher):
    """The learner end (last rank, broadcast source). Typical use, per server::

        sender = WeightSyncSender(timeout_s=server_contract.timeout_s)
        post("/init_communicator/", {"host": ..., "port": group_port, "world_size": 2})
        sender.init(server_host, group_port, world_size=2)
        report = sender.send_full(weight_export.named_tensors(model), announce=lambda m: post(
            "/update_flattened_params/", {"metadatas": [x.model_dump() for x in m]}))
        post("/reset_prefix_cache/")

    ``announce`` must make the server queue the receive (raise if the POST fails: nothing is broadcast then).
    """

    role = "sender"
    rendezvous_key: str | None = None  # the server's per-init secret (its /init_communicator/ reply)

    def use_init_reply(self, reply: Any) -> Any:
        """Keep the ``rendezvous_key`` of a coordexp server's ``/init_communicator/`` reply for :meth:`init`
        (returns ``reply``); without it the server's store keys stay unknown and the group never forms."""
        key = reply.get("rendezvous_key") if isinstance(reply, dict) else None
        self.rendezvous_key = key if isinstance(key, str) else None
        return reply

    def init(self, host: str, port: int, world_size: int, *, rendezvous_key: str | None = None) -> None:
        """Join the group at ``(host, port)`` as rank ``world_size - 1``; returns when every rank has joined.
        ``rendezvous_key``: the server's per-init secret (default: the one kept by :meth:`use_init_reply`)."""
        self._connect(host, port, world_size, world_size - 1, local_address=_route_address(host, port),
                      rendezvous_key=rendezvous_key if rendezvous_key is not None else self.rendezvous_key)

    def send_bucket(self, flat: torch.Tensor, metadatas: Sequence[FlattenedTensorMetadata]) -> None:
        """Broadcast one announced bucket and wait for every receiver's verdict (raises :class:`RemoteApplyError`)."""
        self._require_open()
        numel, dtype = bucket_layout(metadatas)
        if flat.numel() != numel or flat.dtype != dtype:
            raise WeightSyncError(f"bucket tensor ({flat.numel()} x {flat.dtype}) does not match its metadata "
                                  f"({numel} x {dtype})")
        errors = self._transfer(flat.to(self.device).contiguous(), None)
        if errors:
            names = ", ".join(m.name for m in metadatas[:3]) + (", ..." if len(metadatas) > 3 else "")
            detail = "; ".join(f"rank {rank}: {text}" for rank, text in sorted(errors.items()))
            raise RemoteApplyError(f"the rollout server could not apply weight bucket {self._seq - 1} ({names}): "
                                   f"{detail}", errors)

    _push_bucket = send_bucket

class WeightSyncReceiver(_GroupMember):
    """The server end. ``init`` hosts the store (rank 0) and blocks until the sender joins (or times out);
    ``receive`` takes one announced bucket and applies it."""

    role = "receiver"

    def init(self, host: str, port: int, world_size: int, rank: int = 0, *, local_address: str | None = None,
             listener: socket.socket | None = None, rendezvous_key: str | None = None) -> None:
        """Form the group; blocks until the sender joins or ``timeout_s`` passes (then the listener is closed).
        ``host``: the address the rendezvous store listens on (rank 0 binds exactly there, never every interface
        unless ``host`` is a wildcard), or ``listener``, a socket already bound (taken over, closed on failure).
        ``local_address``: the address the sender reaches this server at (default: ``host`` unless it is a
        wildcard, else loopback). ``rendezvous_key``: the per-init secret every store key is kept under (the server
        draws one per authorized init and answers it to the learner only: :mod:`~coordexp.runtime.rollout.store_guard`)."""
        if rank >= world_size - 1:
            if listener is not None:
                listener.close()
            raise ValueError(f"receiver rank {rank} must be < world_size - 1 ({world_size - 1} is the sender's)")
        address = local_address or (host if host not in _WILDCARD_HOSTS else None)
        self._connect(host, port, world_size, rank, local_address=address, listener=listener,
                      rendezvous_key=rendezvous_key)

    def receive(self, metadatas: Sequence[FlattenedTensorMetadata],
                apply: Callable[[list[tuple[str, torch.Tensor]]], None]) -> str | None:
        """Receive one bucket and ``apply`` its named tensors; returns this rank's apply error text (None if it
        applied). Transport failures raise :class:`WeightSyncError`."""
        self._require_open()
        numel, dtype = bucket_layout(metadatas)
        flat = torch.empty(numel, dtype=dtype, device=self.device)
        outcome: dict[str, str] = {}

        def run() -> None:
            try:
                apply(unflatten_bucket(flat, metadatas))
            except Exception as exc:
                outcome["error"] = f"{type(exc).__name__}: {exc}"
                raise

        self._transfer(flat, run)
        return outcome.get("error")
