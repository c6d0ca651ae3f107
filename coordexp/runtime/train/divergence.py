"""A diverged run: the one error for a NaN or Inf loss or gradient norm, raised by the logged-figure check
(:func:`coordexp.runtime.train.launch.non_finite_stop`) and by the trainer before a backward."""

from __future__ import annotations

from coordexp.runtime.model.policy import LaunchError

__all__ = ["NonFiniteTrainingError", "diverged"]

_HINT = "lower training.learning_rate or raise warmup, then resume from an earlier checkpoint"


class NonFiniteTrainingError(LaunchError):
    """The loss or the gradient norm at a step is NaN or Inf: training diverged (exit 2, the step named)."""


def diverged(what: str, value: float, step: int, output_dir: str, when: str = "") -> NonFiniteTrainingError:
    """The error naming the figure, its value, the step and where the last good checkpoint is."""
    return NonFiniteTrainingError(
        f"training diverged: {what} is {value} at step {step}{when}; the run was stopped (the last checkpoint "
        f"before it is in {output_dir})", hint=_HINT)
