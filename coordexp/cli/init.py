"""``coordexp init``: write a complete, commented, self-contained starting config for a model, a dataset, a stage and
the hardware, so a first run needs no copying of examples.

Every key's comment is its schema field's own description and every value not chosen here is the schema's default,
read when the file is written, so the generated file cannot drift from the schema. The values chosen here are the
documented recipes: stage 1 as the examples train it, stage 2 as measured (docs/design.md, decision 15; greedy by
coordinate group: decision 16): ground-truth steps on half the optimizer steps, the prefix cut after the last match.
"""

from __future__ import annotations

import importlib.util
import os
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, get_args

import typer
import yaml
from pydantic import BaseModel

from coordexp.cli.frame import fail, guarded, out, safe
from coordexp.schema.root import CoordExpConfig

__all__ = ["InitChoices", "register", "render_config", "init_config", "STAGE1_LR", "STAGE2_LR", "PRETRAINED_BYTES",
           "weight_bytes"]

WIDTH = 120
STAGE1_LR = {"cpu": 1.0e-3, "gpu": 1.0e-5}
"""Stage-1 peak rates: 1e-3 is what a tiny random model needs to learn where shapes are (decision 10); 1e-5 is the
usual full fine-tuning rate of a pretrained Qwen-VL."""
STAGE2_LR = {"cpu": 2.0e-5, "gpu": 2.0e-6}
"""Stage 2 continues at a small fraction of stage 1's rate: a fiftieth was measured on the tiny model (decision 15),
upstream's Qwen-VL recipe runs a tenth."""
PRETRAINED_BYTES = 200 * 2**20
"""Weights this large are a pretrained model (the smallest Qwen-VL is ~4 GB; the tiny model ~5 MB): init writes
the pretrained rates (STAGE1_LR["gpu"], STAGE2_LR["gpu"]) for it on --device cpu too."""
COORD_PROBE = "<|coord_999|>"
TOKENIZER_FILES = ("tokenizer.json", "added_tokens.json", "tokenizer_config.json", "vocab.json")


class _Default:
    """A value left to the schema's default (read from the field when the file is rendered)."""


DEFAULT = _Default()


@dataclass(frozen=True)
class InitChoices:
    """What ``coordexp init`` was asked for; paths are written into the YAML as given (relative to the file)."""

    model: str
    train_jsonl: str
    val_jsonl: str | None
    output_dir: str
    stage: int
    device: str
    family: str
    attn_implementation: str = "sdpa"
    pretrained: bool = False  # a real (pretrained-size) model: its learning rate whatever the device
    objective: str = "sft"  # stage 2: rollout-matching SFT, or the reward objective (docs/design.md, decision 19)


def weight_bytes(model: Path) -> int:
    """Bytes of the checkpoint's weight files (sizes only, nothing read; an adapter folder counts its adapter)."""
    try:
        return sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin") for f in model.glob(pattern))
    except OSError:
        return 0


def _pipeline(stage2: bool) -> list[dict[str, Any]]:
    """The loss modules (the schema has no default for them, decision 5): token CE plus the coordinate losses; stage
    2 also supervises appended FN descs and the matched prefix's structure (the recipe of decision 15)."""
    weight = 1.0 if stage2 else 0.0
    return [
        {"name": "token_ce", "enabled": True, "weight": 1.0, "channels": ["B"],
         "config": {"rollout_fn_desc_weight": weight, "rollout_matched_prefix_struct_weight": weight}},
        {"name": "coord_reg", "enabled": True, "weight": 1.0, "channels": ["B"],
         "config": {"coord_ce_weight": 0.0, "soft_ce_weight": 1.0, "w1_weight": 1.0, "coord_gate_weight": 1.0,
                    "text_gate_weight": 0.0, "temperature": 1.0, "target_sigma": 2.0, "target_truncate": None}},
    ]


def _plan(c: InitChoices) -> dict[str, Any]:
    """The config as ``{key: (value, why) | DEFAULT | {nested}}`` in the order it is written; ``why`` (may be empty)
    joins the schema's description in the key's comment."""
    cpu, stage2 = c.device == "cpu", c.stage == 2
    evaluates = c.val_jsonl is not None
    if stage2:
        backend = ("hf", "HF generate() with the training model: the CPU backend") if cpu else (
            "vllm", "vLLM colocated on the training GPU, weights pushed in memory after every optimizer step")
    else:
        backend = ("hf", "stage 1 rolls out only to evaluate (training.eval_steps); HF generate() needs no extra "
                   "GPU memory")
    rollout: dict[str, Any] = {
        "rollout_backend": backend,
        "decode_batch_size": (2 if cpu else 8, "prompts per generate call"),
        "max_new_tokens": DEFAULT,
        "decoding": {"temperature": DEFAULT, "coord_group_greedy": (True, "")},
        "repeat_terminate": {"enabled": (True, "stop degenerate rollouts early"), "min_new_tokens": DEFAULT,
                             "max_object_keys": (200, "at least twice the most objects an image of yours holds")},
    }
    if stage2:
        rollout["gt_step_share"] = (0.5, "the recipe: every other optimizer step")
        rollout["trailing_unmatched"] = ("drop", "the recipe")
        rollout["fn_placement"] = ("append", "the recipe's: reading_order is no better beyond noise (decision 18)")
        rollout["repeats"] = ("neutral", "the recipe's: drop and unlikelihood are no better beyond noise (decision 18)")
        if not cpu:
            rollout["vllm"] = {
                "mode": ("colocate", "'server' talks to `coordexp serve-rollout` on other GPUs (README: launch recipes)"),
                "gpu_memory_utilization": (0.3, "the GPU share vLLM takes next to training"),
                "tensor_parallel_size": (1, "one GPU; under torchrun set it to the GPUs each engine spans"),
                "max_model_len": DEFAULT,
                "sleep_level": DEFAULT,
                "sync": {"mode": DEFAULT, "fallback_to_full": DEFAULT},
            }
    if stage2 and c.objective == "reward":
        _reward_plan(rollout)
    rollout["pipeline"] = ({"objective": _pipeline(stage2), "diagnostics": []}, "docs/design.md, decision 5")
    training = {
        "output_dir": (c.output_dir, "the run folder: checkpoints, logs, the final model (stage 2's model.path)"),
        "per_device_train_batch_size": (2 if cpu else 4, ""),
        "gradient_accumulation_steps": (1 if cpu else 4, ""),
        "max_steps": ((100 if cpu else 1000) if stage2 else (500 if cpu else 5000), "change to fit your data"),
        "learning_rate": ((STAGE2_LR if stage2 else STAGE1_LR)["gpu" if c.pretrained else c.device],
                          "stage 2 runs at a small fraction of stage 1's rate (decision 15)" if stage2 else
                          "a pretrained model's rate (the tiny model's 1e-3 would wreck it)" if cpu and c.pretrained
                          else ""),
        "lr_scheduler_type": ("constant" if stage2 else "cosine", ""),
        "warmup_ratio": (0.0 if stage2 else 0.05, ""),
        "seed": DEFAULT,
        "logging_steps": (5 if cpu else 10, ""),
        "save_steps": (100 if cpu else 500, ""),
        "save_total_limit": (2, "keep the newest checkpoints only"),
        "eval_steps": ((50 if cpu else 500) if evaluates else None,
                       "COCO AP of data.val_jsonl's rollouts" if evaluates else "set with data.val_jsonl"),
        "packing": (stage2, "stage 2 packs its post-rollout targets into rows of global_max_length"
                    if stage2 else ""),
        "report_to": DEFAULT,
    }
    if stage2:
        training["packing_buffer"] = (64, "")
        training["packing_min_fill_ratio"] = (0.1, "below it the run says once what would fill the rows")
    return {
        "global_max_length": (4096, "token cap of one sample: prompt with image tokens + answer (+ rollout in "
                              "stage 2)"),
        "model": {
            "path": (c.model, f"a {c.family} checkpoint with the coord tokens"
                     + (" (stage 1's output_dir)" if stage2 else "")),
            "dtype": ("float32" if cpu else "bfloat16", ""),
            "attn_implementation": (c.attn_implementation, "CPU" if cpu else "flash_attention_2 needs the flash-attn "
                                    "package; sdpa works everywhere"),
            "gradient_checkpointing": DEFAULT,
        },
        "template": {"system_prompt": DEFAULT, "user_prompt": DEFAULT,
                     "max_pixels": (200704, "a CPU-sized image budget") if cpu else DEFAULT, "min_pixels": DEFAULT},
        "data": {"train_jsonl": (c.train_jsonl, "from `coordexp convert to-jsonl`"),
                 "val_jsonl": (c.val_jsonl, ""), "image_root": DEFAULT, "object_order": DEFAULT},
        "custom": {"trainer_variant": ("stage2_rollout_aligned" if stage2 else "stage1_sft", ""),
                   "object_field_order": DEFAULT},
        "tuner": {"train_type": DEFAULT, "freeze_llm": DEFAULT, "freeze_vit": DEFAULT, "freeze_aligner": DEFAULT},
        "training": training,
        "rollout_matching": rollout,
    }


def _reward_plan(rollout: dict[str, Any]) -> None:
    """The reward objective's keys (docs/design.md, decision 19): the policy's own distribution is sampled, every
    reward setting is written out at its default, and the SFT keys above stay for the ground-truth steps and
    reward.sft_weight."""
    rollout["objective"] = ("reward", "")
    rollout["decoding"] = {"temperature": (1.0, "the reward objective samples the policy's own distribution"),
                           "top_p": DEFAULT, "top_k": DEFAULT,
                           "coord_group_greedy": (False, "greedy decoding only; the reward objective samples")}
    rollout["gt_step_share"] = (0.5, "the ground-truth steps anchor the policy to the SFT target")
    rollout["reward"] = {key: DEFAULT for key in ("group_size", "include_greedy", "credit", "iou_threshold",
                                                  "class_aware", "duplicate_penalty", "spurious_penalty",
                                                  "stop_penalty", "close_bonus", "cutoff_penalty",
                                                  "baseline_closing", "scale_by_std", "sft_weight", "kl_weight")}


SECTION_NOTES = {
    "model": "The checkpoint to train and how to load it.",
    "template": "The prompt around each image and the image-resolution budget.",
    "data": "JSONL records (norm1000 coordinates); relative paths resolve against this file's folder.",
    "custom": "Which trainer runs: stage1_sft (teacher-forced SFT) or stage2_rollout_aligned (rollout matching).",
    "tuner": "What trains (ms-swift's names): full fine-tuning by default, train_type: lora for adapters.",
    "training": "Hugging Face TrainingArguments (every field of the installed transformers) plus coordexp's own.",
    "rollout_matching": "Rollouts, decoding, matching and the losses (stage 2 trains on rollouts; stage 1 rolls out "
                        "only to evaluate).",
}


def _field_model(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds (through ``Optional``), or None for a scalar."""
    candidates = [annotation, *get_args(annotation)]
    return next((t for t in candidates if isinstance(t, type) and issubclass(t, BaseModel)), None)


def _dump_value(key: str, value: Any, width: int) -> list[str]:
    """``key: value`` as YAML lines: scalars inline, collections as blocks whose innermost lists and maps are flows."""
    options = {"sort_keys": False, "width": width, "allow_unicode": True}
    if isinstance(value, (dict, list)) and value:
        body = yaml.safe_dump(value, default_flow_style=None, **options).rstrip("\n").splitlines()
        return [f"{key}:", *("  " + line for line in body)]
    return yaml.safe_dump({key: value}, default_flow_style=False, **options).rstrip("\n").splitlines()


def _comment(lines: list[str], indent: str, text: str) -> None:
    if text:
        lines.extend(textwrap.wrap(text, WIDTH - len(indent), initial_indent=indent + "# ",
                                   subsequent_indent=indent + "# ", break_on_hyphens=False))


def _render(model: type[BaseModel], plan: dict[str, Any], depth: int, lines: list[str]) -> None:
    indent = "  " * depth
    for key, value in plan.items():
        field = model.model_fields[key]
        nested = _field_model(field.annotation)
        if isinstance(value, dict) and nested is not None:
            if depth == 0:
                lines.append("")
                _comment(lines, indent, SECTION_NOTES.get(key, ""))
            lines.append(f"{indent}{key}:")
            _render(nested, value, depth + 1, lines)
            continue
        chosen, why = (field.get_default(call_default_factory=True), "") if value is DEFAULT else value
        if isinstance(chosen, BaseModel):
            chosen = chosen.model_dump(mode="json")
        described = (field.description or "").rstrip(".")
        _comment(lines, indent, "; ".join(part for part in (described, why) if part) + ("." if described or why
                                                                                         else ""))
        lines.extend(indent + line for line in _dump_value(key, chosen, WIDTH - len(indent) - 24))


def render_config(choices: InitChoices) -> str:
    """The commented YAML of ``choices`` (self-contained: no ``extends``)."""
    objective = "the reward objective" if choices.objective == "reward" else "rollout-matching SFT"
    stage = f"stage 2 ({objective})" if choices.stage == 2 else "stage 1 (SFT on the ground truth)"
    lines = [f"# coordexp {stage} for a {choices.family} model on {choices.device.upper()}; written by `coordexp "
             "init`.", "# Check it with `coordexp validate` and `coordexp preflight`, train it with `coordexp train`. "
             "Every key is", "# documented by `coordexp schema`; keys left out take the schema's defaults."]
    _render(CoordExpConfig, _plan(choices), 0, lines)
    return "\n".join(lines) + "\n"


def _family(model: Path) -> str:
    """The checkpoint's ``model_type`` (an adapter folder: its base's), refused unless coordexp trains it."""
    from coordexp.runtime.model.adapters import adapter_base, is_adapter_dir
    from coordexp.runtime.model.policy import checkpoint_family

    if is_adapter_dir(str(model)):
        return checkpoint_family(adapter_base(str(model)))
    return checkpoint_family(model)


_MAX_TOKENIZER_BYTES = 64 * 2**20  # a tokenizer.json is a few MiB (the bound checkpoint_files reads JSON with)


def _has_coord_tokens(model: Path) -> bool:
    """Whether a tokenizer file names the coord tokens; read bounded (a FIFO, device or huge file is skipped)."""
    from coordexp.cli.file_guard import read_source_bytes
    from coordexp.errors import UserInputError

    for name in TOKENIZER_FILES:
        if not (model / name).exists():
            continue
        try:
            if COORD_PROBE.encode() in read_source_bytes(model / name, "tokenizer", max_bytes=_MAX_TOKENIZER_BYTES):
                return True
        except UserInputError:
            continue
    return False


def _utf8_paths(**paths: Path | None) -> None:
    """Every path the config names must be UTF-8 (YAML is): a folder name in another encoding is exit 2."""
    for flag, path in paths.items():
        if path is None:
            continue
        try:
            os.path.abspath(path).encode("utf-8")
        except UnicodeEncodeError:
            fail(f"--{flag.replace('_', '-')} {ascii(os.fspath(path))}: the path (or a folder above it) is not "
                 "valid UTF-8, and a YAML config cannot name it", "Rename the folder to a UTF-8 name, or move it")


def _written_path(target: Path, config_dir: Path) -> str:
    """``target`` as the YAML should name it: relative to the config's folder (``./`` or ``../`` so that a model
    path is never read as a hub id) unless that climbs more than two folders, else absolute."""
    absolute = Path(os.path.abspath(target))
    relative = os.path.relpath(absolute, os.path.abspath(config_dir))
    if relative.split(os.sep)[:3] == [os.pardir] * 3:
        return str(absolute)
    return relative if relative.startswith(os.pardir) else f".{os.sep}{relative}"


def _check_renders_valid(text: str) -> None:
    """A config init wrote that does not validate is a bug in init (exit 1), never the user's to fix."""
    from coordexp.schema.loader import validate_mapping

    report = validate_mapping(yaml.safe_load(text), "coordexp init")
    if not report.ok or report.warnings:
        raise RuntimeError("coordexp init rendered a config that does not validate: "
                           + "; ".join(i.render() for i in (*report.errors, *report.warnings)))


def init_config(
    output: Annotated[Path, typer.Option("-o", "--output", help="The config file to write (never overwritten).",
                                         show_default=False)],
    model: Annotated[Path, typer.Option("--model", help="Local checkpoint folder (with coord tokens: `coordexp "
                                        "expand-vocab`), or stage 1's output_dir for --stage 2.",
                                        show_default=False)],
    train_jsonl: Annotated[Path, typer.Option("--train-jsonl", help="Training records (`coordexp convert "
                                              "to-jsonl`).", show_default=False)],
    val_jsonl: Annotated[Path | None, typer.Option("--val-jsonl", help="Validation records: evaluated every "
                                                   "training.eval_steps.", show_default=False)] = None,
    stage: Annotated[int, typer.Option("--stage", min=1, max=2, help="1: SFT on the ground truth; 2: "
                                       "rollout-matching SFT from a stage-1 model.")] = 1,
    device: Annotated[str, typer.Option("--device", help="cpu (float32, HF rollouts) or gpu (bfloat16, vLLM "
                                        "colocate rollouts in stage 2).")] = "gpu",
    objective: Annotated[str, typer.Option("--objective", help="Stage 2's objective: sft (rollout-matching SFT) or "
                                           "reward (a policy gradient with rewards from the matching; "
                                           "docs/design.md, decision 19).")] = "sft",
) -> None:
    """Write a complete, commented config for this model family, stage and hardware; it validates and trains as
    written. Exit 2 when OUT exists, the model is not a supported checkpoint or a data file is missing."""
    if device not in ("cpu", "gpu"):
        fail(f"--device {device!r} is not cpu or gpu", "Pass --device cpu or --device gpu")
    if objective not in ("sft", "reward"):
        fail(f"--objective {objective!r} is not sft or reward", "Pass --objective sft or --objective reward")
    if objective == "reward" and stage != 2:
        fail("--objective reward trains on rollouts: it is a stage-2 objective", "Add --stage 2 (from a stage-1 "
             "model), or leave --objective out for stage 1")
    from coordexp.cli.file_guard import check_path_names

    check_path_names(output, f"-o {output}")  # a name over 255 bytes or a NUL byte: exit 2 before any stat
    if os.path.lexists(output):
        fail(f"{output} already exists; init never overwrites a file", "Choose a new name or delete the file first")
    if not (model / "config.json").is_file() and not (model / "adapter_config.json").is_file():
        hint = ("Train stage 1 first (`coordexp train STAGE1.yaml`) and pass its output_dir" if stage == 2 else
                "Pass a local checkpoint folder; download hub models first (hf download ORG/NAME "
                "--local-dir DIR), then `coordexp expand-vocab DIR DIR-coord`")
        fail(f"--model {model} is not a checkpoint folder (no config.json)", hint)
    for flag, path in (("--train-jsonl", train_jsonl), ("--val-jsonl", val_jsonl)):
        if path is not None and not path.is_file():
            fail(f"{flag} {path} is not a file", "Convert your annotations first: coordexp convert to-jsonl "
                 "instances.json -o train.jsonl --image-prefix IMAGES/")
    _utf8_paths(output=output, model=model, train_jsonl=train_jsonl, val_jsonl=val_jsonl)
    from coordexp.runtime.model.checkpoint_files import read_json_object

    for name in ("config.json", "adapter_config.json"):  # bounded (size, nesting) before the family is read
        if (model / name).exists():
            read_json_object(model / name)
    family = _family(model)
    if device == "gpu" and importlib.util.find_spec("flash_attn") is not None:
        attn = "flash_attention_2"
    else:
        attn = "sdpa"
    folder = output.parent
    run_name = _run_name(output)
    choices = InitChoices(
        model=_written_path(model, folder), train_jsonl=_written_path(train_jsonl, folder),
        val_jsonl=None if val_jsonl is None else _written_path(val_jsonl, folder),
        output_dir=f".{os.sep}{Path('runs') / run_name}", stage=stage, device=device, family=family,
        attn_implementation=attn, pretrained=weight_bytes(model) >= PRETRAINED_BYTES, objective=objective)
    text = render_config(choices)
    _check_renders_valid(text)
    from coordexp.cli.file_guard import check_output_file, write_new_file

    write_new_file(check_output_file(output, [train_jsonl, *(p for p in [val_jsonl] if p)], "-o"), text.encode(),
                   "-o")
    objective_note = ", reward objective" if objective == "reward" else ""
    out.print(f"[green]✓[/green] wrote {safe(output)}: stage {stage}{objective_note}, {family}, {device}, run folder "
              f"{safe(folder / 'runs' / run_name)}")
    if not _has_coord_tokens(model):
        out.print(f"  [yellow]! warning[/yellow] {safe(model)}'s tokenizer has no coord tokens: run `coordexp "
                  f"expand-vocab {safe(model)} NEW_DIR` and point model.path at NEW_DIR")
    out.print(f"  next: coordexp validate {safe(output)} && coordexp preflight {safe(output)} && coordexp train "
              f"{safe(output)}")


def _run_name(output: Path) -> str:
    """The run folder's name under ``runs/``: the config's name without ``.yaml``, or ``run`` when that is no
    folder name of its own (``...yaml`` and ``..yaml`` would make ``runs/..``, the config's own folder, or
    ``runs/.``)."""
    return output.stem if output.stem.strip(".") else "run"


def register(app: typer.Typer) -> None:
    """Add ``init`` to ``app``."""
    app.command("init")(guarded(init_config))
