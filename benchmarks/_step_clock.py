"""The wall time of each training step, for the benchmarks that report step times (a helper, not a benchmark)."""

from __future__ import annotations

import time

from transformers import TrainerCallback


class StepClock(TrainerCallback):
    """Appends the wall seconds of every optimizer step, from ``on_step_begin`` to ``on_step_end``, to ``walls``."""

    def __init__(self) -> None:
        self.walls: list[float] = []
        self._started = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.walls.append(time.perf_counter() - self._started)
