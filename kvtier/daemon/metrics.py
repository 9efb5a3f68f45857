"""Prometheus metrics: the backend's counters read at scrape time, plus the daemon's own request metrics.

The backend keeps the truth (its typed stats document, `kvtier.wire.stats.StatsDoc`); a custom collector turns
that document into metric families on every scrape, so nothing is counted twice and nothing drifts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier import __version__
from kvtier.core.errors import ConfigError
from kvtier.daemon.cluster_metrics import cluster_families
from kvtier.wire.stats import StatsDoc

log = logging.getLogger(__name__)
disable_created_metrics()  # no `_created` series: Prometheus does not need them, and they double the families


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
        yield from _form_families(doc)
        yield from _pool_families(doc)
        yield from _store_families(doc)
        yield from _write_back_families(doc)
        yield from _daemon_families(doc)
        yield from cluster_families(doc.cluster)
        yield from _engine_families(doc)
        yield from _event_families(doc)


def _form_families(doc: StatsDoc) -> Iterator[Metric]:
    """Counters only: hit and success ratios are PromQL over them (docs/metrics.md), over the window you choose."""
    routes = CounterMetricFamily(
        "kvtier_lookup_objects", "Objects a lookup routed, by form and route", labels=["form", "route"]
    )
    recov = CounterMetricFamily(
        "kvtier_recoveries", "Loads of RECOVER objects into pool slots, by outcome", labels=["form", "outcome"]
    )
    reasons = CounterMetricFamily("kvtier_recomputes", "RECOMPUTE routes by reason", labels=["form", "reason"])
    admission = CounterMetricFamily(
        "kvtier_admission_rejections", "Objects refused by the admission caps", labels=["form"]
    )
    evictions = CounterMetricFamily("kvtier_evictions", "Objects evicted from the pool", labels=["form"])
    latency = HistogramMetricFamily(
        "kvtier_recovery_latency_seconds", "Time to recover one batch into the pool", labels=["form"]
    )
    for form, f in sorted(doc.forms.items()):
        for route in ("reuse", "recover", "recompute"):
            routes.add_metric([form, route], getattr(f, route))
        recov.add_metric([form, "ok"], f.recover_ok)
        recov.add_metric([form, "failed"], f.recover_failed)
        for reason, n in sorted(f.recompute_reasons.items()):
            reasons.add_metric([form, reason], n)
        admission.add_metric([form], f.admission_rejections)
        evictions.add_metric([form], f.evictions)
        if f.recovery_latency is not None:
            buckets = [(_le(le), n) for le, n in f.recovery_latency.buckets]
            latency.add_metric([form], buckets, f.recovery_latency.sum)
    yield from (routes, recov, reasons, admission, evictions, latency)


def _pool_families(doc: StatsDoc) -> Iterator[Metric]:
    """Capacity, use and quota as families of their own: one label never mixes what a slot count means."""
    labels = ["profile", "form"]
    slots = GaugeMetricFamily("kvtier_pool_slots", "Pool slots allocated at start (capacity)", labels=labels)
    used = GaugeMetricFamily("kvtier_pool_used_slots", "Pool slots holding an object or reserved", labels=labels)
    quota = GaugeMetricFamily("kvtier_pool_quota_slots", "Slots the admission quota lets one form use", labels=labels)
    size = GaugeMetricFamily("kvtier_pool_bytes", "Pool memory allocated at start", labels=labels)
    moving = GaugeMetricFamily(
        "kvtier_pool_moving_bytes", "Pool bytes not yet moved onto huge pages (MADV_COLLAPSE; 0: done)", labels=labels
    )
    for prof in doc.profiles:
        for form, p in sorted(prof.pools.items()):
            values = ((slots, p.slots), (used, p.used), (quota, p.quota), (size, p.bytes), (moving, p.moving_bytes))
            for family, value in values:
                family.add_metric([prof.name, form], value)
    yield from (slots, used, quota, size, moving)


def _store_families(doc: StatsDoc) -> Iterator[Metric]:
    store = doc.store
    by_state = GaugeMetricFamily("kvtier_store_bytes", "Disk store bytes by record state", labels=["state"])
    for state, n in sorted(store.get("bytes_by_state", {}).items()):
        by_state.add_metric([state], int(n))
    budget = GaugeMetricFamily("kvtier_store_budget_bytes", "The store's byte budget (0: none)")
    budget.add_metric([], int(store.get("budget_bytes") or 0))
    queue = GaugeMetricFamily("kvtier_persist_queue_objects", "Sealed objects waiting to be written to the store")
    queue.add_metric([], int(store.get("persist_queue", 0)))
    pins = GaugeMetricFamily("kvtier_prewarm_pins", "Prewarmed prefixes whose pins have not expired")
    pins.add_metric([], doc.prewarm_pins)
    actions = CounterMetricFamily("kvtier_verifier_actions", "Actions the verifier took", labels=["action"])
    for action, n in sorted(doc.verifier.actions.items()):
        actions.add_metric([action], n)
    restarts = CounterMetricFamily("kvtier_verifier_restarts", "Times the supervised verifier was restarted")
    restarts.add_metric([], doc.verifier.restarts)
    yield from (by_state, budget, queue, pins, actions, restarts)


def _write_back_families(doc: StatsDoc) -> Iterator[Metric]:
    """The write-back per form: what waits, what is stuck behind a refusal (quota, budget, disk error)."""
    labels = ["profile", "form"]
    backlog = GaugeMetricFamily(
        "kvtier_write_back_backlog_objects", "Sealed objects not yet in the store, by form", labels=labels
    )
    stuck = GaugeMetricFamily(
        "kvtier_write_back_stuck_objects", "Sealed objects of a form the store refused last pass", labels=labels
    )
    waiting: dict[str, dict[str, int]] = doc.store.get("write_back_backlog", {})
    refused: dict[str, dict[str, int]] = doc.store.get("write_back_stuck", {})
    for profile in sorted({*waiting, *refused}):
        forms = {*waiting.get(profile, {}), *refused.get(profile, {})}
        for form in sorted(forms):
            backlog.add_metric([profile, form], waiting.get(profile, {}).get(form, 0))
            stuck.add_metric([profile, form], refused.get(profile, {}).get(form, 0))
    failed = CounterMetricFamily(
        "kvtier_write_back_failed_passes", "Write-back passes in which the store refused a form"
    )
    failed.add_metric([], int(doc.store.get("failed_passes", 0)))
    deferred = CounterMetricFamily(
        "kvtier_write_back_deferred_seconds",
        "Time the write-back's batches waited for a stream of durable offloads to pause",
    )
    deferred.add_metric([], float(doc.store.get("write_back_deferred_s", 0.0)))
    yield from (backlog, stuck, failed, deferred)


def _daemon_families(doc: StatsDoc) -> Iterator[Metric]:
    healthy = GaugeMetricFamily("kvtier_healthy", "1 when the daemon is healthy (kvtier status: health ok), else 0")
    healthy.add_metric([], 1 if doc.daemon is not None and doc.daemon.health == "ok" else 0)
    info = GaugeMetricFamily("kvtier_build_info", "The running kvtier version (value 1)", labels=["version"])
    info.add_metric([__version__], 1)
    yield from (healthy, info)


def _engine_families(doc: StatsDoc) -> Iterator[Metric]:
    """The engines' tier ops per namespace (vLLM's, SGLang's): label values bounded by
    `kvtier.daemon.tier_stats.MAX_NAMESPACES` namespaces (the rest summed as "other") and three engines."""
    labels = ["namespace", "engine"]
    lookups = CounterMetricFamily(
        "kvtier_engine_lookup_objects",
        "Objects an engine's tier asked the store about, by namespace, engine and answer (hit or miss)",
        labels=[*labels, "result"],
    )
    loads = CounterMetricFamily(
        "kvtier_engine_load_objects",
        "Objects an engine's tier loaded, by namespace, engine and outcome (ok or failed)",
        labels=[*labels, "outcome"],
    )
    loaded = CounterMetricFamily(
        "kvtier_engine_loaded_bytes", "Payload bytes loaded for an engine's tier, by namespace", labels=labels
    )
    stores = CounterMetricFamily(
        "kvtier_engine_stored_objects",
        "Objects an engine's tier stored through the daemon, by namespace",
        labels=labels,
    )
    stored = CounterMetricFamily(
        "kvtier_engine_stored_bytes", "Payload bytes an engine's tier stored through the daemon", labels=labels
    )
    conns = GaugeMetricFamily("kvtier_engine_connections", "Engine tier connections open, by namespace", labels=labels)
    for e in doc.engines:
        at = [e.namespace, e.engine]
        lookups.add_metric([*at, "hit"], e.hits)
        lookups.add_metric([*at, "miss"], e.lookups - e.hits)
        loads.add_metric([*at, "ok"], e.loads)
        loads.add_metric([*at, "failed"], e.load_failures)
        loaded.add_metric(at, e.bytes_loaded)
        stores.add_metric(at, e.stores)
        stored.add_metric(at, e.bytes_stored)
        conns.add_metric(at, e.connections)
    yield from (lookups, loads, loaded, stores, stored, conns)


def _event_families(doc: StatsDoc) -> Iterator[Metric]:
    """The KV-events publisher: objects announced and dropped (absent while [events] is off)."""
    ev = doc.events
    if ev is None:
        return
    sent = CounterMetricFamily(
        "kvtier_kv_event_objects", "Blocks announced as KV events, by change (stored, removed)", labels=["change"]
    )
    sent.add_metric(["stored"], ev.stored)
    sent.add_metric(["removed"], ev.removed)
    dropped = CounterMetricFamily(
        "kvtier_kv_event_dropped_objects", "Block events dropped because the publisher's queue was full"
    )
    dropped.add_metric([], ev.dropped)
    yield from (sent, dropped)


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
