"""The run's model card: ``OUTPUT_DIR/README.md``, written at the end of training for full and LoRA runs (issue 55).

A LoRA run folder held PEFT's empty template ("Model Card for Model ID", "[More Information Needed]") and a full run
none. The card says what a reader of the folder needs: the model training started from, the data, the steps, the
stage and objective, the last evaluation's figures and the command that trains it again. It carries
:data:`MODEL_CARD_MARK`; a ``README.md`` without the mark that is not PEFT's template is the user's and is never
replaced (:func:`card_owner`); a save that changed it (PEFT updates any README it finds) is undone
(:func:`kept_user_card` / :func:`restore_user_card`). Standard library only; written through
:func:`~coordexp.runtime.train.run_folder.write_result_file` (atomic).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Mapping, Optional

from coordexp.runtime.train.run_folder import write_result_file

__all__ = ["MODEL_CARD_NAME", "MODEL_CARD_MARK", "card_owner", "render_model_card", "write_model_card",
           "kept_user_card", "restore_user_card"]

MODEL_CARD_NAME = "README.md"
MODEL_CARD_MARK = "<!-- coordexp model card: written by `coordexp train` at the end of the run; rewritten by it -->"
"""The line that makes a ``README.md`` coordexp's own to rewrite; without it (and not PEFT's template) it is the
user's."""
_PEFT_TEMPLATE = ("# Model Card for Model ID", "library_name: peft")
"""Both in every card PEFT writes from huggingface_hub's default template (the heading keeps the placeholder)."""
_PEEK_BYTES = 1 << 20  # a card is a few KiB; a larger README is a user's document


def card_owner(folder: str | Path) -> Literal["none", "coordexp", "peft", "user"]:
    """Who wrote ``folder/README.md``: nobody (absent), coordexp (the mark), PEFT (its empty template) or the user
    (anything else: a link, a folder, an unreadable or large file included, so it is left alone)."""
    path = Path(folder) / MODEL_CARD_NAME
    if not path.exists() and not path.is_symlink():
        return "none"
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > _PEEK_BYTES:
            return "user"
        text = path.read_bytes().decode("utf-8", "replace")
    except OSError:
        return "user"
    if MODEL_CARD_MARK in text:
        return "coordexp"
    return "peft" if all(mark in text for mark in _PEFT_TEMPLATE) else "user"


def kept_user_card(folder: str | Path) -> Optional[bytes]:
    """The bytes of the user's ``README.md`` in ``folder`` before a save (None when there is none to keep)."""
    if card_owner(folder) != "user":
        return None
    path = Path(folder) / MODEL_CARD_NAME
    try:
        return None if path.is_symlink() or not path.is_file() else path.read_bytes()
    except OSError:
        return None


def restore_user_card(folder: str | Path, kept: Optional[bytes]) -> bool:
    """Put the user's ``README.md`` back as it was when a save (PEFT's ``save_pretrained``) changed it; True when it
    had to."""
    if kept is None:
        return False
    path = Path(folder) / MODEL_CARD_NAME
    try:
        if path.read_bytes() == kept:
            return False
    except OSError:
        pass
    write_result_file(path, kept)
    return True


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * float(value):.1f}%"


def _code(value: Any) -> str:
    return "`" + str(value).replace("`", "'").replace("\n", " ") + "`"


def _stage(run: Any) -> str:
    if run.trainer_variant == "stage1_sft":
        return "stage 1 (`stage1_sft`): teacher-forced SFT on the ground-truth answers"
    rollout = run.rollout_matching
    modules = ", ".join(f"{m.name} (weight {m.weight:g})" for m in rollout.pipeline.objective if m.enabled)
    objective = ("the reward objective (policy gradient, rewards from the matching)" if rollout.objective == "reward"
                 else "rollout-matching SFT")
    return (f"stage 2 (`stage2_rollout_aligned`): {objective}; loss modules {modules or '-'}; "
            f"{100 * rollout.gt_step_share:.0f}% of the optimizer steps on the ground truth")


def _weights(run: Any) -> str:
    tuner = run.tuner
    if tuner.train_type != "lora":
        return "full fine-tune: this folder is a complete checkpoint (usable as `model.path`)"
    kind = "DoRA" if tuner.use_dora else "LoRA"
    return (f"{kind} adapter (r {tuner.lora_rank}, alpha {tuner.lora_alpha:g}) on the base model; "
            "`coordexp export-merged OUTPUT_DIR MERGED` writes a complete checkpoint")


def render_model_card(run: Any, summary: Mapping[str, Any], *, command: str) -> str:
    """The card's Markdown: Hub metadata, the run's facts, the last evaluation, the command that trains it again.
    ``summary`` is :func:`coordexp.runtime.train.progress.summarize_history`'s (plus ``global_step``)."""
    data = run.data
    lora = run.tuner.train_type == "lora"
    steps = summary.get("global_step", summary.get("steps"))
    rows = [("base model", _code(run.model.path) + " (`model.path`: the model this run started from)"),
            ("weights", _weights(run)),
            ("stage", _stage(run)),
            ("training data", _code(data.train_jsonl)),
            ("validation data", "-" if data.val_jsonl is None else _code(data.val_jsonl)),
            ("images", "-" if data.image_root is None else _code(data.image_root)),
            ("steps", f"{steps} (training.max_steps {run.training.max_steps})"),
            ("final training loss", "-" if summary.get("final_loss") is None else f"{summary['final_loss']:.4f}")]
    lines = ["---", f"base_model: {json.dumps(str(run.model.path))}",
             f"library_name: {'peft' if lora else 'transformers'}",
             "tags:", "- coordexp", "- object-detection", f"- {run.trainer_variant}", "---", MODEL_CARD_MARK, "",
             f"# {Path(run.training.output_dir).name}", "",
             "A Qwen-VL detector trained with coordexp: it answers an image with one JSON object whose boxes are the "
             "coordinate tokens `<|coord_0|>`..`<|coord_999|>`.", "",
             "| | |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows), ""]
    last = summary.get("last_eval")
    if last:
        lines += [f"## Last evaluation (step {last['step']}, during training)", "",
                  "| AP50 | precision | recall | F1 | parse valid | match |", "|---|---|---|---|---|---|",
                  "| " + " | ".join(_pct(last.get(key)) for key in ("AP50", "precision", "recall", "f1",
                                                                    "parse_valid_rate", "match_rate")) + " |", "",
                  "Precision, recall and F1 are class-aware at box IoU 0.5; `coordexp eval CONFIG` gives COCO AP.", ""]
    else:
        lines += ["## Evaluation", "", "None ran during training: `coordexp eval CONFIG` evaluates this folder.", ""]
    lines += ["## Train it again", "", "```bash", command, "```", "",
              "`coordexp_config.yaml` beside this file is the run record: the keys the run was given, paths absolute.",
              ""]
    return "\n".join(lines)


def write_model_card(output_dir: str | Path, run: Any, summary: Mapping[str, Any], *,
                     command: str) -> tuple[Path, bool]:
    """``OUTPUT_DIR/README.md`` written (atomically) unless the user wrote that file: ``(path, written)``."""
    path = Path(output_dir) / MODEL_CARD_NAME
    if card_owner(output_dir) == "user":
        return path, False
    write_result_file(path, render_model_card(run, summary, command=command).encode("utf-8"))
    return path, True
