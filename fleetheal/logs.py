"""The one JSON log format of every fleetheal service (agent, remediator): one object per line on stderr.

Fields, in this order: `time` (UTC, ISO 8601 with milliseconds), `level` (debug, info, warning, error,
critical), `logger` (the Python logger, e.g. fleetheal.agent), `msg`, then the record's extra fields
(`log.info("...", extra={"node": "gpu-001"})`) and `exc` (a traceback) when there is one. docs/services.md
has an example.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, TextIO

#: Attributes every LogRecord has; anything else on a record is an extra field.
_STANDARD = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """time, level, logger, msg, the record's extra fields, exc."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD:
                doc[key] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def setup_logging(level: str = "info", stream: TextIO | None = None) -> None:
    """Every logger of the process writes JSON lines to `stream` (stderr) from `level` up."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
