"""bench_learning.py --tune-decoding (issue 53, item 2; benchmarks/_decoding_tuning.py): the setting each arm is
reported at is chosen on the tuning split only, the test images are decoded again only for a penalty other than 1.0,
and the tuning images are none of the seed's training or test images."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _decoding_tuning as tuning  # noqa: E402


def _row(ap50, f1=0.5):
    return {"AP50": ap50, "f1": f1}


def test_the_best_ap50_wins_then_f1_then_the_default_decoding():
    assert tuning.choose([_row(0.5), _row(0.6), _row(0.55)]) == 1
    assert tuning.choose([_row(0.6, 0.7), _row(0.6, 0.8), _row(0.6, 0.75)]) == 1  # AP50 tied: F1
    assert tuning.choose([_row(0.6, 0.8), _row(0.6, 0.8), _row(0.6, 0.8)]) == 0  # all tied: the first listed
    assert tuning.choose([_row(0.6, 0.8), _row(0.6 + 1e-12, 0.8)]) == 0  # float noise is a tie
    assert tuning.choose([_row(None, None), _row(0.0, None)]) == 1  # a missing figure loses
    assert tuning.settings()[0] == (1.0, False) and len(tuning.settings()) == 6


def _decoded(ap50, f1, free_ap50, free_f1):
    figures = {"recall": 0.5, "precision": 0.5, "duplicates_per_image": 1.0, "premature_eos_rate": 0.25,
               "count_buckets": {"1-6": {"recall": 0.5}}}
    return {"AP50": ap50, "f1": f1, **figures,
            "dedup": {"label_free": {**figures, "AP50": free_ap50, "f1": free_f1, "duplicates_per_image": 0.0}}}


@pytest.mark.parametrize("winner", [1.0, 1.1])
def test_the_setting_is_chosen_on_the_tuning_split_and_reported_on_the_test_images(tmp_path, monkeypatch, winner):
    """The tuning split's best setting is (winner, near repeats removed); the test images' figures at it are
    reported, decoded again only at a penalty other than 1.0; the test images never enter the choice."""
    configs = {p: tmp_path / f"tune{p}.yaml" for p in tuning.PENALTIES}
    tests = {p: tmp_path / f"test{p}.yaml" for p in tuning.PENALTIES if p != 1.0}
    split = tuning.Tuning(tmp_path / "tune.jsonl", 3, configs, tests)
    calls = []

    def fake_decode(config, checkpoint, out_dir, score):
        calls.append(config)
        if config in tests.values():  # the test images: the worst setting there, never read by the choice
            return _decoded(0.1, 0.1, 0.2, 0.2)
        best = config == configs[winner]
        return _decoded(0.5, 0.5, 0.9 if best else 0.5, 0.9 if best else 0.5)

    monkeypatch.setattr(tuning, "decode", fake_decode)
    default = _decoded(0.3, 0.3, 0.4, 0.35)
    tuned = tuning.tune_arm(split, tmp_path, "arm", default, "logprob")
    assert (tuned["repetition_penalty"], tuned["near_repeat_removal"]) == (winner, True)
    assert [(r["repetition_penalty"], r["near_repeat_removal"]) for r in tuned["tuning"]] == tuning.settings()
    assert calls[:3] == [configs[p] for p in tuning.PENALTIES]  # one decode per penalty; removal is post-processing
    if winner == 1.0:
        assert len(calls) == 3 and not tuned["test_decoded_again"]
        assert (tuned["AP50"], tuned["f1"], tuned["duplicates_per_image"]) == (0.4, 0.35, 0.0)
    else:
        assert calls[3:] == [tests[winner]] and tuned["test_decoded_again"]
        assert (tuned["AP50"], tuned["f1"]) == (0.2, 0.2)
    assert tuned["count_buckets"] == {"1-6": {"recall": 0.5}} and tuned["tuning_images"] == 3


def _options(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tune-decoding", type=int)
    parser.add_argument("--tune-jsonl", type=Path)
    parser.add_argument("--val-jsonl", type=Path)
    parser.add_argument("--set", action="append", default=[], dest="settings")
    args = parser.parse_args(list(extra))
    args.settings = [(s.split(":")[0].split("."), 1.1) for s in args.settings]

    def error(message):
        raise SystemExit(message)

    tuning.check_args(args, error)
    return args


@pytest.mark.parametrize("extra, message", [
    (("--tune-decoding", "4", "--seed", "-1"), "--seed 0 or more"),
    (("--tune-decoding", "4", "--val-jsonl", "v.jsonl"), "give --tune-jsonl"),
    (("--tune-decoding", "0",), "at least 1"),
    (("--tune-jsonl", "t.jsonl"), "give both"),
    (("--tune-decoding", "4", "--set", "rollout_matching.decoding.repetition_penalty:1.1"), "drop it from --set"),
])
def test_what_tuning_cannot_do_is_refused(extra, message):
    with pytest.raises(SystemExit, match=message):
        _options(*extra)
    _options("--tune-decoding", "4", "--val-jsonl", "v.jsonl", "--tune-jsonl", "t.jsonl")  # user data, own split


def test_the_tuning_split_is_apart_from_the_seeds_images_and_its_configs_only_change_the_penalty(tmp_path):
    from coordexp.runtime.toy.grid import GridLayout, write_grid_dataset

    args = argparse.Namespace(task="grid", tune_decoding=6, tune_jsonl=None, position_code=100.0, cells=4,
                              cell_px=28, min_objects=4, max_objects=12)
    layout = GridLayout(4, 28, 4, 12)
    write_grid_dataset(tmp_path / "data", n_train=6, n_val=6, seed=0, layout=layout)
    eval_config = tmp_path / "eval.yaml"
    eval_config.write_text(yaml.safe_dump({"extends": "x.yaml", "data": {"val_jsonl": "test.jsonl"},
                                           "rollout_matching": {"max_new_tokens": 9}}))
    prepared = tuning.prepare(args, tmp_path, 0, eval_config)

    def boxes(path):
        return [json.dumps(json.loads(line)["objects"]) for line in path.read_text().splitlines()]

    tune = boxes(prepared.split)
    assert len(tune) == 6 and not set(tune) & set(boxes(tmp_path / "data" / "train.jsonl") +
                                                    boxes(tmp_path / "data" / "val.jsonl"))
    assert prepared.split.parent == tmp_path / "tune_data" and tuning.tuning_seed(0) == -1
    for p in tuning.PENALTIES:
        data = yaml.safe_load(prepared.tune_configs[p].read_text())
        assert data["rollout_matching"] == {"max_new_tokens": 9, "decoding": {"repetition_penalty": p}}
        # regression: without image_root the split's images/val_00000.png resolved against the training jsonl's
        # folder, i.e. the seed's TEST images under the tuning split's labels
        assert data["data"] == {"val_jsonl": str(prepared.split), "max_val_samples": 6,
                                "image_root": str(tmp_path / "tune_data")}
    assert sorted(prepared.test_configs) == [1.05, 1.1]
    assert yaml.safe_load(prepared.test_configs[1.1].read_text())["data"] == {"val_jsonl": "test.jsonl"}
    assert tuning.prepare(argparse.Namespace(tune_decoding=None), tmp_path, 0, eval_config) is None
