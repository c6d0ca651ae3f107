"""``coordexp`` command line: ``validate``, ``schema``, ``migrate``; the other commands live in their own modules
(:mod:`coordexp.cli.train`, :mod:`coordexp.cli.demo`, ...) and register themselves here.

Module-level imports stay light (typer, rich, the schema package): ``validate`` and ``schema`` must never pay
for torch/transformers/vllm. Commands that need the runtime import it inside their bodies. Every command runs in
:mod:`coordexp.cli.frame` (consoles, safe printing of user strings, the guarded runner).
Exit codes: 0 ok; 2 invalid input (config, data, usage); 3 an external system failed (rollout server, weight sync,
topology, a missing package, a busy port); 1 internal error (a bug in coordexp).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from typer.core import TyperGroup

from coordexp.cli.adapters import register as register_adapters
from coordexp.cli.assets import register as register_assets
from coordexp.cli.convert import register as register_convert
from coordexp.cli.demo import register as register_demo
from coordexp.cli.evaluate import register as register_eval
from coordexp.cli.frame import (
    EXIT_EXTERNAL,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_INVALID,
    EXIT_OK,
    err,
    guarded,
    issue_line,
    out,
    print_invalid_report,
    report_exception,
    safe,
    write_result,
)
from coordexp.cli.init import register as register_init
from coordexp.cli.plot import register as register_plot
from coordexp.cli.preflight import register as register_preflight
from coordexp.cli.probe import register as register_probe
from coordexp.cli.serve import register as register_serve
from coordexp.cli.train import register as register_train

__all__ = ["app", "main", "EXIT_OK", "EXIT_INTERNAL", "EXIT_INVALID", "EXIT_EXTERNAL"]

# `coordexp --help` lists the commands in the order a new user needs them; tools last (others after, as registered).
WORKFLOW = ("init", "convert", "expand-vocab", "validate", "preflight", "train", "eval", "show-rollouts", "plot-run",
            "serve-rollout", "export-merged", "demo", "make-tiny-model", "make-synthetic-data", "migrate", "schema")


class _WorkflowOrder(TyperGroup):
    def list_commands(self, ctx: Any) -> list[str]:
        rank = {name: k for k, name in enumerate(WORKFLOW)}
        return sorted(super().list_commands(ctx), key=lambda name: rank.get(name, len(rank)))


app = typer.Typer(
    cls=_WorkflowOrder,
    name="coordexp",
    help="Rollout-matching SFT for coordinate-token detectors: check and migrate configs, train, inspect rollouts.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

ConfigArgs = Annotated[list[Path], typer.Argument(help="YAML config file(s) to check.", show_default=False)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output (one JSON list on stdout).")]


def _checkpoint_model_type(path: str) -> str | None:
    """The family (``model_type``) of a local checkpoint for ``--print-contract``; None for a hub id or a directory
    without a readable config (validation never loads a model)."""
    try:
        data = json.loads((Path(path).expanduser() / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    family = data.get("model_type") if isinstance(data, dict) else None
    return family if isinstance(family, str) else None


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
        if contract is not None:
            contract["model"]["family"] = _checkpoint_model_type(contract["model"]["path"])
        results.append((str(path), report, contract))
    from coordexp.cli.named_files import missing_named_files

    missing = {shown: missing_named_files(report.config) if report.ok else [] for shown, report, _ in results}
    packages = {shown: _missing_packages(report) for shown, report, _ in results}

    if as_json:
        payload = []
        for shown, report, contract in results:
            item = {
                "path": shown,
                "ok": report.ok,
                "errors": [i.to_dict() for i in report.errors],
                "warnings": [w.to_dict() for w in report.warnings],
            }
            item["missing_files"] = [{"key": key, "path": file} for key, file in missing[shown]]
            item["missing_packages"] = [{"package": d.package, "needed_for": why, "install": d.install_line}
                                        for d, why in packages[shown]]
            if print_contract:
                item["contract"] = contract
            payload.append(item)
        write_result(json.dumps(payload, indent=2) + "\n")
    else:
        for shown, report, contract in results:
            top = report.path
            if report.ok:
                out.print(f"[green]✓[/green] {safe(shown)}")
            else:
                print_invalid_report(out, shown, report)
            for warning in report.warnings:
                out.print("  [yellow]! warning[/yellow] " + issue_line(warning, top))
            for key, file in missing[shown]:
                out.print(f"  [yellow]! not found[/yellow] {key}: {safe(file)}")
            for dep, why in packages[shown]:
                out.print(f"  [yellow]! not installed[/yellow] {safe(dep.package)} ({safe(why)}): "
                          f"{safe(dep.install_line)}")  # unescaped, Rich took coordexp[tensorboard]'s [...] as markup
            if missing[shown]:
                out.print(f"  [dim]validate checks the file, not the machine; `coordexp preflight {safe(shown)}` "
                          "checks these files[/dim]")
            if contract is not None:
                sys.stdout.write(json.dumps(contract, indent=2) + "\n")
    raise typer.Exit(EXIT_OK if all(r.ok for _, r, _ in results) else EXIT_INVALID)


def _missing_packages(report: Any) -> list:
    """Optional packages a valid config needs that are not installed here (a warning: validate checks the file)."""
    from coordexp.optional_deps import missing_for
    from coordexp.schema.contract import build_contract
    from coordexp.schema.errors import ConfigError

    if not report.ok:
        return []
    try:
        return missing_for(build_contract(report.config))
    except ConfigError:  # a contract-only rule: validate's own report shows it elsewhere
        return []


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


def migrate(
    config: Annotated[Path, typer.Argument(help="Legacy YAML config to rewrite.", show_default=False)],
    in_place: Annotated[
        bool, typer.Option("--in-place", help="Rewrite the file, keeping a CONFIG.bak backup.")
    ] = False,
    output: Annotated[
        Optional[Path], typer.Option("--output", "-o", help="Write the canonical YAML here instead of stdout.")
    ] = None,
    base_dir: Annotated[
        Optional[Path], typer.Option("--base-dir", help="Upstream configs: the launch directory their relative "
                                     "paths meant (default: the current directory).", show_default=False)
    ] = None,
) -> None:
    """Rewrite legacy keys into canonical YAML. Exit 0: everything moved and the result validates; exit 2:
    something was left out or could not be moved (listed), or the result does not validate.

    A config with extends (or upstream's inherit): -o/stdout writes ONE self-contained file, --in-place migrates
    every file of the chain. The original bytes are never lost: writes go to a temp file renamed into place,
    --in-place keeps a byte-identical backup under a fresh name (.bak, .bak.1, ...), read-only targets and -o onto
    the input are refused.
    """
    from coordexp.schema.migrate_chain import needs_chain

    if needs_chain(config):
        _migrate_chain(config, in_place, output, base_dir)
        return
    from coordexp.schema.migrate_io import migrate_file

    result = migrate_file(config, in_place=in_place, output=output)  # errors: exit 2 through the frame
    migration = result.migration
    for change in migration.changes:
        err.print(f"  [green]moved[/green]  {safe(change)}")
    for left in migration.unresolved:
        err.print(f"  [yellow]left[/yellow]   {safe(left)}")
    if not migration.changed:
        err.print(f"[green]✓[/green] {safe(str(config))}: nothing to migrate")
    if result.written is None and not in_place:
        sys.stdout.write(result.text)
    elif result.written is not None:
        kept = f" (backup: {safe(str(result.backup))})" if result.backup else ""
        err.print(f"wrote {safe(str(result.written))}{kept}")

    written = config if in_place else output
    if written is not None:
        _check_written(written)
    elif not migration.unresolved:
        _check_printed(result.text, config)
    raise typer.Exit(EXIT_INVALID if migration.unresolved else EXIT_OK)


def _check_printed(text: str, config: Path) -> None:
    """Validate what ``migrate`` printed, its relative paths read from ``config``'s folder; exit 2 as
    :func:`_check_written` does (the README promises exit 0 only when the result validates, whatever the output)."""
    from coordexp.schema.loader import validate_mapping
    from coordexp.schema.yaml_io import parse_yaml_text

    data = parse_yaml_text(text)
    _report_check(validate_mapping(data if isinstance(data, dict) else {}, str(config)), "the printed config")


def _check_written(written: Path) -> None:
    """Validate what ``migrate`` wrote; exit 2 listing its problems when it still does not validate."""
    from coordexp.schema.loader import validate_config_file

    _report_check(validate_config_file(written), str(written))


def _report_check(report, written: str) -> None:
    if report.ok:
        err.print(f"[green]✓[/green] {safe(written)} validates")
        return
    err.print(f"[red]✗[/red] {safe(written)} still has {len(report.errors)} problem(s):")
    for issue in report.errors:
        err.print("  [red]•[/red] " + issue_line(issue, report.path))
    raise typer.Exit(EXIT_INVALID)


def _migrate_chain(config: Path, in_place: bool, output: Optional[Path], base_dir: Optional[Path]) -> None:
    """``migrate`` of an extends chain or an upstream config (coordexp/schema/migrate_chain.py); same exit codes."""
    from coordexp.schema.migrate_chain import migrate_chain

    result = migrate_chain(config, output=output, in_place=in_place, base_dir=base_dir)
    if result.upstream:
        err.print("upstream-shaped config: ms-swift spellings mapped; relative paths resolved against "
                  f"{safe(str(base_dir or Path.cwd()))}")
    for outcome in result.files:
        m = outcome.migration
        if in_place:
            err.print(f"{safe(str(outcome.path))}:")
        for change in m.changes:
            err.print(f"  [green]moved[/green]  {safe(change)}")
        for left in m.left_out:
            err.print(f"  [yellow]left out[/yellow] {safe(left)}")
        for left in m.unresolved:
            err.print(f"  [yellow]left[/yellow]   {safe(left)}")
        if outcome.written is not None:
            kept = f" (backup: {safe(str(outcome.backup))})" if outcome.backup else ""
            err.print(f"wrote {safe(str(outcome.written))}{kept}")
    for line in result.paths:
        err.print(f"  [cyan]path[/cyan]   {safe(line)}")
    if not in_place and output is None:
        sys.stdout.write(result.text)
    written = config if in_place else output
    if written is not None:
        _check_written(written)
    elif not result.needs_user:
        _check_printed(result.text, config)
    if result.needs_user:
        err.print("[yellow]exit 2:[/yellow] the keys listed as left out / left need your decision")
    raise typer.Exit(EXIT_INVALID if result.needs_user else EXIT_OK)


app.command("validate")(guarded(validate))
app.command("schema")(guarded(schema))
app.command("migrate")(guarded(migrate))
register_assets(app)
register_adapters(app)
register_train(app)
register_demo(app)
register_serve(app)
register_preflight(app)
register_eval(app)
register_probe(app)
register_convert(app)
register_init(app)
register_plot(app)


def main(argv: Optional[list[str]] = None) -> None:
    """Console-script entry: commands report their own errors (:func:`coordexp.cli.frame.guarded`); this reports
    what escapes outside a command the same way, so a bare traceback never reaches the user."""
    from coordexp.cli.quiet import library_bars_quiet

    library_bars_quiet()  # no "Loading weights" / "Writing model shards" bars in logs (stderr not a terminal)
    try:
        app(args=argv, prog_name="coordexp")
    except SystemExit as exc:
        # Ctrl-C in training: a thread blocked on a hung server must not hold the exit (docs/design.md, decision 14)
        from coordexp.cli import signals

        if exc.code == EXIT_INTERRUPTED and signals.training_interrupted:
            signals.exit_interrupted()
        raise
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(EXIT_INTERRUPTED)
    except Exception as exc:  # noqa: BLE001 - the last line of defence of the CLI
        sys.exit(report_exception(exc))


if __name__ == "__main__":
    main()
