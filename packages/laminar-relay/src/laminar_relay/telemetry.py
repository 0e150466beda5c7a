"""A relay's Prometheus metrics, read from its health reply (the same figures
``laminar status`` and the ``Health`` RPC show)."""

from __future__ import annotations

from collections.abc import Mapping

from laminar_common.metrics import Metric
from laminar_common.relay.proto import relay_pb2

__all__ = ["relay_metrics"]


def relay_metrics(h: relay_pb2.HealthReply, fetches: Mapping[str, int]) -> list[Metric]:
    """The metrics of a relay whose health is ``h``; ``fetches``: versions leased to
    readers, by reader id."""
    return [
        Metric("versions_stored", "gauge", "complete versions held", len(h.versions)),
        Metric("latest_stored_version", "gauge", "newest version held",
               max(h.versions) if h.versions else -1),
        Metric("used_bytes", "gauge", "bytes held (complete + receiving)", h.used_bytes),
        Metric("max_bytes", "gauge", "memory cap", h.max_bytes),
        Metric("readers", "gauge", "reader leases held", h.readers),
        Metric("is_master", "gauge", "1 on the master relay", int(h.master)),
        Metric("forwarded_version", "gauge", "newest version sent downstream",
               h.forwarded_version),
        Metric("rejected_total", "counter", "refused requests and frames", labels=("reason",),
               values={(k,): v for k, v in h.rejected.items()}),
        Metric("fetches_total", "counter", "versions leased to readers, by reader id",
               labels=("reader",), values={(k,): v for k, v in dict(fetches).items()}),
    ]
