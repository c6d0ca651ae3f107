"""``coordexp`` command line: ``validate``, ``schema``, ``migrate``; ``train``, ``show-rollouts`` and ``demo`` (the
embedded default job) live in :mod:`coordexp.cli.train` and :mod:`coordexp.cli.demo`.

Module-level imports stay light (typer, rich, the schema package): ``validate`` and ``schema`` must never pay
for torch/transformers/vllm. Commands that need the runtime import it inside their bodies.
Exit codes: 0 ok, 2 invalid input (config problems, usage errors), 1 internal error.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from coordexp.cli.assets import register as _register_assets
from coordexp.cli.demo import register as _register_demo
from coordexp.cli.preflight import register as _register_preflight
from coordexp.cli.serve import register as _register_serve
from coordexp.cli.train import register as _register_train

__all__ = ["app", "main", "EXIT_OK", "EXIT_INTERNAL", "EXIT_INVALID"]

EXIT_OK, EXIT_INTERNAL, EXIT_INVALID = 0, 1, 2

app = typer.Typer(
    name="coordexp",
    help="Rollout-matching SFT for coordinate-token detectors: check and migrate configs, train, inspect rollouts.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

_out = Console(highlight=False, soft_wrap=True)
_err = Console(stderr=True, highlight=False, soft_wrap=True)

ConfigArgs = Annotated[list[Path], typer.Argument(help="YAML config file(s) to check.", show_default=False)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output (one JSON list on stdout).")]


def _issue_line(issue, top_file: Optional[str]) -> str:
    where = escape(issue.path or "<top level>")
    text = f"[bold]{where}[/bold]: {escape(issue.message)}"
    if issue.hint:
        text += f". [dim]{escape(issue.hint)}[/dim]"
    if issue.file and issue.file != top_file:
        text += f" [dim](in {escape(issue.file)})[/dim]"
    return text


def print_invalid_report(console: Console, shown: str, report) -> None:
    """The ``✗ FILE: N problem(s)`` line and one bullet per error, as every command that validates prints them."""
    console.print(f"[red]✗[/red] {escape(shown)}: {len(report.errors)} problem(s)")
    for issue in report.errors:
        console.print("  [red]•[/red] " + _issue_line(issue, report.path))


@app.command()
def validate(
    configs: ConfigArgs,
    as_json: JsonOpt = False,
    print_contract: Annotated[
        bool, typer.Option("--print-contract", help="Also print the normalised run contract of each valid file.")
    ] = False,
) -> None:
    """Check config files against the schema and legacy-key table; exit 0 if all are valid, 2 otherwise."""
    from coordexp.schema.contract import build_contract
    from coordexp.schema.loader import validate_config_file

    results = []
    for path in configs:
        report = validate_config_file(path)
        contract = build_contract(report.config).to_dict() if report.ok and print_contract else None
        results.append((str(path), report, contract))

    if as_json:
        payload = []
        for shown, report, contract in results:
            item = {
                "path": shown,
                "ok": report.ok,
                "errors": [i.to_dict() for i in report.errors],
                "warnings": [w.to_dict() for w in report.warnings],
            }
            if print_contract:
                item["contract"] = contract
            payload.append(item)
        sys.stdout.write(json.dumps(payload, indent=2) + "\n")
    else:
        for shown, report, contract in results:
            top = report.path
            if report.ok:
                _out.print(f"[green]✓[/green] {escape(shown)}")
            else:
                print_invalid_report(_out, shown, report)
            for warning in report.warnings:
                _out.print("  [yellow]! warning[/yellow] " + _issue_line(warning, top))
            if contract is not None:
                sys.stdout.write(json.dumps(contract, indent=2) + "\n")
    raise typer.Exit(EXIT_OK if all(r.ok for _, r, _ in results) else EXIT_INVALID)


@app.command()
def schema(
    indent: Annotated[int, typer.Option(help="JSON indentation.", min=0, max=8)] = 2,
) -> None:
    """Print the JSON Schema of the config (point your editor's YAML language server at it)."""
    from coordexp.schema.root import CoordExpConfig

    document = CoordExpConfig.model_json_schema()
    document["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    document["title"] = "coordexp config"
    document.setdefault("properties", {})["extends"] = {
        "description": "Base file(s) merged first, relative to this file: dicts deep-merge, lists replace.",
        "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
    }
    sys.stdout.write(json.dumps(document, indent=indent or None) + "\n")


@app.command()
def migrate(
    config: Annotated[Path, typer.Argument(help="Legacy YAML config to rewrite.", show_default=False)],
    in_place: Annotated[
        bool, typer.Option("--in-place", help="Rewrite the file, keeping a CONFIG.bak backup.")
    ] = False,
    output: Annotated[
        Optional[Path], typer.Option("--output", "-o", help="Write the canonical YAML here instead of stdout.")
    ] = None,
) -> None:
    """Rewrite legacy keys into canonical YAML; report what could not be moved (exit 2 if anything is left)."""
    from coordexp.schema.loader import validate_config_file
    from coordexp.schema.migrate import migrate_text
    from coordexp.schema.yaml_io import YamlReadError, read_yaml_file

    if in_place and output is not None:
        _err.print("[red]error[/red]: use either --in-place or --output, not both")
        raise typer.Exit(EXIT_INVALID)
    try:
        data = read_yaml_file(config)
        if not isinstance(data, dict):
            raise YamlReadError("top level must be a mapping of sections", "Pass a coordexp YAML config.")
        text = config.read_text(encoding="utf-8")
        target = config if in_place else output
        new_text, migration = migrate_text(text, config, target)
    except YamlReadError as exc:
        _err.print(f"[red]✗[/red] {escape(str(config))}: {escape(exc.message)}. [dim]{escape(exc.hint)}[/dim]")
        raise typer.Exit(EXIT_INVALID) from None

    for change in migration.changes:
        _err.print(f"  [green]moved[/green]  {escape(change)}")
    for left in migration.unresolved:
        _err.print(f"  [yellow]left[/yellow]   {escape(left)}")
    if not migration.changed:
        _err.print(f"[green]✓[/green] {escape(str(config))}: nothing to migrate")

    if in_place:
        if migration.changed:
            backup = config.with_name(config.name + ".bak")
            backup.write_text(text, encoding="utf-8")
            _write_atomic(config, new_text)
            _err.print(f"wrote {escape(str(config))} (backup: {escape(str(backup))})")
    elif output is not None:
        _write_atomic(output, new_text)
        _err.print(f"wrote {escape(str(output))}")
    else:
        sys.stdout.write(new_text)

    written = config if in_place else output
    if written is not None:
        report = validate_config_file(written)
        if report.ok:
            _err.print(f"[green]✓[/green] {escape(str(written))} validates")
        else:
            _err.print(f"[red]✗[/red] {escape(str(written))} still has {len(report.errors)} problem(s):")
            for issue in report.errors:
                _err.print("  [red]•[/red] " + _issue_line(issue, report.path))
            raise typer.Exit(EXIT_INVALID)
    raise typer.Exit(EXIT_INVALID if migration.unresolved else EXIT_OK)


_register_assets(app)
_register_train(app)
_register_demo(app)
_register_serve(app)
_register_preflight(app)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def main(argv: Optional[list[str]] = None) -> None:
    """Console-script entry: never a bare traceback (set COORDEXP_DEBUG=1 to see one)."""
    try:
        app(args=argv, prog_name="coordexp")
    except SystemExit:
        raise
    except KeyboardInterrupt:
        _err.print("interrupted")
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - the last line of defence of the CLI
        if os.environ.get("COORDEXP_DEBUG") == "1":
            raise
        _err.print(f"[red]internal error[/red]: {escape(type(exc).__name__)}: {escape(str(exc))}")
        _err.print("[dim]This is a bug in coordexp. Re-run with COORDEXP_DEBUG=1 for the traceback; report it.[/dim]")
        sys.exit(EXIT_INTERNAL)


if __name__ == "__main__":
    main()
