"""``coordexp convert``: COCO / LVIS / ODVG annotations -> coordexp JSONL, and ``coordexp eval`` predictions -> a
COCO results file with the original image and category ids. Bad input exits 2 listing ``file: record: problem``
lines; the output file is written only when the whole conversion succeeded (temp file + rename)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from coordexp.cli.frame import EXIT_OK, guarded, out, safe
from coordexp.errors import UserInputError

__all__ = ["register", "convert_app", "to_jsonl", "to_results"]

convert_app = typer.Typer(
    help="Convert COCO-style datasets to coordexp JSONL and coordexp predictions to COCO results.",
    no_args_is_help=True,
)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserInputError(f"{path}: cannot read ({exc})") from None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(_read_text(path))
    except ValueError as exc:
        raise UserInputError(f"{path}: not valid JSON ({exc})") from None


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _report(as_json: bool, payload: dict[str, Any], lines: list[str]) -> None:
    if as_json:
        sys.stdout.write(json.dumps({"ok": True, **payload}, indent=2) + "\n")
    else:
        for line in lines:
            out.print(line)
    raise typer.Exit(EXIT_OK)


@convert_app.command("to-jsonl")
@guarded
def to_jsonl(
    source: Annotated[Path, typer.Argument(help="COCO/LVIS instances JSON, or ODVG JSONL.", show_default=False)],
    output: Annotated[Path, typer.Option("--output", "-o", help="The coordexp JSONL to write.", show_default=False)],
    fmt: Annotated[str, typer.Option("--format", help="auto (by extension: .jsonl is ODVG), coco, lvis or odvg.")]
    = "auto",
    image_prefix: Annotated[str, typer.Option(
        "--image-prefix", help="Prepended to every file name (paths resolve against data.image_root).")] = "",
    geometry: Annotated[str, typer.Option(
        "--geometry", help="poly: single-part polygon segmentations stay polygons; bbox: every object a box.")]
    = "poly",
    label_map: Annotated[Optional[Path], typer.Option(
        "--label-map", help="ODVG: JSON {label: name} for instances without a category.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON on stdout.")] = False,
) -> None:
    """Pixel boxes and polygons -> norm1000 bins with each image's width/height, category ids -> desc names;
    crowd and RLE annotations are skipped and counted."""
    from coordexp.runtime.core.coco import coco_to_records, odvg_to_records

    if fmt not in ("auto", "coco", "lvis", "odvg"):
        raise UserInputError(f"--format must be auto, coco, lvis or odvg, got {fmt!r}")
    if geometry not in ("poly", "bbox"):
        raise UserInputError(f"--geometry must be poly or bbox, got {geometry!r}")
    kind = ("odvg" if source.suffix == ".jsonl" else "coco") if fmt == "auto" else fmt
    if kind == "odvg":
        labels = None
        if label_map is not None:
            raw = _read_json(label_map)
            if not isinstance(raw, dict):
                raise UserInputError(f"{label_map}: expected a JSON object {{label: name}}")
            labels = {int(k) if str(k).lstrip("-").isdigit() else k: v for k, v in raw.items()}
        converted = odvg_to_records(_read_text(source).splitlines(), source=str(source), image_prefix=image_prefix,
                                    label_map=labels)
    else:
        converted = coco_to_records(_read_json(source), source=str(source), image_prefix=image_prefix,
                                    geometry=geometry)  # type: ignore[arg-type]
    _write_atomic(output, "".join(json.dumps(r, separators=(", ", ": ")) + "\n" for r in converted.records))
    skipped = ", ".join(f"{n} {why}" for why, n in sorted(converted.skipped.items())) or "none"
    as_box = ", ".join(f"{n} {why}" for why, n in sorted(converted.as_box.items())) or "none"
    _report(as_json, {"output": str(output), "images": len(converted.records), "objects": converted.n_objects,
                      "categories": converted.categories, "skipped": dict(converted.skipped),
                      "as_box": dict(converted.as_box)}, [
        f"[green]✓[/green] {safe(output)}: {len(converted.records)} images, {converted.n_objects} objects, "
        f"{len(converted.categories)} categories",
        f"  skipped: {safe(skipped)}; polygons written as boxes: {safe(as_box)}",
    ])


@convert_app.command("to-results")
@guarded
def to_results(
    predictions: Annotated[Path, typer.Argument(help="predictions.jsonl written by `coordexp eval`.",
                                                show_default=False)],
    gt: Annotated[Path, typer.Option("--gt", help="The original COCO instances JSON (ids come from it).",
                                     show_default=False)],
    output: Annotated[Path, typer.Option("--output", "-o", help="The COCO results JSON to write.",
                                         show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON on stdout.")] = False,
) -> None:
    """Our predictions (norm1000 bins) -> COCO results in pixels, with the ground truth's image and category ids
    (images matched by file name, descs by category name; unknown descs are left out and counted)."""
    from coordexp.runtime.core.coco import predictions_to_coco_results

    document = _read_json(gt)
    if not isinstance(document, dict):
        raise UserInputError(f"{gt}: expected a COCO instances object")
    results, left_out = predictions_to_coco_results(_read_text(predictions).splitlines(), document,
                                                    source=str(predictions), gt_source=str(gt))
    _write_atomic(output, json.dumps(results) + "\n")
    lines = [f"[green]✓[/green] {safe(output)}: {len(results)} detections"]
    if left_out:
        lines.append(f"  left out: {sum(left_out.values())} predictions whose desc is no category of {safe(gt)}")
    _report(as_json, {"output": str(output), "detections": len(results), "left_out": dict(left_out)}, lines)


def register(app: typer.Typer) -> None:
    """Add ``convert to-jsonl`` and ``convert to-results`` to ``app``."""
    app.add_typer(convert_app, name="convert")

