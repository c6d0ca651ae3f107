"""``coordexp convert``: COCO / LVIS / ODVG annotations -> coordexp JSONL, and ``coordexp eval`` predictions -> a
COCO results file with the original image and category ids. Bad input exits 2 listing ``file: record: problem``
lines; the output file is written only when the whole conversion succeeded (temp file + rename).

File safety (:mod:`coordexp.cli.file_guard`): sources must be regular files (a FIFO or ``/dev/zero`` is refused,
reads are capped); ``-o`` may not be an input (also through a symlink or hard link), a device, FIFO, directory or
read-only file. Every record ``to-jsonl`` writes passes the checks ``train`` applies to data records
(``coordexp.runtime.model.data.parse_record``), so what ``convert`` accepts, ``train`` loads."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from coordexp.cli.file_guard import check_output_file, read_source_text, write_atomic
from coordexp.cli.frame import EXIT_OK, guarded, out, safe, write_result
from coordexp.errors import UserInputError

__all__ = ["register", "convert_app", "to_jsonl", "to_results"]

convert_app = typer.Typer(
    help="Convert COCO-style datasets to coordexp JSONL and coordexp predictions to COCO results.",
    no_args_is_help=True,
)


_LABEL_KEY = re.compile(r"-?[0-9]{1,20}")  # ASCII digits only: "²".isdigit() is true and int("²") raises


def _read_json(path: Path, what: str) -> Any:
    from coordexp.runtime.core.coco import load_json

    try:
        return load_json(read_source_text(path, what))
    except ValueError as exc:
        raise UserInputError(f"{path}: not valid JSON ({str(exc)[:200]})") from None


def _jsonl_lines(path: Path, what: str) -> list[str]:
    """The lines of a JSONL file split on ``\n`` only, as ``train`` reads them (U+2028 inside a string is text)."""
    return [line.rstrip("\r") for line in read_source_text(path, what).split("\n")]


def _label_map(path: Path) -> dict[Any, str]:
    """``--label-map``: a JSON object {label: name}; integer-looking keys become ints (ODVG labels are ints)."""
    raw = _read_json(path, "--label-map")
    if not isinstance(raw, dict):
        raise UserInputError(f"{path}: top level: expected a JSON object {{label: name}}")
    problems = [f"{path}: key {ascii(k)[:60]}: expected a non-empty category name, got {type(v).__name__}"
                for k, v in raw.items() if not isinstance(v, str) or not v.strip()]
    if problems:
        from coordexp.runtime.core.coco import ConversionError

        raise ConversionError(problems[:10], len(problems), hint="fix the label map; nothing was written")
    return {int(k) if _LABEL_KEY.fullmatch(k) else k: v for k, v in raw.items()}


def _check_records(records: list[dict[str, Any]], origins: list[str], source: Path, folder: Path) -> str:
    """Every record as ``train`` would read it, then the JSONL text; a record ``train`` would refuse is a ``file:
    record: problem`` line here instead of a file that fails later. A record whose images are already in place
    (relative to ``folder``, the JSONL's) has them opened too: its width/height must be the image as displayed
    (EXIF orientation applied); images not found yet are reported as missing, not refused."""
    from coordexp.runtime.core.coco import MAX_REPORTED_PROBLEMS, ConversionError
    from coordexp.runtime.model.data import DatasetError, parse_record, size_mismatch

    if not records:
        raise UserInputError(f"{source}: holds no image to convert (train refuses an empty file)",
                             hint="check that this is the dataset you meant; nothing was written")
    problems: list[str] = []
    total = 0
    for index, record in enumerate(records):
        where = origins[index] if index < len(origins) else f"record {index}"
        try:
            in_place = _images_in_place(record, folder)
            parsed = parse_record(record, image_root=folder, source=f"{source}: {where}", check_files=in_place)
            mismatch = size_mismatch(parsed.image_paths[0], parsed.width, parsed.height) if in_place else None
            if mismatch is not None:
                total += 1
                if len(problems) < MAX_REPORTED_PROBLEMS:
                    problems.append(f"{source}: {where}: images[0]: {mismatch}")
        except DatasetError as exc:
            total += 1
            if len(problems) < MAX_REPORTED_PROBLEMS:
                problems.extend(exc.problems)
    if total:
        raise ConversionError(problems, total, hint="train would refuse these records; fix the source (nothing "
                                                    "was written)")
    return "".join(json.dumps(r, separators=(", ", ": ")) + "\n" for r in records)


def _images_in_place(record: Any, folder: Path) -> bool:
    """Whether every image the record names is a file relative to ``folder`` (a name no file system takes: no)."""
    names = record.get("images") if isinstance(record, dict) else None
    if not isinstance(names, list) or not names:
        return False
    try:
        return all(isinstance(n, str) and "\x00" not in n and (folder / n).is_file() for n in names)
    except (OSError, ValueError):
        return False


def _report(as_json: bool, payload: dict[str, Any], lines: list[str]) -> None:
    if as_json:
        write_result(json.dumps({"ok": True, **payload}, indent=2) + "\n")
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
    crowd annotations are kept as ignore regions (never trained; COCO AP ignores detections on them), RLE ones are
    skipped and counted."""
    from coordexp.runtime.core.coco import coco_to_records, odvg_to_records

    if fmt not in ("auto", "coco", "lvis", "odvg"):
        raise UserInputError(f"--format must be auto, coco, lvis or odvg, got {fmt!r}")
    if geometry not in ("poly", "bbox"):
        raise UserInputError(f"--geometry must be poly or bbox, got {geometry!r}")
    kind = ("odvg" if source.suffix == ".jsonl" else "coco") if fmt == "auto" else fmt
    target = check_output_file(output, [source, label_map] if label_map is not None else [source])
    if kind == "odvg":
        labels = _label_map(label_map) if label_map is not None else None
        converted = odvg_to_records(_jsonl_lines(source, "source"), source=str(source), image_prefix=image_prefix,
                                    label_map=labels)
    else:
        converted = coco_to_records(_read_json(source, "source"), source=str(source), image_prefix=image_prefix,
                                    geometry=geometry)  # type: ignore[arg-type]
    text = _check_records(converted.records, converted.origins, source, output.parent)
    write_atomic(target, text.encode("utf-8"))
    skipped = ", ".join(f"{n} {why}" for why, n in sorted(converted.skipped.items())) or "none"
    as_box = ", ".join(f"{n} {why}" for why, n in sorted(converted.as_box.items())) or "none"
    missing = missing_images(converted.records, output.parent)
    _report(as_json, {"output": str(output), "images": len(converted.records), "objects": converted.n_objects,
                      "categories": converted.categories, "skipped": dict(converted.skipped),
                      "as_box": dict(converted.as_box), "crowd_regions": converted.crowd_regions,
                      "missing_images": len(missing)}, [
        f"[green]✓[/green] {safe(output)}: {len(converted.records)} images, {converted.n_objects} objects, "
        f"{len(converted.categories)} categories",
        f"  skipped: {safe(skipped)}; polygons written as boxes: {safe(as_box)}; crowd regions kept as COCO "
        f"ignores: {converted.crowd_regions}",
    ] + ([f"  [yellow]! not found[/yellow] {len(missing)} of {len(converted.records)} images next to {safe(output)} "
          f"(e.g. {safe(missing[0])}); records name images relative to the JSONL file: pass the --image-prefix that "
          "leads there from it, or set data.image_root to the image folder"] if missing else []))


def missing_images(records: list[dict[str, Any]], folder: Path, limit: int = 100_000) -> list[str]:
    """Image paths of ``records`` (relative to ``folder``, the JSONL's) that are not files (the first ``limit``
    records are looked at: a stat each)."""
    names = (name for record in records[:limit] for name in record.get("images", []))
    return [name for name in names if not (folder / name).is_file()]


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

    target = check_output_file(output, [predictions, gt])
    document = _read_json(gt, "--gt")
    if not isinstance(document, dict):
        raise UserInputError(f"{gt}: top level: expected a COCO instances object")
    results, left_out = predictions_to_coco_results(_jsonl_lines(predictions, "predictions"), document,
                                                    source=str(predictions), gt_source=str(gt))
    write_atomic(target, (json.dumps(results, allow_nan=False) + "\n").encode("utf-8"))
    lines = [f"[green]✓[/green] {safe(output)}: {len(results)} detections"]
    if left_out:
        lines.append(f"  left out: {sum(left_out.values())} predictions whose desc is no category of {safe(gt)}")
    _report(as_json, {"output": str(output), "detections": len(results), "left_out": dict(left_out)}, lines)


def register(app: typer.Typer) -> None:
    """Add ``convert to-jsonl`` and ``convert to-results`` to ``app``."""
    app.add_typer(convert_app, name="convert")

