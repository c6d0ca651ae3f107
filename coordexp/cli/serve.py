"""``coordexp serve-rollout CFG``: the rollout server for the config's model (ms-swift v3.10 wire protocol).

The config is validated and the port bound before anything heavy is imported or loaded: an invalid file or a busy
port fails in well under a second (exit 2). Engine start-up problems (no model, an enabled ``repeat_terminate``
that the engine cannot activate, vLLM missing for ``--engine vllm``) exit 2 with the reason.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

__all__ = ["register", "serve_rollout"]

EXIT_OK, EXIT_INTERNAL, EXIT_INVALID = 0, 1, 2
_err = Console(stderr=True, highlight=False, soft_wrap=True)


def _fail(message: str, hint: str = "", code: int = EXIT_INVALID) -> None:
    _err.print(f"[red]✗[/red] {escape(message)}" + (f". [dim]{escape(hint)}[/dim]" if hint else ""))
    raise typer.Exit(code)


def serve_rollout(
    config: Annotated[Path, typer.Argument(help="YAML run config (model, template, decoding, repeat_terminate).",
                                           show_default=False)],
    host: Annotated[str, typer.Option("--host", help="Address to listen on (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port; busy is an error (0 = any free port).")] = 8000,
    engine: Annotated[Optional[str], typer.Option(
        "--engine", help="vllm or hf (default: vllm when installed, else hf).")] = None,
    image_root: Annotated[Optional[Path], typer.Option(
        "--image-root", help="The only directory local image paths may point into (default: the config's "
        "data.image_root). Without it, only base64 images are accepted.")] = None,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn log level.")] = "info",
) -> None:
    """Serve rollouts of the config's model over HTTP (ms-swift `swift rollout` compatible endpoints)."""
    from coordexp.cli.app import print_invalid_report
    from coordexp.cli.train import _user_error_types
    from coordexp.schema.contract import build_contract
    from coordexp.schema.loader import validate_config_file

    if engine not in (None, "vllm", "hf"):
        _fail(f"--engine {engine!r} is not an engine", "Use --engine vllm or --engine hf")
    report = validate_config_file(config)
    if not report.ok:
        print_invalid_report(_err, str(config), report)
        raise typer.Exit(EXIT_INVALID)
    run = build_contract(report.config)
    root = image_root if image_root is not None else (Path(run.data.image_root) if run.data.image_root else None)
    if root is not None and not root.is_dir():
        _fail(f"image root {root} is not a directory", "Pass --image-root DIR (the directory holding the images)")

    from coordexp.runtime.server.serve import ServeError, bind_socket, build_app, build_engine, resolve_engine_kind
    from coordexp.runtime.server.serve import serve as run_server

    try:
        sock = bind_socket(host, port)
    except ServeError as exc:
        _fail(str(exc))
    kind = resolve_engine_kind(engine)  # type: ignore[arg-type]
    _err.print(f"loading {escape(run.model.path)} with the {kind} engine "
               f"(repeat_terminate {'on' if run.rollout_matching.repeat_terminate.enabled else 'off'}) ...")
    user_errors = _user_error_types() + (ServeError,)
    try:
        try:
            server_engine = build_engine(run, kind)
            app = build_app(run, server_engine, image_root=root, bind_host=host)
        except user_errors as exc:
            _fail(f"cannot start the rollout server: {type(exc).__name__}: {' '.join(str(exc).split())}",
                  "Fix the config or the installation named above")
        except (KeyboardInterrupt, typer.Exit):
            raise
        except Exception as exc:  # noqa: BLE001 - start-up failure with its reason, no bare traceback
            if os.environ.get("COORDEXP_DEBUG") == "1":
                raise
            _fail(f"cannot start the rollout server: {type(exc).__name__}: {' '.join(str(exc).split())}",
                  "Re-run with COORDEXP_DEBUG=1 for the traceback", EXIT_INTERNAL)
        run_server(app, sock, log_level=log_level)
    finally:
        sock.close()
    raise typer.Exit(EXIT_OK)


def register(app: typer.Typer) -> None:
    """Add ``serve-rollout`` to the main CLI."""
    app.command("serve-rollout")(serve_rollout)
