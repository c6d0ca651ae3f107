"""Evaluation progress during training (issue 44 item 4): the trainer reports each evaluation chunk, the progress
callback prints ``eval  step N  rolling out d/t images  ETA ...`` on a log (the panel on a terminal), and the run's
ETA counts the evaluations still to run, so it does not jump after each one. No model: fake clock, fake trainer."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
from rich.console import Console
from transformers import TrainerControl, TrainerState
from transformers.trainer_callback import CallbackHandler

from coordexp.runtime.train import progress
from coordexp.runtime.train.progress import ProgressCallback, evaluations_left, report_eval_progress


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = _Clock()
    monkeypatch.setattr(progress.time, "monotonic", fake)
    return fake


def _trainer(callback: ProgressCallback, *, max_steps: int, eval_steps: int):
    args = SimpleNamespace(eval_strategy="steps", eval_steps=eval_steps, eval_delay=0)
    state = TrainerState()
    state.max_steps, state.eval_steps, state.global_step = max_steps, eval_steps, 0
    handler = CallbackHandler([callback], None, None, None, None)
    return SimpleNamespace(args=args, state=state, control=TrainerControl(), callback_handler=handler)


def _started(*, terminal: bool, max_steps: int, eval_steps: int):
    """A console buffer, a progress callback writing to it and a fake trainer after on_train_begin."""
    buffer = io.StringIO()
    callback = ProgressCallback(Console(file=buffer, force_terminal=terminal, width=200))
    trainer = _trainer(callback, max_steps=max_steps, eval_steps=eval_steps)
    trainer.callback_handler.on_train_begin(trainer.args, trainer.state, trainer.control)
    return buffer, callback, trainer


def _train_steps(trainer, clock, steps: int, seconds_per_step: float) -> None:
    for _ in range(steps):
        clock.now += seconds_per_step
        trainer.state.global_step += 1
        trainer.callback_handler.on_step_end(trainer.args, trainer.state, trainer.control)


def _evaluate(trainer, clock, images: int, seconds_per_image: float) -> None:
    report_eval_progress(trainer, 0, images)
    for done in range(1, images + 1):
        clock.now += seconds_per_image
        report_eval_progress(trainer, done, images)
    trainer.callback_handler.on_evaluate(trainer.args, trainer.state, trainer.control, metrics={})


def test_evaluations_left_counts_multiples_not_yet_run():
    assert evaluations_left(0, 100, 10, -1) == 10
    assert evaluations_left(10, 100, 10, 0) == 10  # the one at step 10 runs after its log
    assert evaluations_left(10, 100, 10, 10) == 9
    assert evaluations_left(95, 100, 10, 90) == 1
    assert evaluations_left(100, 100, 10, 100) == 0
    assert evaluations_left(5, 100, 0, -1) == 0
    assert evaluations_left(0, 100, 10, -1, delay=50) == 6


def test_a_plain_log_prints_evaluation_progress_with_its_eta(clock):
    buffer, callback, trainer = _started(terminal=False, max_steps=20, eval_steps=10)
    _train_steps(trainer, clock, 10, 1.0)
    _evaluate(trainer, clock, images=64, seconds_per_image=1.0)  # 64 s: a line every 10 s, the first at once
    lines = buffer.getvalue().splitlines()
    assert lines[0] == "eval  step 10  rolling out 1/64 images  ETA 1m03s"
    assert len(lines) == 7 and all(line.startswith("eval  step 10  rolling out ") for line in lines)
    assert lines[1] == "eval  step 10  rolling out 11/64 images  ETA 53s"
    assert callback.eval_status is None  # cleared once the evaluation reports


def test_the_run_eta_counts_evaluations_and_does_not_jump_after_one(clock):
    _, callback, trainer = _started(terminal=False, max_steps=40, eval_steps=10)
    state = trainer.state
    _train_steps(trainer, clock, 10, 1.0)
    _evaluate(trainer, clock, images=30, seconds_per_image=1.0)  # 30 s per evaluation, 1 s per step
    _train_steps(trainer, clock, 5, 1.0)
    # 25 steps left at 1 s each, evaluations at 20, 30 and 40 at 30 s each (the old ETA: 45 s / 15 steps * 25)
    eta = callback._timed(state.global_step, state.max_steps).eta_s
    assert eta == pytest.approx(25 + 3 * 30)
    _train_steps(trainer, clock, 5, 1.0)
    before = callback._timed(state.global_step, state.max_steps).eta_s
    _evaluate(trainer, clock, images=30, seconds_per_image=1.0)
    after = callback._timed(state.global_step, state.max_steps).eta_s
    assert before == pytest.approx(20 + 3 * 30) and after == pytest.approx(20 + 2 * 30)  # less by the one just run


def test_the_live_panel_shows_the_evaluation_in_progress(clock):
    buffer, callback, trainer = _started(terminal=True, max_steps=4, eval_steps=2)
    _train_steps(trainer, clock, 2, 1.0)
    report_eval_progress(trainer, 0, 8)
    clock.now += 4.0
    report_eval_progress(trainer, 2, 8)
    assert callback.eval_status == "eval  step 2  rolling out 2/8 images  ETA 12s"
    callback.on_train_end(trainer.args, trainer.state, trainer.control)
    assert "rolling out 2/8 images" in buffer.getvalue()


def test_other_ranks_and_other_callbacks_ignore_the_event(clock):
    buffer = io.StringIO()
    callback = ProgressCallback(Console(file=buffer, force_terminal=False))
    trainer = _trainer(callback, max_steps=4, eval_steps=2)
    trainer.state.is_world_process_zero = False
    trainer.callback_handler.add_callback(progress.TrainerCallback())  # a callback without the keyword
    trainer.callback_handler.on_train_begin(trainer.args, trainer.state, trainer.control)
    _evaluate(trainer, clock, images=4, seconds_per_image=1.0)
    assert buffer.getvalue() == ""


def test_rollout_trainer_evaluate_reports_each_chunk(monkeypatch):
    """CoordExpTrainer.evaluate reports (0, n) before the first chunk and the images done after each chunk."""
    from coordexp.runtime.train import evaluate as evaluate_module
    from coordexp.runtime.train.trainer import CoordExpTrainer

    seen: list[tuple[int, int]] = []

    class _Recorder(progress.TrainerCallback):
        def on_prediction_step(self, args, state, control, eval_progress=None, **kwargs):
            seen.append(eval_progress)

    class _Stop(Exception):
        pass

    def _metrics(*args, **kwargs):
        raise _Stop

    monkeypatch.setattr(evaluate_module, "detection_metrics", _metrics)
    trainer = object.__new__(CoordExpTrainer)
    fake = _trainer(_Recorder(), max_steps=4, eval_steps=2)
    records = list(range(5))
    trainer.__dict__.update(
        args=SimpleNamespace(world_size=1, process_index=0), state=fake.state, control=fake.control,
        callback_handler=fake.callback_handler, eval_dataset=records, run=SimpleNamespace(data=SimpleNamespace(
            image_root=None)), _scoring_copy=SimpleNamespace(release=lambda: None),
        scored_chunks=lambda recs, positions: iter([(None, recs[:2]), (None, recs[2:4]), (None, recs[4:])]))
    with pytest.raises(_Stop):
        trainer.evaluate()
    assert seen == [(0, 5), (2, 5), (4, 5), (5, 5)]
