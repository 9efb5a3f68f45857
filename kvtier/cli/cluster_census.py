"""The cluster part of `kvtier audit --cluster` (kvtier.cluster.census): run it from the daemon's config, render it."""

from __future__ import annotations

from kvtier.cluster.census import ClusterAuditReport, audit_cluster
from kvtier.core.config import load_config
from kvtier.core.errors import ConfigError
from kvtier.store import DiskStore


def run_cluster_audit(config_path: str | None, store: DiskStore, sample: int) -> ClusterAuditReport:
    """Audit the cluster the daemon's config (`[cluster]`) names; ConfigError where that config has none."""
    cfg = load_config(config_path).cluster
    if not cfg.enabled:
        raise ConfigError("--cluster needs a config whose [cluster] is enabled (pass the daemon's --config)")
    return audit_cluster(cfg, store, sample)


def render_cluster(report: ClusterAuditReport) -> str:
    """The human form: source, one row per namespace and form, then the sample's verdicts."""
    lines = [f"cluster      keys from {report.source}; {report.other_keys} other keys"]
    rows = [("namespace", "form", "objects", "absent")]
    for ns, forms in sorted(report.counts.items()):
        for form, t in sorted(forms.items(), key=lambda kv: kv[0].value):
            rows.append((ns.hex()[:16], form.value, str(t.objects), str(t.absent)))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        lines.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    verdicts = ", ".join(f"{k} {v}" for k, v in sorted(report.verdicts.items())) or "nothing to sample"
    lines.append(f"sampled      {report.sampled} objects fetched and verified: {verdicts}")
    return "\n".join(lines)
