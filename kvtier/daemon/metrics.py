"""Prometheus metrics: the backend's counters read at scrape time, plus the daemon's own request metrics.

The backend keeps the truth (its `stats()` document); a custom collector turns that document into
metric families on every scrape, so nothing is counted twice and nothing drifts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.daemon.errors import ConfigError

log = logging.getLogger(__name__)


class BackendCollector(Collector):
    """Metric families from a stats document (see `kvtier.daemon.backend.Backend.stats_doc`)."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        try:
            doc = self._stats()
        except Exception:  # a scrape must never take the daemon down
            log.exception("stats for a metrics scrape failed")
            return
        forms: dict[str, Any] = doc.get("forms", {})
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
        for form, f in sorted(forms.items()):
            reuse, recover, recompute = (int(f.get(k, 0)) for k in ("reuse", "recover", "recompute"))
            routes.add_metric([form, "reuse"], reuse)
            routes.add_metric([form, "recover"], recover)
            routes.add_metric([form, "recompute"], recompute)
            needed = reuse + recover + recompute - int(f.get("recompute_reasons", {}).get("outside_window", 0))
            hit_rate.add_metric([form], (reuse + recover) / needed if needed else 0.0)
            ok, failed = int(f.get("recover_ok", 0)), int(f.get("recover_failed", 0))
            recov.add_metric([form, "ok"], ok)
            recov.add_metric([form, "failed"], failed)
            recov_rate.add_metric([form], ok / (ok + failed) if ok + failed else 1.0)
            for reason, n in sorted(f.get("recompute_reasons", {}).items()):
                reasons.add_metric([form, reason], int(n))
            admission.add_metric([form], int(f.get("admission_rejections", 0)))
            hist = f.get("recovery_latency")
            if hist:
                buckets = [(_le(le), int(n)) for le, n in hist["buckets"]]
                latency.add_metric([form], buckets, float(hist.get("sum", 0.0)))
        yield from (routes, hit_rate, recov, recov_rate, reasons, admission, latency)

        pool = GaugeMetricFamily(
            "kvtier_pool_slots",
            "Pool slots by profile and form: capacity, occupied, and the admission quota",
            labels=["profile", "form", "state"],
        )
        for prof in doc.get("profiles", []):
            for form, p in sorted(prof.get("pools", {}).items()):
                for state in ("slots", "used", "quota"):
                    pool.add_metric([prof["name"], form, state], int(p.get(state, 0)))
        yield pool

        store = doc.get("store", {})
        by_state = GaugeMetricFamily("kvtier_store_bytes", "Disk store bytes by record state", labels=["state"])
        for state, n in sorted(store.get("bytes_by_state", {}).items()):
            by_state.add_metric([state], int(n))
        yield by_state
        queue = GaugeMetricFamily("kvtier_persist_queue", "Sealed objects waiting to be written to the store")
        queue.add_metric([], int(store.get("persist_queue", 0)))
        yield queue

        verifier = doc.get("verifier", {})
        actions = CounterMetricFamily("kvtier_verifier_actions", "Actions the verifier took", labels=["action"])
        for action, n in sorted(verifier.get("actions", {}).items()):
            actions.add_metric([action], int(n))
        yield actions
        restarts = CounterMetricFamily("kvtier_verifier_restarts", "Times the supervised verifier was restarted")
        restarts.add_metric([], int(verifier.get("restarts", 0)))
        yield restarts


def _le(value: Any) -> str:
    return "+Inf" if value in (None, "+Inf", float("inf")) else repr(float(value))


class Metrics:
    """The daemon's registry: backend families plus request counters; served over HTTP when an address is set."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
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
