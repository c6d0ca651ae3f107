"""A diverged run stops with the step named (issue 45): a NaN or Inf loss or gradient norm in a logged step is exit 2,
never hidden under normal-looking progress; finite logs pass."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


@pytest.mark.parametrize(("key", "value"), [("loss", float("nan")), ("grad_norm", float("inf")),
                                            ("loss", float("-inf"))])
def test_a_non_finite_logged_figure_stops_the_run_naming_the_step(key, value):
    from coordexp.errors import UserInputError
    from coordexp.runtime.train.launch import non_finite_stop

    callback = non_finite_stop()
    args, state = SimpleNamespace(output_dir="runs/x"), SimpleNamespace(global_step=7)
    callback.on_log(args, state, None, logs={"loss": 1.0, "grad_norm": 0.5})  # finite: nothing happens
    with pytest.raises(UserInputError, match=f"{key} is .* at step 7"):
        callback.on_log(args, state, None, logs={"loss": 1.0, "grad_norm": 0.5, key: value})
