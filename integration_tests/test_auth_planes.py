"""Authentication on the weight and trajectory planes, with real processes.

With ``auth.dir`` set (from ``create_keys``):

- a relay lets only the trainer's publisher certificate publish: a gRPC client
  holding the CA but no client certificate fails the TLS handshake, and one
  presenting the readers' ``client.pem`` is refused with PermissionDenied and
  counted in the relay's health; ``publisher.pem`` publishes a version that
  readers can then fetch;
- the relay's chunk data plane admits only authorized CURVE keys: a peer
  without CURVE and one with keys from another ``create_keys`` dir both fail
  their handshake, their chunks never reach the open publish session (its
  commit times out on the relay), a publisher holding the right certificate
  but such keys cannot publish, and the relay keeps serving;
- a trainer's trajectory socket does the same: a forged, well-formed
  trajectory pushed without CURVE or with unauthorized keys is never
  received, rejected or trained, while an authorized push is trained.

A refused key is logged by the server's ZAP handler ("refused a ZeroMQ peer");
a peer without any CURVE keys fails the mechanism handshake before ZAP is
asked, so it is seen from the peer's own socket monitor.
"""

from __future__ import annotations

import contextlib
import json
import re
import time

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from conftest import metric_value, scrape_metrics, tier_args, wait_ready, wait_until
from laminar_common import codec
from laminar_common.auth import CurveAuth, TlsFiles, create_keys, grpc_channel
from laminar_common.errors import TransportError
from laminar_common.etcd import EtcdCoordinator
from laminar_common.relay.client import RelayClient
from laminar_common.relay.dataplane import encode_chunk_header
from laminar_common.relay.manifests import build_manifest, flatten
from laminar_common.relay.proto import relay_pb2, relay_pb2_grpc
from laminar_common.relay.wire import (
    EXTRA_DATA_ENDPOINT,
    GRPC_OPTIONS,
    CommitTimeoutError,
    PermissionDeniedError,
    call_relay,
    manifest_to_proto,
)
from laminar_common.transport import make_push_sender

JOB = "auth-planes"
TTL = 3
COMMIT_TIMEOUT_S = 3
_HANDSHAKES = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
               | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def _common(etcd, keys) -> list[str]:
    return [*tier_args(etcd, JOB, TTL), "--set", f"auth.dir={keys}"]


def _start_relay(etcd, spawn, keys, *extra: str):
    relay = spawn("relay", "laminar_relay.cli", "serve", *_common(etcd, keys),
                  "--set", "member_id=relay-0", "--set", "bind_host=127.0.0.1",
                  "--set", "advertise_host=127.0.0.1", *extra)
    return relay, wait_ready(etcd, JOB, relay, "relay", "relay-0")


def _intruder_keys(keys, tmp_path) -> CurveAuth:
    """CURVE client keys from another ``create_keys`` dir, aimed at this job's server key
    (so the handshake gets as far as the server's key check)."""
    other = CurveAuth.from_dir(create_keys(tmp_path / "other-keys"))
    return CurveAuth(CurveAuth.from_dir(keys).server_public, None, other.client_public,
                     other.client_secret, frozenset())


def _refused_key_line(auth: CurveAuth) -> str:
    return re.escape("refused a ZeroMQ peer: CURVE key " + auth.client_public.decode())


@contextlib.contextmanager
def _unauthorized_peer(kind: int, endpoint: str, auth: CurveAuth | None, frames: list[bytes]):
    """A raw ZeroMQ ``kind`` socket connected to ``endpoint`` (a CURVE client with
    ``auth``'s keys, or no CURVE at all) with ``frames`` queued on it.

    Yields the name of its first handshake outcome (from its socket monitor), once
    there is one; the socket stays connected, frames queued and reconnecting, until
    the block ends.
    """
    sock = zmq.Context.instance().socket(kind)
    sock.linger = 0
    monitor = sock.get_monitor_socket(_HANDSHAKES)
    try:
        if auth is not None:
            auth.apply_client(sock)
        sock.connect(endpoint)
        # No IMMEDIATE: the message is queued now and goes out if a handshake ever succeeds.
        sock.send_multipart(frames, flags=zmq.NOBLOCK)
        outcome = None
        deadline = time.monotonic() + 10
        while outcome is None and time.monotonic() < deadline:
            if monitor.poll(100):
                outcome = zmq.Event(recv_monitor_message(monitor)["event"]).name
        yield outcome
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)


def test_only_the_publisher_certificate_publishes(etcd, spawn, tmp_path):
    keys = create_keys(tmp_path / "keys")
    relay, _ = _start_relay(etcd, spawn, keys)
    coord = EtcdCoordinator([etcd.endpoint], JOB, connect_timeout_s=10)
    curve = CurveAuth.from_dir(keys)
    weights = bytes(range(256)) * 4
    tensors = [("w", "uint8", (len(weights),), weights)]
    reader = RelayClient(coord, client_id="reader", tls=TlsFiles.client_from_dir(keys),
                         curve=curve, rpc_timeout_s=5, publish_timeout_s=5, max_attempts=1)
    assert reader.health("relay-0").rejected == {}

    # (a) The CA but no client certificate: the relay's TLS handshake refuses the
    # connection, so no call reaches it (nothing is counted as a refused call).
    no_cert = RelayClient(coord, client_id="no-cert",
                          tls=TlsFiles(ca=(keys / "ca.pem").read_bytes()), curve=curve,
                          rpc_timeout_s=3, publish_timeout_s=3, max_attempts=1)
    with pytest.raises(TransportError, match="UNAVAILABLE"):
        no_cert.publish(1, tensors)
    no_cert.close()
    relay.wait_for_line(r"Handshake failed.*PEER_DID_NOT_RETURN_A_CERTIFICATE", 10)
    assert reader.health("relay-0").rejected == {}

    # (b) The readers' certificate is verified but may not publish.
    with pytest.raises(PermissionDeniedError, match=r"its certificate \(laminar-client\) "
                                                    r"may not publish"):
        reader.publish(1, tensors)
    relay.wait_for_line(r"relay relay-0 refused BeginPublish .*laminar-client", 10)
    assert reader.health("relay-0").rejected == {"PermissionDeniedError": 1}
    assert coord.latest_version() is None, "a refused publish became visible"

    # (c) The publisher certificate publishes; the version is visible and readable.
    publisher = RelayClient(coord, client_id="trainer",
                            tls=TlsFiles.client_from_dir(keys, role="publisher"), curve=curve)
    result = publisher.publish(1, tensors)
    assert (result.version, result.master_id) == (1, "relay-0")
    assert coord.latest_version().version == 1
    with reader.fetch(1) as fetched:
        assert bytes(fetched.tensors()["w"]) == weights
    health = reader.health("relay-0")
    assert health.versions == (1,)
    assert health.rejected == {"PermissionDeniedError": 1}
    assert relay.alive()
    for c in (reader, publisher):
        c.close()
    coord.close()


def test_data_plane_refuses_unauthorized_chunks(etcd, spawn, tmp_path):
    keys = create_keys(tmp_path / "keys")
    intruder = _intruder_keys(keys, tmp_path)
    relay, record = _start_relay(etcd, spawn, keys,
                                 "--set", f"chain.commit_timeout_s={COMMIT_TIMEOUT_S}")
    coord = EtcdCoordinator([etcd.endpoint], JOB, connect_timeout_s=10)
    curve = CurveAuth.from_dir(keys)
    publisher_tls = TlsFiles.client_from_dir(keys, role="publisher")
    reader = RelayClient(coord, client_id="reader", tls=TlsFiles.client_from_dir(keys),
                         rpc_timeout_s=5)
    weights = bytes(range(256)) * 4
    tensors = [("w", "uint8", (len(weights),), weights)]

    # A real publish session is open, and its one chunk, exactly right, is pushed by
    # peers the data plane does not authorize.
    manifest, buffers = build_manifest(1, tensors)
    assert len(manifest.chunks) == 1
    channel = grpc_channel(record.address, publisher_tls, GRPC_OPTIONS)
    stub = relay_pb2_grpc.RelayStub(channel)
    begin = call_relay(stub.BeginPublish, relay_pb2.BeginPublishRequest(
        manifest=manifest_to_proto(manifest), origin=relay_pb2.ORIGIN_PUBLISHER,
        sender_id="probe"), "begin a probe publish", 5)
    assert begin.accepted
    assert begin.data_endpoint == record.extra[EXTRA_DATA_ENDPOINT]
    chunk = [encode_chunk_header(begin.session, 0, bytes.fromhex(manifest.chunks[0].checksum)),
             bytes(flatten(manifest, buffers))]
    with contextlib.ExitStack() as peers:
        for auth in (None, intruder):
            outcome = peers.enter_context(_unauthorized_peer(
                zmq.DEALER, record.extra[EXTRA_DATA_ENDPOINT], auth, chunk))
            assert outcome is not None and outcome.startswith("HANDSHAKE_FAILED"), outcome
        relay.wait_for_line(_refused_key_line(intruder), 10)
        # The relay waits the whole commit timeout for the chunk: it never arrived.
        with pytest.raises(CommitTimeoutError, match=r"0 of 1 chunks arrived"):
            call_relay(stub.CommitPublish, relay_pb2.CommitPublishRequest(
                session=begin.session, chunks_sent=1, checksums=[manifest.chunks[0].checksum]),
                "commit the probe publish", COMMIT_TIMEOUT_S + 10)
    channel.close()
    health = reader.health("relay-0")
    assert health.versions == () and health.receiving == ()
    assert health.rejected == {"CommitTimeoutError": 1}, "a refused peer's chunk was read"

    # A publisher with the right certificate but no authorized CURVE keys cannot push
    # its chunks either (its sender never completes a connection).
    for auth in (None, intruder):
        client = RelayClient(coord, client_id="bad-keys", tls=publisher_tls, curve=auth,
                             send_timeout_s=2, publish_timeout_s=10, max_attempts=1)
        with pytest.raises(TransportError, match="did not get through"):
            client.publish(1, tensors)
        client.close()
    assert coord.latest_version() is None

    # The relay is alive and its data plane still takes an authorized publisher's chunks.
    assert relay.alive()
    publisher = RelayClient(coord, client_id="trainer", tls=publisher_tls, curve=curve)
    assert publisher.publish(1, tensors).version == 1
    assert coord.latest_version().version == 1
    with reader.fetch(1) as fetched:
        assert bytes(fetched.tensors()["w"]) == weights
    assert reader.health("relay-0").rejected == {"CommitTimeoutError": 1}
    for c in (reader, publisher):
        c.close()
    coord.close()


def _trajectory(trajectory_id: str) -> codec.Trajectory:
    return codec.Trajectory(
        trajectory_id=trajectory_id, prompt_id=f"prompt-{trajectory_id}", group_size=1,
        sample_index=0, worker_id="worker-x", policy_version=0, prompt_token_ids=(1, 5, 6),
        response_token_ids=(7, 8, 2), behaviour_logprobs=(-1.0, -1.0, -1.0), reward=1.0,
        finish_reason="stop")


def _consumed(run_dir) -> list[dict]:
    path = run_dir / "consumed.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_trainer_refuses_forged_trajectories(etcd, spawn, tmp_path):
    keys = create_keys(tmp_path / "keys")
    intruder = _intruder_keys(keys, tmp_path)
    run_dir = tmp_path / "trainer"
    _start_relay(etcd, spawn, keys)
    trainer = spawn("trainer", "laminar_trainer.cli", "run", *_common(etcd, keys),
                    "--set", "trainer_id=trainer", "--set", "simulate.step_s=0.2",
                    "--set", "simulate.weight_bytes=65536", "--set", "batch_groups=1",
                    "--set", "total_steps=50", "--set", f"run_dir={run_dir}",
                    "--set", "metrics.port=0")
    record = wait_ready(etcd, JOB, trainer, "trainer", "trainer", timeout_s=90)
    coord = EtcdCoordinator([etcd.endpoint], JOB, connect_timeout_s=10)
    # Ready means its first version went through the relay with the publisher certificate.
    assert coord.latest_version() is not None

    forged = {"plain": _trajectory("forged-plain"), "intruder": _trajectory("forged-intruder")}
    with contextlib.ExitStack() as peers:
        for name, auth in (("plain", None), ("intruder", intruder)):
            outcome = peers.enter_context(_unauthorized_peer(
                zmq.PUSH, record.address, auth, [codec.encode(forged[name])]))
            assert outcome is not None and outcome.startswith("HANDSHAKE_FAILED"), (name, outcome)
        trainer.wait_for_line(_refused_key_line(intruder), 10)

        # The same kind of message from an authorized key is received and trained.
        sender = make_push_sender(record.address, auth=CurveAuth.from_dir(keys), send_timeout_s=5)
        sender.send(_trajectory("genuine"))
        sender.close()
        assert wait_until(lambda: _consumed(run_dir), 30), "the authorized trajectory was not trained"

        samples = scrape_metrics(record.extra["metrics"])
        assert metric_value(samples, "laminar_trainer_buffer_received_total") == 1
        assert metric_value(samples, "laminar_trainer_rejected_frames_total") == 0
        assert metric_value(samples, "laminar_trainer_trajectories_rejected_total") == 0
    assert [i for row in _consumed(run_dir) for i in row["ids"]] == ["genuine"]
    log_text = "\n".join(trainer.tail(None))
    assert not any(t.trajectory_id in log_text for t in forged.values())
    assert trainer.alive()
    coord.close()
