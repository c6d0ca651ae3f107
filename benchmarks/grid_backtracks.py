"""Add the reading-order backtrack figures to a grid run's summary.json from its evaluation folders.

``backtracks_per_image`` and ``backtrack_recovery_rate`` (coordexp/runtime/toy/probes.py) came after the first grid
seeds ran; every arm's written predictions are in ``WORKDIR/seed<S>/eval_<arm>/predictions.jsonl``, so they are
computed from those (the same function the bench now calls) and the summary is then re-printed:

    python benchmarks/grid_backtracks.py RUN/summary.json && python benchmarks/bench_learning.py --report RUN/summary.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coordexp.runtime.core.objects import DetObject  # noqa: E402
from coordexp.runtime.model.data import load_records  # noqa: E402
from coordexp.runtime.toy.probes import aggregate_figures, image_figures  # noqa: E402

KEYS = ("backtracks_per_image", "backtrack_recovery_rate")


def arm_figures(eval_dir: Path, val_jsonl: Path) -> dict[str, float | None]:
    records = load_records(val_jsonl, None)
    lines = [json.loads(line) for line in (eval_dir / "predictions.jsonl").read_text(encoding="utf-8").splitlines()]
    if len(lines) != len(records):
        raise SystemExit(f"{eval_dir}: {len(lines)} prediction lines for {len(records)} records")
    images = []
    for line, record in zip(lines, records):
        preds = [DetObject(o["desc"], "bbox_2d", tuple(o["bbox_2d"])) for o in line["objects"] if "bbox_2d" in o]
        images.append(image_figures(preds, record.objects, eos_stopped=True))
    figures = aggregate_figures(images)
    return {k: figures[k] for k in KEYS}


def main(summary_path: Path) -> None:
    saved = json.loads(summary_path.read_text(encoding="utf-8"))
    root = summary_path.parent
    for seed in saved["seeds"]:
        work = root / f"seed{seed['seed']}"
        for name, run in seed["runs"].items():
            run["eval"].update(arm_figures(work / f"eval_{name}", work / "data" / "val.jsonl"))
            print(f"seed {seed['seed']} {name}: " + ", ".join(f"{k} {run['eval'][k]:.3f}" for k in KEYS))
    summary_path.write_text(json.dumps(saved, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    for path in sys.argv[1:]:
        main(Path(path))
