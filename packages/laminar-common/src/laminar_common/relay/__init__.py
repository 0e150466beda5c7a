"""laminar_common.relay: the relay tier's client half.

Owns everything a publisher (the trainer, or your own PyTorch loop) and a
fetcher (a rollout, or your own engine) need to talk to the relay tier:

- :mod:`.client`: :class:`RelayClient` (publish a version through the master,
  fetch the latest from the nearest relay, follow the election): both halves,
  :mod:`.writer` (:class:`RelayPublisher`) and :mod:`.reader` (:class:`RelayReader`),
  over one connection core (:mod:`._connection`);
- :mod:`.publish`: the one publish session (begin, stream chunks, commit or
  abort) used by the client and by each relay's chain forwarder;
- :mod:`.wire`: gRPC status/metadata mapping, typed relay errors, manifest
  <-> protobuf, and the one place for gRPC channel options;
- :mod:`.dataplane`: the ZeroMQ chunk stream between relays and clients;
- :mod:`.manifests`: named byte buffers <-> a version's chunked, checksummed
  byte stream (pure Python, no array library);
- :mod:`.tensors`: a fetched version as torch tensors (torch imported on call);
- :mod:`.proto`: generated protobuf/gRPC code (source ``relay.proto`` ships in
  the wheel next to it).

Names below are imported on first use.
"""

from laminar_common._lazy import lazy_exports

_EXPORTS = {
    "RelayClient": "client", "PublishResult": "client", "FetchedWeights": "client",
    "RelayHealth": "client", "RelayRef": "client",
    "RelayPublisher": "writer", "RelayReader": "reader", "RelayConnection": "_connection",
    "PublishSession": "publish",
    "GRPC_OPTIONS": "wire", "RELAY_ROLE": "wire", "MASTER_ELECTION": "wire",
    "VersionConflictError": "wire", "NotMasterError": "wire", "VersionNotFoundError": "wire",
    "StoreFullError": "wire", "ChecksumError": "wire",
    "NamedBuffer": "manifests", "as_named_buffers": "manifests", "build_manifest": "manifests",
    "tensor_views": "manifests", "assemble": "manifests", "tensors_from": "tensors",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
