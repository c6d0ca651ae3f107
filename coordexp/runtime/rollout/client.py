"""A small HTTP client for one rollout server speaking the ms-swift v3.10 ``swift rollout`` JSON protocol.

Like TRL's ``VLLMClient``, but every call has an explicit timeout and every failure is a :class:`ServerError`
that names the server URL, the endpoint and what to do; nothing blocks forever unless the caller asked for no
``/infer/`` timeout. Stdlib ``urllib`` only (proxies from the environment are ignored: servers are local).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
import urllib.error
import urllib.request
from typing import Any, Sequence

from coordexp.errors import ExternalSystemError

__all__ = [
    "ServerError",
    "ServerUnreachableError",
    "ServerTimeoutError",
    "ServerResponseError",
    "is_not_found",
    "RolloutServerClient",
    "SERVER_MODE_HINT",
]

SERVER_MODE_HINT = (
    "start the server first (coordexp serve-rollout CFG --port N, or swift rollout), check "
    "rollout_matching.vllm.server.servers[].base_url, or roll out without a server "
    "(rollout_matching.vllm.mode: colocate, or rollout_matching.rollout_backend: hf)")
_PROBE_TIMEOUT_S = 5.0
_POLL_INTERVAL_S = 0.5
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


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

    ``timeout_s`` bounds health polling and every control call; ``infer_timeout_s`` bounds ``/infer/``
    (``None`` or ``<= 0``: no timeout, the spec's default).
    """

    def __init__(self, base_url: str, *, group_port: int | None = None, timeout_s: float = 240.0,
                 infer_timeout_s: float | None = None):
        self.base_url = base_url.rstrip("/")
        self.group_port = group_port
        self.timeout_s = float(timeout_s)
        self.infer_timeout_s = float(infer_timeout_s) if infer_timeout_s is not None and infer_timeout_s > 0 else None
        self._world_size: int | None = None

    def __repr__(self) -> str:
        return f"RolloutServerClient({self.base_url!r}, group_port={self.group_port})"

    # -- transport ---------------------------------------------------------------------------------------------
    def url(self, endpoint: str) -> str:
        return f"{self.base_url}/{endpoint.strip('/')}/"

    def request(self, method: str, endpoint: str, payload: Any = None, *, timeout: float | None) -> Any:
        """One HTTP call; returns the decoded JSON body or raises a :class:`ServerError` naming the URL."""
        url = self.url(endpoint)
        data = None if payload is None else json.dumps(payload).encode("utf-8")
        req = urllib.request.Request(url, data=data, method=method)
        token = os.environ.get("COORDEXP_SYNC_TOKEN")  # the server's weight-sync token (README: threat model)
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if method == "POST" and data is None:
            req.data = b""
        limit = "no timeout" if timeout is None else f"{timeout:g} s"
        try:
            with _NO_PROXY.open(req, timeout=timeout) as response:
                body = response.read()
        except urllib.error.HTTPError as exc:
            detail = _error_detail(exc)
            raise ServerResponseError(
                f"rollout server {url} answered HTTP {exc.code}{detail}; see the server log for the cause",
                url=url, status=int(exc.code)) from None
        except (socket.timeout, TimeoutError) as exc:
            raise ServerTimeoutError(
                f"rollout server {url} did not answer within {limit} ({exc}); the server may be hung or overloaded",
                url=url) from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, (socket.timeout, TimeoutError)):
                raise ServerTimeoutError(f"rollout server {url} did not answer within {limit}", url=url) from None
            raise ServerUnreachableError(f"rollout server {url} is unreachable ({exc.reason}); {SERVER_MODE_HINT}",
                                         url=url) from None
        except (ConnectionError, OSError, http.client.HTTPException) as exc:  # reset / cut mid-response (killed)
            raise ServerUnreachableError(
                f"rollout server {url} dropped the connection ({type(exc).__name__}: {exc}); the server process "
                "may have died, check its log", url=url) from None
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
                self.request("GET", "health", timeout=max(0.05, min(_PROBE_TIMEOUT_S, remaining)))
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


def _error_detail(exc: urllib.error.HTTPError) -> str:
    try:
        raw = exc.read()[:300].decode("utf-8", "replace")
    except Exception:  # noqa: BLE001 - the status code alone is still a useful error
        return ""
    return f": {raw}" if raw else ""
