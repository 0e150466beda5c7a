"""What a worker reports of its unfinished trajectories: only the tokens the manager
does not have yet.

Each report carries, per unfinished trajectory, the tokens generated since the last
report (``PartialProgress.offset`` says where they continue), so a report costs what
was generated, not what is held. Everything is sent again, whole, to a new manager
connection, after a report that failed to send, and every ``FULL_PROGRESS_EVERY``
reports (the manager keeps a shorter, valid prefix when a continuation does not meet
its copy, and counts a gap). Up to ``PROGRESS_TOKENS_PER_REPORT`` tokens ride in the
report frame; more go as messages of their own. A conversation with tool results in it
is left out (it is generated again if its worker dies). It never references the worker
service.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any

from laminar_common.codec import PartialProgress

from .telemetry import FULL_PROGRESS_EVERY

__all__ = ["ProgressDeltas", "PROGRESS_TOKENS_PER_REPORT"]

PROGRESS_TOKENS_PER_REPORT = 1 << 20
"""Progress tokens batched into one report (~10 MB); more go as messages of their own."""


class ProgressDeltas:
    """The tokens each manager connection has of this worker's unfinished trajectories.

    Args:
        counters: the worker's counters (``progress_tokens`` is counted there).
    """

    def __init__(self, worker_id: str, counters: collections.Counter[str]) -> None:
        self.worker_id = worker_id
        self.counters = counters
        self._sent: dict[str, int] = {}
        self._to: object | None = None
        self._reports = 0

    def since_last(self, to: object, progress: Iterable[Any],
                   skip: Callable[[str], bool] = lambda _: False,
                   ) -> tuple[tuple[PartialProgress, ...], list[PartialProgress]]:
        """The tokens ``to`` (a manager connection) does not have yet, of each entry of
        ``progress`` (the engine's): those that fit one report frame and the rest."""
        if self._to is not to or self._reports % FULL_PROGRESS_EVERY == 0:
            self._sent = {}  # a new manager connection, or a periodic full report
            self._to = to
        self._reports += 1
        sent, self._sent = self._sent, {}
        batched: list[PartialProgress] = []
        extra: list[PartialProgress] = []
        budget = PROGRESS_TOKENS_PER_REPORT
        for p in progress:
            if skip(p.request_id):
                continue
            n = len(p.token_ids)
            have = sent.get(p.request_id, 0)
            if have > n:
                have = 0
            self._sent[p.request_id] = n
            if n == have:
                continue
            msg = PartialProgress(
                trajectory_id=p.request_id, worker_id=self.worker_id,
                policy_version=p.policy_version, token_ids=tuple(p.token_ids[have:]),
                logprobs=tuple(p.logprobs[have:]), offset=have)
            budget -= n - have
            (batched if budget >= 0 else extra).append(msg)
            self.counters["progress_tokens"] += n - have
        return tuple(batched), extra

    def lost(self) -> None:
        """The report did not go out: everything is sent again, whole, next time."""
        self._sent = {}
