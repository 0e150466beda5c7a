"""Client of the relay tier: publish weight versions, fetch them, ask for status.

Owns how a trainer hands a version to the master relay and how a rollout
reads one from its relay. The trainer calls :meth:`RelayClient.publish`,
which returns once the master has stored and verified every chunk and made
the version visible in etcd (the hand-off); the relays spread it along the
chain afterwards, without the trainer. The publish protocol itself (begin,
chunks, commit, abort) is :class:`~laminar_common.relay.publish.PublishSession`;
this module adds master resolution, retries and checksumming ahead. A rollout
calls :meth:`RelayClient.fetch`, which prefers a relay on its own host and
then maps the relay's shared memory instead of copying the bytes.

Behaviour under failure:

- The master is resolved through the coordinator (election
  ``relay-master``). A publish that fails because the master died or lost the
  election is retried on the newly elected master, with bounded jittered
  backoff, until ``publish_timeout_s``: at most the in-flight version is
  re-sent.
- Refusals (version not newer than the published one, malformed or oversized
  manifest, store full) are raised at once as the relay's error class
  (see ``relay_wire``); they are never retried.
- A fetch tries the local relay (waiting up to ``wait_s`` for a version it is
  still receiving), then the master, then the other relays. A first relay that
  does not answer a health call within ``probe_timeout_s`` (paused, cut off) is
  left out of that read, so a paused relay does not hold its readers for a call
  deadline.

Invariants: a :class:`FetchedWeights` is always a complete version whose
chunks were verified (by the relay that stored it, and by this client when the
bytes crossed a network); buffers passed to ``publish`` are read, never kept
after it returns.

Never imports torch or numpy.
"""

from __future__ import annotations

from laminar_common.errors import PublishSuperseded
from laminar_common.relay._connection import (
    FetchedWeights,
    PublishResult,
    RelayConnection,
    RelayHealth,
    RelayRef,
    TensorLike,
)
from laminar_common.relay.reader import RelayReader
from laminar_common.relay.writer import RelayPublisher

__all__ = ["RelayClient", "RelayConnection", "RelayPublisher", "RelayReader", "PublishResult",
           "PublishSuperseded", "FetchedWeights", "RelayHealth", "RelayRef", "TensorLike"]


class RelayClient(RelayPublisher, RelayReader):
    """Publishes to and fetches from the relay tier of one job.

    Args:
        coordinator: the job's coordinator, used read-only to find relays,
            the master and the latest version (the client does not register).
        address: instead of a coordinator, one relay's gRPC ``host:port``
            (used as master and as the only read source).
        client_id: names this client in relay logs and reader leases.
        host: this machine's host id (:func:`~laminar_common.net.host_identity`), to
            recognise same-host relays (default: this machine's).
        chunk_bytes: chunk size of published versions.
        rpc_timeout_s: deadline of each short control call.
        publish_timeout_s: total time a publish may take, retries included.
        failover_wait_s: after a master fails, how long to wait for another
            relay to win the election before trying the same one again.
        hash_threads: threads checksumming chunks while they are sent.
        send_timeout_s: a chunk the master does not take within this fails the
            attempt (how long a publish notices a master that died mid-send).
        use_shared_memory: map a same-host relay's memory instead of streaming.
        tls: CA (and client certificate for mutual TLS) to reach relays over TLS.
        curve: CURVE keys for the weight data plane (a publisher pushes chunks over it).
        delta_full_every: 0 publishes every version in full. K > 0 publishes a
            version as a delta against the one this client published before
            (:mod:`laminar_common.relay.delta`), with a full version every K
            versions, and also whenever the master relay changed, the layout
            changed, or the delta would be at least half the full version's
            bytes (``publish(full=True)`` asks for one). Costs one host copy of
            the published version, kept as the next delta's base.
        probe_timeout_s: before a read that may wait at its first relay, that relay
            must answer a health call within this; one that does not (paused, cut off)
            is left out of the read (where another relay is there to read from).

    Both halves: :class:`~laminar_common.relay.writer.RelayPublisher` (publish) and
    :class:`~laminar_common.relay.reader.RelayReader` (fetch), over one
    :class:`~laminar_common.relay._connection.RelayConnection`.
    """
