"""One service lifecycle for every tier.

Owns ``start`` / ``close(reason)`` / ``run_forever`` and the signal handling:
SIGINT and SIGTERM are turned, once, into a graceful close; the exit code
tells how the service ended (0 closed on request, 1 failed).

A :class:`Service` subclass implements ``_start`` (bind, register, spawn
background threads via :meth:`spawn`) and ``_close`` (stop them, release
resources). A background loop that dies with an unexpected exception marks
the service failed with the traceback logged; ``run_forever`` then returns 1.

:func:`serve` is every tier CLI's serving command (config, logging, run, exit code).
"""

from __future__ import annotations

import abc
import logging
import queue
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["Service", "ServiceState", "serve", "drain"]

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


def serve(prog: str, model: type, path: str | None, overrides: Sequence[str], *,
          print_only: bool, member: Callable[[Any, Any], str],
          run: Callable[[Any, Any], int], prepare: Callable[[Any], Any] | None = None,
          checks: Callable[[Any], list[str]] | None = None,
          context: Callable[[Any], Any] | None = None,
          logger: logging.Logger | None = None, failed: int = 2) -> int:
    """What every tier's serving command does, in one place; returns its exit code.

    1. Loads the config (defaults < file < ``LAMINAR_*`` < ``--set``) and applies
       ``prepare`` (refuse what cannot run, fill defaults); an error is printed as
       ``prog: ...`` and exits 2.
    2. ``print_only``: runs ``checks`` (a refusal exits 2; the warnings it returns go
       to stderr after), prints the resolved config and exits 0.
    3. ``context(config)`` (such as the trainer's process group; an error exits 2)
       gives ``ctx``, closed at the end if it has ``close``.
    4. Logging as the config says, for member ``member(config, ctx)``; the resolved
       config logged to ``logger``.
    5. ``run(config, ctx)``: builds the service and returns its ``run_forever()``; a
       :class:`LaminarError` from it is logged, printed and exits ``failed``.
    """
    from laminar_common.config import dump_config, load_config, log_resolved
    from laminar_common.errors import LaminarError
    from laminar_common.logs import setup_logging

    try:
        config = load_config(model, path, overrides)
        if prepare is not None:
            config = prepare(config)
    except LaminarError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    if print_only:
        try:  # before the dump: a refusal is then the error alone
            warnings = checks(config) if checks is not None else []
        except LaminarError as exc:
            print(f"{prog}: {exc}", file=sys.stderr)
            return 2
        print(dump_config(config))
        for line in warnings:
            print(line, file=sys.stderr)
        return 0
    try:
        ctx = context(config) if context is not None else None
    except LaminarError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    try:
        setup_logging(config.logging.level, config.job, member(config, ctx),
                      config.logging.json_format)
        log_resolved(logger or log, config, path)
        return run(config, ctx)
    except LaminarError as exc:
        (logger or log).error("%s", exc)
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return failed
    finally:
        if ctx is not None and hasattr(ctx, "close"):
            ctx.close()


def drain(events: queue.Queue) -> Iterator[Any]:
    """Every item queued now, without waiting: how a service loop takes the events its
    watch threads queued for it."""
    while True:
        try:
            yield events.get_nowait()
        except queue.Empty:
            return
