"""Signals of a training run: Ctrl-C ends it within seconds even inside a native call (exit 130), SIGTERM
(preemption) first finishes the step in progress with its checkpoint (exit 143), and the console entry's exit after an
interrupt. Kept apart from ``coordexp train``'s command body (issue 56: one concern per module)."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Any, Iterator

from coordexp.cli.frame import EXIT_INTERRUPTED, err, is_rank_zero

__all__ = ["INTERRUPT_GRACE_S", "watching_for_interrupt", "exit_interrupted", "terminate_as_interrupt",
           "EXIT_TERMINATED", "training_interrupted"]

INTERRUPT_GRACE_S = 20.0


@contextmanager
def watching_for_interrupt(grace_s: float = INTERRUPT_GRACE_S) -> Iterator[None]:
    """Ctrl-C ends the run within ``grace_s`` even when the main thread sits in a native call that does not return
    to Python (where the KeyboardInterrupt would be raised): the signal's byte reaches a watcher thread through
    ``signal.set_wakeup_fd`` at once; the normal path gets ``grace_s`` first, then the watcher dumps every thread's
    stack to stderr (where it was stuck) and exits 130. Leaving the block (the interrupt was handled, or the run
    ended) restores the previous wakeup fd and ends the watcher, so an in-process caller keeps its process. A
    disposition the parent set (SIG_IGN) is left alone."""
    import faulthandler
    import signal
    import threading

    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:  # not the main thread: the normal path alone
        os.close(read_fd)
        os.close(write_fd)
        yield
        return
    left = threading.Event()

    def watch() -> None:
        while True:
            data = os.read(read_fd, 64)
            if not data:  # the block was left: its pipe is closed
                return
            if signal.SIGINT in data:
                break
        if left.wait(grace_s):  # the main thread handled the interrupt in time
            return
        err.print(f"interrupted (the main thread did not stop within {grace_s:.0f} s; its stack follows)")
        faulthandler.dump_traceback(all_threads=True)
        exit_interrupted()

    watcher = threading.Thread(target=watch, name="interrupt-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        left.set()
        signal.set_wakeup_fd(previous_fd)
        os.close(write_fd)  # end of file for the watcher's read
        watcher.join(timeout=5.0)
        os.close(read_fd)


training_interrupted = False
"""Set when Ctrl-C stopped a training run in this process: rollout threads may still block on a server."""


def exit_interrupted() -> None:
    """Ctrl-C in the ``coordexp`` process itself: end it now with 130. A rollout thread blocked on a hung server
    (HTTP, up to its timeout) would otherwise hold interpreter exit, which joins worker threads; checkpoints are
    atomic and the run log is flushed per line, so nothing written is lost (docs/design.md, decision 14). Called by
    the console script's entry and the watcher only: an in-process caller gets ``typer.Exit(130)`` instead."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(EXIT_INTERRUPTED)


EXIT_TERMINATED = 143
"""SIGTERM (SLURM, Kubernetes preemption): 128 + 15, as a shell reports it."""


@contextmanager
def terminate_as_interrupt(stop: Any = None) -> Iterator[None]:
    """While the block runs, SIGTERM asks ``stop`` (a :class:`~coordexp.runtime.train.launch.StopRequest`) to end
    the run after the step in progress, with its checkpoint, once the training loop runs; otherwise (no ``stop``,
    not training yet, or a second SIGTERM) it raises ``RunTerminated`` in the main thread at once. Only when the
    disposition is the default (a handler or SIG_IGN the parent set is left alone); the previous one is restored."""
    import signal
    import threading

    from coordexp.runtime.train.launch import RunTerminated

    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return

    def on_sigterm(signum: int, frame: Any) -> None:
        if stop is not None and stop.training and not stop.asked:
            stop.asked = True
            if is_rank_zero():
                err.print("SIGTERM: stopping after this step with its checkpoint (SIGTERM again stops at once)")
            return
        raise RunTerminated()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
