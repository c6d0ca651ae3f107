"""DeepSpeed's import-time lines are dropped only inside commands that do not use it, and only while they run."""

from __future__ import annotations

import io
import logging

from coordexp.cli.quiet import DEEPSPEED_LOGGER, deepspeed_quiet


def _deepspeed_logger_output(enabled: bool) -> tuple[str, str]:
    logger = logging.getLogger(DEEPSPEED_LOGGER)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)  # DeepSpeed's own stdout handler, as its create_logger adds one
    logger.addHandler(handler)
    try:
        with deepspeed_quiet(enabled):
            logger.warning("Setting accelerator to CPU.")
            logger.error("a real DeepSpeed error")
        inside = stream.getvalue()
        logger.warning("after the command")
        return inside, stream.getvalue()[len(inside):]
    finally:
        logger.removeHandler(handler)


def test_a_command_without_deepspeed_drops_its_warnings_but_not_its_errors():
    inside, after = _deepspeed_logger_output(True)
    assert "Setting accelerator" not in inside and "a real DeepSpeed error" in inside
    assert "after the command" in after  # the filter is gone once the command returns


def test_a_command_that_uses_deepspeed_shows_everything():
    inside, _ = _deepspeed_logger_output(False)
    assert "Setting accelerator to CPU." in inside
