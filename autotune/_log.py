"""The package logger, and notices that are said once per process."""

from __future__ import annotations

import logging

logger = logging.getLogger("autotune")
_said: set[str] = set()


class _Formatter(logging.Formatter):
    """``autotune: message`` for autotune's own records; another library's (bitsandbytes' import-time warnings, say)
    keep its logger's name, so that what a library says is not read as autotune's."""

    def format(self, record: logging.LogRecord) -> str:
        said = super().format(record)
        if record.name == "autotune" or record.name.startswith("autotune."):
            return f"autotune: {said}"
        return f"autotune: [{record.name}] {said}"


def log_to_stderr() -> None:
    """Send every logger's records to stderr in autotune's format (the root's handler, as ``basicConfig`` makes)."""
    handler = logging.StreamHandler()  # sys.stderr, as the record is written
    handler.setFormatter(_Formatter("%(message)s"))
    logging.basicConfig(handlers=[handler])


def notice_once(message: str) -> None:
    """Log ``message`` at WARNING level the first time it is given, and never again."""
    if message not in _said:
        _said.add(message)
        logger.warning(message)
