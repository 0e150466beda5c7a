"""Prompt sources: a dataset read through a resumable, optionally shuffled cursor.

Reading is :func:`laminar_common.data.records.load_records` (JSONL or parquet,
text or chat-message prompts, dot-path keys, nested metadata; see
:class:`~laminar_common.data.records.DataConfig`); a record's ``record_id`` is
its prompt id. This module owns the order prompts are dispatched in.

Invariants: a malformed record is refused with its file and line number (row
for parquet) before anything is dispatched; ids are unique within a file and
hold neither ``#`` nor ``@e``, so every dispatched id (``<id>`` in epoch 0,
``<id>@e<n>`` in epoch n) is unique across the run. The cursor's
``(epoch, position)`` with its ``shuffle`` and ``seed`` is all the state needed
to resume: epoch ``n``'s order depends on ``(seed, n)`` and the number of
records only.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

from laminar_common.data.records import DataConfig, Record, load_records

__all__ = ["PromptRecord", "load_prompt_file", "PromptCursor", "epoch_order", "check_resume"]

PromptRecord = Record
"""A prompt of the run: :class:`~laminar_common.data.records.Record` (``record_id``
is the prompt id)."""


def load_prompt_file(path: str | Path, data_config: DataConfig = DataConfig()) -> list[Record]:
    """Read and validate every record of a prompt file (see
    :func:`~laminar_common.data.records.load_records`).

    Raises:
        ConfigError: missing file, unknown suffix, malformed record (with its
            line or row number and field), duplicate id.
    """
    return load_records(path, data_config)


def _epoch_id(prompt_id: str, epoch: int) -> str:
    """The id a record is dispatched under in a later epoch."""
    return f"{prompt_id}@e{epoch}"


def _split_epoch_id(dispatched: str) -> tuple[str, int]:
    """Inverse of :func:`_epoch_id`: ``(record id, epoch)``; epoch 0 for a plain id."""
    base, sep, epoch = dispatched.rpartition("@e")
    if sep and epoch.isdigit() and int(epoch) > 0:
        return base, int(epoch)
    return dispatched, 0


def epoch_order(n: int, epoch: int, seed: int) -> list[int]:
    """Epoch ``epoch``'s shuffled order of ``n`` records: a function of its arguments
    only (a string seed hashes the same in every process, whatever PYTHONHASHSEED)."""
    order = list(range(n))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return order


class PromptCursor:
    """Walks the records ``epochs`` times; ``(epoch, position)`` is the resumable state.

    With ``shuffle``, each epoch visits the records in :func:`epoch_order`
    (``position`` counts records taken in that epoch); otherwise in file order.
    Prompt ids of later epochs get an ``@e<epoch>`` suffix so every dispatched
    prompt id is unique across the run.
    """

    def __init__(self, records: list[Record], epochs: int = 1,
                 max_prompts: int | None = None, epoch: int = 0, position: int = 0,
                 shuffle: bool = False, seed: int = 0) -> None:
        if not 0 <= position < max(len(records), 1):
            raise ValueError(f"cursor position {position} is outside the {len(records)} records")
        self.records = records
        self.epochs = epochs
        self.max_prompts = max_prompts
        self.epoch = epoch
        self.position = position
        self.shuffle = shuffle
        self.seed = seed
        self._order: tuple[int, list[int]] | None = None
        self._by_id: dict[str, Record] | None = None

    @property
    def taken(self) -> int:
        return self.epoch * len(self.records) + self.position

    def exhausted(self) -> bool:
        if self.max_prompts is not None and self.taken >= self.max_prompts:
            return True
        return self.epoch >= self.epochs

    def _index(self, epoch: int, position: int) -> int:
        if not self.shuffle:
            return position
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, epoch_order(len(self.records), epoch, self.seed))
        return self._order[1][position]

    def next(self) -> Record | None:
        if self.exhausted():
            return None
        epoch = self.epoch
        rec = self.records[self._index(epoch, self.position)]
        self.position += 1
        if self.position == len(self.records):
            self.epoch, self.position = self.epoch + 1, 0
        if epoch == 0:
            return rec
        return dataclasses.replace(rec, record_id=_epoch_id(rec.record_id, epoch))

    def state(self) -> dict[str, int | bool]:
        """The resumable state (``epoch``, ``position``, ``shuffle``, ``seed``) and the
        number of ``records`` it walks, for :func:`check_resume`."""
        return {"epoch": self.epoch, "position": self.position, "shuffle": self.shuffle,
                "seed": self.seed, "records": len(self.records)}

    def lookup(self, prompt_id: str) -> Record | None:
        """The record dispatched as ``prompt_id`` (an epoch's ``@e<n>`` suffix included)."""
        if self._by_id is None:
            self._by_id = {r.record_id: r for r in self.records}
        if prompt_id in self._by_id:
            return self._by_id[prompt_id]
        base, epoch = _split_epoch_id(prompt_id)
        if epoch and base in self._by_id:
            return dataclasses.replace(self._by_id[base], record_id=prompt_id)
        return None


def check_resume(saved: dict[str, Any], records: int, shuffle: bool, seed: int) -> None:
    """Refuse to resume a saved cursor under another order.

    The saved position only means something in the order it was taken in: a
    different ``shuffle``/``seed`` or prompt file size would dispatch some
    prompts twice and others never. A state saved before shuffling existed reads
    as ``shuffle=False, seed=0`` with any number of records.

    Raises:
        ValueError: naming the saved and the configured values.
    """
    was_shuffled = bool(saved.get("shuffle", False))
    was_seed = int(saved.get("seed", 0))
    if was_shuffled != shuffle or (shuffle and was_seed != seed):
        raise ValueError(
            f"the saved run used data.shuffle={was_shuffled}, data.seed={was_seed}; this config "
            f"has data.shuffle={shuffle}, data.seed={seed}. Resuming in another order would "
            "dispatch some prompts twice and others never: set them back, or start without "
            "--resume")
    was_records = saved.get("records")
    if was_records is not None and int(was_records) != records:
        raise ValueError(f"the saved run had {was_records} prompts, the prompt file now holds "
                         f"{records}: its position would point elsewhere; restore the file, or "
                         "start without --resume")
