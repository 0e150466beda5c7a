"""The trajectory consumer: the trainer's half of the trajectory protocol, for your own trainer.

A bring-your-own trainer (any framework, any loop) takes part in a Laminar job
through :class:`TrajectoryConsumer`: it binds the trajectory PULL socket,
registers it as the job's ``trainer`` member (workers find it there, and push
their whole unacked outbox to each new incarnation), checks every trajectory at
the door, drops copies by trajectory id, and sends acks and rejections to the
rollout manager, which it finds and follows across restarts through the
membership watch. This module owns that protocol; it must not train, buffer,
depend on an array library, or wait on etcd per trajectory.

Exactly-once, as the built-in trainer keeps it:

- :meth:`TrajectoryConsumer.poll` returns each trajectory id at most once over
  the consumer's life (and, with :meth:`~TrajectoryConsumer.state`, across its
  restarts). Later copies (a worker re-sending an unacked trajectory, a copy
  generated twice) are dropped and counted; a copy of an id already acked is
  acked again, so that its worker drops it.
- :meth:`~TrajectoryConsumer.ack` the ids you trained once that is durable
  for you (after your checkpoint, or at once if you keep none): the manager
  then counts them consumed. Nothing else acks for you.
- A trajectory whose contents are wrong (:func:`check_trajectory`) is never
  returned: it is counted by reason and reported to the manager, which has it
  generated again; after ``max_rejections`` copies of one id the consumer gives
  up on it for good (a *final* rejection) and later copies get that rejection
  again, never an ack.
- A new manager incarnation (a restart, at any address) gets again every ack
  and final rejection of the groups it has not settled (its restored ledger may
  predate them). Ids of groups below the manager's watermark (``settled_below``,
  carried by every trajectory) are forgotten, so memory stays flat.

What Laminar's own trainer adds, each an option of the same door:

- ``hold_final_rejections``: a final rejection waits until the checkpoint that
  records the id as failed (:meth:`~TrajectoryConsumer.state`, then
  :meth:`~TrajectoryConsumer.ack`), as acks do, so that a trainer restored from
  an older checkpoint never trains an id the manager was told it gave up on.
- :meth:`~TrajectoryConsumer.refuse` (a polled trajectory the caller finds wrong:
  counted against ``max_rejections`` like a refusal at the door),
  :meth:`~TrajectoryConsumer.release` (not taken now: its worker sends it again,
  e.g. a full buffer) and :meth:`~TrajectoryConsumer.groups_filtered` (groups the
  caller dropped as uninformative: the manager generates as many more; told again
  to a new manager incarnation).
- ``on_failed`` hears of every id given up on for good (a buffer completes its
  group without it); ``version_bound`` and ``temperature`` tighten the checks.

Threading: :meth:`poll` belongs to one thread; :meth:`ack`, :meth:`reject`,
:meth:`refuse`, :meth:`release`, :meth:`groups_filtered` and :meth:`state` may be
called from another (a training thread) and are atomic against it. The
membership watch only records the newest manager record and latest weight version.

:class:`ConsumedIds` and :func:`check_trajectory` are torch-free and public, so a
trainer built on :class:`TrajectoryConsumer` and Laminar's own trainer can share
them.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from laminar_common.auth import CurveAuth
from laminar_common.codec import Ack, GroupsFiltered, Trajectory, TrajectoryRejected
from laminar_common.consume.consumed import ConsumedIds
from laminar_common.consume.validation import Invalid, check_trajectory
from laminar_common.errors import LaminarError, TransportError
from laminar_common.membership import Coordinator, MemberRecord, MembershipEvent, VersionRecord
from laminar_common.net import Listen, endpoint_host, host_identity, is_wildcard
from laminar_common.roles import Extra, Role
from laminar_common.transport import (
    PullReceiver,
    PushSender,
    TransportStats,
    make_pull_receiver,
    make_push_sender,
)
from laminar_common.version import __version__

# ConsumedIds and check_trajectory live in their own modules (the built-in trainer uses
# them too); re-exported here because a custom trainer needs them with the consumer.
__all__ = ["TrajectoryConsumer", "ConsumerStats", "ConsumedIds", "Invalid", "check_trajectory"]

log = logging.getLogger(__name__)

_SLICE_S = 0.1
"""A waiting poll wakes this often to send what is queued (a manager may have appeared)."""
_SEND_TIMEOUT_S = 2.0
_RETRY_S = 1.0
_MAX_IDS_PER_ACK = 4096
_FILTERED_KEEP = 10_000
"""Most filtered groups remembered for a new manager incarnation."""


# -- the consumer ----------------------------------------------------------------


@dataclass
class ConsumerStats:
    """Counters of one :class:`TrajectoryConsumer`."""

    received: int = 0
    """Trajectories that arrived, every copy."""
    delivered: int = 0
    """Trajectories :meth:`~TrajectoryConsumer.poll` returned (each id once)."""
    duplicates: int = 0
    """Copies of an id already returned (or of a settled group), dropped."""
    reacked: int = 0
    """Of those, copies of an acked id, acked again so that their worker drops them."""
    rejected: collections.Counter[str] = field(default_factory=collections.Counter)
    """Copies refused by :func:`check_trajectory`, by reason."""
    failed: int = 0
    """Ids given up on for good (a final rejection)."""
    caller_rejections: int = 0
    """Ids refused through :meth:`~TrajectoryConsumer.reject`."""
    acked: int = 0
    """Ids passed to :meth:`~TrajectoryConsumer.ack`."""
    released: int = 0
    """Ids handed back through :meth:`~TrajectoryConsumer.release` (sent again later)."""
    groups_filtered: int = 0
    """Groups named to :meth:`~TrajectoryConsumer.groups_filtered`."""
    acks_sent: int = 0
    """Ids sent to a manager in acks (re-sends included)."""
    manager_switches: int = 0
    """Manager incarnations followed."""
    send_errors: int = 0
    """Sends to the manager that failed (retried)."""


class TrajectoryConsumer:
    """Receive trajectories, ack them, follow the manager: a trainer's exactly-once half.

    Constructing one binds the receiver, starts the membership watches and
    registers the ``trainer`` member record (``extra["ready"] = "1"``); from
    then on workers push to it. Use it as a context manager or call
    :meth:`close`.

    Args:
        coordinator: the job's coordinator (``make_coordinator``, or
            :meth:`connect` to have the consumer make and own one).
        member_id: the trainer's member id (one trainer per job).
        listen: where to bind the trajectory socket (``tcp://host:port``, port
            0 picks one; ``tcp://0.0.0.0:port`` every interface; ``inproc://name``
            in unit tests).
        advertise_host: the address workers are told (default: the bound
            host; required when ``listen`` binds a wildcard).
        host_id: this machine's identity in the member record (default: the
            machine id, :func:`~laminar_common.net.host_identity`).
        auth: CURVE keys (``AuthConfig.curve()``) when the job authenticates.
        vocab_size: refuse token ids at or above it (None: only negative ids).
        max_rejections: copies of one id refused by content before it is given
            up on for good.
        state: what :meth:`state` returned before a restart.
        extra: more ``MemberRecord.extra`` fields (e.g. ``Extra.METRICS``).
        owns_coordinator: close the coordinator on :meth:`close` (its lease
            goes, and the trainer record with it).
        temperature: the one sampling temperature accepted (None: any positive).
        version_bound: the newest weight version a trajectory may claim (e.g. the
            trainer's own); default: the newest published, from the watch.
        hold_final_rejections: send a final rejection only with the first
            :meth:`ack` after a :meth:`state` that records it (checkpointed
            trainers); False sends it at once.
        on_failed: called with a trajectory and the reason when its id is given
            up on for good (on the polling thread, before :meth:`poll` returns).

    Raises:
        TransportError: ``listen`` cannot be bound.
        ProtocolError: the job speaks another ``PROTOCOL_VERSION``.
    """

    def __init__(self, coordinator: Coordinator, *, member_id: str = "trainer",
                 listen: str = "tcp://127.0.0.1:0", advertise_host: str | None = None,
                 host_id: str | None = None, auth: CurveAuth | None = None,
                 vocab_size: int | None = None, max_rejections: int = 3,
                 state: Mapping[str, Any] | None = None,
                 extra: Mapping[str, str] | None = None,
                 owns_coordinator: bool = False, temperature: float | None = None,
                 version_bound: Callable[[], int | None] | None = None,
                 hold_final_rejections: bool = False,
                 on_failed: Callable[[Trajectory, str], None] | None = None) -> None:
        if max_rejections < 1:
            raise ValueError(f"max_rejections must be >= 1, got {max_rejections}")
        self.coordinator = coordinator
        self.member_id = member_id
        self.step = 0
        """Your training step; stamped on acks and rejections (the manager logs it)."""
        self.version: int | None = None
        """Your weights' version, stamped on acks (None: the newest published)."""
        self.stats = ConsumerStats()
        self._auth = auth
        self._vocab_size = vocab_size
        self._max_rejections = max_rejections
        self._owns_coordinator = owns_coordinator
        self._temperature = temperature
        self._bound = version_bound
        self._hold = hold_final_rejections
        self._on_failed = on_failed
        self._lock = threading.RLock()
        self._held: list[TrajectoryRejected] = []
        """Final rejections waiting for a checkpoint (``hold_final_rejections``)."""
        self._held_ids: set[str] = set()
        self._covered = 0
        """How many of ``_held`` the latest :meth:`state` recorded."""
        self._filtered_new: list[str] = []
        self._filtered_sent: collections.OrderedDict[str, int] = collections.OrderedDict()
        """Filtered groups (prompt id -> group_seq) told to the manager and not settled
        below its watermark: told again to a new manager incarnation."""
        self._consumed = _restore(state) if state is not None else ConsumedIds()
        self._pending: dict[str, tuple[str, int]] = {}
        """Returned by poll, not yet acked or rejected: id -> (worker, group_seq)."""
        self._reject_counts: dict[str, int] = {}
        self._to_ack: dict[str, None] = {}
        self._notes: list[TrajectoryRejected] = []
        self._acker: PushSender | None = None
        self._acker_key: tuple[str, float] | None = None
        self._manager: MemberRecord | None = None
        self._manager_changed = threading.Event()
        self._latest: int | None = None
        self._latest_read_at = 0.0
        self._retry_at = 0.0
        self._closed = False
        bound_host = endpoint_host(listen.split("://", 1)[-1]) if listen.startswith("tcp://") \
            else None
        if advertise_host is None and is_wildcard(bound_host):
            raise ValueError(f"listen {listen!r} binds every interface: give advertise_host, "
                             "the address workers reach this trainer at")
        self._receiver: PullReceiver = make_pull_receiver(listen, expect=Trajectory, auth=auth)
        self.endpoint = self._receiver.endpoint if advertise_host is None else \
            Listen(bind=bound_host or "", advertise=advertise_host).advertised(
                self._receiver.endpoint)
        """The advertised trajectory address (what workers connect to)."""
        self._watches = []
        try:
            self._watches.append(coordinator.watch_members(self._on_manager, role=Role.MANAGER))
            self._watches.append(coordinator.watch_latest(self._on_latest))
            coordinator.register(MemberRecord(
                member_id=member_id, role=Role.TRAINER, address=self.endpoint,
                host_id=host_identity(host_id), package_version=__version__,
                extra={**(extra or {}), Extra.READY: "1"}))
        except BaseException:
            self._close_sockets()
            raise
        log.info("trajectory consumer %s ready at %s", member_id, self.endpoint)

    @classmethod
    def connect(cls, etcd: str | Sequence[str], job: str, **kwargs: Any) -> TrajectoryConsumer:
        """A consumer with its own etcd coordinator (closed with it).

        Args:
            etcd: etcd endpoint(s), ``host:port``.
            job: the job name (all keys live under ``/laminar/<job>/``).
            **kwargs: as for the constructor.
        """
        from laminar_common.config import EtcdConfig
        from laminar_common.etcd import make_coordinator

        endpoints = (etcd,) if isinstance(etcd, str) else tuple(etcd)
        coordinator = make_coordinator(EtcdConfig(endpoints=endpoints), job)
        try:
            return cls(coordinator, owns_coordinator=True, **kwargs)
        except BaseException:
            coordinator.close()
            raise

    # -- receiving ---------------------------------------------------------------

    def poll(self, timeout_s: float | None = None) -> Trajectory | None:
        """The next valid trajectory not returned before, or None after ``timeout_s``.

        ``None`` blocks until one arrives. While waiting, queued acks and
        rejections go out (to a manager that appeared or restarted meanwhile).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self.flush()
            wait = _SLICE_S if deadline is None else \
                min(_SLICE_S, max(0.0, deadline - time.monotonic()))
            msg = self._receiver.recv(timeout_s=wait)
            if msg is not None:
                with self._lock:
                    out = self._admit(msg)
                if out is not None:
                    return out
            if deadline is not None and time.monotonic() >= deadline:
                self.flush()
                return None

    def _admit(self, traj: Trajectory) -> Trajectory | None:
        self.stats.received += 1
        tid = traj.trajectory_id
        invalid = check_trajectory(traj, self._vocab_size, self._version_bound(traj),
                                   self._temperature)
        # A broken copy of an id already held never counts against that id; but a
        # trajectory whose watermark is wrong must not move ours.
        if invalid is None or invalid.reason != "bad-group":
            self._consumed.advance(traj.settled_below)
            if self._consumed.covers(tid, traj.group_seq):
                self.stats.duplicates += 1
                failed = self._consumed.failed.get(tid)
                if failed is not None:
                    # Given up on already: say so again (the first notice may have found
                    # no ledger entry), never ack it; a held notice goes out when durable.
                    if tid not in self._held_ids:
                        self._notes.append(self._note(tid, traj.worker_id, failed, final=True))
                elif tid not in self._pending:
                    # A copy of something acked (its ack was lost with a manager, or it
                    # was generated twice): ack it again so that its worker drops it.
                    self._to_ack[tid] = None
                    self.stats.reacked += 1
                return None
        if invalid is not None:
            self._refuse(traj, invalid)
            return None
        self._consumed.add(tid, traj.group_seq)
        # Its refusal count stays until it is acked: refuse() after poll counts on.
        self._pending[tid] = (traj.worker_id, traj.group_seq)
        self.stats.delivered += 1
        return traj

    def _version_bound(self, traj: Trajectory) -> int | None:
        """The newest published version, from the watch; read from etcd (at most once a
        second) only when a trajectory claims a newer one than the watch has shown."""
        if self._bound is not None:
            return self._bound()
        if self._latest is not None and traj.policy_version <= self._latest:
            return self._latest
        now = time.monotonic()
        if now - self._latest_read_at >= 1.0:
            self._latest_read_at = now
            try:
                rec = self.coordinator.latest_version()
            except LaminarError as exc:
                log.warning("latest weight version unknown (etcd): %s", exc)
                rec = None
            if rec is not None:
                self._on_latest(rec)
        return self._latest

    def _refuse(self, traj: Trajectory, invalid: Invalid) -> None:
        tid = traj.trajectory_id
        self.stats.rejected[invalid.reason] += 1
        n = self._reject_counts[tid] = self._reject_counts.get(tid, 0) + 1
        final = n >= self._max_rejections
        log.warning("rejected %s (copy %d of at most %d): %s", tid, n, self._max_rejections,
                    invalid)
        note = self._note(tid, traj.worker_id, str(invalid), final)
        if not final:
            self._notes.append(note)
            return
        self._reject_counts.pop(tid, None)
        self._consumed.add(tid, traj.group_seq)
        if tid in self._consumed:
            self._consumed.failed[tid] = str(invalid)
        self.stats.failed += 1
        self._final(note)
        if self._on_failed is not None:
            self._on_failed(traj, str(invalid))

    def _final(self, note: TrajectoryRejected) -> None:
        """Queue a final rejection: at once, or held for the next checkpoint."""
        if self._hold:
            self._held.append(note)
            self._held_ids.add(note.trajectory_id)
        else:
            self._notes.append(note)

    # -- settling ----------------------------------------------------------------

    def ack(self, trajectory_ids: Iterable[str]) -> None:
        """These ids are consumed, durably for you: the manager counts them done.

        Sent at once when the manager is reachable, else as soon as it is. With
        ``hold_final_rejections``, the final rejections the latest :meth:`state`
        recorded go first.
        """
        with self._lock:
            if self._covered:
                durable, self._held = self._held[:self._covered], self._held[self._covered:]
                self._covered = 0
                self._held_ids.difference_update(n.trajectory_id for n in durable)
                self._notes.extend(durable)
            for tid in trajectory_ids:
                self._pending.pop(tid, None)
                self._reject_counts.pop(tid, None)
                self._to_ack[tid] = None
                self.stats.acked += 1
            self.flush()

    def reject(self, trajectory_id: str, reason: str, final: bool = False) -> None:
        """Refuse a trajectory :meth:`poll` returned instead of acking it.

        ``final`` False: the manager has it generated again, and the new copy is
        returned by :meth:`poll` like a new trajectory. ``final`` True: give up on
        the id (the manager records it as rejected; its group goes on without it).

        Raises:
            ValueError: the id is not one :meth:`poll` returned and not yet settled.
        """
        with self._lock:
            worker, _ = self._unsettle(trajectory_id)
            note = self._note(trajectory_id, worker, reason, final)
            if final:
                if trajectory_id in self._consumed:
                    self._consumed.failed[trajectory_id] = reason
                self.stats.failed += 1
                self._final(note)
            else:
                self._consumed.discard(trajectory_id)
                self._notes.append(note)
            self.stats.caller_rejections += 1
            self.flush()

    def refuse(self, traj: Trajectory, invalid: Invalid) -> None:
        """Refuse a trajectory :meth:`poll` returned for its contents, as the door would
        have: counted by reason, generated again, given up on after ``max_rejections``
        copies (``on_failed`` is called then).

        Raises:
            ValueError: the id is not one :meth:`poll` returned and not yet settled.
        """
        with self._lock:
            self._unsettle(traj.trajectory_id)
            self._consumed.discard(traj.trajectory_id)
            self._refuse(traj, invalid)
            self.flush()

    def release(self, trajectory_id: str) -> None:
        """Hand back a trajectory :meth:`poll` returned, untaken and unrefused (a full
        buffer): nothing is sent; its worker, still unacked, sends it again and
        :meth:`poll` returns that copy.

        Raises:
            ValueError: the id is not one :meth:`poll` returned and not yet settled.
        """
        with self._lock:
            self._unsettle(trajectory_id)
            self._consumed.discard(trajectory_id)
            self.stats.released += 1

    def _unsettle(self, trajectory_id: str) -> tuple[str, int]:
        entry = self._pending.pop(trajectory_id, None)
        if entry is None:
            raise ValueError(f"trajectory {trajectory_id!r} was not returned by poll() or is "
                             "acked or rejected already")
        return entry

    def groups_filtered(self, groups: Iterable[tuple[str, int]]) -> None:
        """Groups (prompt id, group_seq) dropped untrained as uninformative: the manager
        generates as many more (it credits each group once, however often told). Sent
        before the acks of their ids; told again to a new manager incarnation unless
        settled below its watermark."""
        with self._lock:
            for prompt_id, seq in groups:
                self.stats.groups_filtered += 1
                self._filtered_new.append(prompt_id)
                self._filtered_sent[prompt_id] = seq
                self._filtered_sent.move_to_end(prompt_id)
            watermark = self._consumed.watermark
            while self._filtered_sent and (
                    len(self._filtered_sent) > _FILTERED_KEEP
                    or 0 <= next(iter(self._filtered_sent.values())) < watermark):
                self._filtered_sent.popitem(last=False)
            self.flush()

    def _note(self, tid: str, worker: str, reason: str, final: bool) -> TrajectoryRejected:
        return TrajectoryRejected(trajectory_id=tid, worker_id=worker, reason=reason,
                                  final=final, trainer_step=self.step)

    def flush(self) -> bool:
        """Send queued acks and rejections; True when nothing is left waiting.

        A failed send is retried (at most once a second) by the next call;
        :meth:`poll`, :meth:`ack` and :meth:`reject` call this.
        """
        with self._lock:
            return self._flush()

    def _flush(self) -> bool:
        if self._manager_changed.is_set():
            # Cleared before the record is read, so a change seen meanwhile is not lost.
            self._manager_changed.clear()
            self._drop_acker()
            self._resettle()
        if not self._to_ack and not self._notes and not self._filtered_new:
            return True
        now = time.monotonic()
        if now < self._retry_at:
            return False
        acker = self._ack_sender()
        if acker is None:
            return False
        try:
            while self._notes:
                acker.send(self._notes[0])
                self._notes.pop(0)
            if self._filtered_new:
                # Before the acks (one ordered socket): the manager credits a filtered
                # group only while it still knows it.
                acker.send(GroupsFiltered(prompt_ids=tuple(self._filtered_new),
                                          trainer_step=self.step))
                self._filtered_new = []
            version = self.version if self.version is not None else self._latest
            while self._to_ack:
                ids = tuple(itertools.islice(self._to_ack, _MAX_IDS_PER_ACK))
                acker.send(Ack(trajectory_ids=ids, trainer_step=self.step,
                               trainer_version=-1 if version is None else version))
                for tid in ids:
                    del self._to_ack[tid]
                self.stats.acks_sent += len(ids)
        except TransportError as exc:
            self.stats.send_errors += 1
            self._retry_at = now + _RETRY_S
            log.warning("sending to the manager failed (retrying): %s", exc)
            self._drop_acker()
            return False
        return True

    def _resettle(self) -> None:
        """A new manager incarnation: whatever this consumer settled in groups the job
        has not settled may be missing from its ledger; send all of it again."""
        self.stats.manager_switches += 1
        failed = self._consumed.failed
        for tid in self._consumed:
            if tid not in self._pending and tid not in failed:
                self._to_ack[tid] = None
        queued = {n.trajectory_id for n in self._notes} | self._held_ids
        self._notes.extend(self._note(tid, "", reason, final=True)
                           for tid, reason in failed.items() if tid not in queued)
        watermark = self._consumed.watermark
        self._filtered_new = [p for p, seq in self._filtered_sent.items()
                              if not 0 <= seq < watermark]

    def _ack_sender(self) -> PushSender | None:
        if self._acker is None:
            rec = self._manager
            if rec is None or Extra.ACK not in rec.extra:
                return None
            self._acker = make_push_sender(rec.extra[Extra.ACK], send_timeout_s=_SEND_TIMEOUT_S,
                                           auth=self._auth)
            self._acker_key = rec.incarnation
        return self._acker

    def _drop_acker(self) -> None:
        if self._acker is not None:
            self._acker.close()
            self._acker = None

    def _on_manager(self, event: MembershipEvent) -> None:
        rec = event.record
        if event.kind == "put" and rec is not None:
            self._manager = rec
            if rec.incarnation != self._acker_key:
                self._manager_changed.set()

    def _on_latest(self, rec: VersionRecord) -> None:
        if self._latest is None or rec.version > self._latest:
            self._latest = rec.version

    # -- state -------------------------------------------------------------------

    @property
    def latest_version(self) -> int | None:
        """The newest weight version published in the job (None before the first)."""
        return self._latest

    @property
    def pending(self) -> list[str]:
        """Ids :meth:`poll` returned that are not acked or rejected yet."""
        with self._lock:
            return list(self._pending)

    @property
    def watermark(self) -> int:
        """The manager's watermark as the trajectories carried it (-1 before any)."""
        return self._consumed.watermark

    @property
    def transport_stats(self) -> TransportStats:
        """The receiving socket's counters (frames refused by reason)."""
        return self._receiver.stats

    def state(self, untrained: Iterable[str] = (), *,
              trained: Iterable[str] | None = None) -> dict[str, Any]:
        """What to save in your checkpoint (JSON-able) to restart without training twice.

        Take it when your checkpoint covers every trajectory :meth:`poll` returned
        (name the ones it does not in ``untrained``), save it with the checkpoint,
        then :meth:`ack` them: a trainer restored with ``state=`` acks again what it
        had not acked yet, and never returns those ids again.

        ``trained``: the pending ids the checkpoint covers; every other pending id
        is left out, decided atomically against a polling thread (a trajectory
        polled while you checkpoint cannot slip in). Final rejections held
        (``hold_final_rejections``) until now go out with the next :meth:`ack`.
        """
        with self._lock:
            skip = set(untrained)
            if trained is not None:
                skip |= set(self._pending) - set(trained)
            items = [(tid, seq) for tid, seq in self._consumed.items() if tid not in skip]
            self._covered = len(self._held)
            return {"consumed": [[tid, seq] for tid, seq in items],
                    "settled_below": self._consumed.watermark,
                    "failed": {t: r for t, r in self._consumed.failed.items()
                               if t not in skip}}

    # -- lifecycle ---------------------------------------------------------------

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (up to ``timeout_s``), then close the sockets and watches."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout_s
        while not self.flush() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = len(self._to_ack) + len(self._notes)
        if left:
            log.warning("closing with %d acks/rejections unsent (no manager reachable): their "
                        "workers send those trajectories to the next trainer", left)
        for handle in self._watches:
            handle.cancel()
        self._close_sockets()
        if self._owns_coordinator:
            self.coordinator.close()

    def _close_sockets(self) -> None:
        self._receiver.close()
        self._drop_acker()

    def __enter__(self) -> TrajectoryConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _restore(state: Mapping[str, Any]) -> ConsumedIds:
    """The consumed ids of a :meth:`TrajectoryConsumer.state` snapshot.

    Raises:
        ValueError: the snapshot is not one (names what is wrong).
    """
    try:
        pairs = [(str(tid), int(seq)) for tid, seq in state.get("consumed", ())]
        consumed = ConsumedIds([t for t, _ in pairs], [s for _, s in pairs],
                               int(state.get("settled_below", -1)))
        failed = {str(k): str(v) for k, v in dict(state.get("failed", {})).items()}
    except (TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"consumer state is malformed: {exc}") from exc
    consumed.failed.update({t: r for t, r in failed.items() if t in consumed})
    return consumed
