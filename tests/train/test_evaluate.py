"""Detection evaluation through the training parse/match path: scripted rollouts with known AP, log-probability
scores equal to a plain full forward, result files that the COCO library and ``convert to-results`` read back."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from coordexp.runtime.core.coco import predictions_to_coco_results
from coordexp.runtime.core.objects import DetObject
from coordexp.runtime.core.serialize import serialize_objects
from coordexp.runtime.model.data import load_records
from coordexp.runtime.rollout.base import RolloutBackend, RolloutOutput
from coordexp.runtime.train.evaluate import evaluate_detection, roll_out_and_score
from coordexp.runtime.train.rollout_step import HostContext
from coordexp.schema.contract import load_contract

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "stage2_cpu_hf.yaml"


class ScriptedBackend(RolloutBackend):
    """Answers each request with the text ``script(record)`` (tokenized); records which model it was synced to."""

    name = "scripted"

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.synced = tokenizer, script, None

    def generate(self, requests):
        outputs = []
        for request in requests:
            text = self.script(request.record)
            ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
            outputs.append(RolloutOutput(tuple(request.prompt.input_ids.tolist()), ids, text, "stop"))
        return outputs

    @classmethod
    def from_run(cls, run, model, processor):
        raise NotImplementedError("built by the tests directly")

    def sync_weights(self, model):
        self.synced = model


@pytest.fixture(scope="module")
def host(tiny_processor):
    contract = load_contract(EXAMPLE)
    return HostContext.create(tiny_processor, contract.rollout_matching, contract.template)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(tiny_model_dir)).eval()


@pytest.fixture(scope="module")
def records(synthetic_dataset):
    return [r for r in load_records(synthetic_dataset.train_jsonl) if r.objects][:4]


def _evaluate(model, host, records, script, **kwargs):
    backend = ScriptedBackend(host.tokenizer, script)
    report = evaluate_detection(model, host, backend, records, decode_batch_size=3, **kwargs)
    assert backend.synced is model
    return report


def test_ground_truth_rollouts_score_ap_one(model, host, records):
    report = _evaluate(model, host, records, lambda r: serialize_objects(r.objects), score="constant")
    assert report.bbox["AP"] == pytest.approx(1.0) and report.bbox["AP50"] == pytest.approx(1.0)
    assert report.segm is not None and report.segm["AP50"] == pytest.approx(1.0)  # synthetic data has polygons
    n_gt = sum(len(r.objects) for r in records)
    assert report.counters.matched == n_gt and report.counters.gt_objects == n_gt
    assert report.images == len(records) and report.left_out == {}


def test_wrong_descs_score_zero_and_unknown_descs_are_counted(model, host, records):
    def renamed(record):
        return serialize_objects([DetObject("mauve blob", o.geometry, o.coords) for o in record.objects])

    report = _evaluate(model, host, records, renamed, score="constant")
    assert report.bbox["AP"] == 0.0
    assert report.left_out == {"unknown_category": sum(len(r.objects) for r in records)}


def test_first_object_only_gives_the_recall_share(model, host, records):
    """Each image's first object, perfectly placed: recall per category is found / present, precision 1."""
    report = _evaluate(model, host, records, lambda r: serialize_objects(r.objects[:1]), score="constant")
    found = {}
    present = {}
    for r in records:
        for k, obj in enumerate(r.objects):
            present[obj.desc] = present.get(obj.desc, 0) + 1
            found[obj.desc] = found.get(obj.desc, 0) + (k == 0)
    for desc, ap in report.bbox.per_category.items():
        recall = found[desc] / present[desc]
        assert ap == pytest.approx(math.floor(recall * 100 + 1e-9 + 1) / 101 if recall else 0.0, abs=1e-6), desc


def test_logprob_scores_equal_a_full_forward(model, host, records):
    import torch

    from coordexp.runtime.model.encoding import encode_prompt, encode_teacher_forced

    record = records[0]
    rollouts = roll_out_and_score(model, host, ScriptedBackend(host.tokenizer, lambda r: serialize_objects(r.objects)),
                                  [record], decode_batch_size=1)
    predictions = rollouts[0].predictions
    assert len(predictions) == len(record.objects)
    ids = host.tokenizer.encode(serialize_objects(record.objects), add_special_tokens=False)
    prompt = encode_prompt(host.processor, record, host.template)
    sample = encode_teacher_forced(host.processor, record, host.template, ids, prompt=prompt)
    with torch.no_grad():
        logits = model(**sample.model_inputs()).logits[0].double()
    tokenizer = host.tokenizer  # the decoder never emits the image/video pads nor the padded vocabulary rows
    logits[:, [tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>")]] = float("-inf")
    logits[:, len(tokenizer):] = float("-inf")
    logp = torch.log_softmax(logits, -1)
    start = sample.assistant_start
    per_token = np.array([float(logp[start + t - 1, token]) for t, token in enumerate(ids)])
    from coordexp.runtime.core.parsing import parse_rollout

    parse = parse_rollout(ids, host.tokenizer, host.vocab, piece_table=host.pieces)
    for parsed, prediction in zip(parse.objects, predictions, strict=True):
        lo, hi = parsed.token_span[0], min(parsed.token_span[1], len(ids))
        assert prediction.logprob == pytest.approx(per_token[lo:hi].sum(), rel=1e-4, abs=1e-4)
        assert prediction.n_tokens == hi - lo
        assert prediction.score("logprob") == pytest.approx(math.exp(per_token[lo:hi].sum()), rel=1e-3)
        assert prediction.score("mean_logprob") == pytest.approx(math.exp(per_token[lo:hi].mean()), rel=1e-3)
        assert prediction.score("constant") == 1.0


def test_files_load_in_the_library_and_map_back(model, host, records, tmp_path):
    from faster_coco_eval import COCO

    report = _evaluate(model, host, records, lambda r: serialize_objects(r.objects[::-1]), out_dir=tmp_path,
                       png_count=2, image_root=records[0].image_paths[0].parent.parent)
    gt = COCO(str(tmp_path / "coco_gt.json"))
    results = gt.loadRes(str(tmp_path / "coco_results.json"))
    assert len(results.getAnnIds()) == sum(len(r.objects) for r in records)
    scores = [a["score"] for a in results.loadAnns(results.getAnnIds())]
    assert all(0 < s <= 1 for s in scores) and len(set(scores)) > 1  # probabilities, not a constant
    assert gt.loadImgs(1)[0]["file_name"].startswith("images/")
    lines = (tmp_path / "predictions.jsonl").read_text().splitlines()
    mapped, left_out = predictions_to_coco_results(lines, json.loads((tmp_path / "coco_gt.json").read_text()),
                                                   source="predictions.jsonl")
    written = json.loads((tmp_path / "coco_results.json").read_text())
    assert not left_out
    assert [(r["image_id"], r["category_id"]) for r in mapped] == [(r["image_id"], r["category_id"]) for r in written]
    np.testing.assert_allclose([r["bbox"] for r in mapped], [r["bbox"] for r in written])
    assert len(list((tmp_path / "png").glob("*.png"))) == 2
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["bbox"]["AP"] == pytest.approx(report.bbox["AP"])
    logs = report.log_dict("eval")
    assert logs["eval/AP50"] == pytest.approx(1.0) and "eval/segm_AP" in logs and "eval/match_rate" in logs


def test_trainer_evaluation_logs_the_same_ap_figures(write_config, dataset):
    """``eval_steps`` evaluation (CoordExpTrainer.evaluate) logs COCO AP next to the counters, as ``coordexp eval``."""
    from coordexp.runtime.train.launch import build_trainer

    config = write_config({"data": {"val_jsonl": str(dataset.val_jsonl)},
                           "rollout_matching": {"max_new_tokens": 24, "decode_batch_size": 2}})
    trainer = build_trainer(load_contract(config))
    try:
        metrics = trainer.evaluate()
    finally:
        trainer.backend.close()
    assert {"eval/AP", "eval/AP50", "eval/AR100", "eval/match_rate"} <= set(metrics)
    # every figure training.metric_for_best_model may name comes back as eval_<name> whenever it was computed
    from coordexp.schema.training import BEST_MODEL_METRICS

    for name in BEST_MODEL_METRICS:
        assert (f"eval/{name}" in metrics) == (f"eval_{name}" in metrics), name
        if f"eval/{name}" in metrics:
            assert metrics[f"eval_{name}"] == metrics[f"eval/{name}"]
    assert {"eval_AP", "eval_AP50", "eval_match_rate", "eval_fn_per_image"} <= set(metrics)
    assert 0.0 <= metrics["eval/AP50"] <= 1.0
    assert metrics["eval/samples"] == len(load_records(dataset.val_jsonl))


def test_pngs_show_images_with_predictions_first(model, host, records, tmp_path):
    """eval used to draw the first N records; one with predictions comes first now (issue 38)."""
    last = len(records) - 1
    _evaluate(model, host, records, lambda r: serialize_objects(r.objects if r is records[-1] else []),
              out_dir=tmp_path, png_count=1, image_root=records[0].image_paths[0].parent.parent)
    assert [p.name for p in (tmp_path / "png").glob("*.png")] == [f"eval_{last:04d}.png"]
