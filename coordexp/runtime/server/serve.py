"""Run the rollout server: build the engine of a config, bind the port explicitly, serve with uvicorn.

- Loopback (``127.0.0.1``) by default; another host is an explicit choice.
- The socket is bound BEFORE the model loads: a busy port is an immediate :class:`ServeSystemError` naming the port
  (ms-swift silently moves to the next free port, and the learner then talks to nothing). ``port=0`` asks the
  OS for a free port; the ready line printed on stdout names the real one.
- SIGINT/SIGTERM stop it within seconds: every request still waiting for the engine worker is answered 503 at
  once, queued work is dropped, an engine call still running is abandoned after 2 s (the worker is a daemon
  thread), the weight-sync group is left and the engine released when it is idle. When an engine call was
  abandoned the process ends with ``os._exit`` after flushing its output: interpreter finalization under a
  running torch/vLLM call ended in SIGABRT; the exit code stays 0.
- The access log is on by default (``access_log=False`` / ``--no-access-log`` turns it off): every request and
  its status, so a client's 4xx leaves a trace; refusals also log their reason on ``coordexp.serve``.
"""

from __future__ import annotations

import copy
import errno
import importlib
import importlib.util
import logging
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from coordexp.errors import CoordexpError, ExternalSystemError, UserInputError
from coordexp.runtime.server.engine import GenerationParams, RolloutEngine

if TYPE_CHECKING:
    from fastapi import FastAPI

    from coordexp.schema.contract import RunContract

__all__ = ["ServeError", "ServeInputError", "ServeSystemError", "READY_PREFIX", "bind_socket", "resolve_engine_kind",
           "build_engine", "build_app", "serve"]

READY_PREFIX = "coordexp rollout server ready on "
EngineKind = Literal["vllm", "hf"]
log = logging.getLogger("coordexp.serve")


class ServeError(CoordexpError, RuntimeError):
    """The server cannot start; the text says why and what to do. Raised as one of the two kinds below."""


class ServeInputError(ServeError, UserInputError):
    """A start-up argument is wrong (a port out of range, a host that does not resolve): exit 2."""


class ServeSystemError(ServeError, ExternalSystemError):
    """This machine cannot serve as asked (the port is busy, vLLM is missing or inconsistent): exit 3."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on exactly ``(host, port)``; a busy port raises :class:`ServeError`."""
    if not 0 <= port <= 65535:
        raise ServeInputError(f"--port {port} is not a TCP port (0..65535; 0 picks a free one)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ServeInputError(f"--host {host!r} cannot be resolved ({exc}); use 127.0.0.1 or an address of this "
                         "machine") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT only; a live listener still conflicts
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ServeSystemError(f"port {port} on {host} is already in use; stop the process holding it or choose "
                             "another --port (the server never moves to another port silently: the learner's "
                             "servers[].base_url must name the real one)") from None
        raise ServeSystemError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


def resolve_engine_kind(requested: EngineKind | None) -> EngineKind:
    """``requested``, or vLLM when it and coordexp's vLLM engine are installed, else HF."""
    if requested is not None:
        return requested
    has_vllm = importlib.util.find_spec("vllm") is not None
    has_wrapper = importlib.util.find_spec("coordexp.runtime.rollout.vllm_engine") is not None
    return "vllm" if has_vllm and has_wrapper else "hf"


def build_engine(run: "RunContract", kind: EngineKind) -> RolloutEngine:
    """The engine of the config's model, with its ``repeat_terminate`` subtree installed (config first: an
    enabled guard that cannot be activated fails here, at start-up)."""
    if kind == "hf":
        from coordexp.runtime.server.engine import HfEngine

        return HfEngine.from_contract(run)
    try:
        module = importlib.import_module("coordexp.runtime.rollout.vllm_engine")
    except ModuleNotFoundError as exc:
        raise ServeSystemError(f"--engine vllm needs {exc.name!r}, which is not installed; install vLLM or serve with "
                         "--engine hf") from None
    factory = getattr(module, "create_server_engine", None)
    if factory is None:
        engine_class = getattr(module, "VllmEngine", None)
        factory = getattr(engine_class, "from_contract", None)
    if factory is None:
        raise ServeSystemError("coordexp.runtime.rollout.vllm_engine defines no create_server_engine(run) / "
                               "VllmEngine.from_contract; the installation is inconsistent: serve with --engine hf")
    engine = factory(run)
    if not isinstance(engine, RolloutEngine):
        raise ServeSystemError(f"the vLLM engine factory returned {type(engine).__name__}, which does not implement "
                               "the RolloutEngine protocol")
    return engine


def build_app(run: "RunContract", engine: RolloutEngine, *, image_root: str | Path | None,
              bind_host: str | None = None, policy: Any = None, max_body_bytes: int | None = None,
              system: str | None = None, batch: Any = None, max_request_tokens: int | None = None) -> "FastAPI":
    """The app of ``run``: the config's template, decoding and max_new_tokens as request defaults; prompt plus
    ``max_tokens`` bounded by the config's resolved ``max_model_len``; ``policy``: the weight-sync
    :class:`~coordexp.runtime.server.rendezvous.RendezvousPolicy` (default: loopback rules for ``bind_host``);
    ``system``: the system prompt of requests without one (None: the chat template's default); ``batch``: a
    :class:`~coordexp.runtime.server.batching.BatchPolicy` (default: the engine's batch size)."""
    from coordexp.runtime.server.limits import DEFAULT_MAX_BODY_BYTES, MAX_REQUEST_TOKENS
    from coordexp.runtime.model.encoding import load_processor
    from coordexp.runtime.server.app import create_app

    rollout = run.rollout_matching
    defaults = GenerationParams(max_new_tokens=rollout.max_new_tokens, decoding=rollout.decoding)
    return create_app(engine, load_processor(run.model.path), run.template, image_root=image_root,
                      defaults=defaults, model_name=Path(run.model.path).name or run.model.path,
                      sync_timeout_s=rollout.serving.sync_timeout_s, bind_host=bind_host, policy=policy,
                      max_model_len=rollout.serving.engine.max_model_len,
                      max_body_bytes=max_body_bytes or DEFAULT_MAX_BODY_BYTES, system=system, batch=batch,
                      max_request_tokens=max_request_tokens or MAX_REQUEST_TOKENS)


def log_config(log_level: str) -> dict[str, Any]:
    """uvicorn's logging setup plus the ``coordexp`` loggers on the same stderr handler (refusals, sync failures)."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["coordexp"] = {"handlers": ["default"], "level": log_level.upper(), "propagate": False}
    return config


def serve(app: Any, sock: socket.socket, *, log_level: str = "info", graceful_timeout_s: float = 5.0,
          access_log: bool = True) -> None:
    """Serve ``app`` on the already-bound ``sock`` until SIGINT/SIGTERM; prints the ready line first. A signal
    answers every waiting request 503 (``app.state.begin_shutdown``); open connections get
    ``graceful_timeout_s`` to finish sending before they are cut."""
    import uvicorn

    host, port = sock.getsockname()[:2]
    begin_shutdown = getattr(getattr(app, "state", None), "begin_shutdown", None)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            self._captured_signals.clear()  # a signal means "stop cleanly": exit 0, do not re-raise it afterwards
            if begin_shutdown is not None:
                begin_shutdown()

    config = uvicorn.Config(app, log_level=log_level, lifespan="on", access_log=access_log,
                            timeout_graceful_shutdown=graceful_timeout_s, log_config=log_config(log_level))
    server = _Server(config)
    shown = f"[{host}]" if ":" in host else host
    print(f"{READY_PREFIX}http://{shown}:{port}", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    print("coordexp rollout server stopped", flush=True)
    abandoned = getattr(getattr(app, "state", None), "abandoned", None)
    if callable(abandoned) and abandoned():
        exit_now(0)


def exit_now(code: int) -> None:
    """End the process at once (no finalizers): an engine call still runs on the worker thread, and finalizing the
    interpreter under it aborts (SIGABRT). Output is flushed first."""
    log.warning("an engine call was still running at shutdown; exiting without waiting for it")
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
