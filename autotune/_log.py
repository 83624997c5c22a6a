"""The package logger, and notices that are said once per process."""

from __future__ import annotations

import logging

logger = logging.getLogger("autotune")
_said: set[str] = set()


def notice_once(message: str) -> None:
    """Log ``message`` at WARNING level the first time it is given, and never again."""
    if message not in _said:
        _said.add(message)
        logger.warning(message)
