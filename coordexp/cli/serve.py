"""``coordexp serve-rollout CFG``: the rollout server for the config's model (ms-swift v3.10 wire protocol).

The config is validated and the port bound before anything heavy is imported or loaded: an invalid file fails in
well under a second (exit 2), a busy port too (exit 3, an external condition). Engine start-up problems exit with
their class's code (:func:`coordexp.cli.frame.guarded`): vLLM missing for ``--engine vllm`` 3, an enabled
``repeat_terminate`` the config cannot activate 2, anything unforeseen 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from coordexp.cli.frame import EXIT_OK, err, fail, guarded, load_run, safe
from coordexp.cli.overrides import SetOption

__all__ = ["register", "serve_rollout"]

# the on/off switches get panels of their own: a --no-... column in the main table leaves its help no room at 80
LOGGING, SYSTEM_PROMPT = "Logging", "System prompt"


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
    checkpoint: Annotated[Optional[Path], typer.Option(
        "--checkpoint", help="Serve this saved model (a training output_dir or checkpoint-N) instead of model.path; "
                             "loaded as `coordexp eval --checkpoint` loads it.")] = None,
    log_level: Annotated[Optional[str], typer.Option(
        "--log-level", show_default=False, rich_help_panel=LOGGING,
        help="uvicorn log level (default: warning, info with --verbose).")] = None,
    access_log: Annotated[Optional[bool], typer.Option(
        "--access-log/--no-access-log", show_default=False, rich_help_panel=LOGGING,
        help="Log every request with its status (default: off, on with --verbose).")] = None,
    verbose: Annotated[bool, typer.Option(
        "--verbose", rich_help_panel=LOGGING,
        help="uvicorn's start-up lines and the access log (every request with its status).")] = False,
    sync_host: Annotated[Optional[str], typer.Option(
        "--sync-host", help="Address the weight-sync rendezvous listens on (default: --host).")] = None,
    sync_token: Annotated[Optional[str], typer.Option(
        "--sync-token", envvar="COORDEXP_SYNC_TOKEN", show_default=False,
        help="Shared token required on every weight endpoint (Authorization: Bearer); mandatory when --host or "
        "--sync-host is not loopback.")] = None,
    sync_timeout_max: Annotated[Optional[float], typer.Option(
        "--sync-timeout-max", help="Cap in seconds on the weight-sync rendezvous and collective timeout; a client's "
        "longer timeout_s is clamped (default: the config's vllm.server.timeout_s, 240).")] = None,
    max_body_mb: Annotated[float, typer.Option(
        "--max-body-mb", help="Largest request body accepted (MiB); larger is 413.")] = 64.0,
    system: Annotated[Optional[str], typer.Option(
        "--system", show_default=False, rich_help_panel=SYSTEM_PROMPT,
        help="System prompt for requests that send none (default: the config's template.system_prompt, which "
        "the model was trained with).")] = None,
    template_system: Annotated[bool, typer.Option(
        "--no-system-from-config", show_default=False, rich_help_panel=SYSTEM_PROMPT,
        help="Requests without a system message get the chat template's own default, as `swift rollout` does, "
        "not the config's system prompt.")] = False,
    config_system: Annotated[bool, typer.Option(  # the default, spelled out; hidden, kept for scripts that pass it
        "--system-from-config", hidden=True)] = False,
    max_batch_seqs: Annotated[Optional[int], typer.Option(
        "--max-batch-seqs", show_default=False, help="Sequences per merged engine call (concurrent /infer/ calls "
        "share it round-robin; default: vLLM's max_num_seqs or 256, HF: 4 x decode_batch_size).")] = None,
    batch_window_ms: Annotated[float, typer.Option(
        "--batch-window-ms", help="How long an idle engine waits for more /infer/ calls to merge (ms; again while "
        "calls keep arriving, at most 8 times).")] = 10.0,
    max_request_tokens: Annotated[int, typer.Option(
        "--max-request-tokens", help="Most sequences x max_tokens one /infer/ may ask for (larger is 400).")
    ] = 1 << 22,
    overrides: SetOption = None,
) -> None:
    """Serve rollouts of the config's model over HTTP (ms-swift `swift rollout` compatible endpoints)."""
    if engine not in (None, "vllm", "hf"):
        fail(f"--engine {engine!r} is not an engine", "Use --engine vllm or --engine hf")
    run = load_run(config, overrides=list(overrides or []))
    if checkpoint is not None:
        from coordexp.cli.evaluate import check_checkpoint_files, run_with_checkpoint

        run, model_dir, adapter = run_with_checkpoint(run, checkpoint)
        if adapter is not None:
            fail(f"--checkpoint {checkpoint} is a LoRA adapter; the server serves a full model",
                 f"Merge it first: `coordexp export-merged {checkpoint} MERGED`, then --checkpoint MERGED")
        check_checkpoint_files(model_dir, None)
    root = image_root if image_root is not None else (Path(run.data.image_root) if run.data.image_root else None)
    if root is not None and not root.is_dir():
        fail(f"image root {root} is not a directory", "Pass --image-root DIR (the directory holding the images)")

    if not 0 < max_body_mb <= 4096:
        fail(f"--max-body-mb {max_body_mb} is out of range", "Use a size in (0, 4096] MiB")
    chosen = [name for name, given in (("--system", system is not None), ("--system-from-config", config_system),
                                       ("--no-system-from-config", template_system)) if given]
    if len(chosen) > 1:
        fail(f"{' and '.join(chosen)} both set the default system prompt", "Pass one of them")
    if max_batch_seqs is not None and not 1 <= max_batch_seqs <= 65536:
        fail(f"--max-batch-seqs {max_batch_seqs} is out of range", "Use 1..65536 sequences")
    if not 0 <= batch_window_ms <= 1000:
        fail(f"--batch-window-ms {batch_window_ms} is out of range", "Use 0..1000 ms")
    if not 1 <= max_request_tokens <= 1 << 40:
        fail(f"--max-request-tokens {max_request_tokens} is out of range", "Use 1..2**40 tokens")
    if system is not None and ("\x00" in system or len(system) > 100_000):
        fail("--system holds a NUL byte or more than 100,000 characters", "Pass a plain-text system prompt")

    from coordexp.runtime.server.rendezvous import RendezvousPolicy
    from coordexp.runtime.server.serve import bind_socket, build_app, build_engine, resolve_engine_kind
    from coordexp.runtime.server.serve import serve as run_server

    policy = RendezvousPolicy.resolve(  # exposed beyond loopback without a token: refused here (exit 2)
        http_host=host, sync_host=sync_host, token=sync_token,
        max_timeout_s=sync_timeout_max if sync_timeout_max is not None else run.rollout_matching.serving.sync_timeout_s)
    from coordexp.optional_deps import require_installed

    kind = resolve_engine_kind(engine)  # type: ignore[arg-type]
    require_installed(run, "serve_vllm" if kind == "vllm" else "serve")  # fastapi, uvicorn, vLLM: exit 3, no load
    sock = bind_socket(host, port)  # ServeInputError (2) / ServeSystemError (3) before anything loads
    try:
        err.print(f"loading {safe(run.model.path)} with the {kind} engine "
                  f"(repeat_terminate {'on' if run.rollout_matching.repeat_terminate.enabled else 'off'}) ...")
        server_engine = build_engine(run, kind)
        from coordexp.runtime.server.app import default_batch_policy
        from coordexp.runtime.server.batching import BatchPolicy

        seqs = max_batch_seqs or default_batch_policy(server_engine).max_batch_seqs
        app = build_app(run, server_engine, image_root=root, bind_host=host, policy=policy,
                        max_body_bytes=int(max_body_mb * 2**20),
                        system=system if system is not None else None if template_system
                        else run.template.system_prompt,
                        batch=BatchPolicy(max_batch_seqs=seqs, window_s=batch_window_ms / 1000),
                        max_request_tokens=max_request_tokens)
        run_server(app, sock, log_level=log_level or ("info" if verbose else "warning"),
                   access_log=verbose if access_log is None else access_log)
    finally:
        sock.close()
    raise typer.Exit(EXIT_OK)


def register(app: typer.Typer) -> None:
    """Add ``serve-rollout`` to the main CLI."""
    app.command("serve-rollout")(guarded(serve_rollout))
