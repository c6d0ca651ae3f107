"""Training evaluation's teacher-forced token figures (issue 28 item 3) and the trainer's object order (item 4):
the figures equal a plain one-sample forward of each validation record's ground-truth serialization, do not depend
on the evaluation batch or how records split over ranks, come back as eval_<name>; the per-step figures of
training.token_type_metrics reduce from sums; data.object_order: random reorders what the trainer reads, the same way
in any trainer (a resumed run) at the same epoch."""

from __future__ import annotations

import math

import pytest
import torch

from coordexp.runtime.model.data import load_records, object_permutation
from coordexp.runtime.model.encoding import encode_prompt
from coordexp.runtime.model.token_types import TokenTypeSums
from coordexp.runtime.train.launch import build_trainer
from coordexp.runtime.train.metrics import StepStats, WindowContext, step_log_values
from coordexp.runtime.train.rollout_step import build_gt_sample
from coordexp.schema.contract import load_contract
from coordexp.schema.training import BEST_MODEL_METRICS, TOKEN_METRICS

STAGE1 = {"custom": {"trainer_variant": "stage1_sft"}, "global_max_length": 1024,
          "rollout_matching": {"max_new_tokens": 8, "decode_batch_size": 2}}


@pytest.fixture(scope="module")
def val_records(dataset):
    return load_records(dataset.val_jsonl)


def _trainer(write_config, dataset, object_order="keep", **training):
    config = write_config({**STAGE1, "data": {"val_jsonl": str(dataset.val_jsonl), "object_order": object_order},
                           "training": {"per_device_train_batch_size": 2, "packing": False, **training}})
    return build_trainer(load_contract(config))


def _samples(trainer, records):
    return [build_gt_sample(r, encode_prompt(trainer.host.processor, r, trainer.host.template), trainer.host)
            for r in records]


def _favour_the_most_common_label(trainer, records) -> None:
    """Point the LM head row of the most common supervised label at the mean hidden state, so the untrained model
    gets some tokens right (accuracy strictly between 0 and 1) and the comparison means something."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    seen, labels = [], []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: seen.append(args[0][0].detach()))
    try:
        for sample in _samples(trainer, records):
            with torch.no_grad():
                model(**sample.encoded.model_inputs())
            start, sup = sample.encoded.assistant_start, sample.supervision
            positions = [*sup.ce_positions.tolist(), *sup.coord_positions.tolist()]
            seen[-1] = seen[-1][[start + p - 1 for p in positions]]
            labels += [int(sample.target.ids[p]) for p in positions]
    finally:
        hook.remove()
    common = max(set(labels), key=labels.count)
    mean = torch.cat(seen).mean(0)
    with torch.no_grad():
        model.lm_head.weight[common] = mean / mean.dot(mean) * 50.0


def _reference(trainer, records) -> tuple[float, float, int, float]:
    """(accuracy, mean cross-entropy, tokens, near-ties): each record's GT serialization in its own full forward."""
    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    hits, loss, count, near_ties = 0, 0.0, 0, 0
    for sample in _samples(trainer, records):
        with torch.no_grad():
            logits = model(**sample.encoded.model_inputs()).logits[0].double()
        sup, ids, start = sample.supervision, sample.target.ids, sample.encoded.assistant_start
        for position in [*sup.ce_positions.tolist(), *sup.coord_positions.tolist()]:
            row, label = logits[start + position - 1], int(ids[position])
            top2 = row.topk(2).values
            near_ties += int(float(top2[0] - top2[1]) < 1e-4)
            hits += int(int(row.argmax()) == label)
            loss += float(torch.logsumexp(row, 0) - row[label])
            count += 1
    return hits / count, loss / count, count, near_ties


def test_evaluation_reports_the_figures_of_a_plain_forward_of_the_ground_truth(write_config, dataset, val_records):
    trainer = _trainer(write_config, dataset, per_device_eval_batch_size=2)  # padded rows of different lengths
    _favour_the_most_common_label(trainer, val_records)
    trainer.model.train()
    try:
        metrics = trainer.evaluate()
    finally:
        trainer.backend.close()
    assert trainer.model.training  # evaluation leaves the model as it found it
    accuracy, loss, count, near_ties = _reference(trainer, val_records)
    assert 0.0 < accuracy < 1.0
    assert metrics["eval/token_acc"] == pytest.approx(accuracy, abs=near_ties / count + 1e-12)
    assert metrics["eval/token_loss"] == pytest.approx(loss, rel=1e-4)
    for name in TOKEN_METRICS:  # next to AP, under both spellings
        assert metrics[f"eval_{name}"] == metrics[f"eval/{name}"] and name in BEST_MODEL_METRICS
    assert "eval/AP50" in metrics and 0.0 <= metrics["eval/coord_token_acc"] <= 1.0


def test_batch_size_and_rank_split_do_not_change_the_sums(write_config, dataset, val_records):
    trainer = _trainer(write_config, dataset, per_device_eval_batch_size=1)
    try:
        whole = trainer.teacher_forced_sums(val_records)
        trainer.args.per_device_eval_batch_size = 3
        batched = trainer.teacher_forced_sums(val_records)
        # the evaluation's rank shards (every world-th record) add up to the whole
        world = 2
        shards = [trainer.teacher_forced_sums(val_records, list(range(rank, len(val_records), world)))
                  for rank in range(world)]
    finally:
        trainer.backend.close()
    assert whole.text_tokens > 0 and whole.coord_tokens > 0
    assert batched.to_list() == pytest.approx(whole.to_list(), rel=1e-5)
    assert (shards[0] + shards[1]).to_list() == pytest.approx(whole.to_list(), rel=1e-5)


def test_the_per_step_figures_are_the_means_of_the_window_sums():
    stats = StepStats()
    stats.add({"token_ce": 1.0}, trained=10, computed=12, counters=[])
    stats.token_types += TokenTypeSums(text_tokens=3, text_correct=2, text_loss=1.5)
    stats.token_types += TokenTypeSums(text_tokens=1, text_correct=1, text_loss=0.5, coord_tokens=4,
                                       coord_correct=1, coord_loss=8.0)
    ctx = WindowContext(world_size=1, device="cpu", stage2=False, buffered=None, packing_length=64,
                        min_fill_ratio=0.0, fallback_events=None, is_main=True, token_type_metrics=True)
    logs = step_log_values(stats, ctx)
    assert logs["text_token_acc"] == pytest.approx(3 / 4) and logs["coord_token_acc"] == pytest.approx(1 / 4)
    assert logs["token_acc"] == pytest.approx(4 / 8) and logs["token_loss"] == pytest.approx(10.0 / 8)
    assert logs["coord_token_loss"] == pytest.approx(2.0) and logs["text_token_loss"] == pytest.approx(0.5)
    off = step_log_values(stats, WindowContext(**{**ctx.__dict__, "token_type_metrics": False}))
    assert not set(TOKEN_METRICS) & set(off)


def test_random_object_order_is_drawn_from_seed_epoch_and_record_index(write_config, dataset):
    records = load_records(dataset.train_jsonl)
    first = _trainer(write_config, dataset, object_order="random", seed=5)
    resumed = _trainer(write_config, dataset, object_order="random", seed=5)  # a fresh trainer, as after a restart
    indices = sorted(range(len(records)), key=lambda i: -len(records[i].objects))[:2]
    try:
        batch = [records[i] for i in indices]
        first.state.epoch = 2.5  # halfway through epoch 2
        resumed.state.epoch = 2.0
        (got,), _ = first.get_batch_samples(iter([batch]), 1, "cpu")
        (again,), _ = resumed.get_batch_samples(iter([batch]), 1, "cpu")
        first.state.epoch = 3.0
        (next_epoch,), _ = first.get_batch_samples(iter([batch]), 1, "cpu")
    finally:
        first.backend.close()
        resumed.backend.close()
    for record, index, out in zip(batch, indices, got, strict=True):
        assert out.objects == tuple(record.objects[i] for i in object_permutation(5, 2, index, len(record.objects)))
    assert [r.objects for r in again] == [r.objects for r in got]
    many = [i for i, r in enumerate(batch) if len(r.objects) > 2]
    assert many and any(next_epoch[i].objects != got[i].objects for i in many)
    assert math.floor(first.state.epoch) == 3
