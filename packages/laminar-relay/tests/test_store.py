"""laminar_relay.store: sessions, sealing, monotonic versions, retention, leases, memory cap."""

from __future__ import annotations

import os
import threading

import pytest

from laminar_common.errors import ProtocolError
from laminar_common.relay.manifests import build_manifest, iter_chunks
from laminar_common.relay.wire import (
    ChecksumError,
    CommitTimeoutError,
    OversizedError,
    StoreFullError,
    VersionConflictError,
    VersionNotFoundError,
)
from laminar_relay.memory import HeapBuffer, make_allocator
from laminar_relay.store import UnknownSessionError, WeightStore

CHUNK = 1024
SIZE = 10 * CHUNK + 17  # 11 chunks


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_store(backend: str = "heap", **kwargs) -> WeightStore:
    kwargs.setdefault("max_bytes", 10 * SIZE)
    kwargs.setdefault("max_version_bytes", 4 * SIZE)
    return WeightStore(make_allocator(backend), **kwargs)


def version_bytes(version: int, size: int = SIZE) -> bytes:
    return (version.to_bytes(2, "big") + os.urandom(62)) * (size // 64) + bytes(size % 64)


def open_session(store, version, data=None, *, sender="trainer", from_relay=False):
    data = version_bytes(version) if data is None else data
    manifest, buffers = build_manifest(
        version, [("w", "uint8", (len(data),), data)], chunk_bytes=CHUNK
    )
    layout = type(manifest)(
        manifest.version,
        manifest.total_bytes,
        manifest.chunk_bytes,
        manifest.tensors,
        tuple(type(c)(c.index, c.offset, c.nbytes, "") for c in manifest.chunks),
    )
    session = store.begin(layout, sender_id=sender, from_relay=from_relay)
    payloads = [
        bytes(p.contiguous()) for p in iter_chunks(buffers, manifest.tensors, manifest.chunks)
    ]
    return session, manifest, payloads


def send(store, session, manifest, payloads, indices=None):
    for i in range(len(payloads)) if indices is None else indices:
        store.write_chunk(
            session.token, i, bytes.fromhex(manifest.chunks[i].checksum), memoryview(payloads[i])
        )


def publish(store, version, data=None, **kwargs):
    session, manifest, payloads = open_session(store, version, data, **kwargs)
    send(store, session, manifest, payloads)
    return store.commit(session.token, len(payloads), [c.checksum for c in manifest.chunks], 1.0)


def read(store, version):
    lease, stored = store.lease(version, "reader", 60.0)
    try:
        return bytes(stored.buffer.view)
    finally:
        store.release(lease)


@pytest.mark.parametrize("backend", ["heap", "memfd"])
def test_sealed_version_is_readable_and_byte_identical(backend):
    store = make_store(backend)
    data = version_bytes(3)
    stored = publish(store, 3, data)
    assert read(store, 3) == data and read(store, None) == data
    assert stored.manifest.chunks[0].checksum and store.versions() == [3]
    if backend == "memfd":
        with open(stored.buffer.share_path, "rb") as fh:  # what a same-host reader maps
            assert fh.read() == data
    store.close()
    assert store.stats()["used_bytes"] == 0


def test_versions_only_move_forward():
    store = make_store()
    publish(store, 5)
    with pytest.raises(VersionConflictError, match="duplicate: version 5"):
        open_session(store, 5)
    with pytest.raises(VersionConflictError, match="regression: version 4 is older than .* 5"):
        open_session(store, 4)
    publish(store, 6)
    assert store.versions() == [5, 6]


def test_truncated_publish_stores_nothing_and_frees_memory():
    store = make_store()
    session, manifest, payloads = open_session(store, 1)
    send(store, session, manifest, payloads, indices=range(4))
    with pytest.raises(ProtocolError, match="truncated publish of version 1: the sender sent 4"):
        store.commit(session.token, 4, [c.checksum for c in manifest.chunks[:4]], 1.0)
    assert store.versions() == [] and store.receiving() == []
    assert store.stats()["used_bytes"] == 0
    with pytest.raises(VersionNotFoundError):
        store.lease(1, "reader", 60.0)
    with pytest.raises(UnknownSessionError):
        store.commit(session.token, len(payloads), [], 1.0)


def test_checksum_mismatch_fails_the_session_at_commit():
    store = make_store()
    session, manifest, payloads = open_session(store, 1)
    bad = bytearray(payloads[2])
    bad[0] ^= 0xFF
    payloads[2] = bytes(bad)
    with pytest.raises(ChecksumError, match="chunk 2 of version 1 failed its checksum"):
        send(store, session, manifest, payloads)
    with pytest.raises(ChecksumError, match="chunk 2 of version 1"):
        store.commit(session.token, len(payloads), [c.checksum for c in manifest.chunks], 1.0)
    assert store.versions() == [] and store.stats()["used_bytes"] == 0


def test_commit_list_must_match_the_chunk_headers():
    store = make_store()
    session, manifest, payloads = open_session(store, 1)
    send(store, session, manifest, payloads)
    sums = [c.checksum for c in manifest.chunks]
    sums[3] = "0" * 32
    with pytest.raises(ChecksumError, match="chunk 3: the commit lists checksum"):
        store.commit(session.token, len(payloads), sums, 1.0)
    assert store.versions() == []


def test_commit_times_out_naming_missing_chunks():
    store = make_store()
    session, manifest, payloads = open_session(store, 1)
    send(store, session, manifest, payloads, indices=[i for i in range(len(payloads)) if i != 7])
    with pytest.raises(CommitTimeoutError, match=r"10 of 11 chunks arrived .* \(missing \[7\]\)"):
        store.commit(session.token, len(payloads), [c.checksum for c in manifest.chunks], 0.2)
    assert store.versions() == []


def test_chunk_out_of_range_or_wrong_size_fails_the_session():
    store = make_store()
    session, manifest, payloads = open_session(store, 1)
    with pytest.raises(ProtocolError, match="chunk index 99 is out of range"):
        store.write_chunk(session.token, 99, bytes(16), memoryview(b"x"))
    session2, manifest2, payloads2 = open_session(store, 2)
    with pytest.raises(ProtocolError, match="is 3 bytes, expected 1024"):
        store.write_chunk(session2.token, 0, bytes(16), memoryview(b"abc"))
    with pytest.raises(UnknownSessionError):
        store.write_chunk(b"n" * 16, 0, bytes(16), memoryview(b"abc"))


def test_oversized_version_and_manifest_are_refused():
    store = make_store(max_tensors=2)
    with pytest.raises(
        OversizedError, match=r"this relay accepts at most \d+ \(store.max_version_bytes\)"
    ):
        open_session(store, 1, data=bytes(4 * SIZE + 1))
    many = [(f"t{i}", "uint8", (1,), b"x") for i in range(3)]
    manifest, _ = build_manifest(1, many)
    with pytest.raises(OversizedError, match="lists 3 tensors"):
        store.begin(manifest, sender_id="x", from_relay=False)


def test_before_seal_failure_leaves_nothing_readable():
    store = make_store()
    session, manifest, payloads = open_session(store, 1)
    send(store, session, manifest, payloads)

    def refuse(_manifest):
        raise VersionConflictError("etcd moved on")

    with pytest.raises(VersionConflictError, match="etcd moved on"):
        store.commit(
            session.token,
            len(payloads),
            [c.checksum for c in manifest.chunks],
            1.0,
            before_seal=refuse,
        )
    assert store.versions() == [] and store.stats()["used_bytes"] == 0


def test_retention_keeps_last_k_but_never_drops_a_version_being_read():
    store = make_store(keep_versions=2)
    publish(store, 1)
    lease, held = store.lease(1, "slow-reader", 60.0)
    publish(store, 2)
    publish(store, 3)
    assert store.versions() == [1, 2, 3]  # 1 is read, so it stays
    assert bytes(held.buffer.view[:2]) == (1).to_bytes(2, "big")
    assert store.release(lease)
    assert store.versions() == [2, 3]
    assert not store.release(lease)


def test_reader_lease_expires_and_then_retention_applies():
    clock = FakeClock()
    store = make_store(keep_versions=1, clock=clock)
    publish(store, 1)
    lease, _ = store.lease(1, "crashed-reader", 5.0)
    publish(store, 2)
    assert store.versions() == [1, 2]
    clock.now += 6
    assert store.stats()["readers"] == 0
    assert store.versions() == [2]
    with pytest.raises(VersionNotFoundError, match="unknown or expired"):
        store.leased(lease)


def test_memory_cap_drops_unread_old_versions_then_refuses_clearly():
    store = make_store(max_bytes=3 * SIZE, max_version_bytes=SIZE, keep_versions=5)
    publish(store, 1)
    publish(store, 2)
    publish(store, 3)
    publish(store, 4)  # no room: version 1 (oldest, unread) is dropped
    assert store.versions() == [2, 3, 4]
    leases = [store.lease(v, "r", 60.0)[0] for v in (2, 3)]
    with pytest.raises(StoreFullError, match=r"no room for version 5 .*v2 \(\d+ B, read\)"):
        open_session(store, 5)
    assert store.versions() == [2, 3, 4]
    for lease in leases:
        store.release(lease)
    publish(store, 5)
    assert 5 in store.versions()


def test_fetch_waits_for_a_version_still_arriving():
    store = make_store()
    session, manifest, payloads = open_session(store, 1)
    got: list[bytes] = []

    def reader():
        lease, stored = store.lease(1, "reader", 60.0, wait_s=5.0)
        got.append(bytes(stored.buffer.view))
        store.release(lease)

    thread = threading.Thread(target=reader)
    thread.start()
    send(store, session, manifest, payloads)
    store.commit(session.token, len(payloads), [c.checksum for c in manifest.chunks], 1.0)
    thread.join(5)
    assert got and got[0][:2] == (1).to_bytes(2, "big")


def test_fetch_of_a_version_that_will_not_come_fails_at_once():
    store = make_store(keep_versions=1)
    publish(store, 1)
    publish(store, 2)
    with pytest.raises(VersionNotFoundError, match="will not arrive"):
        store.lease(1, "r", 60.0, wait_s=30.0)
    open_session(store, 4)
    with pytest.raises(VersionNotFoundError, match="will not arrive"):
        store.lease(3, "r", 60.0, wait_s=30.0)
    with pytest.raises(VersionNotFoundError, match=r"version 9 not available after 0.1s"):
        store.lease(9, "r", 60.0, wait_s=0.1)


def test_idle_sessions_expire_and_replacement_rules():
    clock = FakeClock()
    store = make_store(clock=clock, replace_idle_s=2.0)
    stale, _, _ = open_session(store, 1)
    clock.now += 31
    store.maintain(session_idle_s=30)
    assert store.receiving() == []
    # An active forward from one relay is not replaced by another relay's ...
    open_session(store, 2, sender="relay-a", from_relay=True)
    with pytest.raises(VersionConflictError, match="already arriving from relay-a"):
        open_session(store, 2, sender="relay-b", from_relay=True)
    # ... until it has been idle for a while; a publisher always replaces.
    clock.now += 3
    second, _, _ = open_session(store, 2, sender="relay-b", from_relay=True)
    third, _, _ = open_session(store, 2, sender="trainer")
    assert store.receiving() == [2]
    with pytest.raises(UnknownSessionError):
        store.session(second.token)
    assert store.session(third.token) is third


def test_heap_buffer_has_no_share_path():
    assert HeapBuffer(10, "x").share_path == ""


def test_sealing_a_newer_version_drops_older_sessions_still_arriving():
    store = make_store()
    stale, manifest, payloads = open_session(store, 1, sender="dead-upstream", from_relay=True)
    send(store, stale, manifest, payloads, indices=[0, 1])
    publish(store, 2)
    assert store.receiving() == [] and store.versions() == [2]
    progress = store.progress(stale, 2, 0.0)
    assert progress.state == "aborted" and "superseded by version 2" in progress.reason


def test_a_version_being_committed_is_never_replaced():
    store = make_store()
    session, manifest, payloads = open_session(store, 1)
    send(store, session, manifest, payloads)
    replaced: list[str] = []

    def publish_in_etcd(_manifest):
        # A retrying publisher arrives while the etcd publish is in flight.
        try:
            open_session(store, 1, sender="retry")
        except VersionConflictError as exc:
            replaced.append(str(exc))

    stored = store.commit(
        session.token,
        len(payloads),
        [c.checksum for c in manifest.chunks],
        1.0,
        before_seal=publish_in_etcd,
    )
    assert stored.version == 1 and store.versions() == [1]
    assert replaced == ["version 1 from trainer is being committed here"]
