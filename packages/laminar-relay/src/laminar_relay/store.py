"""The versioned weight store of one relay, in host memory.

Owns every weight version this relay holds or is receiving: their buffers,
publish sessions (a version being received chunk by chunk), reader leases,
retention and the memory cap.

Invariants:

- A version becomes readable only when sealed: every chunk arrived, matched
  its checksum and the sender's commit, and (on the master) ``before_seal``
  (the etcd publish) succeeded. Readers never see a partial version.
- Sealed versions are immutable and only move forward: a version not newer
  than the newest sealed one is refused (duplicate or regression).
- Retention keeps the newest ``keep_versions`` sealed versions; an older one is
  dropped as soon as no reader lease holds it, never while one does.
- Memory held (sealed versions plus sessions' reservations) stays within
  ``max_bytes``; a version that does not fit raises :class:`StoreFullError`.
- Chunk bytes are written outside the lock into disjoint ranges of a session's
  buffer; all bookkeeping happens under the one condition variable.

Buffers come from :mod:`laminar_relay.memory` (``memfd`` shared memory that
same-host readers map, or heap memory).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from laminar_common.codec import ChunkSpec, WeightManifest
from laminar_common.errors import LaminarError, ProtocolError
from laminar_common.relay.manifests import digest_of, validate_manifest
from laminar_common.relay.wire import (
    ChecksumError,
    CommitTimeoutError,
    OversizedError,
    StoreFullError,
    VersionConflictError,
    VersionNotFoundError,
)

from .memory import VersionBuffer

__all__ = [
    "IncomingVersion",
    "StoredVersion",
    "Progress",
    "WeightStore",
    "UnknownSessionError",
]

log = logging.getLogger(__name__)

_PAGE = 4096
_MAX_SPARES = 2
_SPARE_DELAY_S = 0.3


class UnknownSessionError(ProtocolError):
    """A chunk or commit names a publish session this relay does not have open."""


@dataclass(eq=False)
class StoredVersion:
    """A sealed, immutable version."""

    manifest: WeightManifest
    buffer: VersionBuffer
    arrived: tuple[int, ...]
    sealed_at: float
    """Unix time of sealing (comparable across relays on one host)."""
    begun_at: float = 0.0
    """Unix time the session opened (``begin``)."""
    first_chunk_at: float = 0.0
    """Unix time its first chunk was stored."""

    @property
    def version(self) -> int:
        return self.manifest.version


@dataclass(eq=False)
class IncomingVersion:
    """An open publish session: a version arriving chunk by chunk."""

    token: bytes
    layout: WeightManifest
    sender_id: str
    from_relay: bool
    buffer: VersionBuffer
    expected: tuple[bytes | None, ...]
    last_activity: float
    digests: list[bytes | None] = field(default_factory=list)
    claimed: set[int] = field(default_factory=set)
    arrived: list[int] = field(default_factory=list)
    state: str = "open"
    failed: LaminarError | None = None
    stored: StoredVersion | None = None
    begun_at: float = field(default_factory=time.time)
    first_chunk_at: float = 0.0

    @property
    def version(self) -> int:
        return self.layout.version


@dataclass(frozen=True)
class Progress:
    """What a forwarder may send next of a version it follows."""

    state: str
    """``open`` (still arriving), ``sealed`` or ``aborted``."""
    new: tuple[int, ...]
    """Chunk indices that arrived since the position asked for, in arrival order."""
    digests: tuple[bytes | None, ...]
    manifest: WeightManifest
    """The layout while open; the final manifest (with checksums) once sealed."""
    view: memoryview
    reason: str = ""


@dataclass
class _Lease:
    lease_id: str
    version: int
    holder: str
    deadline: float


def _hex_to_digest(checksum: str) -> bytes | None:
    return bytes.fromhex(checksum) if checksum else None


class WeightStore:
    """Versions held by one relay (thread-safe).

    Args:
        allocate: buffer factory (:func:`laminar_relay.memory.make_allocator`).
        max_bytes: memory cap for all versions and open sessions.
        max_version_bytes: largest version accepted.
        keep_versions: retention K.
        max_tensors: largest tensor count a manifest may list.
        replace_idle_s: a session from another relay that has been idle this
            long may be replaced by a new one for the same version.
        verify_forwarded: checksum chunks that come from an upstream relay
            (chunks from a publisher are always checksummed).
        clock: monotonic clock (injectable for tests).
        name: prefix of buffer names (shows in ``/proc/<pid>/fd``).
        prefault: after a version is sealed, prepare a buffer of its size for the
            next one in the background, its pages already faulted in. A fresh
            256 MiB buffer costs ~0.18 s of page faults on first write here, 7x the
            copy itself; a used one is never recycled (a reader may still map it).
            Spare buffers count against ``max_bytes`` and are freed first when
            room is needed; at most :data:`_MAX_SPARES` (one per size) are kept.
    """

    def __init__(
        self,
        allocate: Callable[[int, str], VersionBuffer],
        *,
        max_bytes: int,
        max_version_bytes: int,
        keep_versions: int = 2,
        max_tensors: int = 1_000_000,
        replace_idle_s: float = 1.0,
        verify_forwarded: bool = True,
        clock: Callable[[], float] = time.monotonic,
        name: str = "laminar-relay",
        prefault: bool = True,
    ) -> None:
        if keep_versions < 1:
            raise ValueError(f"keep_versions must be >= 1, got {keep_versions}")
        self._allocate = allocate
        self.max_bytes = max_bytes
        self.max_version_bytes = max_version_bytes
        self.keep_versions = keep_versions
        self.max_tensors = max_tensors
        self.replace_idle_s = replace_idle_s
        self.verify_forwarded = verify_forwarded
        self._clock = clock
        self._name = name
        self._cond = threading.Condition()
        self._sealed: dict[int, StoredVersion] = {}
        self._sessions: dict[bytes, IncomingVersion] = {}
        self._leases: dict[str, _Lease] = {}
        self._pins: collections.Counter[int] = collections.Counter()
        self._used = 0
        self._closed = False
        self.prefault = prefault
        self._spares: dict[int, VersionBuffer] = {}  # size -> never-used buffer
        self._preparing: set[int] = set()

    # -- queries ------------------------------------------------------------

    def newest(self) -> StoredVersion | None:
        with self._cond:
            return self._sealed[max(self._sealed)] if self._sealed else None

    def get(self, version: int) -> StoredVersion | None:
        with self._cond:
            return self._sealed.get(version)

    def versions(self) -> list[int]:
        with self._cond:
            return sorted(self._sealed)

    def receiving(self) -> list[int]:
        with self._cond:
            return sorted({s.version for s in self._sessions.values()})

    def chain(self, version: int) -> list[int]:
        """``version`` and, if it is a delta, the versions held here that it needs to be
        rebuilt: its base, the base's base, ... down to a full version (ascending).
        Stops early where a base is not held here."""
        with self._cond:
            return self._chain_locked(version)

    def _chain_locked(self, version: int) -> list[int]:
        out = [version]
        manifest = self._manifest_locked(version)
        while manifest is not None and manifest.full is not None:
            base = manifest.base_version
            manifest = self._manifest_locked(base)
            if manifest is None:
                break
            out.append(base)
        return sorted(out)

    def _manifest_locked(self, version: int) -> WeightManifest | None:
        if version in self._sealed:
            return self._sealed[version].manifest
        for s in self._sessions.values():
            if s.version == version:
                return s.layout
        return None

    def stats(self) -> dict[str, object]:
        with self._cond:
            self._expire_leases_locked()
            return {
                "versions": sorted(self._sealed),
                "sealed_at": {v: st.sealed_at for v, st in self._sealed.items()},
                "begun_at": {v: st.begun_at for v, st in self._sealed.items()},
                "first_chunk_at": {v: st.first_chunk_at for v, st in self._sealed.items()},
                "receiving": sorted({s.version for s in self._sessions.values()}),
                "used_bytes": self._used,
                "max_bytes": self.max_bytes,
                "readers": len(self._leases),
            }

    def session(self, token: bytes) -> IncomingVersion:
        with self._cond:
            s = self._sessions.get(token)
            if s is None:
                raise UnknownSessionError(
                    "unknown publish session (never opened here, already committed, aborted "
                    "or expired)"
                )
            return s

    # -- publish sessions ---------------------------------------------------

    def begin(self, layout: WeightManifest, *, sender_id: str, from_relay: bool) -> IncomingVersion:
        """Open a session to receive ``layout.version``.

        Raises:
            OversizedError: the version or its manifest is over the limits.
            ProtocolError: the manifest is malformed.
            VersionConflictError: the version is not newer than the newest
                sealed one, is being committed, or (from a relay) another
                relay is actively sending it.
            StoreFullError: it does not fit in ``max_bytes`` even after
                dropping every version no reader holds (except the newest).
        """
        v = layout.version
        if layout.total_bytes > self.max_version_bytes:
            raise OversizedError(
                f"version {v} is {layout.total_bytes} bytes; this relay accepts at most "
                f"{self.max_version_bytes} (store.max_version_bytes)"
            )
        if len(layout.tensors) > self.max_tensors:
            raise OversizedError(
                f"version {v} lists {len(layout.tensors)} tensors; this relay accepts at most "
                f"{self.max_tensors} (store.max_tensors)"
            )
        validate_manifest(layout, require_checksums=False)
        with self._cond:
            if self._closed:
                raise LaminarError("the weight store is closed")
            self._check_newer_locked(v)
            now = self._clock()
            for other in [s for s in self._sessions.values() if s.version == v]:
                if other.state == "committing":
                    # Its commit may be publishing it in etcd right now: never pull it away.
                    raise VersionConflictError(
                        f"version {v} from {other.sender_id} is being committed here"
                    )
                idle = now - other.last_activity
                if (
                    from_relay
                    and other.from_relay
                    and other.sender_id != sender_id
                    and idle < self.replace_idle_s
                ):
                    raise VersionConflictError(
                        f"version {v} is already arriving from {other.sender_id}"
                    )
                self._abort_locked(
                    other, f"superseded by a new publish of version {v} from {sender_id}"
                )
            self._make_room_locked(layout.total_bytes, v)
            try:
                buffer = self._spares.pop(layout.total_bytes, None)
                if buffer is not None:
                    self._used -= buffer.nbytes  # counted again below, as the session's
                else:
                    buffer = self._allocate(layout.total_bytes, f"{self._name}-v{v}")
            except OSError as exc:
                raise StoreFullError(
                    f"cannot allocate {layout.total_bytes} bytes for version {v}: {exc}"
                ) from exc
            n = len(layout.chunks)
            session = IncomingVersion(
                token=uuid.uuid4().bytes,
                layout=layout,
                sender_id=sender_id,
                from_relay=from_relay,
                buffer=buffer,
                expected=tuple(_hex_to_digest(c.checksum) for c in layout.chunks),
                last_activity=now,
                digests=[None] * n,
            )
            self._sessions[session.token] = session
            self._used += layout.total_bytes
            self._cond.notify_all()
            return session

    def _check_newer_locked(self, v: int) -> None:
        if v in self._sealed:
            raise VersionConflictError(
                f"duplicate: version {v} is already stored; versions are immutable"
            )
        if self._sealed and v < max(self._sealed):
            raise VersionConflictError(
                f"regression: version {v} is older than the newest stored version "
                f"{max(self._sealed)}"
            )

    def _free_spares_locked(self, keep: int | None = None) -> None:
        for size in [s for s in self._spares if s != keep]:
            buf = self._spares.pop(size)
            self._used -= buf.nbytes
            buf.free()

    def _prepare_spare_locked(self, nbytes: int) -> None:
        if (not self.prefault or self._closed or nbytes in self._spares
                or nbytes in self._preparing or self._used + nbytes > self.max_bytes):
            return
        self._preparing.add(nbytes)
        threading.Thread(target=self._make_spare, args=(nbytes,), daemon=True,
                         name=f"{self._name}-spare").start()

    def _make_spare(self, nbytes: int) -> None:
        """Allocate a buffer and fault its pages in (off the receive path), after a short
        wait so the version just sealed is forwarded down the chain first."""
        time.sleep(_SPARE_DELAY_S)
        try:
            buf = self._allocate(nbytes, f"{self._name}-spare")
        except OSError as exc:
            log.info("no spare buffer of %d bytes: %s", nbytes, exc)
            with self._cond:
                self._preparing.discard(nbytes)
            return
        view = buf.view
        view[::_PAGE] = bytes(len(range(0, nbytes, _PAGE)))  # one write per page
        with self._cond:
            self._preparing.discard(nbytes)
            if self._closed or nbytes in self._spares or self._used + nbytes > self.max_bytes:
                buf.free()
                return
            while len(self._spares) >= _MAX_SPARES:
                old = self._spares.pop(next(iter(self._spares)))
                self._used -= old.nbytes
                old.free()
            self._spares[nbytes] = buf
            self._used += nbytes

    def _make_room_locked(self, need: int, v: int) -> None:
        if self._used + need > self.max_bytes:
            self._free_spares_locked(keep=need)
        if self._used + need > self.max_bytes:
            self._free_spares_locked()
        # The newest version stays, and so do the versions it is rebuilt from.
        needed = set(self._chain_locked(max(self._sealed))) if self._sealed else set()
        for old in sorted(self._sealed):
            if self._used + need <= self.max_bytes:
                break
            if old not in needed and not self._pins[old]:
                self._drop_locked(old, "making room")
        if self._used + need > self.max_bytes:
            held = (
                ", ".join(
                    f"v{ver} ({s.manifest.total_bytes} B{', read' if self._pins[ver] else ''})"
                    for ver, s in sorted(self._sealed.items())
                )
                or "none"
            )
            arriving = ", ".join(f"v{s.version}" for s in self._sessions.values()) or "none"
            raise StoreFullError(
                f"no room for version {v} ({need} bytes): {self._used} of {self.max_bytes} bytes "
                f"in use (stored: {held}; arriving: {arriving}); the newest version and versions "
                "being read are never dropped; raise store.max_bytes (at least twice the model "
                "size)"
            )

    def write_chunk(self, token: bytes, index: int, digest: bytes, payload: memoryview) -> None:
        """Store one chunk of an open session.

        Raises:
            UnknownSessionError: no such session (it is not failed by this).
            ProtocolError / ChecksumError: bad index, size or checksum; the
                session is failed and its commit will report this error.
        """
        with self._cond:
            s = self._sessions.get(token)
            if s is None or s.state not in ("open", "committing"):
                raise UnknownSessionError(f"chunk {index} names no open publish session")
            n = len(s.digests)
            if not 0 <= index < n:
                raise self._fail_locked(
                    s,
                    ProtocolError(
                        f"chunk index {index} is out of range for version {s.version} ({n} chunks)"
                    ),
                )
            if index in s.claimed:
                return
            s.claimed.add(index)
            spec = s.layout.chunks[index]
            expected = s.expected[index]
            verify = self.verify_forwarded or not s.from_relay
        problem: LaminarError | None = None
        if payload.nbytes != spec.nbytes:
            problem = ProtocolError(
                f"chunk {index} of version {s.version} is {payload.nbytes} bytes, "
                f"expected {spec.nbytes}"
            )
        elif expected is not None and digest != expected:
            problem = ChecksumError(
                f"chunk {index} of version {s.version}: header checksum differs from the manifest's"
            )
        elif verify:
            got = digest_of(payload, s.layout.checksum_algo)
            if got != digest:
                problem = ChecksumError(
                    f"chunk {index} of version {s.version} failed its checksum "
                    f"(sent {digest.hex()}, bytes hash to {got.hex()})"
                )
        if problem is None:
            s.buffer.view[spec.offset : spec.offset + spec.nbytes] = payload
        with self._cond:
            if problem is not None:
                raise self._fail_locked(s, problem)
            if s.state not in ("open", "committing"):
                return
            s.digests[index] = digest
            if not s.arrived:
                s.first_chunk_at = time.time()
            s.arrived.append(index)
            s.last_activity = self._clock()
            self._cond.notify_all()

    def _fail_locked(self, s: IncomingVersion, exc: LaminarError) -> LaminarError:
        if s.failed is None:
            s.failed = exc
            log.warning(
                "publish session of version %d from %s failed: %s", s.version, s.sender_id, exc
            )
        self._cond.notify_all()
        return exc

    def commit(
        self,
        token: bytes,
        chunks_sent: int,
        checksums: list[str],
        timeout_s: float,
        before_seal: Callable[[WeightManifest], None] | None = None,
    ) -> StoredVersion:
        """Wait for every chunk, check it against the sender's list, and seal.

        Args:
            before_seal: called with the final manifest once everything is
                verified and before the version becomes readable (the master
                publishes it in etcd here); if it raises, the session is
                aborted and the error propagates.

        Raises:
            UnknownSessionError, ProtocolError (truncated or inconsistent),
            ChecksumError, CommitTimeoutError, VersionConflictError, or what
            ``before_seal`` raised. On any error the session is aborted.
        """
        with self._cond:
            s = self._sessions.get(token)
            if s is None:
                raise UnknownSessionError("commit names no open publish session")
            if s.state != "open":
                raise ProtocolError(f"publish session of version {s.version} is already committing")
            s.state = "committing"
            v = s.version
            try:
                self._await_chunks_locked(s, chunks_sent, checksums, timeout_s)
            except LaminarError as exc:
                self._abort_locked(s, f"commit failed: {exc}")
                raise
            layout = s.layout
            manifest = msgspec.structs.replace(layout, chunks=tuple(
                ChunkSpec(c.index, c.offset, c.nbytes, w)
                for c, w in zip(layout.chunks, checksums)
            ))
        if before_seal is not None:
            try:
                before_seal(manifest)
            except BaseException as exc:
                with self._cond:
                    self._abort_locked(s, f"could not make version {v} visible: {exc}")
                raise
        with self._cond:
            return self._seal_locked(s, manifest)

    def _await_chunks_locked(self, s, chunks_sent: int, checksums: list[str],
                             timeout_s: float) -> None:
        """Every chunk of ``s`` arrived (waiting up to ``timeout_s``) with the digest the
        sender's list names; caller holds the lock.

        Raises:
            ProtocolError, CommitTimeoutError, ChecksumError, or the session's failure.
        """
        v, n = s.version, len(s.digests)
        if chunks_sent != n or len(checksums) != n:
            kind = "truncated publish" if chunks_sent < n else "inconsistent commit"
            raise ProtocolError(
                f"{kind} of version {v}: the sender sent {chunks_sent} chunks and "
                f"{len(checksums)} checksums, the manifest has {n} chunks; "
                "nothing was stored"
            )
        deadline = self._clock() + timeout_s
        while s.failed is None and len(s.arrived) < n:
            remaining = deadline - self._clock()
            if remaining <= 0:
                missing = [i for i, d in enumerate(s.digests) if d is None]
                raise CommitTimeoutError(
                    f"version {v}: {n - len(missing)} of {n} chunks arrived within "
                    f"{timeout_s:.1f}s (missing {missing[:8]}"
                    f"{'...' if len(missing) > 8 else ''})"
                )
            self._cond.wait(min(remaining, 1.0))
        if s.failed is not None:
            raise s.failed
        for i, (got, want) in enumerate(zip(s.digests, checksums)):
            if got is None or got.hex() != want:
                raise ChecksumError(
                    f"version {v}, chunk {i}: the commit lists checksum {want!r} but the "
                    f"chunk arrived with {got.hex() if got else None!r}"
                )

    def _seal_locked(self, s, manifest: WeightManifest) -> StoredVersion:
        """Make the committed version readable, unless it was aborted meanwhile or a newer
        one was sealed; older sessions still arriving go. Caller holds the lock."""
        v = s.version
        try:
            if s.state != "committing":
                raise ProtocolError(
                    f"publish session of version {v} was aborted while committing"
                )
            self._check_newer_locked(v)
        except LaminarError as exc:
            self._abort_locked(s, str(exc))
            raise
        stored = StoredVersion(manifest, s.buffer, tuple(s.arrived), time.time(),
                               s.begun_at, s.first_chunk_at)
        del self._sessions[s.token]
        s.state, s.stored = "sealed", stored
        self._sealed[v] = stored
        # An older version still arriving can never be sealed now: free it (and
        # release a forwarder waiting on it, e.g. behind a dead upstream).
        for old in [o for o in self._sessions.values() if o.version < v]:
            self._abort_locked(old, f"superseded by version {v}")
        self._retain_locked()
        self._prepare_spare_locked(manifest.total_bytes)
        self._cond.notify_all()
        return stored

    def abort(self, token: bytes, reason: str) -> bool:
        """Drop an open session; returns False if there was none."""
        with self._cond:
            s = self._sessions.get(token)
            if s is None:
                return False
            self._abort_locked(s, reason)
            return True

    def _abort_locked(self, s: IncomingVersion, reason: str) -> None:
        if s.state in ("aborted", "sealed"):
            return
        s.state = "aborted"
        if s.failed is None:
            s.failed = ProtocolError(reason)
        if self._sessions.pop(s.token, None) is not None:
            self._used -= s.layout.total_bytes
            s.buffer.free()
        log.info(
            "dropped publish session of version %d from %s: %s", s.version, s.sender_id, reason
        )
        self._cond.notify_all()

    def _drop_locked(self, version: int, reason: str) -> None:
        stored = self._sealed.pop(version)
        self._used -= stored.manifest.total_bytes
        stored.buffer.free()
        log.info("dropped version %d (%s)", version, reason)

    def _retain_locked(self) -> None:
        keep = set(sorted(self._sealed)[-self.keep_versions :])
        if self._sealed:  # a delta's base chain stays as long as the delta does
            keep.update(self._chain_locked(max(self._sealed)))
        for v in [v for v in self._sealed if v not in keep and not self._pins[v]]:
            self._drop_locked(v, f"retention keeps the newest {self.keep_versions} and the "
                                 "versions the newest is rebuilt from")

    # -- forwarding ---------------------------------------------------------

    def follow(self, version: int) -> IncomingVersion | StoredVersion | None:
        """The session receiving ``version`` (newest one), or the sealed version."""
        with self._cond:
            if version in self._sealed:
                return self._sealed[version]
            sessions = [s for s in self._sessions.values() if s.version == version]
            return sessions[-1] if sessions else None

    def progress(
        self, handle: IncomingVersion | StoredVersion, pos: int, timeout_s: float
    ) -> Progress:
        """Chunks of ``handle`` that arrived after position ``pos``; waits up to ``timeout_s``."""
        deadline = self._clock() + timeout_s
        with self._cond:
            while True:
                stored = handle if isinstance(handle, StoredVersion) else handle.stored
                if stored is not None:
                    digests = tuple(_hex_to_digest(c.checksum) for c in stored.manifest.chunks)
                    return Progress(
                        "sealed", stored.arrived[pos:], digests, stored.manifest, stored.buffer.view
                    )
                assert isinstance(handle, IncomingVersion)
                if handle.state == "aborted" or handle.failed is not None:
                    return Progress(
                        "aborted", (), (), handle.layout, handle.buffer.view, str(handle.failed)
                    )
                if len(handle.arrived) > pos:
                    return Progress(
                        "open",
                        tuple(handle.arrived[pos:]),
                        tuple(handle.digests),
                        handle.layout,
                        handle.buffer.view,
                    )
                remaining = deadline - self._clock()
                if remaining <= 0:
                    return Progress(
                        "open", (), tuple(handle.digests), handle.layout, handle.buffer.view
                    )
                self._cond.wait(remaining)

    # -- readers ------------------------------------------------------------

    def lease(
        self, version: int | None, holder: str, ttl_s: float, wait_s: float = 0.0
    ) -> tuple[str, StoredVersion]:
        """Hold a sealed version for reading (``None``: the newest).

        Waits up to ``wait_s`` for a version this relay may still receive.

        Raises:
            VersionNotFoundError: the version is not here and will not come.
        """
        deadline = self._clock() + wait_s
        with self._cond:
            while True:
                self._expire_leases_locked()
                target = (
                    (max(self._sealed) if self._sealed else None) if version is None else version
                )
                if target is not None and target in self._sealed:
                    lease = _Lease(uuid.uuid4().hex, target, holder, self._clock() + ttl_s)
                    self._leases[lease.lease_id] = lease
                    self._pins[target] += 1
                    return lease.lease_id, self._sealed[target]
                held = sorted(self._sealed)
                arriving = sorted({s.version for s in self._sessions.values()})
                where = f"this relay holds {held or 'no versions'}, receiving {arriving or 'none'}"
                if version is not None and (
                    (held and version < held[-1])
                    or (version not in arriving and any(a > version for a in arriving))
                ):
                    raise VersionNotFoundError(
                        f"version {version} is not here and will not arrive ({where}): it was "
                        "dropped by retention or skipped for a newer one"
                    )
                remaining = deadline - self._clock()
                if remaining <= 0:
                    what = "any version" if version is None else f"version {version}"
                    raise VersionNotFoundError(
                        f"{what} not available after {wait_s:.1f}s ({where})"
                    )
                self._cond.wait(min(remaining, 1.0))

    def leased(self, lease_id: str, ttl_s: float | None = None) -> StoredVersion:
        """The version a live lease holds (renewing it by ``ttl_s`` if given)."""
        with self._cond:
            self._expire_leases_locked()
            lease = self._leases.get(lease_id)
            if lease is None:
                raise VersionNotFoundError(f"reader lease {lease_id!r} is unknown or expired")
            if ttl_s is not None:
                lease.deadline = max(lease.deadline, self._clock() + ttl_s)
            return self._sealed[lease.version]

    def release(self, lease_id: str) -> bool:
        """End a reader lease; returns False if it had already expired or never existed."""
        with self._cond:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                return False
            self._unpin_locked(lease.version)
            return True

    def _unpin_locked(self, version: int) -> None:
        self._pins[version] -= 1
        if self._pins[version] <= 0:
            del self._pins[version]
            self._retain_locked()

    def _expire_leases_locked(self) -> None:
        now = self._clock()
        for lease in [le for le in self._leases.values() if le.deadline < now]:
            del self._leases[lease.lease_id]
            log.warning(
                "reader lease of %s on version %d expired without release",
                lease.holder,
                lease.version,
            )
            self._unpin_locked(lease.version)

    # -- housekeeping -------------------------------------------------------

    def maintain(self, session_idle_s: float) -> None:
        """Expire reader leases and drop sessions idle longer than ``session_idle_s``."""
        with self._cond:
            self._expire_leases_locked()
            now = self._clock()
            for s in [
                s
                for s in self._sessions.values()
                if s.state == "open" and now - s.last_activity > session_idle_s
            ]:
                self._abort_locked(s, f"no traffic for {session_idle_s:.0f}s")

    def close(self) -> None:
        """Drop every session and version."""
        with self._cond:
            self._closed = True
            for s in list(self._sessions.values()):
                self._abort_locked(s, "relay shutting down")
            for v in list(self._sealed):
                self._drop_locked(v, "relay shutting down")
            self._free_spares_locked()
            self._leases.clear()
            self._pins.clear()
            self._cond.notify_all()
