"""Logging set-up for splitfed's own loggers: plain lines, or JSON lines with run/round/client/step fields."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

#: LogRecord attributes that JSON lines carry when present (``extra={"round": 3, ...}``).
CONTEXT_FIELDS = ("run_id", "round", "client", "step")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and any context fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in CONTEXT_FIELDS:
            if hasattr(record, name):
                out[name] = getattr(record, name)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


class ContextFilter(logging.Filter):
    """Adds fixed context fields (e.g. the run id) to every record that passes through."""

    def __init__(self, **fields: Any) -> None:
        super().__init__()
        self.fields = fields

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in self.fields.items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


def setup_logging(level: str | int = "INFO", json_lines: bool = False, **context: Any) -> logging.Logger:
    """Give the ``splitfed`` logger one handler (idempotent); other libraries' logging is left alone."""
    logger = logging.getLogger("splitfed")
    logger.setLevel(level if isinstance(level, int) else level.upper())
    for handler in list(logger.handlers):
        if getattr(handler, "_splitfed", False):
            logger.removeHandler(handler)
    handler = logging.StreamHandler()
    handler._splitfed = True  # type: ignore[attr-defined]
    handler.setFormatter(JsonFormatter() if json_lines else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    if context:
        handler.addFilter(ContextFilter(**context))
    logger.addHandler(handler)
    logger.propagate = False
    return logger
