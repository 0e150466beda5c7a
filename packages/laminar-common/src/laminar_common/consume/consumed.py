"""Exactly-once memory of a trajectory consumer: the ids it consumed, kept flat.

Owns :class:`ConsumedIds`: ids are kept one by one only for groups at or above
the manager's watermark (``settled_below``, which every trajectory carries:
all groups numbered below it are acked or rejected for good); a trajectory of
a group below the watermark counts as consumed without a per-id record. The
built-in trainer's buffer and :class:`~laminar_common.consume.consumer.TrajectoryConsumer`
both keep theirs here, and both checkpoint it through :meth:`ConsumedIds.items`.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator

__all__ = ["ConsumedIds"]


class ConsumedIds:
    """The trajectory ids consumed so far, compacted below the manager's watermark.

    ``watermark``: every group numbered below it is settled at the manager. Ids
    of groups at or above it (or of unnumbered groups, ``group_seq`` -1) are
    kept one by one; the rest are dropped as the watermark moves.
    """

    def __init__(self, ids: Iterable[str] = (), seqs: Iterable[int] | None = None,
                 watermark: int = -1) -> None:
        self.watermark = watermark
        self._recent: dict[str, int] = {}
        self.failed: dict[str, str] = {}
        """Ids given up on (never trained), with why: a later copy of one is answered
        with its rejection again, never with an ack."""
        self._heap: list[tuple[int, str]] = []
        ids = list(ids)
        for tid, seq in zip(ids, seqs if seqs is not None else [-1] * len(ids), strict=True):
            self.add(tid, seq)

    def add(self, tid: str, seq: int = -1) -> None:
        if seq >= 0 and seq < self.watermark:
            return
        self._recent[tid] = seq
        if seq >= 0:
            heapq.heappush(self._heap, (seq, tid))

    def discard(self, tid: str) -> None:
        """Forget ``tid`` (its copy was refused: the next one is new)."""
        self._recent.pop(tid, None)
        self.failed.pop(tid, None)

    def covers(self, tid: str, seq: int) -> bool:
        """Was ``tid`` (of group ``seq``) consumed, or is its group settled?"""
        return (0 <= seq < self.watermark) or tid in self._recent

    def advance(self, settled_below: int) -> None:
        """The manager's watermark moved: forget the ids of groups below it."""
        if settled_below <= self.watermark:
            return
        self.watermark = settled_below
        while self._heap and self._heap[0][0] < settled_below:
            _, tid = heapq.heappop(self._heap)
            self._recent.pop(tid, None)
            self.failed.pop(tid, None)  # settled at the manager: rejected for good

    def items(self) -> list[tuple[str, int]]:
        """``(id, group_seq)`` of every id kept, sorted by id (for checkpoints)."""
        return sorted(self._recent.items())

    def __contains__(self, tid: object) -> bool:
        return tid in self._recent

    def __iter__(self) -> Iterator[str]:
        return iter(self._recent)

    def __len__(self) -> int:
        return len(self._recent)
