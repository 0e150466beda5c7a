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

    Both halves: :class:`~laminar_common.relay.writer.RelayPublisher` (publish) and
    :class:`~laminar_common.relay.reader.RelayReader` (fetch), over one
    :class:`~laminar_common.relay._connection.RelayConnection`, whose arguments it
    takes (``coordinator`` or ``address``, ``client_id``, ``host``, ``chunk_bytes``,
    timeouts, ``tls``, ``curve``, ``delta_full_every``, ...).
    """
