"""TensorBoard files the trainer's evaluation figures under eval/ (issue 42): transformers' callback files every key
without an eval_ prefix under train/, so the trainer's own callback hands it eval/<name> as eval_<name>."""

from __future__ import annotations

from types import SimpleNamespace

from transformers.integrations import TensorBoardCallback

from coordexp.runtime.train import trainer as trainer_module


class Writer:
    def __init__(self):
        self.scalars: dict[str, float] = {}

    def add_scalar(self, key, value, step):
        self.scalars[key] = value

    def add_text(self, key, value, step):
        raise AssertionError(f"text logged: {key}")

    def flush(self):
        pass


def test_eval_figures_land_under_eval_and_training_under_train():
    handler = SimpleNamespace(callbacks=[TensorBoardCallback(tb_writer=Writer())])
    handler.remove_callback = handler.callbacks.remove
    handler.add_callback = handler.callbacks.append
    trainer_module._file_eval_figures_under_eval(SimpleNamespace(callback_handler=handler))
    (callback,) = handler.callbacks
    assert isinstance(callback, TensorBoardCallback) and type(callback) is not TensorBoardCallback
    state = SimpleNamespace(is_world_process_zero=True, global_step=3)
    callback.on_log(None, state, None, logs={"eval/AP50": 0.5, "eval/f1": 0.25, "loss": 1.0, "window": "final"})
    assert callback.tb_writer.scalars == {"eval/AP50": 0.5, "eval/f1": 0.25, "train/loss": 1.0}
