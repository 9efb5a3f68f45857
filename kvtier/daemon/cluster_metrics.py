"""Prometheus families of the cluster tier, from its stats document (`StatsDoc.cluster`, ChainStats as plain data).

Nothing is yielded on a single node (an empty document): a dashboard tells "no cluster" from "cluster down".
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

# ChainStats counters exported as kvtier_cluster_objects{event=...}
_EVENTS = ("local_hits", "cluster_hits", "queued", "dropped", "written_through", "promoted", "background_failed")


def _buckets(hist: dict[str, Any]) -> list[tuple[str, float]]:
    """The tier's per-bucket counts (one more bucket past the last bound) as Prometheus' cumulative buckets."""
    out, running = [], 0
    for bound, n in zip([*hist["bounds"], None], hist["counts"]):
        running += n
        out.append(("+Inf" if bound is None else repr(float(bound)), running))
    return out


def cluster_families(doc: dict[str, Any]) -> Iterator[Metric]:
    if not doc:
        return
    tier = doc["cluster"]
    up = GaugeMetricFamily("kvtier_cluster_up", "1 while the cluster tier answers (connected, not marked down)")
    up.add_metric([], 1 if tier["up"] else 0)
    yield up
    events = CounterMetricFamily(
        "kvtier_cluster_objects",
        "Objects through the tier chain: served locally or from the cluster, written through, promoted, dropped",
        labels=["event"],
    )
    for name in _EVENTS:
        events.add_metric([name], doc[name])
    yield events
    misses = CounterMetricFamily(
        "kvtier_cluster_misses", "Objects the cluster did not serve, by reason (docs/cluster.md)", labels=["reason"]
    )
    for reason, n in sorted(tier["misses"].items()):
        misses.add_metric([reason], n)
    yield misses
    moved = CounterMetricFamily("kvtier_cluster_bytes", "Bytes loaded from and stored to the cluster", labels=["dir"])
    moved.add_metric(["loaded"], tier["bytes_loaded"])
    moved.add_metric(["stored"], tier["bytes_stored"])
    yield moved
    backlog = GaugeMetricFamily("kvtier_cluster_backlog_bytes", "Write-through and promotion bytes queued")
    backlog.add_metric([], doc["backlog_bytes"])
    yield backlog
    latency = HistogramMetricFamily(
        "kvtier_cluster_latency_seconds", "One batched cluster call: existence lookup or load", labels=["op"]
    )
    for op in ("lookup", "load"):
        hist = tier[f"{op}_latency"]
        latency.add_metric([op], _buckets(hist), hist["sum_s"])
    yield latency
