"""Libraries' import-time chatter kept out of commands that do not use the library, and their progress bars out of
logs.

transformers' and huggingface_hub's tqdm bars ("Loading weights", "Writing model shards", downloads) redraw with
carriage returns: in a log file (stderr not a terminal) each becomes pages of lines. :func:`library_bars_quiet`
turns them off there (``HF_HUB_DISABLE_PROGRESS_BARS=1``, which both libraries read, and their switches if they are
already imported); a terminal keeps them, and so does an explicit ``HF_HUB_DISABLE_PROGRESS_BARS=0``.

DeepSpeed, when installed, is imported by transformers / accelerate / peft whether or not the run uses it, and its
``DeepSpeed`` logger (its own stdout handler) then prints "Setting accelerator to CPU ..." (real_accelerator.py) on
stdout. A command that does not use DeepSpeed drops that logger's records below ERROR while it runs; a command that
uses DeepSpeed shows them all."""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager
from typing import Iterator, Optional, TextIO

__all__ = ["deepspeed_quiet", "DEEPSPEED_LOGGER", "library_bars_quiet", "BARS_ENV"]

BARS_ENV = "HF_HUB_DISABLE_PROGRESS_BARS"

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


def _is_terminal(stream: Optional[TextIO]) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError, OSError):  # a closed or replaced stream
        return False


def library_bars_quiet(stream: Optional[TextIO] = None) -> bool:
    """Turn transformers' and huggingface_hub's progress bars off when ``stream`` (default: stderr, where tqdm
    draws) is not a terminal and the user did not set :data:`BARS_ENV`; True when they are off."""
    if _is_terminal(sys.stderr if stream is None else stream):
        return False
    if os.environ.setdefault(BARS_ENV, "1") != "1":
        return False
    # already imported (an in-process caller): the environment was read at their import, switch them directly
    hub = sys.modules.get("huggingface_hub.utils")
    if hub is not None and hasattr(hub, "disable_progress_bars"):
        hub.disable_progress_bars()
    transformers_logging = sys.modules.get("transformers.utils.logging")
    if transformers_logging is not None and hasattr(transformers_logging, "disable_progress_bar"):
        transformers_logging.disable_progress_bar()
    return True
