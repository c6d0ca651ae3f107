"""``coordexp export-merged``: a ``train_type: lora`` adapter merged into its base, saved as a plain checkpoint.

Registered on the main app by :func:`register`. Runtime and heavy imports stay inside the command body.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from coordexp.cli.frame import fail, guarded, out, safe

__all__ = ["register", "export_merged"]


def export_merged(
    adapter_dir: Annotated[Path, typer.Argument(help="Adapter directory (adapter_config.json): a LoRA run's "
                                                "output_dir or one of its checkpoint-N.", show_default=False)],
    out_dir: Annotated[Path, typer.Argument(help="Output directory (created; must be new or empty).",
                                            show_default=False)],
    base: Annotated[Optional[Path], typer.Option(
        "--base", help="Base checkpoint (default: the adapter's base_model_name_or_path).")] = None,
) -> None:
    """Merge a LoRA/DoRA adapter into its base model and save a plain checkpoint with the processor, usable as
    model.path (coordexp train / eval / serve-rollout, vLLM)."""
    from coordexp.runtime.model.adapters import ADAPTER_CONFIG

    if not (adapter_dir / ADAPTER_CONFIG).is_file():
        fail(f"{adapter_dir} is not an adapter directory (no {ADAPTER_CONFIG})",
             "Pass the output_dir or a checkpoint-N of a tuner.train_type: lora run")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        fail(f"{out_dir} already exists and is not an empty directory", "Choose a new or empty output directory")
    if out_dir.resolve() == adapter_dir.resolve():
        fail("ADAPTER_DIR and OUT_DIR are the same directory", "Write the merged checkpoint to a new directory")
    from coordexp.runtime.model.policy import export_merged as merge

    written = merge(adapter_dir, out_dir, base=base)
    out.print(f"[green]✓[/green] merged checkpoint written to {safe(written)}")


def register(app: typer.Typer) -> None:
    """Add ``export-merged`` to ``app``."""
    app.command("export-merged")(guarded(export_merged))
