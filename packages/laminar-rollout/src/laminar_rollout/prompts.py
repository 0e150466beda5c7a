"""Prompt sources: JSONL or parquet files read through a resumable cursor.

A record is a mapping with a string ``id`` and a string ``prompt``; every
other field is kept as string metadata (``task``, ``answer``, ...) and travels
with the prompt to the worker's reward function.

Invariants: a malformed record is refused with its file and line number (row
for parquet) before anything is dispatched; ids are unique within a file; the
cursor (epoch, position) is all the state needed to resume.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from laminar_common.errors import ConfigError
from laminar_common.jsonl import iter_jsonl

__all__ = ["PromptRecord", "load_prompt_file", "PromptCursor"]


@dataclass(frozen=True, slots=True)
class PromptRecord:
    prompt_id: str
    prompt: str
    metadata: dict[str, str]


def _record(obj: object, where: str) -> PromptRecord:
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    pid, prompt = obj.get("id"), obj.get("prompt")
    if not isinstance(pid, str) or not pid:
        raise ConfigError(f"{where}: field 'id' must be a non-empty string")
    if not isinstance(prompt, str) or not prompt:
        raise ConfigError(f"{where}: field 'prompt' must be a non-empty string")
    meta = {}
    for key, value in obj.items():
        if key in ("id", "prompt"):
            continue
        if not isinstance(value, (str, int, float, bool)):
            raise ConfigError(f"{where}: field {key!r} must be a string or number")
        meta[key] = str(value)
    return PromptRecord(pid, prompt, meta)


def load_prompt_file(path: str | Path) -> list[PromptRecord]:
    """Read and validate every record of a JSONL or parquet prompt file.

    Raises:
        ConfigError: missing file, unknown suffix, malformed record (with its
            line or row number), duplicate id.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"prompt file {str(p)!r} does not exist")
    records: list[PromptRecord] = []
    if p.suffix in (".jsonl", ".json"):
        for where, obj in iter_jsonl(p):
            records.append(_record(obj, where))
    elif p.suffix == ".parquet":
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise ConfigError(f"prompt file {str(p)!r}: reading parquet needs pyarrow "
                              "(pip install 'laminar-rollout[parquet]')") from exc
        try:
            rows = pq.read_table(p).to_pylist()
        except (pa.ArrowException, OSError) as exc:
            raise ConfigError(f"prompt file {str(p)!r}: not a readable parquet file: {exc}") from exc
        for row, obj in enumerate(rows):
            records.append(_record(obj, f"{p}: row {row}"))
    else:
        raise ConfigError(f"prompt file {str(p)!r}: use .jsonl or .parquet")
    seen: set[str] = set()
    for rec in records:
        if rec.prompt_id in seen:
            raise ConfigError(f"prompt file {str(p)!r}: duplicate id {rec.prompt_id!r}")
        seen.add(rec.prompt_id)
    if not records:
        raise ConfigError(f"prompt file {str(p)!r} holds no records")
    return records


def _epoch_id(prompt_id: str, epoch: int) -> str:
    """The id a record is dispatched under in a later epoch."""
    return f"{prompt_id}@e{epoch}"


def _split_epoch_id(dispatched: str) -> tuple[str, int]:
    """Inverse of :func:`_epoch_id`: ``(record id, epoch)``; epoch 0 for a plain id."""
    base, sep, epoch = dispatched.rpartition("@e")
    if sep and epoch.isdigit() and int(epoch) > 0:
        return base, int(epoch)
    return dispatched, 0


class PromptCursor:
    """Walks the records ``epochs`` times; ``(epoch, position)`` is the resumable state.

    Prompt ids of later epochs get an ``@e<epoch>`` suffix so every dispatched
    prompt id is unique across the run.
    """

    def __init__(self, records: list[PromptRecord], epochs: int = 1,
                 max_prompts: int | None = None, epoch: int = 0, position: int = 0) -> None:
        self.records = records
        self.epochs = epochs
        self.max_prompts = max_prompts
        self.epoch = epoch
        self.position = position
        self._by_id: dict[str, PromptRecord] | None = None

    @property
    def taken(self) -> int:
        return self.epoch * len(self.records) + self.position

    def exhausted(self) -> bool:
        if self.max_prompts is not None and self.taken >= self.max_prompts:
            return True
        return self.epoch >= self.epochs

    def next(self) -> PromptRecord | None:
        if self.exhausted():
            return None
        epoch, rec = self.epoch, self.records[self.position]
        self.position += 1
        if self.position == len(self.records):
            self.epoch, self.position = self.epoch + 1, 0
        if epoch == 0:
            return rec
        return PromptRecord(_epoch_id(rec.prompt_id, epoch), rec.prompt, rec.metadata)

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def lookup(self, prompt_id: str) -> PromptRecord | None:
        """The record dispatched as ``prompt_id`` (an epoch's ``@e<n>`` suffix included)."""
        if self._by_id is None:
            self._by_id = {r.prompt_id: r for r in self.records}
        if prompt_id in self._by_id:
            return self._by_id[prompt_id]
        base, epoch = _split_epoch_id(prompt_id)
        if epoch and base in self._by_id:
            rec = self._by_id[base]
            return PromptRecord(prompt_id, rec.prompt, rec.metadata)
        return None
