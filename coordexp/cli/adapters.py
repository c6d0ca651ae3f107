"""``coordexp export-merged``: a ``train_type: lora`` adapter merged into its base, saved as a plain checkpoint.

Registered on the main app by :func:`register`. Runtime and heavy imports stay inside the command body.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from coordexp.cli.frame import err, fail, guarded, out, safe

__all__ = ["register", "export_merged"]


def export_merged(
    adapter_dir: Annotated[Path, typer.Argument(help="Adapter directory (adapter_config.json): a LoRA run's "
                                                "output_dir or one of its checkpoint-N.", show_default=False)],
    out_dir: Annotated[Path, typer.Argument(help="Output directory (created; must be new or empty).",
                                            show_default=False)],
    base: Annotated[Optional[Path], typer.Option(
        "--base", help="Local base checkpoint (default: the adapter's base_model_name_or_path); a base other "
        "than the recorded one is used and said.")] = None,
) -> None:
    """Merge a LoRA/DoRA adapter into its base model and save a plain checkpoint with the processor, usable as
    model.path (coordexp train / eval / serve-rollout, vLLM)."""
    if full_checkpoint(adapter_dir):
        fail(f"{adapter_dir} is a full fine-tune (config.json and weights, no adapter_config.json): it already is a "
             "plain checkpoint, there is no adapter to merge",
             f"Use it as it is: model.path: {adapter_dir} (or --checkpoint {adapter_dir})")
    from coordexp.cli.quiet import deepspeed_quiet

    with deepspeed_quiet():  # transformers/peft import DeepSpeed when installed; merging never uses it
        from coordexp.runtime.model.merge_export import plan_export, write_merged

        plan = plan_export(adapter_dir, out_dir, base=base)  # every input checked: exit 2 before any weight loads
        for note in plan.notes:
            err.print(f"[yellow]![/yellow] {safe(note)}")
        written = write_merged(plan)
    out.print(f"[green]✓[/green] merged checkpoint written to {safe(written)}")


def full_checkpoint(folder: Path) -> bool:
    """A saved full model (config.json plus weights) that is not an adapter folder."""
    try:
        weights = any(folder.glob("*.safetensors")) or (folder / "pytorch_model.bin").is_file()
        return (folder.is_dir() and not (folder / "adapter_config.json").exists()
                and (folder / "config.json").is_file() and weights)
    except OSError:
        return False


def register(app: typer.Typer) -> None:
    """Add ``export-merged`` to ``app``."""
    app.command("export-merged")(guarded(export_merged))
