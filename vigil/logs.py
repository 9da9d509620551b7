"""Logging setup, called once by the CLI entry point (never on import)."""

from __future__ import annotations

import json
import logging
import sys
from typing import TextIO

from vigil.settings import LogFormat


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log pipelines (Loki, Elasticsearch)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": record.created,
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure(
    level: str = "INFO", fmt: LogFormat = LogFormat.PLAIN, stream: TextIO | None = None
) -> None:
    """Route the `vigil` loggers to stderr in the chosen format."""
    handler = logging.StreamHandler(stream or sys.stderr)
    if fmt is LogFormat.JSON:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("vigil")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
