"""Rollout logs and the PNGs a person looks at: GT, matched predictions, false positives and false negatives.

Training writes one JSON line per logged rollout (``RolloutLogEntry``) to ``<output_dir>/rollouts.jsonl``;
``coordexp show-rollouts RUN_DIR`` renders them. Coordinates are norm1000 bins mapped onto the image's pixels.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from coordexp.runtime.model.data import open_image, upright
from coordexp.runtime.train.run_folder import save_image
from coordexp.runtime.core.objects import DetObject

__all__ = ["RolloutLogEntry", "bounded_text", "RAW_TEXT_CHARS", "append_rollout_log", "read_rollout_log", "render_rollout", "render_rollout_log", "COLOURS",
           "shown_step", "caption_lines"]

ROLLOUT_LOG_NAME = "rollouts.jsonl"
RAW_TEXT_CHARS = 4000  # a degenerate 512-token answer fits; a longer one is cut (its token count is kept)
# Colour-blind-safe-ish palette: GT green, matched prediction blue, FP red, FN (unmatched GT) orange.
COLOURS = {"gt": (0, 170, 80), "matched": (30, 100, 255), "fp": (230, 30, 30), "fn": (255, 150, 0)}


@dataclass(frozen=True)
class RolloutLogEntry:
    """What a logged rollout needs to be drawn and audited later (no IoU value: matching uses it internally only)."""

    step: int
    image: str
    gt: tuple[DetObject, ...]
    predictions: tuple[DetObject, ...]  # valid parsed objects, appearance order
    pairs: tuple[tuple[int, int], ...]  # (prediction index, gt index)
    text: str = ""  # the parsed prefix (what Y_train keeps of the rollout)
    tag: str = "train"
    extra: dict[str, Any] = field(default_factory=dict)
    raw_text: str = ""  # what the model wrote, decoded (at most RAW_TEXT_CHARS characters, then a cut marker)
    raw_tokens: int = 0  # how many tokens it wrote

    @property
    def class_mismatches(self) -> tuple[int, ...]:
        """Prediction indices matched (geometry only, as the spec's matcher) to a ground truth of another desc."""
        return tuple(p for p, g in self.pairs if self.predictions[p].desc != self.gt[g].desc)

    @property
    def fp_indices(self) -> tuple[int, ...]:
        matched = {p for p, _ in self.pairs}
        return tuple(i for i in range(len(self.predictions)) if i not in matched)

    @property
    def fn_indices(self) -> tuple[int, ...]:
        matched = {g for _, g in self.pairs}
        return tuple(i for i in range(len(self.gt)) if i not in matched)

    def to_json(self) -> str:
        payload = asdict(self)
        for key in ("gt", "predictions"):
            payload[key] = [{"desc": o.desc, o.geometry: list(o.coords)} for o in getattr(self, key)]
        return json.dumps(payload, ensure_ascii=False)

    @classmethod
    def from_json(cls, line: str) -> "RolloutLogEntry":
        raw = json.loads(line)

        def objects(items: Iterable[dict[str, Any]]) -> tuple[DetObject, ...]:
            out = []
            for item in items:
                geometry = "bbox_2d" if "bbox_2d" in item else "poly"
                out.append(DetObject(item["desc"], geometry, tuple(int(v) for v in item[geometry])))
            return tuple(out)

        return cls(
            step=int(raw["step"]),
            image=str(raw["image"]),
            gt=objects(raw["gt"]),
            predictions=objects(raw["predictions"]),
            pairs=tuple((int(p), int(g)) for p, g in raw["pairs"]),
            text=raw.get("text", ""),
            tag=raw.get("tag", "train"),
            extra=raw.get("extra", {}),
            raw_text=str(raw.get("raw_text", "")),
            raw_tokens=int(raw.get("raw_tokens", 0)),
        )


def bounded_text(text: str, limit: int = RAW_TEXT_CHARS) -> str:
    """``text`` cut to ``limit`` characters, the cut said in the text itself."""
    return text if len(text) <= limit else text[:limit] + f" ...[cut: {len(text) - limit} more characters]"


def append_rollout_log(run_dir: str | Path, entries: Sequence[RolloutLogEntry]) -> Path:
    """Append entries to ``run_dir/rollouts.jsonl`` (created on first use) and return its path."""
    path = Path(run_dir) / ROLLOUT_LOG_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as handle:
        for entry in entries:
            handle.write(entry.to_json() + "\n")
    return path


def read_rollout_log(run_dir: str | Path) -> list[RolloutLogEntry]:
    """Every entry of ``run_dir/rollouts.jsonl``; a broken line fails with its line number."""
    path = Path(run_dir) / ROLLOUT_LOG_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"no rollout log at {path}; train with rollout logging on (stage 2 writes it) or pass the run's output_dir"
        )
    entries = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entries.append(RolloutLogEntry.from_json(line))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: not a rollout log entry ({exc})") from exc
    return entries


def _pixels(obj: DetObject, width: int, height: int) -> list[tuple[float, float]]:
    return [(x * width / 1000.0, y * height / 1000.0) for x, y in obj.points()]


MIN_CANVAS_SIDE = 672  # the rendered long side at least this many pixels, so labels stay readable at a glance


def _font(size: int) -> Any:
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)  # scalable (FreeType) default font
    except (TypeError, OSError, ImportError):  # Pillow without FreeType: the fixed bitmap font
        return ImageFont.load_default()


def shown_step(entry: RolloutLogEntry) -> int:
    """The step as the progress numbers it (from 1): a training rollout is logged at the ``global_step`` before its
    optimizer step (0 for the first), an evaluation after the steps it evaluates."""
    return entry.step + 1 if entry.tag == "train" else entry.step


CAPTION_TEXT_LINES = 4  # of the model's raw text; the rest is cut with "..."


def caption_lines(entry: RolloutLogEntry, width_chars: int, scores: Sequence[float] | None = None) -> list[str]:
    """The header a PNG carries: image name, step, counts (and scores), then the raw text the model wrote."""
    mismatched = len(entry.class_mismatches)
    head = (f"{Path(entry.image).name}  {entry.tag} step {shown_step(entry)}  {len(entry.predictions)} predicted, "
            f"{len(entry.gt)} GT, {len(entry.pairs)} matched" + (f" ({mismatched} to another class)" if mismatched
                                                                  else ""))
    lines = [head]
    if scores:
        lines.append("scores: " + " ".join(f"{score:.2f}" for score in scores))
    raw = entry.raw_text or entry.text  # logs written before raw_text existed hold the parsed prefix only
    text = " ".join(raw.split()) or "(no text)"
    if entry.raw_tokens:
        text = f"({entry.raw_tokens} tokens) {text}"
    width = max(20, width_chars)
    chunks = [text[i:i + width] for i in range(0, len(text), width)]
    if len(chunks) > CAPTION_TEXT_LINES:
        chunks = chunks[:CAPTION_TEXT_LINES]
        chunks[-1] = chunks[-1][:width - 3] + "..."
    return lines + [f"text: {chunks[0]}"] + chunks[1:]


def render_rollout(entry: RolloutLogEntry, out_path: str | Path, *, scale: int | None = None,
                   scores: Sequence[float] | None = None) -> Path:
    """Draw one rollout: GT (green), matched predictions (blue), FPs (red), FNs (orange, thicker), each labelled
    with its desc (and score, when ``scores`` has one per prediction); ground truth is drawn whatever matched. A
    header names the image and step and shows the raw text the model wrote. The image is upscaled (nearest) by
    ``scale``, by default until its long side reaches :data:`MIN_CANVAS_SIDE`; fonts and lines grow with it."""
    from PIL import Image, ImageDraw

    with open_image(Path(entry.image)) as opened:
        base = upright(opened).convert("RGB")  # the frame the boxes are in (EXIF applied)
    width, height = base.size
    if scale is None:
        scale = max(1, -(-MIN_CANVAS_SIDE // max(width, height)))
    if scores is not None and len(scores) != len(entry.predictions):
        scores = None
    picture = base.resize((width * scale, height * scale), Image.NEAREST)
    font = _font(max(12, max(picture.size) // 42))
    probe = ImageDraw.Draw(picture)
    left, top, right, bottom = probe.textbbox((0, 0), "0123456789", font=font)  # a typical text character
    char_w, line_h = max(1.0, (right - left) / 10), bottom - top + 6
    header = caption_lines(entry, int((picture.width - 8) // char_w), scores)
    header_h = line_h * len(header) + 6
    canvas = Image.new("RGB", (picture.width, picture.height + header_h), (0, 0, 0))
    canvas.paste(picture, (0, header_h))
    draw = ImageDraw.Draw(canvas)
    for n, line in enumerate(header):
        draw.text((4 - left, 3 + n * line_h - top), line, fill=(255, 255, 255), font=font)
    thin = max(2, max(picture.size) // 300)
    fn = set(entry.fn_indices)
    fp = set(entry.fp_indices)

    def outline(obj: DetObject, colour: tuple[int, int, int], line_width: int, label: str, below: bool) -> None:
        points = [(x * scale, y * scale + header_h) for x, y in _pixels(obj, width, height)]
        draw.line(points + [points[0]], fill=colour, width=line_width, joint="curve")
        left, top, right, bottom = draw.textbbox((0, 0), label, font=font)
        # ground truth labelled above the shape, predictions below it (a matched pair stays readable); on canvas
        x = min(max(0.0, min(p[0] for p in points)), canvas.width - (right - left) - 4)
        if below:
            y = min(max(p[1] for p in points) + 2, canvas.height - 2 * (bottom - top) - 14)
        else:
            y = max(float(header_h), min(p[1] for p in points) - (bottom - top) - 6)
        draw.rectangle([x, y, x + right - left + 4, y + bottom - top + 4], fill=(0, 0, 0))
        draw.text((x + 2 - left, y + 2 - top), label, fill=colour, font=font)

    for i, obj in enumerate(entry.gt):
        outline(obj, COLOURS["fn"] if i in fn else COLOURS["gt"], 2 * thin if i in fn else thin,
                f"{'FN' if i in fn else 'GT'} {obj.desc}", below=False)
    other_class = {p: entry.gt[g].desc for p, g in entry.pairs if p in set(entry.class_mismatches)}
    for i, obj in enumerate(entry.predictions):
        score = "" if scores is None else f" {scores[i]:.2f}"
        wrong = f" (GT: {other_class[i]})" if i in other_class else ""
        outline(obj, COLOURS["fp"] if i in fp else COLOURS["matched"], thin,
                f"{'FP' if i in fp else 'P'} {obj.desc}{wrong}{score}", below=True)
    legend = "GT green | matched blue (class ignored) | FP red | FN orange"
    left, top, right, bottom = draw.textbbox((0, 0), legend, font=font)
    bar = bottom - top + 6
    draw.rectangle([0, canvas.height - bar, canvas.width, canvas.height], fill=(0, 0, 0))
    draw.text((3 - left, canvas.height - bar + 3 - top), legend, fill=(255, 255, 255), font=font)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_image(canvas, out)
    return out


def render_rollout_log(run_dir: str | Path, out_dir: str | Path | None = None, *, limit: int = 8) -> list[Path]:
    """Render the last ``limit`` logged rollouts of a run into ``out_dir`` (default ``run_dir/rollout_png``)."""
    entries = read_rollout_log(run_dir)[-limit:]
    target = Path(out_dir) if out_dir is not None else Path(run_dir) / "rollout_png"
    return [render_rollout(entry, target / f"{entry.tag}_step{shown_step(entry):06d}_{i:02d}.png")
            for i, entry in enumerate(entries)]
