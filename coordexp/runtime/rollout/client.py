"""A small HTTP client for one rollout server speaking the ms-swift v3.10 ``swift rollout`` JSON protocol.

Like TRL's ``VLLMClient``, but every call has an explicit timeout and every failure is a :class:`ServerError`
that names the server URL, the endpoint and what to do; nothing blocks forever unless the caller asked for no
``/infer/`` timeout. Stdlib ``http.client`` only, keep-alive connections pooled per client (proxies from the
environment are not used: servers are local). Retries (docs/design.md, server mode): only idempotent calls,
``/infer/`` included because every request carries an explicit seed (the server gives request ``j`` the seed
``seed + j``), so a repeated call returns what the lost one would have; weight-sync calls are never repeated.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import select
import socket
import threading
import time
from typing import Any, Sequence
from urllib.parse import urlsplit

from pydantic import SecretStr

from coordexp.errors import ExternalSystemError

__all__ = [
    "ServerError",
    "ServerUnreachableError",
    "ServerTimeoutError",
    "ServerResponseError",
    "is_not_found",
    "resolve_sync_token",
    "RolloutServerClient",
    "SERVER_MODE_HINT",
    "SYNC_TOKEN_ENV",
    "IDEMPOTENT_POSTS",
    "RETRY_STATUSES",
]

logger = logging.getLogger("coordexp.rollout.client")

SERVER_MODE_HINT = (
    "start the server first (coordexp serve-rollout CFG --port N, or swift rollout), check "
    "rollout_matching.vllm.server.servers[].base_url, or roll out without a server "
    "(rollout_matching.vllm.mode: colocate, or rollout_matching.rollout_backend: hf)")
SYNC_TOKEN_ENV = "COORDEXP_SYNC_TOKEN"
# POST endpoints that change nothing on the server (or, /infer/, return the same tokens for the same seeded request):
# retried like GETs. Everything else (the weight-sync endpoints) is sent exactly once.
IDEMPOTENT_POSTS = frozenset({"infer", "get_engine_type"})
RETRY_STATUSES = frozenset({502, 503, 504})  # a proxy or a server not ready; any other status is the server's answer
DEFAULT_RETRIES = 2
DEFAULT_BACKOFF_S = 0.5
_MAX_BACKOFF_S = 8.0
# an idle pooled connection is reused only this long: uvicorn (coordexp serve-rollout, swift rollout) closes idle
# keep-alive connections after 5 s, and a call must never race that close
_MAX_IDLE_S = 3.0
_MAX_IDLE_CONNECTIONS = 16
_PROBE_TIMEOUT_S = 5.0
_POLL_INTERVAL_S = 0.5


def resolve_sync_token(configured: "str | SecretStr | None") -> SecretStr | None:
    """The weight-sync token: the configured value (config or CLI), else ``COORDEXP_SYNC_TOKEN``, else None."""
    if isinstance(configured, SecretStr):
        configured = configured.get_secret_value()
    value = configured or os.environ.get(SYNC_TOKEN_ENV) or None
    return SecretStr(value) if value else None


class _ConnectionPool:
    """Idle keep-alive connections to one server. ``http.client`` connections are not thread-safe, so each call
    takes one for itself (a fresh one when none is idle) and gives it back after reading the whole reply."""

    def __init__(self, base_url: str):
        parts = urlsplit(base_url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port
        self._prefix = parts.path.rstrip("/")
        self._idle: list[tuple[http.client.HTTPConnection, float]] = []
        self._lock = threading.Lock()
        self.opened = 0

    def path(self, endpoint: str) -> str:
        return f"{self._prefix}/{endpoint.strip('/')}/"

    def acquire(self, timeout: float | None, *, fresh: bool = False) -> http.client.HTTPConnection:
        """A connected connection whose timeout is ``timeout`` (a new one with ``fresh``); raises ``OSError`` when
        none can be opened."""
        now = time.monotonic()
        while not fresh:
            with self._lock:
                conn, since = self._idle.pop() if self._idle else (None, 0.0)
            if conn is None:
                break
            if now - since <= _MAX_IDLE_S and not _dropped(conn):
                conn.sock.settimeout(timeout)
                return conn
            conn.close()
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = cls(self._host, self._port, timeout=timeout)
        try:
            conn.connect()
        except BaseException:
            conn.close()
            raise
        with self._lock:
            self.opened += 1
        return conn

    def release(self, conn: http.client.HTTPConnection, *, reusable: bool) -> None:
        if not reusable or conn.sock is None:
            conn.close()
            return
        with self._lock:
            if len(self._idle) < _MAX_IDLE_CONNECTIONS:
                self._idle.append((conn, time.monotonic()))
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn, _ in idle:
            conn.close()


def _dropped(conn: http.client.HTTPConnection) -> bool:
    """Whether an idle connection was closed by the server (readable while idle means EOF or stray bytes)."""
    sock = conn.sock
    if sock is None:
        return True
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


class ServerError(ExternalSystemError, RuntimeError):
    """A rollout server call failed; ``url`` is the full endpoint URL."""

    def __init__(self, message: str, *, url: str):
        super().__init__(message)
        self.url = url


class ServerUnreachableError(ServerError):
    """No connection (refused, reset, DNS) or no healthy answer within the allowed time."""


class ServerTimeoutError(ServerError):
    """The server accepted the connection but did not answer within the timeout."""


class ServerResponseError(ServerError):
    """The server answered, but with an HTTP error status (``status``) or a body that is not the expected JSON shape
    (``status`` None); callers branch on ``status``, never on the message text."""

    def __init__(self, message: str, *, url: str, status: int | None = None):
        super().__init__(message, url=url)
        self.status = status


def is_not_found(exc: BaseException) -> bool:
    """Whether ``exc`` is a server's HTTP 404 (an endpoint this server does not have, e.g. ``swift rollout``)."""
    return isinstance(exc, ServerResponseError) and exc.status == 404


class RolloutServerClient:
    """One server: ``base_url`` (no trailing slash) and its weight-sync ``group_port``.

    ``timeout_s`` bounds health polling and every control call; ``infer_timeout_s`` bounds ``/infer/`` (``None`` or
    ``<= 0``: no timeout). Connections are kept alive and reused (a small pool, one connection per concurrent
    caller; docs/design.md, server mode); idempotent calls are retried ``retries`` times with exponential backoff,
    weight-sync calls never (:data:`IDEMPOTENT_POSTS`). ``sync_token`` is sent as ``Authorization: Bearer``; None
    falls back to ``COORDEXP_SYNC_TOKEN``, read once here.
    """

    def __init__(self, base_url: str, *, group_port: int | None = None, timeout_s: float = 240.0,
                 infer_timeout_s: float | None = None, sync_token: "str | SecretStr | None" = None,
                 retries: int = DEFAULT_RETRIES, backoff_s: float = DEFAULT_BACKOFF_S):
        self.base_url = base_url.rstrip("/")
        self.group_port = group_port
        self.timeout_s = float(timeout_s)
        self.infer_timeout_s = float(infer_timeout_s) if infer_timeout_s is not None and infer_timeout_s > 0 else None
        self.retries = max(0, int(retries))
        self.backoff_s = max(0.0, float(backoff_s))
        self._sync_token = resolve_sync_token(sync_token)
        self._world_size: int | None = None
        self._pool = _ConnectionPool(self.base_url)

    def __repr__(self) -> str:
        return f"RolloutServerClient({self.base_url!r}, group_port={self.group_port})"

    @property
    def connections_opened(self) -> int:
        """How many TCP connections this client has opened (keep-alive reuse keeps it low)."""
        return self._pool.opened

    def close(self) -> None:
        """Close the idle pooled connections (calls still in flight close theirs when they finish)."""
        self._pool.close()

    # -- transport ---------------------------------------------------------------------------------------------
    def url(self, endpoint: str) -> str:
        return f"{self.base_url}/{endpoint.strip('/')}/"

    def request(self, method: str, endpoint: str, payload: Any = None, *, timeout: float | None,
                retry: bool | None = None) -> Any:
        """One HTTP call; returns the decoded JSON body or raises a :class:`ServerError` naming the URL.

        With ``retry`` (default: a GET, or a POST in :data:`IDEMPOTENT_POSTS`) a lost connection or HTTP 502/503/504
        is retried ``retries`` times with backoff ``backoff_s * 2**k``; never a timeout (the server may still be
        working on it) nor any other status."""
        if retry is None:
            retry = method == "GET" or endpoint.strip("/") in IDEMPOTENT_POSTS
        attempts = 1 + (self.retries if retry else 0)
        for attempt in range(attempts):
            try:
                # a call sent exactly once never rides a kept-alive connection: the server may close an idle one
                # while the request is on its way, and such a call cannot be resent
                return self._request_once(method, endpoint, payload, timeout=timeout, fresh=not retry)
            except (ServerUnreachableError, ServerResponseError) as exc:
                retryable = isinstance(exc, ServerUnreachableError) or exc.status in RETRY_STATUSES
                if not retryable or attempt + 1 >= attempts:
                    raise
                delay = min(_MAX_BACKOFF_S, self.backoff_s * 2 ** attempt)
                logger.warning("rollout server call %s %s failed (%s); retry %d of %d in %.2f s", method,
                               self.url(endpoint), exc, attempt + 1, attempts - 1, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    def _request_once(self, method: str, endpoint: str, payload: Any, *, timeout: float | None,
                      fresh: bool = False) -> Any:
        url = self.url(endpoint)
        data = b"" if payload is None else json.dumps(payload).encode("utf-8")
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        if self._sync_token is not None:  # the server's weight-sync token (docs/rollout_server.md: threat model)
            headers["Authorization"] = f"Bearer {self._sync_token.get_secret_value()}"
        limit = "no timeout" if timeout is None else f"{timeout:g} s"
        try:
            conn = self._pool.acquire(timeout, fresh=fresh)
        except (socket.timeout, TimeoutError) as exc:
            raise ServerTimeoutError(
                f"rollout server {url} did not accept a connection within {limit} ({exc}); the server may be hung "
                "or overloaded", url=url) from None
        except OSError as exc:  # refused, DNS, no route
            raise ServerUnreachableError(f"rollout server {url} is unreachable ({exc}); {SERVER_MODE_HINT}",
                                         url=url) from None
        try:
            conn.request(method, self._pool.path(endpoint), body=None if method == "GET" else data, headers=headers)
            response = conn.getresponse()
            body = response.read()
        except (socket.timeout, TimeoutError) as exc:
            conn.close()
            raise ServerTimeoutError(
                f"rollout server {url} did not answer within {limit} ({exc}); the server may be hung or overloaded",
                url=url) from None
        except (ConnectionError, OSError, http.client.HTTPException) as exc:  # reset / cut mid-response (killed)
            conn.close()
            raise ServerUnreachableError(
                f"rollout server {url} dropped the connection ({type(exc).__name__}: {exc}); the server process "
                "may have died, check its log", url=url) from None
        self._pool.release(conn, reusable=not response.will_close)
        if response.status >= 400:
            raw = body[:300].decode("utf-8", "replace")
            raise ServerResponseError(
                f"rollout server {url} answered HTTP {response.status}{f': {raw}' if raw else ''}; see the server "
                "log for the cause", url=url, status=int(response.status))
        try:
            return json.loads(body)
        except ValueError:
            snippet = body[:200].decode("utf-8", "replace")
            raise ServerResponseError(f"rollout server {url} answered with malformed JSON: {snippet!r}",
                                      url=url) from None

    # -- liveness and topology --------------------------------------------------------------------------------
    def wait_until_healthy(self, timeout_s: float | None = None) -> float:
        """Poll ``GET /health/`` until it answers 200, for at most ``timeout_s`` (default: the client's).
        Returns the seconds waited; raises :class:`ServerUnreachableError` naming the URL otherwise."""
        budget = self.timeout_s if timeout_s is None else float(timeout_s)
        start = time.monotonic()
        deadline = start + budget
        last: Exception | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                self.request("GET", "health", timeout=max(0.05, min(_PROBE_TIMEOUT_S, remaining)), retry=False)
                return time.monotonic() - start
            except ServerError as exc:
                last = exc
            time.sleep(max(0.0, min(_POLL_INTERVAL_S, deadline - time.monotonic())))
        raise ServerUnreachableError(
            f"rollout server {self.url('health')} did not become healthy within timeout_s={budget:g} s "
            f"(last error: {last}); {SERVER_MODE_HINT}", url=self.url("health"))

    def world_size(self) -> int:
        """``GET /get_world_size/`` (cached): accepts ``{"world_size": N}``, a bare int or a digit string."""
        if self._world_size is None:
            body = self.request("GET", "get_world_size", timeout=self.timeout_s)
            value = body.get("world_size") if isinstance(body, dict) else body
            if isinstance(value, str) and value.strip().isdigit():
                value = int(value)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ServerResponseError(
                    f"rollout server {self.url('get_world_size')} returned {body!r}; expected "
                    '{"world_size": <int >= 1>}', url=self.url("get_world_size"))
            self._world_size = value
        return self._world_size

    def engine_type(self) -> dict:
        """``POST /get_engine_type/`` (POST, as in ms-swift): engine name and ``enable_lora``."""
        body = self.request("POST", "get_engine_type", timeout=self.timeout_s)
        if not isinstance(body, dict):
            raise ServerResponseError(f"rollout server {self.url('get_engine_type')} returned {body!r}; expected an "
                                      "object", url=self.url("get_engine_type"))
        return body

    # -- inference --------------------------------------------------------------------------------------------
    def infer(self, infer_requests: Sequence[dict], request_config: dict) -> list[dict]:
        """``POST /infer/``: one ``RolloutOutput`` dict per request, in request order (checked)."""
        payload = {"infer_requests": list(infer_requests), "request_config": dict(request_config)}
        body = self.request("POST", "infer", payload, timeout=self.infer_timeout_s)
        if not isinstance(body, list) or len(body) != len(infer_requests):
            got = f"a list of {len(body)}" if isinstance(body, list) else type(body).__name__
            raise ServerResponseError(
                f"rollout server {self.url('infer')} returned {got} for {len(infer_requests)} requests; expected one "
                "RolloutOutput per request", url=self.url("infer"))
        return body

    # -- weight sync control (the tensors travel over the torch.distributed group, not HTTP) -------------------
    def init_communicator(self, host: str, port: int, world_size: int, client_device_uuid: str | None = None) -> Any:
        return self.request("POST", "init_communicator", {"host": host, "port": int(port), "world_size": int(world_size),
                                                          "client_device_uuid": client_device_uuid},
                            timeout=self.timeout_s)

    def update_named_param(self, name: str, dtype: str, shape: Sequence[int]) -> Any:
        return self.request("POST", "update_named_param", {"name": name, "dtype": dtype, "shape": list(shape)},
                            timeout=self.timeout_s)

    def update_flattened_params(self, metadatas: Sequence[dict]) -> Any:
        return self.request("POST", "update_flattened_params", {"metadatas": list(metadatas)}, timeout=self.timeout_s)

    def update_adapter_flattened_param(self, lora_int_id: int, peft_config: dict, metadatas: Sequence[dict]) -> Any:
        return self.request("POST", "update_adapter_flattened_param",
                            {"lora_int_id": int(lora_int_id), "peft_config": dict(peft_config),
                             "metadatas": list(metadatas)}, timeout=self.timeout_s)

    def reset_prefix_cache(self) -> Any:
        return self.request("POST", "reset_prefix_cache", timeout=self.timeout_s)

    def close_communicator(self) -> Any:
        return self.request("POST", "close_communicator", timeout=self.timeout_s)
