"""The rollout server's ONE engine worker: a first-in-first-out queue served by a daemon thread.

Why not a ``ThreadPoolExecutor``: its threads are joined at interpreter exit, so a generate call that runs for
minutes would keep a stopped server alive (SIGINT once did not stop it). This worker's thread is a daemon
and :meth:`FifoWorker.stop` never waits longer than its bound: queued work is cancelled, a running engine call is
abandoned (the process is about to exit), and the caller learns whether it was.

``epoch`` counts the barrier operations submitted so far (everything but the ``/infer/`` scheduler's ticks): the
scheduler (``batching.py``) merges only jobs that no weight update separates.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

__all__ = ["FifoWorker", "WorkerStopped"]

log = logging.getLogger("coordexp.serve")


class WorkerStopped(RuntimeError):
    """Work was submitted after :meth:`FifoWorker.stop`, or was still queued when it was called."""


class FifoWorker:
    """Runs submitted callables one at a time, in submission order, on one daemon thread."""

    def __init__(self, name: str = "coordexp-engine"):
        self._queue: "queue.SimpleQueue[tuple[Future, Callable[[], Any]] | None]" = queue.SimpleQueue()
        self._lock = threading.RLock()
        self._stopped = False
        self.epoch = 0  # barrier operations submitted so far
        self._busy = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """Whether a callable is running right now."""
        return self._busy.is_set()

    @property
    def lock(self) -> threading.RLock:
        """Held while submitting: a caller that reads :attr:`epoch` under it submits in a consistent order."""
        return self._lock

    def submit(self, fn: Callable[[], Any], *, barrier: bool = True) -> "Future[Any]":
        """Queue ``fn``; ``barrier`` (the default): it separates the ``/infer/`` jobs queued before it from those
        queued after it (weight updates, cache resets)."""
        future: Future = Future()
        with self._lock:
            if self._stopped:
                raise WorkerStopped("the server is shutting down and takes no more work")
            self.epoch += barrier
            self._queue.put((future, fn))
        return future

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn = item
            if not future.set_running_or_notify_cancel():
                continue
            self._busy.set()
            try:
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - the submitter gets every failure through its future
                future.set_exception(exc)
            else:
                future.set_result(result)
            finally:
                self._busy.clear()

    def stop(self, timeout_s: float = 2.0) -> bool:
        """Cancel queued work and wait at most ``timeout_s`` for the running call; True if the thread ended (a False
        means an engine call is still running and is abandoned: never wait for it, it may take minutes)."""
        with self._lock:
            self._stopped = True
            pending: list[Future] = []
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    pending.append(item[0])
            self._queue.put(None)
        for future in pending:
            future.cancel()
        self._thread.join(timeout=max(0.0, timeout_s))
        if self._thread.is_alive():
            log.warning("an engine call is still running after %.1f s; abandoning it (the process exits anyway)",
                        timeout_s)
            return False
        return True
