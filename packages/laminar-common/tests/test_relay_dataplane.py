"""laminar_common.relay.dataplane: chunk headers and the ZeroMQ sender/receiver pair."""

from __future__ import annotations

import os
import queue
import socket
import time

import pytest
import zmq

from laminar_common.errors import ProtocolError, TransportError
from laminar_common.relay.dataplane import (
    ZmqChunkReceiver,
    ZmqChunkSender,
    decode_chunk_header,
    encode_chunk_header,
    make_chunk_sender,
)

SESSION = bytes(range(16))
DIGEST = bytes(range(16, 32))


def test_header_round_trip_and_refusals():
    raw = encode_chunk_header(SESSION, 7, DIGEST)
    assert decode_chunk_header(raw) == (SESSION, 7, DIGEST)
    with pytest.raises(ProtocolError, match="expected 42"):
        decode_chunk_header(raw[:-1])
    with pytest.raises(ProtocolError, match="does not start with"):
        decode_chunk_header(b"XXXX" + raw[4:])
    with pytest.raises(ProtocolError, match="protocol version 999"):
        decode_chunk_header(raw[:4] + (999).to_bytes(2, "big") + raw[6:])
    with pytest.raises(ValueError):
        encode_chunk_header(b"short", 0, DIGEST)


def test_chunks_arrive_intact_and_garbage_is_counted_not_fatal():
    got: queue.Queue = queue.Queue()
    receiver = ZmqChunkReceiver(
        lambda f: got.put((f.session, f.index, f.digest, bytes(f.payload))), max_chunk_bytes=1 << 20
    )
    sender = ZmqChunkSender(receiver.endpoint, send_timeout_s=5)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(receiver.endpoint)
    try:
        raw.send_multipart([b"only-one-frame"])
        raw.send_multipart([b"bad-header", b"payload"])
        raw.send_multipart([encode_chunk_header(SESSION, 1, DIGEST), b"x" * ((1 << 20) + 1)])
        payload = os.urandom(300_000)
        sender.send(SESSION, 3, DIGEST, payload)
        sender.send(SESSION, 4, DIGEST, b"tiny")
        assert got.get(timeout=5) == (SESSION, 3, DIGEST, payload)
        assert got.get(timeout=5) == (SESSION, 4, DIGEST, b"tiny")
        # The garbage travels on another connection: no ordering against the good
        # chunks, so wait (bounded) until every bad frame has been seen and counted.
        rejected = receiver.stats.rejected
        deadline = time.monotonic() + 5
        while sum(rejected.values()) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rejected["malformed"] == 1 and rejected["bad-header"] == 1
        assert rejected["oversized"] == 1
        assert receiver.stats.received == 2
    finally:
        raw.close(0)
        sender.close()
        receiver.close()


def _hold_port(port: int) -> socket.socket:
    """Bind (never listen on) ``port``, so no other socket takes it meanwhile.

    A closed receiver's port is free: a test in the other xdist worker could bind it, or
    the sender's own reconnect could pick it as its source port and connect to itself
    (TCP simultaneous open; DEALER to DEALER is a valid pair). Either way the send gets
    through; it did once in CI. A bound, non-listening socket refuses connects and keeps
    the port out of the ephemeral range. ZeroMQ closes the listener on its reaper
    thread, so the bind is retried, bounded.
    """
    deadline = time.monotonic() + 5
    while True:
        holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            holder.bind(("127.0.0.1", port))
            return holder
        except OSError:
            holder.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def test_send_to_a_receiver_that_is_gone_fails_with_a_clear_error():
    receiver = ZmqChunkReceiver(lambda f: None)
    endpoint = receiver.endpoint
    receiver.close()
    holder = _hold_port(int(endpoint.rsplit(":", 1)[1]))
    sender = make_chunk_sender(endpoint, hwm=1, send_timeout_s=0.3)
    try:
        with pytest.raises(TransportError, match="did not get through"):
            for i in range(4):
                sender.send(SESSION, i, DIGEST, b"x" * 100_000)
    finally:
        sender.close()
        holder.close()
    with pytest.raises(TransportError, match="no data plane"):
        make_chunk_sender("nccl://gpu0")
