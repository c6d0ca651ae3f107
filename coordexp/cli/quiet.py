"""Libraries' import-time chatter kept out of commands that do not use the library.

DeepSpeed, when installed, is imported by transformers / accelerate / peft whether or not the run uses it, and its
``DeepSpeed`` logger (its own stdout handler) then prints "Setting accelerator to CPU ..." (real_accelerator.py) on
stdout. A command that does not use DeepSpeed drops that logger's records below ERROR while it runs; a command that
uses DeepSpeed shows them all."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator

__all__ = ["deepspeed_quiet", "DEEPSPEED_LOGGER"]

DEEPSPEED_LOGGER = "DeepSpeed"


class _BelowError(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


@contextmanager
def deepspeed_quiet(enabled: bool = True) -> Iterator[None]:
    """While the block runs, DeepSpeed's warnings and info lines are dropped (errors still show); ``enabled=False``
    (the run uses DeepSpeed) changes nothing. The filter sits on the logger itself, so it holds whether DeepSpeed is
    imported inside the block or was before, and it is removed on exit."""
    if not enabled:
        yield
        return
    logger = logging.getLogger(DEEPSPEED_LOGGER)
    quiet = _BelowError()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)
