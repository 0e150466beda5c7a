"""Logging set-up, called once by each CLI (libraries only use getLogger).

Every line carries the job and member id; components add the weight version
and step to their messages.
"""

from __future__ import annotations

import json
import logging
import sys
import time

__all__ = ["setup_logging"]


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "job": getattr(record, "job", ""),
            "member": getattr(record, "member", ""),
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(level: str = "INFO", job: str = "", member: str = "",
                  json_format: bool = False) -> None:
    """Configure the root logger for a CLI process (replaces earlier handlers)."""

    def add_context(record: logging.LogRecord) -> bool:
        record.job = job
        record.member = member
        return True

    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(add_context)
    if json_format:
        handler.setFormatter(_JsonFormatter())
    else:
        fmt = logging.Formatter(
            "%(asctime)s %(levelname)s [%(job)s/%(member)s] %(name)s: %(message)s"
        )
        fmt.converter = time.gmtime
        handler.setFormatter(fmt)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
