"""Transports: ZeroMQ on loopback and the inproc twin behave the same."""

import threading
import time

import pytest

from laminar_common import codec
from laminar_common.errors import ProtocolError, TransportError
from laminar_common.transport import (
    InprocClient,
    InprocHub,
    InprocPullReceiver,
    InprocPushSender,
    InprocServer,
    ZmqClient,
    ZmqPullReceiver,
    ZmqPushSender,
    ZmqServer,
)

ACK = codec.Ack(trajectory_ids=("t1",), trainer_step=1, trainer_version=1)


def _hello(member_id, version=codec.PROTOCOL_VERSION):
    return codec.Hello(member_id=member_id, role="worker", protocol_version=version)


@pytest.fixture(params=["zmq", "inproc"])
def push_pull(request):
    if request.param == "zmq":
        r = ZmqPullReceiver("tcp://127.0.0.1:0", max_frame_bytes=4096)
        s = ZmqPushSender(r.endpoint)
    else:
        hub = InprocHub()
        r = InprocPullReceiver(hub, max_frame_bytes=4096)
        s = InprocPushSender(hub, r.endpoint)
    yield s, r
    s.close()
    r.close()


def test_push_pull_rejects_bad_frames_and_keeps_serving(push_pull):
    sender, receiver = push_pull
    bad_version = bytearray(codec.encode(ACK))
    bad_version[5] = 99
    for frame in (b"junk", codec.MAGIC + codec.PROTOCOL_VERSION.to_bytes(2, "big") + b"\xc1", bytes(bad_version),
                  codec.MAGIC + codec.PROTOCOL_VERSION.to_bytes(2, "big") + b"x" * 5000):
        sender.send_frame(frame)
    sender.send(ACK)
    assert receiver.recv(timeout_s=5) == ACK
    assert receiver.stats.rejected == {"malformed": 2, "version": 1, "oversized": 1}
    assert receiver.stats.received == 1
    assert receiver.recv(timeout_s=0.05) is None


@pytest.fixture(params=["zmq", "inproc"])
def server_and_client_factory(request):
    made = []
    if request.param == "zmq":
        server = ZmqServer(member_id="mgr")

        def client(hello):
            c = ZmqClient(server.endpoint, hello)
            made.append(c)
            return c
    else:
        hub = InprocHub()
        server = InprocServer(hub, member_id="mgr")

        def client(hello):
            return InprocClient(hub, server.endpoint, hello, server)

    yield server, client
    for c in made:
        c.close()
    server.close()


def _serve(server, n_msgs, stop: threading.Event | None = None):
    """Echo ``n_msgs`` acks back (giving up after 5 s without a message), or serve until
    ``stop`` is set (polling every 50 ms)."""
    def run():
        got = 0
        while got < n_msgs and not (stop is not None and stop.is_set()):
            item = server.recv(timeout_s=5 if stop is None else 0.05)
            if item is None:
                if stop is None:
                    return
                continue
            peer, msg = item
            if isinstance(msg, codec.Ack):
                server.send(peer, msg)
                got += 1

    t = threading.Thread(target=run)
    t.start()
    return t


def test_handshake_then_round_trip(server_and_client_factory):
    server, make_client = server_and_client_factory
    client = make_client(_hello("w1"))
    t = _serve(server, 1)
    welcome = client.connect(timeout_s=5)
    assert welcome.member_id == "mgr"
    client.send(ACK)
    assert client.recv(timeout_s=5) == ACK
    t.join()
    assert "w1" in server.peers


def test_message_before_hello_is_dropped_and_counted(server_and_client_factory):
    server, make_client = server_and_client_factory
    client = make_client(_hello("w2"))
    client.send(ACK)
    assert server.recv(timeout_s=0.5) is None
    assert server.stats.rejected["no-hello"] == 1


def test_a_forgotten_peer_is_told_to_say_hello_again(server_and_client_factory):
    server, make_client = server_and_client_factory
    client = make_client(_hello("w3"))
    t = _serve(server, 1)
    client.connect(timeout_s=5)
    client.send(ACK)
    assert client.recv(timeout_s=5) == ACK
    t.join()
    server.forget("w3")  # e.g. its lease expired while it was paused
    client.send(ACK)
    client.send(ACK)
    assert server.recv(timeout_s=0.5) is None
    reply = client.recv(timeout_s=5)
    assert isinstance(reply, codec.Refused) and "say hello again" in reply.reason
    # At most one Refused a second, however many frames it sends meanwhile.
    assert client.recv(timeout_s=0.3) is None
    assert server.stats.rejected["no-hello"] == 2


def test_other_protocol_version_refused_with_clear_error(server_and_client_factory):
    server, make_client = server_and_client_factory
    client = make_client(_hello("old", version=codec.PROTOCOL_VERSION + 1))
    stop = threading.Event()
    t = _serve(server, 1, stop)  # serves the hello, then stops once it was refused
    with pytest.raises(ProtocolError, match="refused: worker 'old' speaks protocol version"):
        client.connect(timeout_s=5)
    stop.set()
    t.join()
    assert server.stats.rejected["refused"] == 1
    assert "old" not in server.peers


def test_send_to_unknown_peer_refused(server_and_client_factory):
    server, _ = server_and_client_factory
    with pytest.raises(TransportError, match="has not said hello"):
        server.send("ghost", ACK)


def test_zmq_push_reports_backpressure():
    receiver = ZmqPullReceiver("tcp://127.0.0.1:0", hwm=1)
    sender = ZmqPushSender(receiver.endpoint, hwm=1, send_timeout_s=0.2)
    big = codec.Ack(trajectory_ids=tuple(f"t{i}" for i in range(20000)), trainer_step=0,
                    trainer_version=0)
    with pytest.raises(TransportError, match="high-water mark"):
        for _ in range(10000):
            sender.send(big)
    sender.close()
    receiver.close()


def test_bind_conflict_is_a_transport_error():
    first = ZmqPullReceiver("tcp://127.0.0.1:0")
    with pytest.raises(TransportError, match="cannot bind"):
        ZmqPullReceiver(first.endpoint)
    first.close()


def test_every_sender_closes_with_a_linger_over_either_transport():
    """Services call ``close(linger_s=...)`` without knowing the transport behind it."""
    from laminar_common.transport import make_pull_receiver, make_push_sender

    for endpoint in ("inproc://linger-test", "tcp://127.0.0.1:0"):
        rx = make_pull_receiver(endpoint)
        tx = make_push_sender(rx.endpoint)
        tx.send(codec.Ack(trajectory_ids=("a",), trainer_step=1, trainer_version=1))
        tx.close(linger_s=0.5)
        got = rx.recv(timeout_s=5)
        assert isinstance(got, codec.Ack) and got.trajectory_ids == ("a",), endpoint
        rx.close()


def test_a_push_link_reports_down_and_counts_its_reconnects():
    """``down_s``: 0 while connected; since creation before the first connection; since the
    drop after the peer went away. ``reconnects``: counted when it comes back (the caller
    re-sends what may have been in flight)."""
    import socket as _socket

    from laminar_common.codec import Acked
    from laminar_common.transport import make_pull_receiver, make_push_sender

    with _socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    tx = make_push_sender(endpoint)
    try:
        time.sleep(0.3)
        assert tx.down_s() >= 0.3 and tx.reconnects() == 0  # nothing listens yet
        rx = make_pull_receiver(endpoint, expect=Acked)
        deadline = time.monotonic() + 5
        while tx.down_s() > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tx.down_s() == 0.0 and tx.reconnects() == 0  # a first connection: not a reconnect
        tx.send(Acked(trajectory_ids=("a",)))
        assert rx.recv(timeout_s=5) == Acked(trajectory_ids=("a",))
        rx.close()
        deadline = time.monotonic() + 5
        while tx.down_s() == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tx.down_s() > 0
        rx = make_pull_receiver(endpoint, expect=Acked)  # the same address, a new process
        deadline = time.monotonic() + 5
        while tx.reconnects() == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tx.reconnects() == 1 and tx.down_s() == 0.0
        rx.close()
    finally:
        tx.close(linger_s=0)
