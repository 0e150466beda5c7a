"""The rollout side of rewards: loading the configured function, and running it off
the decode loop.

The contract, the built-ins (``math``, ``gsm8k``, ``exact``, ``synthetic``) and
``module:function`` loading live in :mod:`laminar_common.data.rewards` and are
re-exported here: a reward is ``fn(prompt, completion, metadata) -> float``. The
``synthetic`` built-in (the demo's tasks) lives in the laminar-examples package; this
tier never imports it, ``synthetic_task`` resolves it through the loader on first use.

:class:`RewardPool` runs reward calls on a few threads so that a slow reward
(math-verify simplifying an expression, a remote judge) never stalls
generation. The worker submits each finished trajectory and polls for scores
on every loop turn; every submitted key comes back from ``poll``
exactly once, with ``(reward, None)``, or ``(0.0, error text)`` when the reward
raised, returned a non-finite value or ran past ``timeout_s``.

A Python thread cannot be killed. A call that runs past its timeout is given up
on: its key comes back as timed out, its late result is dropped, and its thread
is *abandoned* (left to finish on its own, then it exits) and replaced, so the
pool keeps ``workers`` threads taking work. At most ``max_abandoned`` abandoned
threads are replaced; past that the pool shrinks until one of them ends (a
reward that hangs every call would otherwise grow threads without bound, each
one competing for the GIL with the decode loop). When no thread is left to take
work, queued calls fail at once rather than wait forever.

Invariants: ``submit`` and ``poll`` never block on a reward call; ``pending`` is
the number of submitted keys ``poll`` has not returned yet.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from laminar_common.data.rewards import (
    BUILTIN_REWARDS,
    Prompt,
    RewardFn,
    exact_reward,
    load_reward_fn,
    score,
)

__all__ = [
    "BUILTIN_REWARDS",
    "RewardFn",
    "RewardPool",
    "exact_answer",
    "load_reward_fn",
    "score",
]

log = logging.getLogger(__name__)

exact_answer = exact_reward
"""Kept so the spec ``laminar_rollout.rewards:exact_answer`` still loads; the
built-in name ``exact`` is the same function."""


def __getattr__(name: str):
    """``synthetic_task``: kept so the spec ``laminar_rollout.rewards:synthetic_task`` still
    loads; it is the built-in ``synthetic`` (``load_reward_fn("synthetic")``, from the
    laminar-examples package), resolved when first asked for.

    Raises:
        ConfigError: laminar-examples is not installed (the message says to install it).
    """
    if name == "synthetic_task":
        return load_reward_fn("synthetic")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(eq=False)
class _Call:
    key: Hashable
    args: tuple[Prompt, str, Mapping[str, Any]]
    started: float = 0.0
    timed_out: bool = False
    thread: threading.Thread | None = field(default=None, repr=False)


class RewardPool:
    """Scores completions on ``workers`` threads, each call bounded by ``timeout_s``.

    Args:
        fn: the reward function (see :mod:`laminar_common.data.rewards`).
        workers: threads taking calls (>= 1).
        timeout_s: how long one call may run before its key comes back as
            ``(key, 0.0, "reward timed out after Xs")``; measured from the call's
            start, not from ``submit``, and noticed by ``poll``.
        max_abandoned: how many timed-out threads, still running, are replaced
            (see the module docstring).
    """

    def __init__(self, fn: RewardFn, workers: int, timeout_s: float,
                 max_abandoned: int = 8) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_abandoned < 0:
            raise ValueError(f"max_abandoned must be >= 0, got {max_abandoned}")
        self._fn = fn
        self._workers = workers
        self._timeout_s = timeout_s
        self._max_abandoned = max_abandoned
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: collections.deque[_Call] = collections.deque()
        self._running: set[_Call] = set()
        self._done: list[tuple[Hashable, float, str | None]] = []
        self._threads: set[threading.Thread] = set()
        self._abandoned: set[threading.Thread] = set()
        self._pending = 0
        self._spawned = 0
        self._closed = False
        self.timeouts = 0
        """Calls given up on so far (each also came back from ``poll`` as an error)."""
        with self._lock:
            self._top_up()

    @property
    def pending(self) -> int:
        """Submitted keys not yet returned by ``poll`` (queued, running or done)."""
        return self._pending

    @property
    def abandoned(self) -> int:
        """Threads still running a call that timed out."""
        return len(self._abandoned)

    def submit(self, key: Hashable, prompt: Prompt, completion: str,
               metadata: Mapping[str, Any]) -> None:
        """Queue one reward call; never blocks. ``poll`` returns ``key`` exactly once.

        Raises:
            RuntimeError: the pool is closed.
        """
        with self._wake:
            if self._closed:
                raise RuntimeError("RewardPool is closed")
            self._queue.append(_Call(key, (prompt, completion, metadata)))
            self._pending += 1
            self._wake.notify()

    def poll(self) -> list[tuple[Hashable, float, str | None]]:
        """Finished calls as ``(key, reward, error or None)``, in finishing order;
        never blocks. Also gives up on calls running past ``timeout_s``."""
        now = time.monotonic()
        with self._lock:
            for call in [c for c in self._running if now - c.started > self._timeout_s]:
                self._running.discard(call)
                call.timed_out = True
                self._threads.discard(call.thread)
                self._abandoned.add(call.thread)
                self.timeouts += 1
                self._done.append(
                    (call.key, 0.0, f"reward timed out after {self._timeout_s:g}s"))
                log.warning("reward call for %r ran past %gs; abandoning its thread "
                            "(%d abandoned)", call.key, self._timeout_s, len(self._abandoned))
            self._top_up()
            if not self._threads:
                # Every thread hangs in a call and none may be added: fail fast.
                while self._queue:
                    call = self._queue.popleft()
                    self._done.append((call.key, 0.0, (
                        f"reward pool exhausted: {len(self._abandoned)} calls still "
                        f"running past the {self._timeout_s:g}s timeout")))
            done, self._done = self._done, []
            self._pending -= len(done)
        return done

    def close(self) -> None:
        """Stop taking calls and return at once: queued calls are dropped, idle
        threads exit, running calls finish on their own and are discarded."""
        with self._wake:
            self._closed = True
            self._queue.clear()
            self._wake.notify_all()

    def _top_up(self) -> None:
        """Hold the lock. Replace lost threads, within the bound on abandoned ones."""
        limit = self._workers + self._max_abandoned
        while (not self._closed and len(self._threads) < self._workers
               and len(self._threads) + len(self._abandoned) < limit):
            self._spawned += 1
            thread = threading.Thread(target=self._run, name=f"reward-{self._spawned}",
                                      daemon=True)
            self._threads.add(thread)
            thread.start()

    def _run(self) -> None:
        me = threading.current_thread()
        while True:
            with self._wake:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if self._closed:
                    self._threads.discard(me)
                    return
                call = self._queue.popleft()
                call.started, call.thread = time.monotonic(), me
                self._running.add(call)
            try:
                reward, error = score(self._fn, *call.args)
            except BaseException as exc:  # noqa: BLE001 - SystemExit & co. in user code
                reward, error = 0.0, f"{type(exc).__name__}: {exc}"
            with self._lock:
                if call.timed_out:  # poll() gave up on it and abandoned this thread
                    self._abandoned.discard(me)
                    self._top_up()
                    return
                self._running.discard(call)
                if not self._closed:
                    self._done.append((call.key, reward, error))
