"""``coordexp train`` restores every process-wide thing it changed (issue 36 item 6): the launcher variables a zero2
check sets, the SIGINT wakeup fd and its watcher thread; a Ctrl-C that an in-process caller handles does not end the
caller's process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from coordexp.cli.app import app

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _stage1_config(root: Path, **training) -> Path:
    from coordexp.runtime.toy.synthetic import write_synthetic_dataset
    from coordexp.runtime.toy.tiny_model import build_tiny_model

    build_tiny_model(root / "model", seed=0)
    write_synthetic_dataset(root / "data", n_train=4, n_val=2, seed=0)
    data = {
        "extends": str(EXAMPLES / "demo_stage2.yaml"),
        "global_max_length": 2048,
        "custom": {"trainer_variant": "stage1_sft"},
        "model": {"path": "./model"},
        "data": {"train_jsonl": "./data/train.jsonl", "val_jsonl": None},
        "training": {"output_dir": "./run", "max_steps": 1, "logging_steps": 1, "per_device_train_batch_size": 2,
                     "packing": False, **training},
    }
    path = root / "stage1.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


@pytest.mark.slow  # trains
def test_train_restores_environment_wakeup_fd_and_ends_its_watcher(tmp_path, monkeypatch):
    pytest.importorskip("deepspeed")
    monkeypatch.setattr(signal, "getsignal", lambda signum: signal.default_int_handler)  # as at a terminal
    config = _stage1_config(tmp_path, deepspeed="zero2")
    environment = dict(os.environ)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd)
    try:
        result = CliRunner().invoke(app, ["train", str(config)], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        assert dict(os.environ) == environment  # RANK, WORLD_SIZE, MASTER_PORT, ACCELERATE_USE_DEEPSPEED gone
        assert not [t for t in threading.enumerate() if t.name == "interrupt-watch" and t.is_alive()]
        assert signal.set_wakeup_fd(previous) == write_fd  # the caller's wakeup fd is back
    finally:
        os.close(read_fd)
        os.close(write_fd)


HANDLED = textwrap.dedent("""
    import signal, sys, threading, time
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal
    from coordexp.cli.train import watching_for_interrupt
    try:
        with watching_for_interrupt(grace_s=0.5):
            print("ready", flush=True)
            time.sleep(60)
    except KeyboardInterrupt:
        print("handled", flush=True)
    time.sleep(2.0)  # well past the grace period: the process must still be alive
    alive = [t.name for t in threading.enumerate() if t.name == "interrupt-watch"]
    print("watchers", len(alive), "wakeup", signal.set_wakeup_fd(-1), flush=True)
""")


@pytest.mark.slow  # starts a process
def test_a_handled_interrupt_does_not_end_the_callers_process():
    proc = subprocess.Popen([sys.executable, "-c", HANDLED], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = proc.stdout.read()
    assert code == 0, proc.stderr.read()
    assert "handled" in output and "watchers 0 wakeup -1" in output
