"""The cluster tier's lines in `kvtier status` (from `StatsDoc.cluster`; none on a single node)."""

from __future__ import annotations

from typing import Any

from kvtier.core.cluster_config import ClusterConfig


def _quantile(hist: dict[str, Any], q: float) -> str:
    """The upper bound of the bucket holding quantile q ("-" before any call; "> last bound" past it)."""
    total = sum(hist["counts"])
    if not total:
        return "-"
    running = 0
    for bound, n in zip(hist["bounds"], hist["counts"]):
        running += n
        if running >= q * total:
            return f"<= {bound * 1000:g} ms"
    return f"> {hist['bounds'][-1] * 1000:g} ms"


def cluster_lines(doc: dict[str, Any]) -> list[str]:
    if not doc:
        return []
    t = doc["cluster"]
    misses = ", ".join(f"{r} {n}" for r, n in sorted(t["misses"].items())) or "none"
    lines = [
        f"cluster    {'up' if t['up'] else 'DOWN'}  hits {doc['cluster_hits']} (local disk {doc['local_hits']})"
        f"  misses: {misses}",
        f"  moved    loaded {t['bytes_loaded'] / 2**20:.1f} MiB, stored {t['bytes_stored'] / 2**20:.1f} MiB;"
        f" written through {doc['written_through']}, promoted {doc['promoted']}, dropped {doc['dropped']},"
        f" failed {doc['background_failed']}, backlog {doc['backlog_bytes'] / 2**20:.1f} MiB",
        f"  latency  lookup p50 {_quantile(t['lookup_latency'], 0.5)} p99 {_quantile(t['lookup_latency'], 0.99)};"
        f" load p50 {_quantile(t['load_latency'], 0.5)} p99 {_quantile(t['load_latency'], 0.99)}",
    ]
    if not t["up"] and t.get("why_down"):
        lines.insert(1, f"  down     {t['why_down']}")
    return lines


def unit_warnings(cfg: ClusterConfig) -> list[str]:
    """One line per `[cluster]` endpoint the installed kvtier.service (with its drop-ins) would block; [] when the
    cluster is off, no unit is installed, or the unit allows every endpoint (kvtier.cluster.unit_check)."""
    if not cfg.enabled:
        return []
    from kvtier.cluster.unit_check import unit_blocks  # the cluster package (and torch) only for a cluster node

    return [f"warning: kvtier.service would block the cluster's {b.line()}" for b in unit_blocks(cfg)]
