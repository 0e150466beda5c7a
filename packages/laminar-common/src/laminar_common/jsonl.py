"""The one JSON-lines reader: every ``.jsonl`` Laminar reads goes through it.

Owns decoding a file line by line, with errors that name ``file:line``: bad
UTF-8 (the column), invalid JSON, a line that is not a JSON object. Blank
lines are skipped. Raises :class:`~laminar_common.errors.ConfigError`, the
error for a bad input file, so callers catch one type.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from laminar_common.errors import ConfigError

__all__ = ["iter_jsonl", "read_jsonl"]


def iter_jsonl(path: str | Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``(where, record)`` per non-blank line; ``where`` is ``file:line``.

    Raises:
        ConfigError: the file is missing, or a line is not valid UTF-8, not
            valid JSON or not a JSON object (the message names file and line).
    """
    p = Path(path)
    try:
        # surrogateescape: a bad byte surfaces on its own line (checked below),
        # not wherever the decoder's read-ahead happens to be.
        fh = p.open(encoding="utf-8", errors="surrogateescape")
    except OSError as exc:
        raise ConfigError(f"{p}: cannot be read: {exc.strerror or exc}") from exc
    with fh:
        for lineno, line in enumerate(fh, start=1):
            where = f"{p}:{lineno}"
            try:
                line.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ConfigError(f"{where}: not valid UTF-8 (column {exc.start + 1})") from exc
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{where}: not valid JSON: {exc.msg}") from exc
            except (ValueError, RecursionError) as exc:  # a huge number, deep nesting
                raise ConfigError(f"{where}: not valid JSON: {exc}") from exc
            if not isinstance(record, dict):
                raise ConfigError(f"{where}: expected a JSON object, got {type(record).__name__}")
            yield where, record


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All records of a JSON-lines file (see :func:`iter_jsonl`)."""
    return [record for _, record in iter_jsonl(path)]
