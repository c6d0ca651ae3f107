"""Who may open the weight-sync rendezvous, where it listens, and for how long: ONE policy for every sync wire.

Issue 15 item 1: one unauthenticated ``POST /init_communicator/`` made the server listen on every interface at a
port the caller chose, parked inference behind the wait, and took any timeout. The rules, all enforced here:

- the rendezvous listener binds to the HTTP server's interface (loopback by default) or an explicit ``--sync-host``,
  never to every interface by accident (torch's ``TCPStore`` master ignores its host argument, so the store is
  handed a socket bound here: :meth:`RendezvousPolicy.listen`);
- when the HTTP port or the rendezvous is reachable beyond loopback, a shared token is required on every weight
  endpoint (``Authorization: Bearer <token>``; ``--sync-token`` or ``COORDEXP_SYNC_TOKEN``) and the server refuses
  to start without one; a configured token is required on loopback too;
- the client-supplied rendezvous timeout is clamped to the server's cap (:meth:`RendezvousPolicy.timeout_s`);
- the wait runs on its own daemon thread (:class:`RendezvousRunner`), never on the FIFO engine worker, so
  ``/infer/`` keeps answering; an abandoned rendezvous ends at the cap and its listener is closed;
- the listener admits newcomers only while the group forms (:class:`ListenerGate`, a Linux socket filter): on
  ms-swift's wire, whose store carries no secret, only the authorized caller's address (and this server's own store
  client) may connect meanwhile; on both wires nobody new may connect once the group has formed.
"""

from __future__ import annotations

import ctypes
import hmac
import json
import ipaddress
import logging
import math
import os
import socket
import struct
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Iterable

from coordexp.errors import ExternalSystemError, UserInputError
from coordexp.runtime.rollout.weight_sync import WeightSyncError, listening_socket

__all__ = ["TOKEN_ENV", "WILDCARD_HOSTS", "is_loopback", "RendezvousPolicy", "RendezvousPolicyError",
           "SyncAuthError", "RendezvousBusy", "RendezvousRunner", "SYNC_PATHS", "SyncTokenGuard", "ListenerGate",
           "admission_program"]

log = logging.getLogger("coordexp.serve")

TOKEN_ENV = "COORDEXP_SYNC_TOKEN"
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})
DEFAULT_MAX_TIMEOUT_S = 240.0


class RendezvousPolicyError(UserInputError, ValueError):
    """The server's weight-sync settings are unsafe or invalid (e.g. reachable beyond loopback without a token)."""


class SyncAuthError(PermissionError):
    """A weight endpoint was called without the server's token (answered 401)."""


class RendezvousBusy(ExternalSystemError, RuntimeError):
    """A rendezvous is already waiting for its learner (answered 409 until it completes or expires)."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only loopback addresses (``localhost``, ``127.x``, ``::1``); wildcards are not."""
    if host in WILDCARD_HOSTS:
        return False
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    addresses = {info[4][0] for info in infos}
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


@dataclass(frozen=True)
class RendezvousPolicy:
    """The binding, token and timeout rules of the weight-sync rendezvous (module doc). Build it with
    :meth:`resolve`; every ``/init_communicator/`` path (coordexp's gloo/NCCL group and ms-swift's own wire)
    calls :meth:`authorize`, :meth:`timeout_s`, :meth:`listen` and runs its wait through :class:`RendezvousRunner`."""

    bind_host: str = "127.0.0.1"
    max_timeout_s: float = DEFAULT_MAX_TIMEOUT_S
    token: str | None = field(default=None, repr=False)
    exposed: bool = False  # the HTTP port or the rendezvous is reachable beyond loopback

    @classmethod
    def resolve(cls, *, http_host: str, sync_host: str | None = None, token: str | None = None,
                max_timeout_s: float = DEFAULT_MAX_TIMEOUT_S) -> "RendezvousPolicy":
        """The policy of a server bound to ``http_host``; raises :class:`RendezvousPolicyError` when it would be
        reachable beyond loopback without a token, or the cap is not a positive finite number of seconds."""
        bind = sync_host if sync_host not in (None, "") else http_host
        token = token or None
        if token is not None and (len(token) < 8 or any(ord(c) < 33 or ord(c) > 126 for c in token)):
            raise RendezvousPolicyError("--sync-token must be at least 8 printable ASCII characters without spaces "
                                        "(e.g. `python -c 'import secrets; print(secrets.token_hex(16))'`)")
        if not (math.isfinite(max_timeout_s) and 0 < max_timeout_s <= 7 * 24 * 3600):
            raise RendezvousPolicyError(f"the weight-sync timeout cap must be in (0, 604800] seconds "
                                        f"(got {max_timeout_s})")
        exposed = not is_loopback(http_host) or not is_loopback(bind)
        if exposed and token is None:
            where = http_host if not is_loopback(http_host) else bind
            raise RendezvousPolicyError(
                f"the server would be reachable beyond this machine ({where!r}) and anyone reaching it could open the "
                f"weight-sync rendezvous and overwrite the served weights: set a shared token with --sync-token or "
                f"the {TOKEN_ENV} environment variable (the learner sends it too), or serve on 127.0.0.1")
        return cls(bind_host=bind, max_timeout_s=float(max_timeout_s), token=token, exposed=exposed)

    def authorize(self, authorization: str | None) -> None:
        """Raise :class:`SyncAuthError` unless the ``Authorization`` header carries the token (no token: open)."""
        if self.token is None:
            return
        scheme, _, value = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), self.token.encode()):
            raise SyncAuthError(f"weight endpoints need the server's token: send 'Authorization: Bearer <token>' "
                                f"(the value of --sync-token / {TOKEN_ENV} on the server)")

    def timeout_s(self, requested: float | None) -> float:
        """The rendezvous/collective timeout to use: the client's value clamped to ``max_timeout_s`` (the cap when
        unset); a longer request is shortened, never refused, and the reply reports the value used."""
        if requested is None or not math.isfinite(requested) or requested <= 0:
            return self.max_timeout_s
        return min(float(requested), self.max_timeout_s)

    def listen(self, port: int) -> socket.socket:
        """A listening socket on ``(bind_host, port)`` for the rendezvous store (raises :class:`WeightSyncError`
        naming the port when it is busy or not allowed)."""
        return listening_socket(self.bind_host, port)

    def admitted(self, peer: str | None) -> set[str] | None:
        """The addresses that may reach the rendezvous while ms-swift's group forms: the authorized caller's and
        the store's own client's; None (no address rule) when the caller is on loopback (so is anyone local) or
        is not an IPv4 address (swift's client joins the store over IPv4 whatever the HTTP call used)."""
        try:
            address = ipaddress.ip_address((peer or "").split("%")[0])
        except ValueError:
            return None
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if address.is_loopback or address.version != 4:
            return None
        own = {"127.0.0.1", "::1"} if self.bind_host in WILDCARD_HOSTS else _addresses(self.bind_host)
        return {str(address)} | own

    def local_address(self, peer_host: str) -> str:
        """The concrete address of this server for the collective transport: ``bind_host``, or (wildcard) the
        address the route to ``peer_host`` leaves from."""
        if self.bind_host not in WILDCARD_HOSTS:
            return self.bind_host
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((peer_host, 9))
                return probe.getsockname()[0]
        except (OSError, UnicodeError):
            return "127.0.0.1"


def _addresses(host: str) -> set[str]:
    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except (socket.gaierror, UnicodeError):
        return {host}


# Classic BPF, as the kernel runs it on every packet a socket receives (a listener: the connection attempts).
_SO_ATTACH_FILTER = getattr(socket, "SO_ATTACH_FILTER", 26)
_NET = 0xFFF00000  # SKF_NET_OFF: offsets from the IP header
_LDB, _LDW, _RSH, _JEQ, _RET = 0x30, 0x20, 0x74, 0x15, 0x06
_ACCEPT, _DROP = 0xFFFFFFFF, 0


def admission_program(allowed: Iterable[str]) -> list[tuple[int, int, int, int]]:
    """A socket filter (``(code, jt, jf, k)`` instructions) that keeps packets from ``allowed`` source addresses
    (IPv4, IPv6; an IPv4-mapped IPv6 address counts as IPv4) and drops every other; empty ``allowed``: drop all."""
    v4, v6 = set(), set()
    for text in allowed:
        address = ipaddress.ip_address(text.split("%")[0])
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        (v4 if address.version == 4 else v6).add(address.packed)
    code: list = [(_LDB, None, None, _NET), (_RSH, None, None, 4), (_JEQ, None, "v6", 4), (_LDW, None, None, _NET + 12)]
    code += [(_JEQ, "accept", None, int.from_bytes(ip, "big")) for ip in sorted(v4)]
    code += [(_RET, None, None, _DROP), "v6", (_JEQ, None, "drop", 6)]
    for n, ip in enumerate(sorted(v6)):
        for w in range(4):
            code += [(_LDW, None, None, _NET + 8 + 4 * w),
                     (_JEQ, "accept" if w == 3 else None, f"next{n}", int.from_bytes(ip[4 * w:4 * w + 4], "big"))]
        code.append(f"next{n}")
    code += ["drop", (_RET, None, None, _DROP), "accept", (_RET, None, None, _ACCEPT)]
    labels: dict[str, int] = {}
    program: list[tuple[int, str | None, str | None, int]] = []
    for item in code:  # a label names the instruction that follows it
        if isinstance(item, str):
            labels[item] = len(program)
        else:
            program.append(item)

    def offset(label: str | None, index: int) -> int:
        return 0 if label is None else labels[label] - index - 1

    return [(op, offset(jt, i), offset(jf, i), k) for i, (op, jt, jf, k) in enumerate(program)]


class ListenerGate:
    """Who may still connect to a rendezvous listener: :meth:`admit` restricts it to some source addresses while
    the group forms, :meth:`seal` refuses every newcomer once it has formed (connections already accepted keep
    their own filter and keep working). Linux socket filters, best effort: where the kernel refuses them,
    ``enforced`` is False and the key and checked values stay the only guards (logged)."""

    def __init__(self, listener: socket.socket):
        self._socket: socket.socket | None = None
        self.enforced = sys.platform.startswith("linux")  # SO_ATTACH_FILTER is Linux's
        if self.enforced:
            try:  # the store takes over the listener's descriptor; this duplicate reaches the same socket
                self._socket = socket.socket(fileno=os.dup(listener.fileno()))
            except OSError as exc:
                self.enforced = False
                log.warning("the weight-sync rendezvous listener cannot be gated (%s)", exc)

    def _attach(self, program: list[tuple[int, int, int, int]], what: str) -> None:
        if self._socket is None or not self.enforced:
            return
        raw = b"".join(struct.pack("HBBI", *instruction) for instruction in program)
        buffer = ctypes.create_string_buffer(raw, len(raw))
        try:
            self._socket.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER,
                                    struct.pack("HP", len(program), ctypes.addressof(buffer)))
        except OSError as exc:
            self.enforced = False
            log.warning("the weight-sync rendezvous listener cannot %s here (%s): the per-init key (coordexp's "
                        "wire) and checked store values remain", what, exc)

    def admit(self, allowed: set[str] | None) -> None:
        if allowed:
            self._attach(admission_program(allowed), "admit only the authorized peer")

    def seal(self) -> None:
        self._attach(admission_program(()), "refuse connections after the group formed")

    def close(self) -> None:
        sock, self._socket = self._socket, None
        if sock is not None:
            sock.close()


@dataclass
class _Pending:
    future: Future
    started: float
    timeout_s: float


class RendezvousRunner:
    """Runs one rendezvous at a time on a daemon thread, so the engine worker never waits for a learner that may
    never come. A second start while one waits raises :class:`RendezvousBusy` (the wait ends at its timeout)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: _Pending | None = None

    def start(self, connect: Callable[[], None], timeout_s: float, *, name: str = "coordexp-rendezvous") -> Future:
        """Run ``connect`` (which must give up after ``timeout_s`` and release its listener on failure)."""
        with self._lock:
            pending = self._pending
            if pending is not None and not pending.future.done():
                left = max(0.0, pending.started + pending.timeout_s - time.monotonic())
                raise RendezvousBusy(f"a weight-sync rendezvous is already waiting for its learner (it gives up in "
                                     f"{left:.0f} s); join it, or retry after it ends")
            future: Future = Future()
            future.set_running_or_notify_cancel()
            self._pending = _Pending(future, time.monotonic(), float(timeout_s))

        def run() -> None:
            try:
                connect()
            except BaseException as exc:  # noqa: BLE001 - the outcome travels in the future
                future.set_exception(WeightSyncError(str(exc)) if not isinstance(exc, Exception) else exc)
            else:
                future.set_result(None)

        threading.Thread(target=run, name=name, daemon=True).start()
        return future

    def wait(self, future: Future, what: str) -> None:
        """Block until ``future``'s rendezvous has formed (re-raising its failure); bounded by its own timeout."""
        with self._lock:
            pending = self._pending if self._pending is not None and self._pending.future is future else None
        limit = None if pending is None else max(0.0, pending.started + pending.timeout_s - time.monotonic()) + 5.0
        try:
            future.result(timeout=limit)
        except TimeoutError:
            raise WeightSyncError(f"{what}: the weight-sync rendezvous did not complete within its timeout") from None

    @property
    def waiting(self) -> bool:
        with self._lock:
            return self._pending is not None and not self._pending.future.done()


SYNC_PATHS = frozenset({"/init_communicator/", "/update_named_param/", "/update_flattened_params/",
                        "/update_adapter_flattened_param/", "/update_adapter_param/", "/close_communicator/"})


class SyncTokenGuard:
    """ASGI middleware: a request to a weight endpoint (:data:`SYNC_PATHS`, with or without the trailing slash)
    without the policy's token is answered 401 before its body is read; other endpoints pass untouched."""

    def __init__(self, app: Callable, *, policy: RendezvousPolicy,
                 on_refusal: Callable[[str, int, str], None] | None = None):
        self.app, self.policy, self.on_refusal = app, policy, on_refusal

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if self.policy.token is not None and path.rstrip("/") + "/" in SYNC_PATHS:
            header = dict(scope.get("headers") or ()).get(b"authorization", b"").decode("latin-1")
            try:
                self.policy.authorize(header)
            except SyncAuthError as exc:
                if self.on_refusal is not None:
                    client = scope.get("client") or ("?", 0)
                    self.on_refusal(f"{path} from {client[0]}", 401, str(exc))
                payload = json.dumps({"detail": str(exc)}).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                                        (b"content-length", str(len(payload)).encode()), (b"connection", b"close")]})
                await send({"type": "http.response.body", "body": payload})
                return
        await self.app(scope, receive, send)
