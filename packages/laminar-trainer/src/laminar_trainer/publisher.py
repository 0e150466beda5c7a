"""Asynchronous weight publishing: snapshot on the training thread, send in the background.

The training loop's only stall per publish is :meth:`WeightPublisher.snapshot`
(device-to-host copy of every parameter) plus handing the snapshot to the
sender thread. The sender hands it to the master relay (``RelayClient.publish``
returns once the master holds the whole version, verified, and etcd shows it
as ``weights/latest``); the relays spread it along the chain on their own.

If a new snapshot arrives while one is still being sent, the queued one (not
the in-flight one) is replaced: only the newest weights matter, and versions
stay increasing.

Before each send the sender waits for a relay master (``find_master``), saying
so every ``log_every_s`` ("waiting for a relay master in job X (etcd ...)"),
and polls the service's ``stop`` event meanwhile: a trainer whose job has no
relay says why it does not go on, and a signal ends the wait at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from laminar_common.errors import LaminarError, PublishSuperseded

__all__ = ["WeightPublisher", "Snapshot", "snapshot_model", "snapshot_state", "torch_dtype_name",
           "relay_publisher"]

log = logging.getLogger(__name__)


def torch_dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the wire name of a dtype)."""
    return str(dtype).removeprefix("torch.")


@dataclass
class Snapshot:
    version: int
    step: int
    tensors: list[tuple[str, str, tuple[int, ...], memoryview]]
    nbytes: int
    taken_s: float


def snapshot_model(model: torch.nn.Module, version: int, step: int,
                   dtype: torch.dtype | None = None) -> Snapshot:
    """Copy every parameter to host memory (the stall the trainer pays), its floating
    tensors cast to ``dtype`` (on their device first: a bf16 snapshot moves half the
    bytes)."""
    return snapshot_state(model.state_dict(), version, step, dtype=dtype)


def snapshot_state(state: dict[str, torch.Tensor], version: int, step: int,
                   gathered_s: float = 0.0, copy: bool = True,
                   dtype: torch.dtype | None = None) -> Snapshot:
    """A snapshot of a state dict (host copies); ``gathered_s`` counts into its time
    (an FSDP trainer gathers the full state first). ``copy=False`` takes CPU tensors
    as they are: only for a state nothing else holds or changes (a fresh gather).
    ``dtype``: cast floating-point tensors to it (None: as they are); the manifest
    carries each tensor's dtype."""
    t0 = time.perf_counter()
    tensors = []
    nbytes = 0
    for name, param in state.items():
        param = param.detach()
        if dtype is not None and param.is_floating_point() and param.dtype != dtype:
            param = param.to(dtype)  # a new tensor: no second copy below
            host = param.to("cpu").contiguous().reshape(-1)
        else:
            host = param.to("cpu", copy=copy).contiguous().reshape(-1)
        view = memoryview(host.view(torch.uint8).numpy()) if host.numel() else memoryview(b"")
        tensors.append((name, torch_dtype_name(param.dtype), tuple(param.shape), view))
        nbytes += view.nbytes
    return Snapshot(version, step, tensors, nbytes, gathered_s + time.perf_counter() - t0)


@dataclass
class PublishStats:
    published: int = 0
    coalesced: int = 0
    superseded: int = 0
    """Versions given up after a failed send because a newer one was waiting."""
    failed: int = 0
    last_version: int = -1
    last_step: int = -1
    """The trainer step of the newest version the master relay took."""
    failing_since: float | None = None
    """Monotonic time of the first failed send since the last good one (None: none)."""
    stall_s: list[float] = field(default_factory=list)
    send_s: list[float] = field(default_factory=list)


class WeightPublisher:
    """Owns one sender thread; ``publish_fn(version, tensors, step)`` does the send.

    Args:
        find_master: called before each send until it returns (e.g.
            ``RelayClient.master``); a :class:`LaminarError` means no master yet.
            None: send at once.
        stop: the service's stop event: set, it ends a wait for a master and
            :meth:`wait_idle` returns False at once.
        waiting_for: where the master is looked for, for the log line
            (``"job 'laminar' (etcd 127.0.0.1:2379)"``).
        log_every_s: how often a wait for a master is logged.
        poll_s: how often a wait looks for a master (and at ``stop``).
        on_close: called once the sender thread ended (closes what ``publish_fn`` uses).
    """

    def __init__(self, publish_fn, *, find_master: Callable[[], object] | None = None,
                 stop: threading.Event | None = None, waiting_for: str = "this job",
                 log_every_s: float = 10.0, poll_s: float = 0.5,
                 on_close: Callable[[], None] | None = None) -> None:
        self._publish_fn = publish_fn
        self._on_close = on_close
        self._find_master = find_master
        self._stop = stop if stop is not None else threading.Event()
        self._waiting_for = waiting_for
        self._log_every_s = log_every_s
        self._poll_s = poll_s
        self._cond = threading.Condition()
        self._pending: Snapshot | None = None
        self._busy = False
        self._waiting = False
        """The sender is waiting for a master (nothing of the version sent yet)."""
        self._closed = False
        self.stats = PublishStats()
        self._thread = threading.Thread(target=self._run, name="weight-publisher", daemon=True)
        self._thread.start()

    def submit(self, snap: Snapshot) -> float:
        """Queue a snapshot for sending; returns the stall (snapshot + hand-off) in seconds."""
        t0 = time.perf_counter()
        with self._cond:
            if self._pending is not None:
                self.stats.coalesced += 1
            self._pending = snap
            self._cond.notify_all()
        stall = snap.taken_s + (time.perf_counter() - t0)
        self.stats.stall_s.append(stall)
        return stall

    def idle(self) -> bool:
        """Nothing is being sent or waits to be."""
        with self._cond:
            return self._pending is None and not self._busy

    def hold(self, step: int, version: Callable[[], int], limit: int, publish_every: int,
             resend: Callable[[], None], say_every_s: float = 5.0) -> bool:
        """Wait while the trainer at ``step`` is more than ``limit`` steps
        (``max_unpublished_steps``, plus the steps between publishes) ahead of the newest
        version the relays took, saying so on the console; while idle with ``version()``
        unpublished, ``resend()`` (at most once a second). False if the stop event is set."""
        allowed = limit + publish_every - 1
        t0 = said = None
        resent = 0.0
        while step - max(self.stats.last_step, 0) > allowed and not self._stop.is_set():
            now = time.monotonic()
            if said is None or now - said >= say_every_s:
                t0, said = t0 or now, now
                print(f"PAUSED at step {step} for {now - t0:.0f}s: the newest weights the "
                      f"relays took are v{self.stats.last_version} (step "
                      f"{self.stats.last_step}), more than max_unpublished_steps={limit} "
                      "behind; "
                      "training goes on once publishing recovers (the publisher's warnings "
                      "say why it fails)", flush=True)
            if self.idle() and self.stats.last_version < version() and now - resent >= 1.0:
                resent = now
                resend()
            self._stop.wait(0.05)
        if t0 is not None and not self._stop.is_set():
            print(f"RESUMED at step {step} after {time.monotonic() - t0:.1f}s paused: "
                  f"weights v{self.stats.last_version} published", flush=True)
        return not self._stop.is_set()

    def has_newer(self) -> bool:
        """A newer snapshot waits behind the one being sent (a send that keeps failing
        may give its version up for it: ``RelayClient.publish(superseded=...)``)."""
        return self._pending is not None

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return
                snap, self._pending = self._pending, None
                self._busy = True
            try:
                if not self._wait_for_master(snap.version):
                    with self._cond:  # stopped (the service closes): the version stays unsent
                        self._pending = self._pending or snap
                    return
                t0 = time.perf_counter()
                self._publish_fn(snap.version, snap.tensors, snap.step)
                self.stats.published += 1
                self.stats.last_version = snap.version
                self.stats.last_step = snap.step
                self.stats.failing_since = None
                self.stats.send_s.append(time.perf_counter() - t0)
                log.info("published weights v%d (%.1f MB) in %.3fs", snap.version,
                         snap.nbytes / 1e6, time.perf_counter() - t0)
            except PublishSuperseded as exc:
                self.stats.superseded += 1
                self.stats.failing_since = self.stats.failing_since or time.monotonic()
                log.warning("weights v%d not published, a newer version goes instead: %s",
                            snap.version, exc)
            except Exception:  # top of a long-lived loop: keep training, log the failure
                self.stats.failed += 1
                self.stats.failing_since = self.stats.failing_since or time.monotonic()
                log.exception("publishing weights v%d failed", snap.version)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _wait_for_master(self, version: int) -> bool:
        """Until ``find_master`` answers (True) or ``stop`` is set (False); logs the wait."""
        if self._find_master is None:
            return True
        t0 = time.monotonic()
        next_log = t0
        self._waiting = True
        try:
            while not self._stop.is_set():
                try:
                    self._find_master()
                except LaminarError as exc:
                    problem = exc
                else:
                    if next_log > t0:
                        log.info("relay master found after %.0fs; publishing weights v%d",
                                 time.monotonic() - t0, version)
                    return True
                now = time.monotonic()
                if now >= next_log:
                    log.warning("waiting for a relay master in %s to publish weights v%d "
                                "(%.0fs so far): %s", self._waiting_for, version, now - t0,
                                problem)
                    next_log = now + self._log_every_s
                self._stop.wait(self._poll_s)
            return False
        finally:
            self._waiting = False

    def wait_idle(self, timeout_s: float) -> bool:
        """Until nothing is queued or being sent (True), or ``timeout_s`` passes (False).

        With ``stop`` set, returns False at once unless a send is under way: a wait
        for a master is not worth a stop's time, a version half sent is."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending is not None or self._busy:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set() and (
                        self._waiting or not self._thread.is_alive()):
                    return False
                self._cond.wait(min(left, self._poll_s))
            return True

    def close(self, timeout_s: float = 60.0) -> None:
        self.wait_idle(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
        if self._on_close is not None and not self._thread.is_alive():
            on_close, self._on_close = self._on_close, None
            on_close()


def relay_publisher(config, coordinator, stop: threading.Event, curve=None) -> WeightPublisher:
    """A :class:`WeightPublisher` handing versions to the job's master relay through the
    publish half of the relay client (:class:`~laminar_common.relay.writer.RelayPublisher`,
    closed with it): TLS from ``auth.dir``, CURVE keys ``curve`` (``auth.curve()``), deltas
    every ``publish_delta_full_every``, and a version given up when a newer one waits."""
    from laminar_common.auth import TlsFiles
    from laminar_common.relay.writer import RelayPublisher

    tls = TlsFiles.client_from_dir(config.auth.dir, "publisher") if config.auth.dir else None
    client = RelayPublisher(coordinator, client_id=config.trainer_id, tls=tls,
                            curve=curve, host=config.host,
                            delta_full_every=config.publish_delta_full_every)
    made: list[WeightPublisher] = []

    def publish(version, tensors, step):
        return client.publish(version, tensors, trainer_step=step,
                              superseded=lambda: bool(made) and made[0].has_newer())

    made.append(WeightPublisher(
        publish, find_master=client.master, stop=stop, on_close=client.close,
        waiting_for=f"job {config.job!r} (etcd {', '.join(config.etcd.endpoints)})"))
    return made[0]
