"""The fetch half of the relay client: read a complete weight version from a relay.

:class:`RelayReader` prefers a relay on its own host (and maps its shared memory
instead of copying), then the master, then the others in an order spread by reader
id; leaves out a first relay that does not answer a health call in
``probe_timeout_s``; verifies chunks that crossed a network; rebuilds versions
published as deltas over a base it holds or fetches; and releases each relay's
reader lease.

Never imports torch or numpy.
"""


from __future__ import annotations

import hashlib
import logging
import mmap
import os

import grpc

from laminar_common.codec import WeightManifest
from laminar_common.errors import (
    LaminarError,
    ProtocolError,
    TransportError,
)
from laminar_common.relay._connection import (
    FetchedWeights,
    RelayConnection,
    RelayRef,
)
from laminar_common.relay.manifests import (
    checksum,
    validate_manifest,
    verify_buffer,
    verify_chunk,
)
from laminar_common.relay.proto import relay_pb2, relay_pb2_grpc
from laminar_common.relay.wire import (
    MASTER_ELECTION,
    VersionNotFoundError,
    call_relay,
    error_from_rpc,
    manifest_from_proto,
    protocol_metadata,
)

__all__ = ["RelayReader"]

# The client's halves log as the client (one logger to configure, as before the split).
log = logging.getLogger("laminar_common.relay.client")


class RelayReader(RelayConnection):
    """The fetch half (see module docstring); arguments as :class:`RelayConnection`."""

    def fetch(
        self,
        version: int | None = None,
        *,
        wait_s: float = 30.0,
        verify: bool | None = None,
        relay: str | None = None,
        base: FetchedWeights | None = None,
    ) -> FetchedWeights:
        """Read one complete weight version.

        A version published as a delta (:mod:`laminar_common.relay.delta`) is
        rebuilt here: over ``base`` when the delta applies to it, else over its
        own base version, fetched the same way (down to a full version). The
        result is always checked against the full version's checksums.

        Args:
            version: the version to read; ``None`` for the latest (from etcd
                when the client has a coordinator, else the relay's newest).
            wait_s: how long the first relay tried may wait for a version it
                is still receiving through the chain.
            verify: check every chunk checksum here. Default: yes for bytes
                that crossed the network, no for same-host shared memory
                (the relay verified them when it stored them).
            relay: read from this relay only (member id or ``host:port``).
            base: a version this reader holds in its own memory (not a
                shared-memory mapping), for deltas to apply to.

        Raises:
            VersionNotFoundError: no relay holds the version (or none is published).
            TransportError: no relay could be reached.
            ProtocolError: the bytes failed verification.
        """
        if version is None and self._coord is not None:
            record = self._coord.latest_version()
            if record is None:
                raise VersionNotFoundError(
                    f"no weight version has been published yet in job {self._coord.keys.job!r}"
                )
            version = record.version
        if relay is not None:
            known = self.relays()
            candidates = [known.get(relay) or RelayRef(relay, relay)]
        else:
            candidates = self._read_candidates()
        if not candidates:
            raise TransportError("no relay is registered for this job")
        if len(candidates) > 1 and wait_s > 0 and not self._answers(candidates[0]):
            # The first relay may wait ``wait_s`` for a version still on its way; one
            # that does not answer at all (paused, cut off) would hold the read for a
            # whole call deadline, first or last. This read goes without it.
            log.info("relay %s does not answer within %.1fs; reading from the others",
                     candidates[0].member_id, self.probe_timeout_s)
            candidates = candidates[1:]
        errors: list[str] = []
        last: LaminarError | None = None
        for i, ref in enumerate(candidates):
            try:
                fetched = self._fetch_from(ref, version, wait_s if i == 0 else 0.0, verify)
            except (VersionNotFoundError, TransportError) as exc:
                errors.append(f"{ref.member_id}: {exc}")
                last = exc
                continue
            if fetched.manifest.full is None:
                return fetched
            return self._rebuild(fetched, base, wait_s, verify)
        what = "the latest version" if version is None else f"weight version {version}"
        cls = VersionNotFoundError if isinstance(last, VersionNotFoundError) else TransportError
        raise cls(f"could not fetch {what} from any relay: " + "; ".join(errors)) from last

    def _read_candidates(self) -> list[RelayRef]:
        relays = self.relays()
        if self._coord is None:
            return list(relays.values())
        leader = self._coord.leader(MASTER_ELECTION)

        def rank(r: RelayRef) -> bytes:
            return hashlib.blake2b(
                f"{self.client_id}/{r.member_id}".encode(), digest_size=8
            ).digest()

        local = sorted((r for r in relays.values() if r.host == self.host), key=rank)
        rest = sorted((r for r in relays.values() if r.host != self.host), key=rank)
        rest.sort(key=lambda r: r.member_id != leader)
        return local + rest

    def _answers(self, ref: RelayRef) -> bool:
        """Whether ``ref`` answers a health call within ``probe_timeout_s``."""
        try:
            call_relay(self._stub(ref.address).Health, relay_pb2.HealthRequest(),
                       f"health of relay {ref.member_id}", self.probe_timeout_s)
        except LaminarError:
            return False
        return True

    def _fetch_from(
        self, ref: RelayRef, version: int | None, wait_s: float, verify: bool | None
    ) -> FetchedWeights:
        stub = self._stub(ref.address)
        label = "latest" if version is None else f"version {version}"
        what = f"fetch of {label} from relay {ref.member_id}"
        reply = call_relay(
            stub.Fetch,
            relay_pb2.FetchRequest(
                version=-1 if version is None else version, reader_id=self.client_id, wait_s=wait_s
            ),
            what,
            wait_s + self.rpc_timeout_s,
        )
        relay_id = reply.relay_id or ref.member_id

        def release() -> None:
            self._release(ref, reply.lease)

        try:
            manifest = manifest_from_proto(reply.manifest)
            validate_manifest(manifest)
            if version is not None and manifest.version != version:
                raise ProtocolError(f"{what}: relay answered with version {manifest.version}")
            if self.use_shared_memory and reply.shm_path and reply.host == self.host:
                view = self._map_shared(reply.shm_path, manifest, verify=bool(verify))
                if view is not None:
                    return FetchedWeights(manifest, view, "shm", relay_id, release)
            buf = self._read_stream(stub, reply.lease, manifest, verify is not False, what)
        except BaseException:
            release()
            raise
        release()
        return FetchedWeights(manifest, memoryview(buf), "stream", relay_id)

    def _rebuild(self, delta: FetchedWeights, base: FetchedWeights | None, wait_s: float,
                 verify: bool | None) -> FetchedWeights:
        """The full version a fetched delta stands for, over ``base`` or its own base."""
        from laminar_common.relay.delta import apply_delta

        m = delta.manifest
        try:
            if base is not None and base.version == m.base_version \
                    and base.manifest.full is None and base.source != "shm":
                under, own = base, False
            else:
                if base is not None and base.version > m.base_version:
                    base = None  # a newer base is no use further down the chain
                under, own = self.fetch(m.base_version, wait_s=wait_s, verify=verify,
                                        base=base), True
            try:
                out = apply_delta(m, delta.buffer, under.buffer)
            finally:
                if own:
                    under.release()
        finally:
            delta.release()
        assert m.full is not None
        wire = delta.wire_bytes + (under.wire_bytes if own else 0)
        self.delta_fetches += 1
        return FetchedWeights(m.full, memoryview(out), "delta", delta.relay_id, wire_bytes=wire)

    def _shm_fallback(self, why: str) -> None:
        """Same host, but the relay's shared memory is not usable: stream (slower).

        Warned once per client (a container with its own /dev/shm stays that
        way), then counted at debug level.
        """
        self.shm_fallbacks += 1
        (log.warning if self.shm_fallbacks == 1 else log.debug)(
            "%s; fetching over the network instead (a copy)", why)

    def _map_shared(self, path: str, manifest: WeightManifest, verify: bool) -> memoryview | None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            self._shm_fallback(f"cannot open relay shared memory {path} ({exc})")
            return None
        try:
            size = os.fstat(fd).st_size
            if size < manifest.total_bytes:
                self._shm_fallback(f"relay shared memory {path} is {size} bytes, "
                                   f"need {manifest.total_bytes}")
                return None
            mm = mmap.mmap(fd, manifest.total_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        view = memoryview(mm)
        if verify:
            verify_buffer(manifest, view)
        else:
            first = manifest.chunks[0]
            # Identity check: a same-named host with another relay must not pass.
            first_bytes = view[first.offset : first.offset + first.nbytes]
            if checksum(first_bytes, manifest.checksum_algo) != first.checksum:
                log.warning(
                    "relay shared memory %s does not hold version %d; streaming instead",
                    path,
                    manifest.version,
                )
                return None
        return view

    def _read_stream(
        self,
        stub: relay_pb2_grpc.RelayStub,
        lease: str,
        manifest: WeightManifest,
        verify: bool,
        what: str,
    ) -> bytearray:
        out = bytearray(manifest.total_bytes)
        expected = 0
        try:
            for chunk in stub.Read(
                relay_pb2.ReadRequest(lease=lease),
                timeout=self.rpc_timeout_s + manifest.total_bytes / 50e6,
                metadata=protocol_metadata(),
            ):
                if chunk.index != expected or expected >= len(manifest.chunks):
                    raise ProtocolError(f"{what}: got chunk {chunk.index}, expected {expected}")
                spec = manifest.chunks[expected]
                if verify:
                    verify_chunk(spec, chunk.data, manifest.checksum_algo)
                elif len(chunk.data) != spec.nbytes:
                    raise ProtocolError(f"{what}: chunk {expected} has {len(chunk.data)} bytes")
                out[spec.offset : spec.offset + spec.nbytes] = chunk.data
                expected += 1
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, what) from exc
        if expected != len(manifest.chunks):
            raise ProtocolError(
                f"{what}: stream ended after {expected} of {len(manifest.chunks)} chunks"
            )
        return out

    def _release(self, ref: RelayRef, lease: str) -> None:
        if not lease:
            return
        try:
            call_relay(
                self._stub(ref.address).Release,
                relay_pb2.ReleaseRequest(lease=lease),
                f"release on relay {ref.member_id}",
                self.rpc_timeout_s,
            )
        except LaminarError as exc:
            log.warning(
                "could not release reader lease on relay %s (it will expire): %s",
                ref.member_id,
                exc,
            )
