"""Ctrl-C ends ``coordexp train`` even when the main thread never gets back to Python to raise KeyboardInterrupt
(a native call that retries through the signal, or a library that swallows the interrupt). CI saw the hung-server
test's learner still running 90 s after Ctrl-C, with no "interrupted" printed (tests/rollout/
test_interrupt_hung_server.py); the watcher makes that bounded and prints every thread's stack."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

STUCK = textwrap.dedent("""
    import signal, sys, time
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal, whatever the test runner ignores
    from coordexp.cli.signals import watching_for_interrupt
    watch = watching_for_interrupt(grace_s=1.0)  # kept: a collected context manager would leave its block
    watch.__enter__()
    def swallowing_everything():
        ready = False
        while True:
            try:  # "ready" is printed inside the try: a Ctrl-C right after it is swallowed too (CI hit that window)
                if not ready:
                    ready = True
                    print("ready", flush=True)
                time.sleep(0.05)
            except KeyboardInterrupt:  # what a library that retries on any exception does
                pass
    swallowing_everything()
""")


def _interrupted(program: str, timeout: float = 120) -> tuple[int, str, str]:
    """Run ``program``, send SIGINT once it prints "ready"; its exit code, stdout and stderr."""
    proc = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return code, proc.stdout.read(), proc.stderr.read()


@pytest.mark.slow  # starts a process
def test_a_main_thread_that_never_stops_still_exits_130_with_its_stack():
    code, _, stderr = _interrupted(STUCK)
    assert code == 130, stderr
    assert "interrupted" in stderr and "swallowing_everything" in stderr  # the stuck thread's stack is shown


HANDLED = textwrap.dedent("""
    import signal, sys, threading, time
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal
    from coordexp.cli.signals import watching_for_interrupt
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
    """An in-process caller that catches the Ctrl-C keeps its process; the watcher and the wakeup fd are gone."""
    code, stdout, stderr = _interrupted(HANDLED, timeout=60)
    assert code == 0, stderr
    assert "handled" in stdout and "watchers 0 wakeup -1" in stdout


@pytest.mark.slow  # starts a process
def test_an_ignored_sigint_stays_ignored():
    """A parent that ignores SIGINT for its children (a background job) keeps them running through Ctrl-C."""
    program = STUCK.replace("signal.signal(signal.SIGINT, signal.default_int_handler)",
                            "signal.signal(signal.SIGINT, signal.SIG_IGN)")
    proc = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=3)
    finally:
        proc.kill()
        proc.wait()
