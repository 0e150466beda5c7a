"""One service lifecycle for every tier.

Owns ``start`` / ``close(reason)`` / ``run_forever`` and the signal handling:
SIGINT and SIGTERM are turned, once, into a graceful close; the exit code
tells how the service ended (0 closed on request, 1 failed).

A :class:`Service` subclass implements ``_start`` (bind, register, spawn
background threads via :meth:`spawn`) and ``_close`` (stop them, release
resources). A background loop that dies with an unexpected exception marks
the service failed with the traceback logged; ``run_forever`` then returns 1.
"""

from __future__ import annotations

import abc
import logging
import signal
import threading
from collections.abc import Callable

__all__ = ["Service", "ServiceState"]

log = logging.getLogger(__name__)


class ServiceState:
    NEW = "new"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"
    FAILED = "failed"


class Service(abc.ABC):
    """Base of every tier's ``<Tier>Service``."""

    name = "service"

    def __init__(self) -> None:
        self.state = ServiceState.NEW
        self.close_reason: str | None = None
        self.failure: BaseException | None = None
        self.stopping = threading.Event()
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    @abc.abstractmethod
    def _start(self) -> None:
        """Bind, register and spawn background work."""

    @abc.abstractmethod
    def _close(self) -> None:
        """Release what ``_start`` took; called once."""

    def start(self) -> Service:
        if self.state != ServiceState.NEW:
            raise RuntimeError(f"{self.name} already started (state {self.state})")
        self.state = ServiceState.RUNNING
        try:
            self._start()
        except BaseException:
            self.close("start failed")
            raise
        log.info("%s started", self.name)
        return self

    def spawn(self, target: Callable[[], None], name: str) -> threading.Thread:
        """Run ``target`` in a daemon thread; an exception fails the service."""

        def run() -> None:
            try:
                target()
            except Exception as exc:  # top of a long-lived loop
                log.exception("%s: background loop %r failed", self.name, name)
                self.fail(exc)

        thread = threading.Thread(target=run, name=f"{self.name}-{name}", daemon=True)
        self._threads.append(thread)
        thread.start()
        return thread

    def fail(self, exc: BaseException) -> None:
        """Mark the service failed and close it."""
        with self._lock:
            if self.failure is None:
                self.failure = exc
        self.close(f"failed: {exc!r}")

    def close(self, reason: str = "requested") -> None:
        """Close once; later calls return at once."""
        with self._lock:
            if self.state in (ServiceState.CLOSING, ServiceState.CLOSED, ServiceState.FAILED):
                return
            self.state = ServiceState.CLOSING
            self.close_reason = reason
        log.info("%s closing: %s", self.name, reason)
        self.stopping.set()
        # Background loops poll ``stopping``; join them before releasing what they use.
        current = threading.current_thread()
        for thread in self._threads:
            if thread is not current:
                thread.join(timeout=10)
        try:
            self._close()
        finally:
            self.state = ServiceState.FAILED if self.failure else ServiceState.CLOSED
            self._closed.set()
            log.info("%s %s", self.name, self.state)

    def wait_closed(self, timeout_s: float | None = None) -> bool:
        return self._closed.wait(timeout_s)

    def run_forever(self) -> int:
        """Start, serve until a signal or failure, close; return the exit code."""
        received: list[str] = []

        def on_signal(signum: int, _frame: object) -> None:
            if not received:
                received.append(signal.Signals(signum).name)
                self.stopping.set()

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            if self.state == ServiceState.NEW:
                self.start()
            while not self.stopping.wait(0.2):
                pass
            self.close(f"signal {received[0]}" if received else (self.close_reason or "stopped"))
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        return 1 if self.failure else 0
