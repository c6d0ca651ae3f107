"""One weight push to several rollout servers at once: the policy is exported ONCE and every server's transport
consumes that one export (docs/design.md, server mode).

- :class:`SharedExport`: one pass over ``named_tensors(model)`` (LoRA merged on the fly) read by several transports
  in parallel. Each tensor is made once, on first demand, and dropped when every reader has passed it; a reader runs
  at most ``window_bytes`` ahead of the slowest one, so memory stays bounded (not a copy of the whole model).
- :func:`push_in_parallel`: runs one push per server on a bounded thread pool, in waves of at most ``max_workers``
  servers, and raises one :class:`~coordexp.runtime.rollout.weight_sync.WeightSyncError` naming every server that
  failed by URL (the others still got the new weights).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator, Sequence

from coordexp.runtime.rollout.weight_sync import WeightSyncError

__all__ = ["MAX_PARALLEL_PUSHES", "SharedExport", "push_in_parallel"]

MAX_PARALLEL_PUSHES = 8  # servers pushed at once; more wait for the next wave (each wave exports once)
_DONE = float("inf")


class SharedExport:
    """``readers`` parallel readers of one iterable of ``(name, tensor)`` pairs: :meth:`reader` ``(k)`` yields the
    same pairs in the same order to every ``k``; call :meth:`release` ``(k)`` when reader ``k`` ends early (a failed
    push), so the others never wait for it. An error raised by the source reaches every reader."""

    def __init__(self, source: Iterable[tuple[str, Any]], readers: int, *, window_bytes: int):
        if readers < 1:
            raise ValueError(f"readers must be >= 1 (got {readers})")
        self._source = iter(source)
        self._window = max(1, int(window_bytes))
        self._items: dict[int, tuple[str, Any]] = {}
        self._sizes: dict[int, int] = {}
        self._buffered = 0
        self._made = 0
        self._exhausted = False
        self._error: BaseException | None = None
        self._positions: list[float] = [0] * readers
        self._cond = threading.Condition()
        self.produced = 0  # how many pairs the source yielded (each exactly once)

    def reader(self, k: int) -> Iterator[tuple[str, Any]]:
        i = 0
        while True:
            with self._cond:
                item = self._next_locked(k, i)
                if item is None:
                    self._positions[k] = _DONE
                    self._drop_locked()
                    return
                self._positions[k] = i + 1
                self._drop_locked()
            yield item
            i += 1

    def release(self, k: int) -> None:
        with self._cond:
            self._positions[k] = _DONE
            self._drop_locked()

    def _next_locked(self, k: int, i: int) -> tuple[str, Any] | None:
        while True:
            if self._error is not None:
                self._positions[k] = _DONE
                self._drop_locked()
                raise self._error
            if i < self._made:
                return self._items[i]
            if self._exhausted:
                return None
            if self._buffered < self._window or i <= min(self._positions):
                self._produce_locked()
                continue
            self._cond.wait()

    def _produce_locked(self) -> None:
        try:
            name, tensor = next(self._source)
        except StopIteration:
            self._exhausted = True
        except BaseException as exc:  # noqa: BLE001 - every reader must see the export's failure
            self._error = exc
        else:
            size = int(tensor.numel() * tensor.element_size()) if hasattr(tensor, "element_size") else 0
            self._items[self._made], self._sizes[self._made] = (name, tensor), size
            self._buffered += size
            self._made += 1
            self.produced += 1
        self._cond.notify_all()

    def _drop_locked(self) -> None:
        slowest = min(self._positions)
        for index in [j for j in self._items if j < slowest]:
            del self._items[index]
            self._buffered -= self._sizes.pop(index)
        self._cond.notify_all()


def push_in_parallel(clients: Sequence[Any], push_wave: Callable[[Sequence[Any]], list[Callable[[], None]]], *,
                     max_workers: int = MAX_PARALLEL_PUSHES) -> None:
    """Push to every client, at most ``max_workers`` at once. ``push_wave(wave)`` prepares one wave (its shared
    export) and returns one callable per client of the wave; every failure is collected and raised together as
    one :class:`WeightSyncError` naming each failed server's ``base_url``."""
    width = max(1, min(int(max_workers), len(clients)))
    failures: list[tuple[Any, BaseException]] = []
    with ThreadPoolExecutor(max_workers=width, thread_name_prefix="weight-push") as pool:
        for start in range(0, len(clients), width):
            wave = clients[start:start + width]
            futures = [pool.submit(task) for task in push_wave(wave)]
            for client, future in zip(wave, futures):
                try:
                    future.result()
                except BaseException as exc:  # noqa: BLE001 - reported below with the server's URL
                    failures.append((client, exc))
    if not failures:
        return
    if len(failures) == 1 and len(clients) == 1:
        raise failures[0][1]
    detail = "; ".join(f"{c.base_url}: {type(e).__name__}: {e}" for c, e in failures)
    ok = len(clients) - len(failures)
    raise WeightSyncError(
        f"weight push failed on {len(failures)} of {len(clients)} rollout server(s) ({ok} got the new weights): "
        f"{detail}", hint="check each failed server's log; a dead server: restart it (coordexp serve-rollout CFG "
        "--port N) and resume from the last checkpoint") from failures[0][1]
