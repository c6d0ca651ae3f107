"""Degenerate numbers and names (issue 23 item 5): every sigma/epsilon-like knob has a lower bound at which the
loss, its gradients and the optimizer update stay finite (shown AT the bound); path fields refuse a name over the
file system's NAME_MAX at ``validate``; ``migrate`` handles a 300-byte file name with exit 2."""

from __future__ import annotations

import copy
import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from coordexp.cli.app import app
from coordexp.runtime.core.objects import DetObject
from coordexp.runtime.core.ot import pair_coord_targets
from coordexp.runtime.model.coord_losses import (
    coord_hard_ce,
    coord_log_probs,
    gaussian_soft_targets,
    soft_ce,
    w1_distance,
)
from coordexp.schema.matching import MIN_OT_EPSILON, OtConfig
from coordexp.schema.pipeline import MIN_TARGET_SIGMA
from testkit import STAGE2_CONFIG

runner = CliRunner()
_COORD = ("rollout_matching", "pipeline", "objective", 1, "config")
LONG = "n" * 300


def _with(path: tuple, value) -> dict:
    data = copy.deepcopy(STAGE2_CONFIG)
    node = data
    for key in path[:-1]:
        node = node[key] if isinstance(key, int) else node.setdefault(key, {})
    node[path[-1]] = value
    return data


def _validate(tmp_path: Path, data: dict) -> tuple[int, list[dict]]:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    result = runner.invoke(app, ["validate", "--json", str(path)], catch_exceptions=False)
    (item,) = json.loads(result.stdout)
    return result.exit_code, item["errors"]


# ------------------------------------------------------------------------------------------------ numbers

REFUSED = [
    ((*_COORD, "target_sigma"), 1e-160, "rollout_matching.pipeline.objective[1].config.target_sigma"),
    ((*_COORD, "target_sigma"), 1e-20, "rollout_matching.pipeline.objective[1].config.target_sigma"),
    ((*_COORD, "target_sigma"), MIN_TARGET_SIGMA / 2, "rollout_matching.pipeline.objective[1].config.target_sigma"),
    (("rollout_matching", "ot", "epsilon"), 5e-324, "rollout_matching.ot.epsilon"),
    (("rollout_matching", "ot", "epsilon"), MIN_OT_EPSILON / 2, "rollout_matching.ot.epsilon"),
    (("training", "adam_epsilon"), 0.0, "training.adam_epsilon"),
    (("training", "adam_epsilon"), 1e-30, "training.adam_epsilon"),
]


@pytest.mark.parametrize(("path", "value", "dotted"), REFUSED, ids=lambda v: repr(v)[:40])
def test_values_that_make_the_loss_or_the_update_non_finite_are_refused(tmp_path, path, value, dotted):
    code, errors = _validate(tmp_path, _with(path, value))
    assert code == 2 and dotted in [e["path"] for e in errors], errors


@pytest.mark.parametrize(("path", "value"), [
    ((*_COORD, "target_sigma"), MIN_TARGET_SIGMA), (("rollout_matching", "ot", "epsilon"), MIN_OT_EPSILON),
    (("training", "adam_epsilon"), 1e-20), ((*_COORD, "temperature"), 1e-3),
])
def test_the_lower_bounds_themselves_validate(tmp_path, path, value):
    code, errors = _validate(tmp_path, _with(path, value))
    assert code == 0, errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("truncate", [None, 0.0])
def test_coord_losses_and_gradients_are_finite_at_the_smallest_sigma_and_temperature(dtype, truncate):
    """The old bound let sigma reach 1e-160: the soft target was NaN and training ended with every weight NaN."""
    generator = torch.Generator().manual_seed(0)
    centres = torch.tensor([0.0, 0.5, 3.25, 499.999, 998.5, 999.0, 1e-30, 0.4999])
    logits = (torch.randn(len(centres), 1000, generator=generator) * 1e4).to(dtype).requires_grad_(True)
    q = gaussian_soft_targets(centres, MIN_TARGET_SIGMA, truncate)
    log_p = coord_log_probs(logits.float(), 1e-3)
    loss = (soft_ce(log_p, q) + w1_distance(log_p.exp(), q) + coord_hard_ce(log_p, centres)).mean()
    loss.backward()
    assert torch.isfinite(q).all() and torch.allclose(q.sum(dim=1), torch.ones(len(centres)))
    assert torch.isfinite(loss) and torch.isfinite(logits.grad.float()).all()


def test_below_the_bound_the_soft_target_is_nan():
    """Why the bound exists: the float32 target is NaN at the sigma the old schema accepted."""
    q = gaussian_soft_targets(torch.tensor([0.5, 3.25]), 1e-160, None)
    assert not torch.isfinite(q).all()


def test_ot_targets_are_finite_at_the_smallest_epsilon():
    pred = DetObject("a", "poly", (0, 0, 999, 0, 999, 999, 0, 999))
    gt = DetObject("a", "poly", (999, 999, 0, 999, 500, 0))
    box = DetObject("a", "bbox_2d", (0, 0, 999, 999))
    targets = pair_coord_targets([pred, box], [gt, gt], [(0, 0), (1, 1)],
                                 OtConfig(cost="l2", epsilon=MIN_OT_EPSILON, iters=50))
    assert all(np.isfinite(t).all() for t in targets.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adam_stays_finite_at_the_smallest_epsilon(dtype):
    """Zero gradients (an unused embedding row) divide 0 by sqrt(0) + eps: eps 0 (the old lower bound) is NaN."""
    for eps, finite in ((1e-20, True), (0.0, False)):  # 1e-20: the schema's lower bound (validated above)
        weight = torch.nn.Parameter(torch.ones(4, 3, dtype=dtype))
        optimizer = torch.optim.AdamW([weight], lr=1e-3, eps=eps)
        for step in range(3):
            weight.grad = torch.zeros_like(weight)
            weight.grad[0] = 1e-30 if step else 1.0  # a tiny gradient too: v underflows, m does not
            optimizer.step()
        assert bool(torch.isfinite(weight).all()) is finite


# ------------------------------------------------------------------------------------------------ names


@pytest.mark.parametrize("path, dotted", [
    (("training", "output_dir"), "training.output_dir"),
    (("model", "path"), "model.path"),
    (("data", "train_jsonl"), "data.train_jsonl"),
    (("data", "image_root"), "data.image_root"),
])
def test_a_name_over_name_max_is_refused_at_validate(tmp_path, path, dotted):
    code, errors = _validate(tmp_path, _with(path, f"/tmp/{LONG}/x"))
    assert code == 2, errors
    (error,) = [e for e in errors if e["path"] == dotted]
    assert "300 bytes" in error["message"] and "255" in error["message"]


def test_a_long_path_of_short_names_is_refused_at_validate(tmp_path):
    code, errors = _validate(tmp_path, _with(("training", "output_dir"), "/tmp/" + "/".join(["d" * 200] * 25)))
    assert code == 2 and "training.output_dir" in [e["path"] for e in errors]


def test_names_at_the_limit_still_validate(tmp_path):
    code, errors = _validate(tmp_path, _with(("training", "output_dir"), "/tmp/" + "n" * 255))
    assert code == 0, errors


def test_migrate_a_300_byte_file_name_is_exit_2(tmp_path):
    result = runner.invoke(app, ["migrate", str(tmp_path / (LONG + ".yaml"))])
    assert result.exit_code == 2, result.output
    assert "File name too long" in " ".join(result.output.split())


def test_migrate_output_onto_a_fifo_is_refused(tmp_path):
    source = tmp_path / "old.yaml"
    source.write_text(yaml.safe_dump(STAGE2_CONFIG), encoding="utf-8")
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    result = runner.invoke(app, ["migrate", str(source), "-o", str(fifo)])
    assert result.exit_code == 2 and "not a regular file" in " ".join(result.output.split())
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


@pytest.mark.slow
def test_stage1_trains_to_finite_weights_at_the_smallest_sigma_and_temperature(tmp_path, tiny_model_dir,
                                                                                synthetic_dataset):
    """End to end at the bounds: 2 stage-1 steps with target_sigma 1e-3 and temperature 1e-3 (the old schema let
    sigma reach 1e-160: exit 0 with all 46 weight tensors non-finite)."""
    from safetensors.torch import load_file

    from testkit import REPO

    coord_reg = {"coord_ce_weight": 1.0, "soft_ce_weight": 1.0, "w1_weight": 1.0, "coord_gate_weight": 1.0,
                 "text_gate_weight": 1.0, "temperature": 1e-3, "target_sigma": MIN_TARGET_SIGMA, "target_truncate": None}
    config = {
        "extends": str(REPO / "examples" / "demo_stage1.yaml"),
        "model": {"path": str(tiny_model_dir)},
        "data": {"train_jsonl": str(synthetic_dataset.train_jsonl), "val_jsonl": None},
        "training": {"output_dir": str(tmp_path / "run"), "max_steps": 2, "per_device_train_batch_size": 2,
                     "learning_rate": 1e-2, "save_steps": 2},
        "rollout_matching": {"pipeline": {"objective": [
            {"name": "token_ce", "enabled": True, "weight": 1.0, "channels": ["B"],
             "config": {"rollout_fn_desc_weight": 0.0, "rollout_matched_prefix_struct_weight": 0.0}},
            {"name": "coord_reg", "enabled": True, "weight": 1.0, "channels": ["B"], "config": coord_reg}]}},
    }
    path = tmp_path / "stage1.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    result = runner.invoke(app, ["train", str(path)])
    assert result.exit_code == 0, result.output
    weights = load_file(str(tmp_path / "run" / "model.safetensors"))
    assert weights and all(torch.isfinite(t.float()).all() for t in weights.values())
