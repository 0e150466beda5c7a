"""Waiting for members to be ready, from their own etcd records.

A member says it serves by registering (or updating) its record with
``extra["ready"] = "1"`` (:class:`laminar_common.roles.Extra`). Launchers,
tools and tests wait here for that record instead of parsing stdout, so a
tier's log lines are free to change and a restarted member is seen by its
new record (its ``incarnation``), not by a line an old process printed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from laminar_common.errors import LaminarError
from laminar_common.membership import Coordinator, MemberRecord
from laminar_common.roles import is_ready

__all__ = ["wait_ready"]


def wait_ready(coordinator: Coordinator, role: str, member_id: str | None = None, *,
               count: int = 1, timeout_s: float = 60.0, interval_s: float = 0.1,
               newer_than: float = 0.0,
               alive: Callable[[], bool] | None = None) -> list[MemberRecord]:
    """Return ready records of ``role`` once enough are registered.

    Args:
        member_id: wait for this member only (else any ``count`` members).
        newer_than: only records of processes started after this time
            (``MemberRecord.started_at``), e.g. a restarted member.
        alive: checked while waiting; False (the process exited) fails fast.

    Raises:
        LaminarError: not ready within ``timeout_s``, or ``alive()`` turned False;
            the message names the role, the member and what was seen.
    """
    what = f"{role} {member_id!r}" if member_id else f"{count} {role} member(s)"
    deadline = time.monotonic() + timeout_s
    seen: dict[str, MemberRecord] = {}
    while True:
        seen = coordinator.members(role)
        ready = [r for r in seen.values()
                 if is_ready(r.extra) and r.started_at > newer_than
                 and (member_id is None or r.member_id == member_id)]
        if len(ready) >= count:
            return sorted(ready, key=lambda r: r.member_id)
        if alive is not None and not alive():
            raise LaminarError(f"{what}: the process exited before it was ready")
        if time.monotonic() > deadline:
            raise LaminarError(f"{what} not ready after {timeout_s:.0f}s; registered: "
                               f"{sorted(seen) or 'none'}")
        time.sleep(interval_s)
