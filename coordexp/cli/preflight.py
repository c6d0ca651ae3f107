"""``coordexp preflight CFG [--json] [--learner-world-size W]``: launch-script checks and wiring.

Exit codes (distinct, for scripts): 0 ready; 2 invalid config, model directory or data; 3 a rollout server is
unreachable; 4 infeasible topology (``decode_batch_size * S < W``); 5 (``--launch`` only) a port is busy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

__all__ = ["register", "preflight"]

_out = Console(highlight=False, soft_wrap=True)


def preflight(
    config: Annotated[Path, typer.Argument(help="YAML run config.", show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="Print the report (checks + wiring) as one JSON object.")] = False,
    learner_world_size: Annotated[int, typer.Option("--learner-world-size", min=1,
                                                    help="torchrun processes of the learner (W).")] = 1,
    launch: Annotated[bool, typer.Option("--launch", help="Servers are not started yet: check that their ports "
                                         "are free instead of their health.")] = False,
    server_world_size: Annotated[int, typer.Option("--server-world-size", min=1, help="With --launch: replicas "
                                                   "(tp*dp) each server will have.")] = 1,
    health_timeout_s: Annotated[Optional[float], typer.Option("--health-timeout", help="Seconds to wait for each "
                                                              "server's /health/ (default: the config's timeout_s).")] = None,
    gpus: Annotated[Optional[int], typer.Option("--gpus", help="GPUs on the node, for the suggested device split "
                                                "(default: CUDA_VISIBLE_DEVICES, else 4).")] = None,
) -> None:
    """Validate a run before launch: config, model coord tokens, data sample, servers, topology; print wiring."""
    from coordexp.runtime.train.preflight import run_preflight

    report = run_preflight(config, learner_world_size=learner_world_size, health_timeout_s=health_timeout_s,
                           launch=launch, server_world_size=server_world_size, num_gpus=gpus)
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        for check in report.checks:
            mark = "[green]✓[/green]" if check.ok else "[red]✗[/red]"
            _out.print(f"{mark} [bold]{escape(check.name)}[/bold]: {escape(check.detail)}")
        if report.wiring:
            _out.print(escape(json.dumps(report.wiring)))
    raise typer.Exit(report.exit_code)


def register(app: typer.Typer) -> None:
    """Add ``preflight`` to the main CLI."""
    app.command("preflight")(preflight)
