"""Prometheus metrics: one HTTP endpoint per process, values read at scrape time.

A service hands :class:`MetricsServer` a ``collect`` function returning
:class:`Metric` values built from the counters it already keeps; nothing is
added to hot paths, and a scrape can never see half-updated state of a metric
family. Every metric is named ``laminar_<tier>_<name>`` and labelled with
``job`` and ``member``. ``prometheus_client`` is imported only here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from laminar_common.errors import TransportError

__all__ = ["Metric", "MetricsServer"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Metric:
    """One metric family: a single value, or values by extra label values."""

    name: str
    kind: str  # "counter" | "gauge"
    help: str
    value: float | None = None
    labels: tuple[str, ...] = ()
    values: Mapping[tuple[str, ...], float] = field(default_factory=dict)


class MetricsServer:
    """Serves ``/metrics`` for one tier process."""

    def __init__(self, tier: str, job: str, member: str,
                 collect: Callable[[], Iterable[Metric]]) -> None:
        self.tier = tier
        self.job = job
        self.member = member
        self._collect = collect
        self._server = None
        self._thread = None
        self.url: str | None = None

    def _families(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        base = ("job", "member")
        for m in self._collect():
            name = f"laminar_{self.tier}_{m.name}"
            cls = CounterMetricFamily if m.kind == "counter" else GaugeMetricFamily
            fam = cls(name, m.help, labels=base + m.labels)
            if m.value is not None:
                fam.add_metric([self.job, self.member], float(m.value))
            for label_values, value in m.values.items():
                fam.add_metric([self.job, self.member, *label_values], float(value))
            yield fam
        yield self._auth_refusals(CounterMetricFamily, base)

    def _auth_refusals(self, family, base):
        """Every tier's ZeroMQ peers refused by authentication (:func:`laminar_common.auth.refusals`)."""
        from laminar_common.auth import refusals

        fam = family(f"laminar_{self.tier}_auth_refused", "ZeroMQ peers refused by CURVE "
                     "authentication, by reason", labels=(*base, "reason"))
        for reason, value in refusals().items():
            fam.add_metric([self.job, self.member, reason], float(value))
        return fam

    def start(self, host: str = "127.0.0.1", port: int = 0, advertise: str | None = None) -> str:
        """Start the endpoint; returns its URL (port 0 picks a free one). On a wildcard
        ``host`` (every interface) the URL names ``advertise``, the address the member
        tells its peers, so that a scraper on another host can use it."""
        from prometheus_client import start_http_server
        from prometheus_client.registry import CollectorRegistry

        outer = self

        class _Collector:
            def collect(self):
                return outer._families()

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector())
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            raise TransportError(f"cannot serve metrics on {host}:{port}: {exc}") from exc
        from laminar_common.net import bracket_host, is_wildcard

        shown = advertise if advertise and is_wildcard(host) else host
        self.url = f"http://{bracket_host(shown)}:{self._server.server_port}/metrics"
        log.info("metrics at %s", self.url)
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
