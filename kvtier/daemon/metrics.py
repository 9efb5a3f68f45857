"""Prometheus metrics: the backend's counters read at scrape time, plus the daemon's own request metrics.

The backend keeps the truth (its typed stats document, `kvtier.wire.stats.StatsDoc`); a custom collector turns
that document into metric families on every scrape, so nothing is counted twice and nothing drifts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.core.errors import ConfigError
from kvtier.daemon.cluster_metrics import cluster_families
from kvtier.wire.stats import StatsDoc

log = logging.getLogger(__name__)


class BackendCollector(Collector):
    """Metric families from the stats document (`kvtier.daemon.service.Daemon.stats_doc`)."""

    def __init__(self, stats: Callable[[], StatsDoc]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        try:
            doc = self._stats()
        except Exception:  # a scrape must never take the daemon down
            log.exception("stats for a metrics scrape failed")
            return
        routes = CounterMetricFamily(
            "kvtier_lookup_objects", "Objects a lookup routed, by form and route", labels=["form", "route"]
        )
        hit_rate = GaugeMetricFamily(
            "kvtier_hit_rate",
            "Share of the objects lookups needed that were served (REUSE or RECOVER), by form",
            labels=["form"],
        )
        recov = CounterMetricFamily(
            "kvtier_recoveries", "Loads of RECOVER objects into pool slots, by outcome", labels=["form", "outcome"]
        )
        recov_rate = GaugeMetricFamily(
            "kvtier_recovery_success_rate", "Share of recoveries that succeeded, by form", labels=["form"]
        )
        reasons = CounterMetricFamily("kvtier_recomputes", "RECOMPUTE routes by reason", labels=["form", "reason"])
        admission = CounterMetricFamily(
            "kvtier_admission_rejections", "Objects refused by the admission caps", labels=["form"]
        )
        latency = HistogramMetricFamily(
            "kvtier_recovery_latency_seconds", "Time to recover one batch into the pool", labels=["form"]
        )
        for form, f in sorted(doc.forms.items()):
            routes.add_metric([form, "reuse"], f.reuse)
            routes.add_metric([form, "recover"], f.recover)
            routes.add_metric([form, "recompute"], f.recompute)
            hit_rate.add_metric([form], f.hit_rate)
            ok, failed = f.recover_ok, f.recover_failed
            recov.add_metric([form, "ok"], ok)
            recov.add_metric([form, "failed"], failed)
            recov_rate.add_metric([form], ok / (ok + failed) if ok + failed else 1.0)
            for reason, n in sorted(f.recompute_reasons.items()):
                reasons.add_metric([form, reason], n)
            admission.add_metric([form], f.admission_rejections)
            if f.recovery_latency is not None:
                buckets = [(_le(le), n) for le, n in f.recovery_latency.buckets]
                latency.add_metric([form], buckets, f.recovery_latency.sum)
        yield from (routes, hit_rate, recov, recov_rate, reasons, admission, latency)

        pool = GaugeMetricFamily(
            "kvtier_pool_slots",
            "Pool slots by profile and form: capacity, occupied, and the admission quota",
            labels=["profile", "form", "state"],
        )
        for prof in doc.profiles:
            for form, p in sorted(prof.pools.items()):
                for state, n in (("slots", p.slots), ("used", p.used), ("quota", p.quota)):
                    pool.add_metric([prof.name, form, state], n)
        yield pool

        store = doc.store
        by_state = GaugeMetricFamily("kvtier_store_bytes", "Disk store bytes by record state", labels=["state"])
        for state, n in sorted(store.get("bytes_by_state", {}).items()):
            by_state.add_metric([state], int(n))
        yield by_state
        queue = GaugeMetricFamily("kvtier_persist_queue", "Sealed objects waiting to be written to the store")
        queue.add_metric([], int(store.get("persist_queue", 0)))
        yield queue

        actions = CounterMetricFamily("kvtier_verifier_actions", "Actions the verifier took", labels=["action"])
        for action, n in sorted(doc.verifier.actions.items()):
            actions.add_metric([action], n)
        yield actions
        restarts = CounterMetricFamily("kvtier_verifier_restarts", "Times the supervised verifier was restarted")
        restarts.add_metric([], doc.verifier.restarts)
        yield restarts
        yield from cluster_families(doc.cluster)


def _le(value: float | str) -> str:
    return "+Inf" if value in (None, "+Inf", float("inf")) else repr(float(value))


class Metrics:
    """The daemon's registry: backend families plus request counters; served over HTTP when an address is set."""

    def __init__(self, stats: Callable[[], StatsDoc]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(BackendCollector(stats))
        self.requests = Counter(
            "kvtier_requests", "Requests served, by op and result code", ["op", "code"], registry=self.registry
        )
        self.request_seconds = Histogram(
            "kvtier_request_seconds",
            "Time to serve one request, by op",
            ["op"],
            buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0),
            registry=self.registry,
        )
        self.connections = Gauge("kvtier_connections", "Open client connections", registry=self.registry)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def observe_request(self, op: str, seconds: float, code: str) -> None:
        self.requests.labels(op, code).inc()
        self.request_seconds.labels(op).observe(seconds)

    def serve(self, address: str) -> tuple[str, int]:
        """Start the HTTP endpoint on HOST:PORT (port 0 picks one); returns the bound address."""
        host, _, port = address.rpartition(":")
        try:
            self._server, self._thread = start_http_server(
                int(port), addr=host.strip("[]") or "127.0.0.1", registry=self.registry
            )
        except OSError as exc:
            raise ConfigError(
                f"cannot serve metrics on {address}: {exc.strerror}; pick another address or '' to disable",
                key="metrics.address",
            ) from None
        bound = self._server.server_address
        return str(bound[0]), int(bound[1])

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
