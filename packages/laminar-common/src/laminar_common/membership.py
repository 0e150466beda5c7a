"""Membership and the weight-version registry: the :class:`Coordinator` interface.

Owns: member records bound to a lease (with keepalive), prefix watches on
members, the ``weights/latest`` singleton (compare-and-swap, monotonic),
elections (a singleton key bound to the owner's lease) and small per-job state.

Two implementations share this interface: :class:`EtcdCoordinator`
(``etcd.py``, real etcd) and :class:`InMemoryCoordinator` (this module, a twin
for unit tests that keeps the same semantics: leases, expiry, CAS, watches).

Invariants:

- ``weights/latest`` only moves forward: publishing a version <= the current
  one raises :class:`CoordinationError` and changes nothing.
- A member whose ``PROTOCOL_VERSION`` differs from the job's is refused at
  registration with :class:`ProtocolError`.
- Watch callbacks see every member change at least as a coalesced diff, even
  across etcd restarts and compaction (the watch resyncs by listing). A new
  watch starts by reporting what already exists as ``put`` events.
"""

from __future__ import annotations

import abc
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import msgspec

from laminar_common.codec import PROTOCOL_VERSION
from laminar_common.errors import CoordinationError, FencedError, ProtocolError
from laminar_common.keys import JobKeys
from laminar_common.net import host_identity

log = logging.getLogger(__name__)

__all__ = [
    "MemberRecord",
    "VersionRecord",
    "MembershipEvent",
    "WatchHandle",
    "Coordinator",
    "InMemoryEtcd",
    "InMemoryCoordinator",
    "check_protocol",
]


class MemberRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a member tells the job about itself (stored as JSON in etcd)."""

    member_id: str
    role: str
    address: str = ""
    host: str = msgspec.field(default_factory=socket.gethostname)
    """The host name, for people reading ``laminar status``; never compared."""
    host_id: str = msgspec.field(default_factory=host_identity)
    """The machine's identity (:func:`laminar_common.net.host_identity`): members with
    equal host ids are on one host and may share memory."""
    package_version: str = ""
    protocol_version: int = PROTOCOL_VERSION
    capacity: int = 0
    started_at: float = msgspec.field(default_factory=time.time)
    extra: dict[str, str] = {}

    @property
    def incarnation(self) -> tuple[str, float]:
        """Which process this is: a restarted member has a new one, a re-registration
        of the same process (after an etcd restart) keeps it."""
        return self.member_id, self.started_at


class VersionRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The latest complete weight version (``weights/latest``)."""

    version: int
    total_bytes: int = 0
    master_id: str = ""
    trainer_step: int = -1
    published_at: float = msgspec.field(default_factory=time.time)


@dataclass(frozen=True, slots=True)
class MembershipEvent:
    """A member appeared/changed (``put``) or vanished (``delete``)."""

    kind: str
    role: str
    member_id: str
    record: MemberRecord | None


_json = msgspec.json.Encoder()
_member_decoder = msgspec.json.Decoder(MemberRecord)
_version_decoder = msgspec.json.Decoder(VersionRecord)


def encode_record(record: MemberRecord | VersionRecord) -> bytes:
    return _json.encode(record)


def decode_member(raw: bytes, key: str) -> MemberRecord:
    try:
        return _member_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CoordinationError(f"member record at {key!r} is malformed: {exc}") from exc


def decode_members(items: Iterable[tuple[str, bytes]]) -> dict[str, MemberRecord]:
    """``(key, value)`` pairs under the members prefix -> records by member id; a
    malformed one is skipped with a warning naming its key."""
    out = {}
    for key, raw in items:
        try:
            rec = decode_member(raw, key)
        except CoordinationError as exc:
            log.warning("leaving out %s", exc)
            continue
        out[rec.member_id] = rec
    return out


def decode_version(raw: bytes, key: str) -> VersionRecord:
    try:
        return _version_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CoordinationError(f"version record at {key!r} is malformed: {exc}") from exc


def decode_leader(raw: bytes, key: str) -> str:
    """An election's owner value (a member id, written by ``campaign``)."""
    try:
        return raw.decode()
    except UnicodeDecodeError as exc:
        raise CoordinationError(f"election value at {key!r} is not UTF-8 text: {exc}") from exc


def check_protocol(job_protocol: int, record: MemberRecord) -> None:
    """Refuse ``record`` if it speaks another protocol than the job."""
    if record.protocol_version != job_protocol:
        raise ProtocolError(
            f"{record.role} {record.member_id!r} speaks protocol version "
            f"{record.protocol_version} but job members speak {job_protocol}: "
            "run the same major Laminar release on every tier"
        )


class WatchHandle:
    """A running watch; ``cancel()`` stops it (idempotent)."""

    def __init__(self, cancel: Callable[[], None]) -> None:
        self._cancel = cancel
        self._done = False

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            self._cancel()


class Coordinator(abc.ABC):
    """One member's view of a job's coordination state."""

    keys: JobKeys

    @abc.abstractmethod
    def register(self, record: MemberRecord) -> None:
        """Publish ``record`` under a lease kept alive until :meth:`close`.

        Raises:
            ProtocolError: the job speaks another ``PROTOCOL_VERSION``.
        """

    @abc.abstractmethod
    def update_record(self, record: MemberRecord) -> None:
        """Replace this member's record (same lease)."""

    @abc.abstractmethod
    def members(self, role: str | None = None) -> dict[str, MemberRecord]:
        """Live members (of one role, or all), keyed by member id.

        A malformed record is left out and logged (as the watch does): one bad
        value under the members prefix must not hide every other member.
        """

    @abc.abstractmethod
    def watch_members(
        self, callback: Callable[[MembershipEvent], None], role: str | None = None
    ) -> WatchHandle:
        """Call ``callback`` for each membership change (from a background thread)."""

    @abc.abstractmethod
    def latest_version(self) -> VersionRecord | None:
        """The latest complete weight version, or ``None`` before the first."""

    @abc.abstractmethod
    def publish_version(self, record: VersionRecord, fence: str | None = None) -> None:
        """Move ``weights/latest`` forward to ``record`` (compare-and-swap).

        Args:
            fence: an election this member must still hold, checked in the same
                transaction (the very key it won, not an equal value: a later holder
                of the same member id does not pass). A paused or partitioned master
                whose lease expired cannot make a version visible.

        Raises:
            FencedError: this member does not hold ``fence`` (any more).
            CoordinationError: ``record.version`` is not greater than the current.
        """

    @abc.abstractmethod
    def watch_latest(self, callback: Callable[[VersionRecord], None]) -> WatchHandle:
        """Call ``callback`` with each new latest version."""

    @abc.abstractmethod
    def campaign(self, name: str, value: str) -> bool:
        """Try to own singleton ``name`` (bound to this member's lease)."""

    @abc.abstractmethod
    def leader(self, name: str) -> str | None:
        """Current owner value of singleton ``name``, if any.

        Raises:
            CoordinationError: the stored value is not a member id (not UTF-8).
        """

    @abc.abstractmethod
    def owns(self, name: str) -> bool:
        """Whether this process holds ``name``: it won it, or the key is bound to this
        process's own lease (a campaign whose answer was lost to an etcd error is
        adopted). A previous process with the same member id never counts."""

    @abc.abstractmethod
    def election(self, name: str) -> tuple[str, int] | None:
        """``(holder, lease id)`` of singleton ``name``, if held."""

    @abc.abstractmethod
    def evict_leader(self, name: str, holder: str, lease: int | None = None) -> bool:
        """Revoke the lease of the member holding ``name`` if its value is ``holder``
        (and, given ``lease``, only if the key is still bound to that lease; never this
        member's own lease): its records and elections vanish at once, as at its lease's
        expiry. Only for a holder known to be dead (its port refuses connections, or it
        is this member's own previous process).

        Returns:
            True if a lease was revoked.
        """

    @abc.abstractmethod
    def resign(self, name: str) -> None:
        """Give up singleton ``name`` if this member owns it."""

    @abc.abstractmethod
    def get_state(self, name: str) -> bytes | None:
        """Read a small job-state value (not leased)."""

    @abc.abstractmethod
    def put_state(self, name: str, value: bytes) -> None:
        """Write a small job-state value (not leased)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Revoke the lease (records and elections vanish) and stop watches."""

    @property
    @abc.abstractmethod
    def registered(self) -> bool:
        """True while this member's record is believed to be in the store."""


# --------------------------------------------------------------------------
# In-memory twin
# --------------------------------------------------------------------------


class InMemoryEtcd:
    """A tiny in-process key-value store with leases and prefix watches.

    The unit-test twin of an etcd server: many :class:`InMemoryCoordinator`
    share one. Leases expire when :meth:`expire_lease` is called or when their
    TTL passes without a refresh (checked on every access, using ``clock``).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.RLock()
        self._clock = clock
        self._data: dict[str, tuple[bytes, int | None]] = {}
        self._leases: dict[int, tuple[float, float]] = {}
        self._next_lease = 1
        self._watchers: dict[int, tuple[str, Callable[[str, str, bytes | None], None]]] = {}
        self._next_watch = 1

    def grant(self, ttl: float) -> int:
        with self._lock:
            lease = self._next_lease
            self._next_lease += 1
            self._leases[lease] = (ttl, self._clock() + ttl)
            return lease

    def refresh(self, lease: int) -> bool:
        with self._lock:
            self._reap()
            if lease not in self._leases:
                return False
            ttl, _ = self._leases[lease]
            self._leases[lease] = (ttl, self._clock() + ttl)
            return True

    def expire_lease(self, lease: int) -> None:
        with self._lock:
            self._leases.pop(lease, None)
            self._drop_keys_of(lease)

    def _drop_keys_of(self, lease: int) -> None:
        for key in [k for k, (_, le) in self._data.items() if le == lease]:
            del self._data[key]
            self._notify(key, "delete", None)

    def _reap(self) -> None:
        now = self._clock()
        for lease in [le for le, (_, deadline) in self._leases.items() if deadline < now]:
            del self._leases[lease]
            self._drop_keys_of(lease)

    def get(self, key: str) -> bytes | None:
        with self._lock:
            self._reap()
            item = self._data.get(key)
            return None if item is None else item[0]

    def get_prefix(self, prefix: str) -> dict[str, bytes]:
        with self._lock:
            self._reap()
            return {k: v for k, (v, _) in self._data.items() if k.startswith(prefix)}

    def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        with self._lock:
            self._reap()
            if lease is not None and lease not in self._leases:
                raise CoordinationError(f"lease {lease} has expired")
            self._data[key] = (value, lease)
            self._notify(key, "put", value)

    def put_if(self, key: str, value: bytes, expected: bytes | None, lease: int | None = None) -> bool:
        """Compare-and-swap: write only if the current value equals ``expected``."""
        with self._lock:
            if self.get(key) != expected:
                return False
            self.put(key, value, lease)
            return True

    def delete(self, key: str) -> None:
        with self._lock:
            if self._data.pop(key, None) is not None:
                self._notify(key, "delete", None)

    def watch(self, prefix: str, callback: Callable[[str, str, bytes | None], None]) -> int:
        with self._lock:
            wid = self._next_watch
            self._next_watch += 1
            self._watchers[wid] = (prefix, callback)
            return wid

    def cancel(self, wid: int) -> None:
        with self._lock:
            self._watchers.pop(wid, None)

    def _notify(self, key: str, kind: str, value: bytes | None) -> None:
        for prefix, callback in list(self._watchers.values()):
            if key.startswith(prefix):
                callback(key, kind, value)


class InMemoryCoordinator(Coordinator):
    """:class:`Coordinator` over an :class:`InMemoryEtcd` (unit tests only)."""

    def __init__(self, store: InMemoryEtcd, job: str, ttl_s: float = 10.0,
                 keepalive: bool = True) -> None:
        self.store = store
        self.keys = JobKeys(job)
        self.ttl_s = ttl_s
        self.lease: int | None = None
        self._record: MemberRecord | None = None
        self._fences: dict[str, int] = {}
        """Election -> the lease it was won under (the fencing token)."""
        self._watches: list[WatchHandle] = []
        # Like the etcd coordinator, refresh the lease from a thread until close()
        # or crash(); tests that drive a fake clock turn it off.
        self._keepalive = keepalive
        self._stop_keepalive = threading.Event()
        self._crashed = False

    def register(self, record: MemberRecord) -> None:
        proto_key = self.keys.protocol()
        self.store.put_if(proto_key, str(record.protocol_version).encode(), None)
        check_protocol(int(self.store.get(proto_key) or b"0"), record)
        self.lease = self.store.grant(self.ttl_s)
        self._record = record
        self.store.put(self.keys.member(record.role, record.member_id), encode_record(record), self.lease)
        if self._keepalive:
            threading.Thread(target=self._keepalive_loop, daemon=True,
                             name=f"inmemory-keepalive-{record.member_id}").start()

    def _keepalive_loop(self) -> None:
        while not self._stop_keepalive.wait(self.ttl_s / 3):
            if not self.keepalive():
                return

    def crash(self) -> None:
        """Stop refreshing without revoking (a SIGKILL, as the store sees it): the
        lease stays until it expires, and a later :meth:`close` does not revoke it."""
        self._stop_keepalive.set()
        self._crashed = True

    def update_record(self, record: MemberRecord) -> None:
        assert self._record is not None and self.lease is not None, "register() first"
        self._record = record
        self.store.put(self.keys.member(record.role, record.member_id), encode_record(record), self.lease)

    def keepalive(self) -> bool:
        """Refresh the lease (the etcd twin does this from a thread)."""
        return self.lease is not None and self.store.refresh(self.lease)

    def members(self, role: str | None = None) -> dict[str, MemberRecord]:
        return decode_members(self.store.get_prefix(self.keys.members(role)).items())

    def watch_members(self, callback, role=None) -> WatchHandle:
        def on_change(key: str, kind: str, value: bytes | None) -> None:
            r, mid = self.keys.parse_member(key)
            callback(MembershipEvent(kind, r, mid, decode_member(value, key) if value else None))

        with self.store._lock:
            # Like the etcd watch, start by replaying what already exists.
            for key, raw in sorted(self.store.get_prefix(self.keys.members(role)).items()):
                on_change(key, "put", raw)
            wid = self.store.watch(self.keys.members(role), on_change)
        handle = WatchHandle(lambda: self.store.cancel(wid))
        self._watches.append(handle)
        return handle

    def latest_version(self) -> VersionRecord | None:
        raw = self.store.get(self.keys.weights_latest())
        return None if raw is None else decode_version(raw, self.keys.weights_latest())

    def publish_version(self, record: VersionRecord, fence: str | None = None) -> None:
        key = self.keys.weights_latest()
        with self.store._lock:
            if fence is not None:
                self._check_fence(fence)
            self._publish_locked(key, record)

    def _check_fence(self, name: str) -> None:
        held = self.store._data.get(self.keys.election(name))
        token = self._fences.get(name)
        if token is None or held is None or held[1] != token:
            raise FencedError(f"this member does not hold the {name!r} election (any more): "
                              f"now {held[0].decode() if held else 'nobody'}")

    def _publish_locked(self, key: str, record: VersionRecord) -> None:
        current_raw = self.store.get(key)
        current = None if current_raw is None else decode_version(current_raw, key)
        if current is not None and record.version <= current.version:
            raise CoordinationError(
                f"weight version {record.version} is not newer than the published "
                f"{current.version}: versions only move forward"
            )
        if not self.store.put_if(key, encode_record(record), current_raw):
            raise CoordinationError(f"lost the race to publish weight version {record.version}")
        self.store.put(self.keys.weights_version(record.version), encode_record(record))

    def watch_latest(self, callback) -> WatchHandle:
        key = self.keys.weights_latest()

        def on_change(k: str, kind: str, value: bytes | None) -> None:
            if k == key and value is not None:
                callback(decode_version(value, key))

        with self.store._lock:
            current = self.store.get(key)
            if current is not None:
                on_change(key, "put", current)
            wid = self.store.watch(key, on_change)
        handle = WatchHandle(lambda: self.store.cancel(wid))
        self._watches.append(handle)
        return handle

    def campaign(self, name: str, value: str) -> bool:
        if self.lease is None:
            raise CoordinationError("register() before campaigning")
        key = self.keys.election(name)
        with self.store._lock:
            self.store.put_if(key, value.encode(), None, self.lease)
            held = self.store._data.get(key)
            won = held is not None and held[1] == self.lease
            if won:
                self._fences[name] = self.lease
            return won

    def owns(self, name: str) -> bool:
        with self.store._lock:
            held = self.store._data.get(self.keys.election(name))
            if self.lease is not None and held is not None and held[1] == self.lease:
                self._fences[name] = self.lease  # adopt a win whose answer was lost
            token = self._fences.get(name)
            return token is not None and token == self.lease and held is not None \
                and held[1] == token

    def election(self, name: str) -> tuple[str, int] | None:
        held = self.store._data.get(self.keys.election(name))
        return None if held is None or held[1] is None else (held[0].decode(), held[1])

    def evict_leader(self, name: str, holder: str, lease: int | None = None) -> bool:
        with self.store._lock:
            held = self.store._data.get(self.keys.election(name))
            if held is None or held[0] != holder.encode() or held[1] is None \
                    or held[1] == self.lease or (lease is not None and held[1] != lease):
                return False
            self.store.expire_lease(held[1])
            return True

    def leader(self, name: str) -> str | None:
        key = self.keys.election(name)
        raw = self.store.get(key)
        return None if raw is None else decode_leader(raw, key)

    def resign(self, name: str) -> None:
        key = self.keys.election(name)
        with self.store._lock:
            if self.lease is not None and self.store._data.get(key, (None, None))[1] == self.lease:
                self.store.delete(key)

    def get_state(self, name: str) -> bytes | None:
        return self.store.get(self.keys.state(name))

    def put_state(self, name: str, value: bytes) -> None:
        self.store.put(self.keys.state(name), value)

    @property
    def registered(self) -> bool:
        return self.lease is not None and self._record is not None and self.store.get(
            self.keys.member(self._record.role, self._record.member_id)
        ) is not None

    def close(self) -> None:
        self._stop_keepalive.set()
        for handle in self._watches:
            handle.cancel()
        if self.lease is not None and not self._crashed:
            self.store.expire_lease(self.lease)
            self.lease = None
