"""A worker's weights: the version to pull, fetching it from the relay tier and loading
it into the engine, only between trajectories.

:class:`WeightSync` keeps the newest version the manager asked for (``PullWeights``)
and loads it once the loop says the engine holds nothing (no running, migrating or
between-turns trajectory: every trajectory keeps the one version that made all of its
tokens). A failed fetch or load (a relay died with the version) is retried a second
later, and a newer version supersedes it; a load that does not return within
``weight_load_timeout_s`` wedges the engine (:class:`EngineWedgedError`), and the fetched
buffer is never released then (the engine may still read it). It never references the
worker service.
"""

from __future__ import annotations

import collections
import logging
import time
import warnings

from laminar_common.errors import EngineWedgedError, LaminarError

from .engines import GenerationEngine
from .engines.base import call_with_deadline
from .relay_fetch import WeightFetcher

__all__ = ["WeightSync"]

log = logging.getLogger(__name__)


class WeightSync:
    """The pull-and-load half of a worker (see module docstring).

    Args:
        counters: the worker's counters (``weight_loads``, ``weight_bytes``,
            ``weight_delta_loads``, ``pull_failed``, ``weight_load_wedged``).
        what: names the worker in a wedged load's error.
    """

    def __init__(self, engine: GenerationEngine, fetch: WeightFetcher | None,
                 load_timeout_s: float, counters: collections.Counter[str],
                 what: str = "worker", retry_s: float = 1.0) -> None:
        self.engine = engine
        self.fetch = fetch
        self.load_timeout_s = load_timeout_s
        self.counters = counters
        self.what = what
        self.retry_s = retry_s
        self.pending: int | None = None
        """The newest version asked for and not loaded yet."""
        self._retry_at = 0.0
        self.wait_s = 0.0
        """Time spent fetching and loading weights."""

    def want(self, version: int) -> bool:
        """The manager asks for ``version``; False when the engine has it already."""
        if version <= self.engine.weight_version:
            return False
        self.pending = max(self.pending or -1, version)
        return True

    def due(self) -> bool:
        """A version waits and a failed try's retry time has come."""
        return self.pending is not None and time.monotonic() >= self._retry_at

    def load_pending(self) -> bool:
        """Fetch and load the pending version (the caller checked the engine is idle);
        True when loaded, False when it failed and is retried later.

        Raises:
            EngineWedgedError: the load did not return in time (the worker must go).
        """
        version = self.pending
        try:
            self._load(version)
        except EngineWedgedError:
            self.counters["weight_load_wedged"] += 1
            raise  # fails the service: leave the job, exit 1, be restarted
        except LaminarError as exc:
            # A relay may have died with the version; a newer one will come.
            self.counters["pull_failed"] += 1
            self._retry_at = time.monotonic() + self.retry_s
            log.warning("pull of weights v%d failed (retrying in %.0fs): %s", version,
                        self.retry_s, exc)
            return False
        return True

    def _load(self, version: int) -> None:
        if self.fetch is None:
            raise LaminarError("a pull was requested but this worker has no weight source")
        t0 = time.monotonic()
        fetched = self.fetch(version)
        wedged = False

        def load() -> None:
            with warnings.catch_warnings():
                # torch.frombuffer warns on read-only (shared-memory) buffers; the
                # engine copies the values into its parameters before release().
                warnings.simplefilter("ignore", UserWarning)
                self.engine.load_weights(fetched.version, fetched.tensors)

        try:
            call_with_deadline(load, self.load_timeout_s,
                               f"{self.what}: loading weights v{fetched.version}")
        except EngineWedgedError:
            wedged = True  # the engine may still read the buffer: never release it
            raise
        finally:
            if not wedged:
                fetched.release()
        dt = time.monotonic() - t0
        self.wait_s += dt
        self.counters["weight_loads"] += 1
        self.counters["weight_bytes"] += fetched.wire_bytes
        self.counters["weight_delta_loads"] += int(fetched.delta)
        self.pending = None
        log.info("loaded weights v%d in %.3fs (%d bytes fetched%s)", fetched.version, dt,
                 fetched.wire_bytes, ", rebuilt from deltas" if fetched.delta else "")
