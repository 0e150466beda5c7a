"""The relay chain: who forwards to whom, and the pipelined forwarding itself.

Owns the chain order (a pure function of etcd membership and the master
election) and :class:`ChainForwarder`, which pushes versions from this
relay's store to its downstream relay.

Order: the master first, then the other live relays by registration time
(``MemberRecord.started_at``), ties broken by member id. Every relay computes
the same order from the same membership, so relay i's downstream is relay
i+1; a relay that dies drops out when its lease expires, and the relays
around it are joined.

Forwarding is pipelined: chunk k of a version goes downstream as soon as it
is stored and verified here, while later chunks are still arriving, so a
broadcast takes about size/bandwidth + hops x chunk/bandwidth. The
downstream commit is sent only once the version is sealed here (on the master:
once it is visible in etcd), so no relay seals a version its upstream did not.
The publish protocol itself (begin, chunks, commit, abort) is
:class:`~laminar_common.relay.publish.PublishSession`, the same one a
publisher uses; this module only supplies the chunks, read from the store.

Invariants:

- One forwarding thread per relay; versions go downstream one at a time in
  increasing order. When several are pending, only the newest is sent (older
  ones are superseded; readers want the newest), with the versions it is
  rebuilt from when it is a delta (its base chain down to a full version).
- When the downstream changes, the new downstream is offered the newest
  version here and its base chain (catch-up); a relay that already holds a
  version declines it.
- A failed forward never affects this relay's own store or its readers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from laminar_common.auth import CurveAuth
from laminar_common.errors import LaminarError, TransportError
from laminar_common.membership import MemberRecord
from laminar_common.relay.proto import relay_pb2, relay_pb2_grpc
from laminar_common.relay.publish import (
    Chunk,
    ChunkSenders,
    PublishRefused,
    PublishSession,
    PublishWithdrawn,
)

from .store import IncomingVersion, StoredVersion, WeightStore

__all__ = ["order_chain", "neighbours", "ChainForwarder"]

log = logging.getLogger(__name__)

_MAX_ATTEMPTS = 3


def order_chain(members: Mapping[str, MemberRecord], master_id: str | None) -> list[MemberRecord]:
    """The chain: the master first, then by ``(started_at, member_id)``."""
    rest = sorted(
        (m for mid, m in members.items() if mid != master_id),
        key=lambda m: (m.started_at, m.member_id),
    )
    head = [members[master_id]] if master_id is not None and master_id in members else []
    return head + rest


def neighbours(
    chain: Sequence[MemberRecord], member_id: str
) -> tuple[MemberRecord | None, MemberRecord | None]:
    """``(upstream, downstream)`` of ``member_id`` in ``chain`` (None at the ends or if absent)."""
    ids = [m.member_id for m in chain]
    if member_id not in ids:
        return None, None
    i = ids.index(member_id)
    return (chain[i - 1] if i > 0 else None), (chain[i + 1] if i + 1 < len(chain) else None)


class ChainForwarder:
    """Forwards versions from ``store`` to the current downstream relay, pipelined.

    Args:
        store: this relay's store (chunks are read from it without copies).
        member_id: this relay's id (the sender id downstream sees).
        make_stub: gRPC stub for a relay address.
        send_hwm / send_timeout_s: data-plane backpressure and send deadline.
        rpc_timeout_s: deadline of Begin/Abort calls downstream.
        commit_timeout_s: deadline of the downstream commit.
        max_bytes_per_s: pace the data plane to this rate (0: unlimited).
        poll_s: how often a waiting forward re-checks for a chain change.
    """

    def __init__(
        self,
        store: WeightStore,
        member_id: str,
        make_stub: Callable[[str], relay_pb2_grpc.RelayStub],
        *,
        send_hwm: int = 8,
        send_timeout_s: float = 10.0,
        rpc_timeout_s: float = 10.0,
        commit_timeout_s: float = 60.0,
        max_bytes_per_s: int = 0,
        poll_s: float = 0.2,
        curve: CurveAuth | None = None,
    ) -> None:
        self._store = store
        self.member_id = member_id
        self._make_stub = make_stub
        self._rpc_timeout_s = rpc_timeout_s
        self._commit_timeout_s = commit_timeout_s
        self._rate = max_bytes_per_s
        self._poll_s = poll_s
        self._cond = threading.Condition()
        self._downstream: MemberRecord | None = None
        self._pending: dict[int, int] = {}  # version -> attempts so far
        self._stop = threading.Event()
        self._senders = ChunkSenders(hwm=send_hwm, send_timeout_s=send_timeout_s, auth=curve)
        self.forwarded_version = -1
        self.forwarding: int | None = None
        self.forwarded_total = 0
        self._thread = threading.Thread(target=self._run, name=f"forward-{member_id}", daemon=True)

    def start(self) -> ChainForwarder:
        self._thread.start()
        return self

    @property
    def downstream(self) -> MemberRecord | None:
        with self._cond:
            return self._downstream

    def set_downstream(self, member: MemberRecord | None) -> None:
        """Point the chain at a new downstream (and offer it the newest version)."""
        with self._cond:
            old = self._downstream
            same = (old is None and member is None) or (
                old is not None
                and member is not None
                and (old.member_id, old.address, old.started_at)
                == (member.member_id, member.address, member.started_at)
            )
            if same:
                return
            self._downstream = member
            log.info(
                "chain: downstream of %s is now %s",
                self.member_id,
                member.member_id if member else "nobody",
            )
            if member is not None:
                candidates = self._store.versions() + self._store.receiving()
                if candidates:
                    for v in self._store.chain(max(candidates)):
                        self._pending.setdefault(v, 0)
            self._cond.notify_all()

    def offer(self, version: int) -> None:
        """A version started arriving here (or was sealed): forward it downstream."""
        with self._cond:
            self._pending.setdefault(version, 0)
            self._cond.notify_all()

    def _changed(self, target: MemberRecord) -> bool:
        with self._cond:
            return self._stop.is_set() or self._downstream is not target

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                while not self._stop.is_set() and not (self._pending and self._downstream):
                    self._cond.wait()
                if self._stop.is_set():
                    return
                # The newest pending version, preceded by the versions it is rebuilt
                # from (a delta's base chain); older pending versions are superseded.
                top = max(self._pending)
                needed = set(self._store.chain(top))
                for old in [v for v in self._pending if v not in needed]:
                    del self._pending[old]
                for v in needed:
                    if self.forwarded_version < v < top:
                        self._pending.setdefault(v, 0)
                version = min(self._pending)
                attempts = self._pending.pop(version)
                target = self._downstream
                assert target is not None
                self.forwarding = version
            try:
                self._forward(version, target)
            except LaminarError as exc:
                log.warning(
                    "forwarding version %d to %s failed (attempt %d): %s",
                    version,
                    target.member_id,
                    attempts + 1,
                    exc,
                )
                if attempts + 1 < _MAX_ATTEMPTS and not self._changed(target):
                    self._stop.wait(0.2 * (attempts + 1))
                    with self._cond:
                        self._pending.setdefault(version, attempts + 1)
            except Exception:  # top of a long-lived loop: log, keep forwarding later versions
                log.exception(
                    "forwarding version %d to %s failed unexpectedly", version, target.member_id
                )
            finally:
                with self._cond:
                    self.forwarding = None

    def _forward(self, version: int, target: MemberRecord) -> None:
        handle = self._store.follow(version)
        if handle is None:
            log.debug("version %d is gone before it could be forwarded", version)
            return
        first = self._store.progress(handle, 0, 0.0)
        if first.state == "aborted":
            return
        what = f"forward of version {version} to relay {target.member_id}"
        session = PublishSession(
            self._make_stub(target.address),
            first.manifest,
            origin=relay_pb2.ORIGIN_RELAY,
            sender_id=self.member_id,
            senders=self._senders,
            what=what,
            rpc_timeout_s=self._rpc_timeout_s,
            commit_timeout_s=self._commit_timeout_s + self._rpc_timeout_s,
        )
        try:
            reply = session.run(self._chunks(handle, target, what))
        except PublishRefused as exc:
            log.debug("%s skipped: %s", what, exc.reason)
            return
        if reply is None:
            return
        self.forwarded_version = max(self.forwarded_version, reply.version)
        log.info("forwarded version %d to %s", reply.version, target.member_id)

    def _chunks(
        self, handle: IncomingVersion | StoredVersion, target: MemberRecord, what: str
    ) -> Iterator[Chunk]:
        """The chunks of ``handle`` as they are stored here, paced, until it is sealed.

        Raises:
            TransportError: the chain changed or this relay is shutting down.
            PublishWithdrawn: the version was dropped here (abort downstream, no retry).
        """
        pos = 0
        pace_t = time.monotonic()
        while True:
            if self._changed(target):
                raise TransportError(f"{what}: the chain changed")
            p = self._store.progress(handle, pos, self._poll_s)
            if p.state == "aborted":
                log.info("%s stopped: the version was dropped here (%s)", what, p.reason)
                raise PublishWithdrawn(f"dropped upstream: {p.reason}")
            for index in p.new:
                spec = p.manifest.chunks[index]
                digest = p.digests[index]
                assert digest is not None
                yield index, digest, p.view[spec.offset : spec.offset + spec.nbytes]
                pos += 1
                self.forwarded_total += spec.nbytes
                if self._rate:
                    pace_t = max(pace_t, time.monotonic()) + spec.nbytes / self._rate
                    if self._stop.wait(max(0.0, pace_t - time.monotonic())):
                        raise TransportError(f"{what}: relay shutting down")
            if p.state == "sealed" and pos >= len(p.manifest.chunks):
                return

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=10.0)
        self._senders.close()
