"""``coordexp preflight CFG [--json] [--learner-world-size W | --nnodes N --nproc-per-node M]``: launch-script
checks and wiring (with ``--nnodes``, what each node of the launch needs).

Every problem found is listed (not only the first). Exit codes, the error family's: 0 ready; 2 something the user
must fix (config, model directory, data); 3 an external system is not ready (a rollout server unreachable, an
infeasible topology ``decode_batch_size * S < W``, with ``--launch`` a busy port). 2 wins when both kinds occur.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from coordexp.cli.frame import fail, guarded, out, safe, validate_with_overrides, write_result
from coordexp.cli.overrides import SetOption

__all__ = ["register", "preflight"]


def preflight(
    config: Annotated[Path, typer.Argument(help="YAML run config.", show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="Print the report (checks + wiring) as one JSON object.")
                       ] = False,
    learner_world_size: Annotated[Optional[int], typer.Option(
        "--learner-world-size", min=1, help="torchrun processes of the learner (W; default --nnodes x "
        "--nproc-per-node, else 1).")] = None,
    nnodes: Annotated[Optional[int], typer.Option("--nnodes", min=1, help="Nodes of the launch (one torchrun "
                                                  "agent each): say what each node needs.")] = None,
    nproc_per_node: Annotated[Optional[int], typer.Option("--nproc-per-node", min=1, help="Learner ranks per "
                                                          "node (with --nnodes; default 1).")] = None,
    launch: Annotated[bool, typer.Option("--launch", help="Servers are not started yet: check that their ports "
                                         "are free instead of their health.")] = False,
    server_world_size: Annotated[int, typer.Option("--server-world-size", min=1, help="With --launch: replicas "
                                                   "(tp*dp) each server will have.")] = 1,
    health_timeout_s: Annotated[Optional[float], typer.Option(
        "--health-timeout", help="Seconds to wait for each server's /health/ (default: the config's timeout_s).")
    ] = None,
    gpus: Annotated[Optional[int], typer.Option("--gpus", help="GPUs on the node, for the suggested device split "
                                                "(default: CUDA_VISIBLE_DEVICES, else 4).")] = None,
    overrides: SetOption = None,
) -> None:
    """Validate a run before launch: config, model coord tokens, data sample, servers, topology; print wiring."""
    from coordexp.runtime.train.preflight import EXIT_CODES, run_preflight

    world = _world_size(learner_world_size, nnodes, nproc_per_node)
    report = run_preflight(config, learner_world_size=world, health_timeout_s=health_timeout_s, launch=launch,
                           server_world_size=server_world_size, num_gpus=gpus,
                           nnodes=nnodes if nnodes is not None or nproc_per_node is None else 1,
                           validate=lambda path: validate_with_overrides(path, list(overrides or [])))
    if as_json:
        write_result(json.dumps(report.to_dict(), indent=2) + "\n")
    else:
        for check in report.checks:
            mark = "[yellow]![/yellow]" if check.warning else "[green]✓[/green]" if check.ok else "[red]✗[/red]"
            out.print(f"{mark} [bold]{safe(check.name)}[/bold]: {safe(check.detail, multiline=True)}")
        if report.wiring:
            out.print(safe(json.dumps(report.wiring)))
        if not report.ok:
            out.print(f"[red]{len(report.problems)} problem(s)[/red]: {safe(EXIT_CODES[report.exit_code])} "
                      f"(exit {report.exit_code})")
    raise typer.Exit(report.exit_code)


def _world_size(learner_world_size: Optional[int], nnodes: Optional[int], nproc_per_node: Optional[int]) -> int:
    """W: ``--nnodes`` x ``--nproc-per-node`` (each default 1 when the other is given), else
    ``--learner-world-size`` (default 1); both forms must agree."""
    if nnodes is None and nproc_per_node is None:
        return learner_world_size or 1
    world = (nnodes or 1) * (nproc_per_node or 1)
    if learner_world_size is not None and learner_world_size != world:
        fail(f"--learner-world-size {learner_world_size} differs from --nnodes {nnodes or 1} x --nproc-per-node "
             f"{nproc_per_node or 1} = {world}", "Give one of the two forms")
    return world


def register(app: typer.Typer) -> None:
    """Add ``preflight`` to the main CLI."""
    app.command("preflight")(guarded(preflight))
