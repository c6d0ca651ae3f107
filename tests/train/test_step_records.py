"""Every optimizer step's records are logged as a hash (``step_records`` in run_metadata.jsonl), so two runs' data
order can be compared step for step (bench_learning.py checks its arms with it)."""

from __future__ import annotations

from coordexp.runtime.core.objects import DetObject
from coordexp.runtime.model.data import DetectionRecord
from coordexp.runtime.train.metrics import StepStats
from coordexp.runtime.train.pipeline import MicroStepPipeline, PipelineSettings
from coordexp.runtime.train.run_log import RunLog, read_run_log, step_records_hash


def _record(line: int, objects=()) -> DetectionRecord:
    return DetectionRecord(image_paths=(), width=10, height=10, objects=tuple(objects), source=f"train.jsonl:{line}")


def _pipeline(path) -> MicroStepPipeline:
    return MicroStepPipeline(None, None, PipelineSettings(seed=1, stage2=False), stats=StepStats(),
                             run_log=RunLog(path), policy=lambda: None)


def test_each_planned_step_logs_its_records_hash(tmp_path):
    records = [_record(k) for k in range(6)]
    a, b = _pipeline(tmp_path / "a"), _pipeline(tmp_path / "b")
    for pipe, order in ((a, records), (b, records[:2] + records[3:4] + records[2:3] + records[4:])):
        pipe.plan(0, [tuple(order[:2]), tuple(order[2:4])], None)
        pipe.plan(1, [tuple(order[4:])], None)
    logged_a = read_run_log(tmp_path / "a", event="step_records")
    logged_b = read_run_log(tmp_path / "b", event="step_records")
    assert [(r["global_step"], r["records"]) for r in logged_a] == [(0, 4), (1, 2)]
    assert logged_a[1]["hash"] == logged_b[1]["hash"]  # same records in step 1
    assert logged_a[0]["hash"] != logged_b[0]["hash"]  # step 0 read them in another order


def test_the_hash_sees_records_order_micro_batches_and_object_order():
    box = DetObject("box", "bbox_2d", (1, 1, 5, 5))
    other = DetObject("box", "bbox_2d", (6, 6, 9, 9))
    r0, r1 = _record(0, [box, other]), _record(1)
    assert step_records_hash([[r0, r1]]) == step_records_hash([[_record(0, [box, other]), _record(1)]])
    assert step_records_hash([[r0, r1]]) != step_records_hash([[r1, r0]])
    assert step_records_hash([[r0, r1]]) != step_records_hash([[r0], [r1]])
    assert step_records_hash([[r0]]) != step_records_hash([[_record(0, [other, box])]])  # data.object_order: random
