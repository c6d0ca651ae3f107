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
  ``/infer/`` keeps answering; an abandoned rendezvous ends at the cap and its listener is closed.
"""

from __future__ import annotations

import hmac
import json
import ipaddress
import math
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from coordexp.errors import ExternalSystemError, UserInputError
from coordexp.runtime.rollout.weight_sync import WeightSyncError, listening_socket

__all__ = ["TOKEN_ENV", "WILDCARD_HOSTS", "is_loopback", "RendezvousPolicy", "RendezvousPolicyError",
           "SyncAuthError", "RendezvousBusy", "RendezvousRunner", "SYNC_PATHS", "SyncTokenGuard"]

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
