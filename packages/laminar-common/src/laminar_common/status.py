"""Status snapshots to etcd off the caller's thread: :class:`StatusWriter`.

Owns one daemon thread that writes small job-state values
(``Coordinator.put_state``) for ``laminar status``. Callers on a per-step path
(the trainer's step loop, the manager's scheduling loop) only hand over the
newest value, which never blocks: while etcd is slow, paused or unreachable,
writes for the same name coalesce (only the newest is kept) and the caller
goes on. Failures are counted and logged (the first, then every 100th), never
raised.
"""

from __future__ import annotations

import logging
import threading

from laminar_common.errors import LaminarError

__all__ = ["StatusWriter"]

log = logging.getLogger(__name__)


class StatusWriter:
    """Coalescing background writer of ``put_state(name, value)``."""

    def __init__(self, coordinator, what: str = "status") -> None:
        self._coordinator = coordinator
        self._what = what
        self._cond = threading.Condition()
        self._pending: dict[str, bytes] = {}
        self._closed = False
        self._busy = False
        self.written = 0
        self.coalesced = 0
        self.failed = 0
        self._thread = threading.Thread(target=self._run, name=f"{what}-writer", daemon=True)
        self._thread.start()

    def put(self, name: str, value: bytes) -> None:
        """Queue ``value`` for ``name`` (replacing one not yet written); never blocks on etcd."""
        with self._cond:
            if name in self._pending:
                self.coalesced += 1
            self._pending[name] = value
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closed)
                if not self._pending:
                    return
                batch, self._pending = self._pending, {}
                self._busy = True
            for name, value in batch.items():
                try:
                    self._coordinator.put_state(name, value)
                    self.written += 1
                except LaminarError as exc:
                    self.failed += 1
                    if self.failed == 1 or self.failed % 100 == 0:
                        log.warning("could not write the %s snapshot %r to etcd (%d failures; "
                                    "the newest value is written when etcd answers): %s",
                                    self._what, name, self.failed, exc)
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until everything queued was attempted (for tests and shutdown)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._busy, timeout=timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (waiting at most ``timeout_s``) and stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=timeout_s)
