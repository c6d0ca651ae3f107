"""``coordexp make-tiny-model``, ``expand-vocab`` and ``make-synthetic-data``: offline assets for tests and the demo.

Registered on the main app by :func:`register`. Runtime and heavy imports stay inside the command bodies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from coordexp.cli.frame import fail, guarded, out, safe

__all__ = ["register", "make_tiny_model", "expand_vocab", "make_synthetic_data"]


def _require_empty_target(path: Path) -> None:
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        fail(f"{path} already exists and is not an empty directory", "Choose a new or empty output directory")


def make_tiny_model(
    directory: Annotated[Path, typer.Argument(help="Output directory (created; must be new or empty).",
                                              show_default=False)],
    family: Annotated[str, typer.Option("--family", help="Architecture: qwen2_vl, qwen2_5_vl or qwen3_vl.")] = "qwen2_vl",
    seed: Annotated[int, typer.Option("--seed", help="Weight-initialisation seed.")] = 0,
) -> None:
    """Build a tiny random Qwen-VL checkpoint (tokenizer with coord tokens, processor, model) offline."""
    from coordexp.runtime.toy.tiny_model import TINY_FAMILIES, build_tiny_model

    if family not in TINY_FAMILIES:
        fail(f"unknown --family {family!r}", f"Choose one of {', '.join(TINY_FAMILIES)}")
    _require_empty_target(directory)
    build_tiny_model(directory, family=family, seed=seed)
    out.print(f"[green]✓[/green] tiny {family} model written to {safe(directory)}")


def expand_vocab(
    source: Annotated[Path, typer.Argument(help="Local checkpoint directory to read.", show_default=False)],
    destination: Annotated[Path, typer.Argument(help="Output directory (new or empty).", show_default=False)],
) -> None:
    """Add the 1000 coord tokens to a local checkpoint's tokenizer and embeddings and save the result."""
    if not (source / "config.json").is_file():
        fail(f"{source} is not a checkpoint directory (no config.json)",
              "Pass a local directory saved with save_pretrained; download hub models beforehand")
    from coordexp.runtime.model.merge_export import expand_vocab as expand_checked

    added = expand_checked(source, destination)  # SRC and DST checked before any weight loads (exit 2)
    state = f"added {added} coord tokens" if added else "already had all coord tokens; copied unchanged"
    out.print(f"[green]✓[/green] {safe(destination)}: {state}")


def make_synthetic_data(
    directory: Annotated[Path, typer.Argument(help="Output directory.", show_default=False)],
    n_train: Annotated[int, typer.Option("--n-train", min=1, help="Training images.")] = 64,
    n_val: Annotated[int, typer.Option("--n-val", min=0, help="Validation images.")] = 16,
    seed: Annotated[int, typer.Option("--seed", help="Dataset seed (same seed, same bytes).")] = 0,
    size: Annotated[int, typer.Option("--size", min=28, help="Image width and height in pixels.")] = 112,
) -> None:
    """Write a deterministic synthetic shapes dataset (train.jsonl, val.jsonl, images/*.png)."""
    from coordexp.runtime.toy.synthetic import write_synthetic_dataset

    dataset = write_synthetic_dataset(directory, n_train=n_train, n_val=n_val, seed=seed, image_size=(size, size))
    out.print(f"[green]✓[/green] {n_train} train / {n_val} val images: {safe(dataset.train_jsonl)}, "
               f"{safe(dataset.val_jsonl)}")


def register(app: typer.Typer) -> None:
    """Add the asset commands to ``app``."""
    app.command("make-tiny-model")(guarded(make_tiny_model))
    app.command("expand-vocab")(guarded(expand_vocab))
    app.command("make-synthetic-data")(guarded(make_synthetic_data))
